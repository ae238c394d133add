"""The node's coordinator: connections, router, policy, journal and time, wired together.

Theory of operation
-------------------
Each client is a sans-IO :class:`~broker_edge.connection.Connection` (bytes in, events out).
:meth:`Broker.receive` feeds a read to the machine and hands each event to its handler
(:mod:`broker_edge.handlers`); the :class:`~broker_edge.router.Router` (sessions, tries,
retained, shared groups) answers publishes and subscribes with deliveries, which the broker
turns into bytes through each subscriber's machine; :class:`~broker_edge.tenancy.Tenancy`
answers with decisions and log events. The listener writes each connection's bytes once per
turn (:meth:`flush_dirty`) through the transport it registered.

Delivery to subscribers does not wait for the journal: only the *acknowledgement* to the
publisher does (so subscribers see the lowest latency, and a crash can at worst lose a message
that was never acknowledged, which the publisher resends).

Runs: the publishes to one topic that follow each other in a read (QoS 0 or 1, no DUP, RETAIN
or properties) are taken after the first as one (:meth:`accept_run`: one journal append, one
routing, one write per subscriber), when nothing about the client or the broker looks at each
publish (handlers._publish_run says what does). What anyone sees is what one at a time gives.

Time comes in from outside: :meth:`tick` does what is due and returns when it next needs the
clock; ``wake_at`` asks the node for an earlier tick.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Container, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from broker_edge import receipts, sessionlog
from broker_edge.connection import (
    PAUSED_BY_BACKLOG,
    PAUSED_BY_CLAIM,
    PAUSED_BY_JOURNAL,
    PAUSED_BY_RATE,
    PAUSED_BY_ROUTING,
    Connection,
    ConnectionIO,
    ConnLimits,
    ConnState,
    TopicCache,
)
from broker_edge.durability import JournalStatus
from broker_edge.errors import ProtocolError
from broker_edge.handlers import HANDLERS
from broker_edge.handover import Claim
from broker_edge.logtext import printable, truncated
from broker_edge.meshgroups import Share
from broker_edge.message import Message
from broker_edge.outbox import Outbox
from broker_edge.packets import (
    NO_PROPERTIES,
    Connect,
    ProtocolVersion,
    Publish,
    QoS,
    ReasonCode,
    Subscription,
)
from broker_edge.plim import connect_details, disconnect_details, log_event
from broker_edge.router import (
    SESSION_NEVER_EXPIRES,
    Delivery,
    Namespace,
    Router,
    SessionBounds,
)
from broker_edge.session import NO_CLAIM, Outbound, Session
from broker_edge.sessionlog import SessionLog, SessionLogError
from broker_edge.sessionmoves import SessionMoves
from broker_edge.settings import EdgeSettings
from broker_edge.store import subscription_doc, subscription_from
from broker_edge.sysstats import Stats
from broker_edge.tenancy import (
    EDGE_CLIENT_ID,
    NOTHING,
    Admission,
    ControlOutcome,
    LogEvent,
    Tenancy,
)
from broker_edge.tenants import OPERATOR_TENANT, TenantsConfig
from schemas.names import DEFAULT_TENANT
from schemas.topics import JOURNAL_CONTROL_TOPIC_PREFIX

log = logging.getLogger(__name__)

__all__ = ["SCAN_INTERVAL", "SESSION_NEVER_EXPIRES", "Broker", "Journal", "Stats"]

# Aliases for the per-message path: reading an enum member through its class costs ~70 ns on
# Python 3.11 (see connection.py).
_QOS0 = QoS.AT_MOST_ONCE
_CLOSED = ConnState.CLOSED
_V5 = ProtocolVersion.MQTT_5

# How often tick() scans every connection (keepalive, CONNECT timeout) and every session
# (expiry): their deadlines are met within this.
SCAN_INTERVAL = 1.0


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

    def append_run(
        self,
        ts_us: int,
        tenant: str,
        client_id: str,
        topic: str,
        qos: int,
        payloads: list[bytes],
        /,
    ) -> int:
        """Append records without RETAIN, content type or user properties, one per payload;
        returns the first one's seq (the others follow it)."""
        ...

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

    @property
    def durable_seq(self) -> int:
        """Every record up to this seq is durable."""
        ...

    # What the lake has committed of this journal (retention deletes up to it).
    lake_committed_seq: int
    # Per mesh peer, what it acknowledged (retention keeps what follows: broker_edge.mesh).
    peer_acked: dict[str, int]


