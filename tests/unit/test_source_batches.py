"""The source hands Spark its journal ranges in batches of thousands of rows, not one batch per
journal frame (a frame holds what one group commit took: about ten records at 10,000 msgs/s)."""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa

from ingest.journal import JournalReader, JournalWriter
from ingest.source import (
    READ_BATCH_ROWS,
    EdgebusStreamReader,
    JournalRange,
    SourceOptions,
    coalesced,
    worker_journal,
)


def _append(writer: JournalWriter, count: int) -> None:
    """``count`` records in one frame (one group commit)."""
    for i in range(count):
        writer.append(
            ts_us=1_000 + i,
            tenant="t",
            client_id="c",
            topic="a/b",
            qos=1,
            retain=False,
            payload=b"x" * 50,
        )
    writer.flush()


def numbered(first: int, count: int) -> pa.RecordBatch:
    return pa.record_batch({"seq": pa.array(range(first, first + count), pa.int64())})


def test_small_batches_are_joined_in_order_up_to_the_row_count() -> None:
    frames = [numbered(10 * i, 10) for i in range(25)]  # 250 rows in frames of 10
    out = list(coalesced(iter(frames), rows=64))
    assert [b.num_rows for b in out] == [70, 70, 70, 40]
    assert pa.Table.from_batches(out)["seq"].to_pylist() == list(range(250))


def test_a_big_batch_goes_as_it_is_and_nothing_is_held_back() -> None:
    big = numbered(0, 1000)
    out = list(coalesced(iter([big, numbered(1000, 3)]), rows=64))
    assert out[0] is big
    assert [b.num_rows for b in out] == [1000, 3]
    assert list(coalesced(iter([]), rows=64)) == []


def test_batches_of_another_schema_are_never_joined() -> None:
    other = pa.record_batch({"seq": pa.array([5], pa.int64()), "x": pa.array(["a"])})
    out = list(coalesced(iter([numbered(0, 5), other, numbered(6, 5)]), rows=64))
    assert [b.schema.names for b in out] == [["seq"], ["seq", "x"], ["seq"]]
    assert [b.num_rows for b in out] == [5, 1, 5]


def test_the_source_reads_a_journal_of_small_frames_as_few_batches_with_every_record(
    tmp_path: Path,
) -> None:
    records = 2 * READ_BATCH_ROWS + 500
    with JournalWriter.open(tmp_path, "node-a", fsync=False) as writer:
        for _ in range(records // 10):
            _append(writer, 10)  # a group commit of ten records: one frame
        _append(writer, records % 10)
    assert len(list(JournalReader(tmp_path / "node-a").read(0, records))) == records // 10 + 1
    # What Spark's task for the range gets from the source (an executor's side).
    reader = EdgebusStreamReader(SourceOptions.parse({"path": str(tmp_path)}))
    batches = list(reader.read(JournalRange("node-a", 0, records)))
    assert [b.num_rows for b in batches] == [READ_BATCH_ROWS + 6, READ_BATCH_ROWS + 6, 488]
    assert pa.Table.from_batches(batches)["seq"].to_pylist() == list(range(1, records + 1))


def test_a_worker_keeps_its_journal_reader_from_task_to_task_and_sees_new_records(
    tmp_path: Path,
) -> None:
    node = tmp_path / "node-k"
    reader = EdgebusStreamReader(SourceOptions.parse({"path": str(tmp_path)}))
    with JournalWriter.open(tmp_path, "node-k", fsync=False) as writer:
        _append(writer, 30)
        first = pa.Table.from_batches(list(reader.read(JournalRange("node-k", 0, 30))))
        kept = worker_journal(node)
        _append(writer, 20)  # the edge goes on writing between two tasks
        second = pa.Table.from_batches(list(reader.read(JournalRange("node-k", 30, 50))))
    assert first["seq"].to_pylist() == list(range(1, 31))
    assert second["seq"].to_pylist() == list(range(31, 51))
    assert worker_journal(node) is kept  # the same reader, its frame index carried on
    # Another thread (the driver's quota lane beside a read) gets a reader of its own.
    found: list[JournalReader] = []
    thread = threading.Thread(target=lambda: found.append(worker_journal(node)))
    thread.start()
    thread.join()
    assert found[0] is not kept
    assert [b.num_rows for b in found[0].read(10, 50)] == [20, 20]
