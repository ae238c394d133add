"""Small ``usage`` and ``quota_events`` tables for the readers' tests (``edgebus usage``, the
REST API's ``/usage`` and ``/quota``), written with delta-rs as the pipeline's writers would.

Around 2024-03-10: tenant ``acme`` with counters the day before, that day and its quota states
across three days; tenant ``other`` with one of each.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pyarrow as pa
from lake_fixture import DeltaBatchWriter

from schemas.usage import (
    QUOTA_EVENTS_PARTITION_BY,
    QUOTA_EVENTS_SCHEMA,
    USAGE_PARTITION_BY,
    USAGE_SCHEMA,
)
from streaming.quota import QuotaEvent

UTC = dt.UTC
NOW = dt.datetime(2024, 3, 10, 12, 0, tzinfo=UTC)
MINUTE = dt.timedelta(minutes=1)


def window(tenant: str, metric: str, start: str, value: int, day_value: int) -> dict[str, Any]:
    begin = dt.datetime.fromisoformat(start).replace(tzinfo=UTC)
    kind = "gauge" if metric == "sessions" else "counter"
    return {
        "tenant": tenant,
        "metric": metric,
        "kind": kind,
        "window_start": begin,
        "window_end": begin + MINUTE,
        "value": value,
        "day_value": day_value,
        "nodes": [{"node": "edge-a", "value": value, "reported_at": begin + MINUTE}],
        "date": begin.date(),
    }


USAGE = [
    # acme, the day before: must not count for 2024-03-10
    window("acme", "messages_in", "2024-03-09T23:59", 999, 999),
    # acme, 2024-03-10: counters are running sums, the gauge a running maximum
    window("acme", "messages_in", "2024-03-10T00:00", 100, 100),
    window("acme", "messages_in", "2024-03-10T11:58", 40, 140),
    window("acme", "messages_in", "2024-03-10T11:59", 60, 200),
    window("acme", "bytes_in", "2024-03-10T11:58", 9000, 9000),
    window("acme", "sessions", "2024-03-10T11:57", 3, 3),
    window("acme", "sessions", "2024-03-10T11:58", 5, 5),
    window("acme", "sessions", "2024-03-10T11:59", 2, 5),
    window("other", "messages_in", "2024-03-10T11:00", 7, 7),
]


def decided(
    tenant: str, metric: str, when: str, state: str, limit: int | None, value: int, batch: int
) -> QuotaEvent:
    at = dt.datetime.fromisoformat(when).replace(tzinfo=UTC)
    return QuotaEvent(tenant, metric, limit, value, state, at, batch)


QUOTA = [
    decided("acme", "messages_per_day", "2024-03-09T20:00", "warn", 1000, 850, 1),
    decided("acme", "bytes_per_day", "2024-03-09T21:00", "blocked", 5000, 5100, 2),
    decided("acme", "messages_per_day", "2024-03-09T23:00", "blocked", 1000, 1000, 3),
    decided("acme", "messages_per_day", "2024-03-10T00:01", "ok", 1000, 0, 4),
    decided("acme", "messages_per_day", "2024-03-10T11:59", "warn", 250, 200, 7),
    decided("acme", "bytes_per_day", "2024-03-10T08:00", "cleared", None, 3000, 5),
    decided("other", "messages_per_day", "2024-03-10T11:01", "blocked", 5, 7, 6),
    # acme, the day after 2024-03-10: not its state at the end of that day
    decided("acme", "messages_per_day", "2024-03-11T00:01", "ok", 250, 0, 8),
]


def write_lake(root: Path, *, usage: bool = True, quota: bool = True) -> Path:
    if usage:
        writer = DeltaBatchWriter(root / "usage", "edgebus.usage", USAGE_SCHEMA, USAGE_PARTITION_BY)
        # Two commits, so partitions hold more than one file.
        writer.write(0, pa.Table.from_pylist(USAGE[::2], schema=USAGE_SCHEMA))
        writer.write(1, pa.Table.from_pylist(USAGE[1::2], schema=USAGE_SCHEMA))
    if quota:
        events = DeltaBatchWriter(
            root / "quota_events", "edgebus.quota", QUOTA_EVENTS_SCHEMA, QUOTA_EVENTS_PARTITION_BY
        )
        # In batch order: the writer skips a batch id at or below the last one (a replay).
        for event in sorted(QUOTA, key=lambda e: e.batch_id):
            rows = [event.row()]
            events.write(event.batch_id, pa.Table.from_pylist(rows, schema=QUOTA_EVENTS_SCHEMA))
    return root
