"""Group commit: publishes are appended on the event loop, made durable in a worker thread.

Theory of operation
-------------------
``append`` buffers a record in the journal writer and wakes the commit loop. The loop drains
everything buffered so far into one frame and hands it to a single worker thread that writes
and fsyncs it, while the event loop keeps accepting (and buffering) more publishes: the next
frame holds all of those. So one fsync covers every publish that arrived while the previous one
ran, and throughput survives fsync. When a commit returns, every waiter whose seq is now
durable runs (it queues the PUBACK/PUBREC), and the broker flushes its connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ingest.journal import JournalWriter

log = logging.getLogger(__name__)


class GroupCommitter:
    def __init__(self, writer: JournalWriter) -> None:
        self._writer = writer
        # Runs after each commit released its waiters (the broker flushes its connections).
        self.on_commit: Callable[[], None] = _noop
        self._waiters: deque[tuple[int, Callable[[], None]]] = deque()
        self._wake = asyncio.Event()
        self._stopping = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")
        self._task: asyncio.Task[None] | None = None
        self.durable_seq = writer.next_seq - 1
        self.failure: BaseException | None = None

    @property
    def backlog(self) -> int:
        """Records appended and not yet durable."""
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
        if not self._wake.is_set():
            self._wake.set()
        return seq

    def after_durable(self, seq: int, callback: Callable[[], None]) -> None:
        if seq <= self.durable_seq:
            callback()
        else:
            self._waiters.append((seq, callback))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="journal-commit")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        writer = self._writer
        waiters = self._waiters
        while True:
            if not self._stopping:
                await self._wake.wait()
            self._wake.clear()
            frame = writer.drain()
            if frame is not None:
                try:
                    durable = await loop.run_in_executor(self._executor, writer.commit, frame)
                except OSError as exc:
                    # Nothing after this point may be acknowledged: stop the node loudly.
                    log.critical("journal commit failed: %s", exc)
                    self.failure = exc
                    raise
                self.durable_seq = durable
                while waiters and waiters[0][0] <= durable:
                    waiters.popleft()[1]()
                self.on_commit()
            elif self._stopping:
                return

    async def close(self) -> None:
        """Commit what is buffered, then stop the loop and close the journal."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await self._task
            finally:
                self._executor.shutdown(wait=True)
                self._writer.close()


def _noop() -> None:
    pass
