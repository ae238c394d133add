"""Analysts' reads of the lake: any edgebus table, as it is now or as of a Delta version or time.

Two ways, one meaning:

- :func:`load` is Spark's own Delta reader (``spark.read.format("delta")``, time travel with
  ``versionAsOf``/``timestampAsOf``): a distributed DataFrame, partition-pruned by ``where`` on
  ``tenant``/``date``, nothing collected to the driver. The session needs Delta's jars
  (``streaming.session.delta_config``, or ``configure_spark_with_delta_pip``).
- :func:`load_arrow` is delta-rs and DataFusion on this process, no JVM, for notebooks and
  commands over an embedded lake (``deltalake.QueryBuilder``; never
  ``DeltaTable.to_pyarrow_*``, which can abort the interpreter at exit), cast to the table's
  schema from :data:`schemas.tables.TABLES`.

    from streaming import lake
    logs = lake.load(spark, "lake", "logs", where="tenant = 'acme'")
    in_a_bucket = lake.load(spark, "s3://bucket/lake", "logs")  # AWS_* environment variables
    before = lake.load(spark, "lake", "messages", version=3)
    yesterday = lake.load_arrow("lake", "logs", timestamp=datetime(2024, 3, 9, tzinfo=UTC))
    day = lake.latest_date("lake", "usage", where="tenant = 'acme'")  # the day to look at
"""

from __future__ import annotations

from datetime import date, datetime

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError
from pyspark.sql import DataFrame, SparkSession

from schemas.tables import TABLES, TableSpec
from sinks.delta import conform, run_sql, spark_schema
from sinks.errors import SinkSchemaError
from sinks.storage import (
    LakePath,
    StorageError,
    is_delta_table,
    lake_path,
    one_line,
    open_delta,
    spark_uri,
)
from streaming.errors import PipelineError
from streaming.session import use_lake

# The name a table is registered under for one query; never visible to callers.
_QUERY_TABLE = "lake_table"


class LakeError(PipelineError):
    """A table cannot be read as asked: unknown name, no table, no such version or time."""


def table_spec(table: str) -> TableSpec:
    """The schema and partitioning of ``table``, or :class:`LakeError` naming the known ones."""
    spec = TABLES.get(table)
    if spec is None:
        raise LakeError(f"unknown table {table!r}; the lake has {', '.join(sorted(TABLES))}")
    return spec


def open_table(
    lake: LakePath | str,
    table: str,
    *,
    version: int | None = None,
    timestamp: datetime | None = None,
) -> DeltaTable:
    """``table`` under ``lake`` at ``version``, or as it was at ``timestamp``, or now.

    ``timestamp`` must be time-zone aware; it selects the last version committed at or before
    it. A time before the table was created is an error, not an empty table. ``lake`` may be
    ``s3://bucket/prefix`` (reached as the ``AWS_*`` environment variables say, or pass an
    :class:`sinks.storage.ObjectPath` with its own options).
    """
    path = _table_path(lake, table, version, timestamp)
    try:
        delta = open_delta(path, version=version)
        if timestamp is not None:
            delta.load_as_version(timestamp)
            _check_existed(delta, timestamp)
    except DeltaError as exc:
        at = f" at version {version}" if version is not None else ""
        raise LakeError(f"{path}: cannot load the table{at}: {exc}") from exc
    return delta


def _table_path(
    lake: LakePath | str, table: str, version: int | None, timestamp: datetime | None
) -> LakePath:
    """The path of ``table`` under ``lake`` once the arguments are checked and it is a table."""
    table_spec(table)
    if version is not None and timestamp is not None:
        raise ValueError("give version or timestamp, not both")
    if timestamp is not None and timestamp.utcoffset() is None:
        raise ValueError(f"timestamp must be time-zone aware, got {timestamp.isoformat()}")
    try:
        path = (lake if isinstance(lake, LakePath) else lake_path(lake)) / table
        found = is_delta_table(path)
    except StorageError as exc:
        raise LakeError(str(exc)) from exc
    except OSError as exc:  # no bucket, no access
        raise LakeError(f"{lake}: cannot read the lake: {one_line(exc)}") from exc
    if not found:
        raise LakeError(f"{path}: no {table} table (has the pipeline written it yet?)")
    return path


