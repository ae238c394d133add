"""The ``edgebus`` streaming source against a real local SparkSession (see conftest.py)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyspark.errors import AnalysisException, StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from ingest import source
from ingest.journal import (
    FILE_HEADER,
    FRAME_HEADER,
    JournalGapError,
    JournalReader,
    JournalWriter,
    list_segments,
)
from ingest.source import (
    PARTITION_RECORDS,
    EdgebusStreamReader,
    JournalRange,
    SourceOptionError,
    SourceOptions,
    cap_offsets,
    checkpointed_offset,
)
from schemas.journal import JOURNAL_SCHEMA

pytestmark = pytest.mark.spark

Batches = list[tuple[int, list[dict[str, Any]]]]


def write_records(root: Path, node: str, count: int, *, group: int = 4) -> None:
    """Append ``count`` records to ``node``'s journal, committed in groups of ``group``."""
    with JournalWriter.open(root, node) as w:
        for _ in range(count):
            seq = w.next_seq
            w.append(
                ts_us=1_700_000_000_000_000 + seq,
                tenant=f"tenant-{seq % 2}",
                client_id=f"{node}-client",
                topic=f"fleet/{node}/{seq}",
                qos=seq % 3,
                retain=seq % 5 == 0,
                payload=f"{node}:{seq}".encode() * (seq % 4),
                content_type="text/plain" if seq % 2 else None,
                user_properties=(("seq", str(seq)),) if seq % 3 == 0 else (),
            )
            if seq % group == 0:
                w.flush()
        w.flush()


def journal_rows(root: Path, node: str, after: int = 0) -> list[dict[str, Any]]:
    reader = JournalReader(root / node)
    return [row for b in reader.read(after, reader.last_seq()) for row in b.to_pylist()]


