"""Delta table maintenance through Spark's Delta: expire history, repair physical types,
compact, vacuum.

Theory of operation: a streaming sink commits one or a few small files per micro-batch and
partition, so a table that is never maintained reads thousands of tiny files. Spark is the one
engine that writes the lake, so maintenance is Spark's Delta too. :func:`maintain_table` does,
in this order:

0. **Expire** (given a :class:`~sinks.retention.Retention`: ``logs`` and ``messages``): the
   partitions older than each tenant's cutoff go, in one Delta ``DELETE`` that removes whole
   files and rewrites none (:mod:`sinks.retention`); the steps below skip those partitions.
1. **Repair**: files whose Parquet carries an Arrow schema with view types (``string_view``,
   ``binary_view``: written by delta-rs before the pipeline wrote through Spark) break readers
   that trust that schema (pyarrow filters, DuckDB over Arrow, pandas). Each partition holding
   such a file is rewritten by Spark (``replaceWhere`` with ``dataChange = false``): the same
   rows, in files whose physical types are the Delta schema's. See :func:`view_typed_files`.
2. **Compact**: ``OPTIMIZE`` bins each partition's small files into larger ones
   (``dataChange = false``, so row counts, streaming readers and app transactions are
   unchanged).
3. **Vacuum**: files removed from the table (by compaction, a repair or an upsert) are deleted
   once older than the retention; versions younger than it can still be read.
4. **Checkpoint**: the table's state at its newest version, app transactions included, goes
   into one Parquet checkpoint, so readers (the light ones above all) stop replaying JSON
   commits. The table's writer also writes one every ``CHECKPOINT_EVERY`` versions it commits,
   in a thread of its own (:meth:`sinks.delta.DeltaTableWriter.checkpoint_ahead`). After each,
   the log's commits older than ``delta.logRetentionDuration`` (the pipeline's
   ``delta_log_retention_hours``) are deleted (:func:`sinks.delta.checkpoint_and_clean`).

Each step a table does not need is skipped (:func:`pending_work`: the log, the file listing
and ``_last_checkpoint`` say so without a Spark job): on a small table each step costs seconds
of the driver's planning even when it changes nothing, and quiet tables are maintained every
interval all the same.

Concurrency: the streams commit while this runs. Appends and a compaction never conflict; an
upsert (``usage``) and a compaction of the same files do, and whichever loses retries
(:meth:`~sinks.delta.DeltaTableWriter.replace` plans the upsert again; here, the next run).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from sinks.delta import checkpoint_and_clean
from sinks.errors import DeltaSinkError
from sinks.retention import (
    DATE,
    TENANT,
    Expiry,
    Retention,
    as_date,
    delete_expired,
    expired_partitions,
)
from sinks.storage import LakePath, ObjectPath, open_delta, spark_uri

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

# A partition's values by column name; {} for an unpartitioned table.
Partition = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class MaintenanceReport:
    """What :func:`maintain_table` did to one table."""

    path: str
    version_before: int
    version_after: int
    partitions_repaired: int
    files_removed: int  # by compaction
    files_added: int
    vacuumed_files: int
    vacuum_retention_hours: float
    expired: tuple[Expiry, ...] = ()  # the partitions retention deleted, per tenant
    rows_expired: int = 0  # the DELETE commit's numDeletedRows


def maintain_table(
    spark: SparkSession,
    path: LakePath | str,
    *,
    vacuum_retention_hours: float,
    retention: Retention | None = None,
) -> MaintenanceReport:
    """Expire, repair, compact and vacuum the Delta table at ``path`` (see the module's text).

    ``vacuum_retention_hours`` is how long files removed from the table are kept, i.e. how far
    back time travel keeps working (the session allows less than Delta's 7-day default:
    ``streaming.session``). ``retention``: the tenants' cutoffs (None: history is kept).
    Raises :class:`DeltaSinkError` when a step fails.
    """
    from delta.tables import DeltaTable as SparkDeltaTable

    if vacuum_retention_hours < 0:
        raise ValueError(f"vacuum_retention_hours must be >= 0, got {vacuum_retention_hours}")
    target = spark_uri(path)
    try:
        work = pending_work(spark, path, vacuum_retention_hours, retention)
        if not work:
            logger.debug("%s: compacted, vacuumed and checkpointed already", target)
            return MaintenanceReport(
                target, work.version, work.version, 0, 0, 0, 0, vacuum_retention_hours
            )
        deleted = delete_expired(spark, target, work.expire)
        table = SparkDeltaTable.forPath(spark, target)
        repaired = repair_physical_types(spark, path, work.repair)
        removed = added = 0
        if work.compact or repaired:
            metrics = table.optimize().executeCompaction().select("metrics").first()
            if metrics is not None:
                removed = int(metrics["metrics"]["numFilesRemoved"])
                added = int(metrics["metrics"]["numFilesAdded"])
        vacuumed = 0
        # Files this run removed are due at once only with no retention at all.
        if work.vacuum or ((removed or repaired or deleted) and vacuum_retention_hours == 0):
            table.vacuum(vacuum_retention_hours)
            vacuumed = _vacuumed(table)
        _checkpoint(spark, target)
        after = open_delta(path).version()
    except DeltaSinkError:
        raise
    except Exception as exc:  # py4j and Delta raise many types; the message says which
        raise DeltaSinkError(f"{target}: maintenance failed: {exc}") from exc
    return MaintenanceReport(
        path=target,
        version_before=work.version,
        version_after=after,
        partitions_repaired=repaired,
        files_removed=removed,
        files_added=added,
        vacuumed_files=vacuumed,
        vacuum_retention_hours=vacuum_retention_hours,
        expired=work.expire,
        rows_expired=int(deleted.get("numDeletedRows", 0)),
    )


@dataclass(frozen=True, slots=True)
class Work:
    """What :func:`maintain_table` has to do to a table at ``version`` (false: nothing)."""

    version: int
    expire: tuple[Expiry, ...]  # partitions older than their tenant's cutoff
    repair: Mapping[str, Partition]  # view-typed files (:func:`view_typed_files`)
    compact: bool  # a partition holds two or more files below OPTIMIZE's minimum size
    vacuum: bool  # a file is due for deletion (removed, or never committed, and old enough)
    checkpoint: bool  # the newest version has no checkpoint

    def __bool__(self) -> bool:
        return (
            bool(self.expire) or bool(self.repair) or self.compact or self.vacuum or self.checkpoint
        )


def pending_work(
    spark: SparkSession,
    path: LakePath | str,
    vacuum_retention_hours: float,
    retention: Retention | None = None,
) -> Work:
    """What maintaining the table at ``path`` would change, from its log and file listing
    (delta-rs and Delta's ``_last_checkpoint``: no Spark job). Each step a table does not need
    is skipped: on a small table each costs seconds of the driver's planning even when it does
    nothing, and a lake of quiet tables is maintained every interval. Partitions that
    ``retention`` expires are neither repaired nor compacted: they are about to go."""
    delta = open_delta(path)
    version = delta.version()
    actions = pa.table(delta.get_add_actions(flatten=True))
    expire = expired_partitions(actions, retention) if retention is not None else ()
    columns = delta.metadata().partition_columns
    small = int(spark.conf.get("spark.databricks.delta.optimize.minFileSize", str(1 << 30)) or 0)
    values = [actions.column(f"partition.{name}").to_pylist() for name in columns]
    keys = list(zip(*values, strict=True)) if columns else [()] * actions.num_rows
    sizes = actions.column("size_bytes").to_pylist()
    going = {(expiry.tenant, day) for expiry in expire for day in expiry.dates}

    def kept(partition: Partition) -> bool:  # not about to be deleted
        return not going or (partition[TENANT], as_date(partition[DATE])) not in going

    small_files = Counter(
        key
        for key, size in zip(keys, sizes, strict=True)
        if size < small and kept(dict(zip(columns, key, strict=True)))
    )
    # A whole number of hours at most the retention: every file due now is in the list.
    due = delta.vacuum(
        int(vacuum_retention_hours), dry_run=True, enforce_retention_duration=False, full=True
    )
    jvm = spark._jvm
    assert jvm is not None
    log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, spark_uri(path))
    last = log.readLastCheckpointFile()
    repair = {name: where for name, where in view_typed_files(path, delta).items() if kept(where)}
    return Work(
        version=version,
        expire=expire,
        repair=repair,
        compact=any(count > 1 for count in small_files.values()),
        vacuum=bool(due),
        checkpoint=not last.isDefined() or last.get().version() < version,
    )


def view_typed_files(path: LakePath | str, delta: DeltaTable | None = None) -> dict[str, Partition]:
    """The data files of the table's current snapshot whose Parquet holds an Arrow schema with
    view types, with their partition values. Reads the files' footers only (delta-rs lists them).

    Only a local lake can hold them: the delta-rs pipeline that wrote view types (before issue
    18) wrote local lakes only, so a lake in a bucket has none to look for."""
    if isinstance(path, ObjectPath):
        return {}
    if delta is None:  # else the caller's snapshot of it
        delta = open_delta(path)
    columns = delta.metadata().partition_columns
    actions = pa.table(delta.get_add_actions(flatten=True))
    found: dict[str, Partition] = {}
    paths = actions.column("path").to_pylist()
    values = {name: actions.column(f"partition.{name}").to_pylist() for name in columns}
    root = Path(str(path))
    for index, relative in enumerate(paths):
        schema = pq.read_schema(root / relative)
        if any(_has_view(field.type) for field in schema):
            found[relative] = {name: values[name][index] for name in columns}
    return found


def repair_physical_types(
    spark: SparkSession, path: LakePath | str, found: Mapping[str, Partition] | None = None
) -> int:
    """Rewrite every partition holding a view-typed file (``found``, else
    :func:`view_typed_files`) with Spark's Delta; the number of partitions rewritten. Rows and
    versions' data are unchanged (``dataChange = false``); the old files go at the next
    vacuum."""
    target = spark_uri(path)
    if found is None:
        found = view_typed_files(path)
    partitions = {tuple(sorted(values.items())): values for values in found.values()}
    for values in partitions.values():
        where = " AND ".join(f"`{name}` = {_literal(value)}" for name, value in values.items())
        rows = spark.read.format("delta").load(target)
        if where:
            rows = rows.where(where)
        writer = rows.write.format("delta").mode("overwrite").option("dataChange", "false")
        if where:
            writer = writer.option("replaceWhere", where)
        writer.save(target)
        logger.info("%s: rewrote partition %s (view-typed files)", target, where or "(all)")
    return len(partitions)


def _has_view(type_: pa.DataType) -> bool:
    if type_ in (pa.string_view(), pa.binary_view()):
        return True
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return _has_view(type_.value_type)
    if pa.types.is_struct(type_):
        return any(_has_view(type_.field(i).type) for i in range(type_.num_fields))
    return False


def _literal(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, date):
        return f"DATE '{value.isoformat()}'"
    text = str(value)
    return "'" + text.replace("'", "''") + "'"


def _checkpoint(spark: SparkSession, path: str) -> None:
    """A checkpoint at the table's newest version, and the log cleaned up behind it
    (:func:`sinks.delta.checkpoint_and_clean`; no Python or SQL API has either)."""
    checkpoint_and_clean(spark, path)


def _vacuumed(table: Any) -> int:
    """Files the last VACUUM deleted, from its commit's metrics (0 when it deleted none)."""
    row = table.history(5).where("operation = 'VACUUM END'").select("operationMetrics").first()
    if row is None or not row["operationMetrics"]:
        return 0
    return int(row["operationMetrics"].get("numDeletedFiles", 0))


def describe(report: MaintenanceReport) -> str:
    """One log line's worth of ``report``."""
    return (
        f"{report.path}: v{report.version_before} -> v{report.version_after}, "
        f"{report.partitions_repaired} partitions repaired, "
        f"compaction {report.files_removed} files -> {report.files_added}, "
        f"{report.vacuumed_files} files vacuumed (retention {report.vacuum_retention_hours} h), "
        f"{report.rows_expired} rows expired"
        + "".join(
            f"; {e.tenant}: {e.partitions} partitions before {e.before}" for e in report.expired
        )
    )
