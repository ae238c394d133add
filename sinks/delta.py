"""The idempotent Delta writer (Spark's own Delta, delta-spark) and a light reader (delta-rs).

Theory of operation: the journal query hands every micro-batch to ``foreachBatch``
(``streaming.pipeline``). Spark's checkpoint writes a batch's offsets before running it and its
commit marker after, so a crash between the two replays the same batch (same id, same rows).
:class:`DeltaTableWriter` writes each table's rows with Spark's Delta on the executors, with
Delta's app transaction ``(app_id, batch_id)`` (a ``SetTransaction`` action, what the
``txnAppId``/``txnVersion`` options write) in the same atomic commit as the data; a replayed
batch (at or below the recorded one) is skipped. Writes commit through Delta's transaction
API (``DeltaLog.startTransaction``, ``writeFiles`` on the executors, ``commit``) and make the
replay check themselves (see :meth:`DeltaTableWriter.append`: Delta's own check costs three
Spark jobs a commit). Appends add files; :meth:`DeltaTableWriter.replace` is an upsert's
copy-on-write (what a MERGE commits: the files holding changed rows removed, their new
content added) with the rows worked out by the caller in the same pass that reads them.

Spark is the one engine that writes. delta-rs (``deltalake``) only reads, for the commands
that need no JVM: always through ``deltalake.QueryBuilder`` (DataFusion), never
``DeltaTable.to_pyarrow_*``, which can abort the interpreter at exit.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import DeltaError

from sinks.errors import DeltaSinkError, SinkSchemaError
from sinks.storage import LakePath, is_delta_table, one_line, open_delta, spark_uri

if TYPE_CHECKING:  # the light readers import this module and must not pay for pyspark
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType, StructType

logger = logging.getLogger(__name__)

# The name a table is registered under for one read_table query; never visible to callers.
_QUERY_TABLE = "delta_table"

# Delta writes a checkpoint after every ``delta.checkpointInterval`` commits, in the committing
# thread, before the next batch can start: a Spark job of 1.9-3.6 s on a table a stream commits
# to twice a second (Delta's default: 10 commits), which queued every record behind it. The
# tables' interval is set beyond reach (a million commits: about six days of a stream's
# commits, twice a second), and every writer writes a checkpoint each CHECKPOINT_EVERY
# versions in a thread of its own (DeltaTableWriter.checkpoint_ahead); maintenance writes one
# at the newest version as well. Readers replay about that many JSON commits after a
# checkpoint at most (BENCHMARKS.md, issue 12, 2026-11-28).
CHECKPOINT_INTERVAL = "delta.checkpointInterval"
INLINE_CHECKPOINT_INTERVAL = 1_000_000
CHECKPOINT_EVERY = 100

# How long a table's log keeps each commit (its time travel), Delta's table property, and the
# session setting that gives it to every table (streaming.session, from the pipeline's
# ``delta_log_retention_hours``). Delta's own cleanup counts it in whole days (a stream's log
# kept up to a day more than asked); the writer cleans up at minute granularity after each of
# its checkpoints (:func:`checkpoint_and_clean`).
LOG_RETENTION = "delta.logRetentionDuration"
LOG_RETENTION_DEFAULT = "spark.databricks.delta.properties.defaults.logRetentionDuration"


def log_retention(hours: float) -> str:
    """``hours`` as Delta's ``delta.logRetentionDuration`` value: whole minutes, at least one."""
    return f"interval {max(1, round(hours * 60))} minutes"


def checkpoint_and_clean(spark: SparkSession, path: str, snapshot: Any = None) -> None:
    """Write Delta's checkpoint of ``snapshot`` (the newest when None) of the table at ``path``,
    then delete the log's commits and checkpoints older than the table's
    ``delta.logRetentionDuration`` that the checkpoint makes unneeded, counted to the minute
    (Delta's own cleanup, which runs after the checkpoint too, counts whole days)."""
    jvm = spark._jvm
    assert jvm is not None
    delta = jvm.org.apache.spark.sql.delta
    log = delta.DeltaLog.forTable(spark._jsparkSession, path)
    if snapshot is None:
        snapshot = log.update(False, jvm.scala.Option.empty(), jvm.scala.Option.empty())
    none = jvm.scala.Option.empty()
    if "://" not in path:
        # Hadoop's checksum of _last_checkpoint, from before the log was written without them
        # (streaming.session): the checkpoint rewrites the file in place, and a stale checksum
        # would make Hadoop's checksummed local file system refuse to read it.
        (Path(path.removeprefix("file:")) / "_delta_log" / "._last_checkpoint.crc").unlink(
            missing_ok=True
        )
    log.checkpointAndCleanUpDeltaLog(snapshot, none)
    if log.enableExpiredLogCleanup(snapshot.metadata()):
        minute = getattr(delta, "TruncationGranularity$").__getattr__("MODULE$").MINUTE()
        log.cleanUpExpiredLogs(snapshot, none, none, minute)


