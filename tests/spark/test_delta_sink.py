"""The idempotent Delta writer (Spark's Delta) and the safe light reader (delta-rs)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812

from schemas.tables import MESSAGES_PARTITION_BY, MESSAGES_SCHEMA
from sinks.delta import (
    FILE_COLUMN,
    INLINE_CHECKPOINT_INTERVAL,
    LOG_RETENTION,
    LOG_RETENTION_DEFAULT,
    DeltaTableWriter,
    Replacement,
    log_retention,
    read_table,
    spark_schema,
)
from sinks.errors import DeltaSinkError, SinkSchemaError

pytestmark = pytest.mark.spark

APP = "test.history"


def message(seq: int, *, tenant: str = "acme", day: int = 9, **overrides: Any) -> dict[str, Any]:
    ts = dt.datetime(2024, 3, day, 12, 0, seq % 60, tzinfo=dt.UTC)
    row: dict[str, Any] = {
        "node": "edge-1",
        "seq": seq,
        "ts": ts,
        "date": ts.date(),
        "tenant": tenant,
        "client_id": "truck-7",
        "topic": "fleet/truck-7/telemetry",
        "qos": 1,
        "retain": False,
        "payload": b"abc",
        "payload_text": "abc",
        "content_type": None,
        "user_properties": [{"key": "k", "value": str(seq)}],
        "size": 3,
    }
    row.update(overrides)
    return row


def batch(*rows: dict[str, Any]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=MESSAGES_SCHEMA)


@pytest.fixture
def writer(tmp_path: Path) -> DeltaTableWriter:
    return DeltaTableWriter(tmp_path / "messages", APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)


def frame(spark: SparkSession, *rows: dict[str, Any]) -> DataFrame:
    return spark.createDataFrame(list(rows), schema=spark_schema(MESSAGES_SCHEMA))


def test_replayed_batch_is_skipped(spark: SparkSession, writer: DeltaTableWriter) -> None:
    assert writer.last_batch_id() is None
    writer.append(0, frame(spark, message(1), message(2, tenant="other")))
    writer.append(1, frame(spark, message(3, day=10)))
    version = DeltaTable(writer.path).version()

    writer.append(1, frame(spark, message(3, day=10)))  # the replay after a crash
    writer.append(0, frame(spark, message(1)))

    assert DeltaTable(writer.path).version() == version
    assert writer.last_batch_id() == 1
    seqs = read_table(writer.path, columns=["seq"]).column("seq").to_pylist()
    assert sorted(seqs) == [1, 2, 3]


def test_a_restarted_writer_skips_what_the_table_has(
    spark: SparkSession, writer: DeltaTableWriter
) -> None:
    writer.append(0, frame(spark, message(1)))
    writer.append(1, frame(spark, message(2)))
    # Another commit lands after the writer's (a compaction, another writer's append): the
    # writer's memory of its last commit no longer answers; the log does.
    other = DeltaTableWriter(writer.path, "test.other", MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)
    other.append(7, frame(spark, message(100)))
    writer.append(1, frame(spark, message(2)))
    restarted = DeltaTableWriter(writer.path, APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)
    restarted.append(0, frame(spark, message(1)))
    restarted.append(1, frame(spark, message(2)))
    restarted.append(2, frame(spark, message(3)))

    seqs = read_table(writer.path, columns=["seq"]).column("seq").to_pylist()
    assert sorted(seqs) == [1, 2, 3, 100]
    delta = DeltaTable(writer.path)
    assert delta.transaction_version(APP) == 2
    assert delta.transaction_version("test.other") == 7
    assert delta.history(1)[0]["operation"] == "WRITE"


def test_a_table_of_another_schema_is_refused(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "messages"
    spark.createDataFrame([(1, "a")], "seq long, topic string").write.format("delta").save(
        str(path)
    )
    writer = DeltaTableWriter(path, APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)

    with pytest.raises(SinkSchemaError, match="not the declared"):
        writer.append(0, frame(spark, message(1)))

    assert DeltaTable(str(path)).version() == 0
    assert DeltaTable(str(path)).transaction_version(APP) is None


def test_the_table_has_the_declared_schema_and_partitions(
    spark: SparkSession, writer: DeltaTableWriter
) -> None:
    writer.append(0, frame(spark, message(1), message(2, tenant="other", day=10)))
    delta = DeltaTable(writer.path)
    assert delta.metadata().partition_columns == list(MESSAGES_PARTITION_BY)
    assert (Path(writer.path) / "tenant=other" / "date=2024-03-10").is_dir()
    # Nullability and nested types as declared in schemas/, not as a batch happened to be.
    declared = pa.schema(delta.schema().to_arrow())
    assert [(f.name, f.nullable) for f in declared] == [
        (f.name, f.nullable) for f in MESSAGES_SCHEMA
    ]
    # Protocol 1/2: no table feature the light readers (delta-rs, polars, DuckDB) lack.
    protocol = delta.protocol()
    assert (protocol.min_reader_version, protocol.min_writer_version) == (1, 2)
    # One commit made the table and holds the first batch, with the session's table defaults.
    assert (delta.version(), delta.transaction_version(APP)) == (0, 0)
    assert delta.metadata().configuration == {
        "delta.enableDeletionVectors": "false",
        "delta.checkpointInterval": str(INLINE_CHECKPOINT_INTERVAL),
    }


def test_an_empty_first_batch_still_makes_the_table_with_its_properties(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = tmp_path / "messages"
    stats = ("node", "seq")
    writer = DeltaTableWriter(path, APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY, stats)

    assert writer.append(0, frame(spark)) == 0
    delta = DeltaTable(str(path))
    assert (delta.version(), delta.transaction_version(APP)) == (0, None)
    assert delta.metadata().configuration["delta.dataSkippingStatsColumns"] == "node,seq"
    assert writer.append(1, frame(spark, message(1))) == 1
    made = DeltaTableWriter(tmp_path / "other", APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY, stats)
    made.append(0, frame(spark, message(1)))
    other = DeltaTable(str(tmp_path / "other"))
    assert other.metadata().configuration == delta.metadata().configuration
    assert other.schema() == delta.schema()


def test_a_new_tables_first_commit_runs_no_more_jobs_than_the_next(
    spark: SparkSession, writer: DeltaTableWriter
) -> None:
    # The first commit of a table builds no file list for its .crc (a Spark job over the log,
    # cold in a new pipeline's first batch): streaming.session's allFilesInCrc setting.
    def jobs(batch_id: int, *rows: dict[str, Any]) -> int:
        group = f"first-commit-{batch_id}"
        spark.sparkContext.setJobGroup(group, group)
        try:
            writer.append(batch_id, frame(spark, *rows))
        finally:
            spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
        return len(spark.sparkContext.statusTracker().getJobIdsForGroup(group))

    first = jobs(0, message(1))
    assert first <= jobs(1, message(2))
    checksum = json.loads((Path(writer.path) / "_delta_log" / f"{0:020}.crc").read_text())
    assert checksum["numFiles"] == 1
    assert checksum["metadata"]["id"]  # protocol and metadata stay in it
    assert checksum.get("allFiles") is None


def test_every_nth_version_is_checkpointed_by_a_thread_of_the_writer(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = tmp_path / "messages"
    writer = DeltaTableWriter(path, APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY, checkpoint_every=2)
    for batch_id in range(5):
        writer.append(batch_id, frame(spark, message(batch_id)))
        assert writer.wait_checkpoint(timeout=60)

    log = path / "_delta_log"
    made = sorted(int(p.name.split(".")[0]) for p in log.glob("*.checkpoint.parquet"))
    assert made == [2, 4]
    assert json.loads((log / "_last_checkpoint").read_text())["version"] == 4
    # Delta's own checkpoint in the committing thread is out of reach.
    delta = DeltaTable(str(path))
    assert delta.metadata().configuration["delta.checkpointInterval"] == "1000000"
    # A reader starting from the checkpoint sees every batch and the app transaction.
    assert (delta.version(), delta.transaction_version(APP)) == (4, 4)
    assert sorted(read_table(writer.path, columns=["seq"]).column("seq").to_pylist()) == [
        0,
        1,
        2,
        3,
        4,
    ]
    with pytest.raises(ValueError, match="checkpoint_every"):
        DeltaTableWriter(path, APP, MESSAGES_SCHEMA, checkpoint_every=0)


def test_the_log_keeps_commits_for_the_retention_to_the_minute(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The pipeline's delta_log_retention_hours reaches every table (one made before it too),
    and each checkpoint of the writer deletes the commits it makes unneeded once older than
    the retention, to the minute; every version from the oldest checkpoint kept on reads."""
    path = tmp_path / "messages"
    log = path / "_delta_log"
    writer = DeltaTableWriter(path, APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY, checkpoint_every=3)
    writer.append(0, frame(spark, message(0)))  # version 0, before the setting
    assert LOG_RETENTION not in DeltaTable(str(path)).metadata().configuration
    spark.conf.set(LOG_RETENTION_DEFAULT, log_retention(0.5))
    try:
        writer = DeltaTableWriter(
            path, APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY, checkpoint_every=3
        )
        writer.append(1, frame(spark, message(1)))  # ensure's ALTER is version 1, this 2
        configuration = DeltaTable(str(path)).metadata().configuration
        assert configuration[LOG_RETENTION] == "interval 30 minutes"
        writer.append(2, frame(spark, message(2)))  # version 3, checkpointed
        assert writer.wait_checkpoint(timeout=60)
        # Versions 0-3 and the checkpoint are 31 minutes old, a second apart, the rest new.
        old = time.time() - 31 * 60
        for file in log.glob("0000000000000000000[0-3].*"):
            when = old + int(file.name.split(".")[0])
            os.utime(file, (when, when))
        for batch_id in range(3, 6):  # versions 4-6; 6 is checkpointed, then the log cleaned
            writer.append(batch_id, frame(spark, message(batch_id)))
        assert writer.wait_checkpoint(timeout=60)
    finally:
        spark.conf.unset(LOG_RETENTION_DEFAULT)
    assert sorted({int(p.name.split(".")[0]) for p in log.glob("0*.json")}) == [3, 4, 5, 6]
    assert sorted(p.name for p in log.glob("*.checkpoint.parquet")) == [
        f"{3:020d}.checkpoint.parquet",
        f"{6:020d}.checkpoint.parquet",
    ]
    assert not list(log.glob("0000000000000000000[0-2].crc"))
    # The state and the app transaction are whole, for delta-rs and for Spark.
    delta = DeltaTable(str(path))
    assert (delta.version(), delta.transaction_version(APP)) == (6, 5)
    assert sorted(read_table(writer.path, columns=["seq"]).column("seq").to_pylist()) == list(
        range(6)
    )
    # Time travel reaches every version kept, from the oldest checkpoint on, and no further.
    for version, rows in ((3, 3), (4, 4), (6, 6)):
        assert (
            spark.read.format("delta").option("versionAsOf", version).load(writer.path).count()
            == rows
        )
    with pytest.raises(Exception, match=r"(?i)version"):
        spark.read.format("delta").option("versionAsOf", 2).load(writer.path).count()


