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
from typing import Protocol

from broker_edge.codec import encode_publish
from broker_edge.connection import Connection, ConnState
from broker_edge.errors import ProtocolError
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
    RetainHandling,
    Subscription,
)
from broker_edge.retained import RetainedStore
from broker_edge.session import Outbound, OutState, Pending, Session
from broker_edge.settings import EdgeSettings
from broker_edge.trie import TopicTrie
from schemas.journal import DEFAULT_TENANT

log = logging.getLogger(__name__)

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

    def after_durable(self, seq: int, callback: Callable[[], None]) -> None: ...


@dataclass(slots=True)
class Namespace:
    """One tenant's routing world."""

    subscriptions: TopicTrie[str, Subscription] = field(default_factory=TopicTrie)
    retained: RetainedStore = field(default_factory=RetainedStore)


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


class Broker:
    def __init__(
        self,
        settings: EdgeSettings,
        journal: Journal,
        wall_clock_us: Callable[[], int] = lambda: time.time_ns() // 1000,
    ) -> None:
        self.settings = settings
        self.journal = journal
        self.wall_clock_us = wall_clock_us
        self.namespaces: dict[str, Namespace] = {}
        self.sessions: dict[tuple[str, str], Session] = {}
        self.connections: dict[tuple[str, str], Connection] = {}
        self.dirty: set[Connection] = set()
        self.stats = Stats()
        self.valid_topics: set[str] = set()
        # Set when a persistent session's shape changes (created, subscribed, dropped): the node
        # then snapshots soon, so a crash cannot forget a subscription for long.
        self.state_changed = False

    # -- plumbing ------------------------------------------------------------------------------

    def namespace(self, tenant: str) -> Namespace:
        ns = self.namespaces.get(tenant)
        if ns is None:
            ns = self.namespaces[tenant] = Namespace()
        return ns

    def flush_dirty(self) -> None:
        """Write every connection's pending output: one transport write per connection."""
        while self.dirty:
            dirty = self.dirty
            self.dirty = set()
            for conn in dirty:
                self.stats.packets_out += len(conn.out)  # one emit() per packet
                conn.flush()

    # -- connect / disconnect --------------------------------------------------------------------

    def authenticate(self, conn: Connection, packet: Connect) -> int | None:
        """Bind the connection to a tenant; a reason code refuses it. One anonymous tenant
        for now (the embedded default)."""
        conn.tenant = DEFAULT_TENANT
        return None

    def open_session(self, conn: Connection, packet: Connect, now: float) -> tuple[Session, bool]:
        key = (conn.tenant, conn.client_id)
        previous = self.connections.get(key)
        if previous is not None and previous is not conn:
            # Client takeover [MQTT-3.1.4-3]: the older connection is closed.
            log.info("client %s taken over from %s", conn.client_id, previous.peer)
            previous.close(0x8E)
            self._detach(previous, now)
        if conn.version == ProtocolVersion.MQTT_5:
            expiry = packet.properties.session_expiry_interval or 0
        else:
            expiry = 0 if packet.clean_start else SESSION_NEVER_EXPIRES
        session = self.sessions.get(key)
        present = session is not None and not packet.clean_start
        if session is not None and packet.clean_start:
            self._drop_session(session)
            session = None
        if session is None:
            session = Session(
                client_id=conn.client_id,
                tenant=conn.tenant,
                clean=packet.clean_start,
                max_queued=self.settings.max_queued_messages,
                max_inflight=self.settings.max_inflight_messages,
            )
            self.sessions[key] = session
        session.expiry_interval = expiry
        session.clean = expiry == 0
        if not session.clean:
            self.state_changed = True
        session.connection = conn
        session.disconnected_at = None
        self.connections[key] = conn
        return session, present

    def session_resumed(self, conn: Connection, session: Session) -> None:
        """Redeliver the in-flight window with DUP set, then what waited in the queue
        [MQTT-4.4.0-1]."""
        for pid, out in session.inflight.items():
            if out.state is OutState.AWAIT_PUBCOMP:
                conn.send(Pubrel(packet_id=pid))
            else:
                conn.emit(self._encode(conn, out.message, out.qos, out.retain, pid, dup=True))
        self._drain_queue(session)

    def connection_lost(self, conn: Connection, now: float) -> None:
        if conn.session is None:
            return
        will = conn.will
        self._detach(conn, now)
        if will is not None and not conn.clean_disconnect:
            # The network connection closed without DISCONNECT: publish the will [MQTT-3.1.2-8].
            conn.will = None
            self._publish_will(conn, will)

    def _detach(self, conn: Connection, now: float) -> None:
        session = conn.session
        if session is None:
            return
        key = (conn.tenant, conn.client_id)
        if self.connections.get(key) is conn:
            del self.connections[key]
        if session.connection is conn:
            session.connection = None
            session.disconnected_at = now
            if session.expiry_interval == 0:
                self._drop_session(session)

    def _drop_session(self, session: Session) -> None:
        if not session.clean:
            self.state_changed = True
        ns = self.namespace(session.tenant)
        for topic_filter in session.subscriptions:
            ns.subscriptions.remove(topic_filter, session.client_id)
        session.subscriptions.clear()
        session.inflight.clear()
        session.queue.clear()
        key = (session.tenant, session.client_id)
        if self.sessions.get(key) is session:
            del self.sessions[key]

    def _publish_will(self, conn: Connection, will: Publish) -> None:
        try:
            self._accept(conn.tenant, conn.client_id, will, publisher=None)
        except ProtocolError as exc:
            log.warning("will of %s not published: %s", conn.client_id, exc)

    # -- publish ---------------------------------------------------------------------------------

    def accept_publish(self, conn: Connection, packet: Publish, now: float) -> int:
        """Journal, retain and route one inbound publish; returns its journal seq."""
        stats = self.stats
        stats.messages_in += 1
        stats.bytes_in += len(packet.payload)
        return self._accept(conn.tenant, conn.client_id, packet, conn)

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
        matches = ns.subscriptions.match(topic)
        if matches:
            self._route(matches, message, publisher)
        return seq

    def after_durable(self, seq: int, conn: Connection, packet_id: int, qos: QoS) -> None:
        self.journal.after_durable(seq, lambda: conn.ack_durable(packet_id, qos))

    def _route(
        self,
        matches: list[tuple[str, Subscription]],
        message: Message,
        publisher: Connection | None,
    ) -> None:
        if len(matches) > 1:
            # Overlapping subscriptions of one client: deliver once, at the highest QoS
            # [MQTT-3.3.5-1].
            best: dict[str, Subscription] = {}
            for client_id, sub in matches:
                have = best.get(client_id)
                if have is None or sub.qos > have.qos:
                    best[client_id] = sub
            matches = list(best.items())
        sessions = self.sessions
        tenant = message.tenant
        message_qos = message.qos
        message_retain = message.retain
        for client_id, sub in matches:
            if sub.no_local and publisher is not None and client_id == publisher.client_id:
                continue  # [MQTT-3.8.3-3]
            session = sessions.get((tenant, client_id))
            if session is None:
                continue
            qos = message_qos if message_qos < sub.qos else sub.qos
            # Routed copies carry RETAIN 0 unless retain-as-published [MQTT-3.3.1-9, 3.3.1-12].
            retain = message_retain and sub.retain_as_published
            conn = session.connection
            if qos == 0 and conn is not None and not conn.write_paused:
                self._send_qos0(conn, message, retain)  # the common case, straight out
            else:
                self._deliver(session, message, QoS(qos), retain)

    def _deliver(self, session: Session, message: Message, qos: QoS, retain: bool) -> None:
        conn = session.connection
        if conn is None:
            if qos > QoS.AT_MOST_ONCE and not self._enqueue(session, message, qos, retain):
                self.stats.dropped += 1
            return
        if conn.write_paused or (qos > QoS.AT_MOST_ONCE and not session.window_open()):
            if not self._enqueue(session, message, qos, retain):
                self.stats.dropped += 1
            return
        self._send(conn, session, message, qos, retain)

    def _enqueue(self, session: Session, message: Message, qos: QoS, retain: bool) -> bool:
        ok = session.enqueue(Pending(message, qos, retain))
        if not ok and (session.dropped in {1, 10, 100, 1000} or session.dropped % 10_000 == 0):
            log.warning(
                "queue of %s/%s full (%d): dropped %d message(s) so far",
                session.tenant,
                session.client_id,
                session.max_queued,
                session.dropped,
            )
        return ok

    def _send_qos0(self, conn: Connection, message: Message, retain: bool) -> None:
        stats = self.stats
        stats.messages_out += 1
        stats.bytes_out += len(message.payload)
        key = conn.version * 2 + retain
        encoded = message.encoded
        if encoded is None:
            encoded = message.encoded = {}
        data = encoded.get(key)
        if data is None:
            data = encoded[key] = self._encode(conn, message, QoS.AT_MOST_ONCE, retain, None)
        conn.emit(data)

    def _send(
        self, conn: Connection, session: Session, message: Message, qos: QoS, retain: bool
    ) -> None:
        if qos == QoS.AT_MOST_ONCE:
            self._send_qos0(conn, message, retain)
            return
        self.stats.messages_out += 1
        self.stats.bytes_out += len(message.payload)
        pid = session.next_packet_id()
        assert pid is not None  # the window is far below 65535
        state = OutState.AWAIT_PUBACK if qos == QoS.AT_LEAST_ONCE else OutState.AWAIT_PUBREC
        session.inflight[pid] = Outbound(message, qos, retain, state)
        conn.emit(self._encode(conn, message, qos, retain, pid))

    @staticmethod
    def _encode(
        conn: Connection,
        message: Message,
        qos: QoS,
        retain: bool,
        packet_id: int | None,
        *,
        dup: bool = False,
    ) -> bytes:
        props: Properties | None = None
        if conn.version == ProtocolVersion.MQTT_5 and message.properties is not NO_PROPERTIES:
            props = message.properties
        return encode_publish(
            message.topic,
            message.payload,
            int(qos),
            retain,
            dup,
            packet_id,
            conn.version,
            props,
        )

    def _drain_queue(self, session: Session) -> None:
        conn = session.connection
        queue = session.queue
        while queue and conn is not None and not conn.write_paused:
            head = queue[0]
            if head.qos > QoS.AT_MOST_ONCE and not session.window_open():
                return
            queue.popleft()
            self._send(conn, session, head.message, head.qos, head.retain)

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

    def subscribe(self, conn: Connection, subscriptions: Iterable[Subscription]) -> None:
        session = conn.session
        assert session is not None
        ns = self.namespace(conn.tenant)
        if not session.clean:
            self.state_changed = True
        for sub in subscriptions:
            is_new = ns.subscriptions.add(sub.topic_filter, conn.client_id, sub)
            session.subscriptions[sub.topic_filter] = sub
            if sub.retain_handling == RetainHandling.DO_NOT_SEND or (
                sub.retain_handling == RetainHandling.SEND_IF_NEW_SUBSCRIPTION and not is_new
            ):
                continue
            for message in ns.retained.matching(sub.topic_filter):
                # Retained messages go out with RETAIN 1 [MQTT-3.3.1-8].
                qos = message.qos if message.qos < sub.qos else sub.qos
                self._deliver(session, message, QoS(qos), True)

    def unsubscribe(self, conn: Connection, topic_filters: Iterable[str]) -> list[bool]:
        session = conn.session
        assert session is not None
        ns = self.namespace(conn.tenant)
        if not session.clean:
            self.state_changed = True
        found = []
        for topic_filter in topic_filters:
            session.subscriptions.pop(topic_filter, None)
            found.append(ns.subscriptions.remove(topic_filter, conn.client_id))
        return found

    # -- persistence (see broker_edge.store) ------------------------------------------------

    def persistent_sessions(self) -> list[Session]:
        return [s for s in self.sessions.values() if not s.clean]

    def retained_messages(self) -> list[Message]:
        return [m for ns in self.namespaces.values() for m in ns.retained.all()]

    def restore(self, sessions: Iterable[Session], retained: Iterable[Message]) -> None:
        """Install sessions and retained messages read from a snapshot (before serving)."""
        for session in sessions:
            self.sessions[(session.tenant, session.client_id)] = session
            ns = self.namespace(session.tenant)
            for topic_filter, sub in session.subscriptions.items():
                ns.subscriptions.add(topic_filter, session.client_id, sub)
        for message in retained:
            self.namespace(message.tenant).retained.set(message)

    def replay(self, message: Message) -> None:
        """Re-apply a journal record written after the snapshot: retain it, queue it for the
        (offline) persistent sessions it matches. Not journaled again, not counted."""
        ns = self.namespace(message.tenant)
        if message.retain:
            ns.retained.set(message)
        matches = ns.subscriptions.match(message.topic)
        if matches:
            self._route(matches, message, None)

    # -- housekeeping --------------------------------------------------------------------------

    def check_keepalives(self, now: float) -> None:
        """Close connections silent for 1.5 x their keepalive [MQTT-3.1.2-24]."""
        for conn in list(self.connections.values()):
            if conn.keepalive and now - conn.last_rx > 1.5 * conn.keepalive:
                log.info("keepalive timeout: %s (%s)", conn.client_id, conn.peer)
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
                self._drop_session(session)

    def publish_system(self, topic: str, payload: bytes) -> None:
        """Retain and route one broker-made ``$SYS`` message (QoS 0) without the journal: it is
        derived state, regenerated every interval (see ``broker_edge.sysstats``). Default
        tenant's namespace until tenants decide who sees node statistics."""
        ns = self.namespace(DEFAULT_TENANT)
        message = Message(
            DEFAULT_TENANT, topic, payload, QoS.AT_MOST_ONCE, True, "", self.wall_clock_us()
        )
        ns.retained.set(message)
        matches = ns.subscriptions.match(topic)
        if matches:
            self._route(matches, message, None)

    def log_malformed(self, conn: Connection, exc: ProtocolError) -> None:
        log.warning(
            "closing %s (%s): %s (reason 0x%02X)",
            conn.client_id or "-",
            conn.peer,
            exc,
            int(exc.reason_code),
        )

    def log_denied_publish(self, conn: Connection, topic: str) -> None:
        log.info("publish to reserved topic %r by %s refused", topic, conn.client_id)

    def close_all(self, reason: int) -> None:
        for conn in list(self.connections.values()):
            if conn.state is ConnState.CONNECTED:
                conn.close(reason)
        self.flush_dirty()
