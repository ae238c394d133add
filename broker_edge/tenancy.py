"""Who a connection is and what it may do: tokens, ACLs, limits, quota state, log events.

The broker routes; this decides. A connection's token (its MQTT username) gives its tenant and
access rules (:mod:`broker_edge.tenants`). Without a tenants file the edge serves one anonymous
default tenant. When no ``[operator]`` token is configured, the edge's own local one
(:mod:`schemas.operator_token`, in its data dir) is the operator's: the pipeline on this
machine uses it to send the journal notices that drive retention. Every decision worth knowing
is a log event published in the tenant's namespace on ``$log/{origin}/{event}`` (journaled like
any publish; see :mod:`broker_edge.plim`); events without a tenant (a bad token, garbage before
CONNECT) go to the operator's namespace.
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, Any

from broker_edge.logtext import truncated
from broker_edge.packets import (
    ConnackCode311,
    Connect,
    ProtocolVersion,
    Publish,
    ReasonCode,
)
from broker_edge.plim import (
    CONTROL_PREFIX,
    QuotaDecision,
    QuotaDecisionError,
    TenantUsage,
    counter_messages,
    log_event,
    quota_event,
)
from broker_edge.tenants import ALLOW_ALL, OPERATOR_TENANT, Grant, Limits, TenantsConfig
from schemas import topics
from schemas.control import ControlMessageError, JournalCommitted
from schemas.names import DEFAULT_TENANT, GAUGE_METRICS

if TYPE_CHECKING:
    from broker_edge.broker import Broker
    from broker_edge.connection import Connection

log = logging.getLogger(__name__)

# The client id of the edge's own publishes (logs, counters, quota): see schemas.topics.
EDGE_CLIENT_ID = topics.EDGE_CLIENT_ID
# The "$" topics the operator's token may publish on: quota decisions and journal commit notices.
OPERATOR_PREFIXES = (CONTROL_PREFIX, topics.JOURNAL_CONTROL_TOPIC_PREFIX)


_ANONYMOUS = Grant(DEFAULT_TENANT, ALLOW_ALL)
_OPERATOR = Grant(OPERATOR_TENANT, ALLOW_ALL, operator=True)


class Tenancy:
    def __init__(
        self, broker: Broker, config: TenantsConfig | None, local_operator_token: str | None = None
    ) -> None:
        self.broker = broker
        self.config = config
        # The operator token the edge made in its data dir when none is configured (valid for
        # as long as the edge runs, whatever a reloaded tenants file says).
        self.local_operator_token = local_operator_token
        self.usage: dict[str, TenantUsage] = {}
        self.quota: dict[str, dict[str, QuotaDecision]] = {}
        self.blocked: set[str] = set()
        self.connected: dict[str, int] = {}  # live connections per tenant on this node
        self._counter_previous: dict[str, dict[str, int]] = {}
        # Tenants whose last report was all zeros: their next all-zero report is skipped.
        self._counter_quiet: set[str] = set()
        self._logging = False
        self._journal_topic = topics.journal_control_topic(broker.settings.node_id)

    # -- identity --------------------------------------------------------------------------

    def usage_of(self, tenant: str) -> TenantUsage:
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage()
        return usage

    def limits(self, tenant: str) -> Limits:
        return self.config.limits(tenant) if self.config is not None else Limits()

    def authenticate(self, conn: Connection, packet: Connect) -> int | None:
        """Bind the connection to its tenant, or return the CONNACK code that refuses it."""
        v5 = conn.version == ProtocolVersion.MQTT_5
        grant = self.grant(packet.username)
        if grant is None:
            # Journaled in the operator's namespace for anyone who tries: keep it small.
            self.log(
                OPERATOR_TENANT,
                "auth_failed",
                truncated(conn.client_id),
                {"peer": conn.peer, "username": packet.username is not None},
            )
            # The issue names 0x86 (bad user name or password: the token) for MQTT 5.
            return ReasonCode.BAD_USER_NAME_OR_PASSWORD if v5 else ConnackCode311.NOT_AUTHORIZED
        conn.tenant, conn.acl, conn.operator = grant.tenant, grant.acl, grant.operator
        conn.token = packet.username
        conn.usage = self.usage_of(conn.tenant)
        limits = self.limits(conn.tenant)
        conn.max_payload = limits.max_payload_bytes or 0
        conn.rate = float(limits.messages_per_second or 0)
        conn.bucket = conn.rate
        refusal = ReasonCode.QUOTA_EXCEEDED if v5 else ConnackCode311.NOT_AUTHORIZED
        if conn.tenant in self.blocked:
            self.log(
                conn.tenant,
                "limit_exceeded",
                conn.client_id,
                {"refused": "connect", "reason": "quota_blocked"},
            )
            return refusal
        # Every session counts, the offline persistent ones too; a client taking over or
        # resuming its own session adds none.
        key = (conn.tenant, conn.client_id)
        known = key in self.broker.connections or key in self.broker.sessions
        if (
            limits.sessions is not None
            and not known
            and self.broker.session_counts.get(conn.tenant, 0) >= limits.sessions
        ):
            self.log(
                conn.tenant,
                "limit_exceeded",
                conn.client_id,
                {"refused": "connect", "limit": "sessions", "value": limits.sessions},
            )
            return refusal
        return None

    def grant(self, token: str | None) -> Grant | None:
        """What ``token`` (a CONNECT's user name) gives; None: refused. Without a tenants file
        every client is the anonymous tenant's, except the holder of the local operator token."""
        local = self.local_operator_token
        if (
            local is not None
            and token is not None
            and hmac.compare_digest(token.encode(), local.encode())
        ):
            return _OPERATOR
        if self.config is None:
            return _ANONYMOUS
        return self.config.grant(token)

    def reload(self, config: TenantsConfig | None) -> None:
        """A new tenants file (SIGHUP): connections keep running under their token's new rules;
        a token that no longer exists, or now names another tenant, is disconnected."""
        self.config = config
        for conn in list(self.broker.connections.values()):
            if config is None:
                continue
            grant = self.grant(conn.token)
            if grant is None or grant.tenant != conn.tenant:
                conn.will = None  # nobody vouches for it any more
                conn.close(ReasonCode.NOT_AUTHORIZED, reason_string="token revoked")
                continue
            conn.acl, conn.operator = grant.acl, grant.operator
            limits = config.limits(conn.tenant)
            conn.max_payload = limits.max_payload_bytes or 0
            conn.rate = float(limits.messages_per_second or 0)
            conn.decoder.max_packet_size = conn.packet_limit()
            if conn.will is not None and self.refuse_publish(conn, conn.will, action="will"):
                conn.will = None  # the new rules forbid it: checked like at CONNECT
        self.broker.flush_dirty()

    # -- publish checks --------------------------------------------------------------------

    def refuse_publish(
        self, conn: Connection, packet: Publish, *, action: str = "publish"
    ) -> int | None:
        """None to accept, or the MQTT 5 reason code to refuse an inbound publish with.

        A will is checked here too, at CONNECT (``action="will"``): it becomes a publish of
        this client later, so what the client may not publish it may not leave as a will.
        """
        topic = packet.topic
        if topic[0] == "$":
            # "$" topics are the platform's; only the operator may publish quota decisions and
            # the lake's journal commit notices.
            if not (conn.operator and topic.startswith(OPERATOR_PREFIXES)):
                self.log(
                    conn.tenant, "acl_denied", conn.client_id, {"action": action, "topic": topic}
                )
                return ReasonCode.NOT_AUTHORIZED
        elif not conn.acl.may_publish(topic):
            self.log(conn.tenant, "acl_denied", conn.client_id, {"action": action, "topic": topic})
            return ReasonCode.NOT_AUTHORIZED
        if conn.tenant in self.blocked:
            conn.usage.dropped += 1
            return ReasonCode.QUOTA_EXCEEDED
        if conn.max_payload and len(packet.payload) > conn.max_payload:
            self.log(
                conn.tenant,
                "limit_exceeded",
                conn.client_id,
                {
                    "limit": "max_payload_bytes",
                    "value": conn.max_payload,
                    "size": len(packet.payload),
                    "topic": topic,
                    "action": action,
                },
            )
            conn.usage.dropped += 1
            return ReasonCode.QUOTA_EXCEEDED
        return None

    def take_token(self, conn: Connection, now: float) -> float:
        """Token bucket per client: seconds to pause its reads for (0: go on)."""
        rate = conn.rate
        conn.bucket = min(rate, conn.bucket + (now - conn.bucket_at) * rate)
        conn.bucket_at = now
        conn.bucket -= 1.0
        if conn.bucket >= 0:
            return 0.0
        return -conn.bucket / rate

    # -- quota -----------------------------------------------------------------------------

    def apply_quota(self, tenant: str, payload: bytes) -> None:
        """Apply a decision from ``$control/quota/{tenant}`` and tell the tenant about it."""
        if not payload:  # the retained decision was cleared: forget the tenant's state
            self.quota.pop(tenant, None)
            self.blocked.discard(tenant)
            return
        try:
            decision = QuotaDecision.parse(payload)
        except QuotaDecisionError as exc:
            log.warning("quota decision for %s ignored: %s", tenant, exc)
            return
        decisions = self.quota.setdefault(tenant, {})
        previous = decisions.get(decision.metric)
        decisions[decision.metric] = decision
        if any(d.state == "blocked" for d in decisions.values()):
            self.blocked.add(tenant)
        else:
            self.blocked.discard(tenant)
        self.broker.internal_publish(
            tenant, topics.quota_topic(decision.metric), decision.payload(), retain=True
        )
        event = quota_event(previous.state if previous else None, decision.state)
        if event is not None:
            log.info("tenant %s: %s (%s)", tenant, event, decision.metric)
            self.log(
                tenant,
                event,
                "",
                {
                    "metric": decision.metric,
                    "limit": decision.limit,
                    "value": decision.value,
                    "decided_at": decision.decided_at,
                },
                origin="quota",
            )

    def control_message(self, tenant: str, topic: str, payload: bytes) -> None:
        """Every publish in the operator's namespace passes here (live, restored, replayed)."""
        if tenant == OPERATOR_TENANT and topic.startswith(CONTROL_PREFIX):
            target = topic[len(CONTROL_PREFIX) :]
            if target and "/" not in target:
                self.apply_quota(target, payload)
        elif tenant == OPERATOR_TENANT and topic == self._journal_topic:
            self.apply_journal_committed(payload)

    def apply_journal_committed(self, payload: bytes) -> None:
        """``$control/journal/{this node}``: the lake committed this node's journal up to a
        seq; retention may delete segments at or below it (see broker_edge.durability)."""
        if not payload:
            return  # the retained message was cleared: keep the last known value
        try:
            committed = JournalCommitted.parse(payload)
        except ControlMessageError as exc:
            log.warning("journal commit notice ignored: %s", exc)
            return
        self.broker.journal_committed(committed.committed_seq)

    # -- log events and counters -------------------------------------------------------------

    def log(
        self,
        tenant: str,
        event: str,
        client_id: str,
        details: dict[str, Any],
        *,
        origin: str = "mqtt",
    ) -> None:
        if self._logging:
            return  # an event while publishing an event (e.g. a queue overflowing): skip
        self._logging = True
        try:
            topic, payload = log_event(
                ts_us=self.broker.wall_clock_us(),
                node=self.broker.settings.node_id,
                tenant=tenant,
                client_id=client_id,
                origin=origin,
                event=event,
                details=details,
            )
            self.broker.internal_publish(tenant, topic, payload)
        finally:
            self._logging = False

    def publish_counters(self, start_us: int, end_us: int) -> None:
        broker = self.broker
        tenants = set(self.usage) | {s.tenant for s in broker.sessions.values()}
        for tenant in sorted(tenants):
            usage = self.usage_of(tenant)
            ns = broker.namespace(tenant)
            totals = {
                "messages_in": usage.messages_in,
                "messages_out": usage.messages_out,
                "bytes_in": usage.bytes_in,
                "bytes_out": usage.bytes_out,
                "sessions": self.connected.get(tenant, 0),
                "subscriptions": sum(
                    len(s.subscriptions) for s in broker.sessions.values() if s.tenant == tenant
                ),
                "retained": sum(1 for m in ns.retained.all() if m.topic[0] != "$"),
            }
            previous = self._counter_previous.get(tenant, {})
            self._counter_previous[tenant] = totals
            # A tenant with nothing going on (every counter still, every gauge 0) is reported
            # once, then not again until something moves: at a 2 s interval, idle tenants
            # would otherwise fill the journal. Lossless for usage: a missing report adds 0 to
            # every sum, and the one zero report ends each gauge's last window at 0.
            quiet = all(
                totals[m] == 0 if m in GAUGE_METRICS else totals[m] == previous.get(m, 0)
                for m in totals
            )
            if quiet and tenant in self._counter_quiet:
                continue
            if quiet:
                self._counter_quiet.add(tenant)
            else:
                self._counter_quiet.discard(tenant)
            for topic, payload in counter_messages(
                node=broker.settings.node_id,
                tenant=tenant,
                totals=totals,
                previous=previous,
                start_us=start_us,
                end_us=end_us,
            ):
                broker.internal_publish(tenant, topic, payload)
        broker.flush_dirty()
