"""SQL reads over one Delta table (delta-rs and DataFusion, no JVM), for the light readers.

The upserts themselves are Spark's Delta commits (:meth:`sinks.delta.DeltaTableWriter.replace`);
this module keeps the read side the quota step and the lake commands share.
:func:`query_table` runs one SQL query over one table through ``deltalake.QueryBuilder``,
never ``DeltaTable.to_pyarrow_*`` (see :mod:`sinks.delta`).
"""

from __future__ import annotations

import pyarrow as pa
from deltalake.exceptions import DeltaError

from sinks.delta import run_sql
from sinks.errors import DeltaSinkError
from sinks.storage import LakePath, is_delta_table, one_line, open_delta

TABLE_NAME = "t"
"""The name the table has in :func:`query_table`'s SQL: ``SELECT ... FROM t``."""


def query_table(path: LakePath | str, sql: str) -> pa.Table:
    """The result of ``sql`` over the Delta table at ``path``, which it names ``t``.

    The caller builds ``sql``; quote literals with :func:`sql_string`. A missing table is an
    error: callers that may run first check :func:`table_exists`.
    """
    target = str(path)
    if not table_exists(path):
        raise DeltaSinkError(f"{target}: not a Delta table")
    try:
        table = run_sql(open_delta(path), TABLE_NAME, sql)
    except (DeltaError, OSError) as exc:
        raise DeltaSinkError(f"{target}: query failed: {exc}") from exc
    # DataFusion answers with view types (string_view, binary_view); plain types are simpler.
    fields = [pa.field(f.name, _plain(f.type), f.nullable) for f in table.schema]
    return table.cast(pa.schema(fields))


def table_exists(path: LakePath | str) -> bool:
    try:
        return is_delta_table(path)
    except OSError as exc:
        raise DeltaSinkError(f"{path}: cannot be a Delta table: {one_line(exc)}") from exc


def sql_string(value: str) -> str:
    """``value`` as a SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def _plain(type_: pa.DataType) -> pa.DataType:
    if type_ == pa.string_view():
        return pa.string()
    if type_ == pa.binary_view():
        return pa.binary()
    return type_
