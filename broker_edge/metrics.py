"""The edge's Prometheus metrics (``GET /metrics`` on its HTTP port, issue 13).

Theory of operation: nothing is counted for Prometheus on the hot path. A scrape takes one
:class:`~broker_edge.sysstats.Sample` of the broker (what ``$SYS`` publishes), the tenants'
running totals and the quota decisions the edge acts on, on the event loop's thread (the HTTP
server asks for them there, ``broker_edge.node``), and :func:`exposition` turns those values
into Prometheus's text format with ``prometheus_client``'s metric families. The library is
imported at the first scrape, so an edge without ``--http`` never loads it (a lean edge).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from broker_edge.plim import QuotaDecision, TenantUsage
from broker_edge.sysstats import Sample

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

PREFIX = "edgebus_edge_"
# (name, help, the Sample field): gauges, then counters (their names get ``_total``).
_GAUGES = (
    ("connections", "Clients connected now.", "clients_connected"),
    (
        "sessions",
        "Sessions: connected, plus persistent ones without a connection.",
        "clients_total",
    ),
    ("subscriptions", "Subscriptions of every session.", "subscriptions_count"),
    ("retained_messages", "Retained messages held.", "retained_count"),
    ("inflight_messages", "QoS 1/2 deliveries awaiting acknowledgement.", "messages_inflight"),
    ("held_messages", "Deliveries held for sessions: queued plus in flight.", "store_count"),
    ("journal_bytes", "Bytes of the node's journal segments on disk.", "journal_bytes"),
    ("journal_durable_seq", "The newest durable journal seq.", "journal_durable_seq"),
    ("journal_committed_seq", "The newest seq the lake has committed.", "journal_committed_seq"),
)
_COUNTERS = (
    ("messages_received", "PUBLISH packets received.", "publish_received"),
    ("messages_sent", "PUBLISH packets sent.", "publish_sent"),
    ("messages_dropped", "Publishes dropped (limits, full queues).", "publish_dropped"),
    ("payload_bytes_received", "Payload bytes of publishes received.", "publish_bytes_received"),
    ("payload_bytes_sent", "Payload bytes of publishes sent.", "publish_bytes_sent"),
    ("wire_bytes_received", "Bytes read from clients.", "bytes_received"),
    ("wire_bytes_sent", "Bytes written to clients.", "bytes_sent"),
    ("connects", "CONNECT packets received, accepted or refused.", "connects"),
    ("journal_refused", "QoS 1/2 publishes refused because of the journal.", "journal_refused"),
    ("journal_dropped", "QoS 0 publishes dropped because of the journal.", "journal_dropped"),
    (
        "journal_frames_synced_on_loop",
        "Journal frames whose fdatasync completed on the event loop (Linux AIO).",
        "journal_frames_loop",
    ),
    (
        "journal_frames_synced_in_thread",
        "Journal frames the commit thread wrote and synced (rolls, retries, no AIO).",
        "journal_frames_thread",
    ),
)
_TENANT_COUNTERS = (
    ("messages_in", "Publishes the tenant's clients sent this node."),
    ("messages_out", "Publishes this node delivered to the tenant's clients."),
    ("bytes_in", "Payload bytes the tenant's clients sent this node."),
    ("bytes_out", "Payload bytes this node delivered to the tenant's clients."),
    ("dropped", "The tenant's publishes this node dropped or refused."),
)
JOURNAL_STATES = ("ok", "full", "error")
QUOTA_STATES = ("ok", "warn", "blocked")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one scrape shows, taken on the event loop's thread."""

    sample: Sample
    tenants: Mapping[str, TenantUsage]
    quota: Mapping[str, Mapping[str, QuotaDecision]]


def exposition(snapshot: Snapshot) -> bytes:
    """``snapshot`` in Prometheus's text exposition format."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot))
    text: bytes = generate_latest(registry)
    return text


class _Collector:
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sample = self._snapshot.sample
        yield GaugeMetricFamily(PREFIX + "uptime_seconds", "Seconds since start.", sample.uptime)
        for name, text, field in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, text, getattr(sample, field))
        lag = max(0, sample.journal_durable_seq - sample.journal_committed_seq)
        yield GaugeMetricFamily(
            PREFIX + "journal_lag_records", "Durable records the lake has not committed.", lag
        )
        for name, text, field in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, text, getattr(sample, field))
        state = GaugeMetricFamily(
            PREFIX + "journal_state",
            "1 for the journal's state: ok, full (a disk budget) or error (a write failing).",
            labels=["state"],
        )
        for name in JOURNAL_STATES:
            state.add_metric([name], 1 if sample.journal_state == name else 0)
        yield state
        yield from self._tenants()

    def _tenants(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        tenants = sorted(self._snapshot.tenants.items())
        for name, text in _TENANT_COUNTERS:
            family = CounterMetricFamily(PREFIX + "tenant_" + name, text, labels=["tenant"])
            for tenant, usage in tenants:
                family.add_metric([tenant], getattr(usage, name))
            yield family
        quota = GaugeMetricFamily(
            PREFIX + "quota_state",
            "1 for each tenant's quota state per metric, as the pipeline decided it.",
            labels=["tenant", "metric", "state"],
        )
        limit: Any = GaugeMetricFamily(
            PREFIX + "quota_limit", "The limit of each decision.", labels=["tenant", "metric"]
        )
        for tenant, decisions in sorted(self._snapshot.quota.items()):
            for metric, decision in sorted(decisions.items()):
                for name in QUOTA_STATES:
                    quota.add_metric([tenant, metric, name], 1 if decision.state == name else 0)
                if decision.limit is not None:
                    limit.add_metric([tenant, metric], decision.limit)
        yield quota
        yield limit
