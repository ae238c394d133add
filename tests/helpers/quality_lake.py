"""Small real lakes for the quality tests: rows written with the pipeline's own writer and the
table schemas of ``schemas.tables``, good ones and ones that break the suites."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from lake_fixture import DeltaBatchWriter

from schemas.tables import TABLES

UTC = dt.UTC
NOW = dt.datetime(2024, 3, 10, 12, 0, tzinfo=UTC)
TODAY = NOW.date()
YESTERDAY = TODAY - dt.timedelta(days=1)
LONG_AGO = TODAY - dt.timedelta(days=5)
MINUTE = dt.timedelta(minutes=1)


def write(lake: Path, table: str, rows: Sequence[dict[str, Any]], batch_id: int = 0) -> None:
    spec = TABLES[table]
    writer = DeltaBatchWriter(lake / table, f"test.{table}", spec.schema, spec.partition_by)
    writer.write(batch_id, pa.Table.from_pylist(list(rows), schema=spec.schema))


def message(
    seq: int, *, node: str = "edge-a", day: dt.date = TODAY, **fields: Any
) -> dict[str, Any]:
    ts = dt.datetime.combine(day, dt.time(8, 0), UTC) + dt.timedelta(seconds=seq)
    row = {
        "node": node,
        "seq": seq,
        "ts": ts,
        "date": day,
        "tenant": "acme",
        "client_id": "truck-1",
        "topic": "fleet/truck-1/telemetry",
        "qos": 1,
        "retain": False,
        "payload": b'{"speed": 50}',
        "content_type": "application/json",
        "user_properties": None,
        "size": 13,
    }
    return {**row, **fields}


def log(
    seq: int, event_type: str = "connect", *, valid: bool = True, **fields: Any
) -> dict[str, Any]:
    ts = dt.datetime.combine(TODAY, dt.time(9, 0), UTC) + dt.timedelta(seconds=seq)
    row = {
        "node": "edge-a",
        "seq": seq,
        "ts": ts,
        "date": TODAY,
        "tenant": "acme",
        "origin": "mqtt",
        "event_type": event_type,
        "client_id": "truck-1",
        "details": "{}",
        "time": ts.isoformat(),
        "payload_valid": valid,
        "invalid_reason": None if valid else "not_json",
        "raw": None if valid else b"{oops",
    }
    return {**row, **fields}


def usage(minute: int, value: int, day_value: int, metric: str = "messages_in") -> dict[str, Any]:
    start = dt.datetime.combine(TODAY, dt.time(10, 0), UTC) + minute * MINUTE
    return {
        "tenant": "acme",
        "metric": metric,
        "kind": "counter",
        "window_start": start,
        "window_end": start + MINUTE,
        "value": value,
        "day_value": day_value,
        "nodes": [{"node": "edge-a", "value": value, "reported_at": start + MINUTE}],
        "date": TODAY,
    }


def quota_event(batch_id: int, state: str, value: int = 850) -> dict[str, Any]:
    return {
        "tenant": "acme",
        "metric": "messages_per_day",
        "limit": 1000,
        "value": value,
        "state": state,
        "decided_at": NOW - dt.timedelta(hours=1) + batch_id * MINUTE,
        "batch_id": batch_id,
        "date": TODAY,
    }


def good_lake(lake: Path) -> None:
    """Every table with rows that keep every expectation."""
    write(lake, "messages", [message(seq) for seq in range(1, 6)])
    write(lake, "logs", [log(1), log(2, "disconnect"), log(3, "bogus", valid=False)])
    write(lake, "usage", [usage(0, 10, 10), usage(1, 5, 15), usage(2, 0, 15)])
    write(lake, "quota_events", [quota_event(1, "warn"), quota_event(2, "blocked", 1000)])


def bad_lake(lake: Path) -> None:
    """Rows that break the suites in known ways, and a bad row outside the run's window."""
    write(
        lake,
        "messages",
        [
            message(1),
            message(2),
            message(2, topic="fleet/again"),  # (edge-a, 2) twice
            message(3, qos=3),
            message(4, qos=3),
            message(5, topic="$log/mqtt/connect"),  # log traffic in messages
            message(1, node="edge-b", day=YESTERDAY),  # yesterday is in the window: fine
            message(9, qos=7, day=LONG_AGO),  # outside the window: never read
        ],
    )
    write(lake, "logs", [log(1), log(2, "teleport"), log(3, "bogus", valid=False)])
    write(lake, "usage", [usage(0, 10, 10), usage(1, 5, 4)])  # day_value below value
    write(lake, "quota_events", [quota_event(1, "warn"), quota_event(2, "melting")])
