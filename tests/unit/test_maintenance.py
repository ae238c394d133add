"""Delta table maintenance (``sinks.maintenance``) on real tables written by the sinks' writers."""

from __future__ import annotations

import datetime as dt
import shutil
import threading
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import CommitFailedError

from sinks.delta import DeltaBatchWriter, read_table
from sinks.errors import DeltaSinkError
from sinks.maintenance import (
    compact_small_files,
    interval_hours,
    maintain_table,
    small_file_partitions,
)
from sinks.upsert import DeltaUpsertWriter

APP = "test.maintenance"
DAY = dt.date(2024, 3, 10)
SCHEMA = pa.schema(
    [
        pa.field("node", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("date", pa.date32(), nullable=False),
        pa.field("value", pa.int64(), nullable=False),
    ]
)
PARTITION_BY = ("tenant", "date")
KEY = ("node", "seq", "tenant", "date")
ROWS_PER_BATCH = 5


def rows(batch_id: int, tenant: str = "acme", value: int = 0) -> pa.Table:
    seqs = range(batch_id * ROWS_PER_BATCH, (batch_id + 1) * ROWS_PER_BATCH)
    return pa.table(
        {
            "node": ["edge-1"] * ROWS_PER_BATCH,
            "seq": list(seqs),
            "tenant": [tenant] * ROWS_PER_BATCH,
            "date": [DAY] * ROWS_PER_BATCH,
            "value": [value] * ROWS_PER_BATCH,
        },
        schema=SCHEMA,
    )


def tenant_of(batch_id: int) -> str:
    return "acme" if batch_id % 2 else "globex"


def write_batches(path: Path, batches: range, writer: DeltaBatchWriter | None = None) -> None:
    writer = writer or DeltaBatchWriter(path, APP, SCHEMA, PARTITION_BY)
    for batch_id in batches:
        assert writer.write(batch_id, rows(batch_id, tenant_of(batch_id)))


def seq_counts(path: Path) -> Counter[int]:
    return Counter(read_table(path, columns=["seq"]).column("seq").to_pylist())


def expect_once(path: Path, batches: int) -> None:
    counts = seq_counts(path)
    assert set(counts) == set(range(batches * ROWS_PER_BATCH))
    assert set(counts.values()) == {1}


def count_at(path: Path, version: int) -> int:
    delta = DeltaTable(path, version=version)
    # Read the rows, not count(*): a count is answered from the log's statistics alone.
    result = QueryBuilder().register("t", delta).execute("SELECT seq FROM t").read_all()
    count: int = pa.table(result).num_rows
    return count


def data_files(path: Path) -> set[Path]:
    return {Path(uri) for uri in DeltaTable(path).file_uris()}


def test_compaction_leaves_one_file_per_partition_and_every_row_once(tmp_path: Path) -> None:
    write_batches(tmp_path, range(30))
    lone = DeltaBatchWriter(tmp_path, "test.lone", SCHEMA, PARTITION_BY)
    assert lone.write(0, rows(100, "initech"))  # a partition with one file: nothing to merge
    lone_file = next(p for p in data_files(tmp_path) if "tenant=initech" in str(p))
    assert len(data_files(tmp_path)) == 31

    report = maintain_table(tmp_path, vacuum_retention_hours=168)

    assert report.partitions_compacted == 2
    assert (report.files_removed, report.files_added) == (30, 2)
    files = data_files(tmp_path)
    assert len(files) == 3
    assert lone_file in files
    counts = seq_counts(tmp_path)
    assert set(counts.values()) == {1}
    assert len(counts) == 31 * ROWS_PER_BATCH
    delta = DeltaTable(tmp_path)
    assert delta.transaction_version(APP) == 29
    assert delta.transaction_version("test.lone") == 0


def test_a_second_run_with_nothing_to_do_commits_nothing(tmp_path: Path) -> None:
    write_batches(tmp_path, range(6))
    first = maintain_table(tmp_path, vacuum_retention_hours=168)

    second = maintain_table(tmp_path, vacuum_retention_hours=168)

    assert second.partitions_compacted == second.files_removed == second.vacuumed_files == 0
    assert second.version_before == second.version_after == first.version_after


def test_checkpoint_keeps_app_transactions_when_the_json_log_is_trimmed(tmp_path: Path) -> None:
    # A log retention of 0 lets cleanup delete every commit the checkpoint covers: the app
    # transactions, which make replays idempotent, must then come from the checkpoint.
    DeltaTable.create(
        tmp_path,
        SCHEMA,
        partition_by=list(PARTITION_BY),
        configuration={"delta.logRetentionDuration": "interval 0 seconds"},
    )
    writer = DeltaBatchWriter(tmp_path, APP, SCHEMA, PARTITION_BY)
    write_batches(tmp_path, range(12), writer)

    report = maintain_table(tmp_path, vacuum_retention_hours=0)

    log = tmp_path / "_delta_log"
    assert (log / f"{report.version_after:020d}.checkpoint.parquet").is_file()
    assert not (log / f"{0:020d}.json").exists()  # trimmed: only the checkpoint knows batch 0
    assert DeltaTable(tmp_path).transaction_version(APP) == 11
    assert writer.last_batch_id() == 11
    assert not writer.write(11, rows(11, tenant_of(11)))  # a replay is still skipped
    assert not writer.write(3, rows(3, tenant_of(3)))
    assert writer.write(12, rows(12, tenant_of(12)))
    expect_once(tmp_path, 13)


def test_zero_retention_vacuums_the_compacted_away_files(tmp_path: Path) -> None:
    write_batches(tmp_path, range(10))
    small_files = data_files(tmp_path)
    before = DeltaTable(tmp_path).version()

    report = maintain_table(tmp_path, vacuum_retention_hours=0)

    assert report.retention_check_overridden  # 0 h is below Delta's 168 h minimum
    assert report.vacuumed_files == len(small_files) == 10
    assert not any(path.exists() for path in small_files)
    expect_once(tmp_path, 10)
    assert DeltaTable(tmp_path).transaction_version(APP) == 9
    # Time travel to before the compaction is gone with its files: that is what 0 h means.
    with pytest.raises(Exception, match="not found"):  # DataFusion raises a bare Exception
        count_at(tmp_path, before)


def test_default_retention_keeps_old_files_and_time_travel(tmp_path: Path) -> None:
    write_batches(tmp_path, range(10))
    small_files = data_files(tmp_path)
    after_batch_4 = 5  # version 0 creates the table, batch n is version n + 1

    report = maintain_table(tmp_path, vacuum_retention_hours=168)

    assert report.files_removed == 10
    assert not report.retention_check_overridden
    assert report.vacuumed_files == 0
    assert all(path.exists() for path in small_files)
    assert count_at(tmp_path, after_batch_4) == 5 * ROWS_PER_BATCH
    assert count_at(tmp_path, report.version_before) == 10 * ROWS_PER_BATCH


def test_vacuum_never_deletes_a_file_a_writer_has_not_committed_yet(tmp_path: Path) -> None:
    write_batches(tmp_path, range(4))
    some_file = next(iter(data_files(tmp_path)))
    in_flight = some_file.with_name("part-00000-in-flight.snappy.parquet")
    shutil.copy(some_file, in_flight)  # written, its commit not yet made

    maintain_table(tmp_path, vacuum_retention_hours=0)
    assert in_flight.exists()
    maintain_table(tmp_path, vacuum_retention_hours=168)  # "full" vacuum, but the file is new
    assert in_flight.exists()


def test_a_table_minimum_retention_below_the_setting_is_enforced_not_overridden(
    tmp_path: Path,
) -> None:
    DeltaTable.create(
        tmp_path,
        SCHEMA,
        partition_by=list(PARTITION_BY),
        configuration={"delta.deletedFileRetentionDuration": "interval 1 hours"},
    )
    write_batches(tmp_path, range(3))

    report = maintain_table(tmp_path, vacuum_retention_hours=1.5)

    assert report.vacuum_retention_hours == 2  # whole hours, rounded up: never less history
    assert not report.retention_check_overridden


@pytest.mark.parametrize(
    ("interval", "hours"),
    [("interval 7 days", 168.0), ("interval 1 week", 168.0), ("INTERVAL 90 minutes", 1.5)],
)
def test_interval_hours(interval: str, hours: float) -> None:
    assert interval_hours(interval) == hours


@pytest.mark.parametrize("interval", ["7 days", "interval x days", "interval 3 fortnights"])
def test_interval_hours_rejects_what_is_not_an_interval(interval: str) -> None:
    with pytest.raises(DeltaSinkError, match="not a Delta interval"):
        interval_hours(interval)


def test_only_partitions_with_several_small_files_are_planned(tmp_path: Path) -> None:
    write_batches(tmp_path, range(4))
    DeltaBatchWriter(tmp_path, "test.lone", SCHEMA, PARTITION_BY).write(0, rows(9, "initech"))
    delta = DeltaTable(tmp_path)

    assert small_file_partitions(delta, target_size=10**9) == [("acme", DAY), ("globex", DAY)]
    assert small_file_partitions(delta, target_size=10**9, min_files=3) == []
    assert small_file_partitions(delta, target_size=1) == []  # no file is small


# --- Concurrent writers -------------------------------------------------------------------


class AlwaysStaleWriter(DeltaUpsertWriter):
    """A writer that loses every commit race: it always starts from the same old snapshot."""

    def __init__(self, path: Path, snapshot: DeltaTable) -> None:
        super().__init__(path, APP, SCHEMA, PARTITION_BY)
        self._snapshot = snapshot

    def _open_or_create(self) -> DeltaTable:
        return self._snapshot


def test_a_merge_that_keeps_losing_gives_up_with_a_clear_error(tmp_path: Path) -> None:
    write_batches(tmp_path, range(6))
    writer = AlwaysStaleWriter(tmp_path, DeltaTable(tmp_path))
    maintain_table(tmp_path, vacuum_retention_hours=168)
    version = DeltaTable(tmp_path).version()

    with pytest.raises(DeltaSinkError, match="lost 5 commit races") as raised:
        writer.upsert(6, rows(1, tenant_of(1), value=7), KEY)
    assert isinstance(raised.value.__cause__, CommitFailedError)
    assert DeltaTable(tmp_path).version() == version  # nothing committed
    assert DeltaTable(tmp_path).transaction_version(APP) == 5


class StaleWriter(DeltaUpsertWriter):
    """A writer whose next commit starts from a snapshot taken earlier: a commit race, replayed
    deterministically (the other side commits between the snapshot and this commit)."""

    def __init__(self, path: Path, snapshot: DeltaTable) -> None:
        super().__init__(path, APP, SCHEMA, PARTITION_BY)
        self._snapshot: DeltaTable | None = snapshot

    def _open_or_create(self) -> DeltaTable:
        snapshot, self._snapshot = self._snapshot, None
        return snapshot if snapshot is not None else super()._open_or_create()


def test_an_append_that_races_a_compaction_still_commits_once(tmp_path: Path) -> None:
    write_batches(tmp_path, range(6))
    writer = StaleWriter(tmp_path, DeltaTable(tmp_path))
    maintain_table(tmp_path, vacuum_retention_hours=0)  # compacts and vacuums in between

    assert writer.write(6, rows(6, tenant_of(6)))

    expect_once(tmp_path, 7)
    assert DeltaTable(tmp_path).transaction_version(APP) == 6


def test_a_merge_that_loses_to_a_compaction_retries_and_lands_once(tmp_path: Path) -> None:
    write_batches(tmp_path, range(6))
    writer = StaleWriter(tmp_path, DeltaTable(tmp_path))
    maintain_table(tmp_path, vacuum_retention_hours=168)
    version = DeltaTable(tmp_path).version()

    # Maintenance committed during the merge: the first commit loses, the writer retries on a
    # fresh snapshot within the same call.
    assert writer.upsert(6, rows(1, tenant_of(1), value=7), KEY)
    assert DeltaTable(tmp_path).version() == version + 1
    assert not writer.upsert(6, rows(1, tenant_of(1), value=7), KEY)  # and its replay
    expect_once(tmp_path, 6)
    values = read_table(tmp_path, "value = 7", columns=["seq"]).column("seq").to_pylist()
    assert sorted(values) == list(range(ROWS_PER_BATCH, 2 * ROWS_PER_BATCH))


def test_a_compaction_that_loses_to_a_merge_is_retried_and_keeps_the_merge(
    tmp_path: Path,
) -> None:
    write_batches(tmp_path, range(6))
    stale = DeltaTable(tmp_path)
    merger = DeltaUpsertWriter(tmp_path, APP, SCHEMA, PARTITION_BY)
    assert merger.upsert(6, rows(1, tenant_of(1), value=7), KEY)  # rewrites an acme file

    result = compact_small_files(stale, target_size=10**9)

    assert result.conflicts == 1
    assert result.partitions == 2
    assert len(data_files(tmp_path)) == 2
    expect_once(tmp_path, 6)
    # Compacting the stale snapshot's files would have brought back value 0: it must not.
    assert set(read_table(tmp_path, "seq >= 5 AND seq < 10").column("value").to_pylist()) == {7}
    assert DeltaTable(tmp_path).transaction_version(APP) == 6


def maintain_while(path: Path, worker: threading.Thread, retention_hours: float) -> int:
    """Maintain the table at ``path`` over and over while ``worker`` writes to it; the runs."""
    worker.start()
    runs = 0
    while worker.is_alive() or runs == 0:
        maintain_table(path, vacuum_retention_hours=retention_hours)
        runs += 1
    worker.join()
    return runs


def test_appends_from_another_thread_during_maintenance_land_exactly_once(
    tmp_path: Path,
) -> None:
    batches = 40
    write_batches(tmp_path, range(2))
    failures: list[BaseException] = []

    def append() -> None:
        try:
            write_batches(tmp_path, range(2, batches))
        except BaseException as exc:
            failures.append(exc)
            raise

    runs = maintain_while(tmp_path, threading.Thread(target=append), 0)
    maintain_table(tmp_path, vacuum_retention_hours=0)

    assert runs > 1
    assert failures == []
    expect_once(tmp_path, batches)
    assert DeltaTable(tmp_path).transaction_version(APP) == batches - 1
    assert len(data_files(tmp_path)) == 2  # one per partition


def test_merges_from_another_thread_that_retry_lost_commits_land_exactly_once(
    tmp_path: Path,
) -> None:
    # The upsert writer retries a batch whose commit lost to a compaction by itself.
    batches = 30
    write_batches(tmp_path, range(4))
    failures: list[BaseException] = []

    def merge() -> None:
        writer = DeltaUpsertWriter(tmp_path, APP, SCHEMA, PARTITION_BY)
        try:
            for batch_id in range(4, batches):
                # Batch n updates the rows of batch n - 4 and inserts its own.
                data = pa.concat_tables(
                    [
                        rows(batch_id - 4, tenant_of(batch_id), 1),
                        rows(batch_id, tenant_of(batch_id)),
                    ]
                )
                writer.upsert(batch_id, data, KEY)
        except BaseException as exc:
            failures.append(exc)
            raise

    maintain_while(tmp_path, threading.Thread(target=merge), 168)

    assert failures == []
    expect_once(tmp_path, batches)
    assert DeltaTable(tmp_path).transaction_version(APP) == batches - 1
    updated = read_table(tmp_path, "value = 1", columns=["seq"]).num_rows
    assert updated == (batches - 4) * ROWS_PER_BATCH
