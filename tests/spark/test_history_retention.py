"""Retention of history (issue 16 part 5): the pipeline's maintenance deletes the ``logs`` and
``messages`` partitions older than each tenant keeps, in one Delta DELETE that rewrites no
file; time travel still shows them, the latest version and every reader do not."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Any

import pytest
from delta.tables import DeltaTable as SparkDeltaTable
from pyspark.sql import SparkSession

from broker_edge.plim import log_event
from edgebus.lake_command import query
from ingest.journal import JournalWriter
from sinks.storage import open_delta
from streaming import pipeline
from streaming.maintenance import MaintenanceSchedule, spark_maintainer
from streaming.settings import PipelineSettings

pytestmark = pytest.mark.spark

NOW = datetime.combine(datetime.now(UTC).date(), time(0, 30), UTC)  # today, 00:30 UTC
TODAY = NOW.date()
AGES = (0, 7, 8, 30, 31, 45)  # days before today: each side of 7 and of 30 days
TENANTS = ("acme", "globex", "initech")
# acme keeps 7 days of logs and 30 of messages; globex is in the file with neither key,
# initech not in it at all: both keep the defaults (logs 30 days, messages forever).
OWN_DAYS = {"acme": {"logs": 7, "messages": 30}, "globex": {}}
KEPT_DAYS = {
    ("logs", "acme"): 7,
    ("logs", "globex"): 30,
    ("logs", "initech"): 30,
    ("messages", "acme"): 30,
}


def write_history(settings: PipelineSettings) -> None:
    """Per tenant and age, two messages and one log event at noon of that UTC day."""
    with JournalWriter.open(settings.journal_root, "edge-a", fsync=False) as writer:
        for tenant in TENANTS:
            for age in AGES:
                noon = datetime.combine(TODAY - timedelta(days=age), time(12), UTC)
                ts_us = int(noon.timestamp() * 1_000_000)
                topic, payload = log_event(
                    ts_us=ts_us,
                    node="edge-a",
                    tenant=tenant,
                    client_id="truck-1",
                    origin="mqtt",
                    event="connect",
                    details={"age": age},
                )
                records = [
                    (topic, payload),
                    *[(f"fleet/truck-{i}/telemetry", b"{}") for i in (1, 2)],
                ]
                for topic_, payload_ in records:
                    writer.append(
                        ts_us=ts_us,
                        tenant=tenant,
                        client_id="truck-1",
                        topic=topic_,
                        qos=0,
                        retain=False,
                        payload=payload_,
                    )
        writer.flush()


def kept(table: str) -> Counter[tuple[str, date]]:
    """The rows that must stay, per (tenant, date)."""
    per_day = 1 if table == "logs" else 2
    return Counter(
        {
            (tenant, TODAY - timedelta(days=age)): per_day
            for tenant in TENANTS
            for age in AGES
            if age <= KEPT_DAYS.get((table, tenant), 10**6)
        }
    )


def rows_of(settings: PipelineSettings, table: str, version: int | None = None) -> Counter[Any]:
    """Rows per (tenant, date) through delta-rs's QueryBuilder (as ``edgebus sql`` reads)."""
    delta = open_delta(settings.table_path(table), version)
    rows = query(delta, table, f'SELECT tenant, "date" FROM {table}')
    return Counter((row["tenant"], row["date"]) for row in rows)


def edgebus(*args: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "edgebus.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_maintenance_expires_each_tenants_history_by_partition(
    edgebus_spark: SparkSession,
    make_settings: Callable[..., PipelineSettings],
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings()
    write_history(settings)
    pipeline.run(settings, once=True, spark=edgebus_spark)
    every = {table: rows_of(settings, table) for table in ("logs", "messages")}
    assert every["logs"] == Counter(
        {(t, TODAY - timedelta(days=a)): 1 for t in TENANTS for a in AGES}
    )
    before = {table: open_delta(settings.table_path(table)).version() for table in every}
    schedule = MaintenanceSchedule(
        settings,
        spark_maintainer(edgebus_spark),
        ("messages", "logs"),
        tenants=lambda: OWN_DAYS,
        clock=lambda: NOW,
    )

    with caplog.at_level(logging.INFO, logger="sinks.retention"):
        reports = {Path(r.path).name: r for r in schedule.run_once()}

    for table in ("logs", "messages"):
        assert rows_of(settings, table) == kept(table), table
        # Time travel: the version before the DELETE still holds every row.
        assert rows_of(settings, table, before[table]) == every[table]
        old = edgebus_spark.read.format("delta").option("versionAsOf", before[table])
        assert old.load(str(settings.table_path(table))).count() == every[table].total()
        gone = every[table].total() - kept(table).total()
        assert reports[table].rows_expired == gone
        # Whole files removed, none written, no deletion vector: one commit, metadata only.
        history = SparkDeltaTable.forPath(edgebus_spark, str(settings.table_path(table)))
        deletes = history.history().where("operation = 'DELETE'").collect()
        assert len(deletes) == 1
        metrics = deletes[0]["operationMetrics"]
        assert int(metrics["numDeletedRows"]) == gone
        assert int(metrics["numRemovedFiles"]) == sum(e.files for e in reports[table].expired)
        assert int(metrics["numAddedFiles"]) == 0
        assert int(metrics.get("numDeletionVectorsAdded", 0)) == 0
        assert int(metrics.get("numCopiedRows", 0)) == 0
    assert [(e.tenant, e.before, e.partitions) for e in reports["logs"].expired] == [
        ("acme", TODAY - timedelta(days=7), 4),
        ("globex", TODAY - timedelta(days=30), 2),
        ("initech", TODAY - timedelta(days=30), 2),
    ]
    assert [(e.tenant, e.rows) for e in reports["messages"].expired] == [("acme", 4)]
    logged = [r.getMessage() for r in caplog.records]
    cutoff = TODAY - timedelta(days=7)
    assert any(f"deleted 4 rows of logs older than {cutoff} for tenant acme" in m for m in logged)

    # The readers see the latest version only: edgebus logs and edgebus sql (subprocesses,
    # delta-rs); sql --as-of the old version sees what time travel keeps.
    lake = str(settings.lake)
    shown = edgebus(
        "logs", "--lake", lake, "--tenant", "acme", "--since", "60d", "--format", "json"
    )
    assert sorted(row["details"]["age"] for row in shown) == [0, 7]
    sql = 'SELECT tenant, CAST("date" AS VARCHAR) AS day, COUNT(*) AS n FROM logs GROUP BY 1, 2'
    latest = edgebus("sql", sql, "--lake", lake, "--format", "json")
    assert {(r["tenant"], date.fromisoformat(r["day"])): r["n"] for r in latest} == kept("logs")
    then = edgebus("sql", sql, "--lake", lake, "--format", "json", "--as-of", str(before["logs"]))
    assert sum(row["n"] for row in then) == every["logs"].total()

    # Nothing left to expire (or to do): the next run commits nothing.
    versions = {table: open_delta(settings.table_path(table)).version() for table in every}
    again = {Path(r.path).name: r for r in schedule.run_once()}
    assert {t: open_delta(settings.table_path(t)).version() for t in every} == versions
    assert (again["logs"].expired, again["messages"].rows_expired) == ((), 0)