def run_query(spark: SparkSession, root: Path, checkpoint: Path, **options: str) -> Batches:
    """Run the source into foreachBatch until nothing is left; return rows per batch id."""
    batches: Batches = []

    def collect(df: DataFrame, batch_id: int) -> None:
        table = df.toArrow()
        batches.append((batch_id, table.to_pylist()))

    reader = spark.readStream.format("edgebus").option("path", str(root))
    for key, value in options.items():
        reader = reader.option(key, value)
    query = (
        reader.load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    return batches


def keys(batches: Batches) -> list[tuple[str, int]]:
    return [(row["node"], row["seq"]) for _, rows in batches for row in rows]


def sizes(batches: Batches) -> list[int]:
    return [len(rows) for _, rows in batches if rows]


# --- whole queries -------------------------------------------------------------------------------


def test_every_record_exactly_once_with_all_fields(
    edgebus_spark: SparkSession, tmp_path: Path
) -> None:
    root = tmp_path / "journal"
    write_records(root, "edge-a", 30, group=7)
    write_records(root, "edge-b", 45, group=1)
    batches = run_query(edgebus_spark, root, tmp_path / "ckpt")

    got = keys(batches)
    assert len(got) == len(set(got)) == 75
    by_key = {(r["node"], r["seq"]): r for _, rows in batches for r in rows}
    expected = journal_rows(root, "edge-a") + journal_rows(root, "edge-b")
    assert [by_key[(r["node"], r["seq"])] for r in expected] == expected
    assert expected[5]["user_properties"] == [{"key": "seq", "value": "6"}]


def test_schema_is_the_journal_schema(edgebus_spark: SparkSession, tmp_path: Path) -> None:
    df = edgebus_spark.readStream.format("edgebus").option("path", str(tmp_path)).load()
    assert df.schema == source.journal_spark_schema()
    assert [f.name for f in df.schema.fields] == JOURNAL_SCHEMA.names
    types = {f.name: f.dataType.simpleString() for f in df.schema.fields}
    assert types["ts"] == "timestamp"
    assert types["payload"] == "binary"
    assert types["qos"] == "tinyint"
    assert types["user_properties"] == "array<struct<key:string,value:string>>"


def test_batches_are_capped_and_shared_fairly(edgebus_spark: SparkSession, tmp_path: Path) -> None:
    root = tmp_path / "journal"
    write_records(root, "edge-a", 37)
    write_records(root, "edge-b", 12)
    batches = run_query(edgebus_spark, root, tmp_path / "ckpt", maxRecordsPerBatch="10")

    assert all(size <= 10 for size in sizes(batches))
    assert len(sizes(batches)) == 5
    got = keys(batches)
    assert sorted(got) == sorted(
        [("edge-a", s) for s in range(1, 38)] + [("edge-b", s) for s in range(1, 13)]
    )
    first = [row["node"] for row in batches[0][1]]
    assert (first.count("edge-a"), first.count("edge-b")) == (5, 5)


@pytest.mark.parametrize("pass_checkpoint", [True, False], ids=["option", "spark-hook-only"])
def test_restart_continues_without_duplicates_and_keeps_the_cap(
    edgebus_spark: SparkSession, tmp_path: Path, pass_checkpoint: bool
) -> None:
    root, checkpoint = tmp_path / "journal", tmp_path / "ckpt"
    options = {"maxRecordsPerBatch": "8"}
    if pass_checkpoint:
        options["checkpointLocation"] = str(checkpoint)
    write_records(root, "edge-a", 20)
    write_records(root, "edge-b", 6)
    first = run_query(edgebus_spark, root, checkpoint, **options)
    write_records(root, "edge-a", 9)
    write_records(root, "edge-b", 14)
    write_records(root, "edge-c", 3)  # a node that appears while the query is down
    second = run_query(edgebus_spark, root, checkpoint, **options)

    assert all(size <= 8 for size in sizes(first) + sizes(second))
    assert min(bid for bid, _ in second) > max(bid for bid, _ in first)
    assert sorted(keys(first)) == [("edge-a", s) for s in range(1, 21)] + [
        ("edge-b", s) for s in range(1, 7)
    ]
    assert sorted(keys(second)) == (
        [("edge-a", s) for s in range(21, 30)]
        + [("edge-b", s) for s in range(7, 21)]
        + [("edge-c", s) for s in range(1, 4)]
    )
    # The first batch after the restart continues from the checkpoint: a full, fair batch.
    assert sizes(second)[0] == 8


def test_corrupt_journal_fails_the_query_naming_the_file(
    edgebus_spark: SparkSession, tmp_path: Path
) -> None:
    root = tmp_path / "journal"
    write_records(root, "edge-a", 12, group=4)
    (_, path), *_ = list_segments(root / "edge-a")
    data = bytearray(path.read_bytes())
    _, body_len, _, _, _ = FRAME_HEADER.unpack_from(data, len(FILE_HEADER))
    second_frame = len(FILE_HEADER) + FRAME_HEADER.size + body_len
    data[second_frame + FRAME_HEADER.size + 10] ^= 0xFF
    path.write_bytes(bytes(data))

    with pytest.raises(StreamingQueryException) as info:
        run_query(edgebus_spark, root, tmp_path / "ckpt")
    assert str(path) in str(info.value)
    assert f"byte offset {second_frame}" in str(info.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "option 'path'"),
        ({"path": "x", "maxRecordsPerBatch": "0"}, "option 'maxRecordsPerBatch'"),
        ({"path": "x", "maxRecordsPerBatch": "many"}, "option 'maxRecordsPerBatch'"),
        ({"path": "x", "checkpointLocation": "s3a://b/c"}, "option 'checkpointLocation'"),
        ({"path": "x", "maxRecordPerBatch": "5"}, "unknown option"),
    ],
)
def test_bad_options_fail_at_load(
    edgebus_spark: SparkSession, options: dict[str, str], message: str
) -> None:
    reader = edgebus_spark.readStream.format("edgebus").options(**options)
    with pytest.raises(AnalysisException, match=message):
        reader.load()


# --- the restart mechanism, checked against a checkpoint Spark really wrote ----------------------


