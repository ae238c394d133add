"""A lake and checkpoint written by the delta-rs pipeline (before issue 18) carry on under Spark's
Delta with no duplicate and no gap, and maintenance repairs their view-typed files.

``tests/data/lake_before_delta_spark.tar.gz`` was written by that pipeline (commit 70ed61e):
two nodes' journals of 62 records each (messages, log events, a JSON-contract breach, counters)
processed in four micro-batches of at most 40 records. Its ``usage`` files carry
``string_view`` columns (the defect of issue 16 part 1).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import time
from collections import Counter as Multiset
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from counter_records import Counter, write_counters
from delta.tables import DeltaTable as SparkDeltaTable
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from broker_edge.plim import disconnect_details, log_event
from ingest.journal import JournalWriter
from schemas.tables import TABLES
from sinks.delta import read_table
from sinks.maintenance import maintain_table, pending_work, view_typed_files
from streaming import lake, pipeline
from streaming.settings import PipelineSettings

pytestmark = pytest.mark.spark

ARCHIVE = Path(__file__).parents[1] / "data" / "lake_before_delta_spark.tar.gz"
NODES = ("edge-a", "edge-b")
BEFORE = 62  # records per node in the archive's journals
# The columns of issue 16 part 4 the archive's tables lack (it has no quota_events table).
NEW_COLUMNS = {
    "messages": ("payload_text",),
    "logs": ("reason", "reason_code", "topic", "qos", "metric", "limit", "value"),
    "usage": ("quota_metric",),
}


@pytest.fixture
def settings(make_settings: Callable[..., PipelineSettings]) -> PipelineSettings:
    """The archive unpacked where ``make_settings`` puts the data dir and the lake."""
    unpacked = make_settings(max_records_per_batch=40)
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(unpacked.data_dir.parent, filter="data")
    return unpacked


def identities(settings: PipelineSettings, table: str) -> Multiset[tuple[str, int]]:
    rows = read_table(settings.table_path(table), columns=["node", "seq"]).to_pylist()
    return Multiset((row["node"], row["seq"]) for row in rows)


def test_the_old_lake_carries_on_exactly_once(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    old_messages = identities(settings, "messages")
    old_batches = DeltaTable(str(settings.table_path("messages"))).transaction_version(
        "edgebus.history"
    )
    assert old_batches is not None
    assert sum(old_messages.values()) == 100
    # Before the pipeline upgrades it, a reader sees the columns the old lake lacks, as nulls.
    for table, columns in NEW_COLUMNS.items():
        assert not set(columns) & set(
            DeltaTable(str(settings.table_path(table))).schema().to_arrow().names
        )
        rows = lake.load_arrow(settings.lake, table)
        assert rows.schema == TABLES[table].schema
        assert rows.num_rows
        assert all(rows.column(name).null_count == rows.num_rows for name in columns)
    old_logs = lake.load_arrow(settings.lake, "logs").num_rows
    for node in NODES:
        with JournalWriter.open(settings.journal_root, node, fsync=False) as writer:
            topic, payload = log_event(
                ts_us=1_710_028_800_000_000 + 10**9,
                node=node,
                tenant="acme",
                client_id="truck-9",
                origin="mqtt",
                event="disconnect",
                details=disconnect_details(peer="127.0.0.1:5000", clean=False, reason_code=0x8D),
            )
            writer.append(
                ts_us=1_710_028_800_000_000 + 10**9,
                tenant="acme",
                client_id="$edge",
                topic=topic,
                qos=0,
                retain=False,
                payload=payload,
            )
            for i in range(30):
                writer.append(
                    ts_us=1_710_028_800_000_000 + 10**9 + i,
                    tenant="acme",
                    client_id="truck-9",
                    topic=f"fleet/new/{i}",
                    qos=1,
                    retain=False,
                    payload=b'{"speed": 3}',
                    content_type="application/json",
                )
            writer.flush()
        write_counters(settings.journal_root, node, [Counter("acme", "messages_in", 15, 7)])

    pipeline.run(settings, once=True, spark=edgebus_spark)

    messages = identities(settings, "messages")
    assert max(messages.values()) == 1, "a record landed twice"
    new = {(node, seq) for node in NODES for seq in range(BEFORE + 2, BEFORE + 32)}
    assert set(messages) == set(old_messages) | new, "a record is missing"
    assert max(identities(settings, "logs").values()) == 1
    assert max(identities(settings, "quarantine").values()) == 1
    # The same app ids carry on: the batch ids go on from the old checkpoint's.
    delta = DeltaTable(str(settings.table_path("messages")))
    assert delta.transaction_version("edgebus.history") > old_batches
    # Usage: the old rows (5 per node at 00:00:10) and the new ones (7 per node) summed.
    usage = read_table(settings.table_path("usage"), "metric = 'messages_in'").to_pylist()
    assert [(row["value"], row["day_value"]) for row in usage] == [(24, 24)]
    # The new columns (issue 16 part 4) were added to the tables, where the schema has them:
    # null in the old rows, filled in the new ones, for every reader.
    for table in NEW_COLUMNS:
        stored = DeltaTable(str(settings.table_path(table))).schema().to_arrow().names
        assert stored == TABLES[table].schema.names, table
    texts = {
        (row["seq"] > BEFORE, row["payload_text"])
        for row in lake.load_arrow(settings.lake, "messages").to_pylist()
    }
    assert texts == {(False, None), (True, '{"speed": 3}')}
    logs = lake.load(edgebus_spark, settings.lake, "logs").collect()
    assert len(logs) == old_logs + 2
    assert {(row.seq > BEFORE, row.event_type, row.reason_code) for row in logs} >= {
        (True, "disconnect", 0x8D)
    }
    assert all(row.reason_code is None for row in logs if row.seq <= BEFORE)
    # The usage row the batch rewrote names its quota metric.
    assert [row["quota_metric"] for row in usage] == ["messages_per_day"]


def test_maintenance_repairs_view_typed_files_and_keeps_every_row(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    usage = settings.table_path("usage")
    broken = view_typed_files(usage)
    assert broken, "the archive's usage files should carry string_view"
    before = read_table(usage).sort_by([("metric", "ascending")]).to_pylist()
    version = DeltaTable(str(usage)).version()

    report = maintain_table(edgebus_spark, usage, vacuum_retention_hours=0)

    assert report.partitions_repaired == len({tuple(v.items()) for v in broken.values()})
    assert view_typed_files(usage) == {}
    assert read_table(usage).sort_by([("metric", "ascending")]).to_pylist() == before
    for uri in DeltaTable(str(usage)).file_uris():
        schema = pq.read_schema(uri.removeprefix("file://"))
        assert "view" not in str(schema), uri
    # Retention 0: the replaced files are gone from disk, the old version's data with them.
    on_disk = {p.name for p in usage.rglob("*.parquet") if "_delta_log" not in p.parts}
    assert on_disk == {Path(u).name for u in DeltaTable(str(usage)).file_uris()}
    # App transactions survive the rewrite: a replay is still recognised.
    assert DeltaTable(str(usage)).transaction_version("edgebus.usage") is not None
    assert report.version_after > version


def test_compaction_leaves_one_file_per_partition_and_every_row_once(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    messages = settings.table_path("messages")
    before = identities(settings, "messages")
    files = len(DeltaTable(str(messages)).file_uris())
    partitions = {Path(u).parent for u in DeltaTable(str(messages)).file_uris()}
    assert files > len(partitions)

    report = maintain_table(edgebus_spark, messages, vacuum_retention_hours=168)

    assert report.files_removed - report.files_added == files - len(partitions)
    assert len(DeltaTable(str(messages)).file_uris()) == len(partitions)
    assert identities(settings, "messages") == before
    assert any((messages / "_delta_log").glob("*.checkpoint.parquet"))
    # Maintained: nothing left to do, and nothing is done (no commit, not even a VACUUM's).
    commits = sorted((messages / "_delta_log").glob("*.json"))
    assert not pending_work(edgebus_spark, messages, 168)
    again = maintain_table(edgebus_spark, messages, vacuum_retention_hours=168)
    assert (again.version_before, again.version_after) == (report.version_after,) * 2
    assert (again.files_removed, again.vacuumed_files) == (0, 0)
    assert sorted((messages / "_delta_log").glob("*.json")) == commits


def test_vacuum_keeps_removed_files_exactly_as_long_as_the_retention_says(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    """Maintenance vacuums by ``vacuum_retention_hours``, not by the table's own 7 days (Delta
    logs that it ignores a retention other than 0 hours; it does not, and this says so)."""
    logs = settings.table_path("logs")

    def on_disk() -> set[str]:
        return {p.name for p in logs.rglob("*.parquet") if "_delta_log" not in p.parts}

    def live() -> set[str]:
        return {Path(u).name for u in DeltaTable(str(logs)).file_uris()}

    SparkDeltaTable.forPath(edgebus_spark, str(logs)).optimize().executeCompaction()
    replaced = on_disk() - live()
    assert replaced  # compacted: the files it replaced are still there
    # A file no commit names (a write that died before its commit) goes too, once as old.
    partition = next(iter(live()))
    orphan = next(logs.rglob(partition)).with_name("part-orphan.snappy.parquet")
    orphan.write_bytes(next(logs.rglob(partition)).read_bytes())
    assert pending_work(edgebus_spark, logs, 168).vacuum is False  # younger than 168 h
    time.sleep(2.5)
    assert pending_work(edgebus_spark, logs, 2 / 3600).vacuum
    report = maintain_table(edgebus_spark, logs, vacuum_retention_hours=2 / 3600)  # 2 s
    assert report.vacuumed_files == len(replaced) + 1
    assert on_disk() == live()
    assert not orphan.exists()


def tenants_of(settings: PipelineSettings, table: str) -> list[str]:
    return read_table(settings.table_path(table), columns=["tenant"]).column(0).to_pylist()


def maintain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgebus.cli", "maintain", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_edgebus_maintain_repairs_a_lake_once_as_a_command(
    settings: PipelineSettings, tmp_path: Path
) -> None:
    """Also retention: the archive's rows are of 2024-03-10, older than the 30 days ``logs``
    keeps by default and than the 30 days of ``messages`` the tenants file gives acme; globex
    keeps its messages forever (the default)."""
    assert view_typed_files(settings.table_path("usage"))
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        '[tenants.acme]\ntokens = ["a"]\nmessages_retention_days = 30\n'
        '[tenants.globex]\ntokens = ["g"]\n'
    )
    messages = Multiset(tenants_of(settings, "messages"))
    assert set(messages) == {"acme", "globex"}
    assert read_table(settings.table_path("logs")).num_rows > 0

    done = maintain("--lake", str(settings.lake), "--tenants", str(tenants))

    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: v" in done.stdout
    assert "1 partitions repaired" in done.stdout
    for table in ("messages", "logs", "usage", "quarantine"):
        assert view_typed_files(settings.table_path(table)) == {}
    kept = Multiset(tenants_of(settings, "messages"))
    assert kept == Multiset({"globex": messages["globex"]})
    assert read_table(settings.table_path("logs")).num_rows == 0
    assert f"{messages['acme']} rows expired; acme: 1 partitions before" in done.stdout
    missing = maintain("--lake", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert "no such lake" in missing.stderr
    (tmp_path / "bad.toml").write_text('[tenants.acme]\ntokens = ["a"]\nlogs_retention_days = -1\n')
    bad = maintain("--lake", str(settings.lake), "--tenants", str(tmp_path / "bad.toml"))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"edgebus: bad tenants file: {tmp_path / 'bad.toml'}: tenants.acme.logs_retention_days: "
        "must be a whole number of days >= 0 (0: forever), got -1"
    ]
