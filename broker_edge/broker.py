"""Sessions and routing of one edge node: the part between connections and the journal.

Each tenant has its own :class:`Namespace` (subscription trie and retained store), so tenants are
isolated by construction: nothing here ever looks a topic up outside the publisher's namespace.
A publish is appended to the journal, stored if retained, and fanned out to the sessions whose
subscriptions match. Deliveries go straight to a connected client's output buffer while its
in-flight window has room and its transport is not paused; otherwise they wait in the session's
bounded queue.

Delivery to subscribers does not wait for the journal: only the *acknowledgement* to the
publisher does (so subscribers see the lowest latency, and a crash can at worst lose a message
that was never acknowledged, which the publisher resends).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker_edge import sessionlog
from broker_edge.codec import encode_publish
from broker_edge.connection import (
    PAUSED_BY_JOURNAL,
    PAUSED_BY_RATE,
    RECORD_OVERHEAD,
    Connection,
    ConnState,
)
from broker_edge.durability import JournalStatus
from broker_edge.errors import ProtocolError
from broker_edge.logtext import printable, truncated
from broker_edge.message import Message
from broker_edge.packets import (
    NO_PROPERTIES,
    Connect,
    Properties,
    ProtocolVersion,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    QoS,
    ReasonCode,
    RetainHandling,
    Subscription,
)
from broker_edge.plim import log_event
from broker_edge.retained import RetainedStore
from broker_edge.session import Outbound, OutState, Pending, Session
from broker_edge.sessionlog import SessionLog, SessionLogError
from broker_edge.settings import EdgeSettings
from broker_edge.store import subscription_doc, subscription_from
from broker_edge.tenancy import (
    EDGE_CLIENT_ID,
    NOTHING,
    Admission,
    ControlOutcome,
    LogEvent,
    Tenancy,
)
from broker_edge.tenants import OPERATOR_TENANT, TenantsConfig
from broker_edge.topics import parse_subscription_filter
from broker_edge.trie import TopicTrie
from schemas.names import DEFAULT_TENANT
from schemas.topics import JOURNAL_CONTROL_TOPIC_PREFIX

log = logging.getLogger(__name__)

# Aliases for the per-message path: reading an enum member through its class costs ~70 ns on
# Python 3.11 (see connection.py).
_QOS0 = QoS.AT_MOST_ONCE
_V5 = ProtocolVersion.MQTT_5

# How often tick() scans every connection (keepalive, CONNECT timeout) and every session
# (expiry): their deadlines are met within this.
SCAN_INTERVAL = 1.0

SESSION_NEVER_EXPIRES = 0xFFFFFFFF


class Journal(Protocol):
    """What the broker needs of the journal: append now, be told when it is durable.

    ``append`` is positional (it runs once per publish): ts_us, tenant, client_id, topic, qos,
    retain, payload, content_type, user_properties; it returns the record's seq.
    """

    def append(
        self,
        ts_us: int,
        tenant: str,
        client_id: str,
        topic: str,
        qos: int,
        retain: bool,
        payload: bytes,
        content_type: str | None,
        user_properties: tuple[tuple[str, str], ...],
        /,
    ) -> int: ...

    def after_durable(
        self, seq: int, callback: Callable[[], None], refused: Callable[[], None] | None = None
    ) -> None:
        """``callback`` once ``seq`` is durable, or ``refused`` if its frame failed."""
        ...

    @property
    def backlog(self) -> int:
        """Records appended and not yet durable."""
        ...

    @property
    def appended_seq(self) -> int:
        """The seq of the newest record appended."""
        ...

    # What the lake has committed of this journal (retention deletes up to it).
    lake_committed_seq: int


@dataclass(slots=True)
class SharedGroup:
    """A shared subscription ``$share/{group}/{filter}``: each message goes to one member,
    round-robin, preferring members that are connected and can take it [MQTT-4.8.2]."""

    members: dict[str, Subscription] = field(default_factory=dict)
    cursor: int = 0

    def pick(self, sessions: dict[tuple[str, str], Session], tenant: str) -> str | None:
        ids = list(self.members)
        n = len(ids)
        for i in range(n):
            client_id = ids[(self.cursor + i) % n]
            session = sessions.get((tenant, client_id))
            if session is not None and session.connection is not None and session.window_open():
                self.cursor = (self.cursor + i + 1) % n
                return client_id
        if not n:
            return None
        client_id = ids[self.cursor % n]  # nobody can take it now: queue it for the next one
        self.cursor = (self.cursor + 1) % n
        return client_id


# Trie entries: a client's own subscription (key: client id) or a shared group
# (key: ("$share", group)).
TrieKey = str | tuple[str, str]
TrieValue = Subscription | SharedGroup


@dataclass(slots=True)
class Namespace:
    """One tenant's routing world."""

    subscriptions: TopicTrie[TrieKey, TrieValue] = field(default_factory=TopicTrie)
    retained: RetainedStore = field(default_factory=RetainedStore)
    shared: dict[tuple[str, str], SharedGroup] = field(default_factory=dict)


@dataclass(slots=True)
class Stats:
    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    dropped: int = 0
    # MQTT packets of any type and bytes on the wire (listener, flush_dirty), for $SYS.
    packets_in: int = 0
    packets_out: int = 0
    wire_bytes_in: int = 0
    wire_bytes_out: int = 0
    sockets_opened: int = 0
    connects: int = 0  # CONNECT packets received, refused ones too
    sessions_expired: int = 0  # disconnected sessions dropped at the end of their expiry
    # Times a publisher's reads were paused because the journal was behind.
    reads_paused: int = 0


