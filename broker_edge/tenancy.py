"""Who a connection is and what it may do: tokens, ACLs, limits, quota state, log events.

The broker routes; this decides. A pure policy (issue 10): it reads what it is shown and answers
with values (an :class:`Admission`, a reason code, :class:`LogEvent` s, the publishes a quota
decision makes); it never writes into a connection or the broker, which apply the answers. Its
own state is the tenants' usage totals, quota decisions and counter history.

A connection's token (its MQTT username) gives its tenant and access rules
(:mod:`broker_edge.tenants`). Without a tenants file the edge serves one anonymous
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
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any, Protocol, TypeVar

from broker_edge.localquota import DayCount, Reached, report_points, stops
from broker_edge.logtext import truncated
from broker_edge.packets import ConnackCode311, Publish, ReasonCode
from broker_edge.plim import (
    CONTROL_PREFIX,
    QuotaDecision,
    QuotaDecisionError,
    TenantUsage,
    counter_messages,
    quota_event,
)
from broker_edge.tenants import ALLOW_ALL, OPERATOR_TENANT, Acl, Grant, Limits, TenantsConfig
from schemas import topics
from schemas.control import ConfirmedUsage, ControlMessageError, JournalCommitted
from schemas.names import DEFAULT_TENANT, GAUGE_METRICS

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# The client id of the edge's own publishes (logs, counters, quota): see schemas.topics.
EDGE_CLIENT_ID = topics.EDGE_CLIENT_ID
# The "$" topics the operator's token may publish on: quota decisions, confirmed usage and
# journal commit notices.
OPERATOR_PREFIXES = (
    CONTROL_PREFIX,
    topics.USAGE_CONTROL_TOPIC_PREFIX,
    topics.JOURNAL_CONTROL_TOPIC_PREFIX,
)


_ANONYMOUS = Grant(DEFAULT_TENANT, ALLOW_ALL)
_OPERATOR = Grant(OPERATOR_TENANT, ALLOW_ALL, operator=True)


@dataclass(frozen=True, slots=True)
class LogEvent:
    """One ``$log/{origin}/{event}`` event to publish in ``tenant``'s namespace."""

    tenant: str
    event: str
    client_id: str
    details: Mapping[str, Any]
    origin: str = "mqtt"


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer to a CONNECT: ``refusal`` (a CONNACK code) or what the client may do."""

    refusal: int | None
    tenant: str = ""
    acl: Acl = field(default_factory=lambda: ALLOW_ALL)
    operator: bool = False
    usage: TenantUsage = field(default_factory=TenantUsage)
    max_payload: int = 0  # 0: no limit beyond the protocol's
    rate: float = 0.0  # messages per second (token bucket); 0: unlimited
    events: tuple[LogEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class ControlOutcome:
    """What a message in the operator's namespace asks for: retained publishes in tenants'
    namespaces (``(tenant, topic, payload)``), log events, and the lake's committed seq of this
    node's journal (retention)."""

    publishes: tuple[tuple[str, str, bytes], ...] = ()
    events: tuple[LogEvent, ...] = ()
    journal_committed: int | None = None


NOTHING = ControlOutcome()


class Client(Protocol):
    """What the policy reads of a connection."""

    @property
    def tenant(self) -> str: ...
    @property
    def client_id(self) -> str: ...
    @property
    def operator(self) -> bool: ...
    @property
    def acl(self) -> Acl: ...
    @property
    def max_payload(self) -> int: ...
    @property
    def usage(self) -> TenantUsage: ...