def test_rows_come_back_with_the_table_types(spark: SparkSession, writer: DeltaTableWriter) -> None:
    rows = [message(1), message(2, tenant="other", content_type="text/plain")]
    writer.append(0, frame(spark, *rows))
    back = read_table(writer.path, schema=MESSAGES_SCHEMA).sort_by("seq")
    assert back.schema == MESSAGES_SCHEMA
    assert back.to_pylist() == rows
    some = read_table(writer.path, "tenant = 'other' AND seq >= 2", columns=["seq", "tenant"])
    assert some.to_pylist() == [{"seq": 2, "tenant": "other"}]


def test_columns_of_other_types_are_cast(spark: SparkSession, writer: DeltaTableWriter) -> None:
    loose = frame(spark, message(1)).withColumn("seq", F.col("seq").cast("string"))
    writer.append(0, loose)
    assert read_table(writer.path, schema=MESSAGES_SCHEMA).to_pylist() == [message(1)]


def test_batches_that_do_not_fit_are_rejected(
    spark: SparkSession, writer: DeltaTableWriter
) -> None:
    with pytest.raises(SinkSchemaError, match="lack columns \\['size'\\]"):
        writer.append(0, frame(spark, message(1)).drop("size"))
    nulls = frame(spark, message(1)).withColumn("seq", F.lit(None).cast("bigint"))
    with pytest.raises(DeltaSinkError, match="seq"):  # Delta's NOT NULL check
        writer.append(1, nulls)
    assert writer.last_batch_id() is None


