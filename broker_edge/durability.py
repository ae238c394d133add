"""Group commit: publishes are appended on the event loop and made durable in frames.

Theory of operation
-------------------
Syncs on the loop (Linux, the default). ``append`` buffers a record in the journal writer; once
the reads of that loop iteration are handled, the loop drains the buffer into one frame, writes
it (a copy into the page cache) and starts its fdatasync with Linux AIO (ingest.aiosync). The
kernel signals an eventfd the loop watches when the sync is done; the loop then marks the frame
durable, acknowledges its publishes and at once writes the next frame from what arrived
meanwhile. One frame is in flight at a time. Nothing waits for the GIL on the way: a sync in a
Python thread took ~580 µs under load where the disk needed ~200 (the thread waited for the loop
to let go of the GIL after every sync), and the edge did 73k TLS QoS 1 msgs/s against 88k.

The commit thread keeps what must not block the loop: a frame that starts a segment (a file and
a directory to create and sync) is handed to it, and so are a failed frame's retries; it hands
the commits back to the loop as soon as it has committed one (``_thread_turn``). Each segment
after the first is a *spare* written ahead by the loop's executor (``JournalWriter.
prepare_spare``): frames written over zeros sync without the file's size, one disk write fewer
per sync; a spare is not written when it would take the journal near its disk budget.

Without AIO (another OS, a kernel without it, a journal without fsync, or a test's fault
injecting file layer) the commit thread does every commit as follows.

The commit thread. ``append`` (event-loop thread) buffers a record in the journal writer. One
commit thread loops:
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
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ingest.aiosync import AioSync
from ingest.journal import OS_FILES, JournalWriteError, JournalWriter, PendingFrame, list_segments

log = logging.getLogger(__name__)

# The commit thread wakes at least this often (seconds) to apply retention and the disk budget.
MAINTENANCE_INTERVAL = 1.0
# After a failed write or sync, the thread retries this often (seconds) until one succeeds.
RETRY_INTERVAL = 1.0

# A spare segment the budget or the disk refused is tried again this often (seconds).
SPARE_RETRY_INTERVAL = 10.0

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


class Syncer(Protocol):
    """What the committer needs of :class:`ingest.aiosync.AioSync` (tests give a fake)."""

    def fileno(self) -> int: ...
    def submit(self, fd: int) -> None: ...
    def reap(self) -> list[int]: ...
    def close(self) -> None: ...


class GroupCommitter:
    def __init__(
        self,
        writer: JournalWriter,
        *,
        max_bytes: int = 0,
        min_free_bytes: int = 0,
        retention_seconds: float = 0.0,
        wall_clock: Callable[[], float] = time.time,
        syncer: Callable[[], Syncer | None] = AioSync.open,
    ) -> None:
        self._writer = writer
        # Syncs that complete on the loop (see "Syncs on the loop"), made in start(): only for
        # a journal that syncs through the real file layer (tests that inject faults into it
        # get the thread, where every call goes through that layer).
        self._make_syncer = syncer
        self._syncer: Syncer | None = None
        self._syncing: PendingFrame | None = None  # the frame whose sync is in flight (loop)
        self._sync_settled: asyncio.Future[None] | None = None  # close() waits for that sync
        self._thread_turn = True  # the thread may drain and commit (guarded by _lock)
        self._handed_failure: JournalWriteError | None = None  # a loop commit's, for the thread
        self._spare_job: asyncio.Future[bool] | None = None  # writing the next segment ahead
        self._spare_after = 0.0  # loop time before which no spare is tried (after a no)
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
        self._full_limit: str | None = None  # the limit reached (guarded by _lock)
        self._full_reason: str | None = None  # why (guarded by _lock; read by _set_full)
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
        # Frames committed on the loop (syncer) and in the thread, for $SYS and tests.
        self.loop_commits = 0
        self.thread_commits = 0
        # The event loop's view: every seq up to this one is durable and its waiters ran.
        self.durable_seq = writer.next_seq - 1
        self.status = JournalStatus()
        self.failure: BaseException | None = None
        self.closed = False

    @property
    def sync_mode(self) -> str:
        """ "loop" while syncs complete on the event loop, else "thread"."""
        return "loop" if self._syncer is not None else "thread"

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
            if not self._idle or self.failure is not None:
                return
            self._idle = False
            if self._syncer is None or self._stopping or self._writer.needs_roll:
                # The thread commits: there is no syncer, the committer closes, or the frame
                # starts a segment (a file and a directory to create and sync: not on the loop).
                self._thread_turn = True
                self._wake.set()
                return
        self._commit_on_loop(self._syncer)

    # -- syncs on the loop ---------------------------------------------------------------------

    def _commit_on_loop(self, syncer: Syncer) -> None:
        """Drain, encode and write a frame here, and start its sync: it ends in _synced."""
        writer = self._writer
        with self._lock:
            frame = writer.drain()
            if frame is None:
                self._idle = True
                return
        try:
            fd = writer.write(frame)
        except JournalWriteError as exc:
            self._hand_failure(exc)
            return
        try:
            syncer.submit(fd)
        except OSError as exc:
            # The kernel would not (this filesystem, a full context): sync this frame here, once,
            # and commit in the thread from now on.
            log.warning("journal: asynchronous fdatasync refused (%s); syncing in a thread", exc)
            self._stop_syncer()
            try:
                self._committed_seq = writer.sync(frame)
            except JournalWriteError as err:
                self._hand_failure(err)
                return
            self._after_loop_commit()
            return
        self._syncing = frame

    def _synced(self) -> None:
        """The syncer's descriptor is readable: the frame in flight is durable, or failed."""
        assert self._syncer is not None
        results = self._syncer.reap()
        frame = self._syncing
        if not results or frame is None:
            return
        self._syncing = None
        try:
            if results[-1] < 0:
                err = -results[-1]
                raise self._writer.sync_failed(frame, OSError(err, os.strerror(err)))
            self._committed_seq = self._writer.durable(frame)
        except JournalWriteError as exc:
            self._hand_failure(exc)
        else:
            self._after_loop_commit()
        finally:
            if self._sync_settled is not None and not self._sync_settled.done():
                self._sync_settled.set_result(None)

    def _after_loop_commit(self) -> None:
        self.loop_commits += 1
        with self._lock:
            self._idle = True
        self._check_space(_call_now)
        self._report()  # acknowledges, then _kick: the next frame

    def _hand_failure(self, exc: JournalWriteError) -> None:
        """A loop commit failed: the thread owns the writer until it recovered (_idle stays
        False meanwhile, so the loop commits nothing)."""
        with self._lock:
            self._thread_turn = True
            self._handed_failure = exc
        self._wake.set()

    def _prepare_spare(self) -> None:
        """Have a thread of the loop's executor write the next segment ahead (a spare: zeros
        overwritten in place sync without the file's size, one disk write fewer per sync),
        unless that would take the journal near its disk budget."""
        writer, loop = self._writer, self._loop
        if loop is None or self._stopping or loop.time() < self._spare_after:
            return
        size = writer.spare_size() + writer.segment_bytes  # the spare, and room to fill it
        try:
            too_big = (self._max_bytes and writer.bytes_on_disk + size > self._max_bytes) or (
                self._min_free and writer.free_bytes() - size < self._min_free
            )
        except OSError:
            too_big = True
        if too_big:
            self._spare_after = loop.time() + SPARE_RETRY_INTERVAL
            return
        self._spare_job = loop.run_in_executor(None, self._write_spare)
        self._spare_job.add_done_callback(self._spare_written)

    def _write_spare(self) -> bool:
        try:
            self._writer.prepare_spare()
        except OSError as exc:
            log.warning("journal: no spare segment written ahead: %s", exc)
            return False
        return True

    def _spare_written(self, job: asyncio.Future[bool]) -> None:
        self._spare_job = None
        if not job.result() and self._loop is not None:  # the disk said no
            self._spare_after = self._loop.time() + SPARE_RETRY_INTERVAL

    def _stop_syncer(self) -> None:
        syncer, self._syncer = self._syncer, None
        if syncer is not None:
            if self._loop is not None:
                self._loop.remove_reader(syncer.fileno())
            syncer.close()

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
        writer = self._writer
        if writer.fsync and writer.files is OS_FILES:
            self._syncer = self._make_syncer()
        if self._syncer is not None:
            loop.add_reader(self._syncer.fileno(), self._synced)
            self._thread_turn = False
            self._prepare_spare()
        log.info(
            "journal: %s",
            "syncs complete on the event loop (Linux AIO)"
            if self._syncer is not None
            else "syncs in the commit thread",
        )
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
            with lock:
                failed, self._handed_failure = self._handed_failure, None
            if failed is not None:  # a loop commit's (the thread's own are handled below)
                self._fail_and_retry(loop, failed)
                if self._stopping:
                    return
            while True:
                with lock:
                    if not self._thread_turn:
                        break  # the loop commits (and may have a sync in flight)
                    frame = writer.drain()
                    if frame is None:
                        self._go_idle()
                        break
                try:
                    self._committed_seq = writer.commit(frame)
                    self.thread_commits += 1
                except JournalWriteError as exc:
                    self._fail_and_retry(loop, exc)
                    if self._stopping:
                        return
                    continue
                with lock:
                    lagging = self._report_scheduled
                    if not lagging:
                        self._report_scheduled = True
                    # Lagging: the loop has not run the previous report yet, it is saturated.
                    # Wait for that report (it covers this commit too) to wake us, so the next
                    # frame is bigger and acknowledgements go out in fewer writes. With a
                    # syncer, the report's _kick has the loop commit the next frame.
                    done = lagging or self._syncer is not None
                    if done:
                        self._go_idle()
                if not lagging:
                    loop.call_soon_threadsafe(self._report)
                # After the report is on its way: the acknowledgements do not wait for statfs.
                self._check_space(loop.call_soon_threadsafe)
                if done:
                    break
            if self._stopping:
                return

    def _go_idle(self) -> None:
        # Under _lock. With a syncer, the next _kick decides who commits the next frame.
        self._idle = True
        if self._syncer is not None:
            self._thread_turn = False

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
        self._check_space(loop.call_soon_threadsafe)

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

    def _check_space(self, post: Callable[[Callable[[], None]], object]) -> None:
        """Tell the loop (``post`` runs a callback there) when the limit reached changes, not
        the bytes. Runs in the thread and, after a loop commit, on the loop: the callback reads
        the newest state, so two checks racing cannot leave an older one in place."""
        limit, reason = self._over_budget()
        with self._lock:
            if limit == self._full_limit:
                return
            self._full_limit, self._full_reason = limit, reason
        post(self._set_full)

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
            self._check_space(loop.call_soon_threadsafe)
            return

    # -- event loop --------------------------------------------------------------------------

    def _report(self) -> None:
        # Cleared before reading the seq: a commit finishing after this line schedules a new
        # report, one finishing before it is included in this one.
        with self._lock:
            self._report_scheduled = False
        if self._syncer is not None and not self._writer.spare_bytes and self._spare_job is None:
            self._prepare_spare()  # the spare went into a segment: write the next one ahead
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

    def _set_full(self) -> None:
        with self._lock:
            reason = self._full_reason
        if (reason or "") == self.status.full:
            return  # a second report of the same change
        used, free = self.bytes_on_disk, self.free_bytes
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
            if self._syncing is not None:  # a loop commit's sync is in flight: let it end
                self._sync_settled = asyncio.get_running_loop().create_future()
                await self._sync_settled
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
            if self._spare_job is not None:
                await asyncio.wait([self._spare_job])
            self._stop_syncer()
            self.closed = True
            self._writer.close()


def _noop() -> None:
    pass


def _call_now(callback: Callable[[], None]) -> None:
    callback()


def _ignore_status(status: JournalStatus) -> None:
    pass


def _ignore_drop(node: str, first: int, last: int) -> None:
    pass
