"""Schemas of the JSON payloads the edges publish on reserved topics, defined once.

The pipeline parses each payload against its schema here (Spark ``from_json`` over the schema
converted from Arrow), so a field's name and type are decided in exactly one place, next to
the table schemas the parsed rows land in.
"""

from __future__ import annotations

import pyarrow as pa

# Topics of log events: ``$log/{origin}/{event}`` in the tenant's namespace.
LOG_TOPIC_PREFIX = "$log/"

# Every event an edge logs (``broker_edge.plim.log_event`` refuses others): the ``event`` field
# of a log payload and the ``event_type`` column of valid ``logs`` rows.
LOG_EVENTS = frozenset(
    {
        "connect",
        "disconnect",
        "subscribe",
        "unsubscribe",
        "auth_failed",
        "acl_denied",
        "malformed_packet",
        "session_taken_over",
        "queue_overflow",
        "limit_exceeded",
        "quota_warn",
        "quota_blocked",
        "quota_cleared",
        "journal_full",
        "journal_error",
        "journal_resumed",
    }
)

# One log event on ``$log/{origin}/{event}`` (see ``broker_edge.plim.log_event``). Every field
# is required; ``client_id`` is "" for events about the tenant rather than a client (quota).
# ``details`` is a JSON object whose keys depend on the event: it is kept as its JSON text.
LOG_EVENT_SCHEMA = pa.schema(
    [
        pa.field("time", pa.string()),  # ISO 8601, UTC, as the edge wrote it
        pa.field("ts_us", pa.int64()),  # the same instant, microseconds since the epoch
        pa.field("node", pa.string()),
        pa.field("tenant", pa.string()),
        pa.field("client_id", pa.string()),
        pa.field("origin", pa.string()),  # mqtt, quota, ...
        pa.field("event", pa.string()),
        pa.field("details", pa.string()),
    ]
)