USAGE_LIKE = pa.schema(
    [
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("k", pa.int64(), nullable=False),
        pa.field("v", pa.int64(), nullable=False),
    ]
)


def test_a_replacement_is_exactly_once_and_planned_again_after_a_compaction(
    spark: SparkSession, tmp_path: Path
) -> None:
    upserts = DeltaTableWriter(tmp_path / "t", "test.replace", USAGE_LIKE, ("tenant",))

    def rows(*kv: tuple[int, int]) -> DataFrame:
        return spark.createDataFrame(
            [{"tenant": "acme", "k": k, "v": v} for k, v in kv], spark_schema(USAGE_LIKE)
        )

    upserts.append(0, rows((1, 10), (2, 20)))
    upserts.append(1, rows((3, 30)))
    plans: list[set[str]] = []

    def plan(stored: DataFrame) -> Replacement[int]:
        """Set k=2 to 21: its file is replaced, with the other rows in it kept."""
        if not plans:  # a compaction commits between the read and the commit
            spark.sql(f"OPTIMIZE delta.`{upserts.path}`")
        plans.append({row[FILE_COLUMN] for row in stored.collect()})
        (name,) = {row[FILE_COLUMN] for row in stored.where("k = 2").collect()}
        new = (
            stored.where(F.col(FILE_COLUMN) == name)
            .withColumn("v", F.when(F.col("k") == 2, 21).otherwise(F.col("v")))
            .drop(FILE_COLUMN)
        )
        return Replacement(rows=[new], replaced=[name], result=len(plans))

    assert upserts.replace(2, spark, "tenant = 'acme'", plan) == 2  # planned twice
    assert len(plans[0]) >= 2
    assert len(plans[1]) == 1  # the second plan read the compacted file
    assert upserts.replace(2, spark, "tenant = 'acme'", plan) is None  # a replay: skipped
    assert len(plans) == 2
    back = read_table(upserts.path).sort_by("k").to_pylist()
    assert [(r["k"], r["v"]) for r in back] == [(1, 10), (2, 21), (3, 30)]
    assert upserts.last_batch_id() == 2
    history = DeltaTable(upserts.path).history(1)[0]
    assert history["operation"] == "WRITE"
    assert history["operationParameters"]["mode"] == "Overwrite"


