"""MQTT 5 features with real paho v5 clients: shared subscriptions, topic aliases, message
expiry, will delay, subscription identifiers, flow control and packet size limits."""

from __future__ import annotations

import queue
import socket
import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

TIMEOUT = 10.0


class V5:
    def __init__(
        self,
        port: int,
        client_id: str,
        *,
        clean_start: bool = True,
        connect_props: Properties | None = None,
        will: tuple[str, bytes, Properties] | None = None,
    ) -> None:
        self.inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        connected: queue.Queue = queue.Queue()
        self.client.on_connect = lambda c, u, f, rc, p: connected.put((f, rc, p))
        self.client.on_message = lambda c, u, m: self.inbox.put(m)
        if will is not None:
            self.client.will_set(will[0], will[1], qos=1, properties=will[2])
        self.client.connect("127.0.0.1", port, clean_start=clean_start, properties=connect_props)
        self.client.loop_start()
        self.flags, rc, self.connack = connected.get(timeout=TIMEOUT)
        assert not rc.is_failure, rc

    def subscribe(self, topic_filter: str, qos: int = 1, props: Properties | None = None) -> None:
        done: queue.Queue = queue.Queue()
        self.client.on_subscribe = lambda c, u, mid, codes, p: done.put(codes)
        self.client.subscribe(topic_filter, options=SubscribeOptions(qos=qos), properties=props)
        codes = done.get(timeout=TIMEOUT)
        assert not codes[0].is_failure, codes

    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int = 1,
        props: Properties | None = None,
        retain: bool = False,
    ) -> None:
        info = self.client.publish(topic, payload, qos=qos, properties=props, retain=retain)
        info.wait_for_publish(TIMEOUT)

    def get(self) -> mqtt.MQTTMessage:
        return self.inbox.get(timeout=TIMEOUT)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def v5(edge):
    made: list[V5] = []

    def _make(client_id: str, **kwargs) -> V5:
        client = V5(edge.port, client_id, **kwargs)
        made.append(client)
        return client

    yield _make
    for client in made:
        client.close()


def test_shared_subscription_gives_each_message_to_one_member(v5):
    a, b = v5("member-a"), v5("member-b")
    plain = v5("plain")
    a.subscribe("$share/workers/jobs/#")
    b.subscribe("$share/workers/jobs/#")
    plain.subscribe("jobs/#")
    pub = v5("producer")
    for i in range(20):
        pub.publish("jobs/x", str(i).encode())
    time.sleep(0.3)
    got_a = [a.inbox.get_nowait().payload for _ in range(a.inbox.qsize())]
    got_b = [b.inbox.get_nowait().payload for _ in range(b.inbox.qsize())]
    assert sorted(got_a + got_b, key=int) == [str(i).encode() for i in range(20)]
    assert got_a, "round-robin spreads the load [MQTT-4.8.2]"
    assert got_b
    assert [plain.get().payload for _ in range(20)] == [str(i).encode() for i in range(20)]


def test_shared_subscription_gets_no_retained_messages(v5):
    pub = v5("retainer")
    pub.publish("state/a", b"kept", retain=True)
    member = v5("late-member")
    member.subscribe("$share/g/state/#")
    pub.publish("state/a", b"live")
    assert member.get().payload == b"live"
    assert member.inbox.empty()


def test_inbound_topic_alias(v5):
    sub = v5("alias-sub")
    sub.subscribe("alias/#")
    pub = v5("alias-pub")
    first = Properties(PacketTypes.PUBLISH)
    first.TopicAlias = 3
    pub.publish("alias/long/topic/name", b"one", props=first)
    again = Properties(PacketTypes.PUBLISH)
    again.TopicAlias = 3
    pub.publish("", b"two", props=again)  # the alias alone names the topic
    got = [sub.get() for _ in range(2)]
    assert [(m.topic, m.payload) for m in got] == [
        ("alias/long/topic/name", b"one"),
        ("alias/long/topic/name", b"two"),
    ]


def test_outbound_topic_alias_when_client_allows(v5):
    props = Properties(PacketTypes.CONNECT)
    props.TopicAliasMaximum = 4
    sub = v5("alias-taker", connect_props=props)
    sub.subscribe("out/#")
    pub = v5("alias-source")
    for i in range(3):
        pub.publish("out/topic", str(i).encode())
    got = [sub.get() for _ in range(3)]
    # paho hands aliases through unresolved: the first delivery sets alias 1 with the topic,
    # later ones carry only the alias [MQTT-3.3.2-12].
    assert [(m.topic, m.payload) for m in got] == [("out/topic", b"0"), ("", b"1"), ("", b"2")]
    assert all(m.properties.TopicAlias == 1 for m in got)


