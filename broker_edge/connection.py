"""Protocol state machine of one client connection (sans-IO, h11-style).

Theory of operation
-------------------
Bytes and time in, events out; events in, bytes out. The wiring (the broker's handlers, driven
by the listener) feeds what the socket read to :meth:`Connection.receive_data` and pulls
:meth:`Connection.next_event` until it returns None. Each event is the decoded packet itself
(frozen values; no second object per publish), already checked against the transition table of
:mod:`broker_edge.states` and the per-connection rules: topic aliases resolved, topic names
validated, the receive maximum counted, PINGREQ answered, AUTH refused. Answers go the other
way through methods (:meth:`accept`, :meth:`ack_durable`, :meth:`deliver_qos0`, ...) that queue
bytes; :meth:`data_to_send` hands them over, one ``transport.write`` per turn.

The machine holds no broker, no transport and no timer: it says when it next needs the clock
(:meth:`deadline`) and is told the time with each input. The listener's handle for this
connection (``io``) is stored for the wiring and never called from here.

A peer that breaks the protocol raises :class:`~broker_edge.errors.ProtocolError` out of
``next_event``; :meth:`protocol_failure` turns it into CONNACK/DISCONNECT with its reason code.
Our own misuse of the machine raises :class:`~broker_edge.errors.LocalProtocolError`.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Protocol

from broker_edge.codec import Decoder, encode, encode_publish
from broker_edge.errors import ProtocolError, UnsupportedProtocol
from broker_edge.packets import (
    NO_PROPERTIES,
    Auth,
    Connack,
    ConnackCode311,
    Disconnect,
    Packet,
    Pingreq,
    Properties,
    ProtocolVersion,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    QoS,
    ReasonCode,
)
from broker_edge.plim import TenantUsage
from broker_edge.states import RECEIVABLE, ConnEvent, ConnState, conn_step
from broker_edge.tenancy import take_token
from broker_edge.tenants import ALLOW_ALL, Acl
from broker_edge.topics import InvalidTopic, validate_topic_name

if TYPE_CHECKING:
    from broker_edge.message import Message
    from broker_edge.settings import EdgeSettings
    from broker_edge.tenancy import Admission

__all__ = ["ConnLimits", "ConnState", "Connection", "ConnectionIO", "TopicCache"]

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
PAUSED_BY_ROUTING = 4  # packets of an earlier read still to handle (see Broker.receive)
PAUSED_BY_BACKLOG = 8  # its own records awaiting the journal are over the per-client bound
PAUSED_BY_CLAIM = 16  # its CONNECT waits for the mesh's peers (broker_edge.handover)

# What a journal record costs while it waits for its commit, beyond its topic and payload (the
# writer's buffered Python values), for the per-client bound on that backlog.
RECORD_OVERHEAD = 256

# Topic names already validated, shared by every connection of a broker (bounded: cleared when
# full, by count and by characters, so long distinct topics cannot pile up in it). Devices
# publish to the same few topics over and over.
VALID_TOPIC_CACHE = 16_384
VALID_TOPIC_CACHE_CHARS = 2**20

_PINGRESP = b"\xd0\x00"
_QOS_OF = itemgetter(2)  # of a durable_acks entry (seq, packet id, QoS)
_NO_OUTPUT: list[bytes] = []  # see Connection.out
_NO_USAGE = TenantUsage()  # replaced at CONNECT; nothing is counted before

# Per-message code compares with these aliases: on Python 3.11 reading an enum member through
# its class (QoS.AT_MOST_ONCE) costs ~70 ns.
_CONNECTED = ConnState.CONNECTED
_CLOSED = ConnState.CLOSED
_QOS0 = QoS.AT_MOST_ONCE
_V5 = ProtocolVersion.MQTT_5


@dataclass(frozen=True, slots=True)
class ConnLimits:
    """The edge's settings a connection obeys, read once per broker and shared."""

    max_packet_size: int
    max_topic_levels: int
    topic_alias_maximum: int
    receive_maximum: int  # our receive maximum: max_inflight_messages
    max_keepalive: int
    connect_timeout: float
    max_backlog_bytes: int  # max_journal_backlog_bytes_per_client

    @classmethod
    def of(cls, settings: EdgeSettings) -> ConnLimits:
        return cls(
            settings.max_packet_size,
            settings.max_topic_levels,
            settings.topic_alias_maximum,
            settings.max_inflight_messages,
            settings.max_keepalive,
            settings.connect_timeout,
            settings.max_journal_backlog_bytes_per_client,
        )


