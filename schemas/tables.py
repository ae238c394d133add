"""Arrow schemas of the Delta tables the pipeline writes, defined once and never inferred.

Each table is created from its schema here, each job casts its output to it, and readers get
it back, so a column's type is decided in exactly one place.
"""

from __future__ import annotations

import pyarrow as pa

from schemas.journal import USER_PROPERTY

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
