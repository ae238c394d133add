"""$SYS/broker/... statistics over real sockets, read by real paho clients."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from broker_edge.settings import EdgeSettings

TIMEOUT = 10.0
INTERVAL = 0.2
SYS = "$SYS/broker/"


@pytest.fixture
def edge_settings(edge_settings: EdgeSettings) -> EdgeSettings:
    """The module's default edge (the ``edge`` and ``connect`` fixtures) updates $SYS quickly."""
    return replace(edge_settings, sys_interval=INTERVAL)


class SysView:
    """The latest value of every topic a client received, updated as messages arrive."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.latest: dict[str, bytes] = {}

    def wait(self, topic: str, ok: Callable[[bytes], bool] = lambda _: True) -> bytes:
        """Wait until the latest value of ``topic`` satisfies ``ok``; returns it."""
        deadline = time.monotonic() + TIMEOUT
        while topic not in self.latest or not ok(self.latest[topic]):
            try:
                msg = self.client.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{topic} not as expected within {TIMEOUT} s: {self.latest.get(topic)}")
            self.latest[msg.topic] = msg.payload
        return self.latest[topic]

    def next(self, topic: str) -> Any:
        """The next message on ``topic`` (recording the others on the way)."""
        while True:
            msg = self.client.get()
            self.latest[msg.topic] = msg.payload
            if msg.topic == topic:
                return msg


def test_sys_subscriber_sees_clients_traffic_and_uptime(connect):
    watcher = connect()
    watcher.subscribe(SYS + "#")
    view = SysView(watcher)
    assert view.wait(SYS + "version") == b"edgebus 0.1.0"
    assert view.wait(SYS + "uptime").endswith(b" seconds")
    view.wait(SYS + "clients/connected", lambda p: p == b"1")

    pub = connect()
    for i in range(5):
        pub.publish("fleet/v1/telemetry", b"%d" % i, qos=1)

    view.wait(SYS + "clients/connected", lambda p: p == b"2")
    view.wait(SYS + "publish/messages/received", lambda p: p == b"5")
    # At least CONNECT x2, SUBSCRIBE and 5 PUBLISH (plus any PINGREQ), all counted on the wire.
    view.wait(SYS + "messages/received", lambda p: int(p) >= 8)
    view.wait(SYS + "bytes/received", lambda p: int(p) > 5 * 20)
    view.wait(SYS + "messages/sent", lambda p: int(p) > 5)  # CONNACKs, PUBACKs, $SYS ...
    view.wait(SYS + "load/publish/received/1min", lambda p: float(p) > 0)
    assert not view.next(SYS + "uptime").retain  # a periodic update, routed live

    pub.close()
    view.wait(SYS + "clients/connected", lambda p: p == b"1")


def test_sys_store_expired_clients_and_connection_load(connect, edge):
    watcher = connect()
    watcher.subscribe(SYS + "#")
    view = SysView(watcher)
    view.wait(SYS + "store/messages/count", lambda p: p == b"0")
    offline = connect("offline", clean_session=False)
    offline.subscribe("q/#", qos=1)
    offline.close()
    pub = connect()
    pub.publish("q/1", b"12345", qos=1)
    pub.publish("q/2", b"678", qos=1)
    # Held for the offline session (or in flight to a connection that is going away).
    view.wait(SYS + "store/messages/count", lambda p: p == b"2")
    view.wait(SYS + "store/messages/bytes", lambda p: p == b"8")
    view.wait(SYS + "messages/stored", lambda p: p == b"2")
    view.wait(SYS + "load/connections/1min", lambda p: float(p) > 0)
    assert view.latest[SYS + "clients/expired"] == b"0"

    # An MQTT 5 session that expires one second after its client leaves.
    expiring = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id="expiring", protocol=mqtt.MQTTv5
    )
    connected: queue.Queue[Any] = queue.Queue()
    expiring.on_connect = lambda c, u, flags, rc, props: connected.put(rc)
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 1
    expiring.connect("127.0.0.1", edge.port, clean_start=False, properties=props)
    expiring.loop_start()
    assert not connected.get(timeout=TIMEOUT).is_failure
    expiring.disconnect()
    expiring.loop_stop()
    view.wait(SYS + "clients/expired", lambda p: p == b"1")


def test_hash_subscriber_gets_no_sys_topics(connect):
    everything = connect()
    everything.subscribe("#")  # after $SYS values are retained: none come back [MQTT-4.7.2-1]
    watcher = connect()
    watcher.subscribe(SYS + "uptime")
    view = SysView(watcher)
    assert view.next(SYS + "uptime").retain  # the retained value
    assert not view.next(SYS + "uptime").retain  # and an update routed after subscribing
    everything.nothing_more()


def test_retained_sys_value_reaches_a_late_subscriber_and_clients_cannot_overwrite_it(
    make_edge, make_client
):
    # A long interval: the one update at start is all there is during the test.
    slow = make_edge(sys_interval=3600.0)
    evil = make_client(port=slow.port)
    evil.publish(SYS + "version", b"pwned", qos=1, retain=True)  # refused [MQTT-4.7.2-1]
    late = make_client(port=slow.port)
    late.subscribe(SYS + "+")
    got = {}
    for _ in range(2):  # $SYS/broker/version and $SYS/broker/uptime
        msg = late.get()
        assert msg.retain  # from the retained store [MQTT-3.3.1-8]
        got[msg.topic] = msg.payload
    assert got == {SYS + "version": b"edgebus 0.1.0", SYS + "uptime": b"0 seconds"}
    late.nothing_more()


def test_sys_interval_zero_publishes_nothing(make_edge, make_client):
    quiet = make_edge(sys_interval=0.0)
    watcher = make_client(port=quiet.port)
    watcher.subscribe("$SYS/#")
    watcher.nothing_more(wait=3 * INTERVAL)


def test_sys_values_are_not_persisted_across_a_restart(make_edge, make_client):
    first = make_edge()
    watcher = make_client(port=first.port)
    watcher.subscribe(SYS + "uptime")
    assert watcher.get().retain  # retained in the first run
    first.stop()  # a clean stop writes the state snapshot
    second = make_edge(sys_interval=0.0)  # the second run publishes no $SYS
    late = make_client(port=second.port)
    late.subscribe("$SYS/#")
    late.nothing_more(wait=3 * INTERVAL)  # so nothing may be left from the first run
