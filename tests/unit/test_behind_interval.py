"""The work behind the stream (streaming.behind): at most one work per interval, what comes
meanwhile done as one, and never held back from a drain, a close or a full hand-over queue."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from streaming.behind import Behind


class Recorder(Behind[int]):
    """Records each work's items and when it started; each work takes ``work_seconds``."""

    thread_name = "behind-test"

    def __init__(self, interval: float, hurry_at: int | None = None) -> None:
        super().__init__(interval, hurry_at)
        self.works: list[tuple[float, list[int]]] = []
        self.started = threading.Event()

    def _work(self, spark: Any, taken: list[int]) -> None:
        self.works.append((time.monotonic(), list(taken)))
        self.started.set()

    def start(self) -> None:
        self._start_thread(None)  # type: ignore[arg-type] (no Spark in these works)

    def hand(self, item: int, most: int | None = None) -> None:
        self._hand(item, most)


def test_items_handed_within_the_interval_wait_and_go_as_one_work() -> None:
    behind = Recorder(interval=0.6)
    behind.start()
    behind.hand(1)
    assert behind.started.wait(5)  # the first work starts at once
    for item in (2, 3, 4):
        behind.hand(item)
    time.sleep(0.2)
    assert [items for _, items in behind.works] == [[1]]  # held back by the interval
    deadline = time.monotonic() + 5
    while len(behind.works) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    behind.close()
    assert [items for _, items in behind.works] == [[1], [2, 3, 4]]
    first, second = (at for at, _ in behind.works)
    assert second - first >= 0.6


@pytest.mark.parametrize("end", ["drain", "close"])
def test_a_drain_or_a_close_is_not_held_back_by_the_interval(end: str) -> None:
    behind = Recorder(interval=60)
    behind.start()
    behind.hand(1)
    assert behind.started.wait(5)
    behind.hand(2)
    began = time.monotonic()
    if end == "drain":
        behind.drain(timeout=10)
    else:
        behind.close()
    assert time.monotonic() - began < 5
    assert [items for _, items in behind.works] == [[1], [2]]
    behind.close()


def test_enough_items_waiting_end_the_interval_before_the_stream_would_wait() -> None:
    behind = Recorder(interval=60, hurry_at=3)
    behind.start()
    behind.hand(1)
    assert behind.started.wait(5)
    for item in (2, 3):
        behind.hand(item, most=6)
    time.sleep(0.2)
    assert len(behind.works) == 1
    behind.hand(4, most=6)  # three wait: the work starts without waiting out the interval
    deadline = time.monotonic() + 5
    while len(behind.works) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [items for _, items in behind.works] == [[1], [2, 3, 4]]
    behind.close()


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_seconds"):
        Recorder(interval=-1)
