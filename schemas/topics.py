"""The edge/pipeline contract on the wire, declared once: the reserved topics in each tenant's
namespace, who writes them, and the quota decision the pipeline sends back.

The edge (``broker_edge.plim``, ``broker_edge.tenancy``) publishes log events, counters and
quota states on these topics and applies the decisions; the pipeline (``streaming``) splits the
journal by the same prefixes and publishes the decisions. Payload schemas live next door:
``schemas.payloads`` (log events) and ``schemas.usage`` (counters, usage and quota tables).

A topic whose first level starts with ``$`` is the platform's: no client may publish there (nor
leave a will there), except the operator token on ``$control/quota/...``; ``#`` and ``+`` never
match such a topic [MQTT-4.7.2-1].
"""

from __future__ import annotations

LOG_TOPIC_PREFIX = "$log/"
"""``$log/{origin}/{event}``: one JSON log event (``schemas.payloads.LOG_EVENT_SCHEMA``)."""

COUNTERS_TOPIC_PREFIX = "$counters/"
"""``$counters/{metric}``: a tenant's usage on one edge (``schemas.usage.COUNTER_SCHEMA``)."""

QUOTA_TOPIC_PREFIX = "$quota/"
"""``$quota/{metric}``: retained, the tenant's quota state as the edge applies it."""

CONTROL_TOPIC_PREFIX = "$control/quota/"
"""``$control/quota/{tenant}``: retained decisions in the operator's namespace (operator only)."""

USAGE_CONTROL_TOPIC_PREFIX = "$control/usage/"
"""``$control/usage/{tenant}``: retained, the tenant's confirmed day totals across all edges and
its limits (``schemas.control.ConfirmedUsage``); each edge enforces the limits locally with them."""

JOURNAL_CONTROL_TOPIC_PREFIX = "$control/journal/"
"""``$control/journal/{node}``: retained, how far the lake has committed a node's journal
(``schemas.control.JournalCommitted``); the edge's retention deletes segments at or below it."""

SYS_TOPIC_PREFIX = "$SYS/"
"""``$SYS/broker/...``: node statistics, never journaled, seen by no tenant of a tenants file."""

EDGE_CLIENT_ID = "$edge"
"""The client id of every record the edge itself writes (log events, counters, quota states):
no MQTT client can have it, so a record on an edge topic with another client id was not
written by an edge."""

EDGE_TOPIC_PREFIXES = (LOG_TOPIC_PREFIX, COUNTERS_TOPIC_PREFIX, QUOTA_TOPIC_PREFIX)
"""Topics only the edge writes in a tenant's namespace."""

DECISION_STATES = ("ok", "warn", "blocked")
# The decision JSON object's keys (broker_edge.plim.QuotaDecision, streaming.quota): state
# (DECISION_STATES), metric, limit and value (numbers or null), decided_at (ISO 8601 string).
DECISION_FIELDS = ("state", "metric", "limit", "value", "decided_at")


def log_topic(origin: str, event: str) -> str:
    return f"{LOG_TOPIC_PREFIX}{origin}/{event}"


def counter_topic(metric: str) -> str:
    return f"{COUNTERS_TOPIC_PREFIX}{metric}"


def quota_topic(metric: str) -> str:
    return f"{QUOTA_TOPIC_PREFIX}{metric}"


def control_topic(tenant: str) -> str:
    return f"{CONTROL_TOPIC_PREFIX}{tenant}"


def usage_control_topic(tenant: str) -> str:
    return f"{USAGE_CONTROL_TOPIC_PREFIX}{tenant}"


def journal_control_topic(node: str) -> str:
    return f"{JOURNAL_CONTROL_TOPIC_PREFIX}{node}"
