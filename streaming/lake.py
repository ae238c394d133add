"""Analysts' reads of the lake: any edgebus table, as it is now or as of a Delta version or time.

Spark has no Delta reader here (Delta's JVM jars are not available), so every read goes through
delta-rs: the table, loaded at the version asked for, is queried with DataFusion
(``deltalake.QueryBuilder``; never ``DeltaTable.to_pyarrow_*``, which can abort the interpreter
at exit), cast to the table's schema from :data:`schemas.tables.TABLES`, and for Spark turned
into a DataFrame with that schema, never an inferred one. ``where`` is a DataFusion SQL
condition; on a partition column (``tenant``, ``date``) it prunes whole files.

Rows are collected on the driver: this is for notebooks and analysis over an embedded lake, not
for streaming jobs (they read the journal).

    from streaming import lake
    logs = lake.load(spark, "lake", "logs", where="tenant = 'acme'")
    before = lake.load_arrow("lake", "messages", version=3)
    yesterday = lake.load_arrow("lake", "logs", timestamp=datetime(2024, 3, 9, tzinfo=UTC))
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

from schemas.tables import TABLES, TableSpec
from sinks.delta import conform, run_sql
from sinks.errors import SinkSchemaError
from streaming.errors import PipelineError

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
    lake: Path | str,
    table: str,
    *,
    version: int | None = None,
    timestamp: datetime | None = None,
) -> DeltaTable:
    """``table`` under ``lake`` at ``version``, or as it was at ``timestamp``, or now.

    ``timestamp`` must be time-zone aware; it selects the last version committed at or before
    it. A time before the table was created is an error, not an empty table.
    """
    table_spec(table)
    if version is not None and timestamp is not None:
        raise ValueError("give version or timestamp, not both")
    if timestamp is not None and timestamp.utcoffset() is None:
        raise ValueError(f"timestamp must be time-zone aware, got {timestamp.isoformat()}")
    path = str(Path(lake) / table)
    if not DeltaTable.is_deltatable(path):
        raise LakeError(f"{path}: no {table} table (has the pipeline written it yet?)")
    try:
        delta = DeltaTable(path, version=version)
        if timestamp is not None:
            delta.load_as_version(timestamp)
            _check_existed(delta, timestamp)
    except DeltaError as exc:
        at = f" at version {version}" if version is not None else ""
        raise LakeError(f"{path}: cannot load the table{at}: {exc}") from exc
    return delta


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
    lake: Path | str,
    table: str,
    *,
    version: int | None = None,
    timestamp: datetime | None = None,
    where: str | None = None,
) -> pa.Table:
    """The rows of ``table`` (in no particular order) with exactly its schema, as Arrow."""
    schema = table_spec(table).schema
    delta = open_table(lake, table, version=version, timestamp=timestamp)
    columns = ", ".join('"' + name.replace('"', '""') + '"' for name in schema.names)
    # The query is read-only over this one table; the condition is SQL by contract.
    sql = f"SELECT {columns} FROM {_QUERY_TABLE}"  # noqa: S608
    if where:
        sql += f" WHERE {where}"
    try:
        result = run_sql(delta, _QUERY_TABLE, sql)
        # DataFusion answers with view types (string_view, binary_view); hand back the table's.
        return conform(result, schema)
    except (DeltaError, SinkSchemaError) as exc:
        raise LakeError(f"{delta.table_uri}: query failed: {exc}") from exc


def load(
    spark: SparkSession,
    lake: Path | str,
    table: str,
    *,
    version: int | None = None,
    timestamp: datetime | None = None,
    where: str | None = None,
) -> DataFrame:
    """:func:`load_arrow` as a Spark DataFrame with the table's Spark schema."""
    rows = load_arrow(lake, table, version=version, timestamp=timestamp, where=where)
    schema = from_arrow_schema(rows.schema)
    if rows.num_rows == 0:
        # No rows can mean no chunks (version 0, a filter that matches nothing), and pyspark
        # cannot convert a nested column (messages.user_properties) without chunks.
        return spark.createDataFrame([], schema=schema)
    return spark.createDataFrame(rows, schema=schema)
