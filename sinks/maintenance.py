"""Delta table maintenance (delta-rs): compact small files, vacuum, checkpoint, trim the log.

Theory of operation: a streaming sink commits one or a few small files per micro-batch and
partition, so a table that is never maintained reads thousands of tiny files and replays a long
JSON log. :func:`maintain_table` fixes both, in this order:

1. **Compact**: every partition holding at least ``min_files`` files smaller than the target
   size is rewritten into fewer, larger files, one commit per partition (``optimize.compact``
   with that partition's filter). Partitions with nothing to merge are not touched, and a table
   with nothing to do gets no commit. Compaction changes no data (its commit says
   ``dataChange = false``), so row counts and app transactions are unchanged.
2. **Vacuum**: the files that compaction (or a merge) removed from the table are deleted once
   they are older than the retention; versions younger than the retention can still be read.
3. **Checkpoint**: the table's state at its newest version, app transactions included, goes
   into one Parquet checkpoint, so readers and writers stop replaying JSON commits.
4. **Log cleanup**: JSON commits older than the table's ``delta.logRetentionDuration``
   (30 days by default) and covered by a checkpoint are deleted.

Concurrency: writers of the same process may commit while this runs; delta-rs commits are
optimistic, so nothing is ever overwritten. Appends (:class:`~sinks.delta.DeltaBatchWriter`)
and compaction never conflict, whichever commits first. A merge
(:class:`~sinks.upsert.DeltaUpsertWriter`) and a compaction of the same table do: when the
merge commits first, the compaction fails with ``CommitFailedError`` and is retried here on the
new snapshot (up to ``attempts`` times, then left to the next run); when the compaction commits
first, the *merge* fails with ``CommitFailedError`` and commits nothing, and its writer must
retry it (the app transaction makes the retry exactly-once). Vacuum's own commits carry no
files and conflict with nothing.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError

from sinks.errors import DeltaSinkError

logger = logging.getLogger(__name__)

# delta-rs' own default when the table sets no ``delta.targetFileSize``.
DEFAULT_TARGET_SIZE = 100 * 1024 * 1024
# Delta's default ``delta.deletedFileRetentionDuration``: vacuum refuses less unless told.
DEFAULT_MIN_RETENTION_HOURS = 168.0

_HOURS_PER_UNIT = {
    "nanosecond": 1 / 3_600_000_000_000,
    "microsecond": 1 / 3_600_000_000,
    "millisecond": 1 / 3_600_000,
    "second": 1 / 3600,
    "minute": 1 / 60,
    "hour": 1.0,
    "day": 24.0,
    "week": 168.0,
}
_INTERVAL = re.compile(r"^\s*interval\s+(\d+)\s+([a-z]+?)s?\s*$", re.IGNORECASE)

# A partition's values in the table's partition column order; () for an unpartitioned table.
PartitionKey = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """What compacting one table did."""

    partitions: int  # partitions rewritten
    files_removed: int
    files_added: int
    conflicts: int  # commits that lost to a concurrent writer (each retried, or left for later)


@dataclass(frozen=True, slots=True)
class MaintenanceReport:
    """What :func:`maintain_table` did to one table."""

    path: str
    version_before: int
    version_after: int  # the version the checkpoint was written for
    partitions_compacted: int
    files_removed: int
    files_added: int
    conflicts: int
    vacuumed_files: int
    vacuum_retention_hours: int
    retention_check_overridden: bool  # retention below the table's minimum (see maintain_table)


def maintain_table(
    path: Path | str,
    *,
    vacuum_retention_hours: float,
    target_size: int | None = None,
    min_files: int = 2,
    attempts: int = 3,
) -> MaintenanceReport:
    """Compact, vacuum, checkpoint and trim the log of the Delta table at ``path``.

    ``vacuum_retention_hours`` (rounded up to whole hours, delta-rs takes no less) is how long
    files removed from the table are kept, i.e. how far back time travel keeps working. Delta
    refuses a retention below the table's ``delta.deletedFileRetentionDuration`` (168 h unless
    the table sets it) because a reader or a merge still working on an older snapshot would
    find its files gone. When the configured retention is below that minimum, this passes
    ``enforce_retention_duration=False``: the operator asked for it (tests, small disks), and
    the report says so. Below the longest merge or read of the table, such a reader fails with
    a "not found" error; the data itself is never lost.

    Vacuum deletes only files the log removed ("lite"), never a file a writer has written but
    not yet committed. With a retention at or above the table's minimum it runs "full" and
    also deletes untracked files older than the retention (left by failed commits), which no
    writer can still be about to commit.

    ``target_size`` is the compacted file size in bytes (the table's ``delta.targetFileSize``
    or 100 MiB when None); partitions with fewer than ``min_files`` smaller files are left
    alone. Raises :class:`DeltaSinkError` when the table cannot be read or a step fails for
    another reason than a lost commit race.
    """
    if vacuum_retention_hours < 0:
        raise ValueError(f"vacuum_retention_hours must be >= 0, got {vacuum_retention_hours}")
    target = str(path)
    try:
        delta = DeltaTable(target)
        version_before = delta.version()
        size = target_size if target_size is not None else _target_size(delta)
        compaction = compact_small_files(delta, size, min_files=min_files, attempts=attempts)
        retention = math.ceil(vacuum_retention_hours)
        enforced = retention >= _min_retention_hours(delta)
        vacuumed = delta.vacuum(
            retention_hours=retention,
            dry_run=False,
            enforce_retention_duration=enforced,
            full=enforced,
        )
        delta.update_incremental()  # writers may have committed meanwhile
        delta.create_checkpoint()
        delta.cleanup_metadata()
    except (DeltaError, OSError) as exc:
        raise DeltaSinkError(f"{target}: maintenance failed: {exc}") from exc
    return MaintenanceReport(
        path=target,
        version_before=version_before,
        version_after=delta.version(),
        partitions_compacted=compaction.partitions,
        files_removed=compaction.files_removed,
        files_added=compaction.files_added,
        conflicts=compaction.conflicts,
        vacuumed_files=len(vacuumed),
        vacuum_retention_hours=retention,
        retention_check_overridden=not enforced,
    )


def compact_small_files(
    delta: DeltaTable, target_size: int, *, min_files: int = 2, attempts: int = 3
) -> CompactionResult:
    """Compact every partition of ``delta`` that holds ``min_files`` or more small files.

    One commit per partition, so a conflict costs one partition's work, not the table's. (A
    merge still conflicts with a compaction of *any* partition: delta-rs checks its whole
    read.) A commit that loses to a concurrent
    writer (``CommitFailedError``) is retried on the table's newest snapshot, up to
    ``attempts`` times in all; then that partition waits for the next run. ``delta`` is left
    at the newest version this saw.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    columns = list(delta.metadata().partition_columns)
    partitions = files_removed = files_added = conflicts = 0
    for key in small_file_partitions(delta, target_size, min_files):
        filters = [
            (name, "=", "" if value is None else value)
            for name, value in zip(columns, key, strict=True)
        ]
        for attempt in range(1, attempts + 1):
            try:
                metrics = delta.optimize.compact(
                    partition_filters=filters or None,
                    target_size=target_size,
                    # One bin at a time: maintenance runs beside the streams and should
                    # take one core, not all of them (DataFusion's default).
                    max_concurrent_tasks=1,
                )
            except CommitFailedError as exc:
                conflicts += 1
                logger.info(
                    "%s: compaction of %s lost to a concurrent commit (attempt %d of %d): %s",
                    delta.table_uri,
                    filters,
                    attempt,
                    attempts,
                    exc,
                )
                delta.update_incremental()
                continue
            if metrics["numFilesRemoved"]:
                partitions += 1
                files_removed += metrics["numFilesRemoved"]
                files_added += metrics["numFilesAdded"]
            break
    return CompactionResult(partitions, files_removed, files_added, conflicts)