def test_reading_a_missing_table_or_bad_sql_is_a_sink_error(
    spark: SparkSession, writer: DeltaTableWriter
) -> None:
    with pytest.raises(DeltaSinkError, match="not a Delta table"):
        read_table(writer.path)
    writer.append(0, frame(spark, message(1)))
    with pytest.raises(DeltaSinkError, match="query failed"):
        read_table(writer.path, "no_such_column = 1")
    with pytest.raises(SinkSchemaError):
        read_table(writer.path, columns=["no_such_column"])


def test_a_file_in_the_way_is_a_sink_error(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "messages"
    path.write_bytes(b"not a table")
    writer = DeltaTableWriter(path, APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)
    with pytest.raises(DeltaSinkError):
        writer.last_batch_id()
    with pytest.raises(DeltaSinkError):
        writer.append(0, frame(spark, message(1)))
    with pytest.raises(DeltaSinkError):
        read_table(path)


READER = textwrap.dedent(
    """
    import sys
    from sinks.delta import read_table
    table = read_table(sys.argv[1], "seq > 1")
    assert table.num_rows == 2, table.num_rows
    """
)


def test_reader_processes_always_exit_cleanly(
    spark: SparkSession, writer: DeltaTableWriter
) -> None:
    # delta-rs can abort the interpreter at exit (134) after to_pyarrow_*: read_table must not.
    writer.append(0, frame(spark, message(1), message(2), message(3, tenant="other")))
    for attempt in range(10):
        done = subprocess.run(
            [sys.executable, "-c", READER, writer.path],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, (attempt, done.returncode, done.stderr)


def test_spark_batches_of_empty_lists_reach_every_table(
    spark: SparkSession, make_settings: Callable[..., Any]
) -> None:
    # Empty lists cross to the JVM as JSON text and come back as empty lists (not nulls) in
    # every table: messages from the stream, the others from the batch's second read. A replay
    # of the batch (its commit marker gone) changes nothing.
    from ingest.journal import JournalWriter
    from streaming import pipeline

    settings = make_settings()
    ts_us = int(dt.datetime(2024, 3, 10, tzinfo=dt.UTC).timestamp() * 1_000_000)
    with JournalWriter.open(settings.journal_root, "edge-1", fsync=False) as journal:
        for i in range(1, 7):
            journal.append(
                ts_us=ts_us + i,
                tenant="acme",
                client_id="dev",
                topic="a/b" if i % 2 else "$log/mqtt/connect",
                qos=1,
                retain=False,
                payload=b"x",
                user_properties=(),
            )
        journal.flush()
    commits = settings.checkpoint_path(pipeline.JOB) / "commits"
    for _ in range(2):
        pipeline.run(settings, once=True, spark=spark)
        (commits / "0").unlink()  # what a crash right after the Delta commits leaves
    back = read_table(settings.table_path("messages"), columns=["seq", "user_properties"])
    assert sorted(back.column("seq").to_pylist()) == [1, 3, 5]
    assert back.column("user_properties").to_pylist() == [[]] * 3
    quarantined = read_table(settings.table_path("quarantine"), columns=["seq", "user_properties"])
    assert sorted(quarantined.column("seq").to_pylist()) == [2, 4, 6]  # not log events
    assert quarantined.column("user_properties").to_pylist() == [[]] * 3
    logs = read_table(settings.table_path("logs"), columns=["seq", "payload_valid"])
    assert sorted(logs.column("seq").to_pylist()) == [2, 4, 6]


def test_a_table_written_before_a_column_existed_gets_it_and_carries_on(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Schema evolution (issue 16 part 4): a table made with an older schema (no
    ``payload_text``) gets the column where the declared schema has it, in one metadata
    commit; the old rows read null there, and the app transaction carries on."""
    older = pa.schema([field for field in MESSAGES_SCHEMA if field.name != "payload_text"])
    old_writer = DeltaTableWriter(tmp_path / "messages", APP, older, MESSAGES_PARTITION_BY)
    old_row = {k: v for k, v in message(1).items() if k != "payload_text"}
    old_writer.append(0, spark.createDataFrame([old_row], schema=spark_schema(older)))
    version = DeltaTable(str(tmp_path / "messages")).version()

    writer = DeltaTableWriter(tmp_path / "messages", APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)
    writer.append(0, frame(spark, message(1)))  # a replay: skipped, upgraded or not
    writer.append(1, frame(spark, message(2)))

    delta = DeltaTable(str(tmp_path / "messages"))
    assert pa.schema(delta.schema().to_arrow()).names == MESSAGES_SCHEMA.names
    history = [entry["operation"] for entry in delta.history()]
    assert history[:2] == ["WRITE", "ADD COLUMNS"]
    assert delta.version() == version + 2
    back = read_table(writer.path, columns=["seq", "payload_text"]).sort_by("seq")
    assert back.to_pylist() == [
        {"seq": 1, "payload_text": None},
        {"seq": 2, "payload_text": "abc"},
    ]
    assert writer.upgrade(spark) == []  # nothing left to add: no commit
    assert DeltaTable(str(tmp_path / "messages")).version() == version + 2
