"""When table maintenance runs (``streaming.maintenance``): an injected clock, real tables."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest
from lake_fixture import DeltaBatchWriter

from sinks.maintenance import MaintenanceReport
from streaming.maintenance import MaintenanceSchedule
from streaming.settings import PipelineSettings

SCHEMA = pa.schema([pa.field("tenant", pa.string(), nullable=False), pa.field("n", pa.int64())])


def make_table(path: Path, batches: int = 3) -> None:
    writer = DeltaBatchWriter(path, "test.schedule", SCHEMA, ("tenant",))
    for batch_id in range(batches):
        writer.write(batch_id, pa.table({"tenant": ["acme"], "n": [batch_id]}, schema=SCHEMA))


def report(path: Path) -> MaintenanceReport:
    return MaintenanceReport(str(path), 1, 1, 0, 0, 0, 0, 168.0)


class Recorder:
    """A maintainer that records its calls; it fails for the paths in ``failing``."""

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple[Path, float]] = []
        self.failing = failing

    def __call__(self, path: Path, retention_hours: float) -> MaintenanceReport:
        self.calls.append((path, retention_hours))
        if path.name in self.failing:
            raise OSError(f"{path}: disk on fire")
        return report(path)


def settings(lake: Path, interval: float = 60.0) -> PipelineSettings:
    return PipelineSettings(
        lake=lake, maintenance_interval_seconds=interval, vacuum_retention_hours=2.0
    )


def test_runs_when_the_interval_has_passed_not_before(tmp_path: Path) -> None:
    make_table(tmp_path / "logs")
    recorder = Recorder()
    schedule = MaintenanceSchedule(settings(tmp_path), recorder, ("messages", "logs"))

    assert not schedule.maybe_run(100.0)  # the first call starts the clock
    assert not schedule.maybe_run(159.9)
    assert schedule.maybe_run(160.0)
    assert schedule.wait(timeout=30)
    # "messages" does not exist yet: skipped, not an error.
    assert recorder.calls == [(tmp_path / "logs", 2.0)]
    assert not schedule.maybe_run(219.9)
    assert schedule.maybe_run(220.0)
    assert schedule.close(timeout=30)
    assert schedule.runs == 2
    assert len(recorder.calls) == 2


def test_zero_interval_never_runs(tmp_path: Path) -> None:
    make_table(tmp_path / "logs")
    recorder = Recorder()
    schedule = MaintenanceSchedule(settings(tmp_path, interval=0), recorder, ("logs",))

    for now in (0.0, 1e6, 1e9):
        assert not schedule.maybe_run(now)
    assert recorder.calls == []


def test_a_failing_table_is_logged_and_the_others_still_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for table in ("messages", "logs"):
        make_table(tmp_path / table)
    recorder = Recorder(failing=("messages",))
    schedule = MaintenanceSchedule(settings(tmp_path), recorder, ("messages", "logs"))

    with caplog.at_level(logging.INFO, logger="streaming.maintenance"):
        reports = schedule.run_once()
        reports_again = schedule.run_once()  # the next run tries the failed table again

    assert [r.path for r in reports] == [str(tmp_path / "logs")]
    assert reports_again == reports
    assert [path.name for path, _ in recorder.calls] == ["messages", "logs"] * 2
    failed = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failed) == 2
    assert "messages: maintenance failed" in failed[0].getMessage()
    assert failed[0].exc_info is not None
