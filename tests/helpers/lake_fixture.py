"""Delta tables for the light readers' unit tests, written without a JVM.

The pipeline writes every table with Spark's Delta (``sinks.delta.DeltaTableWriter``); the
readers under test here (``edgebus logs``, ``usage``, ``quality``, maintenance scheduling) read
any Delta table, so their tests build small ones with delta-rs in milliseconds instead of
starting Spark. The writer keeps the pipeline's contract: the declared schema (plain types,
never view types), the partitioning, and the batch id as the app transaction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from sinks.delta import conform


class DeltaBatchWriter:
    """Appends Arrow batches to one Delta table, once per ``(app_id, batch_id)``."""

    def __init__(
        self, path: Path | str, app_id: str, schema: pa.Schema, partition_by: Sequence[str] = ()
    ) -> None:
        self.path = str(path)
        self.app_id = app_id
        self.schema = schema
        self.partition_by = list(partition_by)

    def write(self, batch_id: int, table: pa.Table) -> bool:
        """Append ``table`` as batch ``batch_id``; False when it is empty or already there."""
        data = conform(table, self.schema)
        if data.num_rows == 0:
            return False
        if not DeltaTable.is_deltatable(self.path):
            Path(self.path).mkdir(parents=True, exist_ok=True)
            DeltaTable.create(
                self.path, self.schema, mode="ignore", partition_by=self.partition_by or None
            )
        delta = DeltaTable(self.path)
        done = delta.transaction_version(self.app_id)
        if done is not None and done >= batch_id:
            return False
        write_deltalake(
            delta,
            data,
            mode="append",
            commit_properties=CommitProperties(
                app_transactions=[Transaction(self.app_id, batch_id)]
            ),
        )
        return True


def log_row(
    tenant: str,
    ts: datetime,
    node: str,
    seq: int,
    event_type: str = "connect",
    client_id: str = "truck-1",
) -> dict[str, Any]:
    """One valid ``logs`` row (details ``{"clean": seq is even}``), as the logs step writes it."""
    return {
        "node": node,
        "seq": seq,
        "ts": ts,
        "date": ts.date(),
        "tenant": tenant,
        "origin": "quota" if event_type.startswith("quota") else "mqtt",
        "event_type": event_type,
        "client_id": client_id,
        "details": json.dumps({"clean": seq % 2 == 0}),
        "time": ts.isoformat(),
        "payload_valid": True,
        "invalid_reason": None,
        "raw": None,
    }