class TopicCache:
    """Topic names validated lately, shared by a broker's connections."""

    __slots__ = ("chars", "names")

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.chars = 0

    def learn(self, topic: str, max_levels: int) -> None:
        """Check a topic name not seen lately and remember it as valid."""
        try:
            validate_topic_name(topic)
        except InvalidTopic as exc:
            raise ProtocolError(str(exc), ReasonCode.TOPIC_NAME_INVALID) from exc
        if topic.count("/") >= max_levels:
            raise ProtocolError(
                f"topic name of more than {max_levels} levels", ReasonCode.TOPIC_NAME_INVALID
            )
        names = self.names
        if len(names) >= VALID_TOPIC_CACHE or self.chars + len(topic) > VALID_TOPIC_CACHE_CHARS:
            names.clear()
            self.chars = 0
        names.add(topic)
        self.chars += len(topic)


class ConnectionIO(Protocol):
    """What the wiring needs of a connection's transport (the listener's protocol object)."""

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


class Connection:
    """One client's side of the protocol: CONNECT to DISCONNECT."""

    # One per client: slots keep an idle connection small (no per-instance __dict__).
    __slots__ = (
        "_alias_in",
        "_alias_out",
        "_receivable",
        "acl",
        "alias_out_max",
        "bucket",
        "bucket_at",
        "clean_disconnect",
        "client_id",
        "close_reason",
        "closing",
        "connected_at",
        "decoder",
        "durable_acks",
        "inbound_unacked",
        "io",
        "journal_bytes",
        "keepalive",
        "last_rx",
        "limits",
        "max_packet_out",
        "max_payload",
        "operator",
        "out",
        "paused_for",
        "peer",
        "rate",
        "receive_maximum_out",
        "resume_at",
        "state",
        "tenant",
        "token",
        "topics",
        "turn_bytes",
        "usage",
        "version",
        "will",
        "will_delay",
        "write_paused",
    )

    def __init__(
        self,
        peer: str,
        now: float,
        limits: ConnLimits,
        topics: TopicCache,
        io: ConnectionIO = NO_IO,
    ) -> None:
        self.peer = peer
        self.limits = limits
        self.topics = topics
        # Before CONNECT only a CONNECT may arrive, and a CONNECT is far below 1 MiB (five
        # fields of at most 65,535 bytes plus properties): a peer cannot make us buffer more.
        self.decoder = Decoder(max_packet_size=min(limits.max_packet_size, CONNECT_MAX))
        self.state = ConnState.AWAIT_CONNECT
        self._receivable = RECEIVABLE[self.state]
        self.version = ProtocolVersion.MQTT_3_1_1
        self.client_id = ""
        self.tenant = ""
        self.keepalive = 0
        self.last_rx = now
        self.connected_at = now
        self.will: Publish | None = None
        self.will_delay = 0
        self.clean_disconnect = False
        # The listener's handle for this connection: kept for the wiring, never called here.
        self.io = io
        self.paused_for = 0  # PAUSED_BY_* bits
        # MQTT 5 limits the client declared in CONNECT (3.1.1: none).
        self.receive_maximum_out = 65_535
        self.max_packet_out = 0  # 0: no limit
        self.alias_out_max = 0
        self._alias_out: dict[str, int] | None = None
        self._alias_in: dict[int, str] | None = None
        self.inbound_unacked = 0  # QoS 1/2 publishes received and not yet fully acknowledged
        # Bytes of this client's journal records not yet durable (see end_turn), and those of
        # the publishes of the current turn.
        self.journal_bytes = 0
        self.turn_bytes = 0
        # The QoS 1/2 publishes of the current turn that the node took, (seq, packet id, QoS):
        # acknowledged together once the journal has the turn (see take_acks), not one waiter
        # each. None when there are none (an idle connection holds no list).
        self.durable_acks: list[tuple[int, int, int]] | None = None
        # Tenancy: what the policy admitted at CONNECT (broker_edge.tenancy.Admission).
        self.token: str | None = None
        self.acl: Acl = ALLOW_ALL
        self.operator = False
        self.usage = _NO_USAGE
        self.max_payload = 0  # 0: no limit beyond the protocol's
        self.rate = 0.0  # messages per second allowed (token bucket); 0: unlimited
        self.bucket = 0.0
        self.bucket_at = now
        self.resume_at = 0.0  # paused for its rate: when to read again
        # Packets to write at the end of the turn. Shared and never appended to while empty
        # (emit replaces it): an idle connection holds no list of its own.
        self.out: list[bytes] = _NO_OUTPUT
        self.write_paused = False
        self.closing = False
        self.close_reason: int | None = None

    # -- bytes and time in, events out ---------------------------------------------------------

    def receive_data(self, data: bytes, now: float) -> None:
        """Buffer what the socket read at ``now``."""
        self.last_rx = now
        self.decoder.feed(data)

    def next_event(self) -> Packet | None:
        """The next packet the wiring must act on, or None when more bytes are needed (or the
        connection is closing). Raises ProtocolError when the peer broke the protocol."""
        decoder = self.decoder
        while not self.closing:
            packet = decoder.next_packet()
            if packet is None:
                return None
            kind = type(packet)
            if kind not in self._receivable:
                raise ProtocolError(
                    f"{kind.__name__} not allowed in state {self.state.name}",
                    ReasonCode.PROTOCOL_ERROR,
                )
            if kind is Publish:
                # The per-publish hot path: inline, no helper call a branch can avoid.
                publish: Publish = packet  # type: ignore[assignment]
                if publish.properties is not NO_PROPERTIES:
                    publish = self._publish_properties(publish)
                topic = publish.topic
                topics = self.topics
                if topic not in topics.names:
                    topics.learn(topic, self.limits.max_topic_levels)
                # What its journal record will hold until durable (see end_turn).
                self.turn_bytes += len(publish.payload) + len(topic) + RECORD_OVERHEAD
                if publish.qos:
                    # An inbound QoS 1/2 exchange opens (states.Flow.IN_QOS1 / IN_QOS2).
                    self.inbound_unacked += 1
                    if self.inbound_unacked > self.limits.receive_maximum and self.version == _V5:
                        # More unacknowledged QoS 1/2 publishes than our receive maximum
                        # [MQTT-3.3.4-9].
                        raise ProtocolError(
                            "receive maximum exceeded", ReasonCode.RECEIVE_MAXIMUM_EXCEEDED
                        )
                return publish
            if kind is Pingreq:
                self.emit(_PINGRESP)
                continue
            if kind is Auth:
                # No enhanced authentication method is offered [MQTT-4.12.0-1].
                raise ProtocolError(
                    "AUTH without an authentication method", ReasonCode.PROTOCOL_ERROR
                )
            return packet
        return None

    def take_run(
        self, publish: Publish, max_count: int, max_bytes: int
    ) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """After ``publish`` (the event just returned: QoS 0 or 1 without DUP, RETAIN or
        properties, so it has its ``wire``), the publishes straight behind it in the same read
        that are the same but for their payloads (and packet ids): their payloads, packet ids
        and bytes (``Decoder.same_publishes``), taken as events of their own would be: counted
        for the journal's backlog, and at QoS 1 each opens its exchange (states.Flow.IN_QOS1).
        At most ``max_count`` and ``max_bytes`` of payload; an MQTT 5 run at QoS 1 stops at
        our receive maximum (the publish over it comes from ``next_event``, which refuses
        it). None when the next packet is not one of them.

        Devices and gateways send runs of one topic; the wiring handles such a run as a whole
        (one routing, one journal append: ``Broker.accept_run``) when nothing about the client
        asks for a look at each publish. The machine does not know when that is: it never
        returns a run from ``next_event``.
        """
        wire = publish.wire
        qos = publish.qos
        if wire is None or qos > 1 or self.closing:
            return None
        if qos and self.version == _V5:
            max_count = min(max_count, self.limits.receive_maximum - self.inbound_unacked)
        head = 2 if wire[1] < 0x80 else 3  # the decoder's fast path: a 1- or 2-byte length
        topic = wire[head : head + 2 + ((wire[head] << 8) | wire[head + 1])]
        run = self.decoder.same_publishes(qos, topic, max_count, max_bytes)
        if run is not None:
            payloads = run[0]
            if qos:
                self.inbound_unacked += len(payloads)
            self.turn_bytes += sum(map(len, payloads)) + len(payloads) * (
                len(publish.topic) + RECORD_OVERHEAD
            )
        return run

    def take_pubacks(self, max_count: int) -> list[int] | None:
        """After a PUBACK (the event just returned), the packet ids of the plain PUBACKs straight
        behind it in the same read (``Decoder.same_pubacks``), at most ``max_count``: a
        subscriber acknowledges the deliveries of one write in one. None when the next packet
        is not one."""
        if self.closing:
            return None
        return self.decoder.same_pubacks(max_count)

    def _publish_properties(self, packet: Publish) -> Publish:
        props = packet.properties
        if props.subscription_identifiers:
            # Only the server sends subscription identifiers [MQTT-3.3.4-6].
            raise ProtocolError(
                "PUBLISH from a client with a subscription identifier", ReasonCode.PROTOCOL_ERROR
            )
        if props.topic_alias is not None:
            return self._resolve_alias(packet)
        return packet

    def _resolve_alias(self, packet: Publish) -> Publish:
        """Apply an inbound topic alias [MQTT-3.3.2.3.4]."""
        alias = packet.properties.topic_alias
        assert alias is not None
        if not 0 < alias <= self.limits.topic_alias_maximum:
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

    def peer_disconnected(self, reason_code: int) -> None:
        """The client's DISCONNECT was taken: close without an answer."""
        # A normal DISCONNECT discards the will [MQTT-3.1.2-10]; v5 0x04 keeps it.
        if reason_code != ReasonCode.DISCONNECT_WITH_WILL:
            self.will = None
        self.clean_disconnect = True
        self.close(None, send_disconnect=False)

    # -- time --------------------------------------------------------------------------------

    def deadline(self) -> float:
        """When this connection must be looked at again if nothing is received: the end of
        the CONNECT timeout, or 1.5 x its keepalive after the last read [MQTT-3.1.2-24];
        ``inf`` when never."""
        if self.state is ConnState.AWAIT_CONNECT:
            return self.connected_at + self.limits.connect_timeout
        if self.keepalive and self.state is _CONNECTED:
            return self.last_rx + 1.5 * self.keepalive
        return float("inf")

    def take_token(self, now: float) -> float:
        """Charge one publish to the rate limit: seconds to pause reading, or 0."""
        self.bucket, pause = take_token(self.bucket, self.bucket_at, self.rate, now)
        self.bucket_at = now
        if pause > 0 and not self.paused_for & PAUSED_BY_RATE:
            self.resume_at = now + pause
            return pause
        return 0.0

    # -- events in: the CONNECT ---------------------------------------------------------------

    def connect_received(self, version: ProtocolVersion, client_id: str, keepalive: int) -> int:
        """A CONNECT arrived: its protocol version, the client id (assigned when empty) and the
        keepalive, capped; returns the keepalive to announce (v5 Server Keep Alive) or -1."""
        self.version = version
        self.client_id = client_id
        announce = -1
        if keepalive > self.limits.max_keepalive:
            keepalive = self.limits.max_keepalive
            if version == _V5:
                announce = keepalive
        self.keepalive = keepalive
        return announce

    def refuse(self, code: int) -> None:
        """Refuse the CONNECT with ``code`` (3.1.1 or 5.0 by the client's version) and close."""
        self.send(Connack(reason_code=code))
        self.close(None)

    def admit(self, admission: Admission, token: str | None) -> None:
        """What the tenancy policy granted this client."""
        self.tenant, self.acl, self.operator = admission.tenant, admission.acl, admission.operator
        self.token = token
        self.usage = admission.usage
        self.max_payload, self.rate = admission.max_payload, admission.rate
        self.bucket = self.rate

    def regrant(self, admission: Admission) -> None:
        """New rules for the same token and tenant (tenants file reloaded)."""
        self.acl, self.operator = admission.acl, admission.operator
        self.max_payload, self.rate = admission.max_payload, admission.rate
        self.decoder.max_packet_size = self.packet_limit()

    def keep_will(self, will: Publish | None, delay: int = 0) -> None:
        """The will to publish if the connection ends without DISCONNECT; None drops it."""
        self.will = will
        self.will_delay = delay

    def take_will(self) -> Publish | None:
        will, self.will = self.will, None
        return will

    def accept(self, session_present: bool, assigned: str | None, server_keepalive: int,
               client_props: Properties | None) -> None:  # fmt: skip
        """Send CONNACK 0: the connection is open. ``client_props``: the v5 CONNECT's
        properties (the limits the client declared)."""
        self.state = conn_step(self.state, ConnEvent.ACCEPTED)
        self._receivable = RECEIVABLE[self.state]
        limits = self.limits
        if client_props is not None:
            self.receive_maximum_out = client_props.receive_maximum or 65_535
            self.max_packet_out = client_props.maximum_packet_size or 0
            # Never more aliases than we accept ourselves: each holds a topic name (up to
            # 64 KiB) for as long as the connection lives.
            self.alias_out_max = min(
                client_props.topic_alias_maximum or 0, limits.topic_alias_maximum
            )
        self.decoder.max_packet_size = self.packet_limit()
        props = NO_PROPERTIES
        if self.version == _V5:
            size = self.decoder.max_packet_size
            props = Properties(
                assigned_client_identifier=assigned,
                server_keep_alive=server_keepalive if server_keepalive >= 0 else None,
                receive_maximum=limits.receive_maximum,
                topic_alias_maximum=limits.topic_alias_maximum or None,
                maximum_packet_size=size if size < 268_435_460 else None,
            )
        self.send(Connack(session_present=session_present, reason_code=0, properties=props))

    def packet_limit(self) -> int:
        """The largest packet this client may send: the edge's maximum packet size, lowered
        to what the tenant's max_payload_bytes can use. The decoder refuses a bigger one from
        its fixed header [MQTT-3.2.2-15], so a slow body is never buffered."""
        limit = self.limits.max_packet_size
        if self.max_payload:
            limit = min(limit, self.max_payload + PUBLISH_HEADROOM)
        return limit

    # -- events in: inbound QoS 1/2 (states.Flow.IN_QOS1 / IN_QOS2) ---------------------------

    def ack_durable(self, packet_id: int, qos: int) -> bool:
        """The journal made an inbound publish durable: acknowledge it (Flow DURABLE)."""
        return self.acks_durable([(0, packet_id, qos)])

    def take_acks(self) -> list[tuple[int, int, int]] | None:
        """The turn's publishes awaiting the journal (see ``durable_acks``), handed over."""
        acks, self.durable_acks = self.durable_acks, None
        return acks

    def acks_durable(self, acks: list[tuple[int, int, int]]) -> bool:
        """The journal made these publishes (from :meth:`take_acks`) durable: acknowledge them
        in the order they arrived [MQTT-4.6.0-2], one write for all; True as :meth:`emit`.
        A QoS 1 exchange ends with its PUBACK; a QoS 2 one stays open until PUBREL.
        """
        self.inbound_unacked -= list(map(_QOS_OF, acks)).count(1)
        # PUBACK/PUBREC 0x00 without properties are the same four bytes in 3.1.1 and 5.0 (the
        # reason code may be omitted when it is 0 [MQTT-3.4.2.1]): no encoder needed, one
        # big-endian word each (0x4002 or 0x5002, then the packet id), packed at once.
        words = [(0x40020000 if qos == 1 else 0x50020000) | pid for _, pid, qos in acks]
        return self.emit(struct.pack(f">{len(words)}I", *words))

    def ack_again(self, packet_id: int) -> None:
        """A QoS 2 PUBLISH resent with an id still open: PUBREC again, delivered once
        [MQTT-4.3.3-10]; it opened no new exchange."""
        self.inbound_unacked -= 1
        self.emit(b"\x50\x02" + packet_id.to_bytes(2, "big"))

    def ack_refused(self, packet: Publish, reason: int) -> None:
        """Acknowledge a refused QoS 1/2 publish (Flow REFUSED): MQTT 5 with the reason code;
        3.1.1 has no negative acknowledgement, so it gets a plain one (the message is
        dropped)."""
        pid = packet.packet_id
        if pid is None:
            return
        self.inbound_unacked -= 1
        code = reason if self.version == _V5 else 0
        if packet.qos == QoS.AT_LEAST_ONCE:
            self.send(Puback(packet_id=pid, reason_code=code))
        else:
            self.send(Pubrec(packet_id=pid, reason_code=code))

    def refuse_undurable(self, packet_id: int, qos: int) -> bool:
        """The journal frame holding an inbound QoS 1/2 publish failed: it was not taken.
        MQTT 5: PUBACK/PUBREC 0x80 (unspecified error) [MQTT-3.4.2.1], which ends a QoS 2
        exchange [MQTT-4.3.3-4]; 3.1.1: close (the client resends after reconnecting,
        [MQTT-4.4.0-1]). False when already closing (nothing to do)."""
        if self.closing:
            return False
        if self.version != _V5:
            self.close(None)
            return True
        self.inbound_unacked -= 1
        code = ReasonCode.UNSPECIFIED_ERROR
        if qos == QoS.AT_LEAST_ONCE:
            self.send(Puback(packet_id=packet_id, reason_code=code))
        else:
            self.send(Pubrec(packet_id=packet_id, reason_code=code))
        return True

    def released(self, packet_id: int, found: bool) -> None:
        """PUBREL: the inbound QoS 2 exchange ends with PUBCOMP (v5: 0x92 when it was not
        open)."""
        if found:
            self.inbound_unacked -= 1
        code = 0 if found or self.version != _V5 else ReasonCode.PACKET_IDENTIFIER_NOT_FOUND
        self.emit(_pubcomp(packet_id, code, self.version))

    # -- events in: deliveries (outbound) ------------------------------------------------------

    def deliver_qos0(self, message: Message, retain: bool) -> bool:
        """The QoS 0 hot path: one encoding per message, protocol version and retain flag,
        shared by every subscriber. Only for a client without topic aliases or a maximum
        packet size (those get :meth:`publish_bytes`). True as :meth:`emit`."""
        version = self.version
        key = version * 2 + retain
        if message.enc_key == key:
            data = message.enc
        else:
            encoded = message.encoded
            found = encoded.get(key) if encoded is not None else None
            if found is not None:
                data = found
            else:
                if version == _V5:
                    v5 = self.publish_bytes(message, _QOS0, retain, None, False, (), 0)
                    assert v5 is not None
                    data = v5
                else:  # 3.1.1 has no properties to adjust: straight to the codec
                    data = encode_publish(
                        message.topic, message.payload, 0, retain, False, None, version
                    )
                if message.enc_key < 0:
                    message.enc_key = key
                    message.enc = data
                elif encoded is None:
                    message.encoded = {key: data}
                else:
                    encoded[key] = data
        return self.emit(data)

    def publish_bytes(
        self,
        message: Message,
        qos: int,
        retain: bool,
        packet_id: int | None,
        dup: bool,
        sub_ids: tuple[int, ...],
        now_us: int,
    ) -> bytes | None:
        """The PUBLISH of ``message`` for this client, or None when it exceeds the client's
        maximum packet size (then it is dropped for this client [MQTT-3.1.2-25])."""
        topic: str = message.topic
        props: Properties | None = None
        if self.version == _V5:
            base = message.properties
            changes: dict[str, object] = {}
            expiry = base.message_expiry_interval
            if expiry is not None and now_us:
                # Forward the time left, not the time given [MQTT-3.3.2-6].
                waited = (now_us - message.ts_us) // 1_000_000
                if waited > 0:
                    changes["message_expiry_interval"] = max(expiry - waited, 1)
            if sub_ids:
                changes["subscription_identifiers"] = sub_ids
            if self.alias_out_max:
                alias, known = self._outgoing_alias(topic)
                if alias:
                    changes["topic_alias"] = alias
                    if known:
                        topic = ""  # the alias alone names the topic [MQTT-3.3.2-12]
            if changes:
                base = dataclasses.replace(base, **changes)  # type: ignore[arg-type]
            if base is not NO_PROPERTIES:
                props = base
        data = encode_publish(
            topic, message.payload, qos, retain, dup, packet_id, self.version, props
        )
        if self.max_packet_out and len(data) > self.max_packet_out:
            return None
        return data

    def _outgoing_alias(self, topic: str) -> tuple[int, bool]:
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

    # -- flow control --------------------------------------------------------------------------

    def pause(self, reason: int) -> bool:
        """Stop reading for ``reason`` (a PAUSED_BY_* bit); True when reading must stop now."""
        was = self.paused_for
        self.paused_for = was | reason
        return not was

    def resume(self, reason: int) -> bool:
        """``reason`` no longer holds; True when no reason is left and reading must restart."""
        if self.paused_for & reason:
            self.paused_for &= ~reason
            return not self.paused_for
        return False

    def writing(self, paused: bool) -> None:
        """The transport's write buffer went over (True) or back under its high-water mark."""
        self.write_paused = paused

    def end_turn(self) -> int:
        """This turn's publish bytes, now charged to this client until the journal has them
        (``journaled``); 0 when none. While they are over
        ``max_journal_backlog_bytes_per_client`` its reads stop: the journal's own bound counts
        records, not bytes."""
        pending = self.turn_bytes
        if pending:
            self.turn_bytes = 0
            self.journal_bytes += pending
        return pending

    def journaled(self, size: int) -> bool:
        """``size`` bytes of this client's records no longer wait for the journal; True when
        its reads, paused for that backlog, may resume."""
        self.journal_bytes -= size
        return (
            self.paused_for & PAUSED_BY_BACKLOG != 0
            and self.journal_bytes <= self.limits.max_backlog_bytes // 2
            and self.state is not _CLOSED
        )

    # -- bytes out -----------------------------------------------------------------------------

    def emit(self, data: bytes) -> bool:
        """Queue bytes for the peer; True when they are the first since the last
        :meth:`data_to_send` (the wiring then has this connection to flush)."""
        if self.state is _CLOSED:
            return False
        out = self.out
        if out:
            out.append(data)
            return False
        self.out = [data]
        return True

    def send(self, packet: Packet) -> bool:
        return self.emit(encode(packet, self.version))

    def data_to_send(self) -> bytes:
        """Everything queued, as one write (b"" when nothing)."""
        out = self.out
        if not out:
            return b""
        self.out = _NO_OUTPUT
        return b"".join(out) if len(out) > 1 else out[0]

    def discard_output(self) -> None:
        self.out = _NO_OUTPUT

    def close(
        self,
        reason: int | None = None,
        *,
        send_disconnect: bool = True,
        reason_string: str | None = None,
    ) -> bool:
        """Close after what is queued; MQTT 5 clients first get DISCONNECT with ``reason``
        (and a human-readable reason string, allowed on DISCONNECT whatever the client asked
        [MQTT-3.1.2-29]). False when it was closing already."""
        if self.closing:
            return False
        if (
            send_disconnect
            and reason is not None
            and self.version == _V5
            and self.state is _CONNECTED
        ):
            props = NO_PROPERTIES
            if reason_string:
                props = Properties(reason_string=reason_string[:200])
            self.send(Disconnect(reason_code=reason, properties=props))
        self.close_reason = reason
        self.closing = True
        return True

    def closed(self) -> bool:
        """The wiring wrote the last bytes: True when the transport must close now."""
        if self.closing and self.state is not _CLOSED:
            self.state = conn_step(self.state, ConnEvent.CLOSE)
            self._receivable = RECEIVABLE[self.state]
            return True
        return False

    def lost(self) -> None:
        """The socket is gone: nothing more is read or written."""
        self.state = conn_step(self.state, ConnEvent.CLOSE)
        self._receivable = RECEIVABLE[self.state]
        self.out = _NO_OUTPUT

    def protocol_failure(self, exc: ProtocolError) -> None:
        """The peer broke the protocol: answer with the reason code and close [MQTT-4.13.1-1]."""
        reason = int(exc.reason_code)
        if self.state is ConnState.AWAIT_CONNECT and self.version == _V5:
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
        self.close(reason, reason_string=str(exc))


def _pubcomp(packet_id: int, code: int, version: ProtocolVersion) -> bytes:
    if not code:
        return b"\x70\x02" + packet_id.to_bytes(2, "big")
    return encode(Pubcomp(packet_id=packet_id, reason_code=code), version)
