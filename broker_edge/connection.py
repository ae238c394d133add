"""Protocol state machine of one client connection (sans-IO).

Theory of operation
-------------------
The listener feeds raw bytes to :meth:`Connection.receive`; the decoder turns them into packets
and each packet goes to the handler of its type, chosen from ``_HANDLERS`` after the state check
in ``_LEGAL``: the one table of which packets a connection may receive in which state. Handlers
talk to the :class:`~broker_edge.broker.Broker` (routing, sessions, journal) and queue outgoing
bytes with :meth:`emit`; the listener writes everything a read produced in one
``transport.write``. Nothing here touches sockets, clocks or event loops: time comes in as
``now``.

A peer that breaks the protocol raises :class:`~broker_edge.errors.ProtocolError` out of
``receive``; the listener turns it into a DISCONNECT with its reason code (MQTT 5) and closes
this connection only.

Inbound QoS 1 and 2 publishes are acknowledged only after their journal record is durable:
the broker calls back :meth:`ack_durable` from the group commit.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from broker_edge.codec import Decoder, encode
from broker_edge.errors import ProtocolError, UnsupportedProtocol
from broker_edge.packets import (
    NO_PROPERTIES,
    SUBACK_FAILURE_311,
    Auth,
    Connack,
    ConnackCode311,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Properties,
    ProtocolVersion,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    QoS,
    ReasonCode,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
)
from broker_edge.plim import TenantUsage
from broker_edge.tenancy import take_token
from broker_edge.tenants import ALLOW_ALL, Acl
from broker_edge.topics import InvalidTopic, parse_subscription_filter, validate_topic_name
from schemas.topics import JOURNAL_CONTROL_TOPIC_PREFIX

if TYPE_CHECKING:
    from broker_edge.broker import Broker
    from broker_edge.session import Session

_client_numbers = itertools.count(1)

# Topic names already validated, shared by every connection of a broker (bounded: cleared when
# full, by count and by characters, so long distinct topics cannot pile up in it). Devices
# publish to the same few topics over and over.
VALID_TOPIC_CACHE = 16_384
VALID_TOPIC_CACHE_CHARS = 2**20

# What a PUBLISH may carry besides its payload (topic name, packet id, properties): with a
# tenant's max_payload_bytes, a packet declaring more than payload + this is refused from its
# fixed header, before its body is buffered.
PUBLISH_HEADROOM = 128 * 1024

CONNECT_MAX = 2**20

# Why reading from a connection is paused (bits of Connection.paused_for). Reading resumes only
# when no reason is left: a publisher slowed by its rate limit must not be resumed early because
# the journal caught up, nor the other way round.
PAUSED_BY_RATE = 1  # over its tenant's message rate (tenancy.take_token)
PAUSED_BY_JOURNAL = 2  # the journal's backlog is over max_journal_backlog
PAUSED_BY_ROUTING = 4  # packets of an earlier read still to handle (see receive)
PAUSED_BY_BACKLOG = 8  # its own records awaiting the journal are over the per-client bound

# What a journal record costs while it waits for its commit, beyond its topic and payload (the
# writer's buffered Python values), for the per-client bound on that backlog.
RECORD_OVERHEAD = 256


class ConnState(Enum):
    AWAIT_CONNECT = 1
    CONNECTED = 2
    CLOSED = 3


# Which packet types a server may receive in each state [MQTT-3.1.0-1, MQTT-3.1.0-2].
_FROM_CLIENT_CONNECTED = frozenset(
    {Publish, Puback, Pubrec, Pubrel, Pubcomp, Subscribe, Unsubscribe, Pingreq, Disconnect, Auth}
)
_LEGAL: dict[ConnState, frozenset[type]] = {
    ConnState.AWAIT_CONNECT: frozenset({Connect}),
    ConnState.CONNECTED: _FROM_CLIENT_CONNECTED,
    ConnState.CLOSED: frozenset(),
}

# Per-message code compares with these aliases: on Python 3.11 reading an enum member through
# its class (QoS.AT_MOST_ONCE) costs ~70 ns, and hashing a plain Enum (a _LEGAL lookup) runs
# Enum.__hash__ in Python.
_CLOSED = ConnState.CLOSED
_QOS0 = QoS.AT_MOST_ONCE
_QOS2 = QoS.EXACTLY_ONCE


class Connection:
    """One client's side of the protocol: CONNECT to DISCONNECT."""

    # One per client: slots keep an idle connection small (no per-instance __dict__).
    __slots__ = (
        "_alias_in",
        "_alias_out",
        "acl",
        "alias_out_max",
        "broker",
        "bucket",
        "bucket_at",
        "clean_disconnect",
        "client_id",
        "close_reason",
        "closing",
        "connected_at",
        "decoder",
        "inbound_unacked",
        "io",
        "journal_bytes",
        "keepalive",
        "last_rx",
        "max_packet_out",
        "max_payload",
        "operator",
        "out",
        "paused_for",
        "peer",
        "rate",
        "receive_maximum_out",
        "resume_at",
        "session",
        "state",
        "tenant",
        "token",
        "turn_bytes",
        "turn_seq",
        "usage",
        "version",
        "will",
        "will_delay",
        "write_paused",
    )

    def __init__(self, broker: Broker, peer: str, now: float) -> None:
        self.broker = broker
        self.peer = peer
        # Before CONNECT only a CONNECT may arrive, and a CONNECT is far below 1 MiB (five
        # fields of at most 65,535 bytes plus properties): a peer cannot make us buffer more.
        self.decoder = Decoder(max_packet_size=min(broker.settings.max_packet_size, CONNECT_MAX))
        self.state = ConnState.AWAIT_CONNECT
        self.version = ProtocolVersion.MQTT_3_1_1
        self.client_id = ""
        self.tenant = ""
        self.session: Session | None = None
        self.keepalive = 0
        self.last_rx = now
        self.connected_at = now
        self.will: Publish | None = None
        self.will_delay = 0
        self.clean_disconnect = False
        # Set by the listener: its transport (one reference, not one bound method per call a
        # connection makes: idle connections are most of an edge's memory). Reading is paused
        # and resumed through pause()/resume() with a reason, never directly.
        self.io: ConnectionIO = NO_IO
        self.paused_for = 0  # PAUSED_BY_* bits
        # MQTT 5 limits the client declared in CONNECT (3.1.1: none).
        self.receive_maximum_out = 65_535
        self.max_packet_out = 0  # 0: no limit
        self.alias_out_max = 0
        self._alias_out: dict[str, int] | None = None
        self._alias_in: dict[int, str] | None = None
        self.inbound_unacked = 0  # QoS 1/2 publishes received and not yet fully acknowledged
        # Bytes of this client's journal records not yet durable (see end_turn), and those of
        # the records of the current turn with the last one's seq (set by the broker).
        self.journal_bytes = 0
        self.turn_bytes = 0
        self.turn_seq = 0
        # Tenancy: what the policy admitted at CONNECT (broker_edge.tenancy.Admission).
        self.token: str | None = None
        self.acl: Acl = ALLOW_ALL
        self.operator = False
        self.usage = _NO_USAGE
        self.max_payload = 0  # 0: no limit beyond the protocol's
        self.rate = 0.0  # messages per second allowed (token bucket); 0: unlimited
        self.bucket = 0.0
        self.bucket_at = now
        self.resume_at = 0.0  # paused for its rate: when to read again (broker.tick)
        # Packets to write at the end of the turn. Shared and never appended to while empty
        # (emit replaces it): an idle connection holds no list of its own.
        self.out: list[bytes] = _NO_OUTPUT
        self.write_paused = False
        self.closing = False
        self.close_reason: int | None = None

    # -- input -------------------------------------------------------------------------------

    def receive(self, data: bytes, now: float) -> bool:
        """Feed bytes from the socket and handle the packets they complete; raises
        ProtocolError when the peer broke the protocol.

        Stops early, returning True, once this call has routed more than the broker's
        ``max_deliveries_per_turn`` deliveries (a burst fanned out to many subscribers), or
        handled packets for more than ``max_turn_seconds`` by the broker's ``clock``: the caller
        writes what was routed so far and calls ``receive(b"", now)`` again for the rest, so
        subscribers see deliveries flow, and other clients are served, instead of waiting for a
        whole read.
        """
        self.last_rx = now
        decoder = self.decoder
        decoder.feed(data)
        handlers = _HANDLERS
        state = self.state
        legal = _LEGAL[state]
        broker = self.broker
        stats = broker.stats
        turn_ends = stats.messages_out + broker.settings.max_deliveries_per_turn
        clock = broker.clock
        deadline = now + broker.settings.max_turn_seconds
        while not self.closing:
            packet = decoder.next_packet()
            if packet is None:
                return False
            if self.state is not state:  # a handler moved it (CONNECT)
                state = self.state
                legal = _LEGAL[state]
            kind = type(packet)
            if kind not in legal:
                raise ProtocolError(
                    f"{kind.__name__} not allowed in state {state.name}",
                    ReasonCode.PROTOCOL_ERROR,
                )
            handlers[kind](self, packet, now)
            if stats.messages_out > turn_ends or clock() > deadline:
                return True
        return False

    def pause(self, reason: int) -> None:
        """Stop reading from the socket for ``reason`` (a PAUSED_BY_* bit)."""
        if not self.paused_for:
            self.io.pause_reading()
        self.paused_for |= reason

    def resume(self, reason: int) -> None:
        """``reason`` no longer holds; read again if no other reason to pause is left."""
        if self.paused_for & reason:
            self.paused_for &= ~reason
            if not self.paused_for:
                self.io.resume_reading()

    def end_turn(self) -> None:
        """Charge this turn's journal records to this client until they are durable; while
        they are over ``max_journal_backlog_bytes_per_client`` its reads stop. The journal's
        own bound counts records, not bytes: without this, one client's big publishes (3,000
        of 60 KB) waited for their commit as hundreds of MiB."""
        pending = self.turn_bytes
        if not pending:
            return
        self.turn_bytes = 0
        self.journal_bytes += pending

        def journaled() -> None:
            self._journaled(pending)

        # Released when durable, or when the journal failed their frame and dropped them
        # (refused): either way they no longer wait for the journal.
        self.broker.journal.after_durable(self.turn_seq, journaled, journaled)
        if self.journal_bytes > self.broker.settings.max_journal_backlog_bytes_per_client:
            self.pause(PAUSED_BY_BACKLOG)

    def _journaled(self, size: int) -> None:
        self.journal_bytes -= size
        limit = self.broker.settings.max_journal_backlog_bytes_per_client
        if self.journal_bytes <= limit // 2 and self.state is not _CLOSED:
            self.resume(PAUSED_BY_BACKLOG)

    # -- output ------------------------------------------------------------------------------

    def emit(self, data: bytes) -> None:
        if self.state is _CLOSED:
            return
        out = self.out
        if out:
            out.append(data)
        else:
            self.out = [data]
            self.broker.dirty.add(self)

    def send(self, packet: Packet) -> None:
        self.emit(encode(packet, self.version))

    def flush(self) -> None:
        if self.out:
            data = b"".join(self.out) if len(self.out) > 1 else self.out[0]
            self.out = _NO_OUTPUT
            self.io.write(data)
        if self.closing and self.state is not ConnState.CLOSED:
            self.state = ConnState.CLOSED
            self.io.close()

    def packet_limit(self) -> int:
        """The largest packet this client may send: the edge's maximum packet size, lowered
        to what the tenant's max_payload_bytes can use. The decoder refuses a bigger one from
        its fixed header [MQTT-3.2.2-15], so a slow body is never buffered."""
        limit = self.broker.settings.max_packet_size
        if self.max_payload:
            limit = min(limit, self.max_payload + PUBLISH_HEADROOM)
        return limit

    def outgoing_alias(self, topic: str) -> tuple[int, bool]:
        """(alias, already known to the client) for a topic sent to this client; alias 0 when
        the client's topic alias maximum is used up (aliases are never reassigned)."""
        aliases = self._alias_out
        if aliases is None:
            aliases = self._alias_out = {}
        alias = aliases.get(topic)
        if alias is not None:
            return alias, True
        if len(aliases) >= self.alias_out_max:
            return 0, False
        alias = aliases[topic] = len(aliases) + 1
        return alias, False

    def close(
        self,
        reason: int | None = None,
        *,
        send_disconnect: bool = True,
        reason_string: str | None = None,
    ) -> None:
        """Close after flushing; MQTT 5 clients first get DISCONNECT with ``reason`` (and a
        human-readable reason string, allowed on DISCONNECT whatever the client asked
        [MQTT-3.1.2-29])."""
        if self.closing:
            return
        if (
            send_disconnect
            and reason is not None
            and self.version == ProtocolVersion.MQTT_5
            and self.state is ConnState.CONNECTED
        ):
            props = NO_PROPERTIES
            if reason_string:
                props = Properties(reason_string=reason_string[:200])
            self.send(Disconnect(reason_code=reason, properties=props))
        self.close_reason = reason
        self.closing = True
        self.broker.dirty.add(self)

    def protocol_failure(self, exc: ProtocolError) -> None:
        """The peer broke the protocol: answer with the reason code and close [MQTT-4.13.1-1]."""
        reason = int(exc.reason_code)
        if self.state is ConnState.AWAIT_CONNECT and self.version == ProtocolVersion.MQTT_5:
            # Before CONNACK the reason code travels in a CONNACK [MQTT-3.2.2-8].
            self.send(Connack(reason_code=reason))
        elif (
            self.state is ConnState.AWAIT_CONNECT
            and isinstance(exc, UnsupportedProtocol)
            and exc.known_name
        ):
            # "MQTT" at a level we do not speak: the 3.1.1 answer, which any MQTT client can
            # read [MQTT-3.1.2-2]; an unknown protocol name is just closed [MQTT-3.1.2-1].
            self.send(Connack(reason_code=ConnackCode311.UNACCEPTABLE_PROTOCOL_VERSION))
        self.broker.log_malformed(self, exc)
        self.close(reason, reason_string=str(exc))

    # -- handlers ----------------------------------------------------------------------------

    def _on_connect(self, packet: Connect, now: float) -> None:
        self.broker.stats.connects += 1
        self.version = packet.protocol_version
        v5 = self.version == ProtocolVersion.MQTT_5
        client_id = packet.client_id
        assigned: str | None = None
        if not client_id:
            if not packet.clean_start and not v5:
                # [MQTT-3.1.3-8] an empty id with CleanSession=0 is rejected.
                self.send(Connack(reason_code=ConnackCode311.IDENTIFIER_REJECTED))
                self.close(None)
                return
            client_id = assigned = f"edgebus-{self.broker.settings.node_id}-{next(_client_numbers)}"
        self.client_id = client_id
        self.keepalive = packet.keepalive
        server_keepalive: int | None = None
        if self.keepalive > self.broker.settings.max_keepalive:
            self.keepalive = self.broker.settings.max_keepalive
            server_keepalive = self.keepalive if v5 else None
        if v5 and packet.properties.authentication_method is not None:
            # No enhanced authentication method is offered [MQTT-4.12.0-1].
            self.send(Connack(reason_code=ReasonCode.BAD_AUTHENTICATION_METHOD))
            self.close(None)
            return
        admission = self.broker.admit(self, packet)
        if admission.refusal is not None:
            self.send(Connack(reason_code=admission.refusal))
            self.close(None)
            return
        self.tenant, self.acl, self.operator = admission.tenant, admission.acl, admission.operator
        self.token = packet.username
        self.usage = admission.usage
        self.max_payload, self.rate = admission.max_payload, admission.rate
        self.bucket = self.rate
        if packet.will is not None and not self._take_will(packet.will, v5):
            return
        if v5:
            cp = packet.properties
            self.receive_maximum_out = cp.receive_maximum or 65_535
            self.max_packet_out = cp.maximum_packet_size or 0
            # Never more aliases than we accept ourselves: each holds a topic name (up to
            # 64 KiB) for as long as the connection lives.
            self.alias_out_max = min(
                cp.topic_alias_maximum or 0, self.broker.settings.topic_alias_maximum
            )
        self.decoder.max_packet_size = self.packet_limit()
        session, present = self.broker.open_session(self, packet, now)
        self.session = session
        self.state = ConnState.CONNECTED
        props = NO_PROPERTIES
        if v5:
            settings = self.broker.settings
            props = Properties(
                assigned_client_identifier=assigned,
                server_keep_alive=server_keepalive,
                receive_maximum=settings.max_inflight_messages,
                topic_alias_maximum=settings.topic_alias_maximum or None,
                maximum_packet_size=(
                    self.decoder.max_packet_size
                    if self.decoder.max_packet_size < 268_435_460
                    else None
                ),
            )
        self.send(Connack(session_present=present, reason_code=0, properties=props))
        self.broker.session_resumed(self, session)

    def _take_will(self, will: Will, v5: bool) -> bool:
        """Keep the CONNECT's will, or refuse the connection (False) if this client may not
        publish it."""
        try:
            validate_topic_name(will.topic)  # [MQTT-3.1.3-11]
        except InvalidTopic as exc:
            raise ProtocolError(f"will topic: {exc}", ReasonCode.TOPIC_NAME_INVALID) from exc
        if will.topic.count("/") >= self.broker.settings.max_topic_levels:
            raise ProtocolError(
                f"will topic of more than {self.broker.settings.max_topic_levels} levels",
                ReasonCode.TOPIC_NAME_INVALID,
            )
        # Will Delay is a property of the will, not of the message it becomes.
        message_props = will.properties
        if message_props.will_delay_interval is not None:
            message_props = dataclasses.replace(message_props, will_delay_interval=None)
        will_publish = Publish(
            topic=will.topic,
            payload=will.payload,
            qos=will.qos,
            retain=will.retain,
            properties=message_props,
        )
        # The will becomes a publish of this client: checked like one, now, while the CONNACK
        # can still refuse it (ACL, "$" topics, payload limit) [MQTT-3.2.2-12].
        refusal, event = self.broker.tenancy.refuse_publish(self, will_publish, action="will")
        if event is not None:
            self.broker.log_events((event,))
        if refusal is not None:
            self.send(Connack(reason_code=refusal if v5 else ConnackCode311.NOT_AUTHORIZED))
            self.close(None)
            return False
        self.will = will_publish
        self.will_delay = will.properties.will_delay_interval or 0
        return True

    def _on_publish(self, packet: Publish, now: float) -> None:
        if packet.properties is not NO_PROPERTIES:
            if packet.properties.subscription_identifiers:
                # Only the server sends subscription identifiers [MQTT-3.3.4-6].
                raise ProtocolError(
                    "PUBLISH from a client with a subscription identifier",
                    ReasonCode.PROTOCOL_ERROR,
                )
            if packet.properties.topic_alias is not None:
                packet = self._resolve_alias(packet)
        topic = packet.topic
        broker = self.broker
        if topic not in broker.valid_topics:
            self._learn_topic(topic)
        qos = packet.qos
        session = self.session
        assert session is not None
        pid = packet.packet_id
        if qos == _QOS2 and pid is not None and pid in session.awaiting_rel:
            # A resent QoS 2 PUBLISH we already accepted: acknowledge again, deliver once
            # [MQTT-4.3.3-10].
            self.send(Pubrec(packet_id=pid))
            return
        if (
            topic[0] == "$"
            or self.acl is not ALLOW_ALL
            or self.max_payload
            or broker.tenancy.blocked
        ):
            refusal, event = broker.tenancy.refuse_publish(self, packet)
            if event is not None:
                broker.log_events((event,))
            if refusal is not None:
                if (
                    refusal == ReasonCode.QUOTA_EXCEEDED
                    and qos != QoS.AT_MOST_ONCE
                    and self.version != ProtocolVersion.MQTT_5
                    and self.tenant in broker.tenancy.blocked
                ):
                    # 3.1.1 cannot refuse a QoS 1/2 publish: leave it unacknowledged and close.
                    self.close(None)
                    return
                self._ack_refused(packet, refusal)
                return
        if broker.journal_refusal and not (
            # The lake's commit notice is not journaled, and it is what lets retention free
            # a full journal: never refuse it.
            self.operator and topic.startswith(JOURNAL_CONTROL_TOPIC_PREFIX)
        ):
            self._refuse_for_journal(packet, broker.journal_refusal)
            return
        if self.rate:
            self.bucket, pause = take_token(self.bucket, self.bucket_at, self.rate, now)
            self.bucket_at = now
            if pause > 0 and not self.paused_for & PAUSED_BY_RATE:
                # Over its message rate: stop reading from this client for a while (it is
                # slowed, nothing it sent is dropped). Publishes later in the same read overdraw
                # the bucket further; the read after the resume pays for them.
                self.pause(PAUSED_BY_RATE)
                self.resume_at = now + pause
                broker.rate_paused.add(self)
                broker.wake_at(self.resume_at)  # broker.tick resumes it then
        if qos != _QOS0:
            self.inbound_unacked += 1
            if (
                self.inbound_unacked > self.broker.settings.max_inflight_messages
                and self.version == ProtocolVersion.MQTT_5
            ):
                # More unacknowledged QoS 1/2 publishes than our receive maximum [MQTT-3.3.4-9].
                raise ProtocolError("receive maximum exceeded", ReasonCode.RECEIVE_MAXIMUM_EXCEEDED)
        seq = broker.accept_publish(self, packet, now)
        if (
            broker.journal.backlog > broker.settings.max_journal_backlog
            and not self.paused_for & PAUSED_BY_JOURNAL
        ):
            # The journal is behind: stop reading from this publisher until it catches up,
            # rather than accept what we cannot make durable.
            broker.stats.reads_paused += 1
            self.pause(PAUSED_BY_JOURNAL)
            broker.paused_readers.add(self)
        if qos == _QOS0:
            return
        assert pid is not None
        if qos == _QOS2:
            session.hold_rel(pid)
        broker.after_durable(seq, self, pid, qos)

    def _learn_topic(self, topic: str) -> None:
        """Check a topic name not seen lately and remember it as valid."""
        broker = self.broker
        try:
            validate_topic_name(topic)
        except InvalidTopic as exc:
            raise ProtocolError(str(exc), ReasonCode.TOPIC_NAME_INVALID) from exc
        if topic.count("/") >= broker.settings.max_topic_levels:
            raise ProtocolError(
                f"topic name of more than {broker.settings.max_topic_levels} levels",
                ReasonCode.TOPIC_NAME_INVALID,
            )
        valid = broker.valid_topics
        if (
            len(valid) >= VALID_TOPIC_CACHE
            or broker.valid_topic_chars + len(topic) > VALID_TOPIC_CACHE_CHARS
        ):
            valid.clear()
            broker.valid_topic_chars = 0
        valid.add(topic)
        broker.valid_topic_chars += len(topic)

    def _resolve_alias(self, packet: Publish) -> Publish:
        """Apply an inbound topic alias [MQTT-3.3.2.3.4]."""
        alias = packet.properties.topic_alias
        assert alias is not None
        if not 0 < alias <= self.broker.settings.topic_alias_maximum:
            # [MQTT-3.3.2-9] [MQTT-3.3.2-10]
            raise ProtocolError(f"topic alias {alias} out of range", ReasonCode.TOPIC_ALIAS_INVALID)
        aliases = self._alias_in
        if aliases is None:
            aliases = self._alias_in = {}
        if packet.topic:
            aliases[alias] = packet.topic
            return packet
        topic = aliases.get(alias)
        if topic is None:
            raise ProtocolError(f"topic alias {alias} was never set", ReasonCode.PROTOCOL_ERROR)
        return dataclasses.replace(packet, topic=topic)

    def ack_durable(self, packet_id: int, qos: QoS) -> None:
        """The journal made an inbound publish durable: acknowledge it now."""
        if qos == QoS.AT_LEAST_ONCE:
            self.inbound_unacked -= 1
            # PUBACK 0x00 without properties is the same four bytes in 3.1.1 and 5.0 (the
            # reason code may be omitted when it is 0 [MQTT-3.4.2.1]): no encoder needed.
            self.emit(b"\x40\x02" + packet_id.to_bytes(2, "big"))
        else:
            self.send(Pubrec(packet_id=packet_id))

    def _refuse_for_journal(self, packet: Publish, reason: int) -> None:
        """The journal is full or failing: nothing can be made durable, so nothing is taken.
        QoS 0 is dropped and counted; QoS 1/2 is refused (MQTT 5, ``reason``), or, since 3.1.1
        has no negative acknowledgement, the connection is closed and the client resends."""
        broker = self.broker
        if packet.qos == _QOS0:
            broker.journal_dropped += 1
            broker.stats.dropped += 1
            return
        broker.journal_refused += 1
        if self.version == ProtocolVersion.MQTT_5:
            self._ack_refused(packet, reason)
        else:
            self.close(None)

    def refuse_undurable(self, packet_id: int, qos: QoS) -> None:
        """The journal frame holding an inbound QoS 1/2 publish failed: it was not taken.
        MQTT 5: PUBACK/PUBREC 0x80 (unspecified error) [MQTT-3.4.2.1]; 3.1.1: close (the
        client resends after reconnecting, [MQTT-4.4.0-1])."""
        if self.closing:
            return
        self.broker.journal_refused += 1
        if self.version != ProtocolVersion.MQTT_5:
            self.close(None)
            return
        if qos == QoS.AT_LEAST_ONCE:
            self.inbound_unacked -= 1
            self.send(Puback(packet_id=packet_id, reason_code=ReasonCode.UNSPECIFIED_ERROR))
        else:
            # A PUBREC >= 0x80 ends the exchange: no PUBREL follows [MQTT-4.3.3-4].
            assert self.session is not None
            self.session.release_rel(packet_id)
            self.inbound_unacked -= 1
            self.send(Pubrec(packet_id=packet_id, reason_code=ReasonCode.UNSPECIFIED_ERROR))

    def _ack_refused(self, packet: Publish, reason: int) -> None:
        """Acknowledge a refused QoS 1/2 publish: MQTT 5 with the reason code; 3.1.1 has no
        negative acknowledgement, so it gets a plain one (the message is dropped)."""
        pid = packet.packet_id
        if pid is None:
            return
        code = reason if self.version == ProtocolVersion.MQTT_5 else 0
        if packet.qos == QoS.AT_LEAST_ONCE:
            self.send(Puback(packet_id=pid, reason_code=code))
        else:
            self.send(Pubrec(packet_id=pid, reason_code=code))

    def _on_pubrel(self, packet: Pubrel, now: float) -> None:
        assert self.session is not None
        found = self.session.release_rel(packet.packet_id)
        if found:
            self.inbound_unacked -= 1
        reason = 0 if found or self.version != ProtocolVersion.MQTT_5 else 0x92
        self.send(Pubcomp(packet_id=packet.packet_id, reason_code=reason))

    def _on_puback(self, packet: Puback, now: float) -> None:
        self.broker.delivery_acked(self, packet.packet_id, Puback)

    def _on_pubrec(self, packet: Pubrec, now: float) -> None:
        if self.broker.delivery_acked(self, packet.packet_id, Pubrec):
            self.send(Pubrel(packet_id=packet.packet_id))

    def _on_pubcomp(self, packet: Pubcomp, now: float) -> None:
        self.broker.delivery_acked(self, packet.packet_id, Pubcomp)

    def _on_subscribe(self, packet: Subscribe, now: float) -> None:
        v5 = self.version == ProtocolVersion.MQTT_5
        codes: list[int] = []
        accepted: list[tuple[str | None, str, Subscription]] = []
        ids = packet.properties.subscription_identifiers
        assert self.session is not None
        held = set(self.session.subscriptions)
        capped = False  # a filter refused for max_subscriptions_per_client
        for sub in packet.subscriptions:
            try:
                group, topic_filter = parse_subscription_filter(sub.topic_filter)
            except InvalidTopic:
                codes.append(ReasonCode.TOPIC_FILTER_INVALID if v5 else SUBACK_FAILURE_311)
                continue
            refusal = self._over_limits(sub.topic_filter, topic_filter, held)
            if refusal is not None:
                capped = capped or refusal == ReasonCode.QUOTA_EXCEEDED
                codes.append(refusal if v5 else SUBACK_FAILURE_311)
                continue
            if group is not None and sub.no_local:
                # No Local on a shared subscription is a protocol error [MQTT-3.8.3-4].
                raise ProtocolError("no-local on a shared subscription", ReasonCode.PROTOCOL_ERROR)
            if not self.acl.may_subscribe(topic_filter):
                self.broker.log(
                    self.tenant,
                    "acl_denied",
                    self.client_id,
                    {"action": "subscribe", "topic_filter": sub.topic_filter},
                )
                codes.append(ReasonCode.NOT_AUTHORIZED if v5 else SUBACK_FAILURE_311)
                continue
            codes.append(int(sub.qos))
            accepted.append((group, topic_filter, sub))
            held.add(sub.topic_filter)
        # SUBACK before the retained messages the subscriptions bring [MQTT-3.8.4-1].
        self.send(Suback(packet_id=packet.packet_id, reason_codes=tuple(codes)))
        self.broker.subscribe(self, accepted, ids[0] if ids else None)
        if capped:
            # One event per SUBSCRIBE, not per filter refused: the log costs the journal too.
            self.broker.log(
                self.tenant,
                "limit_exceeded",
                self.client_id,
                {
                    "limit": "max_subscriptions_per_client",
                    "value": self.broker.settings.max_subscriptions_per_client,
                },
            )
        self.broker.log(
            self.tenant,
            "subscribe",
            self.client_id,
            {
                "topic_filters": [s.topic_filter for s in packet.subscriptions],
                "reason_codes": [int(c) for c in codes],
            },
        )

    def _over_limits(self, full: str, topic_filter: str, held: set[str]) -> int | None:
        """The reason code refusing a filter over the edge's limits, or None. ``held``: the
        session's filters, those accepted earlier in this SUBSCRIBE included."""
        settings = self.broker.settings
        if topic_filter.count("/") >= settings.max_topic_levels:
            return ReasonCode.TOPIC_FILTER_INVALID
        if full not in held and len(held) >= settings.max_subscriptions_per_client:
            # Each filter costs every publish in the namespace a walk of its levels.
            return ReasonCode.QUOTA_EXCEEDED
        return None

    def _on_unsubscribe(self, packet: Unsubscribe, now: float) -> None:
        found = self.broker.unsubscribe(self, packet.topic_filters)
        v5 = self.version == ProtocolVersion.MQTT_5
        codes = tuple(0 if f else ReasonCode.NO_SUBSCRIPTION_EXISTED for f in found) if v5 else ()
        self.send(Unsuback(packet_id=packet.packet_id, reason_codes=codes))
        self.broker.log(
            self.tenant,
            "unsubscribe",
            self.client_id,
            {"topic_filters": list(packet.topic_filters), "found": found},
        )

    def _on_pingreq(self, packet: Pingreq, now: float) -> None:
        self.send(Pingresp())

    def _on_disconnect(self, packet: Disconnect, now: float) -> None:
        expiry = packet.properties.session_expiry_interval
        if expiry is not None and self.version == ProtocolVersion.MQTT_5:
            # The client may change its session's expiry on the way out [MQTT-3.14.2.2.2], but
            # not make a session persistent that it opened with 0 [MQTT-3.14.2-2]: that is a
            # protocol error, answered with DISCONNECT 0x82, and the will is published.
            self.broker.set_session_expiry(self, expiry)
        # A normal DISCONNECT discards the will [MQTT-3.1.2-10]; v5 0x04 keeps it.
        if packet.reason_code != ReasonCode.DISCONNECT_WITH_WILL:
            self.will = None
        self.clean_disconnect = True
        self.close(None, send_disconnect=False)

    def _on_auth(self, packet: Auth, now: float) -> None:
        # No enhanced authentication method is offered, so AUTH is a protocol error
        # [MQTT-4.12.0-1].
        raise ProtocolError("AUTH without an authentication method", ReasonCode.PROTOCOL_ERROR)