def test_alias_out_of_range_disconnects(edge):
    sock = socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT)
    body = b"\x00\x04MQTT\x05\x02\x00\x3c\x00\x00\x01a"
    sock.sendall(bytes([0x10, len(body)]) + body)
    assert sock.recv(64)[0] == 0x20
    # PUBLISH QoS 0 topic "t", properties: topic alias (0x23) = 1000 > maximum 64
    var = b"\x00\x01t" + b"\x03\x23\x03\xe8"
    sock.sendall(bytes([0x30, len(var) + 1]) + var + b"x")
    data = sock.recv(64)
    assert data[0] == 0xE0
    assert data[2] == 0x94  # Topic Alias invalid [MQTT-3.3.2-9]
    sock.close()


def test_expired_messages_are_not_delivered_from_the_queue(v5):
    expiry = Properties(PacketTypes.CONNECT)
    expiry.SessionExpiryInterval = 300
    sub = v5("expiring", clean_start=False, connect_props=expiry)
    sub.subscribe("exp/#")
    sub.close()
    pub = v5("exp-pub")
    short = Properties(PacketTypes.PUBLISH)
    short.MessageExpiryInterval = 1
    long = Properties(PacketTypes.PUBLISH)
    long.MessageExpiryInterval = 100
    pub.publish("exp/short", b"gone", props=short)
    pub.publish("exp/long", b"kept", props=long)
    time.sleep(2.1)
    again = v5("expiring", clean_start=False, connect_props=expiry)
    msg = again.get()
    assert msg.payload == b"kept"
    # The remaining lifetime is forwarded, not the original [MQTT-3.3.2-6].
    assert 95 <= msg.properties.MessageExpiryInterval < 100
    assert again.inbox.empty()


def test_will_delay_and_reconnect_in_time_cancels_it(v5, edge):
    watcher = v5("will-watcher")
    watcher.subscribe("wills/#")
    session = Properties(PacketTypes.CONNECT)
    session.SessionExpiryInterval = 60
    delayed = Properties(PacketTypes.WILLMESSAGE)
    delayed.WillDelayInterval = 1
    doomed = V5(
        edge.port,
        "delayed-will",
        clean_start=False,
        connect_props=session,
        will=("wills/delayed", b"late", delayed),
    )
    doomed.client.loop_stop()
    doomed.client.socket().close()
    started = time.monotonic()
    msg = watcher.get()
    assert msg.payload == b"late"
    assert time.monotonic() - started >= 0.9  # not before the delay [MQTT-3.1.3-9]

    again = V5(
        edge.port,
        "delayed-will",
        clean_start=False,
        connect_props=session,
        will=("wills/delayed", b"never", delayed),
    )
    again.client.loop_stop()
    again.client.socket().close()
    back = V5(edge.port, "delayed-will", clean_start=False, connect_props=session)
    time.sleep(2.5)
    assert watcher.inbox.empty()  # reconnected within the delay: no will
    back.close()


def test_subscription_identifiers_are_returned(v5):
    sub = v5("ids")
    first = Properties(PacketTypes.SUBSCRIBE)
    first.SubscriptionIdentifier = 7
    sub.subscribe("ids/+/a", props=first)
    second = Properties(PacketTypes.SUBSCRIBE)
    second.SubscriptionIdentifier = 9
    sub.subscribe("ids/#", props=second)
    pub = v5("ids-pub")
    pub.publish("ids/x/a", b"both")
    pub.publish("ids/y", b"one")
    both, one = sub.get(), sub.get()
    assert sorted(both.properties.SubscriptionIdentifier) == [7, 9]  # [MQTT-3.3.4-3]
    assert one.properties.SubscriptionIdentifier == [9]


def test_outbound_maximum_packet_size_is_respected(v5):
    props = Properties(PacketTypes.CONNECT)
    props.MaximumPacketSize = 100
    small = v5("small-client", connect_props=props)
    small.subscribe("size/#")
    pub = v5("size-pub")
    pub.publish("size/big", b"x" * 500)  # over the client's limit: not sent [MQTT-3.1.2-25]
    pub.publish("size/ok", b"fits")
    assert small.get().payload == b"fits"
    assert small.inbox.empty()


def test_receive_maximum_exceeded_disconnects(make_edge):
    edge = make_edge(max_inflight_messages=2, journal_fsync=True)
    sock = socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT)
    body = b"\x00\x04MQTT\x05\x02\x00\x3c\x00\x00\x01r"
    sock.sendall(bytes([0x10, len(body)]) + body)
    connack = sock.recv(64)
    assert connack[0] == 0x20
    # Three QoS 2 publishes never released by PUBREL: the third exceeds receive maximum 2.
    frames = b"".join(
        bytes([0x34, 6]) + b"\x00\x01t" + pid.to_bytes(2, "big") + b"\x00" for pid in (1, 2, 3)
    )
    sock.sendall(frames)
    data = b""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        chunk = sock.recv(256)
        if not chunk:
            break
        data += chunk
    sock.close()
    assert b"\xe0" in data
    at = data.index(b"\xe0")
    assert data[at + 2] == 0x93  # Receive Maximum exceeded [MQTT-3.3.4-9]