class Broker:
    def __init__(
        self,
        settings: EdgeSettings,
        journal: Journal,
        wall_clock_us: Callable[[], int] = lambda: time.time_ns() // 1000,
        tenants: TenantsConfig | None = None,
        local_operator_token: str | None = None,
    ) -> None:
        self.settings = settings
        self.journal = journal
        self.wall_clock_us = wall_clock_us
        # Set by the node to its event loop's clock: a connection ends a turn that ran too long.
        self.clock: Callable[[], float] = _no_time
        # Set by the node: call tick() at this loop time at the latest (one timer for every
        # deadline of every connection; see tick).
        self.wake_at: Callable[[float], None] = _never
        # Publishers paused for their rate until their resume_at (see tick).
        self.rate_paused: set[Connection] = set()
        self._next_scan = 0.0  # when tick next scans every connection and session
        self.namespaces: dict[str, Namespace] = {}
        self.sessions: dict[tuple[str, str], Session] = {}
        self.connections: dict[tuple[str, str], Connection] = {}
        self.dirty: set[Connection] = set()
        self.stats = Stats()
        self.tenancy = Tenancy(tenants, settings.node_id, local_operator_token)
        # Live connections per tenant on this node (the tenants' "sessions" gauge).
        self.connected: dict[str, int] = {}
        self._logging = False  # publishing a log event (see log)
        self.valid_topics: set[str] = set()
        self.valid_topic_chars = 0  # characters in valid_topics (see connection.py)
        # Set when a persistent session's shape changes (created, subscribed, dropped): the node
        # then snapshots soon, so a crash cannot forget a subscription for long.
        self.state_changed = False
        # Wills waiting for their delay [MQTT-3.1.3-9]: (tenant, client id) -> (due, will).
        self.pending_wills: dict[tuple[str, str], tuple[float, Publish]] = {}
        # Publishers whose reads are paused until the journal catches up.
        self.paused_readers: set[Connection] = set()
        # Connections that have not completed CONNECT yet (closed after connect_timeout).
        self.awaiting_connect: set[Connection] = set()
        # Sessions per tenant, persistent offline ones included (the tenant's sessions limit).
        self.session_counts: dict[str, int] = {}
        # Set by the node: changes to persistent sessions are appended here, and the output of
        # the connections that made them is held until ``sync_sessions`` made them durable.
        self.session_log: SessionLog | None = None
        self.held: set[Connection] = set()
        self.request_session_sync: Callable[[], None] = _noop  # runs sync_sessions soon
        self._session_sync_requested = False
        # The journal's state (journal_status_changed): while journal_refusal is not 0 every
        # client publish is refused with it (QoS 0: dropped and counted in journal_dropped).
        self.journal_status = JournalStatus()
        self.journal_refusal = 0
        self.journal_dropped = 0  # QoS 0 publishes dropped while the journal refused
        self.journal_refused = 0  # QoS 1/2 publishes refused (or their connection closed)
        self.on_journal_status: Callable[[JournalStatus], None] = _ignore_status

    # -- plumbing ------------------------------------------------------------------------------

    def namespace(self, tenant: str) -> Namespace:
        ns = self.namespaces.get(tenant)
        if ns is None:
            ns = self.namespaces[tenant] = Namespace()
        return ns

    def flush_dirty(self) -> None:
        """Write every connection's pending output: one transport write per connection.
        A connection whose session change is not durable yet waits (see sync_sessions)."""
        while self.dirty:
            dirty = self.dirty
            self.dirty = set()
            held = self.held
            for conn in dirty:
                if held and conn in held:
                    continue  # its CONNACK/SUBACK waits for the session log
                self.stats.packets_out += len(conn.out)  # one emit() per packet
                conn.flush()

    # -- the session log (see broker_edge.sessionlog) ------------------------------------------

    def _log_session_change(
        self, session: Session, op: str, conn: Connection | None, **fields: Any
    ) -> None:
        """Append a change of a persistent session; ``conn``'s output is held until it is
        durable, so its CONNACK or SUBACK never promises what a crash could take back."""
        session_log = self.session_log
        if session_log is None:
            return
        seq = self.journal.appended_seq  # made after this journal record (see _restore)
        record = {"op": op, "seq": seq, "t": session.tenant, "c": session.client_id}
        record.update(fields)
        session_log.append(record)
        if conn is not None:
            self.held.add(conn)
        self._want_session_sync()

    def _want_session_sync(self) -> None:
        if not self._session_sync_requested:
            self._session_sync_requested = True
            self.request_session_sync()

    def log_session(self, session: Session, conn: Connection | None) -> None:
        """Record the session as it is now: opened with its expiry, or dropped (expiry 0)."""
        if session.clean:
            self._log_session_change(session, "drop", conn)
        else:
            self._log_session_change(session, "open", conn, x=session.expiry_interval)

    def sync_sessions(self) -> None:
        """Make the logged session changes durable, then release the held connections."""
        self._session_sync_requested = False
        held, self.held = self.held, set()
        try:
            if self.session_log is not None:
                self.session_log.sync()
        except SessionLogError:
            # Nothing held may be confirmed: close those connections without their answer.
            log.exception("session changes not durable: closing the clients that made them")
            for conn in held:
                conn.out.clear()
                conn.close(None, send_disconnect=False)
        for conn in held:
            if conn.out or conn.closing:
                self.dirty.add(conn)
        self.flush_dirty()

    def apply_session_record(self, record: dict[str, Any], now: float) -> None:
        """Re-apply one session log record at restore (before serving; never logged again)."""
        key = (record["t"], record["c"])
        session = self.sessions.get(key)
        op = record["op"]
        if op == "drop":
            if session is not None:
                self._drop_session(session)
            return
        if session is None:
            session = Session(
                client_id=key[1],
                tenant=key[0],
                clean=False,
                max_queued=self.settings.max_queued_messages,
                max_inflight=self.settings.max_inflight_messages,
                max_queued_bytes=self.settings.max_queued_bytes,
                disconnected_at=now,
            )
            self._add_session(session, key)
        if op == "open":
            session.expiry_interval = int(record["x"])
        elif op == "sub":
            sub = subscription_from(record["sub"])
            session.subscriptions[sub.topic_filter] = sub
            if record.get("id") is not None:
                session.set_subscription_id(sub.topic_filter, int(record["id"]))
            self._install_subscription(session, sub.topic_filter, sub)
        elif op == "unsub":
            full = record["f"]
            session.set_subscription_id(full, None)
            if session.subscriptions.pop(full, None) is not None:
                self._remove_subscription(self.namespace(session.tenant), key[1], full)

    def _add_session(self, session: Session, key: tuple[str, str]) -> None:
        """``key`` is ``(session.tenant, session.client_id)``."""
        self.sessions[key] = session
        counts = self.session_counts
        counts[session.tenant] = counts.get(session.tenant, 0) + 1

    # -- connect / disconnect --------------------------------------------------------------------

    def admit(self, conn: Connection, packet: Connect) -> Admission:
        """The tenancy's answer to a CONNECT (its log events published)."""
        client_id = conn.client_id
        admission = self.tenancy.admit(
            client_id=client_id,
            peer=conn.peer,
            v5=conn.version == ProtocolVersion.MQTT_5,
            username=packet.username,
            known=lambda tenant: (
                (tenant, client_id) in self.connections or (tenant, client_id) in self.sessions
            ),
            sessions=self.session_counts,
        )
        self.log_events(admission.events)
        return admission

    def log(
        self,
        tenant: str,
        event: str,
        client_id: str,
        details: dict[str, Any],
        *,
        origin: str = "mqtt",
    ) -> None:
        """Publish one log event in ``tenant``'s namespace (journaled like any publish)."""
        self.log_events((LogEvent(tenant, event, client_id, details, origin),))

    def log_events(self, events: Iterable[LogEvent]) -> None:
        for event in events:
            if self._logging:
                return  # an event while publishing an event (e.g. a queue overflowing): skip
            self._logging = True
            try:
                topic, payload = log_event(
                    ts_us=self.wall_clock_us(),
                    node=self.settings.node_id,
                    tenant=event.tenant,
                    client_id=event.client_id,
                    origin=event.origin,
                    event=event.event,
                    details=dict(event.details),
                )
                self.internal_publish(event.tenant, topic, payload)
            finally:
                self._logging = False

    def control(self, outcome: ControlOutcome) -> None:
        """Carry out what a message in the operator's namespace asked for."""
        if outcome is NOTHING:
            return
        for tenant, topic, payload in outcome.publishes:
            self.internal_publish(tenant, topic, payload, retain=True)
        self.log_events(outcome.events)
        if outcome.journal_committed is not None:
            self.journal_committed(outcome.journal_committed)

    def reload_tenants(self, config: TenantsConfig | None) -> None:
        """A new tenants file (SIGHUP): connections keep running under their token's new rules;
        a token that no longer exists, or now names another tenant, is disconnected."""
        tenancy = self.tenancy
        tenancy.config = config
        if config is None:
            return
        for conn in list(self.connections.values()):
            admission = tenancy.regrant(conn.token, conn.tenant)
            if admission is None:
                conn.will = None  # nobody vouches for it any more
                conn.close(ReasonCode.NOT_AUTHORIZED, reason_string="token revoked")
                continue
            conn.acl, conn.operator = admission.acl, admission.operator
            conn.max_payload, conn.rate = admission.max_payload, admission.rate
            conn.decoder.max_packet_size = conn.packet_limit()
            if conn.will is not None:
                refusal, event = tenancy.refuse_publish(conn, conn.will, action="will")
                if refusal is not None:
                    conn.will = None  # the new rules forbid it: checked like at CONNECT
                if event is not None:
                    self.log_events((event,))
        self.flush_dirty()

    def publish_counters(self, start_us: int, end_us: int) -> None:
        """Each tenant's usage on this node for the window, on ``$counters/{metric}``."""
        gauges: dict[str, dict[str, int]] = {}
        for session in self.sessions.values():
            gauge = gauges.get(session.tenant)
            if gauge is None:
                gauge = gauges[session.tenant] = {"subscriptions": 0}
            gauge["subscriptions"] += len(session.subscriptions)
        for name in set(gauges) | set(self.tenancy.usage):
            ns = self.namespace(name)
            gauge = gauges.setdefault(name, {"subscriptions": 0})
            gauge["sessions"] = self.connected.get(name, 0)
            gauge["retained"] = sum(1 for m in ns.retained.all() if m.topic[0] != "$")
        reports = self.tenancy.counter_reports(start_us, end_us, self.settings.node_id, gauges)
        for tenant, topic, payload in reports:
            self.internal_publish(tenant, topic, payload)
        self.flush_dirty()

    def internal_publish(
        self, tenant: str, topic: str, payload: bytes, *, retain: bool = False
    ) -> None:
        """A publish made by the edge itself (log event, counter, quota state): journaled and
        routed like any other, not counted as the tenant's traffic."""
        self._accept(
            tenant, EDGE_CLIENT_ID, Publish(topic=topic, payload=payload, retain=retain), None
        )

    def open_session(self, conn: Connection, packet: Connect, now: float) -> tuple[Session, bool]:
        key = (conn.tenant, conn.client_id)
        previous = self.connections.get(key)
        if previous is not None and previous is not conn:
            # Client takeover [MQTT-3.1.4-3]: the older connection is closed.
            log.info("client %s taken over from %s", printable(conn.client_id), previous.peer)
            self.log(
                conn.tenant,
                "session_taken_over",
                conn.client_id,
                {"old_peer": previous.peer, "new_peer": conn.peer},
            )
            previous.close(0x8E)
            self._detach(previous, now)
        if conn.version == ProtocolVersion.MQTT_5:
            expiry = packet.properties.session_expiry_interval or 0
        else:
            expiry = 0 if packet.clean_start else SESSION_NEVER_EXPIRES
        self.pending_wills.pop(key, None)  # reconnected in time: no will [MQTT-3.1.3-9]
        session = self.sessions.get(key)
        present = session is not None and not packet.clean_start
        if session is not None and packet.clean_start:
            self._drop_session(session)
            session = None
        was_persistent = session is not None and not session.clean
        if session is None:
            session = Session(
                client_id=conn.client_id,
                tenant=conn.tenant,
                clean=packet.clean_start,
                max_queued=self.settings.max_queued_messages,
                max_inflight=self.settings.max_inflight_messages,
                max_queued_bytes=self.settings.max_queued_bytes,
            )
            self._add_session(session, key)  # the key of self.connections too: one tuple
        # Never more unacknowledged deliveries than the client's receive maximum
        # [MQTT-3.3.4-7].
        session.max_inflight = min(self.settings.max_inflight_messages, conn.receive_maximum_out)
        session.expiry_interval = expiry
        session.clean = expiry == 0
        if not session.clean or was_persistent:
            self.state_changed = True
            self.log_session(session, conn)  # its CONNACK waits until this is durable
        session.connection = conn
        session.disconnected_at = None
        self.connections[key] = conn
        connected = self.connected
        connected[conn.tenant] = connected.get(conn.tenant, 0) + 1
        self.log(
            conn.tenant,
            "connect",
            conn.client_id,
            {
                "peer": conn.peer,
                "protocol": int(conn.version),
                "clean_start": packet.clean_start,
                "keepalive": conn.keepalive,
                "session_present": present,
            },
        )
        return session, present

    def session_resumed(self, conn: Connection, session: Session) -> None:
        """Redeliver the in-flight window with DUP set, then what waited in the queue
        [MQTT-4.4.0-1]."""
        for pid, out in session.inflight.items():
            if out.state is OutState.AWAIT_PUBCOMP:
                conn.send(Pubrel(packet_id=pid))
            else:
                data = self._encode(
                    conn,
                    out.message,
                    out.qos,
                    out.retain,
                    pid,
                    dup=True,
                    sub_ids=out.subscription_ids,
                )
                if data is not None:
                    conn.emit(data)
        self._drain_queue(session)

    def set_session_expiry(self, conn: Connection, expiry: int) -> None:
        """A DISCONNECT's session expiry interval replaces the one of the CONNECT
        [MQTT-3.14.2.2.2]; raises ProtocolError if the CONNECT's was 0 and this one is not."""
        session = conn.session
        assert session is not None
        if expiry and not session.expiry_interval:
            raise ProtocolError(
                "DISCONNECT sets a session expiry after a CONNECT with 0 [MQTT-3.14.2-2]",
                ReasonCode.PROTOCOL_ERROR,
            )
        if expiry == session.expiry_interval:
            return
        was_persistent = not session.clean
        session.expiry_interval = expiry
        session.clean = expiry == 0
        if was_persistent:
            self.state_changed = True  # a new expiry, or no longer persistent
            self.log_session(session, conn)

    def connection_lost(self, conn: Connection, now: float) -> None:
        session = conn.session
        if session is None:
            return
        will = conn.will
        conn.will = None
        self._detach(conn, now)
        if will is None or conn.clean_disconnect:
            return
        # The network connection closed without DISCONNECT: the will [MQTT-3.1.2-8], after its
        # delay or when the session ends, whichever comes first [MQTT-3.1.3-9].
        key = (conn.tenant, conn.client_id)
        taken_over = key in self.connections
        if conn.will_delay == 0:
            self._publish_will(conn.tenant, conn.client_id, will)
        elif not taken_over and self.sessions.get(key) is session:
            delay = min(conn.will_delay, session.expiry_interval)
            self.pending_wills[key] = (now + delay, will)
            self.wake_at(now + delay)
        elif not taken_over:
            self._publish_will(conn.tenant, conn.client_id, will)  # the session already ended

    def _detach(self, conn: Connection, now: float) -> None:
        session = conn.session
        if session is None:
            return
        key = (conn.tenant, conn.client_id)
        if self.connections.get(key) is conn:
            del self.connections[key]
            self.connected[conn.tenant] -= 1
            self.log(
                conn.tenant,
                "disconnect",
                conn.client_id,
                {
                    "peer": conn.peer,
                    "clean": conn.clean_disconnect,
                    "reason_code": conn.close_reason,
                },
            )
        if session.connection is conn:
            session.connection = None
            session.disconnected_at = now
            if session.expiry_interval == 0:
                self._drop_session(session)

    def _drop_session(self, session: Session) -> None:
        if not session.clean:
            self.state_changed = True
            self._log_session_change(session, "drop", None)
        ns = self.namespace(session.tenant)
        for topic_filter in session.subscriptions:
            self._remove_subscription(ns, session.client_id, topic_filter)
        session.subscriptions.clear()
        session.clear_subscription_ids()
        session.inflight.clear()
        session.clear_queue()
        key = (session.tenant, session.client_id)
        if self.sessions.get(key) is session:
            del self.sessions[key]
            self.session_counts[session.tenant] -= 1
        pending = self.pending_wills.pop(key, None)
        if pending is not None:
            self._publish_will(session.tenant, session.client_id, pending[1])

    def _publish_will(self, tenant: str, client_id: str, will: Publish) -> None:
        try:
            self._accept(tenant, client_id, will, publisher=None)
        except ProtocolError as exc:
            log.warning("will of %s not published: %s", printable(client_id), printable(str(exc)))

    # -- publish ---------------------------------------------------------------------------------

    def accept_publish(self, conn: Connection, packet: Publish, now: float) -> int:
        """Journal, retain and route one inbound publish; returns its journal seq."""
        stats = self.stats
        size = len(packet.payload)
        stats.messages_in += 1
        stats.bytes_in += size
        usage = conn.usage
        usage.messages_in += 1
        usage.bytes_in += size
        seq = self._accept(conn.tenant, conn.client_id, packet, conn)
        conn.turn_bytes += size + len(packet.topic) + RECORD_OVERHEAD  # see Connection.end_turn
        if seq:  # 0: not journaled (the lake's commit notice), nothing to wait for
            conn.turn_seq = seq
        return seq

    def _accept(
        self, tenant: str, client_id: str, packet: Publish, publisher: Connection | None
    ) -> int:
        # The per-publish hot path: keep it flat (no helper calls that a branch can avoid).
        props = packet.properties
        if props is not NO_PROPERTIES and (
            props.topic_alias is not None or props.subscription_identifiers
        ):
            props = dataclasses.replace(props, topic_alias=None, subscription_identifiers=())
        ts_us = self.wall_clock_us()
        topic = packet.topic
        qos = packet.qos
        retain = packet.retain
        if tenant == OPERATOR_TENANT and topic.startswith(JOURNAL_CONTROL_TOPIC_PREFIX):
            # Not journaled: the pipeline sends one after each batch it commits, and a
            # journaled one would be a new record, so a new batch, so a new notice, forever.
            # The retained message is kept in the state snapshot; without it retention waits.
            seq = 0
        else:
            seq = self.journal.append(
                ts_us,
                tenant,
                client_id,
                topic,
                qos,
                retain,
                packet.payload,
                props.content_type,
                props.user_properties,
            )
        message = Message(tenant, topic, packet.payload, qos, retain, client_id, ts_us, props, seq)
        ns = self.namespaces.get(tenant)
        if ns is None:
            ns = self.namespace(tenant)
        if retain:
            ns.retained.set(message)
        if tenant == OPERATOR_TENANT:
            self.control(self.tenancy.control_message(tenant, topic, packet.payload))
        matches = ns.subscriptions.match(topic)
        if matches:
            self._route(matches, message, publisher)
        return seq

    def after_durable(self, seq: int, conn: Connection, packet_id: int, qos: QoS) -> None:
        self.journal.after_durable(
            seq,
            lambda: conn.ack_durable(packet_id, qos),
            lambda: conn.refuse_undurable(packet_id, qos),
        )

    def journal_committed(self, committed_seq: int) -> None:
        """The lake has this node's records up to ``committed_seq``: retention may go there."""
        journal = self.journal
        appended = journal.appended_seq
        if committed_seq > appended:
            # Never from this journal (a lake of another journal under the same node name?):
            # trusting it could delete records the lake does not have.
            log.warning(
                "journal commit notice for seq %d ignored: this journal ends at seq %d",
                committed_seq,
                appended,
            )
            return
        journal.lake_committed_seq = max(journal.lake_committed_seq, committed_seq)

    def journal_status_changed(self, status: JournalStatus) -> None:
        """The journal started or stopped refusing publishes (see broker_edge.durability): from
        now on ``Connection._on_publish`` refuses with ``journal_refusal``; the operator's
        ``$log`` gets ``journal_full`` / ``journal_error`` / ``journal_resumed``."""
        previous = self.journal_status
        self.journal_status = status
        self.journal_refusal = status.reason_code
        if status.state == "error" and self.session_log is not None:
            # The journal dropped what followed its last durable record and gives those seqs
            # out again: the session changes logged with them came after that record.
            self.session_log.append({"op": sessionlog.CUT, "seq": self.journal.appended_seq})
            self._want_session_sync()
        details: dict[str, object] = {"state": status.state}
        if status.state == "error":
            details["error"] = status.error[:300]
            if previous.state == "error" and previous.error == status.error:
                # A retry failed the same way: the event was routed already; only put it back
                # in the journal (the failed frame that held it was dropped), where it is the
                # frame the next retry writes.
                topic, payload = log_event(
                    ts_us=self.wall_clock_us(),
                    node=self.settings.node_id,
                    tenant=OPERATOR_TENANT,
                    client_id="",
                    origin="journal",
                    event="journal_error",
                    details=details,
                )
                self.journal.append(
                    self.wall_clock_us(), OPERATOR_TENANT, EDGE_CLIENT_ID, topic, 0, False,
                    payload, None, (),
                )  # fmt: skip
            else:
                self.log(OPERATOR_TENANT, "journal_error", "", details, origin="journal")
        elif status.state == "full" and previous.state != "full":
            details["reason"] = status.full
            self.log(OPERATOR_TENANT, "journal_full", "", details, origin="journal")
        elif status.state == "ok" and previous.state != "ok":
            self.log(OPERATOR_TENANT, "journal_resumed", "", details, origin="journal")
        self.on_journal_status(status)
        self.flush_dirty()

    def _route(
        self,
        matches: list[tuple[TrieKey, TrieValue]],
        message: Message,
        publisher: Connection | None,
    ) -> None:
        sessions = self.sessions
        tenant = message.tenant
        if len(matches) == 1 and type(matches[0][1]) is Subscription:
            # The common case: one plain subscription, no overlap to resolve.
            client_id, sub = matches[0]
            assert isinstance(client_id, str)
            assert isinstance(sub, Subscription)
            session = sessions.get((tenant, client_id))
            if session is not None:
                self._to_session(session, message, sub, publisher, ())
            return
        # Overlapping subscriptions of one client: one delivery at the highest QoS
        # [MQTT-3.3.5-1], carrying every matching subscription identifier [MQTT-3.3.4-3].
        # Each shared group picks one member [MQTT-4.8.2-?].
        best: dict[str, Subscription] = {}
        ids: dict[str, list[int]] = {}
        for key, value in matches:
            if type(value) is SharedGroup:
                picked = value.pick(sessions, tenant)
                if picked is None:
                    continue
                client_id = picked
                sub = value.members[picked]
            else:
                assert isinstance(key, str)
                assert isinstance(value, Subscription)
                client_id, sub = key, value
            have = best.get(client_id)
            if have is None or sub.qos > have.qos:
                best[client_id] = sub
            session = sessions.get((tenant, client_id))
            if session is not None and session.subscription_ids:
                sub_id = session.subscription_ids.get(sub.topic_filter)
                if sub_id is not None:
                    ids.setdefault(client_id, []).append(sub_id)
        for client_id, sub in best.items():
            session = sessions.get((tenant, client_id))
            if session is not None:
                self._to_session(session, message, sub, publisher, tuple(ids.get(client_id, ())))

    def _to_session(
        self,
        session: Session,
        message: Message,
        sub: Subscription,
        publisher: Connection | None,
        sub_ids: tuple[int, ...],
    ) -> None:
        if sub.no_local and publisher is not None and session.client_id == publisher.client_id:
            return  # [MQTT-3.8.3-3]
        if not sub_ids and session.subscription_ids:
            sub_id = session.subscription_ids.get(sub.topic_filter)
            if sub_id is not None:
                sub_ids = (sub_id,)
        message_qos = message.qos
        qos = message_qos if message_qos < sub.qos else sub.qos
        # Routed copies carry RETAIN 0 unless retain-as-published [MQTT-3.3.1-9, 3.3.1-12].
        retain = message.retain and sub.retain_as_published
        conn = session.connection
        if qos == 0 and conn is not None and not conn.write_paused and not sub_ids:
            self._send_qos0(conn, message, retain)  # the hot path, straight out
        else:
            self._deliver(session, message, QoS(qos), retain, sub_ids)

    def _deliver(
        self,
        session: Session,
        message: Message,
        qos: QoS,
        retain: bool,
        sub_ids: tuple[int, ...] = (),
    ) -> None:
        conn = session.connection
        if conn is None:
            if qos > QoS.AT_MOST_ONCE and not self._enqueue(session, message, qos, retain, sub_ids):
                self.stats.dropped += 1
            return
        if conn.write_paused or (qos > QoS.AT_MOST_ONCE and not session.window_open()):
            if not self._enqueue(session, message, qos, retain, sub_ids):
                self.stats.dropped += 1
            return
        self._send(conn, session, message, qos, retain, sub_ids)

    def _enqueue(
        self,
        session: Session,
        message: Message,
        qos: QoS,
        retain: bool,
        sub_ids: tuple[int, ...],
    ) -> bool:
        ok = session.enqueue(Pending(message, qos, retain, sub_ids))
        if not ok and (session.dropped in {1, 10, 100, 1000} or session.dropped % 10_000 == 0):
            self.log(
                session.tenant,
                "queue_overflow",
                session.client_id,
                {
                    "max_queued_messages": session.max_queued,
                    "max_queued_bytes": session.max_queued_bytes,
                    "dropped": session.dropped,
                },
            )
            log.warning(
                "queue of %s/%s full (%d messages / %d bytes): dropped %d message(s) so far",
                session.tenant,
                printable(session.client_id),
                session.max_queued,
                session.max_queued_bytes,
                session.dropped,
            )
        return ok

    def _send_qos0(self, conn: Connection, message: Message, retain: bool) -> None:
        if conn.alias_out_max or conn.max_packet_out:
            self._send(conn, None, message, _QOS0, retain, ())
            return
        stats = self.stats
        size = len(message.payload)
        stats.messages_out += 1
        stats.bytes_out += size
        usage = conn.usage
        usage.messages_out += 1
        usage.bytes_out += size
        key = conn.version * 2 + retain
        encoded = message.encoded
        if encoded is None:
            encoded = message.encoded = {}
        data = encoded.get(key)
        if data is None:
            if conn.version == _V5:
                data = self._encode(conn, message, _QOS0, retain, None)
                assert data is not None
            else:  # 3.1.1 has no properties to adjust: straight to the codec
                data = encode_publish(
                    message.topic, message.payload, 0, retain, False, None, conn.version
                )
            encoded[key] = data
        conn.emit(data)

    def _send(
        self,
        conn: Connection,
        session: Session | None,
        message: Message,
        qos: QoS,
        retain: bool,
        sub_ids: tuple[int, ...],
    ) -> None:
        pid = None
        if qos > QoS.AT_MOST_ONCE:
            assert session is not None
            pid = session.next_packet_id()
            assert pid is not None  # the window is far below 65535
        data = self._encode(conn, message, qos, retain, pid, sub_ids=sub_ids)
        if data is None:
            return  # over the client's maximum packet size: dropped [MQTT-3.1.2-25]
        size = len(message.payload)
        self.stats.messages_out += 1
        self.stats.bytes_out += size
        conn.usage.messages_out += 1
        conn.usage.bytes_out += size
        if pid is not None:
            assert session is not None
            state = OutState.AWAIT_PUBACK if qos == QoS.AT_LEAST_ONCE else OutState.AWAIT_PUBREC
            session.inflight[pid] = Outbound(message, qos, retain, state, sub_ids)
        conn.emit(data)

    def _encode(
        self,
        conn: Connection,
        message: Message,
        qos: QoS,
        retain: bool,
        packet_id: int | None,
        *,
        dup: bool = False,
        sub_ids: tuple[int, ...] = (),
    ) -> bytes | None:
        """The PUBLISH for this client, or None when it exceeds the client's maximum packet
        size (the message is then dropped for this client [MQTT-3.1.2-25])."""
        topic: str = message.topic
        props: Properties | None = None
        if conn.version == _V5:
            base = message.properties
            changes: dict[str, object] = {}
            expiry = base.message_expiry_interval
            if expiry is not None:
                # Forward the time left, not the time given [MQTT-3.3.2-6].
                waited = (self.wall_clock_us() - message.ts_us) // 1_000_000
                if waited > 0:
                    changes["message_expiry_interval"] = max(expiry - waited, 1)
            if sub_ids:
                changes["subscription_identifiers"] = sub_ids
            if conn.alias_out_max:
                alias, known = conn.outgoing_alias(topic)
                if alias:
                    changes["topic_alias"] = alias
                    if known:
                        topic = ""  # the alias alone names the topic [MQTT-3.3.2-12]
            if changes:
                base = dataclasses.replace(base, **changes)  # type: ignore[arg-type]
            if base is not NO_PROPERTIES:
                props = base
        data = encode_publish(
            topic, message.payload, int(qos), retain, dup, packet_id, conn.version, props
        )
        if conn.max_packet_out and len(data) > conn.max_packet_out:
            log.info(
                "%d-byte PUBLISH over %s's maximum packet size %d: not sent",
                len(data),
                printable(conn.client_id),
                conn.max_packet_out,
            )
            self.stats.dropped += 1
            return None
        return data

    def _drain_queue(self, session: Session) -> None:
        conn = session.connection
        queue = session.queue
        now_us = self.wall_clock_us()
        while queue and conn is not None and not conn.write_paused:
            head = queue[0]
            if head.qos > QoS.AT_MOST_ONCE and not session.window_open():
                return
            session.pop()
            expiry = head.message.properties.message_expiry_interval
            if expiry is not None and now_us - head.message.ts_us >= expiry * 1_000_000:
                continue  # expired while waiting: never delivered [MQTT-3.3.2-5]
            self._send(conn, session, head.message, head.qos, head.retain, head.subscription_ids)

    def delivery_acked(
        self, conn: Connection, packet_id: int, kind: type[Puback | Pubrec | Pubcomp]
    ) -> bool:
        """A subscriber acknowledged a delivery; False if no such delivery was in flight."""
        session = conn.session
        assert session is not None
        out = session.inflight.get(packet_id)
        if out is None:
            return False
        if kind is Pubrec:
            if out.state is not OutState.AWAIT_PUBREC:
                return out.state is OutState.AWAIT_PUBCOMP  # a repeated PUBREC: PUBREL again
            out.state = OutState.AWAIT_PUBCOMP
            return True
        expected = OutState.AWAIT_PUBACK if kind is Puback else OutState.AWAIT_PUBCOMP
        if out.state is not expected:
            return False
        del session.inflight[packet_id]
        self._drain_queue(session)
        return True

    def writing_resumed(self, conn: Connection) -> None:
        if conn.session is not None:
            self._drain_queue(conn.session)

    # -- subscribe -----------------------------------------------------------------------------

    def subscribe(
        self,
        conn: Connection,
        subscriptions: Iterable[tuple[str | None, str, Subscription]],
        subscription_id: int | None = None,
    ) -> None:
        """Add (group, filter, options) subscriptions; group is set for ``$share/...``."""
        session = conn.session
        assert session is not None
        ns = self.namespace(conn.tenant)
        if not session.clean:
            self.state_changed = True
        for group, topic_filter, sub in subscriptions:
            full = sub.topic_filter
            is_new = full not in session.subscriptions
            session.subscriptions[full] = sub
            if subscription_id is not None:
                session.set_subscription_id(full, subscription_id)
            else:
                session.set_subscription_id(full, None)
            if not session.clean:  # its SUBACK waits until this is durable
                self._log_session_change(
                    session, "sub", conn, sub=subscription_doc(full, sub), id=subscription_id
                )
            if group is not None:
                shared = ns.shared.get((group, topic_filter))
                if shared is None:
                    shared = ns.shared[(group, topic_filter)] = SharedGroup()
                    ns.subscriptions.add(topic_filter, ("$share", group), shared)
                shared.members[conn.client_id] = sub
                continue  # no retained messages for a shared subscription [MQTT-4.8.2-?]
            ns.subscriptions.add(topic_filter, conn.client_id, sub)
            if sub.retain_handling == RetainHandling.DO_NOT_SEND or (
                sub.retain_handling == RetainHandling.SEND_IF_NEW_SUBSCRIPTION and not is_new
            ):
                continue
            sub_ids = (subscription_id,) if subscription_id is not None else ()
            now_us = self.wall_clock_us()
            for message in ns.retained.matching(topic_filter):
                expiry = message.properties.message_expiry_interval
                if expiry is not None and now_us - message.ts_us >= expiry * 1_000_000:
                    ns.retained.remove(message.topic)  # expired retained message [MQTT-3.3.2-5]
                    continue
                # Retained messages go out with RETAIN 1 [MQTT-3.3.1-8].
                qos = message.qos if message.qos < sub.qos else sub.qos
                self._deliver(session, message, QoS(qos), True, sub_ids)

    def unsubscribe(self, conn: Connection, topic_filters: Iterable[str]) -> list[bool]:
        session = conn.session
        assert session is not None
        ns = self.namespace(conn.tenant)
        if not session.clean:
            self.state_changed = True
        found = []
        for topic_filter in topic_filters:
            had = session.subscriptions.pop(topic_filter, None) is not None
            session.set_subscription_id(topic_filter, None)
            if had:
                self._remove_subscription(ns, conn.client_id, topic_filter)
                if not session.clean:
                    self._log_session_change(session, "unsub", conn, f=topic_filter)
            found.append(had)
        return found

    def _remove_subscription(self, ns: Namespace, client_id: str, full_filter: str) -> None:
        group, topic_filter = parse_subscription_filter(full_filter)
        if group is None:
            ns.subscriptions.remove(topic_filter, client_id)
            return
        shared = ns.shared.get((group, topic_filter))
        if shared is not None:
            shared.members.pop(client_id, None)
            if not shared.members:
                del ns.shared[(group, topic_filter)]
                ns.subscriptions.remove(topic_filter, ("$share", group))

    # -- persistence (see broker_edge.store) ------------------------------------------------

    def persistent_sessions(self) -> list[Session]:
        return [s for s in self.sessions.values() if not s.clean]

    def retained_messages(self) -> list[Message]:
        return [m for ns in self.namespaces.values() for m in ns.retained.all()]

    def restore(self, sessions: Iterable[Session], retained: Iterable[Message]) -> None:
        """Install sessions and retained messages read from a snapshot (before serving)."""
        for session in sessions:
            session.max_queued_bytes = self.settings.max_queued_bytes  # not in the snapshot
            self._add_session(session, (session.tenant, session.client_id))
            for full, sub in session.subscriptions.items():
                self._install_subscription(session, full, sub)
        for message in retained:
            self.namespace(message.tenant).retained.set(message)
            self.control(
                self.tenancy.control_message(message.tenant, message.topic, message.payload)
            )

    def _install_subscription(self, session: Session, full: str, sub: Subscription) -> None:
        """Put a restored subscription into its namespace's trie (no retained messages)."""
        ns = self.namespace(session.tenant)
        group, topic_filter = parse_subscription_filter(full)
        if group is None:
            ns.subscriptions.add(topic_filter, session.client_id, sub)
            return
        shared = ns.shared.get((group, topic_filter))
        if shared is None:
            shared = ns.shared[(group, topic_filter)] = SharedGroup()
            ns.subscriptions.add(topic_filter, ("$share", group), shared)
        shared.members[session.client_id] = sub

    def replay(self, message: Message) -> None:
        """Re-apply a journal record written after the snapshot: retain it, queue it for the
        (offline) persistent sessions it matches. Not journaled again, not counted."""
        ns = self.namespace(message.tenant)
        if message.retain:
            ns.retained.set(message)
        self.control(self.tenancy.control_message(message.tenant, message.topic, message.payload))
        matches = ns.subscriptions.match(message.topic)
        if matches:
            self._route(matches, message, None)

    # -- housekeeping --------------------------------------------------------------------------

    # -- time: everything that happens when nothing is received --------------------------------

    def tick(self, now: float) -> float:
        """Do what is due at ``now`` and return when the clock is next needed: delayed wills
        and rate-limited publishers exactly when due; keepalives, CONNECT timeouts and
        session expiry on a scan of every connection and session every ``SCAN_INTERVAL``.
        Nothing here reads a clock or sets a timer: the caller (the node, or a test with a
        fake clock) calls it at or after the time it returned, or earlier through wake_at."""
        if now >= self._next_scan:
            self.check_keepalives(now)
            self.expire_sessions(now)
            self._next_scan = now + SCAN_INTERVAL
        self.publish_due_wills(now)
        due = self._next_scan
        if self.rate_paused:
            for conn in list(self.rate_paused):
                if conn.state is ConnState.CLOSED:
                    self.rate_paused.discard(conn)
                elif conn.resume_at <= now:
                    self.rate_paused.discard(conn)
                    conn.resume(PAUSED_BY_RATE)
                else:
                    due = min(due, conn.resume_at)
        for will_due, _ in self.pending_wills.values():
            due = min(due, will_due)
        return due

    def publish_due_wills(self, now: float) -> None:
        for key, (due, will) in list(self.pending_wills.items()):
            if due <= now:
                del self.pending_wills[key]
                self._publish_will(key[0], key[1], will)
        self.flush_dirty()

    def after_commit(self) -> None:
        """A journal commit finished: send the acks it released, resume paused publishers."""
        self.flush_dirty()
        if self.paused_readers and self.journal.backlog <= self.settings.max_journal_backlog // 2:
            paused, self.paused_readers = self.paused_readers, set()
            for conn in paused:
                conn.resume(PAUSED_BY_JOURNAL)

    def check_keepalives(self, now: float) -> None:
        """Close connections silent for 1.5 x their keepalive [MQTT-3.1.2-24], and those that
        did not complete CONNECT within ``connect_timeout``."""
        limit = self.settings.connect_timeout
        for conn in list(self.awaiting_connect):
            if conn.state is not ConnState.AWAIT_CONNECT:
                self.awaiting_connect.discard(conn)
            elif now - conn.connected_at > limit:
                log.info("no CONNECT from %s within %.0f s: closing", conn.peer, limit)
                self.awaiting_connect.discard(conn)
                conn.close(None)
        for conn in list(self.connections.values()):
            if conn.keepalive and now - conn.last_rx > 1.5 * conn.keepalive:
                log.info("keepalive timeout: %s (%s)", printable(conn.client_id), conn.peer)
                conn.close(0x8D)
        self.flush_dirty()

    def expire_sessions(self, now: float) -> None:
        """Drop disconnected sessions whose expiry interval has passed (MQTT 5)."""
        for session in list(self.sessions.values()):
            at = session.disconnected_at
            if (
                at is not None
                and session.expiry_interval != SESSION_NEVER_EXPIRES
                and now - at >= session.expiry_interval
            ):
                self.stats.sessions_expired += 1
                self._drop_session(session)

    def publish_system(self, topic: str, payload: bytes) -> None:
        """Retain and route one broker-made ``$SYS`` message (QoS 0) without the journal: it is
        derived state, regenerated every interval (see ``broker_edge.sysstats``).

        Node statistics cover every tenant, so no tenant sees them: with a tenants file they
        live in the operator's namespace; without one, in the anonymous tenant's (the only one,
        as on any single-tenant broker). A tenants file cannot name a tenant ``default``."""
        owner = OPERATOR_TENANT if self.tenancy.config is not None else DEFAULT_TENANT
        ns = self.namespace(owner)
        message = Message(owner, topic, payload, QoS.AT_MOST_ONCE, True, "", self.wall_clock_us())
        ns.retained.set(message)
        matches = ns.subscriptions.match(topic)
        if matches:
            self._route(matches, message, None)

    def log_malformed(self, conn: Connection, exc: ProtocolError) -> None:
        log.warning(
            "closing %s (%s): %s (reason 0x%02X)",
            printable(conn.client_id) or "-",
            conn.peer,
            printable(str(exc)),
            int(exc.reason_code),
        )
        self.log(
            conn.tenant or OPERATOR_TENANT,
            "malformed_packet",
            # Before CONNECT completes nobody vouches for the client id: cap what it costs.
            conn.client_id if conn.tenant else truncated(conn.client_id),
            {"peer": conn.peer, "reason_code": int(exc.reason_code), "error": str(exc)[:200]},
        )

    def close_all(self, reason: int) -> None:
        for conn in list(self.connections.values()):
            if conn.state is ConnState.CONNECTED:
                conn.close(reason)
        self.flush_dirty()


def _noop() -> None:
    pass


def _ignore_status(status: JournalStatus) -> None:
    pass


def _no_time() -> float:
    return 0.0  # without a loop's clock no turn is ever too long


def _never(at: float) -> None:
    del at
