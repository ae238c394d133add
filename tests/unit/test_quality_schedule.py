"""When the quality schedule runs (``streaming.quality.QualitySchedule``): an injected monotonic
clock and an injected run; the thread is awaited, never slept on."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from quality_lake import NOW

from streaming.quality import QualityResult, QualitySchedule
from streaming.settings import PipelineSettings


class Recorder:
    """A run that records its calls; it raises while ``failing`` is set, and waits for
    ``release`` (set by default) before it returns."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, dt.datetime]] = []
        self.failing = False
        self.release = threading.Event()
        self.release.set()

    def __call__(self, lake: Path, *, now: dt.datetime, **_: Any) -> Sequence[QualityResult]:
        self.calls.append((lake, now))
        self.release.wait()
        if self.failing:
            raise OSError("disk on fire")
        return []


def schedule(tmp_path: Path, recorder: Recorder, interval: float = 600.0) -> QualitySchedule:
    return QualitySchedule(tmp_path, interval, run=recorder, clock=lambda: NOW)


def test_runs_when_the_interval_has_passed_not_before(tmp_path: Path) -> None:
    recorder = Recorder()
    quality = schedule(tmp_path, recorder)

    assert not quality.maybe_run(1000.0)  # the first call starts the clock
    assert not quality.maybe_run(1599.9)
    assert quality.maybe_run(1600.0)
    assert quality.wait(timeout=30)
    assert recorder.calls == [(tmp_path, NOW)]

    assert not quality.maybe_run(2199.0)  # one interval after the last run started
    assert quality.maybe_run(2200.5)
    assert quality.wait(timeout=30)
    assert len(recorder.calls) == 2
    assert quality.runs == 2


def test_a_run_in_flight_is_never_overlapped(tmp_path: Path) -> None:
    recorder = Recorder()
    recorder.release.clear()
    quality = schedule(tmp_path, recorder, interval=10.0)
    quality.maybe_run(0.0)
    assert quality.maybe_run(10.0)

    assert not quality.maybe_run(20.0)  # due, but the first is still running
    assert not quality.maybe_run(25.0)
    recorder.release.set()
    assert quality.wait(timeout=30)
    assert quality.maybe_run(25.0)  # due since 20: starts as soon as the first is done
    assert quality.wait(timeout=30)
    assert len(recorder.calls) == 2


def test_a_failing_run_is_logged_not_raised_and_the_next_one_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    recorder.failing = True
    quality = schedule(tmp_path, recorder, interval=10.0)
    quality.maybe_run(0.0)

    with caplog.at_level(logging.ERROR, logger="streaming.schedule"):
        assert quality.maybe_run(10.0)
        assert quality.wait(timeout=30)
    assert quality.failures == 1
    assert "quality run 1 failed" in caplog.text
    assert "disk on fire" in caplog.text

    recorder.failing = False
    assert quality.maybe_run(20.0)
    assert quality.wait(timeout=30)
    assert (quality.runs, quality.failures) == (2, 1)


def test_interval_zero_never_runs(tmp_path: Path) -> None:
    recorder = Recorder()
    settings = PipelineSettings(lake=tmp_path, quality_interval_seconds=0)
    quality = QualitySchedule(settings.lake, settings.quality_interval_seconds, run=recorder)
    quality_recorded = schedule(tmp_path, recorder, interval=0)

    for now in (0.0, 1e6, 1e9):
        assert not quality.maybe_run(now)
        assert not quality_recorded.maybe_run(now)
    assert not quality.enabled
    assert recorder.calls == []


def test_close_waits_for_the_run_and_starts_no_more(tmp_path: Path) -> None:
    recorder = Recorder()
    quality = schedule(tmp_path, recorder, interval=1.0)
    quality.maybe_run(0.0)
    assert quality.maybe_run(1.0)

    assert quality.close(timeout=30)
    assert not quality.running
    assert not quality.maybe_run(100.0)
    assert len(recorder.calls) == 1
