"""The logs step: every log event publish (``$log/{origin}/{event}``), into the ``logs`` table.

Theory of operation: the pipeline's route (``streaming.route``, on the executors) hands this
step the records on log topics of each micro-batch. ``transform`` parses each payload against
``LOG_EVENT_SCHEMA`` (orjson; log events are a small share of the traffic). The row's identity,
time, date and tenant come from the journal record, never from the payload: a payload cannot
move a row to another tenant's or day's partition. A payload that breaks the contract is kept
with ``payload_valid = false``, the first rule it failed and its raw bytes (ARCHITECTURE rule
5), and is also returned for ``quarantine``; whatever did parse is filled in, and
``origin``/``event_type`` fall back to the topic's levels. Rows go to an idempotent
:class:`~sinks.delta.DeltaTableWriter` as in :mod:`streaming.history`, so a replayed batch is
skipped.
"""

from __future__ import annotations

from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from schemas.payloads import LOG_EVENT_SCHEMA, LOG_TOPIC_PREFIX
from schemas.tables import LOGS_PARTITION_BY, LOGS_SCHEMA, utc_date
from sinks.delta import DeltaTableWriter
from sinks.quarantine import quarantine_rows
from streaming.settings import PipelineSettings

TABLE = "logs"
# The Delta app id of this step's commits. Stable across restarts from the same checkpoint.
APP_ID = "edgebus.logs"
# The columns whose file statistics readers prune on (``edgebus logs``: time, its cursor, the
# event type and client filters).
STATS_COLUMNS = ("node", "seq", "ts", "event_type", "client_id")
# The rule name quarantined log events carry; the reason says which part of it broke.
RULE = "log_event"

# Fields whose absence makes a payload invalid, in the order the first missing one is reported.
# ``details`` is checked separately: it must be an object, not any JSON value.
REQUIRED_FIELDS = ("time", "ts_us", "node", "tenant", "client_id", "origin", "event")

# The Python type each payload field must have (bool is an int to Python, not to JSON).
_TYPES: dict[str, type] = {
    field.name: int if pa.types.is_integer(field.type) else str
    for field in LOG_EVENT_SCHEMA
    if field.name != "details"
}

# The columns transform parses out of the payload, in the table's order.
_PARSED = ("origin", "event_type", "client_id", "details", "time")


def accepts(topics: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """True for the records this step takes: topics under ``$log/``."""
    return pc.starts_with(topics, LOG_TOPIC_PREFIX)


def parse(topic: str, tenant: str, payload: bytes) -> dict[str, Any]:
    """One log event payload to the parsed columns of its ``logs`` row, ``invalid_reason``
    included (None when the payload keeps every rule)."""
    doc = _object(payload)
    event: dict[str, Any] = {}
    for name, kind in _TYPES.items():
        value = doc.get(name) if doc is not None else None
        valid = isinstance(value, kind) and not isinstance(value, bool)
        event[name] = value if valid else None
    details = doc.get("details") if doc is not None else None
    levels = topic.split("/")
    return {
        "origin": event["origin"] if event["origin"] is not None else _level(levels, 1),
        "event_type": event["event"] if event["event"] is not None else _level(levels, 2),
        "client_id": event["client_id"],
        "details": _compact(details) if isinstance(details, dict) else None,
        "time": event["time"],
        "invalid_reason": _invalid_reason(doc, event, details, topic, tenant),
    }


def _invalid_reason(
    doc: dict[str, Any] | None, event: dict[str, Any], details: object, topic: str, tenant: str
) -> str | None:
    """The first contract rule the payload breaks, or None when it keeps them all."""
    if doc is None:
        return "payload is not a JSON object"
    for name in REQUIRED_FIELDS:
        if event[name] is None:
            return f"field {name!r} is missing, null or of the wrong type"
    if not isinstance(details, dict):
        return "field 'details' is not a JSON object"
    # Tenants are isolated by construction: the namespace decides, a payload cannot.
    if event["tenant"] != tenant:
        claimed = event["tenant"]
        return f"field 'tenant' is '{claimed}' but the event was published in tenant '{tenant}'"
    if topic != f"{LOG_TOPIC_PREFIX}{event['origin']}/{event['event']}":
        return f"topic {topic} does not match origin {event['origin']} and event {event['event']}"
    return None


def transform(records: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Journal rows on log topics to ``logs`` rows (table order and types), and the records
    whose payload broke the contract as ``quarantine`` rows."""
    parsed = [
        parse(topic, tenant, payload)
        for topic, tenant, payload in zip(
            records.column("topic").to_pylist(),
            records.column("tenant").to_pylist(),
            records.column("payload").to_pylist(),
            strict=True,
        )
    ]
    reasons = pa.array([row["invalid_reason"] for row in parsed], pa.string())
    valid = pc.is_null(reasons)
    derived: dict[str, pa.Array | pa.ChunkedArray] = {
        "date": utc_date(records.column("ts")),
        "payload_valid": valid,
        "invalid_reason": reasons,
        "raw": pc.if_else(valid, pa.scalar(None, pa.binary()), records.column("payload")),
    }
    for name in _PARSED:
        derived[name] = pa.array([row[name] for row in parsed], LOGS_SCHEMA.field(name).type)
    columns = [
        derived[name] if name in derived else records.column(name) for name in LOGS_SCHEMA.names
    ]
    rows = pa.Table.from_arrays(columns, schema=LOGS_SCHEMA)
    broken = pc.invert(valid)
    return rows, quarantine_rows(records.filter(broken), TABLE, RULE, reasons.filter(broken))


def logs_writer(settings: PipelineSettings) -> DeltaTableWriter:
    return DeltaTableWriter(
        settings.table_path(TABLE),
        APP_ID,
        LOGS_SCHEMA,
        LOGS_PARTITION_BY,
        stats_columns=STATS_COLUMNS,
    )


def _object(payload: bytes) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def _level(levels: list[str], index: int) -> str | None:
    return levels[index] if index < len(levels) else None


def _compact(value: dict[str, Any]) -> str:
    return orjson.dumps(value).decode()
