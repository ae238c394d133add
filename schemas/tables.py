"""Arrow schemas of the Delta tables the pipeline writes, defined once and never inferred.

Each table is created from its schema here, each job casts its output to it, and readers get
it back, so a column's type is decided in exactly one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import pyarrow as pa
import pyarrow.compute as pc

from schemas.journal import JOURNAL_SCHEMA, USER_PROPERTY
from schemas.quality import (
    QUALITY_RESULTS_PARTITION_BY,
    QUALITY_RESULTS_SCHEMA,
    QUALITY_RESULTS_TABLE,
)
from schemas.usage import (
    QUOTA_EVENTS_PARTITION_BY,
    QUOTA_EVENTS_SCHEMA,
    USAGE_PARTITION_BY,
    USAGE_SCHEMA,
)

# One row per publish on a tenant's own topics (anything not starting with "$"). ``(node, seq)``
# is the journal record's identity; ``date`` is the UTC date of ``ts``. ``payload_text`` is the
# payload as text when it is valid UTF-8 (an empty payload: ""), null when it is not: made on
# the executors as the rows are written (MESSAGES_DERIVED), null on rows written before the
# column existed.
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
        pa.field("payload_text", pa.string(), nullable=True),
        pa.field("content_type", pa.string(), nullable=True),
        pa.field("user_properties", pa.list_(USER_PROPERTY), nullable=True),
        pa.field("size", pa.int32(), nullable=False),
    ]
)

MESSAGES_PARTITION_BY: tuple[str, ...] = ("tenant", "date")

# The ``messages`` columns the JVM derives from the others as it writes them (Spark SQL over
# the row), never computed in Python: the route's rows (MESSAGES_ROUTED_SCHEMA) lack them.
# ``try_validate_utf8`` is null for a payload that is not UTF-8 (overlong forms and surrogates
# included); a cast alone would keep the invalid bytes.
MESSAGES_DERIVED: Mapping[str, str] = MappingProxyType(
    {"payload_text": "try_validate_utf8(CAST(payload AS STRING))"}
)
MESSAGES_ROUTED_SCHEMA = pa.schema([f for f in MESSAGES_SCHEMA if f.name not in MESSAGES_DERIVED])

# One row per publish on a log topic ``$log/{origin}/{event}`` (schemas.payloads), the source of
# ``edgebus logs``. ``(node, seq)``, ``ts`` and ``date`` come from the journal record like in
# ``messages`` (so partitions never depend on a payload's clock); ``tenant`` is the namespace
# the event was published in. The other columns come from the JSON payload.
#
# Rows whose payload breaks the LOG_EVENT_SCHEMA contract are kept, never dropped:
# ``payload_valid`` is false, ``invalid_reason`` names the first failed rule and ``raw`` holds
# the payload as published (null on valid rows); the fields that did parse are filled in, and
# ``origin``/``event_type`` fall back to the topic's levels. Such rows are also copied to
# ``quarantine`` (below).
#
# The typed columns after ``details`` are the details most events carry, read out of it
# (``streaming.logs.typed_details``, which says which key of which event fills each); null when
# the event's details have no such field (or one of another type), and on rows written before
# the columns existed. ``metric``, ``limit`` and ``value`` mean what they mean in
# ``quota_events``: the limit's name, the limit, the measured value.
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
        pa.field("reason", pa.string(), nullable=True),  # why, in words
        pa.field("reason_code", pa.int32(), nullable=True),  # an MQTT reason/return code
        pa.field("topic", pa.string(), nullable=True),  # the topic or topic filter
        pa.field("qos", pa.int8(), nullable=True),
        pa.field("metric", pa.string(), nullable=True),  # the limit's name
        pa.field("limit", pa.int64(), nullable=True),  # the limit's value
        pa.field("value", pa.int64(), nullable=True),  # the value measured against it
        pa.field("time", pa.string(), nullable=True),  # the payload's ISO time, as sent
        pa.field("payload_valid", pa.bool_(), nullable=False),
        pa.field("invalid_reason", pa.string(), nullable=True),
        pa.field("raw", pa.binary(), nullable=True),
    ]
)

LOGS_PARTITION_BY: tuple[str, ...] = ("tenant", "date")


# One row per journal record that broke a data contract (schemas.contracts, or the payload
# contract of a reserved topic), kept raw: every journal column as it was, plus the UTC ``date``
# of ``ts``, the ``table`` the record was meant for, the ``rule`` it broke (a rule's name) and a
# ``reason`` a person can act on. Unique on ``(node, seq, table)``. A record without a tenant is
# filed under NO_TENANT: Delta (Hive-style partitions) cannot tell an empty partition value
# from null, and the partition column is not nullable; its rule says the tenant was empty. A log
# event that breaks its payload contract is also kept in ``logs`` (``payload_valid = false``):
# log retrieval must show that the event happened; other tables get only records that keep
# every rule.
_QUARANTINE_ADDED = {
    "ts": [pa.field("date", pa.date32(), nullable=False)],
    "tenant": [
        pa.field("table", pa.string(), nullable=False),
        pa.field("rule", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
    ],
}
QUARANTINE_SCHEMA = pa.schema(
    [added for field in JOURNAL_SCHEMA for added in [field, *_QUARANTINE_ADDED.get(field.name, [])]]
)

QUARANTINE_PARTITION_BY: tuple[str, ...] = ("tenant", "date")
NO_TENANT = "$none"


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
        QUALITY_RESULTS_TABLE: TableSpec(QUALITY_RESULTS_SCHEMA, QUALITY_RESULTS_PARTITION_BY),
        "quarantine": TableSpec(QUARANTINE_SCHEMA, QUARANTINE_PARTITION_BY),
    }
)


def utc_date(ts: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """The UTC date of each timestamp: every table's ``date`` partition column.

    Cast from the UTC type explicitly: Arrow takes a zoned timestamp's date in its own zone.
    """
    return pc.cast(pc.cast(ts, pa.timestamp("us", tz="UTC")), pa.date32())