class Tenancy:
    def __init__(
        self,
        config: TenantsConfig | None,
        node_id: str,
        local_operator_token: str | None = None,
        today: date | None = None,
    ) -> None:
        self.config = config
        self.node_id = node_id
        # The operator token the edge made in its data dir when none is configured (valid for
        # as long as the edge runs, whatever a reloaded tenants file says).
        self.local_operator_token = local_operator_token
        self.usage: dict[str, TenantUsage] = {}
        self.quota: dict[str, dict[str, QuotaDecision]] = {}
        # Refused publishes: the tenants the pipeline's decisions block, and those the local
        # quota stops (broker_edge.localquota); ``blocked`` is the union of both.
        self.blocked: set[str] = set()
        self.decided_blocked: set[str] = set()
        self.stopped: dict[str, Reached] = {}
        # The UTC day of the local quota (the broker's clock; roll_day moves it at midnight).
        self.today = today if today is not None else datetime.now(UTC).date()
        self._days: dict[str, DayCount] = {}
        self._counter_previous: dict[str, dict[str, int]] = {}
        # When each tenant's counters were last reported (wall clock µs): the next report's
        # interval starts there.
        self._reported_until: dict[str, int] = {}
        # Tenants whose last report was all zeros: their next all-zero report is skipped.
        self._counter_quiet: set[str] = set()
        # Tenants whose count passed a report point: their counters go out before the next
        # counter interval (broker_edge.localquota; the broker's tick sends them).
        self.report_due: set[str] = set()
        self._journal_topic = topics.journal_control_topic(node_id)

    # -- identity --------------------------------------------------------------------------

    def usage_of(self, tenant: str) -> TenantUsage:
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage()
            self._days[tenant] = DayCount.starting(self.today, usage)
            self.restop(tenant)
        return usage

    def limits(self, tenant: str) -> Limits:
        return self.config.limits(tenant) if self.config is not None else Limits()

    def admit(
        self,
        *,
        client_id: str,
        peer: str,
        v5: bool,
        username: str | None,
        known: Callable[[str], bool],
        sessions: Mapping[str, int],
    ) -> Admission:
        """A CONNECT's admission. ``known(tenant)``: this client id has a session or a
        connection in ``tenant`` already; ``sessions``: sessions per tenant, offline persistent
        ones included."""
        grant = self.grant(username)
        if grant is None:
            # Journaled in the operator's namespace for anyone who tries: keep it small.
            event = LogEvent(
                OPERATOR_TENANT,
                "auth_failed",
                truncated(client_id),
                {"peer": peer, "username": username is not None},
            )
            # The issue names 0x86 (bad user name or password: the token) for MQTT 5.
            code = ReasonCode.BAD_USER_NAME_OR_PASSWORD if v5 else ConnackCode311.NOT_AUTHORIZED
            return Admission(code, events=(event,))
        tenant = grant.tenant
        limits = self.limits(tenant)
        refusal = ReasonCode.QUOTA_EXCEEDED if v5 else ConnackCode311.NOT_AUTHORIZED
        # A blocked tenant still connects and subscribes (its dashboard reads $quota/... and
        # $log/... to learn why); only its publishes are refused (refuse_publish), issue 13.
        # Every session counts, the offline persistent ones too; a client taking over or
        # resuming its own session adds none.
        if (
            limits.sessions is not None
            and sessions.get(tenant, 0) >= limits.sessions
            and not known(tenant)
        ):
            details = {"refused": "connect", "limit": "sessions", "value": limits.sessions}
            return Admission(
                refusal, events=(LogEvent(tenant, "limit_exceeded", client_id, details),)
            )
        return self._admitted(grant)

    def _admitted(self, grant: Grant) -> Admission:
        limits = self.limits(grant.tenant)
        return Admission(
            None,
            grant.tenant,
            grant.acl,
            grant.operator,
            self.usage_of(grant.tenant),
            limits.max_payload_bytes or 0,
            float(limits.messages_per_second or 0),
        )

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

    def regrant(self, token: str | None, tenant: str) -> Admission | None:
        """After a reload: what a connected client of ``tenant`` with ``token`` may do now;
        None when its token no longer exists or now names another tenant."""
        grant = self.grant(token)
        if grant is None or grant.tenant != tenant:
            return None
        return self._admitted(grant)

    # -- publish checks --------------------------------------------------------------------

    def refuse_publish(
        self, client: Client, packet: Publish, *, action: str = "publish"
    ) -> tuple[int | None, LogEvent | None]:
        """(None, ...) to accept, or the MQTT 5 reason code to refuse an inbound publish with,
        and the log event that says so.

        A will is checked here too, at CONNECT (``action="will"``): it becomes a publish of
        this client later, so what the client may not publish it may not leave as a will.
        """
        topic = packet.topic
        if (
            # "$" topics are the platform's; only the operator may publish quota decisions and
            # the lake's journal commit notices.
            not (client.operator and topic.startswith(OPERATOR_PREFIXES))
            if topic[0] == "$"
            else not client.acl.may_publish(topic)
        ):
            details: dict[str, Any] = {"action": action, "topic": topic, "qos": int(packet.qos)}
            event = LogEvent(client.tenant, "acl_denied", client.client_id, details)
            return ReasonCode.NOT_AUTHORIZED, event
        if client.tenant in self.blocked and action != "will":
            # A will is refused for a block when it is due, not at CONNECT (will_refused): the
            # block may be over by then, and a blocked tenant's clients may connect.
            client.usage.dropped += 1  # the tenant's own totals (usage_of): this policy's state
            return ReasonCode.QUOTA_EXCEEDED, None
        if client.max_payload and len(packet.payload) > client.max_payload:
            details = {
                "limit": "max_payload_bytes",
                "value": client.max_payload,
                "size": len(packet.payload),
                "topic": topic,
                "qos": int(packet.qos),
                "action": action,
            }
            client.usage.dropped += 1
            event = LogEvent(client.tenant, "limit_exceeded", client.client_id, details)
            return ReasonCode.QUOTA_EXCEEDED, event
        return None, None

    def will_refused(self, tenant: str) -> bool:
        """Whether a will now due is dropped: its tenant is blocked (counted as dropped)."""
        if tenant not in self.blocked:
            return False
        self.usage_of(tenant).dropped += 1
        return True

    # -- quota and control -------------------------------------------------------------------

    def apply_quota(self, tenant: str, payload: bytes) -> ControlOutcome:
        """A decision from ``$control/quota/{tenant}``: the tenant's retained ``$quota/...``
        state and the log event that tells it."""
        if not payload:  # the retained decision was cleared: forget the tenant's state
            self.quota.pop(tenant, None)
            self.decided_blocked.discard(tenant)
            self._update_blocked(tenant)
            return NOTHING
        decision = _parsed(QuotaDecision.parse, payload, f"quota decision for {tenant}")
        if decision is None:
            return NOTHING
        decisions = self.quota.setdefault(tenant, {})
        previous = decisions.get(decision.metric)
        decisions[decision.metric] = decision
        if any(d.state == "blocked" for d in decisions.values()):
            self.decided_blocked.add(tenant)
        else:
            self.decided_blocked.discard(tenant)
        self._update_blocked(tenant)
        publish = (tenant, topics.quota_topic(decision.metric), decision.payload())
        event = quota_event(previous.state if previous else None, decision.state)
        if event is None:
            return ControlOutcome((publish,))
        log.info("tenant %s: %s (%s)", tenant, event, decision.metric)
        details = decision.details()
        return ControlOutcome((publish,), (LogEvent(tenant, event, "", details, "quota"),))

    def control_message(self, tenant: str, topic: str, payload: bytes) -> ControlOutcome:
        """Every publish in the operator's namespace passes here (live, restored, replayed)."""
        if tenant != OPERATOR_TENANT:
            return NOTHING
        if topic.startswith(CONTROL_PREFIX):
            target = topic[len(CONTROL_PREFIX) :]
            if target and "/" not in target:
                return self.apply_quota(target, payload)
        elif topic.startswith(topics.USAGE_CONTROL_TOPIC_PREFIX):
            target = topic[len(topics.USAGE_CONTROL_TOPIC_PREFIX) :]
            if target and "/" not in target:
                return self.apply_confirmed(target, payload)
        elif topic == self._journal_topic and payload:  # empty: the retained one was cleared
            # The lake committed this node's journal up to a seq; retention may delete the
            # segments at or below it (see broker_edge.durability).
            try:
                committed = JournalCommitted.parse(payload)
            except ControlMessageError as exc:
                log.warning("journal commit notice ignored: %s", exc)
                return NOTHING
            return ControlOutcome(journal_committed=committed.committed_seq)
        return NOTHING

    # -- local quota (broker_edge.localquota) -------------------------------------------------

    def apply_confirmed(self, tenant: str, payload: bytes) -> ControlOutcome:
        """The pipeline's confirmed day totals of ``tenant`` (``$control/usage/{tenant}``)."""
        if not payload:  # the retained one was cleared
            return NOTHING
        confirmed = _parsed(ConfirmedUsage.parse, payload, f"confirmed usage of {tenant}")
        if confirmed is None:
            return NOTHING
        if confirmed.tenant != tenant or confirmed.date != self.today:
            # Another day's (a retained one from before midnight, or a clock apart): the local
            # count of today stands alone until today's arrive.
            return NOTHING
        self.usage_of(tenant)
        self._days[tenant].confirmed = confirmed
        return ControlOutcome(events=self.restop(tenant))

    def restop(self, tenant: str) -> tuple[LogEvent, ...]:
        """Recompute where the local quota stops ``tenant`` (after a publish reached a stop, a
        confirmed total, a reload, a new day); the ``quota_reached`` event when it now stops."""
        usage = self.usage[tenant]
        day, limits = self._days[tenant], self.limits(tenant)
        at, reached = stops(self.node_id, usage, day, limits)
        if reached is None and (
            usage.messages_in >= usage.check_messages_in or usage.bytes_in >= usage.check_bytes_in
        ):
            self.report_due.add(tenant)  # a report point, not a stop, brought it here
        points = report_points(usage, day, limits)
        usage.check_messages_in = min(at["messages_in"], points["messages_in"])
        usage.check_bytes_in = min(at["bytes_in"], points["bytes_in"])
        was = self.stopped.get(tenant)
        if reached is None:
            if was is not None:
                del self.stopped[tenant]
                log.info("tenant %s: local quota released (%s)", tenant, was.metric)
                self._update_blocked(tenant)
            return ()
        self.stopped[tenant] = reached
        self._update_blocked(tenant)
        if was is not None:
            return ()
        log.info(
            "tenant %s: local quota reached (%s %d of %d)",
            tenant,
            reached.metric,
            reached.value,
            reached.limit,
        )
        details = {
            "metric": reached.metric,
            "limit": reached.limit,
            "value": reached.value,
            "confirmed": reached.confirmed,
            "node": self.node_id,
        }
        return (LogEvent(tenant, "quota_reached", "", details, "quota"),)

    def restop_all(self) -> tuple[LogEvent, ...]:
        """After a reload of the tenants file: every tenant's stops under its new limits."""
        return tuple(event for tenant in list(self.usage) for event in self.restop(tenant))

    def roll_day(self, today: date) -> tuple[LogEvent, ...]:
        """A new UTC day: every tenant's day count starts again, the old confirmed totals go."""
        if today == self.today:
            return ()
        self.today = today
        for tenant, usage in self.usage.items():
            self._days[tenant] = DayCount.starting(today, usage)
        return self.restop_all()

    def _update_blocked(self, tenant: str) -> None:
        if tenant in self.decided_blocked or tenant in self.stopped:
            self.blocked.add(tenant)
        else:
            self.blocked.discard(tenant)

    # -- counters ----------------------------------------------------------------------------

    def counter_reports(
        self,
        start_us: int,
        end_us: int,
        node: str,
        gauges: Mapping[str, Mapping[str, int]],
        tenants: Collection[str] | None = None,
    ) -> list[tuple[str, str, bytes]]:
        """``(tenant, topic, payload)`` of each tenant's ``$counters/...`` for the window
        (from ``start_us``, or from the tenant's last report if later), from its usage totals
        and ``gauges`` (sessions, subscriptions, retained: the broker's); only of ``tenants``
        when given (a report before the interval's end: ``report_due``)."""
        reports: list[tuple[str, str, bytes]] = []
        chosen = set(self.usage) | set(gauges) if tenants is None else set(tenants)
        for tenant in sorted(chosen):
            self.report_due.discard(tenant)
            since = max(start_us, self._reported_until.get(tenant, start_us))
            self._reported_until[tenant] = end_us
            usage = self.usage_of(tenant)
            totals = {
                "messages_in": usage.messages_in,
                "messages_out": usage.messages_out,
                "bytes_in": usage.bytes_in,
                "bytes_out": usage.bytes_out,
                **_NO_GAUGES,
                **gauges.get(tenant, {}),
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
            reports.extend(
                (tenant, topic, payload)
                for topic, payload in counter_messages(
                    node=node,
                    tenant=tenant,
                    totals=totals,
                    previous=previous,
                    start_us=since,
                    end_us=end_us,
                )
            )
        return reports


_NO_GAUGES = {"sessions": 0, "subscriptions": 0, "retained": 0}


def _parsed(parse: Callable[[bytes], _T], payload: bytes, what: str) -> _T | None:
    """``parse(payload)``, or None (logged) when the operator sent something broken."""
    try:
        return parse(payload)
    except (QuotaDecisionError, ControlMessageError) as exc:
        log.warning("%s ignored: %s", what, exc)
        return None


def take_token(bucket: float, bucket_at: float, rate: float, now: float) -> tuple[float, float]:
    """Token bucket of one client at ``rate`` messages per second, one message taken at
    ``now``: (the bucket's new level, seconds to pause the client's reads for; 0: go on)."""
    level = min(rate, bucket + (now - bucket_at) * rate) - 1.0
    return level, (0.0 if level >= 0 else -level / rate)
