"""The logs step: every log event publish (``$log/{origin}/{event}``), into the ``logs`` table.

Theory of operation: the pipeline's route (``streaming.route``, on the executors) hands this
step the records on log topics of each micro-batch. ``transform`` parses each payload against
``LOG_EVENT_SCHEMA`` (orjson; log events are a small share of the traffic). The row's identity,
time, date and tenant come from the journal record, never from the payload: a payload cannot
move a row to another tenant's or day's partition. A payload that breaks the contract is kept
with ``payload_valid = false``, the first rule it failed and its raw bytes (ARCHITECTURE rule
5), and is also returned for ``quarantine``; whatever did parse is filled in, and
``origin``/``event_type`` fall back to the topic's levels. The typed columns (``reason``,
``reason_code``, ``topic``, ``qos``, ``metric``, ``limit``, ``value``) are read out of the
details by :func:`typed_details`, valid payload or not. Rows go to an idempotent
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

# The typed columns read out of the details (typed_details), in the table's order.
TYPED = ("reason", "reason_code", "topic", "qos", "metric", "limit", "value")

# The columns transform parses out of the payload, in the table's order.
_PARSED = ("origin", "event_type", "client_id", "details", *TYPED, "time")

# Where each typed column comes from: the first of these details keys whose value has the
# column's type (a string, or an integer in the column's range; never a boolean) ...
_KEYS: dict[str, tuple[str, ...]] = {
    "reason": ("reason", "error"),  # tls_handshake_failed, link_refused, journal_full; errors
    "reason_code": ("reason_code",),  # disconnect, malformed_packet
    "topic": ("topic", "topic_filter"),  # acl_denied, limit_exceeded (a publish); subscribe
    "qos": ("qos",),  # acl_denied, limit_exceeded (a publish)
    "metric": ("metric",),  # quota_warn, quota_blocked, quota_cleared, quota_reached
    "limit": ("limit",),
    "value": ("value",),
}
# ... unless the event names them otherwise: ``limit_exceeded`` calls the limit's name
# ``limit``, its value ``value`` and a refused publish's payload size ``size``.
_EVENT_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "limit_exceeded": {"metric": ("limit",), "limit": ("value",), "value": ("size",)},
}
# A SUBSCRIBE or UNSUBSCRIBE that named one filter (nearly all do): that filter is the topic,
# and a SUBACK's one reason code the reason code (the granted QoS, when below 0x80). With
# several filters these stay null; ``details`` has the lists.
_ONE_FILTER_EVENTS = frozenset({"subscribe", "unsubscribe"})
_GRANTED_QOS_BELOW = 0x80
# The range of each integer column.
_INT64 = (-(2**63), 2**63 - 1)
_RANGES: dict[str, tuple[int, int]] = {
    "reason_code": (-(2**31), 2**31 - 1),
    "qos": (0, 2),
    "limit": _INT64,
    "value": _INT64,
}


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
    event_type = event["event"] if event["event"] is not None else _level(levels, 2)
    return {
        "origin": event["origin"] if event["origin"] is not None else _level(levels, 1),
        "event_type": event_type,
        "client_id": event["client_id"],
        "details": _compact(details) if isinstance(details, dict) else None,
        **typed_details(event_type, details if isinstance(details, dict) else None),
        "time": event["time"],
        "invalid_reason": _invalid_reason(doc, event, details, topic, tenant),
    }


def typed_details(event_type: str | None, details: dict[str, Any] | None) -> dict[str, Any]:
    """The typed columns of a ``logs`` row (:data:`TYPED`) out of its event's ``details``:
    each from the first details key :data:`_KEYS` (or, for some events, :data:`_EVENT_KEYS`)
    names whose value has the column's type; None where there is none."""
    typed: dict[str, Any] = dict.fromkeys(TYPED)
    if details is None:
        return typed
    keys = _KEYS | _EVENT_KEYS.get(event_type or "", {})
    for name in TYPED:
        bounds = _RANGES.get(name)
        for key in keys[name]:
            value = _typed(details.get(key), bounds)
            if value is not None:
                typed[name] = value
                break
    if event_type in _ONE_FILTER_EVENTS:
        filters = details.get("topic_filters")
        if isinstance(filters, list) and len(filters) == 1 and isinstance(filters[0], str):
            typed["topic"] = filters[0]
        codes = details.get("reason_codes")
        if isinstance(codes, list) and len(codes) == 1:
            code = _typed(codes[0], _RANGES["reason_code"])
            typed["reason_code"] = code
            if isinstance(code, int) and code < _GRANTED_QOS_BELOW:
                typed["qos"] = _typed(code, _RANGES["qos"])
    return typed


def _typed(value: object, bounds: tuple[int, int] | None) -> str | int | None:
    """``value`` if it has the column's type: a string (``bounds`` None), or an integer within
    ``bounds`` (a float with an integer value too: JSON does not tell 3 from 3.0)."""
    if bounds is None:
        return value if isinstance(value, str) else None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and bounds[0] <= value <= bounds[1]:
        return value
    return None


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
