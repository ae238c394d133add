"""The usage job end to end: counter records in node journals -> Delta ``usage``, summed across
edges per tenant, metric and minute, exactly once across batches and replays."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from counter_records import Counter, write_counters, write_records
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from sinks.delta import read_table
from streaming import pipeline, usage
from streaming.settings import PipelineSettings

pytestmark = pytest.mark.spark

MIDNIGHT = dt.datetime(2024, 3, 10, tzinfo=dt.UTC)


def run_usage(spark: SparkSession, settings: PipelineSettings) -> None:
    query = pipeline.start(spark, settings)
    try:
        query.processAllAvailable()
    finally:
        query.stop()


def usage_rows(settings: PipelineSettings) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(tenant, metric, minute of the day) -> row, nodes as {node: value}."""
    rows = {}
    for row in read_table(settings.table_path(usage.TABLE)).to_pylist():
        minute = int((row["window_start"] - MIDNIGHT).total_seconds()) // 60
        row["nodes"] = {n["node"]: n["value"] for n in row["nodes"]}
        key = (row["tenant"], row["metric"], minute)
        assert key not in rows, f"duplicate row {key}"
        rows[key] = row
    return rows


def values(settings: PipelineSettings) -> dict[tuple[str, str, int], tuple[Any, ...]]:
    return {k: (r["value"], r["day_value"], r["nodes"]) for k, r in usage_rows(settings).items()}


def test_counters_from_two_nodes_are_summed_per_tenant_and_minute(
    edgebus_spark: SparkSession, make_settings: Callable[..., PipelineSettings]
) -> None:
    settings = make_settings(max_records_per_batch=1000)
    journal = settings.journal_root
    write_counters(
        journal,
        "edge-a",
        [
            Counter("acme", "messages_in", 10, 5),
            Counter("acme", "messages_in", 20, 7),
            Counter("acme", "messages_in", 60, 1),  # ends on the minute: the next window
            Counter("acme", "sessions", 10, 0, total=3),
            Counter("acme", "sessions", 50, 2, total=5),  # edge-a's latest in minute 0
            Counter("acme", "sessions", 30, -1, total=4),  # older, even if journaled later
        ],
    )
    write_counters(
        journal,
        "edge-b",
        [
            Counter("acme", "messages_in", 30, 10),
            Counter("acme", "sessions", 40, 2, total=2),
            Counter("globex", "messages_in", 15, 4),
            Counter("globex", "bytes_in", 15, 400),
        ],
    )
    write_records(
        journal,
        "edge-c",
        [
            ("acme", "fleet/truck-1/telemetry", b'{"speed": 42}'),  # device traffic
            ("acme", "$log/mqtt/connect", b"{}"),
            ("acme", "$counters/messages_in", b"not json"),
            ("acme", "$counters/messages_in", b'{"kind": "counter", "delta": 1}'),
        ],
    )

    run_usage(edgebus_spark, settings)

    assert values(settings) == {
        ("acme", "messages_in", 0): (22, 22, {"edge-a": 12, "edge-b": 10}),
        ("acme", "messages_in", 1): (1, 23, {"edge-a": 1}),
        ("acme", "sessions", 0): (7, 7, {"edge-a": 5, "edge-b": 2}),
        ("globex", "messages_in", 0): (4, 4, {"edge-b": 4}),
        ("globex", "bytes_in", 0): (400, 400, {"edge-b": 400}),
    }
    row = usage_rows(settings)[("acme", "sessions", 0)]
    assert row["kind"] == "gauge"
    assert row["window_start"] == MIDNIGHT
    assert row["window_end"] == MIDNIGHT + dt.timedelta(minutes=1)
    assert row["date"] == MIDNIGHT.date()
    assert usage_rows(settings)[("acme", "messages_in", 1)]["kind"] == "counter"

    # A batch without counter records commits nothing.
    version = DeltaTable(str(settings.table_path(usage.TABLE))).version()
    write_records(journal, "edge-c", [("acme", "fleet/truck-2/telemetry", b"{}")])
    run_usage(edgebus_spark, settings)
    assert DeltaTable(str(settings.table_path(usage.TABLE))).version() == version


def test_minutes_spanning_batches_replays_and_late_records_count_once(
    edgebus_spark: SparkSession, make_settings: Callable[..., PipelineSettings]
) -> None:
    settings = make_settings(max_records_per_batch=2)  # every minute spans several batches
    journal = settings.journal_root
    write_counters(
        journal,
        "edge-a",
        [Counter("acme", "messages_in", s, 1) for s in (10, 20, 30, 40, 50, 70)]
        + [
            Counter("acme", "sessions", 10, 3, total=3),
            Counter("acme", "sessions", 50, -2, total=1),  # a gauge can go down
        ],
    )
    write_counters(
        journal,
        "edge-b",
        [Counter("acme", "messages_in", s, 2) for s in (15, 25, 35)]
        + [Counter("acme", "sessions", 20, 4, total=4)],
    )

    run_usage(edgebus_spark, settings)
    expected = {
        ("acme", "messages_in", 0): (11, 11, {"edge-a": 5, "edge-b": 6}),
        ("acme", "messages_in", 1): (1, 12, {"edge-a": 1}),
        ("acme", "sessions", 0): (5, 5, {"edge-a": 1, "edge-b": 4}),
    }
    assert values(settings) == expected
    table = DeltaTable(str(settings.table_path(usage.TABLE)))
    last_batch = table.transaction_version(usage.APP_ID)
    assert last_batch is not None
    assert last_batch >= 4
    version = table.version()

    # A crash after the Delta commit and before Spark's: the restart replays the last batch.
    commits = settings.checkpoint_path(pipeline.JOB) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    (commits / str(last)).unlink()
    run_usage(edgebus_spark, settings)
    assert (commits / str(last)).exists()
    assert DeltaTable(str(settings.table_path(usage.TABLE))).version() == version
    assert values(settings) == expected

    # edge-b catches up late with minute 0: every later day_value moves with it.
    write_counters(
        journal,
        "edge-b",
        [Counter("acme", "messages_in", 55, 100), Counter("acme", "messages_in", 130, 1)],
    )
    run_usage(edgebus_spark, settings)
    assert values(settings) == {
        ("acme", "messages_in", 0): (111, 111, {"edge-a": 5, "edge-b": 106}),
        ("acme", "messages_in", 1): (1, 112, {"edge-a": 1}),
        ("acme", "messages_in", 2): (1, 113, {"edge-b": 1}),
        ("acme", "sessions", 0): (5, 5, {"edge-a": 1, "edge-b": 4}),
    }
