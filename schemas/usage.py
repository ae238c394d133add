"""Usage counters and quota decisions: the counter payload the edges publish, the ``usage`` and
``quota_events`` tables, and the decision the pipeline sends back to the edges.

Defined once here (Arrow); Spark types are derived with ``from_arrow_schema`` where needed.
"""

from __future__ import annotations

import pyarrow as pa

from schemas import topics
from schemas.names import COUNTED_QUOTAS
from schemas.names import COUNTER_KINDS as COUNTER_KINDS  # noqa: PLC0414 (re-exported)
from schemas.names import COUNTER_METRICS as COUNTER_METRICS  # noqa: PLC0414 (re-exported)
from schemas.names import GAUGE_METRICS as GAUGE_METRICS  # noqa: PLC0414 (re-exported)

_TS = pa.timestamp("us", tz="UTC")

# The topics and the decision's fields are the edge/pipeline contract, declared in
# schemas.topics; named here too for the pipeline's steps that import them from this module.
# The metric names are in schemas.names (pure Python, imported by the lean edge).
COUNTERS_TOPIC_PREFIX = topics.COUNTERS_TOPIC_PREFIX
CONTROL_TOPIC_PREFIX = topics.CONTROL_TOPIC_PREFIX
DECISION_STATES = topics.DECISION_STATES
DECISION_FIELDS = topics.DECISION_FIELDS

# The JSON payload on ``$counters/{metric}`` (see broker_edge.plim.counter_messages). ``delta``
# is what a counter grew by during the interval; ``total`` is the node's running total, or a
# gauge's current value. Timestamps are ISO 8601 strings with an offset in the JSON.
COUNTER_PAYLOAD_SCHEMA = pa.schema(
    [
        pa.field("node", pa.string()),
        pa.field("tenant", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("kind", pa.string()),
        pa.field("delta", pa.int64()),
        pa.field("total", pa.int64()),
        pa.field("interval_start", _TS),
        pa.field("interval_end", _TS),
    ]
)

# Counter records are published by the edge itself, under this client id, in each tenant's
# namespace (broker_edge.tenancy). The pipeline counts no other: a client that manages to
# publish on ``$counters/`` (a will, a bug) must not be able to move its tenant's usage.
EDGE_CLIENT_ID = topics.EDGE_CLIENT_ID

# One parsed counter record of a micro-batch (streaming.usage.transform), before the records of
# one tenant, metric, minute and node are reduced to a USAGE_PARTIAL_SCHEMA row. ``window_start``
# is the minute ``interval_end`` falls in; ``date`` its UTC date.
COUNTER_RECORD_SCHEMA = pa.schema(
    [
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("delta", pa.int64(), nullable=False),
        pa.field("total", pa.int64(), nullable=False),
        pa.field("interval_end", _TS, nullable=False),
        pa.field("window_start", _TS, nullable=False),
        pa.field("date", pa.date32(), nullable=False),
    ]
)

# One node's part of a usage window: a counter's summed deltas, or a gauge's latest value
# (the one reported last, at ``reported_at``).
NODE_USAGE = pa.struct(
    [
        pa.field("node", pa.string(), nullable=False),
        pa.field("value", pa.int64(), nullable=False),
        pa.field("reported_at", _TS, nullable=False),
    ]
)

_NODE_ELEMENT = pa.field("element", NODE_USAGE, nullable=False)

# What the usage job's transform hands to its sink: one row per tenant, metric, minute and node,
# for the counter records of one micro-batch.
USAGE_PARTIAL_SCHEMA = pa.schema(
    [
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("window_start", _TS, nullable=False),
        pa.field("date", pa.date32(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("value", pa.int64(), nullable=False),
        pa.field("reported_at", _TS, nullable=False),
    ]
)

# One row per tenant, metric and one-minute window [window_start, window_end), across all edges.
# A counter interval belongs to the window its ``interval_end`` falls in.
#   value      counters: the deltas of every node summed; gauges: the sum over nodes of each
#              node's latest value in the window.
#   day_value  the UTC day so far, through this window: counters a running total (the day's
#              usage), gauges a running maximum (the day's peak).
#   nodes      each node's part of ``value``, sorted by node.
#   quota_metric  the quota metric this counter measures (``messages_in`` counts
#              ``messages_per_day``, ``bytes_in`` ``bytes_per_day``: ``quota_events.metric``),
#              null for a metric no quota is measured by (sessions, ...) and on rows written
#              before the column existed (a lake upgraded in place).
# ``date`` is the UTC date of ``window_start``. Unique on USAGE_KEY.
USAGE_SCHEMA = pa.schema(
    [
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("quota_metric", pa.string(), nullable=True),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("window_start", _TS, nullable=False),
        pa.field("window_end", _TS, nullable=False),
        pa.field("value", pa.int64(), nullable=False),
        pa.field("day_value", pa.int64(), nullable=False),
        pa.field(
            "nodes", pa.list_(pa.field("element", NODE_USAGE, nullable=False)), nullable=False
        ),
        pa.field("date", pa.date32(), nullable=False),
    ]
)

USAGE_PARTITION_BY: tuple[str, ...] = ("tenant", "date")
USAGE_KEY: tuple[str, ...] = ("tenant", "date", "metric", "window_start")

QUOTA_EVENT_STATES = ("ok", "warn", "blocked", "cleared")
"""``warn`` at 80 % of a limit, ``blocked`` at 100 %; back under 80 %: ``cleared`` (the limit was
raised or removed the same UTC day) or ``ok`` (a new UTC day started)."""

# One row per change of a tenant's quota state for one metric (``messages_per_day``,
# ``bytes_per_day``: the limit's name). ``limit`` is null when the tenant has no such limit any
# more; ``value`` is the day's usage when decided, of the counter ``usage_metric`` names (the
# ``usage`` table's ``metric``: ``messages_in`` for ``messages_per_day``, ``bytes_in`` for
# ``bytes_per_day``; null only on rows written before the column existed); ``batch_id`` the
# usage job's micro-batch that decided it; ``date`` the UTC date of ``decided_at``.
QUOTA_EVENTS_SCHEMA = pa.schema(
    [
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("usage_metric", pa.string(), nullable=True),
        pa.field("limit", pa.int64(), nullable=True),
        pa.field("value", pa.int64(), nullable=False),
        pa.field("state", pa.string(), nullable=False),
        pa.field("decided_at", _TS, nullable=False),
        pa.field("batch_id", pa.int64(), nullable=False),
        pa.field("date", pa.date32(), nullable=False),
    ]
)

QUOTA_EVENTS_PARTITION_BY: tuple[str, ...] = ("tenant", "date")


def named_metric_sql(column: str, names: dict[str, str]) -> str:
    """A SQL expression (Spark, DataFusion) mapping the metric in ``column`` by ``names``
    (:data:`COUNTED_QUOTAS` or :data:`QUOTA_METRICS`), null for a metric it does not name."""
    cases = " ".join(f"WHEN '{key}' THEN '{value}'" for key, value in sorted(names.items()))
    return f"CASE {column} {cases} END"


# The ``quota_metric`` of a ``usage`` row from its ``metric``, in SQL (the usage step's writes).
QUOTA_METRIC_SQL = named_metric_sql("metric", COUNTED_QUOTAS)
