"""The connection state machine without sockets: bytes in, bytes out, a fake journal."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from broker_edge.broker import Broker
from broker_edge.codec import Decoder, encode
from broker_edge.connection import Connection, ConnState
from broker_edge.errors import ProtocolError
from broker_edge.packets import (
    Connack,
    Connect,
    Packet,
    Pingreq,
    ProtocolVersion,
    Puback,
    Publish,
    QoS,
    ReasonCode,
    Subscribe,
    Subscription,
)
from broker_edge.settings import EdgeSettings


class FakeJournal:
    """Appends in memory; nothing is durable until ``make_durable``."""

    def __init__(self) -> None:
        self.records: list[dict[str, object]] = []
        self.durable = 0
        self.waiters: list[tuple[int, Callable[[], None]]] = []

    FIELDS = ("ts_us", "tenant", "client_id", "topic", "qos", "retain", "payload")

    def append(self, *values: object) -> int:
        self.records.append(dict(zip(self.FIELDS, values, strict=False)))
        return len(self.records)

    def after_durable(self, seq: int, callback: Callable[[], None]) -> None:
        if seq <= self.durable:
            callback()
        else:
            self.waiters.append((seq, callback))

    @property
    def device(self) -> list[dict[str, object]]:
        """Records of device traffic (not the edge's own $log / $counters publishes)."""
        return [r for r in self.records if not str(r["topic"]).startswith("$")]

    @property
    def backlog(self) -> int:
        return len(self.records) - self.durable

    def make_durable(self) -> None:
        self.durable = len(self.records)
        waiting, self.waiters = self.waiters, []
        for seq, callback in waiting:
            assert seq <= self.durable
            callback()


class Peer:
    """A client's view of one Connection: send packets, read decoded replies."""

    def __init__(self, broker: Broker, version: ProtocolVersion) -> None:
        self.broker = broker
        self.version = version
        self.conn = Connection(broker, "test:1", now=0.0)
        self.wire: list[bytes] = []
        self.conn.write = self.wire.append
        self.closed = False

        def _close() -> None:
            self.closed = True

        self.conn.close_transport = _close
        self.decoder = Decoder(protocol_version=version)

    def send(self, packet: Packet, now: float = 0.0) -> None:
        try:
            self.conn.receive(encode(packet, self.version), now)
        except ProtocolError as exc:
            self.conn.protocol_failure(exc)
        self.broker.flush_dirty()

    def replies(self) -> list[Packet]:
        self.decoder.feed(b"".join(self.wire))
        self.wire.clear()
        return list(self.decoder.packets())


@pytest.fixture
def journal() -> FakeJournal:
    return FakeJournal()


@pytest.fixture
def broker(journal: FakeJournal) -> Broker:
    return Broker(EdgeSettings(node_id="unit"), journal, wall_clock_us=lambda: 1_000_000)


def connected(broker: Broker, client_id: str, version: ProtocolVersion) -> Peer:
    peer = Peer(broker, version)
    peer.send(Connect(client_id=client_id, protocol_version=version))
    assert peer.replies() == [Connack(session_present=False, reason_code=0)] or version == 5
    return peer


@pytest.mark.parametrize("version", [ProtocolVersion.MQTT_3_1_1, ProtocolVersion.MQTT_5])
def test_qos1_puback_waits_for_the_journal(broker, journal, version):
    peer = connected(broker, "pub", version)
    peer.replies()
    peer.send(Publish(topic="t/1", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=7))
    assert peer.replies() == []  # journaled, not yet durable: no PUBACK
    assert journal.device[0]["topic"] == "t/1"
    journal.make_durable()
    broker.flush_dirty()
    assert peer.replies() == [Puback(packet_id=7)]


def test_qos0_is_journaled_and_routed(broker, journal):
    sub = connected(broker, "sub", ProtocolVersion.MQTT_3_1_1)
    sub.send(Subscribe(packet_id=1, subscriptions=(Subscription("a/+"),)))
    sub.replies()
    pub = connected(broker, "pub", ProtocolVersion.MQTT_3_1_1)
    pub.send(Publish(topic="a/b", payload=b"hello"))
    assert [r["payload"] for r in journal.device] == [b"hello"]
    (msg,) = sub.replies()
    assert isinstance(msg, Publish)
    assert (msg.topic, msg.payload, msg.qos) == ("a/b", b"hello", QoS.AT_MOST_ONCE)


def test_packet_before_connect_closes(broker):
    peer = Peer(broker, ProtocolVersion.MQTT_3_1_1)
    peer.decoder = Decoder(protocol_version=ProtocolVersion.MQTT_3_1_1)
    with pytest.raises(ProtocolError):
        peer.conn.receive(encode(Pingreq(), ProtocolVersion.MQTT_3_1_1), 0.0)


def test_second_connect_is_a_protocol_error(broker):
    peer = connected(broker, "twice", ProtocolVersion.MQTT_5)
    peer.replies()
    peer.send(Connect(client_id="twice", protocol_version=ProtocolVersion.MQTT_5))
    assert peer.closed
    replies = peer.replies()
    assert [type(p).__name__ for p in replies] == ["Disconnect"]
    assert replies[0].reason_code == ReasonCode.PROTOCOL_ERROR  # type: ignore[union-attr]


def test_wildcard_in_publish_topic_disconnects_v5(broker, journal):
    peer = connected(broker, "bad", ProtocolVersion.MQTT_5)
    peer.replies()
    peer.send(Publish(topic="a/+", payload=b"x"))
    assert peer.closed
    (disconnect,) = peer.replies()
    assert disconnect.reason_code == ReasonCode.TOPIC_NAME_INVALID  # type: ignore[union-attr]
    assert journal.device == []


def test_empty_client_id_with_persistent_session_rejected_311(broker):
    peer = Peer(broker, ProtocolVersion.MQTT_3_1_1)
    peer.send(Connect(client_id="", clean_start=False))
    assert peer.replies() == [Connack(reason_code=0x02)]  # [MQTT-3.1.3-8]
    assert peer.closed
    assert peer.conn.state is ConnState.CLOSED


def test_assigned_client_identifier_v5(broker):
    peer = Peer(broker, ProtocolVersion.MQTT_5)
    peer.send(Connect(client_id="", protocol_version=ProtocolVersion.MQTT_5))
    (connack,) = peer.replies()
    assert isinstance(connack, Connack)
    assert connack.properties.assigned_client_identifier
    assert peer.conn.client_id == connack.properties.assigned_client_identifier


def test_publish_after_disconnect_is_ignored(broker, journal):
    from broker_edge.packets import Disconnect

    peer = connected(broker, "bye", ProtocolVersion.MQTT_3_1_1)
    peer.conn.receive(
        encode(Disconnect(), ProtocolVersion.MQTT_3_1_1)
        + encode(Publish(topic="late", payload=b"x"), ProtocolVersion.MQTT_3_1_1),
        0.0,
    )
    broker.flush_dirty()
    assert journal.device == []
    assert peer.closed


def test_publisher_paused_while_journal_is_behind_and_resumed_after(journal):
    broker = Broker(
        EdgeSettings(node_id="unit", max_journal_backlog=4), journal, wall_clock_us=lambda: 1
    )
    peer = connected(broker, "fast", ProtocolVersion.MQTT_3_1_1)
    journal.make_durable()  # the connect log event
    calls: list[str] = []
    peer.conn.pause_reading = lambda: calls.append("pause")
    peer.conn.resume_reading = lambda: calls.append("resume")
    for i in range(4):
        peer.send(Publish(topic="t", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=i + 1))
    assert calls == []  # 4 records behind: at the limit, still reading
    peer.send(Publish(topic="t", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=5))
    assert calls == ["pause"]
    assert peer.replies() == []  # nothing acknowledged that is not durable
    journal.make_durable()
    broker.after_commit()
    assert calls == ["pause", "resume"]
    assert [p.packet_id for p in peer.replies()] == [1, 2, 3, 4, 5]  # type: ignore[union-attr]


def test_connection_without_connect_is_closed_after_the_timeout(broker):
    peer = Peer(broker, ProtocolVersion.MQTT_3_1_1)
    broker.awaiting_connect.add(peer.conn)
    broker.check_keepalives(now=broker.settings.connect_timeout - 1)
    assert not peer.closed
    broker.check_keepalives(now=broker.settings.connect_timeout + 1)
    assert peer.closed