class MeshPort(Protocol):
    """What the broker needs of the edge mesh (broker_edge.meshlink.Mesh)."""

    def forward(self, message: Message) -> Container[Share] | None:
        """A publish accepted here: to the peers that want it, and to the peers its shared
        groups' messages are given to; returns the shares that get it here (None: every
        one)."""
        ...

    def sys_values(self) -> tuple[tuple[str, str], ...]:
        """``$SYS/broker/mesh/...`` values: (topic under mesh/, text)."""
        ...

    def claim(self, claim: Claim, done: Callable[[bool, bool], None]) -> bool:
        """Tell the peers a CONNECT claims its client id; True when ``done(moved, stale)`` is
        called once they answered (see broker_edge.handover), False when nobody is waited
        for."""
        ...


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
        self.node_id = settings.node_id  # the origin of what is accepted here
        self.journal = journal
        self.wall_clock_us = wall_clock_us
        self.limits = ConnLimits.of(settings)
        self.topics = TopicCache()  # topic names validated lately, shared by connections
        self.router = Router(
            SessionBounds(
                settings.max_queued_messages,
                settings.max_inflight_messages,
                settings.max_queued_bytes,
            )
        )
        # Set by the node to its event loop's clock: a connection ends a turn that ran too long.
        self.clock: Callable[[], float] = _no_time
        # Set by the node: call tick() at this loop time at the latest (one timer for every
        # deadline of every connection; see tick).
        self.wake_at: Callable[[float], None] = _never
        # Publishers paused for their rate until their resume_at (see tick).
        self.rate_paused: set[Connection] = set()
        self._next_scan = 0.0  # when tick next scans every connection and session
        self.connections: dict[tuple[str, str], Connection] = {}
        self.session_of: dict[Connection, Session] = {}  # the session of each connected client
        self.stats = Stats()
        self.outbox = Outbox(self.stats, wall_clock_us, self._queue_overflow)
        # Write every connection's pending output (Outbox.flush; bound once: it runs after
        # every read and every journal commit).
        self.flush_dirty: Callable[[], None] = self.outbox.flush
        today = datetime.fromtimestamp(wall_clock_us() / 1e6, UTC).date()
        self.tenancy = Tenancy(tenants, settings.node_id, local_operator_token, today)
        # Live connections per tenant on this node (the tenants' "sessions" gauge).
        self.connected: dict[str, int] = {}
        self._logging = False  # publishing a log event (see log)
        # Set when a persistent session's shape changes (created, subscribed, dropped): the node
        # then snapshots soon, so a crash cannot forget a subscription for long.
        self.state_changed = False
        # Wills waiting for their delay [MQTT-3.1.3-9]: (tenant, client id) -> (due, will).
        self.pending_wills: dict[tuple[str, str], tuple[float, Publish]] = {}
        # Publishers whose reads are paused until the journal catches up.
        self.paused_readers: set[Connection] = set()
        # Connections that have not completed CONNECT yet (closed after connect_timeout).
        self.awaiting_connect: set[Connection] = set()
        # Set by the node: changes to persistent sessions are appended here, and the output of
        # the connections that made them is held until ``sync_sessions`` made them durable.
        self.session_log: SessionLog | None = None
        self.request_session_sync: Callable[[], None] = _noop  # runs sync_sessions soon
        self._session_sync_requested = False
        # The journal's state (journal_status_changed): while journal_refusal is not 0 every
        # client publish is refused with it (QoS 0: dropped and counted in journal_dropped).
        self.journal_status = JournalStatus()
        self.journal_refusal = 0
        # Where the turn under way (receive) ends: its messages_out at which it stops routing.
        self.turn_ends = 0
        self.journal_dropped = 0  # QoS 0 publishes dropped while the journal refused
        self.journal_refused = 0  # QoS 1/2 publishes refused (or their connection closed)
        self.on_journal_status: Callable[[JournalStatus], None] = _ignore_status
        # Set by the node when the edge may have peers (broker_edge.meshlink): publishes
        # accepted here are forwarded to it.
        self.mesh: MeshPort | None = None
        # Sessions that move between the edges of a mesh (broker_edge.handover).
        self.moves = SessionMoves(self)
        # Set by the node: the listener hands it a connection that opened with the link magic
        # (transport, peer, the bytes read); unset, such a connection is closed.
        self.link_acceptor: Callable[[Any, str, bytes], None] | None = None

    # -- what the router owns, for readers (sysstats, node, tests) ------------------------------

    @property
    def sessions(self) -> dict[tuple[str, str], Session]:
        return self.router.sessions

    @property
    def namespaces(self) -> dict[str, Namespace]:
        return self.router.namespaces

    @property
    def session_counts(self) -> dict[str, int]:
        return self.router.session_counts

    def namespace(self, tenant: str) -> Namespace:
        return self.router.namespace(tenant)

    # -- wiring: connections in, bytes out ----------------------------------------------------

    def open_connection(self, peer: str, now: float, io: ConnectionIO) -> Connection:
        """A socket was accepted: its machine, written through ``io``."""
        conn = Connection(peer, now, self.limits, self.topics, io)
        self.stats.sockets_opened += 1
        self.awaiting_connect.add(conn)
        return conn

    def receive(self, conn: Connection, data: bytes, now: float) -> bool:
        """One turn: feed bytes from the socket and handle the events they complete (counted in
        ``packets_in``); raises ProtocolError when the peer broke the protocol. The turn's
        publishes are charged to the client until the journal has them.

        Stops early, returning True, once this call has routed more than
        ``max_deliveries_per_turn`` deliveries (a burst fanned out to many subscribers), or
        handled packets for more than ``max_turn_seconds`` by ``clock``: reading is paused,
        and the caller writes what was routed so far and calls ``receive(conn, b"", now)``
        again for the rest, so subscribers see deliveries flow, and other clients are served,
        instead of waiting for a whole read.
        """
        stats = self.stats
        stats.wire_bytes_in += len(data)
        conn.receive_data(data, now)
        handlers = HANDLERS
        turn_ends = self.turn_ends = stats.messages_out + self.settings.max_deliveries_per_turn
        clock = self.clock
        deadline = now + self.settings.max_turn_seconds
        next_event = conn.next_event
        more = False
        try:
            while (event := next_event()) is not None:
                handlers[type(event)](self, conn, event, now)
                if stats.messages_out > turn_ends or clock() > deadline:
                    more = True
                    break
                if conn.paused_for & PAUSED_BY_CLAIM:
                    break  # its CONNECT waits for the peers: nothing after it yet (connect)
        finally:
            decoder = conn.decoder
            stats.packets_in += decoder.decoded
            decoder.decoded = 0
            if conn.out or conn.closing:
                self.outbox.dirty.add(conn)
            if conn.turn_bytes:
                # Charge this turn's publishes to the client until the journal has them (see
                # Connection.end_turn), and acknowledge its QoS 1/2 publishes then: one waiter
                # per turn, not one per publish; inline: once per read.
                pending = conn.end_turn()
                acks = conn.take_acks()

                def durable() -> None:
                    if acks is not None and conn.acks_durable(acks):
                        self.outbox.dirty.add(conn)
                    if conn.journaled(pending):
                        self.resume(conn, PAUSED_BY_BACKLOG)

                def refused() -> None:
                    if acks is not None:
                        self._refuse_acks(conn, acks)
                    if conn.journaled(pending):
                        self.resume(conn, PAUSED_BY_BACKLOG)

                # Released when durable, or when the journal failed their frame and dropped
                # them (refused): either way they no longer wait. The newest record: the
                # turn's publishes are at or before it (a turn is one client's).
                self.journal.after_durable(self.journal.appended_seq, durable, refused)
                if conn.journal_bytes > self.limits.max_backlog_bytes:
                    self.pause(conn, PAUSED_BY_BACKLOG)
                if self.journal.backlog > self.settings.max_journal_backlog and not (
                    conn.paused_for & PAUSED_BY_JOURNAL
                ):
                    # The journal is behind: stop reading from this publisher until it catches
                    # up, rather than accept what we cannot make durable (checked once a turn:
                    # reading stops after the turn either way).
                    stats.reads_paused += 1
                    self.pause(conn, PAUSED_BY_JOURNAL)
                    self.paused_readers.add(conn)
            if more:
                self.pause(conn, PAUSED_BY_ROUTING)
            elif conn.paused_for & PAUSED_BY_ROUTING:
                self.resume(conn, PAUSED_BY_ROUTING)
        return more

    def close(self, conn: Connection, reason: int | None, **kwargs: Any) -> None:
        """Close ``conn`` (after its output), MQTT 5 with DISCONNECT ``reason``."""
        self.outbox.close(conn, reason, **kwargs)

    def pause(self, conn: Connection, reason: int) -> None:
        """Stop reading from ``conn`` for ``reason`` (a PAUSED_BY_* bit)."""
        if conn.pause(reason):
            conn.io.pause_reading()

    def resume(self, conn: Connection, reason: int) -> None:
        if conn.resume(reason):
            conn.io.resume_reading()

    def writing_paused(self, conn: Connection, paused: bool) -> None:
        """The transport's buffer went over (True) or under its high-water mark."""
        conn.writing(paused)
        if not paused:
            session = self.session_of.get(conn)
            if session is not None:
                self.outbox.drain(session)
            self.flush_dirty()

    def connection_gone(self, conn: Connection, now: float) -> None:
        """The socket is closed: forget the connection (will, session detach)."""
        conn.lost()
        self.outbox.forget(conn)
        self.awaiting_connect.discard(conn)
        self.paused_readers.discard(conn)
        self.rate_paused.discard(conn)
        self.connection_lost(conn, now)
        self.flush_dirty()

    def protocol_failure(self, conn: Connection, exc: ProtocolError) -> None:
        """The peer broke the protocol: answer with the reason code, log it, close."""
        conn.protocol_failure(exc)
        self.outbox.mark(conn)
        self.log_malformed(conn, exc)

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
            self.outbox.hold(conn)
        self._want_session_sync()

    def log_peer_change(self, node: str, doc: dict[str, Any]) -> None:
        """Append a change of a mesh peer's filters (an INTEREST frame's ``doc``): synced before
        the report of any publish appended after it runs, so before its acknowledgement
        (broker_edge.mesh: "Restarts")."""
        session_log = self.session_log
        if session_log is None:
            return
        seq = self.journal.appended_seq
        session_log.append({"op": sessionlog.PEER, "seq": seq, "n": node, "i": doc})
        self._want_session_sync()

    def _want_session_sync(self) -> None:
        if not self._session_sync_requested:
            self._session_sync_requested = True
            self.request_session_sync()

    def log_session(self, session: Session, conn: Connection | None) -> None:
        """Record the session as it is now: opened with its expiry, or dropped (expiry 0)."""
        if session.clean:
            self._log_session_change(session, "drop", conn)
        elif session.claim == NO_CLAIM:
            self._log_session_change(session, "open", conn, x=session.expiry_interval)
        else:  # in a mesh: the CONNECT it is held by (broker_edge.handover)
            self._log_session_change(
                session,
                "open",
                conn,
                x=session.expiry_interval,
                v=list(session.claim),
                s=list(session.since),
            )

    def sync_sessions(self) -> None:
        """Make the logged session changes durable, then release the held connections."""
        self._session_sync_requested = False
        outbox = self.outbox
        held = outbox.release()
        try:
            if self.session_log is not None:
                self.session_log.sync()
        except SessionLogError:
            # Nothing held may be confirmed: close those connections without their answer.
            log.exception("session changes not durable: closing the clients that made them")
            for conn in held:
                conn.discard_output()
                conn.close(None, send_disconnect=False)
        for conn in held:
            if conn.out or conn.closing:
                outbox.mark(conn)
        self.flush_dirty()

    def apply_session_record(self, record: dict[str, Any], now: float) -> None:
        """Re-apply one session log record at restore (before serving; never logged again)."""
        key = (record["t"], record["c"])
        router = self.router
        session = router.sessions.get(key)
        op = record["op"]
        if op == "drop":
            if session is not None:
                self._drop_session(session)
            return
        if session is None:
            session = router.new_session(key[0], key[1], False, now)
        if op == "open":
            router.set_expiry(session, int(record["x"]))
            if "v" in record:
                session.claim = (int(record["v"][0]), str(record["v"][1]))
                session.since = (int(record["s"][0]), str(record["s"][1]))
        elif op == "sub":
            sub = subscription_from(record["sub"])
            session.subscriptions[sub.topic_filter] = sub
            if record.get("id") is not None:
                session.set_subscription_id(sub.topic_filter, int(record["id"]))
            router.install(session, sub.topic_filter, sub)
        elif op == "unsub":
            router.unsubscribe(session, (record["f"],))

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
                (tenant, client_id) in self.connections
                or (tenant, client_id) in self.router.sessions
            ),
            sessions=self.router.session_counts,
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
        # New limits: a raised one lifts a local quota stop at once (broker_edge.localquota).
        self.log_events(tenancy.restop_all())
        for conn in list(self.connections.values()):
            admission = tenancy.regrant(conn.token, conn.tenant)
            if admission is None:
                conn.keep_will(None)  # nobody vouches for it any more
                self.close(conn, ReasonCode.NOT_AUTHORIZED, reason_string="token revoked")
                continue
            conn.regrant(admission)
            if conn.will is not None:
                refusal, event = tenancy.refuse_publish(conn, conn.will, action="will")
                if refusal is not None:
                    conn.keep_will(None)  # the new rules forbid it: checked like at CONNECT
                if event is not None:
                    self.log_events((event,))
        self.flush_dirty()

    def roll_day(self) -> None:
        """Midnight UTC (the node calls this then): the local quota starts a new day."""
        today = datetime.fromtimestamp(self.wall_clock_us() / 1e6, UTC).date()
        self.log_events(self.tenancy.roll_day(today))
        self.flush_dirty()

    def publish_counters(
        self, start_us: int, end_us: int, tenants: Collection[str] | None = None
    ) -> None:
        """Each tenant's usage on this node for the window, on ``$counters/{metric}`` (only
        ``tenants``' when given)."""
        wanted = None if tenants is None else set(tenants)
        gauges: dict[str, dict[str, int]] = {}
        for session in self.router.sessions.values():
            if wanted is not None and session.tenant not in wanted:
                continue
            gauge = gauges.get(session.tenant)
            if gauge is None:
                gauge = gauges[session.tenant] = {"subscriptions": 0}
            gauge["subscriptions"] += len(session.subscriptions)
        names = set(gauges) | set(self.tenancy.usage) if wanted is None else wanted
        for name in names:
            ns = self.router.namespace(name)
            gauge = gauges.setdefault(name, {"subscriptions": 0})
            gauge["sessions"] = self.connected.get(name, 0)
            gauge["retained"] = sum(1 for m in ns.retained.all() if m.topic[0] != "$")
        reports = self.tenancy.counter_reports(
            start_us, end_us, self.settings.node_id, gauges, wanted
        )
        for tenant, topic, payload in reports:
            self.internal_publish(tenant, topic, payload)
        self.flush_dirty()

    def internal_publish(
        self, tenant: str, topic: str, payload: bytes, *, retain: bool = False
    ) -> None:
        """A publish made by the edge itself (log event, counter, quota state): journaled and
        routed like any other, not counted as the tenant's traffic."""
        self.accept(
            tenant, EDGE_CLIENT_ID, Publish(topic=topic, payload=payload, retain=retain), None
        )

    def connect(
        self, conn: Connection, packet: Connect, connack: tuple[str | None, int], now: float
    ) -> None:
        """Open the admitted CONNECT's session and send its CONNACK (``connack``: the client id
        assigned, the keepalive to announce); in a mesh, once the peers answered its claim
        (broker_edge.handover: reading stops meanwhile)."""
        mesh = self.mesh
        if mesh is None:
            self._accept(conn, packet, connack, now, None)
            return
        key = (conn.tenant, conn.client_id)
        version = (self.wall_clock_us(), self.node_id)
        held = self.router.sessions.get(key)
        since = version if packet.clean_start else held.since if held is not None else NO_CLAIM
        claim = Claim(conn.tenant, conn.client_id, version, since, not packet.clean_start)

        def answered(moved: bool, stale: bool) -> None:
            self.resume(conn, PAUSED_BY_CLAIM)
            if conn.state is _CLOSED or conn.closing:
                return  # gone meanwhile: what moved here stays, offline
            if stale:
                # A CONNECT of this client id on another edge is newer: this one lost.
                log.info("CONNECT of %s superseded on another edge", printable(conn.client_id))
                self.close(conn, None)
            else:
                self._accept(conn, packet, connack, self.clock(), claim)
                self._read_on(conn)
            self.outbox.mark(conn)  # outside a read: nothing else marks its CONNACK
            self.flush_dirty()

        if mesh.claim(claim, answered):
            self.pause(conn, PAUSED_BY_CLAIM)
        else:
            self._accept(conn, packet, connack, now, claim)

    def _read_on(self, conn: Connection) -> None:
        """Handle what the client sent after its CONNECT while the CONNECT waited (a client
        may send before its CONNACK); a turn cut short leaves the rest for its next read."""
        try:
            if self.receive(conn, b"", self.clock()):
                self.resume(conn, PAUSED_BY_ROUTING)
        except ProtocolError as exc:
            self.protocol_failure(conn, exc)
        except Exception as exc:
            # Our bug, not the client's (as in the listener): close it, not the link it came by.
            log.exception("internal error on connection %s", conn.peer)
            failure = ProtocolError(repr(exc), ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)
            self.protocol_failure(conn, failure)

    def _accept(
        self,
        conn: Connection,
        packet: Connect,
        connack: tuple[str | None, int],
        now: float,
        claim: Claim | None,
    ) -> None:
        session, present = self.open_session(conn, packet, now, claim)
        v5 = conn.version == ProtocolVersion.MQTT_5
        conn.accept(present, *connack, packet.properties if v5 else None)
        self.outbox.resume_session(conn, session)

    def open_session(
        self, conn: Connection, packet: Connect, now: float, claim: Claim | None = None
    ) -> tuple[Session, bool]:
        key = (conn.tenant, conn.client_id)
        router = self.router
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
            self.close(previous, 0x8E)
            self._detach(previous, now)
        if conn.version == ProtocolVersion.MQTT_5:
            expiry = packet.properties.session_expiry_interval or 0
        else:
            expiry = 0 if packet.clean_start else SESSION_NEVER_EXPIRES
        self.pending_wills.pop(key, None)  # reconnected in time: no will [MQTT-3.1.3-9]
        session = router.sessions.get(key)
        present = session is not None and not packet.clean_start
        if session is not None and packet.clean_start:
            self._drop_session(session)
            session = None
        was_persistent = session is not None and not session.clean
        if session is None:
            session = router.new_session(conn.tenant, conn.client_id, packet.clean_start, None)
        receive_maximum = 65_535
        if conn.version == ProtocolVersion.MQTT_5:
            receive_maximum = packet.properties.receive_maximum or 65_535
        router.attach(session, conn, expiry, receive_maximum)
        if claim is not None:
            session.claim = claim.version
            session.since = max(session.since, claim.since)
        if not session.clean or was_persistent:
            self.state_changed = True
            self.log_session(session, conn)  # its CONNACK waits until this is durable
        self.session_of[conn] = session
        self.connections[key] = conn
        self.awaiting_connect.discard(conn)
        connected = self.connected
        connected[conn.tenant] = connected.get(conn.tenant, 0) + 1
        details = connect_details(
            peer=conn.peer,
            protocol=int(conn.version),
            clean_start=packet.clean_start,
            keepalive=conn.keepalive,
            session_present=present,
        )
        self.log(conn.tenant, "connect", conn.client_id, details)
        return session, present

    def set_session_expiry(self, conn: Connection, session: Session, expiry: int) -> None:
        """A DISCONNECT's session expiry interval replaces the one of the CONNECT
        [MQTT-3.14.2.2.2]; raises ProtocolError if the CONNECT's was 0 and this one is not."""
        if expiry and not session.expiry_interval:
            raise ProtocolError(
                "DISCONNECT sets a session expiry after a CONNECT with 0 [MQTT-3.14.2-2]",
                ReasonCode.PROTOCOL_ERROR,
            )
        if expiry == session.expiry_interval:
            return
        if self.router.set_expiry(session, expiry):
            self.state_changed = True  # a new expiry, or no longer persistent
            self.log_session(session, conn)

    def connection_lost(self, conn: Connection, now: float) -> None:
        session = self.session_of.get(conn)
        if session is None:
            return
        will = conn.take_will()
        self._detach(conn, now)
        if will is None or conn.clean_disconnect:
            return
        # The network connection closed without DISCONNECT: the will [MQTT-3.1.2-8], after its
        # delay or when the session ends, whichever comes first [MQTT-3.1.3-9].
        key = (conn.tenant, conn.client_id)
        taken_over = key in self.connections
        if conn.will_delay == 0:
            self._publish_will(conn.tenant, conn.client_id, will)
        elif not taken_over and self.router.sessions.get(key) is session:
            delay = min(conn.will_delay, session.expiry_interval)
            self.pending_wills[key] = (now + delay, will)
            self.wake_at(now + delay)
        elif not taken_over:
            self._publish_will(conn.tenant, conn.client_id, will)  # the session already ended

    def _detach(self, conn: Connection, now: float) -> None:
        session = self.session_of.pop(conn, None)
        if session is None:
            return
        key = (conn.tenant, conn.client_id)
        if self.connections.get(key) is conn:
            del self.connections[key]
            self.connected[conn.tenant] -= 1
            details = disconnect_details(
                peer=conn.peer, clean=conn.clean_disconnect, reason_code=conn.close_reason
            )
            self.log(conn.tenant, "disconnect", conn.client_id, details)
        if self.router.detach(session, conn, now):
            self._drop_session(session)

    def _drop_session(self, session: Session) -> None:
        if not session.clean:
            self.state_changed = True
            self._log_session_change(session, "drop", None)
        self.router.drop_session(session)
        key = (session.tenant, session.client_id)
        pending = self.pending_wills.pop(key, None)
        if pending is not None:
            self._publish_will(session.tenant, session.client_id, pending[1])

    def _queue_overflow(self, session: Session) -> None:
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

    def _publish_will(self, tenant: str, client_id: str, will: Publish) -> None:
        if self.tenancy.will_refused(tenant):
            log.info("will of %s not published: tenant %s is blocked", printable(client_id), tenant)
            return
        try:
            self.accept(tenant, client_id, will, publisher=None)
        except ProtocolError as exc:
            log.warning("will of %s not published: %s", printable(client_id), printable(str(exc)))

    # -- publish ---------------------------------------------------------------------------------

    def accept(
        self,
        tenant: str,
        client_id: str,
        packet: Publish,
        publisher: str | None,
        version: int = 0,
    ) -> int:
        """Journal, retain and route one publish; returns its journal seq. ``publisher``: the
        client id when a client published it (No Local), None when the edge did; ``version``:
        the protocol version of the packet's ``wire`` bytes, if it has them."""
        # The per-publish hot path: keep it flat (no helper calls that a branch can avoid).
        props = packet.properties
        if props is not NO_PROPERTIES and (
            props.topic_alias is not None or props.subscription_identifiers
        ):
            props = dataclasses.replace(props, topic_alias=None, subscription_identifiers=())
        ts_us = self.wall_clock_us()
        topic = packet.topic
        payload = packet.payload
        qos = packet.qos
        retain = packet.retain
        operator = tenant == OPERATOR_TENANT
        if operator and topic.startswith(JOURNAL_CONTROL_TOPIC_PREFIX):
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
                payload,
                props.content_type,
                props.user_properties,
            )
        message = Message(
            tenant, topic, payload, qos, retain, client_id, ts_us, props, seq, self.node_id
        )
        wire = packet.wire
        if wire is None:
            pass
        elif qos:  # the publisher's own bytes with a packet id of each subscriber's
            at = len(wire) - len(payload) - (3 if version == _V5 else 2)
            message.wire = (version, at, wire)
        else:  # the publisher's own bytes are its QoS 0 subscribers' delivery (Message.enc)
            message.enc_key = version * 2
            message.enc = wire
        shares = None
        if self.mesh is not None:
            # First: what this publish sets off (a log event of a queue overflowing, a quota
            # decision's) is journaled after it, and peers must get it in seq order too.
            shares = self.mesh.forward(message)
        if operator:
            self.take(message)  # retained (or not) already, so route(retain=False)
        deliveries = self.router.route(message, publisher, not operator, shares)  # positional
        if deliveries is not None:
            if self.moves.adopted:
                self.moves.note(deliveries)
            self.outbox.deliver(deliveries)
        return seq

    def accept_run(
        self,
        tenant: str,
        client_id: str,
        topic: str,
        qos: int,
        payloads: list[bytes],
        size: int,
        packets: list[bytes],
        version: int,
    ) -> int:
        """Journal and route a run of a client's publishes to one topic at one QoS (0 or 1),
        without DUP, RETAIN or properties, as :meth:`accept` would each of them: one timestamp
        (they came in one read), one journal append, one routing; returns the first one's
        seq (the others follow it). ``payloads``: ``size`` bytes in all; ``packets``: as they
        came, of protocol ``version`` (QoS 0: all of them in one piece; QoS 1: one each).

        A connected subscriber of the same protocol version that takes a QoS 0 run as it is
        gets those bytes in one piece; any other delivery is each message's, as from
        :meth:`accept`. Each message goes to the mesh's peers first, in seq order, as from
        :meth:`accept`. A tenant with shared subscriptions has each message routed on its
        own (a group gives each message to its next member). Only for a client that is not
        the operator, on a broker without adopted sessions (handlers._publish_run checks)."""
        ts_us = self.wall_clock_us()
        seq = self.journal.append_run(ts_us, tenant, client_id, topic, qos, payloads)
        level = QoS(qos)
        first = Message(
            tenant, topic, payloads[0], level, False, client_id, ts_us, NO_PROPERTIES, seq,
            self.node_id,
        )  # fmt: skip
        messages: list[Message] | None = None
        kept: list[Container[Share] | None] | None = None
        if self.mesh is not None:
            # First, as in accept: the peers get the run in seq order, before anything its
            # deliveries set off (a queue's overflow) is journaled and forwarded after it.
            messages = self._run_messages(first, payloads, packets, version)
            forward = self.mesh.forward
            kept = [forward(message) for message in messages]
        ns = self.router.namespaces.get(tenant)
        if ns is not None and ns.shared:
            # A shared group gives each message to its next member (SharedGroup.pick): routed
            # one by one, as accept would.
            if messages is None:
                messages = self._run_messages(first, payloads, packets, version)
            for i, message in enumerate(messages):
                each = self.router.route(message, client_id, True, kept[i] if kept else None)
                if each is not None:
                    self.outbox.deliver(each)
            return seq
        # The shares the mesh kept here only choose among shared groups: the tenant has none.
        deliveries = self.router.route(first, client_id, True, None)
        if deliveries is None:
            return seq
        if not qos:
            deliveries = self.outbox.deliver_whole(deliveries, len(payloads), size, packets[0],
                                                   version)  # fmt: skip
            if not deliveries:
                return seq
        if messages is None:
            messages = self._run_messages(first, payloads, packets, version)
        if qos:
            for session, _, sub_qos, retain, sub_ids in deliveries:
                self.outbox.deliver_run(session, messages, sub_qos, retain, sub_ids)
        else:
            self.outbox.deliver(
                [
                    (session, message, sub_qos, retain, sub_ids)
                    for session, _, sub_qos, retain, sub_ids in deliveries
                    for message in messages
                ]
            )
        return seq

    @staticmethod
    def _run_messages(
        first: Message, payloads: list[bytes], packets: list[bytes], version: int
    ) -> list[Message]:
        """Every message of a run (``first`` is the first's); at QoS 1 each with its packet
        as it came (``Message.wire``, as from accept)."""
        tenant, topic, qos, client_id, ts_us = (
            first.tenant, first.topic, first.qos, first.client_id, first.ts_us
        )  # fmt: skip
        seq, node = first.seq, first.origin
        messages = [first]
        messages += (
            Message(tenant, topic, payloads[i], qos, False, client_id, ts_us, NO_PROPERTIES,
                    seq + i, node)
            for i in range(1, len(payloads))
        )  # fmt: skip
        if qos:
            skip = 3 if version == _V5 else 2  # the packet id (and v5's property length)
            for message, raw in zip(messages, packets, strict=True):
                message.wire = (version, len(raw) - len(message.payload) - skip, raw)
        return messages

    def take(self, message: Message) -> bool:
        """Retain ``message`` if it asks to be and is the newest of its topic (see
        broker_edge.retained), and carry out an operator's control message then (or when it is
        not retained): a decision older than the one held is not applied, on any edge. True
        unless it was an older retained message."""
        if message.retain and not self.router.retain(message):
            return False
        if message.tenant == OPERATOR_TENANT:
            self.control(
                self.tenancy.control_message(message.tenant, message.topic, message.payload)
            )
        return True

    def deliver_remote(self, message: Message, shares: Container[Share] = ()) -> bool:
        """A publish a peer accepted (broker_edge.mesh): retained here if it is the newest of
        its topic and applied here if it is the operator's (as if published here), then to
        this node's sessions, counted in their deliveries (to one member of each of
        ``shares``, the shared groups its origin gave it to here, and of no other group); not
        journaled (its origin did), never forwarded again. True when a persistent session
        took it at QoS 1/2 (only a snapshot makes that survive a crash)."""
        # The per-crossing-publish hot path: most messages are neither retained nor the
        # operator's, and a QoS 0 one is never held for a snapshot.
        if (message.retain or message.tenant == OPERATOR_TENANT) and (
            self.take(message) and message.retain
        ):
            self.state_changed = True  # not in this node's journal: snapshot it soon
        deliveries = self.router.route(message, None, retain=False, shares=shares)
        if deliveries is None:
            return False
        if self.moves.adopted:
            self.moves.note(deliveries)
        self.outbox.deliver(deliveries)
        if not message.qos:
            return False
        return self._log_received(message, deliveries)

    def _log_received(self, message: Message, deliveries: list[Delivery]) -> bool:
        """A crossing QoS 1/2 message the persistent sessions of ``deliveries`` took: in the
        session log before their clients see it (broker_edge.receipts). True if any took it."""
        record, sessions = receipts.received(message, deliveries)
        if not sessions:
            return False
        session_log = self.session_log
        if session_log is not None:
            session_log.append({"op": receipts.RX, "seq": self.journal.appended_seq, **record})
            for session in sessions:
                if session.connection is not None:
                    self.outbox.hold(session.connection)
            self._want_session_sync()
        return True

    def log_received_done(self, session: Session, out: Outbound, *, ended: bool) -> None:
        """``session``'s subscriber ended its exchange of a crossing message (the restore no
        longer gives it back; nothing waits for this record), or, not ``ended``, received it at
        QoS 2 (PUBREC: the restore sends only its PUBREL again, which waits for this record):
        see broker_edge.receipts."""
        session_log = self.session_log
        if session_log is None:
            return
        record = receipts.done(session, out, ended=ended)
        session_log.append({"op": receipts.RX_DONE, "seq": self.journal.appended_seq, **record})
        if not ended and session.connection is not None:
            self.outbox.hold(session.connection)
        self._want_session_sync()

    def _refuse_acks(self, conn: Connection, acks: list[tuple[int, int, int]]) -> None:
        """The journal failed the frame of a turn's last record. Its publishes that an earlier
        frame made durable are acknowledged; the others are refused."""
        durable_seq = self.journal.durable_seq
        for seq, packet_id, qos in acks:
            if seq <= durable_seq:
                if conn.ack_durable(packet_id, qos):
                    self.outbox.dirty.add(conn)
            elif conn.refuse_undurable(packet_id, qos):
                self.journal_refused += 1
                if qos == 2 and conn.version == ProtocolVersion.MQTT_5:
                    session = self.session_of.get(conn)
                    if session is not None:
                        session.release_rel(packet_id)  # a PUBREC 0x80 ends it [MQTT-4.3.3-4]
                self.outbox.mark(conn)

    def refuse_for_journal(self, conn: Connection, packet: Publish) -> None:
        """The journal is full or failing: nothing can be made durable, so nothing is taken.
        QoS 0 is dropped and counted; QoS 1/2 is refused (MQTT 5, ``journal_refusal``), or,
        since 3.1.1 has no negative acknowledgement, the connection is closed and the client
        resends."""
        if packet.qos == _QOS0:
            self.journal_dropped += 1
            self.stats.dropped += 1
            return
        self.journal_refused += 1
        if conn.version == ProtocolVersion.MQTT_5:
            conn.ack_refused(packet, self.journal_refusal)
        else:
            conn.close(None)

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
        now on publishes are refused with ``journal_refusal``; the operator's ``$log`` gets
        ``journal_full`` / ``journal_error`` / ``journal_resumed``."""
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

    # -- subscribe -----------------------------------------------------------------------------

    def subscribe(
        self,
        conn: Connection,
        session: Session,
        subscriptions: list[tuple[str | None, str, Subscription]],
        subscription_id: int | None = None,
    ) -> None:
        """Add (group, filter, options) subscriptions; group is set for ``$share/...``."""
        if not session.clean:
            self.state_changed = True
            for _, _, sub in subscriptions:  # its SUBACK waits until these are durable
                full = sub.topic_filter
                doc = subscription_doc(full, sub)
                self._log_session_change(session, "sub", conn, sub=doc, id=subscription_id)
        retained = self.router.subscribe(
            session, subscriptions, subscription_id, self.wall_clock_us()
        )
        for _, message, qos, retain, sub_ids in retained:
            self.outbox.deliver_one(session, conn, message, qos, retain, sub_ids)

    def unsubscribe(
        self, conn: Connection, session: Session, topic_filters: Sequence[str]
    ) -> list[bool]:
        found = self.router.unsubscribe(session, topic_filters)
        if not session.clean:
            self.state_changed = True
            for topic_filter, had in zip(topic_filters, found, strict=True):
                if had:
                    self._log_session_change(session, "unsub", conn, f=topic_filter)
        return found

    # -- persistence (see broker_edge.store) ------------------------------------------------

    def persistent_sessions(self) -> list[Session]:
        return [s for s in self.router.sessions.values() if not s.clean]

    def retained_messages(self) -> list[Message]:
        return self.router.retained_messages()

    def retain_remote(self, message: Message) -> None:
        """A peer's retained message (or tombstone) as its link came up (broker_edge.mesh):
        kept and applied if it is newer than what this node holds, delivered to nobody."""
        if self.take(message):
            self.state_changed = True

    def retained_state(self) -> list[Message]:
        """Retained messages and tombstones (what a snapshot keeps, a new link is sent)."""
        return self.router.retained_state()

    def restore(self, sessions: Iterable[Session], retained: Iterable[Message]) -> None:
        """Install sessions and retained messages read from a snapshot (before serving)."""
        router = self.router
        for session in sessions:
            router.add_session(session)
            for full, sub in session.subscriptions.items():
                router.install(session, full, sub)
        for message in retained:
            router.namespace(message.tenant).retained.set(message)
            self.control(
                self.tenancy.control_message(message.tenant, message.topic, message.payload)
            )

    def replay(self, message: Message) -> None:
        """Re-apply a journal record written after the snapshot: retain it, queue it for the
        (offline) persistent sessions it matches. Not journaled again, not counted."""
        self.take(message)
        deliveries = self.router.route(message, None, retain=False)
        if deliveries is not None:
            self.outbox.deliver(deliveries)

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
        if self.tenancy.report_due:  # a tenant's count passed a report point (localquota)
            end_us = self.wall_clock_us()
            start_us = end_us - int(self.settings.counter_interval * 1e6)
            self.publish_counters(start_us, end_us, self.tenancy.report_due)
            self.flush_dirty()
        due = self._next_scan
        if self.rate_paused:
            for conn in list(self.rate_paused):
                if conn.state is _CLOSED:
                    self.rate_paused.discard(conn)
                elif conn.resume_at <= now:
                    self.rate_paused.discard(conn)
                    self.resume(conn, PAUSED_BY_RATE)
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
                self.resume(conn, PAUSED_BY_JOURNAL)

    def check_keepalives(self, now: float) -> None:
        """Close connections silent for 1.5 x their keepalive [MQTT-3.1.2-24], and those that
        did not complete CONNECT within ``connect_timeout``."""
        for conn in list(self.awaiting_connect):
            if conn.state is not ConnState.AWAIT_CONNECT:
                self.awaiting_connect.discard(conn)
            elif now > conn.deadline():
                log.info(
                    "no CONNECT from %s within %.0f s: closing",
                    conn.peer,
                    conn.limits.connect_timeout,
                )
                self.awaiting_connect.discard(conn)
                self.close(conn, None)
        for conn in list(self.connections.values()):
            if now > conn.deadline():
                log.info("keepalive timeout: %s (%s)", printable(conn.client_id), conn.peer)
                self.close(conn, 0x8D)
        self.flush_dirty()

    def expire_sessions(self, now: float) -> None:
        """Drop disconnected sessions whose expiry interval has passed (MQTT 5)."""
        for session in self.router.expired_sessions(now):
            self.stats.sessions_expired += 1
            self._drop_session(session)

    def publish_system(self, topic: str, payload: bytes) -> None:
        """Retain and route one broker-made ``$SYS`` message (QoS 0) without the journal: it is
        derived state, regenerated every interval (see ``broker_edge.sysstats``).

        Node statistics cover every tenant, so no tenant sees them: with a tenants file they
        live in the operator's namespace; without one, in the anonymous tenant's (the only one,
        as on any single-tenant broker). A tenants file cannot name a tenant ``default``."""
        owner = OPERATOR_TENANT if self.tenancy.config is not None else DEFAULT_TENANT
        message = Message(owner, topic, payload, QoS.AT_MOST_ONCE, True, "", self.wall_clock_us())
        deliveries = self.router.route(message, None)
        if deliveries is not None:
            self.outbox.deliver(deliveries)

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
                self.close(conn, reason)
        self.flush_dirty()


def _noop() -> None:
    pass


def _ignore_status(status: JournalStatus) -> None:
    pass


def _no_time() -> float:
    return 0.0  # without a loop's clock no turn is ever too long


def _never(at: float) -> None:
    del at
