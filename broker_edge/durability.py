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
import logging
import threading
from collections import deque
from collections.abc import Callable

from ingest.journal import JournalWriter

log = logging.getLogger(__name__)


class GroupCommitter:
    def __init__(self, writer: JournalWriter) -> None:
        self._writer = writer
        # Runs after each report released its waiters (the broker flushes its connections).
        self.on_commit: Callable[[], None] = _noop
        self._waiters: deque[tuple[int, Callable[[], None]]] = deque()
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
        # The event loop's view: every seq up to this one is durable and its waiters ran.
        self.durable_seq = writer.next_seq - 1
        self.failure: BaseException | None = None
        self.closed = False

    @property
    def backlog(self) -> int:
        """Records appended and not yet known durable on the loop."""
        return self._writer.next_seq - 1 - self.durable_seq

    @property
    def appended_seq(self) -> int:
        return self._writer.next_seq - 1

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
                ts_us=ts_us,
                tenant=tenant,
                client_id=client_id,
                topic=topic,
                qos=qos,
                retain=retain,
                payload=payload,
                content_type=content_type,
                user_properties=user_properties,
            )
        # Read after the locked append: if the thread went idle before it, this sees so.
        if self._idle and not self._kick_scheduled and self._loop is not None:
            # Wake the thread once this loop iteration's reads are handled, not at this first
            # record of the first read: a frame then holds whole reads, and the thread does
            # not preempt the loop mid-read to commit one record.
            self._kick_scheduled = True
            self._loop.call_soon(self._kick)
        return seq

    def _kick(self) -> None:
        self._kick_scheduled = False
        with self._lock:
            if self._idle:
                self._idle = False
                self._wake.set()

    def after_durable(self, seq: int, callback: Callable[[], None]) -> None:
        if seq <= self.durable_seq:
            callback()
        else:
            self._waiters.append((seq, callback))

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
        except BaseException as exc:  # handed to the loop, which stops the node
            loop.call_soon_threadsafe(self._thread_failed, exc)
        else:
            loop.call_soon_threadsafe(self._thread_done)

    def _commit_until_stopped(self, loop: asyncio.AbstractEventLoop) -> None:
        writer = self._writer
        lock = self._lock
        wake = self._wake
        while True:
            wake.wait()
            wake.clear()
            while True:
                with lock:
                    frame = writer.drain()
                    if frame is None:
                        self._idle = True
                        break
                self._committed_seq = writer.commit(frame)
                with lock:
                    lagging = self._report_scheduled
                    if lagging:
                        # The loop has not run the previous report yet: it is saturated. Wait
                        # for that report (it covers this commit too) to wake us, so the next
                        # frame is bigger and acknowledgements go out in fewer writes.
                        self._idle = True
                    else:
                        self._report_scheduled = True
                if lagging:
                    break
                loop.call_soon_threadsafe(self._report)
            if self._stopping:
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

    def _thread_done(self) -> None:
        try:
            self._report()
        finally:  # close() waits for this, whatever the last report did
            if self._stopped is not None and not self._stopped.done():
                self._stopped.set_result(None)

    def _thread_failed(self, exc: BaseException) -> None:
        # Nothing after the last durable seq may be acknowledged: stop the node loudly.
        log.critical("journal commit failed: %s", exc)
        self.failure = exc
        try:
            self._report()
        finally:
            if self._stopped is not None and not self._stopped.done():
                self._stopped.set_exception(exc)

    async def close(self) -> None:
        """Commit what is buffered, then stop the thread and close the journal. Records
        appended after this returns are never committed (``closed`` tells the node)."""
        self._stopping = True
        self._wake.set()
        try:
            if self._stopped is not None:
                await self._stopped
            # Appended while the thread was finishing (closing connections log their
            # disconnect): commit those here.
            frame = self._writer.drain()  # on the loop, where append runs: no race
            if frame is not None:
                loop = asyncio.get_running_loop()
                self._committed_seq = await loop.run_in_executor(None, self._writer.commit, frame)
                self._report()
        finally:
            if self._thread is not None:
                self._thread.join()
            self.closed = True
            self._writer.close()


def _noop() -> None:
    pass
