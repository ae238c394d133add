"""Work the stream hands over and a thread of its own does behind it: the other tables
(:mod:`streaming.others`) and the quota step (:mod:`streaming.quota_lane`).

Theory of operation
-------------------
The stream's ``foreachBatch`` hands each batch over (:meth:`Behind._hand`) and returns; the
thread takes everything handed over since it last looked, in order, and works it through as
one (:meth:`Behind._work`: one read and one commit for several batches when it fell behind).
With an interval, a work starts at most once per interval and what comes meanwhile waits for
it: fewer, larger works, where each costs mostly per call (a commit), not per batch.
A failure stops the thread and is raised by the next hand-over, so the stream's next batch
fails with it (and by :meth:`Behind.check`, which a long run calls while no batch comes).
:meth:`Behind.drain` waits for what was handed over; :meth:`Behind.close` lets the thread
finish it, then stops it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Generic, TypeVar

from streaming.errors import PipelineError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

Handed = TypeVar("Handed")


class Behind(Generic[Handed]):
    """A thread working through what the stream hands over (see the module's docstring)."""

    # What the work is, for its errors and its thread ("the other tables").
    what = "the work behind the stream"
    thread_name = "behind"
    # Seconds without anything handed over after which the thread calls ``_idle`` (None: never).
    idle_seconds: float | None = None

    def __init__(self, interval_seconds: float = 0.0, hurry_at: int | None = None) -> None:
        if interval_seconds < 0:
            raise ValueError(f"interval_seconds must be >= 0, got {interval_seconds}")
        # The least time between the starts of two works: what comes meanwhile waits and is
        # done as one (the work's cost is mostly per call, not per batch) ...
        self._interval = interval_seconds
        self._next_start = 0.0
        # ... unless this many items wait: then at once, before the stream has to wait.
        self._hurry_at = hurry_at
        self._draining = 0  # callers of drain, who want it all done now
        self._changed = threading.Condition()
        self._handed: list[Handed] = []
        self._busy = False
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    def drain(self, timeout: float | None = None) -> None:
        """Wait until everything handed over is done; raises the thread's failure, or
        :class:`PipelineError` when ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            self._draining += 1  # the interval does not hold back what a caller waits for
            self._changed.notify_all()
            try:
                while self._error is None and (self._handed or self._busy):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise PipelineError(
                            f"{self.what} did not catch up within {timeout} s{self._progress()}"
                        )
                    self._changed.wait(left)
                self._raise_failure()
            finally:
                self._draining -= 1

    def check(self) -> None:
        """Raise the thread's failure, if it failed."""
        with self._changed:
            self._raise_failure()

    def close(self) -> None:
        """Stop the thread once what was handed over is done (or it failed)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _hand(self, item: Handed, most: int | None = None) -> None:
        """Hand ``item`` over, first waiting while ``most`` items wait already; raises the
        thread's failure."""
        with self._changed:
            while self._error is None and most is not None and len(self._handed) >= most:
                self._changed.wait()
            self._raise_failure()
            self._handed.append(item)
            self._changed.notify_all()

    def _start_thread(self, spark: SparkSession) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(spark,), name=self.thread_name, daemon=True
        )
        self._thread.start()

    def _work(self, spark: SparkSession, taken: list[Handed]) -> None:
        """Do ``taken`` (what was handed over since the last call, in order), as one."""
        raise NotImplementedError

    def _idle(self, spark: SparkSession) -> None:
        """Nothing was handed over for ``idle_seconds``: what the work does meanwhile."""

    def _progress(self) -> str:
        """How far the work got, for the error of a drain that timed out."""
        return ""

    def _wait_interval(self) -> None:
        """Until the interval since the last work's start is over (at once when closing or
        draining, when ``hurry_at`` items wait, or with nothing handed over: the idle call does
        not wait)."""
        while self._handed and not self._closing and not self._draining:
            if self._hurry_at is not None and len(self._handed) >= self._hurry_at:
                return
            left = self._next_start - time.monotonic()
            if left <= 0:
                return
            self._changed.wait(left)

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise PipelineError(f"{self.what} failed: {self._error}") from self._error

    def _run(self, spark: SparkSession) -> None:
        while True:
            with self._changed:
                while not self._handed and not self._closing:
                    if not self._changed.wait(self.idle_seconds):
                        break  # idle for idle_seconds
                if not self._handed and self._closing:
                    return
                self._wait_interval()
                taken = list(self._handed)
                if taken:
                    self._next_start = time.monotonic() + self._interval
                self._busy = bool(taken)
            try:
                if taken:
                    self._work(spark, taken)
                else:
                    self._idle(spark)
            except BaseException as exc:  # failed: the stream's next batch raises it
                logger.exception("%s failed", self.what)
                with self._changed:
                    self._error = exc
                    self._busy = False
                    self._changed.notify_all()
                return
            with self._changed:
                del self._handed[: len(taken)]
                self._busy = False
                self._changed.notify_all()
