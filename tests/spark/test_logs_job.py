"""The logs job end to end: journals on disk -> edgebus source -> Delta ``logs``."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from broker_edge.plim import log_event
from edgebus import logs_cli
from ingest.journal import JournalWriter
from sinks.delta import read_table
from streaming import history, logs, pipeline
from streaming.errors import PipelineError
from streaming.settings import PipelineSettings

pytestmark = pytest.mark.spark

Id = tuple[str, int]
BASE_TS_US = 1_710_028_800_000_000  # 2024-03-10T00:00:00Z
HOUR_US = 3_600_000_000
TENANTS = ("acme", "globex")
EVENTS = ("connect", "subscribe", "acl_denied", "disconnect")


@pytest.fixture
def settings(make_settings: Callable[..., PipelineSettings]) -> PipelineSettings:
    # A small batch cap so a run spans a few micro-batches (each costs ~0.5 s or more).
    return make_settings(max_records_per_batch=10)


def write_journal(settings: PipelineSettings, node: str, count: int, start: int = 0) -> set[Id]:
    """``count`` records on ``node``: log events of both tenants, device traffic, one bad log.

    Returns the ids of the records that belong in ``logs``.
    """
    logged: set[Id] = set()
    with JournalWriter.open(settings.journal_root, node, fsync=False) as writer:
        for i in range(start, start + count):
            ts_us = BASE_TS_US + i * HOUR_US  # one per hour: spans two UTC days
            tenant = TENANTS[i % 2]
            if i % 4 == 3:
                topic, payload = f"fleet/truck-{i}/telemetry", b'{"speed": 42}'
            elif i == 5:
                topic, payload = "$log/mqtt/connect", b'{"broken": '
            else:
                topic, payload = log_event(
                    ts_us=ts_us,
                    node=node,
                    tenant=tenant,
                    client_id=f"truck-{i}",
                    origin="mqtt",
                    event=EVENTS[i % len(EVENTS)],
                    details={"i": i, "peer": f"10.0.0.{i}:1883"},
                )
            seq = writer.append(
                ts_us=ts_us,
                tenant=tenant,
                client_id="$edge" if topic.startswith("$") else f"truck-{i}",
                topic=topic,
                qos=0,
                retain=False,
                payload=payload,
            )
            if topic.startswith("$log/"):
                logged.add((node, seq))
        writer.flush()
    return logged


def run_logs(spark: SparkSession, settings: PipelineSettings) -> None:
    query = pipeline.start(spark, settings)
    try:
        query.processAllAvailable()
    finally:
        query.stop()


def log_rows(settings: PipelineSettings) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = read_table(settings.table_path(logs.TABLE)).to_pylist()
    return sorted(rows, key=lambda row: (row["node"], row["seq"]))


def assert_exactly_once(settings: PipelineSettings, expected: set[Id]) -> None:
    ids = Counter((row["node"], row["seq"]) for row in log_rows(settings))
    assert set(ids) == expected
    assert max(ids.values()) == 1


def delta_version(settings: PipelineSettings) -> int:
    version: int = DeltaTable(str(settings.table_path(logs.TABLE))).version()
    return version


def test_log_events_of_two_tenants_land_as_rows(
    edgebus_spark: SparkSession, settings: PipelineSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = write_journal(settings, "edge-a", 30) | write_journal(settings, "edge-b", 9)

    run_logs(edgebus_spark, replace(settings, max_records_per_batch=100))  # one batch

    assert_exactly_once(settings, expected)
    rows = log_rows(settings)
    valid = [row for row in rows if row["payload_valid"]]
    for row in valid:
        i = json.loads(row["details"])["i"]
        ts = dt.datetime.fromtimestamp((BASE_TS_US + i * HOUR_US) / 1e6, dt.UTC)
        assert row["ts"] == ts
        assert row["date"] == ts.date()
        assert row["tenant"] == TENANTS[i % 2]
        assert row["client_id"] == f"truck-{i}"
        assert (row["origin"], row["event_type"]) == ("mqtt", EVENTS[i % len(EVENTS)])
        assert row["time"] == ts.isoformat(timespec="milliseconds")
        assert (row["invalid_reason"], row["raw"]) == (None, None)
    assert {row["tenant"] for row in valid} == set(TENANTS)
    assert {row["date"] for row in valid} == {dt.date(2024, 3, 10), dt.date(2024, 3, 11)}
    # Partitioned by tenant and date, as the CLI's pruning expects.
    table = DeltaTable(str(settings.table_path(logs.TABLE)))
    assert table.metadata().partition_columns == ["tenant", "date"]

    # What the job wrote is what `edgebus logs` reads: every acme event, newest first.
    argv = ["--lake", str(settings.lake), "--tenant", "acme", "--format", "json"]
    assert logs_cli.main([*argv, "--limit", "1000"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    acme = sorted(
        (row for row in rows if row["tenant"] == "acme"),
        key=lambda r: (r["ts"], r["node"], r["seq"]),
        reverse=True,
    )
    assert [(e["node"], e["seq"]) for e in shown] == [(r["node"], r["seq"]) for r in acme]


def test_an_invalid_payload_is_kept_not_dropped(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    write_journal(settings, "edge-a", 8)
    run_logs(edgebus_spark, settings)
    invalid = [row for row in log_rows(settings) if not row["payload_valid"]]
    assert len(invalid) == 1
    [row] = invalid
    assert (row["node"], row["seq"], row["tenant"]) == ("edge-a", 6, "globex")
    assert row["raw"] == b'{"broken": '
    assert row["invalid_reason"] == "payload is not a JSON object"
    assert (row["origin"], row["event_type"], row["client_id"]) == ("mqtt", "connect", None)


def test_replays_land_exactly_once(edgebus_spark: SparkSession, settings: PipelineSettings) -> None:
    expected = write_journal(settings, "edge-a", 12)
    run_logs(edgebus_spark, settings)
    assert_exactly_once(settings, expected)
    version = delta_version(settings)

    run_logs(edgebus_spark, settings)  # nothing new: nothing written
    assert delta_version(settings) == version

    # What a SIGKILL right after the Delta commit leaves: Spark replays the last batch.
    commits = settings.checkpoint_path(pipeline.JOB) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    (commits / str(last)).unlink()
    run_logs(edgebus_spark, settings)
    assert_exactly_once(settings, expected)
    assert delta_version(settings) == version  # the replay was recognised, not re-appended

    expected |= write_journal(settings, "edge-a", 7, start=12)
    run_logs(edgebus_spark, settings)
    assert_exactly_once(settings, expected)
    last_batch = DeltaTable(str(settings.table_path(logs.TABLE))).transaction_version(logs.APP_ID)
    assert last_batch is not None
    assert last_batch >= 2  # batches of at most 10 records: 10 + 2, then 7


def test_a_lost_checkpoint_refuses_to_start(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    write_journal(settings, "edge-a", 6)
    run_logs(edgebus_spark, settings)
    for path in sorted(settings.checkpoint_path(pipeline.JOB).rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    with pytest.raises(PipelineError, match="checkpoint"):
        pipeline.start(edgebus_spark, settings)
    assert not edgebus_spark.streams.active


def test_one_batch_feeds_logs_and_messages(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    # One query reads the journal; each step writes its own table from the same batches.
    expected = write_journal(settings, "edge-a", 16)
    query = pipeline.start(edgebus_spark, settings)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    assert_exactly_once(settings, expected)
    messages = read_table(settings.table_path(history.TABLE), columns=["topic"])
    assert messages.num_rows == 4
    assert not any(topic.startswith("$") for topic in messages.column("topic").to_pylist())