def _check_existed(delta: DeltaTable, timestamp: datetime) -> None:
    # delta-rs answers a time before the first commit with version 0; that is not what the
    # table held then (nothing), so say so instead of returning rows committed later. The
    # creation time is the table's own record (its metadata), not a storage detail.
    created_ms = delta.metadata().created_time
    if created_ms is not None and timestamp.timestamp() * 1000 < created_ms:
        created = datetime.fromtimestamp(created_ms / 1000, timestamp.tzinfo)
        raise LakeError(
            f"{delta.table_uri}: no version at {timestamp.isoformat()}; "
            f"the table was created at {created.isoformat()}"
        )


def load_arrow(
    lake: LakePath | str,
    table: str,
    *,
    version: int | None = None,
    timestamp: datetime | None = None,
    where: str | None = None,
) -> pa.Table:
    """The rows of ``table`` (in no particular order) with exactly its schema, as Arrow.

    A version written before a column existed (or a lake the pipeline has not upgraded yet)
    reads null in it."""
    schema = table_spec(table).schema
    delta = open_table(lake, table, version=version, timestamp=timestamp)
    stored = {field.name for field in delta.schema().fields}
    present = [name for name in schema.names if name in stored]
    columns = ", ".join('"' + name.replace('"', '""') + '"' for name in present)
    # The query is read-only over this one table; the condition is SQL by contract.
    sql = f"SELECT {columns} FROM {_QUERY_TABLE}"  # noqa: S608
    if where:
        sql += f" WHERE {where}"
    try:
        result = run_sql(delta, _QUERY_TABLE, sql)
        for field in schema:
            if field.name not in stored:
                result = result.append_column(field, pa.nulls(result.num_rows, field.type))
        # DataFusion answers with view types (string_view, binary_view); hand back the table's.
        return conform(result, schema)
    except (DeltaError, SinkSchemaError) as exc:
        raise LakeError(f"{delta.table_uri}: query failed: {exc}") from exc


def load(
    spark: SparkSession,
    lake: LakePath | str,
    table: str,
    *,
    version: int | None = None,
    timestamp: datetime | None = None,
    where: str | None = None,
) -> DataFrame:
    """``table`` as a Spark DataFrame read by Spark's Delta (at ``version`` or as of
    ``timestamp``, else now), with ``where`` (Spark SQL) applied: partition-pruned,
    distributed, never collected."""
    path = _table_path(lake, table, version, timestamp)
    if timestamp is not None:
        _check_existed(open_delta(path), timestamp)
    use_lake(spark, path)
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    if timestamp is not None:
        reader = reader.option("timestampAsOf", timestamp.isoformat())
    try:
        rows = reader.load(spark_uri(path))
    except Exception as exc:  # py4j wraps Delta's errors; the message says which
        raise LakeError(f"{path}: cannot load the table: {exc}") from exc
    # A version written before a column existed reads null in it, as load_arrow's does.
    declared = spark_schema(table_spec(table).schema)
    missing = [field for field in declared if field.name not in rows.columns]
    if missing:
        from pyspark.sql import functions as F  # noqa: N812 (pyspark's own convention)

        rows = rows.select(
            *[F.col(f"`{name}`") for name in rows.columns],
            *[F.lit(None).cast(field.dataType).alias(field.name) for field in missing],
        )
    return rows.where(where) if where else rows


def latest_date(lake: LakePath | str, table: str, *, where: str | None = None) -> date | None:
    """The latest UTC ``date`` of ``table`` that has rows (matching ``where``), through delta-rs;
    None when none has. The day to show by default: after midnight UTC today has nothing yet,
    and a lake copied or replayed elsewhere ends on its own last day."""
    table_spec(table)  # a known table, partitioned by date
    delta = open_table(lake, table)
    sql = f"SELECT max(date) AS latest FROM {_QUERY_TABLE}"  # noqa: S608 (a fixed name)
    if where:
        sql += f" WHERE {where}"
    try:
        latest: date | None = run_sql(delta, _QUERY_TABLE, sql).column(0)[0].as_py()
    except DeltaError as exc:
        raise LakeError(f"{delta.table_uri}: query failed: {exc}") from exc
    return latest
