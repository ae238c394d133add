"""Schemas of the JSON payloads the edges publish on reserved topics, defined once.

The pipeline parses each payload against its schema here (Spark ``from_json`` over the schema
converted from Arrow), so a field's name and type are decided in exactly one place, next to
the table schemas the parsed rows land in.
"""

from __future__ import annotations

import pyarrow as pa

from schemas import topics
from schemas.names import LOG_EVENTS as LOG_EVENTS  # noqa: PLC0414 (re-exported)

# Topics of log events: ``$log/{origin}/{event}`` in the tenant's namespace (schemas.topics).
LOG_TOPIC_PREFIX = topics.LOG_TOPIC_PREFIX

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
