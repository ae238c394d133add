"""The idempotent Delta writer and a safe Delta reader, both on delta-rs (``deltalake``).

Theory of operation: a streaming job hands every micro-batch to :meth:`DeltaBatchWriter.write`
from ``foreachBatch``. Spark's checkpoint writes a batch's offsets before running it and its
commit marker after, so a crash between the two replays the same batch (same id, same rows).
Each append carries a Delta app transaction ``(app_id, batch_id)`` in the same atomic commit as
its data; a replayed batch finds ``transaction_version(app_id) >= batch_id`` and is skipped.

Empty batches are not committed at all: a commit per empty trigger would only bloat the log,
and replaying an empty batch writes nothing either way, so nothing can be duplicated.

Reading goes through ``deltalake.QueryBuilder`` (DataFusion) only: ``DeltaTable.to_pyarrow_*``
can abort the interpreter at exit, which a replayable pipeline cannot afford.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction, write_deltalake
from deltalake.exceptions import DeltaError

from sinks.errors import DeltaSinkError, SinkSchemaError

logger = logging.getLogger(__name__)

# The name a table is registered under for one read_table query; never visible to callers.
_QUERY_TABLE = "delta_table"


class DeltaBatchWriter:
    """Appends micro-batches to one Delta table, exactly once per ``(app_id, batch_id)``.

    ``app_id`` names the writing query; give each streaming job its own, and keep it stable
    across restarts from the same checkpoint.
    """

    def __init__(
        self,
        path: Path | str,
        app_id: str,
        schema: pa.Schema,
        partition_by: Sequence[str] = (),
    ) -> None:
        if not app_id:
            raise ValueError("app_id must not be empty")
        unknown = [name for name in partition_by if name not in schema.names]
        if unknown:
            raise SinkSchemaError(f"partition columns not in the schema: {unknown}")
        self._path = str(path)
        self._app_id = app_id
        self._schema = schema
        self._partition_by = list(partition_by)

    @property
    def path(self) -> str:
        return self._path

    @property
    def app_id(self) -> str:
        return self._app_id

    def _already_committed(self, delta: DeltaTable, batch_id: int) -> bool:
        """Whether ``batch_id`` of this app is in the table already (a replay: skip it)."""
        done = delta.transaction_version(self._app_id)
        if done is not None and done >= batch_id:
            logger.info(
                "%s: batch %d of %s already committed (app version %d), skipping replay",
                self._path,
                batch_id,
                self._app_id,
                done,
            )
            return True
        return False

    def last_batch_id(self) -> int | None:
        """The highest batch id committed under ``app_id``, or None (no table, or no commit)."""
        if not _is_table(self._path):
            return None
        try:
            version: int | None = DeltaTable(self._path).transaction_version(self._app_id)
        except (DeltaError, OSError) as exc:
            raise DeltaSinkError(f"{self._path}: cannot read the transaction log") from exc
        return version

    def write(self, batch_id: int, table: pa.Table) -> bool:
        """Append ``table`` as batch ``batch_id``; False when there was nothing to write.

        Nothing is written when the batch is empty or was already committed (a replay).
        Raises :class:`SinkSchemaError` when ``table`` does not fit the schema.
        """
        if batch_id < 0:
            raise ValueError(f"batch_id must be >= 0, got {batch_id}")
        data = conform(table, self._schema)
        if data.num_rows == 0:
            logger.debug(
                "%s: batch %d of %s is empty, nothing to commit", self._path, batch_id, self._app_id
            )
            return False
        try:
            delta = self._open_or_create()
            if self._already_committed(delta, batch_id):
                return False
            write_deltalake(
                delta,
                data,
                mode="append",
                commit_properties=CommitProperties(
                    app_transactions=[Transaction(self._app_id, batch_id)]
                ),
            )
        except (DeltaError, OSError) as exc:
            raise DeltaSinkError(
                f"{self._path}: writing batch {batch_id} of {self._app_id} failed"
            ) from exc
        logger.info(
            "%s: batch %d of %s committed, %d rows",
            self._path,
            batch_id,
            self._app_id,
            data.num_rows,
        )
        return True

    def _open_or_create(self) -> DeltaTable:
        if _is_table(self._path):
            return DeltaTable(self._path)
        Path(self._path).mkdir(parents=True, exist_ok=True)
        # mode="ignore": another writer creating the same table first is not an error.
        created: DeltaTable = DeltaTable.create(
            self._path,
            self._schema,
            mode="ignore",
            partition_by=self._partition_by or None,
        )
        logger.info("%s: created Delta table partitioned by %s", self._path, self._partition_by)
        return created


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
    path: Path | str,
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
    if not _is_table(target):
        raise DeltaSinkError(f"{target}: not a Delta table")
    try:
        delta = DeltaTable(target)
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


def _is_table(path: str) -> bool:
    try:
        found: bool = DeltaTable.is_deltatable(path)
    except OSError as exc:  # e.g. a plain file where the table directory should be
        raise DeltaSinkError(f"{path}: cannot be a Delta table: {exc}") from exc
    return found


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'
