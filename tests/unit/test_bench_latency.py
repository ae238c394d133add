"""bench.latency's measurement: Delta log parsing → per-row latency, on a real tiny Delta table
written by the pipeline's own writer (app transactions, partitions that need percent-encoding,
a compaction that re-adds rows without a data change)."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from lake_fixture import DeltaBatchWriter

from bench import latency

SCHEMA = pa.schema(
    [
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("ts", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)
APP_ID = "edgebus.history"
# (batch id, tenant, seqs): a tenant whose partition directory is percent-encoded in the log.
BATCHES = [(0, "acme", [1, 2, 3]), (1, "$none x", [4, 5]), (2, "acme", [6])]


def ts_of(seq: int) -> int:
    return 1_795_000_000_000_000 + seq * 1_234_567  # µs


@pytest.fixture
def table(tmp_path: Path) -> Path:
    path = tmp_path / "messages"
    writer = DeltaBatchWriter(path, APP_ID, SCHEMA, ["tenant"])
    for batch, tenant, seqs in BATCHES:
        rows = pa.table(
            {
                "tenant": [tenant] * len(seqs),
                "seq": seqs,
                "ts": pa.array([ts_of(s) for s in seqs], pa.timestamp("us", tz="UTC")),
            },
            schema=SCHEMA,
        )
        assert writer.write(batch, rows)
    return path


def commit_ms_by_version(path: Path) -> dict[int, int]:
    """The commit timestamps as delta-rs itself reports them (the independent side)."""
    return {entry["version"]: entry["timestamp"] for entry in DeltaTable(str(path)).history()}


# One tick of the clock file mtimes come from (Linux: CLOCK_REALTIME_COARSE, id 5; a jiffy,
# 4 ms at HZ=250), in whole milliseconds plus the millisecond the timestamps are cut to.
MTIME_TICK_MS = math.ceil(time.clock_getres(getattr(time, "CLOCK_REALTIME_COARSE", 5)) * 1000) + 1


def test_commits_carry_their_files_batches_and_times(table: Path) -> None:
    commits = latency.read_commits(table)
    history = commit_ms_by_version(table)

    assert [c.version for c in commits] == [0, 1, 2, 3]  # 0: the table's creation
    assert commits[0].added == ()
    assert [c.batch for c in commits] == [None, 0, 1, 2]
    assert all(c.timestamp_ms == history[c.version] for c in commits)
    for commit in commits[1:]:
        assert len(commit.added) == 1
        assert (table / commit.added[0]).is_file()  # unquoted: "tenant=$none x/..."
        assert commit.write_ms is not None
        # The log file appears when the commit is done, not before its timestamp; the kernel
        # stamps mtimes from its coarse clock, up to one tick behind the time read before.
        assert commit.visible_ns // 1_000_000 >= commit.timestamp_ms - MTIME_TICK_MS


def test_each_row_latency_is_its_commit_time_minus_its_ts(table: Path) -> None:
    history = commit_ms_by_version(table)
    version_of_seq = {s: version for version, (_, _, seqs) in enumerate(BATCHES, 1) for s in seqs}

    rows = latency.visible_rows(table, latency.read_commits(table), ["seq"])

    assert sorted(rows.column("seq").to_pylist()) == [1, 2, 3, 4, 5, 6]
    for seq, version, latency_us in zip(
        rows.column("seq").to_pylist(),
        rows.column("version").to_pylist(),
        rows.column("latency_us").to_pylist(),
        strict=True,
    ):
        assert version == version_of_seq[seq]
        assert latency_us == history[version] * 1000 - ts_of(seq)


def test_compaction_adds_no_rows(table: Path) -> None:
    DeltaTable(str(table)).optimize.compact()
    commits = latency.read_commits(table)

    assert len(commits) == 5
    assert commits[-1].added == ()  # dataChange false: the same rows, rewritten
    rows = latency.visible_rows(table, commits, ["seq"])
    assert sorted(rows.column("seq").to_pylist()) == [1, 2, 3, 4, 5, 6]


def test_batch_breakdown_splits_a_rows_wait_from_the_batch(table: Path) -> None:
    commits = latency.read_commits(table)
    rows = latency.visible_rows(table, commits, ["seq"])
    first = commits[1]
    started_us = ts_of(3) + 100_000  # the trigger of batch 0 started 100 ms after seq 3
    started = datetime.fromtimestamp(started_us / 1e6, UTC).isoformat().replace("+00:00", "Z")
    progress = {0: {"timestamp": started, "numInputRows": 3, "durationMs": {"addBatch": 5}}}

    per_batch, summary = latency.batch_breakdown(rows, commits, progress)

    assert [b["batch"] for b in per_batch] == [0, 1, 2]
    batch0 = per_batch[0]
    mean_ts = sum(ts_of(s) for s in (1, 2, 3)) / 3
    assert batch0["wait_ms_mean"] == pytest.approx((started_us - mean_ts) / 1000)
    assert batch0["start_to_commit_ms"] == pytest.approx(
        (first.timestamp_ms * 1000 - started_us) / 1000
    )
    assert batch0["start_to_write_ms"] == pytest.approx(
        batch0["start_to_commit_ms"] - first.write_ms
    )
    assert "wait_ms_mean" not in per_batch[1]  # no progress report for it
    assert summary["batches"] == 3


def test_send_times_come_from_the_generator_stamp() -> None:
    mono = [5_000_000_123, 6_000_000_999]
    payloads = pa.chunked_array(
        [[m.to_bytes(8, "big") + (7).to_bytes(8, "big") + bytes(20) for m in mono]]
    )

    sent = latency.send_times_us(payloads, mono_to_wall_ns=1_000_000_000_000)

    assert sent.to_pylist() == [(m + 1_000_000_000_000) // 1000 for m in mono]


def test_percentiles_are_nearest_rank_in_ms() -> None:
    figures = latency.percentiles_ms(pa.array(range(1000, 101_000, 1000), pa.int64()))

    assert figures["p50"] == 50
    assert figures["p99"] == 99
    assert figures["max"] == 100
    assert figures["samples"] == 100