# The column :meth:`DeltaTableWriter.replace` adds to the stored rows: the name of the data file
# each row is in (the last part of its path).
FILE_COLUMN = "_file"

Plan = TypeVar("Plan")


@dataclass(frozen=True)
class Replacement(Generic[Plan]):
    """What a :meth:`DeltaTableWriter.replace` plan decided: ``rows`` to write (each in files
    of its own), the names of the files they ``replaced``, the caller's ``result``, and
    ``release`` to run once the commit is done or failed (e.g. unpersisting ``rows``)."""

    rows: Sequence[DataFrame]
    replaced: Collection[str]
    result: Plan
    release: Callable[[], object] | None = None


class DeltaTableWriter:
    """One Delta table, written by Spark's Delta data source, exactly once per batch id.

    ``app_id`` names the writing query; keep it stable across restarts from the same
    checkpoint. The table is created from ``schema`` (the one declaration in ``schemas/``) the
    first time it is written, never inferred from a batch. Every ``checkpoint_every``-th
    version it commits gets a Delta checkpoint written by a thread of its own
    (:meth:`checkpoint_ahead`), never in the committing thread.
    """

    def __init__(
        self,
        path: LakePath | str,
        app_id: str,
        schema: pa.Schema,
        partition_by: Sequence[str] = (),
        stats_columns: Sequence[str] = (),
        checkpoint_every: int = CHECKPOINT_EVERY,
    ) -> None:
        if not app_id:
            raise ValueError("app_id must not be empty")
        unknown = [name for name in partition_by if name not in schema.names]
        if unknown:
            raise SinkSchemaError(f"partition columns not in the schema: {unknown}")
        # Spark's name for the table (s3a:// in a bucket); delta-rs reads it at ``_location``.
        self._path = spark_uri(path)
        self._location = path
        self._app_id = app_id
        self._schema = schema
        self._partition_by = list(partition_by)
        unknown = [name for name in stats_columns if name not in schema.names]
        if unknown:
            raise SinkSchemaError(f"stats columns not in the schema: {unknown}")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self._checkpoint_every = checkpoint_every
        self._checkpointing: threading.Thread | None = None
        self._properties = {CHECKPOINT_INTERVAL: str(INLINE_CHECKPOINT_INTERVAL)}
        if stats_columns:
            self._properties[STATS_COLUMNS] = ",".join(stats_columns)
        self._ensured = False
        # (table version, batch id) of this writer's last append: the replay check's answer
        # while no other commit follows it.
        self._committed: tuple[int, int] | None = None
        self._schema_checked = False

    @property
    def path(self) -> str:
        return self._path

    @property
    def location(self) -> LakePath | str:
        """The table as delta-rs reads it (with a bucket's storage options)."""
        return self._location

    @property
    def app_id(self) -> str:
        return self._app_id

    def last_batch_id(self) -> int | None:
        """The highest batch id committed under ``app_id``, or None (no table, or no commit).

        A light read of the Delta log (delta-rs), no Spark job.
        """
        if not _is_table(self._location):
            return None
        try:
            version: int | None = open_delta(self._location).transaction_version(self._app_id)
        except (DeltaError, OSError) as exc:
            raise DeltaSinkError(f"{self._path}: cannot read the transaction log") from exc
        return version

    def ensure(self, spark: SparkSession) -> None:
        """Create the table (empty, with the declared schema, partitioning and properties) if
        it is not there yet, or give a table made before the properties and the columns it
        lacks (:meth:`upgrade`); a table of other columns is left as it is, for the schema
        check to refuse before a write. Creating it first keeps its schema the declared one: the
        nullability and types of ``schemas/``, not whatever a first batch happens to carry.
        Checked once per writer."""
        if self._ensured:
            return
        from delta.tables import DeltaTable as SparkDeltaTable

        if _is_table(self._location):
            self.upgrade(spark)
            table = open_delta(self._location)
            have = table.metadata().configuration
            wanted = dict(self._properties)
            retention = spark.conf.get(LOG_RETENTION_DEFAULT, None)
            if retention:  # the pipeline's setting reaches the tables made before it too
                wanted[LOG_RETENTION] = retention
            missing = {k: v for k, v in wanted.items() if have.get(k) != v}
            # A table of another schema is left untouched, for the schema check to refuse.
            ours = {field.name for field in table.schema().fields} == set(self._schema.names)
            if missing and ours:
                settings = ", ".join(f"'{k}' = '{v}'" for k, v in missing.items())
                spark.sql(f"ALTER TABLE delta.`{self._path}` SET TBLPROPERTIES ({settings})")
                logger.info("%s: set %s", self._path, settings)
            self._ensured = True
            return
        builder = (
            SparkDeltaTable.createIfNotExists(spark)
            .location(self._path)
            .addColumns(spark_schema(self._schema))
        )
        if self._partition_by:
            builder = builder.partitionedBy(*self._partition_by)
        for key, value in self._properties.items():
            builder = builder.property(key, value)
        builder.execute()
        self._ensured = True
        logger.info("%s: created Delta table partitioned by %s", self._path, self._partition_by)

    def upgrade(self, spark: SparkSession) -> list[str]:
        """Give the table the columns of the declared schema it lacks (a table written by an
        older edgebus); the names of the columns added ([] without a table).

        Columns are added where the declared schema has them (``ADD COLUMNS ... AFTER``, one
        commit, Delta's schema evolution: metadata only, no data file is rewritten), so the
        table's schema is the declared one again; the rows written before read null in them.
        Only a table whose columns are all declared, and which lacks only nullable ones, is
        upgraded: another is left as it is, for the schema check to refuse before a write.
        The app transactions are untouched: the next batch is recognised as the next one, a
        replayed one as a replay."""
        if not _is_table(self._location):
            return []
        stored = {field.name for field in open_delta(self._location).schema().fields}
        declared = spark_schema(self._schema)
        added = [field for field in declared if field.name not in stored]
        if (
            not added
            or not stored <= set(declared.names)
            or any(not field.nullable for field in added)
        ):
            return []
        names = declared.names
        columns = []
        for field in added:
            index = names.index(field.name)
            where = "FIRST" if index == 0 else f"AFTER {_backticked(names[index - 1])}"
            columns.append(f"{_backticked(field.name)} {field.dataType.simpleString()} {where}")
        spark.sql(f"ALTER TABLE delta.`{self._path}` ADD COLUMNS ({', '.join(columns)})")
        logger.info("%s: added columns %s", self._path, ", ".join(columns))
        return [field.name for field in added]

    def append(self, batch_id: int, rows: DataFrame) -> int | None:
        """Append ``rows`` as batch ``batch_id``, exactly once: the rows and the app transaction
        ``(app_id, batch_id)`` go in one Delta commit, and a batch the table already holds is
        skipped. Returns how many rows the commit holds (from the files' statistics; 0 when
        ``rows`` is empty, and then nothing is committed: a replay finds nothing either), or
        None when the batch was skipped or a file has no statistics.

        The rows are written by the executors that hold them; the driver only commits. The
        commit is Delta's own transaction (``DeltaLog.startTransaction``, ``writeFiles``,
        ``commit`` with a ``SetTransaction`` action: what ``txnAppId``/``txnVersion`` make
        the data source write), and Delta checks the rows against the table's schema and NOT
        NULL constraints as it writes them. What the data source's options would add is the
        replay check, and that check rebuilds the table's whole state from its log with three
        Spark jobs on every commit (``Snapshot.transactions``; 0.55 s against 0.23 s for the
        whole append here, BENCHMARKS.md issue 18). The writer makes the same check itself:
        the last batch it committed, while the table's version is the one that commit made,
        else the table's app transactions as delta-rs reads them from the log.
        """
        if batch_id < 0:
            raise ValueError(f"batch_id must be >= 0, got {batch_id}")
        conformed = self.conformed(rows)
        spark = rows.sparkSession
        try:
            creating = not self._ensured and not _is_table(self._location)
            txn = self._transaction(spark, conformed, create=not creating)
            if creating:
                txn.updateMetadataForNewTable(self._new_metadata(spark))
            elif self._replayed(txn, batch_id):
                return None
            began = time.monotonic()
            files = txn.writeFiles(conformed._jdf)
            wrote = time.monotonic()
            written = _rows_in(files)
            if written == 0:
                if creating:  # an empty first batch still makes the (empty) table
                    self.ensure(spark)
                return 0
            version = self._commit(spark, txn, files, batch_id, "Append")
            if creating:
                self._ensured = True
                logger.info(
                    "%s: created Delta table partitioned by %s, with its first batch",
                    self._path,
                    self._partition_by,
                )
        except SinkSchemaError:
            raise
        except Exception as exc:  # py4j/Spark raise many types; the message says which
            self._committed = None
            raise DeltaSinkError(
                f"{self._path}: writing batch {batch_id} of {self._app_id} failed: {exc}"
            ) from exc
        logger.info(
            "%s: batch %d of %s committed as version %d (%s rows; files %.2f s, commit %.2f s)",
            self._path,
            batch_id,
            self._app_id,
            version,
            written,
            wrote - began,
            time.monotonic() - wrote,
        )
        return written

    def replace(
        self,
        batch_id: int,
        spark: SparkSession,
        partitions: str,
        plan: Callable[[DataFrame], Replacement[Plan]],
    ) -> Plan | None:
        """Rewrite files of the partitions ``partitions`` selects as batch ``batch_id``, exactly
        once: what a merge does, with the rows worked out by the caller in one pass.

        ``partitions`` is a SQL condition on the partition columns only. ``plan`` gets the
        stored rows of those partitions, as of the snapshot the commit builds on, with the
        name of the data file each is in (column :data:`FILE_COLUMN`), and returns a
        :class:`Replacement`: the rows to write (each DataFrame in files of its own, so rows
        that change often do not drag others along) and the names of the files they replace.
        One Delta commit removes those files and adds the new ones, with the app transaction
        ``(app_id, batch_id)``; a batch the table holds already is skipped (None, ``plan`` not
        called). The commit declares the partitions it read, so a compaction that removed any
        of their files first makes it fail; then the whole replacement is planned again on the
        new snapshot (``plan`` must depend on its input only), up to :data:`REPLACE_ATTEMPTS`.
        """
        if batch_id < 0:
            raise ValueError(f"batch_id must be >= 0, got {batch_id}")
        attempt = 1
        while True:
            try:
                txn = self._transaction(spark)
                if self._replayed(txn, batch_id):
                    return None
                found, stored = self._partition_files(spark, txn, partitions)
                replacement = plan(stored)
                try:
                    self._commit_replacement(spark, txn, batch_id, partitions, found, replacement)
                finally:
                    if replacement.release is not None:
                        replacement.release()
            except SinkSchemaError:
                raise
            except Exception as exc:  # py4j wraps Delta's exceptions; their class is in the text
                self._committed = None
                if not _lost_race(exc) or attempt == REPLACE_ATTEMPTS:
                    raise DeltaSinkError(
                        f"{self._path}: replacing files for batch {batch_id} of {self._app_id} "
                        f"failed (attempt {attempt}): {exc}"
                    ) from exc
                logger.info("%s: lost a commit race, planning again: %s", self._path, exc)
                attempt += 1
            else:
                return replacement.result

    def _partition_files(
        self, spark: SparkSession, txn: Any, partitions: str
    ) -> tuple[Any, DataFrame]:
        """The data files of the partitions ``partitions`` selects in ``txn``'s snapshot (a
        Scala sequence of ``AddFile``, recorded as the transaction's read), and their rows with
        each one's file name (:data:`FILE_COLUMN`), read as Delta's own commands read the files
        they rewrite."""
        from pyspark.sql import DataFrame
        from pyspark.sql import functions as F  # noqa: N812 (pyspark's own convention)

        jvm = spark._jvm
        assert jvm is not None  # a classic (not Connect) session, as every session here
        parser = spark._jsparkSession.sessionState().sqlParser()
        read = _scala_list(jvm, [parser.parseExpression(partitions)])
        found = txn.filterFiles(read, False)
        scan = txn.deltaLog().createDataFrame(
            txn.snapshot(), found, False, jvm.scala.Option.empty()
        )
        stored = DataFrame(scan, spark).withColumn(
            FILE_COLUMN, F.regexp_extract("_metadata.file_path", "[^/]*$", 0)
        )
        return found, stored

    def _commit_replacement(
        self,
        spark: SparkSession,
        txn: Any,
        batch_id: int,
        partitions: str,
        found: Any,
        replacement: Replacement[Any],
    ) -> None:
        """Write ``replacement``'s rows and commit them with the removal of the files they
        replace (among ``found``) as batch ``batch_id``; nothing when there is neither."""
        began = time.monotonic()
        actions = []
        for rows in replacement.rows:
            added = txn.writeFiles(self.conformed(rows)._jdf).iterator()
            while added.hasNext():
                actions.append(added.next())
        removed = _removals(found, replacement.replaced)
        actions += removed
        if not actions:
            return
        wrote = time.monotonic()
        files = _scala_list(spark._jvm, actions)
        version = self._commit(spark, txn, files, batch_id, "Overwrite", predicate=partitions)
        self._prepare_next(spark)
        logger.info(
            "%s: batch %d of %s committed as version %d (%d files replaced; written %.2f s, "
            "commit %.2f s)",
            self._path,
            batch_id,
            self._app_id,
            version,
            len(removed),
            wrote - began,
            time.monotonic() - wrote,
        )

    def _prepare_next(self, spark: SparkSession) -> None:
        """Build the new snapshot's file state in a background thread: the next replacement
        reads it (``filterFiles``), and a Delta snapshot rebuilds it from the log, with Spark
        jobs, the first time it is asked, after every commit. Built now, while the pipeline
        writes the next batch's other tables, it is ready when the next replacement starts."""
        jvm = spark._jvm
        assert jvm is not None
        snapshot = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(
            spark._jsparkSession, self._path
        ).unsafeVolatileSnapshot()

        def build() -> None:
            try:
                snapshot.allFiles().count()
            except Exception as exc:  # only a head start: the next replacement builds it anyway
                logger.info("%s: building the snapshot's state ahead failed: %s", self._path, exc)

        threading.Thread(target=build, name="delta-snapshot", daemon=True).start()

    def _transaction(
        self, spark: SparkSession, rows: DataFrame | None = None, *, create: bool = True
    ) -> Any:
        """A new Delta transaction on the table (created first if need be, unless ``create``
        is false: the caller's commit makes it); the table's schema is checked against
        ``rows``' once per writer."""
        if create:
            self.ensure(spark)
        jvm = spark._jvm
        assert jvm is not None  # a classic (not Connect) session, as every session here
        delta = jvm.org.apache.spark.sql.delta
        txn = delta.DeltaLog.forTable(spark._jsparkSession, self._path).startTransaction()
        if rows is not None and not self._schema_checked:
            table = txn.metadata().schema().json() if create else spark_schema(self._schema).json()
            self._check_schema(table, rows.schema)
        return txn

    def _new_metadata(self, spark: SparkSession) -> Any:
        """The metadata a new table gets from its first commit: the declared schema,
        partitioning and properties (Delta adds the session's defaults and the protocol, as
        ``CREATE TABLE`` does; one commit where creating first took two)."""
        jvm = spark._jvm
        assert jvm is not None
        delta = jvm.org.apache.spark.sql.delta
        to_scala = jvm.org.apache.spark.api.python.PythonUtils.toScalaMap
        properties = jvm.java.util.HashMap()
        for key, value in self._properties.items():
            properties.put(key, value)
        return delta.actions.Metadata(
            str(uuid.uuid4()),
            None,
            None,
            delta.actions.Format("parquet", to_scala(jvm.java.util.HashMap())),
            spark_schema(self._schema).json(),
            _scala_list(jvm, list(self._partition_by)),
            to_scala(properties),
            jvm.scala.Option.apply(jvm.java.lang.Long.valueOf(int(time.time() * 1000))),
        )

    def _replayed(self, txn: Any, batch_id: int) -> bool:
        """Whether the table holds batch ``batch_id`` already (logged): the last batch this
        writer committed, while the table's version is the one that commit made, else the
        table's app transactions as delta-rs reads them from the log."""
        if self._committed is not None and self._committed[0] == txn.snapshot().version():
            done: int | None = self._committed[1]
        else:
            done = self.last_batch_id()
        if done is None or done < batch_id:
            return False
        logger.info(
            "%s: batch %d of %s already committed (last %d), skipped",
            self._path,
            batch_id,
            self._app_id,
            done,
        )
        return True

    def _commit(
        self,
        spark: SparkSession,
        txn: Any,
        files: Any,
        batch_id: int,
        mode: str,
        predicate: str | None = None,
    ) -> int:
        """Commit ``files`` (a Scala sequence of actions) with the app transaction
        ``(app_id, batch_id)``, in the table's history as a write in save mode ``mode``
        (``predicate``: the partitions it replaced); the new version."""
        jvm = spark._jvm
        assert jvm is not None
        delta = jvm.org.apache.spark.sql.delta
        now = jvm.java.lang.Long.valueOf(int(time.time() * 1000))
        marker = delta.actions.SetTransaction(self._app_id, batch_id, jvm.scala.Option.apply(now))
        none = jvm.scala.Option.empty()
        operation = getattr(delta, "DeltaOperations$Write")(
            getattr(jvm.org.apache.spark.sql.SaveMode, mode),
            none,
            jvm.scala.Option.apply(predicate) if predicate is not None else none,
            *([none] * 6),
        )
        version: int = txn.commit(files.appended(marker), operation)
        self._committed = (version, batch_id)
        if version and version % self._checkpoint_every == 0:
            self.checkpoint_ahead(spark, version)
        return version

    def checkpoint_ahead(self, spark: SparkSession, version: int) -> bool:
        """Write Delta's checkpoint of the table at ``version`` (just committed) in a thread of
        its own, and clean up the log behind it (:func:`checkpoint_and_clean`); False when the
        last one is still being written (the next one due catches up).

        Delta writes its checkpoint after the commit, in the committing thread, every
        ``delta.checkpointInterval`` commits: a Spark job of 2-3.6 s on the stream's path, which
        every record queued behind (BENCHMARKS.md, issue 12). The tables' own interval is set
        beyond reach (:data:`INLINE_CHECKPOINT_INTERVAL`) and the writer writes it here
        instead. A checkpoint is an optional file beside the commits it sums up: one cut short
        by a crash is ignored by every reader, and maintenance writes one at the newest
        version all the same."""
        if self._checkpointing is not None and self._checkpointing.is_alive():
            logger.info(
                "%s: checkpoint at %d skipped, the last one is running", self._path, version
            )
            return False
        jvm = spark._jvm
        assert jvm is not None
        log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, self._path)
        snapshot = log.unsafeVolatileSnapshot()

        def write() -> None:
            began = time.monotonic()
            try:
                checkpoint_and_clean(spark, self._path, snapshot)
            except Exception as exc:  # maintenance writes one at the newest version anyway
                logger.warning("%s: checkpoint at %d failed: %s", self._path, version, exc)
                return
            logger.info(
                "%s: checkpoint at %d written in %.2f s",
                self._path,
                snapshot.version(),
                time.monotonic() - began,
            )

        self._checkpointing = threading.Thread(target=write, name="delta-checkpoint", daemon=True)
        self._checkpointing.start()
        return True

    def wait_checkpoint(self, timeout: float | None = None) -> bool:
        """Wait for the checkpoint being written, if any; False while it still runs."""
        thread = self._checkpointing
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _check_schema(self, table_json: str, rows: StructType) -> None:
        """The table's columns and types (nullability aside) are the rows': the check Delta's
        data source makes before a write, made once per writer."""
        from pyspark.sql.types import StructType

        table = StructType.fromJson(json.loads(table_json))
        if loose(table) != loose(rows):
            raise SinkSchemaError(
                f"{self._path}: the table's schema {table.simpleString()} is not the declared "
                f"{rows.simpleString()}"
            )
        self._schema_checked = True

    def conformed(self, rows: DataFrame) -> DataFrame:
        """``rows`` with exactly the table's columns, in order, cast to the table's types."""
        from pyspark.sql import functions as F  # noqa: N812 (pyspark's own convention)

        missing = [name for name in self._schema.names if name not in rows.columns]
        if missing:
            raise SinkSchemaError(f"{self._path}: the rows lack columns {missing}")
        have = {field.name: field.dataType for field in rows.schema}
        target = spark_schema(self._schema)
        return rows.select(
            *[
                F.col(f"`{field.name}`")
                if have[field.name] == field.dataType
                else F.col(f"`{field.name}`").cast(loose(field.dataType)).alias(field.name)
                for field in target
            ]
        )