def small_file_partitions(
    delta: DeltaTable, target_size: int, min_files: int = 2
) -> list[PartitionKey]:
    """The partitions of ``delta`` holding at least ``min_files`` files under ``target_size``.

    Keys are partition values in ``partition_columns`` order (None for a null value), sorted
    by their text; an unpartitioned table has the one key ``()``.
    """
    if min_files < 2:
        raise ValueError(
            f"min_files must be >= 2 (one file alone is never merged), got {min_files}"
        )
    columns = list(delta.metadata().partition_columns)
    files = pa.table(delta.get_add_actions(flatten=True))
    sizes = files.column("size_bytes").to_pylist()
    values = [files.column(f"partition.{name}").to_pylist() for name in columns]
    small = Counter(
        tuple(column[row] for column in values)
        for row, size in enumerate(sizes)
        if size < target_size
    )
    return sorted((key for key, count in small.items() if count >= min_files), key=str)


def _target_size(delta: DeltaTable) -> int:
    configured = delta.metadata().configuration.get("delta.targetFileSize")
    return int(configured) if configured else DEFAULT_TARGET_SIZE


def _min_retention_hours(delta: DeltaTable) -> float:
    """The table's ``delta.deletedFileRetentionDuration`` in hours (Delta's default: 168)."""
    configured = delta.metadata().configuration.get("delta.deletedFileRetentionDuration")
    if not configured:
        return DEFAULT_MIN_RETENTION_HOURS
    return interval_hours(configured)


def interval_hours(interval: str) -> float:
    """Hours in a Delta table property interval such as ``"interval 7 days"``."""
    match = _INTERVAL.match(interval)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _HOURS_PER_UNIT:
        raise DeltaSinkError(f"not a Delta interval: {interval!r}")
    return int(match.group(1)) * _HOURS_PER_UNIT[unit]


def describe(report: MaintenanceReport) -> str:
    """One log line's worth of ``report``."""
    below = ", below the table minimum" if report.retention_check_overridden else ""
    return (
        f"{report.path}: v{report.version_before} -> v{report.version_after}, "
        f"{report.partitions_compacted} partitions compacted "
        f"({report.files_removed} files -> {report.files_added}), "
        f"{report.conflicts} commit conflicts, {report.vacuumed_files} files vacuumed "
        f"(retention {report.vacuum_retention_hours} h{below})"
    )
