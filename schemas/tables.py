"""Arrow schemas of the Delta tables the pipeline writes, defined once and never inferred.

Each table is created from its schema here, each job casts its output to it, and readers get
it back, so a column's type is decided in exactly one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import pyarrow as pa

from schemas.journal import USER_PROPERTY
from schemas.usage import (
    QUOTA_EVENTS_PARTITION_BY,
    QUOTA_EVENTS_SCHEMA,
    USAGE_PARTITION_BY,
    USAGE_SCHEMA,
)

# One row per publish on a tenant's own topics (anything not starting with "$"). ``(node, seq)``
# is the journal record's identity; ``date`` is the UTC date of ``ts``.
MESSAGES_SCHEMA = pa.schema(
    [
        pa.field("node", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("ts", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("date", pa.date32(), nullable=False),
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("client_id", pa.string(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("qos", pa.int8(), nullable=False),
        pa.field("retain", pa.bool_(), nullable=False),
        pa.field("payload", pa.binary(), nullable=False),
        pa.field("content_type", pa.string(), nullable=True),
        pa.field("user_properties", pa.list_(USER_PROPERTY), nullable=True),
        pa.field("size", pa.int32(), nullable=False),
    ]
)

MESSAGES_PARTITION_BY: tuple[str, ...] = ("tenant", "date")

# One row per publish on a log topic ``$log/{origin}/{event}`` (schemas.payloads), the source of
# ``edgebus logs``. ``(node, seq)``, ``ts`` and ``date`` come from the journal record like in
# ``messages`` (so partitions never depend on a payload's clock); ``tenant`` is the namespace
# the event was published in. The other columns come from the JSON payload.
#
# Rows whose payload breaks the LOG_EVENT_SCHEMA contract are kept, never dropped:
# ``payload_valid`` is false, ``invalid_reason`` names the first failed rule and ``raw`` holds
# the payload as published (null on valid rows); the fields that did parse are filled in, and
# ``origin``/``event_type`` fall back to the topic's levels. A quarantine table fed from these
# rows comes later; until then ``payload_valid = false`` is the quarantine.
LOGS_SCHEMA = pa.schema(
    [
        pa.field("node", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("ts", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("date", pa.date32(), nullable=False),
        pa.field("tenant", pa.string(), nullable=False),
        # null only when neither the payload nor the topic names it (e.g. a bare "$log/x")
        pa.field("origin", pa.string(), nullable=True),
        pa.field("event_type", pa.string(), nullable=True),
        pa.field("client_id", pa.string(), nullable=True),  # "" for tenant-wide events
        pa.field("details", pa.string(), nullable=True),  # the JSON text of the details object
        pa.field("time", pa.string(), nullable=True),  # the payload's ISO time, as sent
        pa.field("payload_valid", pa.bool_(), nullable=False),
        pa.field("invalid_reason", pa.string(), nullable=True),
        pa.field("raw", pa.binary(), nullable=True),
    ]
)

LOGS_PARTITION_BY: tuple[str, ...] = ("tenant", "date")


@dataclass(frozen=True, slots=True)
class TableSpec:
    """How one Delta table of the lake is laid out."""

    schema: pa.Schema
    partition_by: tuple[str, ...]


# Every table of the lake by name, which is also its directory under the lake. A new table's
# schema registers here, so readers (streaming.lake) know it without inferring anything.
TABLES: Mapping[str, TableSpec] = MappingProxyType(
    {
        "messages": TableSpec(MESSAGES_SCHEMA, MESSAGES_PARTITION_BY),
        "logs": TableSpec(LOGS_SCHEMA, LOGS_PARTITION_BY),
        "usage": TableSpec(USAGE_SCHEMA, USAGE_PARTITION_BY),
        "quota_events": TableSpec(QUOTA_EVENTS_SCHEMA, QUOTA_EVENTS_PARTITION_BY),
    }
)