def _scala_list(jvm: Any, items: Sequence[Any]) -> Any:
    """A Scala immutable list of ``items`` (JVM objects), for Delta's Scala APIs."""
    java = jvm.java.util.ArrayList()
    for item in items:
        java.add(item)
    return jvm.scala.jdk.javaapi.CollectionConverters.asScala(java).toList()


def _removals(found: Any, names: Collection[str]) -> list[Any]:
    """The remove actions for the files ``names`` among ``found`` (a Scala sequence of
    ``AddFile``: the files the transaction read). Each name must be one of them: a plan that
    names another file read another snapshot."""
    wanted = set(names)
    removes = []
    files = found.iterator()
    while wanted and files.hasNext():
        add = files.next()
        name = add.path().rsplit("/", 1)[-1]
        if name in wanted:
            wanted.discard(name)
            removes.append(add.remove())
    if wanted:
        raise DeltaSinkError(f"files to replace are not in the snapshot read: {sorted(wanted)}")
    return removes


def _rows_in(files: Any) -> int | None:
    """The rows of the files ``writeFiles`` wrote (a Scala sequence of ``AddFile``), from the
    statistics Delta collects for each (None if a file has none)."""
    rows = 0
    found = files.iterator()
    while found.hasNext():
        counted = found.next().numLogicalRecords()
        if counted.isEmpty():
            return None
        rows += int(counted.get())
    return rows


