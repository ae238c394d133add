"""Names the edge and the pipeline share, in pure Python: the edge imports this module and must
stay free of pyarrow (issue 9: a lean edge), so the Arrow schemas beside it import these names
from here rather than define them. The topics they travel on are declared in ``schemas.topics``
(pure Python too).
"""

from __future__ import annotations

# Without a tenants file every client is in this tenant.
DEFAULT_TENANT = "default"

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
        # The edge's own count of the day reached a limit: it refuses the tenant's publishes
        # before the pipeline's decision arrives (broker_edge.localquota, issue 14).
        "quota_reached",
        "journal_full",
        "journal_error",
        "journal_resumed",
        # A socket on a TLS listener that did not complete its handshake (broker_edge.tls).
        "tls_handshake_failed",
        # ... and how many of those one listener did not report in one window (a scanner:
        # broker_edge.refusals).
        "tls_handshake_failures_suppressed",
        # The edge mesh (broker_edge.mesh), in the operator's namespace.
        "link_up",
        "link_down",
        "link_refused",
        # A journal over its disk budget removed records a peer had not acknowledged
        # (broker_edge.durability): they are dropped for it.
        "peer_dropped",
        # A peer away longer than edge.peer_expiry_hours: the journal keeps nothing for it any
        # more (broker_edge.mesh, "Peers gone for good").
        "peer_forgotten",
    }
)

COUNTER_KINDS = ("counter", "gauge")

# The metrics every edge reports per tenant (``broker_edge.plim.counter_messages``); the gauges
# among them report a current value, the others (counters) what they grew by.
COUNTER_METRICS = (
    "messages_in",
    "messages_out",
    "bytes_in",
    "bytes_out",
    "sessions",
    "subscriptions",
    "retained",
)
GAUGE_METRICS = frozenset({"sessions", "subscriptions", "retained"})

# Quota metric (a daily limit's name in the tenants file) -> the counter metric that measures it
# (the ``usage_metric`` column of ``quota_events``).
QUOTA_METRICS: dict[str, str] = {"messages_per_day": "messages_in", "bytes_per_day": "bytes_in"}
# ... and the other way: counter metric -> the quota metric it counts (the ``quota_metric``
# column of ``usage``); a counter no quota is measured by is not in it.
COUNTED_QUOTAS: dict[str, str] = {counter: quota for quota, counter in QUOTA_METRICS.items()}

# The tables whose history expires -> the key that says how many whole days besides today they
# keep (0: forever): in ``[pipeline]`` for every tenant, in a tenant's entry of the tenants file
# for that tenant.
RETENTION_DAYS: dict[str, str] = {
    "logs": "logs_retention_days",
    "messages": "messages_retention_days",
}