class ConnectionIO(Protocol):
    """What a connection needs of its transport (the listener's protocol object)."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class _NoIO:
    """A connection's transport until the listener sets one: output goes nowhere."""

    __slots__ = ()

    def write(self, data: bytes) -> None:
        del data

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


NO_IO: ConnectionIO = _NoIO()
_NO_OUTPUT: list[bytes] = []  # see Connection.out
_NO_USAGE = TenantUsage()  # replaced at CONNECT; nothing is counted before


_HANDLERS: dict[type, Callable[[Connection, object, float], None]] = {
    Connect: Connection._on_connect,  # type: ignore[dict-item]
    Publish: Connection._on_publish,  # type: ignore[dict-item]
    Puback: Connection._on_puback,  # type: ignore[dict-item]
    Pubrec: Connection._on_pubrec,  # type: ignore[dict-item]
    Pubrel: Connection._on_pubrel,  # type: ignore[dict-item]
    Pubcomp: Connection._on_pubcomp,  # type: ignore[dict-item]
    Subscribe: Connection._on_subscribe,  # type: ignore[dict-item]
    Unsubscribe: Connection._on_unsubscribe,  # type: ignore[dict-item]
    Pingreq: Connection._on_pingreq,  # type: ignore[dict-item]
    Disconnect: Connection._on_disconnect,  # type: ignore[dict-item]
    Auth: Connection._on_auth,  # type: ignore[dict-item]
}
