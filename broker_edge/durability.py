"""Group commit: publishes are appended on the event loop, made durable in a commit thread.

Theory of operation
-------------------
``append`` (event-loop thread) buffers a record in the journal writer. One commit thread loops:
it drains everything buffered so far into one frame, encodes, writes and syncs it, reports the
new durable seq to the event loop, and at once drains again. So one sync covers every publish
that arrived while the previous one ran, and the next frame's write and sync start as soon as
the previous sync returns, without waiting for the event loop (which may be busy routing a big
read) to notice the commit and hand the next frame over. Never more than one frame is in flight.
An idle thread is woken by a callback the first append schedules on the loop, so it runs once
the reads of that loop iteration are handled and their records go out in one frame.

When the loop is saturated (the report of the previous commit has not run when the next commit
finishes), draining at once would only make frames smaller and acknowledgements more frequent,
each a write to every publisher: CPU the saturated loop does not have (a fan-in of 100 QoS 1
publishers ran ~20 % slower that way). The thread then waits for that report, which wakes it.

Disk trouble never leaves a publisher waiting (issue 9). A frame whose write or sync fails is
handed to the loop (``_report_failure``), which drops it and every record buffered after it
(their seqs are given out again), refuses their publishers (MQTT 5: reason 0x80; 3.1.1: the
connection is closed) and refuses new publishes until the thread, retrying every second, has
cut the journal back to its last durable frame and written and synced a frame again. The disk
budget (``journal_max_bytes``, ``journal_min_free_bytes``) is checked after every commit and
every second; over it, publishes are refused with 0x97 until retention (segments the lake has
committed, older than ``journal_retention_hours``) frees space. ``on_state`` tells the broker.

Retention also keeps what the mesh's peers have not acknowledged (the journal is their
replication log, broker_edge.mesh: an origin that restarts rebuilds each peer's unacknowledged
messages from it): ``peer_acked`` (per peer node, the seq at or below which it acknowledged all
it was due; set on the loop by the mesh) holds back every segment with a record after the lowest
(a peer away longer than ``edge.peer_expiry_hours`` is not in it: broker_edge.mesh, "Peers gone
for good").
Chosen where the issues are silent: one peer away for long must not fill the disk forever, so
the disk budget wins. While the journal is over its budget and a segment the lake committed (and
old enough) is held only for peers, the oldest such segments go, one at a time until it is under
budget with a segment to spare (so the edge keeps taking publishes, each peer away keeping the
newest records that fit), and ``on_peer_dropped(node, first, last)`` tells the loop, for each
peer that had not acknowledged them, the seqs it gives up (the mesh drops them for that peer and
logs ``peer_dropped`` in the operator's ``$log``). The lake's commit and the age rule still
hold: a segment the lake has not committed is never removed, for the budget or anything else.

The thread only *reports*: ``call_soon_threadsafe`` schedules at most one report at a time, and
the report reads the newest durable seq when it runs, so several commits finished while the loop
was busy cost it one wakeup. The report releases every waiter whose seq is now durable (it
queues the PUBACK/PUBREC: a QoS 1/2 publish is acknowledged only after its record is durable)
and then runs ``on_commit`` (the broker flushes its connections).

``append`` and the thread's ``drain`` share one lock: the writer assigns a seq and extends its
buffer in two steps, and a drain between them would take a record without its seq. The lock is
uncontended almost always (the thread holds it only to swap the buffer out).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ingest.journal import JournalWriteError, JournalWriter, list_segments

log = logging.getLogger(__name__)

# The commit thread wakes at least this often (seconds) to apply retention and the disk budget.
MAINTENANCE_INTERVAL = 1.0
# After a failed write or sync, the thread retries this often (seconds) until one succeeds.
RETRY_INTERVAL = 1.0

# MQTT 5 reason codes that refuse a publish the journal cannot take [MQTT-3.4.2.1].
UNSPECIFIED_ERROR = 0x80
QUOTA_EXCEEDED = 0x97


@dataclass(frozen=True, slots=True)
class JournalStatus:
    """Whether the journal takes publishes: ``state`` is "ok", "full" (over its disk budget:
    ``full`` says which) or "error" (writes fail: ``error`` says why; wins over full)."""

    state: str = "ok"
    full: str = ""
    error: str = ""

    @property
    def reason_code(self) -> int:
        if self.state == "error":
            return UNSPECIFIED_ERROR
        return QUOTA_EXCEEDED if self.state == "full" else 0


class GroupCommitter:
    def __init__(
        self,
        writer: JournalWriter,
        *,
        max_bytes: int = 0,
        min_free_bytes: int = 0,
        retention_seconds: float = 0.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._writer = writer
        # Runs after each report released its waiters (the broker flushes its connections).
        self.on_commit: Callable[[], None] = _noop
        # Runs on the loop when the journal starts or stops refusing (see ``refusing``).
        self.on_state: Callable[[JournalStatus], None] = _ignore_status
        self._waiters: deque[tuple[int, Callable[[], None], Callable[[], None] | None]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = True  # the thread found nothing to drain and waits (guarded by _lock)
        self._kick_scheduled = False  # a _kick is due on the loop (loop thread only)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future[None] | None = None
        # Written by the thread, read by the report on the loop.
        self._committed_seq = writer.next_seq - 1
        self._report_scheduled = False
        # Disk budget and retention (the thread applies them).
        self._max_bytes = max_bytes
        self._min_free = min_free_bytes
        self._retention = retention_seconds
        self._wall_clock = wall_clock
        self._full_limit: str | None = None  # the limit reached, the thread's view
        self._failure_handled = threading.Event()  # the loop dropped the failed records
        self._retry = threading.Event()  # set only to cut a retry wait short (close)
        # What the pipeline has committed of this node (set on the loop from $control).
        self.lake_committed_seq = 0
        # Per mesh peer, the seq at or below which it acknowledged everything (set on the loop,
        # a new dict each time; retention keeps what follows the lowest). Runs on the loop with
        # the seqs a full journal gave up for a peer: (node, first, last).
        self.peer_acked: dict[str, int] = {}
        self.on_peer_dropped: Callable[[str, int, int], None] = _ignore_drop
        self._peer_dropped_upto: dict[str, int] = {}  # the thread's: reported up to here
        # Written by the thread for $SYS.
        self.bytes_on_disk = writer.bytes_on_disk
        self.free_bytes = -1
        self.segments_removed = 0
        # The event loop's view: every seq up to this one is durable and its waiters ran.
        self.durable_seq = writer.next_seq - 1
        self.status = JournalStatus()
        self.failure: BaseException | None = None
        self.closed = False

    @property
    def backlog(self) -> int:
        """Records appended and not yet known durable on the loop."""
        return self._writer.next_seq - 1 - self.durable_seq

    @property
    def appended_seq(self) -> int:
        return self._writer.next_seq - 1

    @property
    def refusing(self) -> int:
        """0 while publishes may be taken; else the MQTT 5 reason code that refuses them:
        0x80 while the journal fails, 0x97 while it is full (loop thread)."""
        return self.status.reason_code

    def append(
        self,
        ts_us: int,
        tenant: str,
        client_id: str,
        topic: str,
        qos: int,
        retain: bool,
        payload: bytes,
        content_type: str | None,
        user_properties: tuple[tuple[str, str], ...],
        /,
    ) -> int:
        with self._lock:
            seq = self._writer.append(
                ts_us, tenant, client_id, topic, qos, retain, payload, content_type, user_properties
            )
        # Read after the locked append: if the thread went idle before it, this sees so.
        if self._idle and not self._kick_scheduled and self._loop is not None:
            self._kick_soon(self._loop)
        return seq

    def _kick_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        # Wake the thread once this loop iteration's reads are handled, not at this first
        # record of the first read: a frame then holds whole reads, and the thread does not
        # preempt the loop mid-read to commit one record.
        self._kick_scheduled = True
        loop.call_soon(self._kick)

    def append_run(
        self,
        ts_us: int,
        tenant: str,
        client_id: str,
        topic: str,
        qos: int,
        payloads: list[bytes],
        /,
    ) -> int:
        """A run of records, one per payload (``JournalWriter.append_run``); the first one's
        seq."""
        with self._lock:
            seq = self._writer.append_run(ts_us, tenant, client_id, topic, qos, payloads)
        if self._idle and not self._kick_scheduled and self._loop is not None:
            self._kick_soon(self._loop)  # as append
        return seq

    def _kick(self) -> None:
        self._kick_scheduled = False
        with self._lock:
            if self._idle:
                self._idle = False
                self._wake.set()

    def after_durable(
        self, seq: int, callback: Callable[[], None], refused: Callable[[], None] | None = None
    ) -> None:
        """``callback`` once ``seq`` is durable; ``refused`` instead if its frame failed."""
        if seq <= self.durable_seq:
            callback()
        else:
            self._waiters.append((seq, callback, refused))

    def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        self._thread = threading.Thread(target=self._commit_loop, name="journal", daemon=True)
        self._thread.start()
        self._kick()  # records appended before start (restoring state may publish)

    # -- commit thread -----------------------------------------------------------------------

    def _commit_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            self._commit_until_stopped(loop)
        except BaseException as exc:  # handed to the loop, which refuses publishes from now on
            loop.call_soon_threadsafe(self._thread_failed, exc)
        else:
            loop.call_soon_threadsafe(self._thread_done)

    def _commit_until_stopped(self, loop: asyncio.AbstractEventLoop) -> None:
        writer = self._writer
        lock = self._lock
        wake = self._wake
        while True:
            # Also wakes every second when idle: retention and the disk budget are applied
            # while nothing is published (that is when a full journal waits for them).
            wake.wait(MAINTENANCE_INTERVAL)
            wake.clear()
            self._maintain(loop)
            while True:
                with lock:
                    frame = writer.drain()
                    if frame is None:
                        self._idle = True
                        break
                try:
                    self._committed_seq = writer.commit(frame)
                except JournalWriteError as exc:
                    self._fail_and_retry(loop, exc)
                    if self._stopping:
                        return
                    continue
                with lock:
                    lagging = self._report_scheduled
                    if lagging:
                        # The loop has not run the previous report yet: it is saturated. Wait
                        # for that report (it covers this commit too) to wake us, so the next
                        # frame is bigger and acknowledgements go out in fewer writes.
                        self._idle = True
                    else:
                        self._report_scheduled = True
                if not lagging:
                    loop.call_soon_threadsafe(self._report)
                # After the report is on its way: the acknowledgements do not wait for statfs.
                self._check_space(loop)
                if lagging:
                    break
            if self._stopping:
                return

    def _maintain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Retention (segments the lake has committed and no peer waits for), then the disk
        budget (which wins over the peers: see the theory of operation)."""
        committed = self.lake_committed_seq
        if committed > 0:
            peer_acked = self.peer_acked  # one read: the loop replaces it whole
            kept_for = min(peer_acked.values(), default=committed)
            self._remove(min(committed, kept_for), None)
            if kept_for < committed:
                # With a segment to spare: the records that follow (a removal's own log event,
                # the next publishes) do not put the journal over its budget again at once.
                spare = self._writer.segment_bytes
                while self._over_budget(spare)[0] is not None:
                    last = self._remove(committed, 1)
                    if last is None:
                        break
                    self._gave_up(loop, peer_acked, last)
        self._check_space(loop)

    def _remove(self, upto: int, count: int | None) -> int | None:
        """Remove (at most ``count``) sealed segments old enough with every record at or below
        ``upto``; the last seq removed, or None when none was."""
        try:
            removed = self._writer.remove_committed(
                upto, self._retention, self._wall_clock(), count
            )
        except OSError as exc:
            log.warning("journal retention: %s", exc)
            return None
        if not removed:
            return None
        self.segments_removed += len(removed)
        last = list_segments(self._writer.node_dir)[0][0] - 1  # the active one is left
        log.info(
            "journal retention: removed %d segment(s) up to seq %d (%s..%s)",
            len(removed),
            last,
            removed[0].name,
            removed[-1].name,
        )
        return last

    def _gave_up(
        self, loop: asyncio.AbstractEventLoop, peer_acked: dict[str, int], last: int
    ) -> None:
        """The budget removed records up to ``last``: tell the loop what each peer lost."""
        reported = self._peer_dropped_upto
        for node, acked in sorted(peer_acked.items()):
            first = max(acked, reported.get(node, 0)) + 1
            if first <= last:
                reported[node] = last
                log.warning(
                    "journal over its budget: seqs %d..%d removed, peer %s had not acknowledged",
                    first,
                    last,
                    node,
                )
                loop.call_soon_threadsafe(self.on_peer_dropped, node, first, last)

    def _over_budget(self, spare: int = 0) -> tuple[str | None, str | None]:
        """The budget limit the journal reached now, or would with ``spare`` bytes more (and
        why), or (None, None)."""
        used = self.bytes_on_disk = self._writer.bytes_on_disk
        if self._max_bytes and used + spare >= self._max_bytes:
            return "journal_max_bytes", (
                f"journal holds {used} bytes, journal_max_bytes is {self._max_bytes}"
            )
        if self._min_free:
            try:
                self.free_bytes = free = self._writer.free_bytes()
            except OSError as exc:
                log.warning("journal free space unknown: %s", exc)
                free = self._min_free
            if free - spare < self._min_free:
                return "journal_min_free_bytes", (
                    f"{free} bytes free, journal_min_free_bytes is {self._min_free}"
                )
        return None, None

    def _check_space(self, loop: asyncio.AbstractEventLoop) -> None:
        limit, reason = self._over_budget()
        if limit != self._full_limit:  # reported when the limit reached changes, not the bytes
            self._full_limit = limit
            loop.call_soon_threadsafe(self._set_full, reason, self.bytes_on_disk, self.free_bytes)

    def _fail_and_retry(self, loop: asyncio.AbstractEventLoop, exc: BaseException) -> None:
        """A frame failed: have the loop refuse its publishes, then retry every second until a
        write and sync succeed (or the committer closes)."""
        writer = self._writer
        while True:
            self._failure_handled.clear()
            loop.call_soon_threadsafe(self._report_failure, exc)
            self._failure_handled.wait()  # the loop dropped the buffered records
            if self._stopping:
                return
            self._retry.wait(RETRY_INTERVAL)
            if self._stopping:
                return
            self._maintain(loop)  # retention may be what frees the disk
            try:
                writer.recover()
                with self._lock:
                    frame = writer.drain()  # the journal_error event at least (broker)
                if frame is not None:
                    self._committed_seq = writer.commit(frame)
            except (OSError, JournalWriteError) as err:
                exc = err
                continue
            log.warning("journal writes again from seq %d", writer.next_seq)
            with self._lock:
                self._report_scheduled = True
            loop.call_soon_threadsafe(self._report)
            loop.call_soon_threadsafe(self._recovered)
            self._check_space(loop)
            return

    # -- event loop --------------------------------------------------------------------------

    def _report(self) -> None:
        # Cleared before reading the seq: a commit finishing after this line schedules a new
        # report, one finishing before it is included in this one.
        with self._lock:
            self._report_scheduled = False
        durable = self._committed_seq
        if durable > self.durable_seq:
            self.durable_seq = durable
            waiters = self._waiters
            while waiters and waiters[0][0] <= durable:
                waiters.popleft()[1]()
            self.on_commit()
        self._kick()  # a thread that waited for this report commits what came meanwhile

    def _refuse_waiters(self) -> None:
        waiters, self._waiters = self._waiters, deque()
        for _, _, refused in waiters:
            if refused is not None:
                refused()

    def _report_failure(self, exc: BaseException) -> None:
        """The thread could not write a frame: its records, and every record buffered after
        it, are dropped (their publishers refused), and publishes are refused until a retry
        succeeds. Runs on the loop, where records are appended, so none slips in between."""
        self._report()  # what was durable before the failure is acknowledged
        with self._lock:
            dropped = self._writer.discard_buffered()
        self._refuse_waiters()
        first = self.status.state != "error"
        self.status = dataclasses.replace(self.status, state="error", error=str(exc))
        if first:
            log.error("journal failing, publishes refused (%d record(s) dropped): %s", dropped, exc)
        try:
            self.on_state(self.status)
            self.on_commit()  # the refusals go out now
        finally:
            self._failure_handled.set()

    def _recovered(self) -> None:
        log.warning("journal recovered at seq %d: taking publishes again", self.durable_seq)
        full = self.status.full
        self.status = JournalStatus(state="full" if full else "ok", full=full)
        self.on_state(self.status)

    def _set_full(self, reason: str | None, used: int, free: int) -> None:
        state = self.status.state
        if state != "error":
            state = "full" if reason else "ok"
        if reason:
            log.warning("journal full, publishes refused: %s", reason)
        elif self.status.full:
            log.info("journal below its budget again (%d bytes, %d free)", used, free)
        self.status = dataclasses.replace(self.status, state=state, full=reason or "")
        self.on_state(self.status)

    def _thread_done(self) -> None:
        try:
            self._report()
        finally:  # close() waits for this, whatever the last report did
            if self._stopped is not None and not self._stopped.done():
                self._stopped.set_result(None)

    def _thread_failed(self, exc: BaseException) -> None:
        # Our bug, not the disk's: nothing after the last durable seq may be acknowledged, and
        # nothing more is committed. Refuse publishes (never leave them hanging) and say so.
        log.critical("journal commit thread failed: %s", exc, exc_info=exc)
        self.failure = exc
        try:
            self._report()
            self._refuse_waiters()
            self.status = dataclasses.replace(self.status, state="error", error=repr(exc))
            self.on_state(self.status)
            self.on_commit()
        finally:
            if self._stopped is not None and not self._stopped.done():
                self._stopped.set_exception(exc)

    async def close(self) -> None:
        """Commit what is buffered, then stop the thread and close the journal. Records
        appended after this returns are never committed (``closed`` tells the node)."""
        self._stopping = True
        self._wake.set()
        self._retry.set()
        self._failure_handled.set()
        try:
            if self._stopped is not None:
                await self._stopped
            # Appended while the thread was finishing (closing connections log their
            # disconnect): commit those here.
            frame = self._writer.drain()  # on the loop, where append runs: no race
            if frame is not None and self._writer.failed is None:
                loop = asyncio.get_running_loop()
                try:
                    self._committed_seq = await loop.run_in_executor(
                        None, self._writer.commit, frame
                    )
                except JournalWriteError as exc:
                    log.warning("journal: last %d record(s) not written: %s", frame.count, exc)
                self._report()
            self._refuse_waiters()
        finally:
            if self._thread is not None:
                self._thread.join()
            self.closed = True
            self._writer.close()


def _noop() -> None:
    pass


def _ignore_status(status: JournalStatus) -> None:
    pass


def _ignore_drop(node: str, first: int, last: int) -> None:
    pass
