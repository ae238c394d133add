"""Exactly-once upserts into a Delta table, and SQL reads over one table (delta-rs).

Theory of operation: :class:`DeltaUpsertWriter` merges a micro-batch into its table by a key
(``MERGE ... WHEN MATCHED UPDATE ALL WHEN NOT MATCHED INSERT ALL``) with the Delta app
transaction ``(app_id, batch_id)`` in the same atomic commit, exactly like
:class:`~sinks.delta.DeltaBatchWriter` does for appends: a replayed batch finds
``transaction_version(app_id) >= batch_id`` and is skipped. Rows of a batch replace whole rows
of the table; what they should contain is the caller's business.

:func:`query_table` runs one SQL query over one table through ``deltalake.QueryBuilder``
(DataFusion), never ``DeltaTable.to_pyarrow_*`` (see :mod:`sinks.delta`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, DeltaError

from sinks.delta import DeltaBatchWriter, conform, run_sql
from sinks.errors import DeltaSinkError, SinkSchemaError

logger = logging.getLogger(__name__)

# How often a merge is tried when another commit (a compaction) wins the race to the log.
# This query is the only writer of its rows, so a lost race never means changed data.
MERGE_ATTEMPTS = 5

TABLE_NAME = "t"
"""The name the table has in :func:`query_table`'s SQL: ``SELECT ... FROM t``."""


class DeltaUpsertWriter(DeltaBatchWriter):
    """Appends (``write``) or upserts (``upsert``) micro-batches, exactly once per batch id."""

    def upsert(self, batch_id: int, table: pa.Table, key: Sequence[str]) -> bool:
        """Merge ``table`` by ``key`` as batch ``batch_id``; False when nothing was written.

        Rows whose key is in the table replace the stored row, others are inserted. ``table``
        must not hold a key twice. Partition columns belong in ``key`` (the merge then only
        reads the partitions the batch touches). Nothing is written for an empty batch or a
        batch already committed (a replay).
        """
        if batch_id < 0:
            raise ValueError(f"batch_id must be >= 0, got {batch_id}")
        if not key:
            raise ValueError("key must name at least one column")
        data = conform(table, self._schema)
        unknown = [name for name in key if name not in self._schema.names]
        if unknown:
            raise SinkSchemaError(f"key columns not in the schema: {unknown}")
        if data.num_rows == 0:
            return False
        predicate = " AND ".join(f"t.{_quote(name)} = s.{_quote(name)}" for name in key)
        for attempt in range(1, MERGE_ATTEMPTS + 1):
            try:
                delta = self._open_or_create()
                if self._already_committed(delta, batch_id):
                    return False
                metrics = (
                    delta.merge(
                        data,
                        predicate,
                        source_alias="s",
                        target_alias="t",
                        commit_properties=CommitProperties(
                            app_transactions=[Transaction(self._app_id, batch_id)]
                        ),
                    )
                    .when_matched_update_all()
                    .when_not_matched_insert_all()
                    .execute()
                )
                break
            except CommitFailedError as exc:
                # A compaction (sinks.maintenance) committed first; it rewrote files without
                # changing a row, so the same merge on the new snapshot is still right.
                if attempt == MERGE_ATTEMPTS:
                    raise DeltaSinkError(
                        f"{self._path}: merging batch {batch_id} of {self._app_id} lost "
                        f"{attempt} commit races: {exc}"
                    ) from exc
                logger.info("%s: merge lost a commit race (%s), retrying", self._path, exc)
            except (DeltaError, OSError) as exc:
                raise DeltaSinkError(
                    f"{self._path}: merging batch {batch_id} of {self._app_id} failed: {exc}"
                ) from exc
        logger.info(
            "%s: batch %d of %s merged: %s inserted, %s updated",
            self._path,
            batch_id,
            self._app_id,
            metrics.get("num_target_rows_inserted"),
            metrics.get("num_target_rows_updated"),
        )
        return True


def query_table(path: Path | str, sql: str) -> pa.Table:
    """The result of ``sql`` over the Delta table at ``path``, which it names ``t``.

    The caller builds ``sql``; quote literals with :func:`sql_string`. A missing table is an
    error: callers that may run first check :func:`table_exists`.
    """
    target = str(path)
    if not table_exists(target):
        raise DeltaSinkError(f"{target}: not a Delta table")
    try:
        table = run_sql(DeltaTable(target), TABLE_NAME, sql)
    except (DeltaError, OSError) as exc:
        raise DeltaSinkError(f"{target}: query failed: {exc}") from exc
    # DataFusion answers with view types (string_view, binary_view); plain types are simpler.
    fields = [pa.field(f.name, _plain(f.type), f.nullable) for f in table.schema]
    return table.cast(pa.schema(fields))


def table_exists(path: Path | str) -> bool:
    try:
        found: bool = DeltaTable.is_deltatable(str(path))
    except OSError as exc:
        raise DeltaSinkError(f"{path}: cannot be a Delta table: {exc}") from exc
    return found


def sql_string(value: str) -> str:
    """``value`` as a SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _plain(type_: pa.DataType) -> pa.DataType:
    if type_ == pa.string_view():
        return pa.string()
    if type_ == pa.binary_view():
        return pa.binary()
    return type_