def test_reader_recovers_the_planned_end_from_the_checkpoint(
    edgebus_spark: SparkSession, tmp_path: Path
) -> None:
    root, checkpoint = tmp_path / "journal", tmp_path / "ckpt"
    write_records(root, "edge-a", 11)
    write_records(root, "edge-b", 3)
    run_query(edgebus_spark, root, checkpoint, maxRecordsPerBatch="100")

    # The offset log format this relies on: "v1", metadata JSON, then our offset.
    last = max(int(p.name) for p in (checkpoint / "offsets").iterdir() if p.name.isdigit())
    lines = (checkpoint / "offsets" / str(last)).read_text().splitlines()
    assert lines[0] == "v1"
    assert "batchWatermarkMs" in json.loads(lines[1])
    assert json.loads(lines[2]) == {"edge-a": 11, "edge-b": 3}
    assert checkpointed_offset(checkpoint) == {"edge-a": 11, "edge-b": 3}

    write_records(root, "edge-a", 10)
    write_records(root, "edge-b", 10)
    opts = {"path": str(root), "maxRecordsPerBatch": "6"}
    with_ckpt = EdgebusStreamReader(
        SourceOptions.parse({**opts, "checkpointLocation": f"file://{checkpoint}"})
    )
    assert with_ckpt.latestOffset() == {"edge-a": 14, "edge-b": 6}
    # Without it (and before Spark's restart call to partitions) it would start from zero.
    blind = EdgebusStreamReader(SourceOptions.parse(opts))
    assert blind.latestOffset() == {"edge-a": 3, "edge-b": 3}
    # Spark 4.1 calls partitions(latest, latest) on restart; that alone restores the position.
    hooked = EdgebusStreamReader(SourceOptions.parse(opts))
    assert hooked.partitions({"edge-a": 11, "edge-b": 3}, {"edge-a": 11, "edge-b": 3}) == []
    assert hooked.latestOffset() == {"edge-a": 14, "edge-b": 6}


def test_no_checkpoint_yet_means_start_from_zero(tmp_path: Path) -> None:
    assert checkpointed_offset(tmp_path / "never-ran") == {}
    (tmp_path / "offsets").mkdir()
    assert checkpointed_offset(tmp_path) == {}
    (tmp_path / "offsets" / "0").write_text('v1\n{"batchWatermarkMs":0}\n-\n{"x": [1]}')
    assert checkpointed_offset(tmp_path) == {}


def test_lost_journal_records_are_reported(tmp_path: Path) -> None:
    write_records(tmp_path, "edge-a", 5)
    reader = EdgebusStreamReader(SourceOptions.parse({"path": str(tmp_path)}))
    reader.partitions({}, {"edge-a": 9})
    with pytest.raises(source.SourceError, match=r"ends at seq 5 .* planned up to seq 9"):
        reader.latestOffset()


def test_records_removed_before_the_query_read_them_stop_it(tmp_path: Path) -> None:
    """Retention or a person removed segments past the query's offset: a clear error naming
    the node and the missing seqs, never a silent skip (issue 9)."""
    with JournalWriter.open(tmp_path, "edge-a", segment_bytes=4096) as writer:
        for i in range(200):
            writer.append(
                ts_us=i, tenant="t", client_id="c", topic="x", qos=0, retain=False, payload=b"p"
            )
            writer.flush()
        segments = list_segments(tmp_path / "edge-a")
        writer.remove_committed(segments[2][0] - 1, 0, now=9e12)  # the lake "has" them
    oldest = segments[2][0]
    reader = EdgebusStreamReader(SourceOptions.parse({"path": str(tmp_path)}))
    reader.partitions({}, {"edge-a": 7})  # where a checkpoint left it
    with pytest.raises(
        source.SourceError, match=rf"node 'edge-a' no longer has seqs 8\.\.{oldest - 1}"
    ):
        reader.latestOffset()
    # Reading such a range on an executor fails the same way, naming the node.
    with pytest.raises(JournalGapError, match=rf"node 'edge-a': seqs 8\.\.{oldest - 1}"):
        list(reader.read(JournalRange("edge-a", 7, 20)))
    # A query that read up to the oldest remaining segment goes on.
    caught_up = EdgebusStreamReader(SourceOptions.parse({"path": str(tmp_path)}))
    caught_up.partitions({}, {"edge-a": oldest - 1})
    assert caught_up.latestOffset() == {"edge-a": 200}


# --- planning and reading without Spark ----------------------------------------------------------


def test_partitions_split_large_ranges_and_skip_empty_ones(tmp_path: Path) -> None:
    reader = EdgebusStreamReader(SourceOptions.parse({"path": str(tmp_path)}))
    n = PARTITION_RECORDS
    start = {"a": 7, "b": 5, "c": 3}
    end = {"a": 7 + 2 * n + 1, "b": 5, "c": 4, "d": 2}
    assert reader.partitions(start, end) == [
        JournalRange("a", 7, 7 + n),
        JournalRange("a", 7 + n, 7 + 2 * n),
        JournalRange("a", 7 + 2 * n, 7 + 2 * n + 1),
        JournalRange("c", 3, 4),
        JournalRange("d", 0, 2),
    ]
    with pytest.raises(source.SourceError, match="node 'b' went backwards"):
        reader.partitions({"b": 5}, {"b": 4})
    with pytest.raises(source.SourceError, match="not an offset"):
        reader.partitions({"a": "7"}, end)  # type: ignore[dict-item]