# The columns Delta keeps min/max statistics of in each file's log entry (the readers prune
# files with them). Collecting them costs about as much as writing the rows, so the hot tables
# keep them for the columns queries filter on, not for every column (Delta's default: 32).
STATS_COLUMNS = "delta.dataSkippingStatsColumns"

# How often a replacement that lost a commit race to a compaction is planned again.
REPLACE_ATTEMPTS = 5
# Delta's conflicts a retry on a fresh snapshot resolves (a compaction committed first).
_RACES = ("ConcurrentAppendException", "ConcurrentDeleteReadException", "ConcurrentDeleteDelete")


def _lost_race(exc: Exception) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(name in text for name in _RACES)


def loose(data_type: DataType) -> DataType:
    """``data_type`` with every nested field nullable: what a cast can produce (Spark casts
    to no nested NOT NULL). The table's own NOT NULL columns are still checked by Delta."""
    from pyspark.sql.types import ArrayType, MapType, StructField, StructType

    if isinstance(data_type, ArrayType):
        return ArrayType(loose(data_type.elementType), containsNull=True)
    if isinstance(data_type, MapType):
        return MapType(loose(data_type.keyType), loose(data_type.valueType), True)
    if isinstance(data_type, StructType):
        return StructType([StructField(f.name, loose(f.dataType), True) for f in data_type])
    return data_type


