"""When table maintenance runs (``streaming.maintenance``): an injected clock, real tables."""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest
from lake_fixture import DeltaBatchWriter

from sinks.maintenance import MaintenanceReport
from sinks.retention import Retention
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
        self.retention: dict[str, Retention | None] = {}
        self.failing = failing

    def __call__(
        self, path: Path, retention_hours: float, retention: Retention | None
    ) -> MaintenanceReport:
        self.calls.append((path, retention_hours))
        self.retention[path.name] = retention
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


NOW = datetime(2026, 3, 31, 23, 59, tzinfo=UTC)  # a UTC day's last minute
TODAY = date(2026, 3, 31)


def test_each_tenant_keeps_its_own_days_besides_today(tmp_path: Path) -> None:
    """logs: 30 days by default, acme 7, initech forever (0); messages: forever by default,
    acme 365. The cutoff is the first date kept: today minus the days."""
    for table in ("messages", "logs", "usage"):
        make_table(tmp_path / table)
    recorder = Recorder()
    tenants = {"acme": {"logs": 7, "messages": 365}, "initech": {"logs": 0}, "globex": {}}
    schedule = MaintenanceSchedule(
        settings(tmp_path),
        recorder,
        ("messages", "logs", "usage"),
        tenants=lambda: tenants,
        clock=lambda: NOW.astimezone(timezone(timedelta(hours=5))),  # already April 1st there
    )

    schedule.run_once()

    logs = recorder.retention["logs"]
    assert logs is not None
    assert logs.cutoff("acme") == date(2026, 3, 24)  # keeps Mar 24 .. 31: 7 days and today
    assert logs.cutoff("initech") is None
    assert logs.cutoff("globex") == logs.cutoff("not-in-the-file") == date(2026, 3, 1)
    messages = recorder.retention["messages"]
    assert messages is not None
    assert messages.cutoff("acme") == TODAY - timedelta(days=365)
    assert messages.cutoff("globex") is None
    assert recorder.retention["usage"] is None  # no retention: usage is history's summary


def test_messages_kept_forever_by_everyone_need_no_retention(tmp_path: Path) -> None:
    make_table(tmp_path / "messages")
    recorder = Recorder()
    schedule = MaintenanceSchedule(
        settings(tmp_path), recorder, ("messages",), tenants=lambda: {"acme": {"messages": 0}}
    )
    schedule.run_once()
    assert recorder.retention == {"messages": None}


def test_an_unreadable_tenants_file_never_falls_back_to_the_defaults(tmp_path: Path) -> None:
    """A tenant keeping more than the default must not lose it to a file being edited: the
    last good read counts, and without one there is no retention at all that run."""
    make_table(tmp_path / "logs")
    reads: list[dict[str, dict[str, int]] | Exception] = [
        OSError("tenants.toml: being edited"),
        {"acme": {"logs": 90}},
        ValueError("tenants.toml: bad TOML"),
    ]

    def load() -> dict[str, dict[str, int]]:
        read = reads.pop(0)
        if isinstance(read, Exception):
            raise read
        return read

    recorder = Recorder()
    schedule = MaintenanceSchedule(
        settings(tmp_path), recorder, ("logs",), tenants=load, clock=lambda: NOW
    )
    cutoffs = []
    for _ in range(3):
        schedule.run_once()
        retention = recorder.retention["logs"]
        cutoffs.append(retention.cutoff("acme") if retention is not None else "none")
    assert cutoffs == ["none", TODAY - timedelta(days=90), TODAY - timedelta(days=90)]
