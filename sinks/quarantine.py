"""The quarantine writer: journal records that broke a data contract, kept raw with the reason.

The rules themselves live in ``schemas.contracts`` and with the payload parsers in
``streaming``; this module only shapes the rows and appends them, exactly once per micro-batch
like every table (app id ``edgebus.quarantine``).
"""

from __future__ import annotations

from typing import TypeAlias

import pyarrow as pa
import pyarrow.compute as pc

from schemas.tables import NO_TENANT, QUARANTINE_PARTITION_BY, QUARANTINE_SCHEMA, utc_date
from sinks.delta import DeltaTableWriter
from sinks.storage import LakePath

TABLE = "quarantine"
APP_ID = "edgebus.quarantine"

Strings: TypeAlias = pa.Array | pa.ChunkedArray | str


def quarantine_writer(path: LakePath | str) -> DeltaTableWriter:
    return DeltaTableWriter(path, APP_ID, QUARANTINE_SCHEMA, QUARANTINE_PARTITION_BY)


def quarantine_rows(records: pa.Table, table: Strings, rule: Strings, reason: Strings) -> pa.Table:
    """``records`` (journal rows) as ``quarantine`` rows; ``table``, ``rule`` and ``reason``
    are one value for all or one per record."""
    n = records.num_rows
    added = {
        "date": utc_date(records.column("ts")),
        "tenant": pc.if_else(
            pc.equal(records.column("tenant"), ""), pa.scalar(NO_TENANT), records.column("tenant")
        ),
        "table": _column(table, n),
        "rule": _column(rule, n),
        "reason": _column(reason, n),
    }
    columns = [
        added[name] if name in added else records.column(name) for name in QUARANTINE_SCHEMA.names
    ]
    return pa.Table.from_arrays(columns, schema=QUARANTINE_SCHEMA)


def _column(values: Strings, n: int) -> pa.Array | pa.ChunkedArray:
    if isinstance(values, str):
        return pa.array([values] * n, pa.string())
    return values