def test_same_range_always_yields_the_same_rows(tmp_path: Path) -> None:
    write_records(tmp_path, "edge-a", 40, group=6)
    reader = EdgebusStreamReader(SourceOptions.parse({"path": str(tmp_path)}))

    def replay() -> list[pa.RecordBatch]:
        return [b for p in reader.partitions({"edge-a": 3}, {"edge-a": 31}) for b in reader.read(p)]

    once, twice = replay(), replay()
    assert pa.Table.from_batches(once).equals(pa.Table.from_batches(twice))
    assert pa.Table.from_batches(once).column("seq").to_pylist() == list(range(4, 32))


def test_option_parsing() -> None:
    parsed = SourceOptions.parse({"PATH": "/j", "maxrecordsperbatch": "5"})
    assert (parsed.journal_root, parsed.max_records_per_batch, parsed.checkpoint) == (
        Path("/j"),
        5,
        None,
    )
    assert SourceOptions.parse({"path": "/j"}).max_records_per_batch == 500_000
    assert SourceOptions.parse(
        {"path": "/j", "checkpointLocation": "file:///c"}
    ).checkpoint == Path("/c")
    with pytest.raises(SourceOptionError, match="'path'"):
        SourceOptions.parse({"path": ""})


# --- capping -------------------------------------------------------------------------------------


def test_cap_examples() -> None:
    assert cap_offsets({}, {"a": 37, "b": 12}, 10) == {"a": 5, "b": 5}
    assert cap_offsets({"a": 35, "b": 10}, {"a": 37, "b": 12}, 10) == {"a": 37, "b": 12}
    assert cap_offsets({"a": 5, "b": 10}, {"a": 37, "b": 12}, 10) == {"a": 13, "b": 12}
    # Fewer records than nodes: the largest backlogs first.
    assert cap_offsets({}, {"a": 2, "b": 9, "c": 9}, 1) == {"a": 0, "b": 1, "c": 0}
    # A node known only from the planned offset (its directory is gone) stays where it was.
    assert cap_offsets({"gone": 4}, {"a": 3}, 10) == {"a": 3, "gone": 4}


offsets = st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 60), max_size=6)


@given(planned=offsets, extra=offsets, budget=st.integers(1, 100))
def test_cap_is_bounded_monotone_and_max_min_fair(
    planned: dict[str, int], extra: dict[str, int], budget: int
) -> None:
    available = {n: planned.get(n, 0) + e for n, e in extra.items()}
    available.update({n: s for n, s in planned.items() if n not in available})
    end = cap_offsets(planned, available, budget)
    grant = {n: end[n] - planned.get(n, 0) for n in end}
    backlog = {n: available.get(n, 0) - planned.get(n, 0) for n in end}
    assert all(0 <= grant[n] <= max(backlog[n], 0) for n in end)
    assert sum(grant.values()) == min(budget, sum(max(b, 0) for b in backlog.values()))
    # Max-min fair: a node that did not get its whole backlog got at least as much as any other
    # node, give or take the one record of an uneven split.
    for n, m in itertools.permutations(end, 2):
        if grant[n] < backlog[n]:
            assert grant[n] >= grant[m] - 1


def test_python_workers_come_from_edgebus_daemon_and_keep_zip_directories(
    spark: SparkSession,
) -> None:
    """Every session's Python workers (the source's read tasks among them) are started by
    ingest.worker_daemon, so a task does not read pyspark's zips again (BENCHMARKS.md)."""

    def worker_imports(_: int) -> tuple[str, list[str]]:
        # In the worker (pickled by value): how it was started, and its zip finders' types.
        import sys
        import zipimport

        cmdline = Path("/proc/self/cmdline").read_bytes().split(b"\0")
        finders = sys.path_importer_cache.values()
        zips = {type(f).__name__ for f in finders if isinstance(f, zipimport.zipimporter)}
        return " ".join(part.decode() for part in cmdline if part), sorted(zips)

    for _ in range(2):  # a reused worker too: its finders were made in an earlier task
        [(cmdline, zips)] = spark.sparkContext.parallelize([0], 1).map(worker_imports).collect()
        assert "-m ingest.worker_daemon pyspark.worker" in cmdline
        assert zips == ["SteadyZipImporter"]
