"""The history step: every publish on a tenant's own topics, into the Delta ``messages`` table.

Theory of operation: the pipeline's one journal query (``streaming.pipeline``) collects each
micro-batch as Arrow once and hands every step the records meant for it. This step keeps the
tenants' own traffic (topics starting with ``$`` are log, counter and control traffic and go to
their own tables), applies the message contract (``schemas.contracts.MESSAGE_RULES``), derives
``date`` and ``size`` and appends the rows through a :class:`DeltaBatchWriter`, which commits
the batch id as a Delta app transaction in the same commit as the rows: a batch replayed after
a crash is recognised and skipped. Records that break the contract are returned for
``quarantine``.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from schemas.contracts import MESSAGE_RULES, first_broken, rows_where
from schemas.tables import MESSAGES_PARTITION_BY, MESSAGES_SCHEMA, utc_date
from sinks.delta import DeltaBatchWriter
from sinks.quarantine import quarantine_rows
from streaming.settings import PipelineSettings

TABLE = "messages"
# The Delta app id of this step's commits. Stable across restarts from the same checkpoint.
APP_ID = "edgebus.history"


def accepts(topics: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """True for the records this step takes: every topic not starting with ``$``."""
    return pc.invert(pc.starts_with(topics, "$"))


def transform(records: pa.Table) -> pa.Table:
    """Journal rows (``JOURNAL_SCHEMA``) to ``messages`` rows, in table order and types."""
    derived = {
        "date": utc_date(records.column("ts")),
        "size": pc.cast(pc.binary_length(records.column("payload")), pa.int32()),
    }
    columns = [
        derived[name] if name in derived else records.column(name) for name in MESSAGES_SCHEMA.names
    ]
    return pa.Table.from_arrays(columns, schema=MESSAGES_SCHEMA)


def messages_writer(settings: PipelineSettings) -> DeltaBatchWriter:
    return DeltaBatchWriter(
        settings.table_path(TABLE), APP_ID, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY
    )


class HistoryStep:
    """Appends a micro-batch's device publishes to ``messages``, exactly once per batch id."""

    table = TABLE

    def __init__(self, settings: PipelineSettings) -> None:
        self.writer = messages_writer(settings)
        self.writers: tuple[DeltaBatchWriter, ...] = (self.writer,)

    accepts = staticmethod(accepts)

    def __call__(self, batch_id: int, records: pa.Table) -> pa.Table:
        """Write ``records`` (all accepted); the ones that broke the contract, as quarantine."""
        rules, reasons = first_broken(records, MESSAGE_RULES)
        kept = pc.is_null(rules)
        self.writer.write(batch_id, transform(rows_where(records, kept)))
        broken = pc.invert(kept)
        return quarantine_rows(
            rows_where(records, broken), TABLE, rules.filter(broken), reasons.filter(broken)
        )
