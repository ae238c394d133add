"""Session expiry, server keep alive, bounded queues and slow subscribers."""

from __future__ import annotations

import logging
import queue
import socket
import time

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

TIMEOUT = 10.0


def _v5(
    port: int, client_id: str, props: Properties, *, clean_start: bool, keepalive: int = 60
) -> tuple:
    connected: queue.Queue = queue.Queue()
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
    )
    client.on_connect = lambda c, u, flags, rc, p: connected.put((flags, p))
    client.connect(
        "127.0.0.1",
        port,
        keepalive=keepalive,
        clean_start=clean_start,
        properties=props,
    )
    client.loop_start()
    flags, connack = connected.get(timeout=TIMEOUT)
    return client, flags, connack


def test_session_expiry_interval_ends_the_session(edge):
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 1
    client, flags, _ = _v5(edge.port, "expires", props, clean_start=True)
    client.subscribe("e/#", qos=1)
    time.sleep(0.2)
    client.disconnect()
    client.loop_stop()
    client, flags, _ = _v5(edge.port, "expires", props, clean_start=False)
    assert flags.session_present  # within the interval: still there
    client.disconnect()
    client.loop_stop()
    time.sleep(2.6)  # expiry 1 s, checked every housekeeping second
    client, flags, _ = _v5(edge.port, "expires", props, clean_start=False)
    assert not flags.session_present  # [MQTT-3.1.2-23]
    client.disconnect()
    client.loop_stop()


def test_server_keep_alive_caps_the_client(make_edge):
    edge = make_edge(max_keepalive=30)
    props = Properties(PacketTypes.CONNECT)
    client, _, connack = _v5(edge.port, "sleepy", props, clean_start=True, keepalive=600)
    assert connack.ServerKeepAlive == 30  # [MQTT-3.2.2-21]
    client.disconnect()
    client.loop_stop()


def test_offline_queue_is_bounded_and_logged(make_edge, make_client, caplog):
    edge = make_edge(max_queued_messages=5)
    sub = make_client("bounded", clean_session=False, port=edge.port)
    sub.subscribe("b/#", qos=1)
    sub.close()
    pub = make_client(None, port=edge.port)
    with caplog.at_level(logging.WARNING, logger="broker_edge.broker"):
        for i in range(12):
            pub.publish("b/x", str(i).encode(), qos=1)
    assert any("queue of default/bounded full" in r.getMessage() for r in caplog.records)
    again = make_client("bounded", clean_session=False, port=edge.port)
    got = [again.get().payload for _ in range(5)]
    # Policy: when full, new QoS 1 messages are refused (the oldest are kept, in order).
    assert got == [str(i).encode() for i in range(5)]
    again.nothing_more()
    assert edge.call(lambda: edge.node.broker.stats.dropped) == 7


def test_slow_subscriber_never_grows_memory_without_bound(make_edge, make_client):
    edge = make_edge(max_queued_messages=50, write_buffer_high_water=64 * 1024)
    # A subscriber that connects, subscribes and then never reads its socket.
    sock = socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = b"\x00\x04MQTT\x04\x02\x00\x00\x00\x04slow"
    sock.sendall(bytes([0x10, len(body)]) + body)
    assert sock.recv(4) == b"\x20\x02\x00\x00"
    sock.sendall(b"\x82\x08\x00\x01\x00\x03s/#\x00")
    assert sock.recv(5) == b"\x90\x03\x00\x01\x00"
    pub = make_client(None, port=edge.port)
    payload = b"x" * 1024
    for _ in range(20_000):  # ~20 MiB: beyond the kernel's socket buffers and the queue
        pub.paho.publish("s/x", payload, qos=0)
    pub.publish("s/x", payload, qos=1)  # waits until the edge handled everything before it

    def state() -> tuple[int, int, int]:
        broker = edge.node.broker
        session = broker.sessions[("default", "slow")]
        buffered = session.connection.io._transport.get_write_buffer_size()
        return len(session.queue), session.queued_bytes, broker.stats.dropped, buffered

    queued, queued_bytes, dropped, buffered = edge.call(state)
    assert queued <= 50
    assert queued_bytes <= 50 * 1024
    # The transport buffer stops growing at the high-water mark (plus one read's worth).
    assert buffered < 2 * 2**20
    assert dropped > 0  # QoS 0 beyond the bound is dropped and counted, not buffered
    sock.close()
