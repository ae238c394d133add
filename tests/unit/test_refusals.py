"""The refusal limiter (broker_edge.refusals): which failed handshakes are reported, and the
window's summary of the others."""

from __future__ import annotations

from broker_edge.refusals import RefusalLimiter, Suppressed


def test_one_source_past_its_limit_is_counted_not_reported() -> None:
    limiter = RefusalLimiter(per_source=2, per_listener=10, interval=60.0)
    assert limiter.window_end is None
    admitted = [limiter.admit("tls", "10.0.0.1", 5.0 + n) for n in range(5)]
    assert admitted == [True, True, False, False, False]
    assert limiter.window_end == 65.0  # opened by the first refusal
    assert limiter.admit("tls", "10.0.0.2", 9.0)  # another source has its own allowance
    assert limiter.admit("wss", "10.0.0.1", 9.0)  # ... and so has another listener
    assert limiter.close_window() == [Suppressed("tls", 3, 1, 60.0)]
    assert limiter.window_end is None


def test_many_sources_are_bounded_by_the_listener_limit() -> None:
    limiter = RefusalLimiter(per_source=2, per_listener=3, interval=1.0)
    admitted = [limiter.admit("wss", f"10.0.0.{n}", 0.0) for n in range(10)]
    assert admitted == [True] * 3 + [False] * 7
    assert not limiter.admit("wss", "10.0.0.0", 0.5)  # within its own limit, not the listener's
    assert limiter.close_window() == [Suppressed("wss", 8, 8, 1.0)]


def test_a_new_window_starts_afresh_and_a_quiet_one_says_nothing() -> None:
    limiter = RefusalLimiter(per_source=1, per_listener=1, interval=10.0)
    assert limiter.admit("tls", "a", 0.0)
    assert limiter.close_window() == []  # nothing held back: no summary
    assert limiter.admit("tls", "a", 20.0)
    assert not limiter.admit("tls", "a", 21.0)
    assert limiter.window_end == 30.0
    assert limiter.close_window() == [Suppressed("tls", 1, 1, 10.0)]
    assert limiter.admit("tls", "a", 40.0)
