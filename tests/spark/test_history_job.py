"""The history job end to end: journals on disk -> edgebus source -> Delta ``messages``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from ingest.journal import JournalWriter
from sinks.delta import read_table
from streaming import history, pipeline
from streaming.errors import PipelineError
from streaming.settings import PipelineSettings

pytestmark = pytest.mark.spark

Id = tuple[str, int]
BASE_TS_US = 1_710_028_800_000_000  # 2024-03-10T00:00:00Z
# Parquet's names for dictionary-encoded pages (format v1 and v2).
DICTIONARY_ENCODINGS = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}


@pytest.fixture
def settings(make_settings: Callable[..., PipelineSettings]) -> PipelineSettings:
    # A small batch cap so a run spans several micro-batches.
    return make_settings(max_records_per_batch=7)


def journal(settings: PipelineSettings, node: str, topics: Iterable[str]) -> set[Id]:
    """Append one record per topic to ``node``'s journal; the ids of the non-``$`` ones."""
    kept: set[Id] = set()
    with JournalWriter.open(settings.journal_root, node, fsync=False) as writer:
        for i, topic in enumerate(topics):
            seq = writer.append(
                ts_us=BASE_TS_US + i * 3_600_000_000,  # one per hour: spans two UTC days
                tenant="acme" if i % 3 else "other",
                client_id=f"truck-{i}",
                topic=topic,
                qos=i % 3,
                retain=False,
                payload=f"payload {i}".encode(),
                user_properties=(("i", str(i)),),
            )
            if not topic.startswith("$"):
                kept.add((node, seq))
        writer.flush()
    return kept


def traffic(n: int) -> list[str]:
    return ["$log/edge/connect" if i % 5 == 0 else f"fleet/truck-{i}/telemetry" for i in range(n)]


def message_ids(settings: PipelineSettings) -> Counter[Id]:
    table = read_table(settings.table_path("messages"), columns=["node", "seq"])
    return Counter(
        zip(table.column("node").to_pylist(), table.column("seq").to_pylist(), strict=True)
    )


def assert_exactly_once(settings: PipelineSettings, expected: set[Id]) -> None:
    ids = message_ids(settings)
    assert set(ids) == expected
    assert max(ids.values()) == 1


def delta_version(settings: PipelineSettings) -> int:
    version: int = DeltaTable(str(settings.table_path("messages"))).version()
    return version