def spark_schema(schema: pa.Schema) -> StructType:
    """The Spark schema of an Arrow schema of ``schemas/``, nullability included (nested too)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    converted: StructType = from_arrow_schema(schema, prefer_timestamp_ntz=False)
    return converted


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns, order and types, or :class:`SinkSchemaError`.

    Engines hand over equivalent but different Arrow types (Spark: large strings, the session
    time zone, nullable nested fields); values are cast, never dropped or invented.

    A column with an empty buffer anywhere is also copied into one fresh array. Spark's
    (Java) Arrow writer gives zero-length string/binary arrays, e.g. the keys under a batch of
    empty lists or an empty partition's chunk, an empty offsets buffer instead of one zero
    offset; delta-rs (arrow-rs) then reads past the buffer and panics. pyarrow's concatenation
    rebuilds proper offsets at every nesting level. Columns without an empty buffer are not
    copied: at 100,000 rows a second the copy of every payload would cost a tenth of the time.
    """
    missing = [name for name in schema.names if name not in table.column_names]
    extra = [name for name in table.column_names if name not in schema.names]
    if missing or extra:
        raise SinkSchemaError(f"columns do not match the table: missing {missing}, extra {extra}")
    columns = []
    for field in schema:
        column = table.column(field.name)
        if not field.nullable and column.null_count:
            raise SinkSchemaError(f"column {field.name!r}: {column.null_count} nulls, not nullable")
        try:
            cast = column.cast(field.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise SinkSchemaError(
                f"column {field.name!r}: cannot cast {column.type} to {field.type}: {exc}"
            ) from exc
        if any(_has_empty_buffer(chunk) for chunk in cast.chunks):
            cast = pa.chunked_array([pa.concat_arrays(cast.chunks)], field.type)
        columns.append(cast)
    return pa.Table.from_arrays(columns, schema=schema)


def _has_empty_buffer(array: pa.Array) -> bool:
    """Whether any buffer of ``array`` (children included) is allocated with zero bytes; a
    sound offsets buffer never is (it holds at least one offset)."""
    return any(buffer is not None and buffer.size == 0 for buffer in array.buffers())


def read_table(
    path: LakePath | str,
    sql_where: str | None = None,
    columns: Sequence[str] | None = None,
    *,
    schema: pa.Schema | None = None,
    limit: int | None = None,
) -> pa.Table:
    """Rows of the Delta table at ``path`` (in no particular order), as one Arrow table.

    ``sql_where`` is a DataFusion SQL condition (``"tenant = 'acme' AND seq > 10"``);
    ``columns`` selects and orders columns. The result has the table's own Arrow types, or
    ``schema``'s when given (its fields for the selected columns). ``limit`` caps the rows read
    (which ones is up to the engine).
    """
    target = str(path)
    if not _is_table(path):
        raise DeltaSinkError(f"{target}: not a Delta table")
    try:
        delta = open_delta(path)
        table_schema = pa.schema(delta.schema().to_arrow())
        names = list(columns) if columns is not None else table_schema.names
        unknown = [name for name in names if name not in table_schema.names]
        if unknown:
            raise SinkSchemaError(f"{target}: no such columns {unknown}")
        # The query is read-only over this one table; the condition is SQL by contract.
        sql = f"SELECT {', '.join(_quote(n) for n in names)} FROM {_QUERY_TABLE}"  # noqa: S608
        if sql_where:
            sql += f" WHERE {sql_where}"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        result = run_sql(delta, _QUERY_TABLE, sql)
    except (DeltaError, OSError) as exc:
        raise DeltaSinkError(f"{target}: query failed: {exc}") from exc
    # DataFusion answers with view types (string_view, binary_view); hand back the table's.
    wanted = schema if schema is not None else table_schema
    return conform(result, pa.schema([wanted.field(name) for name in names]))


def run_sql(delta: DeltaTable, name: str, sql: str) -> pa.Table:
    """The result of ``sql`` over ``delta`` registered as ``name`` (DataFusion), in Arrow.

    Read through the Arrow C stream, not ``pa.table()``: that imports pandas (a third of a
    second, which a command line pays on every run) to check for a DataFrame. Errors are
    DataFusion's own (``DeltaError``, or a plain ``Exception`` for a missing data file).
    """
    reader = QueryBuilder().register(name, delta).execute(sql)
    return pa.RecordBatchReader.from_stream(reader).read_all()


def _is_table(path: LakePath | str) -> bool:
    try:
        return is_delta_table(path)
    except OSError as exc:  # a plain file where the table directory should be; no bucket
        raise DeltaSinkError(f"{path}: cannot be a Delta table: {one_line(exc)}") from exc


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _backticked(identifier: str) -> str:
    """A Spark SQL identifier (``limit`` is a keyword)."""
    return "`" + identifier.replace("`", "``") + "`"
