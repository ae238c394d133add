"""Periodic work beside the streams: one background thread per run, never more than one.

The pipeline's loop calls :meth:`IntervalSchedule.maybe_run` with the monotonic clock every
time it polls its queries. The first call only starts the clock (a restarted pipeline catches up
on its backlog before it spends a core elsewhere); once ``interval_seconds`` have passed since
then, or since the last run started, :meth:`IntervalSchedule.run_once` runs in a daemon thread.
A run still in flight when the next is due delays that one until it ends; a run that raises is
logged and counted, never raised into the stream, and the next one is tried as usual.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


class IntervalSchedule:
    """Runs :meth:`run_once` (subclasses define it) every ``interval_seconds`` (0: never)."""

    def __init__(self, name: str, interval_seconds: float) -> None:
        if interval_seconds < 0:
            raise ValueError(f"{name}: interval_seconds must be >= 0, got {interval_seconds}")
        self._name = name
        self._interval = interval_seconds
        self._next_due: float | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._runs = 0
        self._failures = 0

    @property
    def enabled(self) -> bool:
        return self._interval > 0

    @property
    def runs(self) -> int:
        """How many runs have been started."""
        return self._runs

    @property
    def failures(self) -> int:
        """How many runs raised."""
        return self._failures

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def maybe_run(self, now_monotonic: float) -> bool:
        """Start a run in the background when one is due and none is running; True if started."""
        if not self.enabled or self._closed:
            return False
        if self._next_due is None:
            self._next_due = now_monotonic + self._interval
            return False
        if now_monotonic < self._next_due or self.running:
            return False
        self._next_due = now_monotonic + self._interval
        self._runs += 1
        self._thread = threading.Thread(
            target=self._run_logged, name=f"edgebus-{self._name}-{self._runs}", daemon=True
        )
        self._thread.start()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the run in flight, if any; False when it is still running after ``timeout``."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def close(self, timeout: float | None = None) -> bool:
        """Start no more runs and wait for the one in flight (see :meth:`wait`).

        A run cut short by the process ending is harmless (every Delta commit is atomic), but
        joining it lets delta-rs finish before the interpreter shuts down.
        """
        self._closed = True
        return self.wait(timeout)

    def run_once(self) -> object:
        """One run, in the calling thread."""
        raise NotImplementedError

    def _run_logged(self) -> None:
        try:
            self.run_once()
        # Any error: this thread must not die silently, and the next run may well work.
        except Exception:
            self._failures += 1
            logger.exception(
                "%s run %d failed; the next one is due in %gs",
                self._name,
                self._runs,
                self._interval,
            )