def test_every_record_lands_exactly_once(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    expected = journal(settings, "edge-a", traffic(20)) | journal(settings, "edge-b", traffic(13))

    pipeline.run(settings, once=True, spark=edgebus_spark)
    assert_exactly_once(settings, expected)
    version = delta_version(settings)

    pipeline.run(settings, once=True, spark=edgebus_spark)  # nothing new: nothing written
    assert_exactly_once(settings, expected)
    assert delta_version(settings) == version

    expected |= journal(settings, "edge-a", traffic(9))
    pipeline.run(settings, once=True, spark=edgebus_spark)
    assert_exactly_once(settings, expected)

    dollar = read_table(settings.table_path("messages"), "starts_with(topic, '$')")
    assert dollar.num_rows == 0
    # The source caps batches at 7 records: the runs above took several micro-batches.
    last_batch = DeltaTable(str(settings.table_path("messages"))).transaction_version(
        history.APP_ID
    )
    assert last_batch is not None
    assert last_batch >= 4


def test_payloads_and_device_ids_are_written_without_a_dictionary(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    """``payload`` and ``payload_text`` are nearly all distinct, and ``client_id`` and
    ``topic`` name a fleet's thousands of devices: their pages are PLAIN, with no dictionary
    lookup per row (BENCHMARKS.md, issues 18 and 12); other columns keep theirs."""
    # Enough rows in one file for a repeated column's dictionary to pay (Parquet falls back to
    # PLAIN where it does not, as for a few rows): 20 devices, 100 publishes each.
    settings = dataclasses.replace(settings, max_records_per_batch=5_000)
    with JournalWriter.open(settings.journal_root, "edge-a", fsync=False) as writer:
        for i in range(2_000):
            writer.append(
                ts_us=BASE_TS_US + i * 1_000_000,
                tenant="acme",
                client_id=f"truck-{i % 20}",
                topic=f"fleet/truck-{i % 20}/telemetry",
                qos=1,
                retain=False,
                payload=f"payload {i}".encode(),
            )
        writer.flush()
    pipeline.run(settings, once=True, spark=edgebus_spark)

    files = DeltaTable(str(settings.table_path("messages"))).file_uris()
    assert files
    for uri in files:
        row_group = pq.ParquetFile(uri.removeprefix("file://")).metadata.row_group(0)
        encodings = {
            row_group.column(i).path_in_schema: set(row_group.column(i).encodings)
            for i in range(row_group.num_columns)
        }
        for column in ("payload", "payload_text", "client_id", "topic"):
            assert not encodings[column] & DICTIONARY_ENCODINGS, (column, encodings[column])
        for column in ("node", "tenant", "qos"):  # a value or three: a dictionary pays
            assert encodings[column] & DICTIONARY_ENCODINGS, (column, encodings[column])


def test_crash_between_delta_commit_and_spark_commit(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    expected = journal(settings, "edge-a", traffic(10))
    pipeline.run(settings, once=True, spark=edgebus_spark)
    version = delta_version(settings)

    # What a SIGKILL right after the Delta commit leaves: the batch is in the table, but
    # Spark never wrote its commit marker, so the restart replays it.
    commits = settings.checkpoint_path(pipeline.JOB) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    (commits / str(last)).unlink()

    pipeline.run(settings, once=True, spark=edgebus_spark)
    assert_exactly_once(settings, expected)
    assert delta_version(settings) == version  # the replay was recognised, not re-appended
    assert (commits / str(last)).exists()

    expected |= journal(settings, "edge-a", traffic(4))
    pipeline.run(settings, once=True, spark=edgebus_spark)
    assert_exactly_once(settings, expected)


def test_a_lost_checkpoint_refuses_to_start(
    edgebus_spark: SparkSession, settings: PipelineSettings
) -> None:
    journal(settings, "edge-a", traffic(10))
    pipeline.run(settings, once=True, spark=edgebus_spark)
    for path in sorted(settings.checkpoint_path(pipeline.JOB).rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()

    with pytest.raises(PipelineError, match="checkpoint"):
        pipeline.run(settings, once=True, spark=edgebus_spark)
    assert not edgebus_spark.streams.active


def test_long_run_stops_when_asked(edgebus_spark: SparkSession, settings: PipelineSettings) -> None:
    # Quality and maintenance every second: both schedules must run beside the stream.
    settings = dataclasses.replace(
        settings, quality_interval_seconds=1.0, maintenance_interval_seconds=1.0
    )
    expected = journal(settings, "edge-a", traffic(12))
    stop = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            pipeline.run(settings, once=False, stop=stop, spark=edgebus_spark)
        except BaseException as exc:  # handed to the test thread below
            errors.append(exc)

    runner = threading.Thread(target=target)
    runner.start()
    try:
        query = wait_for_query(edgebus_spark, pipeline.JOB)
        query.processAllAvailable()
        assert_exactly_once(settings, expected)
        quality = settings.table_path("quality_results")
        log = settings.table_path("messages") / "_delta_log"
        deadline = time.monotonic() + 120

        def validated() -> bool:
            if not DeltaTable.is_deltatable(str(quality)):
                return False
            return read_table(quality, "\"table\" = 'messages'", columns=["success"]).num_rows > 0

        logs = settings.table_path("logs")

        def expired() -> bool:  # 2024's log events: older than the 30 days logs keep
            return read_table(logs, columns=["seq"]).num_rows == 0

        while time.monotonic() < deadline and not (
            validated() and any(log.glob("*.checkpoint.parquet")) and expired()
        ):
            time.sleep(0.5)  # the schedules' threads signal nothing a test can await
        results = read_table(quality, "\"table\" = 'messages'", columns=["success"])
        assert results.num_rows > 0
        assert all(results.column("success").to_pylist())
        assert any(log.glob("*.checkpoint.parquet")), "maintenance never checkpointed messages"
        assert expired(), "maintenance never expired the old logs"
        assert_exactly_once(settings, expected)  # messages keep everything by default
    finally:
        stop.set()
        runner.join(timeout=60)
    assert not runner.is_alive()
    assert errors == []
    assert not edgebus_spark.streams.active


@pytest.mark.parametrize("once", [True, False])
def test_a_failing_query_fails_the_run(
    edgebus_spark: SparkSession, settings: PipelineSettings, once: bool
) -> None:
    journal(settings, "edge-a", traffic(3))
    # A table of another shape already sits where messages go: the first batch cannot land.
    DeltaTable.create(settings.table_path("messages"), pa.schema([pa.field("x", pa.int64())]))

    with pytest.raises(StreamingQueryException):
        pipeline.run(settings, once=once, spark=edgebus_spark)
    assert not edgebus_spark.streams.active


PIPELINE_PROCESS = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from sinks.delta import read_table
    from streaming import pipeline
    from streaming.session import build_spark
    from streaming.settings import PipelineSettings

    settings = PipelineSettings(
        data_dir=Path(sys.argv[1]), lake=Path(sys.argv[2]), master="local[1]",
        shuffle_partitions=3, driver_memory="1g",
    )
    conf = build_spark(settings).conf
    assert conf.get("spark.app.name") == "edgebus-pipeline"
    assert conf.get("spark.sql.session.timeZone") == "UTC"
    assert conf.get("spark.sql.shuffle.partitions") == "3"
    assert conf.get("spark.ui.enabled") == "false"
    pipeline.run(settings, once=True)  # builds (joins) the session and stops it
    rows = read_table(settings.table_path("messages"), columns=["seq"])
    assert rows.num_rows == int(sys.argv[3]), rows.num_rows
    """
)


def test_pipeline_process_runs_once_and_exits_cleanly(settings: PipelineSettings) -> None:
    # The real entry path in its own process: its own session, stopped by run(), then a Delta
    # read in the same interpreter, which must still exit 0 (delta-rs and the JVM both loaded).
    expected = journal(settings, "edge-a", traffic(10))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            PIPELINE_PROCESS,
            str(settings.data_dir),
            str(settings.lake),
            str(len(expected)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert_exactly_once(settings, expected)


def wait_for_query(spark: SparkSession, name: str, timeout: float = 60.0) -> StreamingQuery:
    # Spark offers no "query started" event to Python; poll its registry briefly.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for query in spark.streams.active:
            if query.name == name:
                return query
        time.sleep(0.05)
    raise AssertionError(f"query {name!r} did not start within {timeout}s")
