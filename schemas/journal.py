"""The journal record: one row per publish an edge accepted.

``(node, seq)`` is a record's identity from the edge all the way into Delta. ``seq`` starts at 1
on each node and grows by one per record with no gaps.
"""

from __future__ import annotations

import pyarrow as pa

from schemas.names import DEFAULT_TENANT as DEFAULT_TENANT  # noqa: PLC0414 (re-exported)

USER_PROPERTY = pa.struct(
    [pa.field("key", pa.string(), nullable=False), pa.field("value", pa.string(), nullable=False)]
)

# Column order is part of the on-disk format (journal frames are Arrow IPC record batches
# serialized without their schema); change it only with a new journal format version.
JOURNAL_SCHEMA = pa.schema(
    [
        pa.field("node", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("ts", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("client_id", pa.string(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("qos", pa.int8(), nullable=False),
        pa.field("retain", pa.bool_(), nullable=False),
        pa.field("payload", pa.binary(), nullable=False),
        pa.field("content_type", pa.string(), nullable=True),
        pa.field("user_properties", pa.list_(USER_PROPERTY), nullable=True),
    ]
)
