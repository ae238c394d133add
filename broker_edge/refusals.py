"""How many refused handshakes a listener reports: a scanner must not flood the log or ``$log``.

Theory of operation
-------------------
Every failed TLS handshake is worth a log line and a ``$log`` event (a device with a bad
certificate, a client on the wrong port), but a scanner hammering the port would turn each of
its connections into a journaled event that lands in the lake. So reports are counted in windows
of ``interval`` seconds: within one, at most ``per_source`` refusals from one source address and
``per_listener`` refusals on one listener are reported; the others are only counted, and when
the window ends each listener that held some back reports one summary (:class:`Suppressed`:
how many, from how many sources, over what interval). This is EMQX's log throttling (one
``log_events_throttled`` line per window with the dropped count), and the kernel's
"N callbacks suppressed".

A window opens at the first refusal after a quiet spell and closes ``interval`` seconds later
(the caller's timer calls :meth:`RefusalLimiter.close_window`); everything counted is then
forgotten, so what the limiter holds is bounded by the sources seen in one window. Pure: the
caller passes the time and does the logging.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Suppressed:
    """What one listener did not report in one window."""

    listener: str
    count: int  # refusals not reported
    sources: int  # distinct source addresses among them
    interval: float  # the window's length, seconds


class RefusalLimiter:
    """Which refusals to report, and the summaries of the others (see the module)."""

    __slots__ = (
        "_by_listener", "_by_source", "_held_back", "interval", "per_listener", "per_source",
        "window_end",
    )  # fmt: skip

    def __init__(self, per_source: int, per_listener: int, interval: float) -> None:
        self.per_source = per_source
        self.per_listener = per_listener
        self.interval = interval
        self.window_end: float | None = None  # None: no window open (nothing counted)
        self._by_source: dict[tuple[str, str], int] = {}
        self._by_listener: dict[str, int] = {}
        # listener -> source -> refusals held back
        self._held_back: dict[str, dict[str, int]] = {}

    def admit(self, listener: str, source: str, now: float) -> bool:
        """Count one refusal on ``listener`` from ``source``: True if it is to be reported,
        False if only counted for the window's summary. Opens a window if none is."""
        if self.window_end is None:
            self.window_end = now + self.interval
        key = (listener, source)
        from_source = self._by_source.get(key, 0) + 1
        self._by_source[key] = from_source
        on_listener = self._by_listener.get(listener, 0)
        if from_source <= self.per_source and on_listener < self.per_listener:
            self._by_listener[listener] = on_listener + 1
            return True
        held = self._held_back.setdefault(listener, {})
        held[source] = held.get(source, 0) + 1
        return False

    def close_window(self) -> list[Suppressed]:
        """End the window: one summary per listener that held refusals back; forget the rest."""
        summaries = [
            Suppressed(listener, sum(sources.values()), len(sources), self.interval)
            for listener, sources in sorted(self._held_back.items())
        ]
        self.window_end = None
        self._by_source.clear()
        self._by_listener.clear()
        self._held_back.clear()
        return summaries
