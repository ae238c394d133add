"""The history step: every publish on a tenant's own topics, into the Delta ``messages`` table.

Theory of operation: the pipeline's route (``streaming.route``, run on the executors) hands
this step the records meant for it: the tenants' own traffic (topics starting with ``$`` are
log, counter and control traffic and go to their own tables). :func:`split` applies the message
contract (``schemas.contracts.MESSAGE_RULES``) and derives ``date`` and ``size``; the columns the
JVM derives as it writes (``payload_text``: ``schemas.tables.MESSAGES_DERIVED``, added by
``streaming.route.share``) are not made here, in Python, on the hot path. The pipeline
appends the rows through a :class:`~sinks.delta.DeltaTableWriter`, which commits the batch id
as a Delta app transaction in the same commit as the rows: a batch replayed after a crash is
recognised and skipped. Records that break the contract go to ``quarantine``.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from schemas.contracts import MESSAGE_RULES, first_broken, rows_where
from schemas.tables import (
    MESSAGES_PARTITION_BY,
    MESSAGES_ROUTED_SCHEMA,
    MESSAGES_SCHEMA,
    utc_date,
)
from sinks.delta import DeltaTableWriter
from sinks.quarantine import quarantine_rows
from streaming.settings import PipelineSettings

TABLE = "messages"
# The Delta app id of this step's commits. Stable across restarts from the same checkpoint.
APP_ID = "edgebus.history"
# The columns whose file statistics readers prune on: time ranges and (node, seq) identities.
STATS_COLUMNS = ("node", "seq", "ts")


def accepts(topics: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """True for the records this step takes: every topic not starting with ``$``."""
    return pc.invert(pc.starts_with(topics, "$"))


def transform(records: pa.Table) -> pa.Table:
    """Journal rows (``JOURNAL_SCHEMA``) to ``messages`` rows, in table order and types, less
    the columns the JVM derives (``MESSAGES_ROUTED_SCHEMA``)."""
    derived = {
        "date": utc_date(records.column("ts")),
        "size": pc.cast(pc.binary_length(records.column("payload")), pa.int32()),
    }
    columns = [
        derived[name] if name in derived else records.column(name)
        for name in MESSAGES_ROUTED_SCHEMA.names
    ]
    return pa.Table.from_arrays(columns, schema=MESSAGES_ROUTED_SCHEMA)


def split(records: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Accepted journal rows to ``messages`` rows, and the ones that broke the message
    contract as ``quarantine`` rows."""
    rules, reasons = first_broken(records, MESSAGE_RULES)
    kept = pc.is_null(rules)
    broken = pc.invert(kept)
    quarantined = quarantine_rows(
        rows_where(records, broken), TABLE, rules.filter(broken), reasons.filter(broken)
    )
    return transform(rows_where(records, kept)), quarantined


def messages_writer(settings: PipelineSettings) -> DeltaTableWriter:
    return DeltaTableWriter(
        settings.table_path(TABLE),
        APP_ID,
        MESSAGES_SCHEMA,
        MESSAGES_PARTITION_BY,
        stats_columns=STATS_COLUMNS,
    )
