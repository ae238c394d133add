"""Persistent sessions, their queues and retained messages survive an edge restart."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time

import paho.mqtt.client as mqtt

from broker_edge import store


def test_persistent_session_and_queue_survive_clean_restart(make_edge, make_client):
    first = make_edge()
    sub = make_client("durable-sub", clean_session=False, port=first.port)
    sub.subscribe("fleet/+/alerts", qos=1)
    sub.close()
    pub = make_client(None, port=first.port)
    for i in range(5):
        pub.publish("fleet/v1/alerts", f"a{i}".encode(), qos=1)
    pub.close()
    first.stop()

    second = make_edge()
    again = make_client("durable-sub", clean_session=False, port=second.port)
    assert again.session_present
    assert [again.get().payload for _ in range(5)] == [f"a{i}".encode() for i in range(5)]
    # The subscription itself survived: new traffic still arrives.
    pub2 = make_client(None, port=second.port)
    pub2.publish("fleet/v2/alerts", b"after", qos=1)
    assert again.get().payload == b"after"


def test_retained_survive_restart_and_clears_stay_cleared(make_edge, make_client):
    first = make_edge()
    pub = make_client(None, port=first.port)
    pub.publish("cfg/a", b"keep", qos=1, retain=True)
    pub.publish("cfg/b", b"gone", qos=1, retain=True)
    pub.publish("cfg/b", b"", qos=1, retain=True)
    pub.close()
    first.stop()
    second = make_edge()
    sub = make_client(None, port=second.port)
    sub.subscribe("cfg/#", qos=1)
    msg = sub.get()
    assert (msg.topic, msg.payload, msg.retain) == ("cfg/a", b"keep", True)
    sub.nothing_more()


def test_clean_sessions_are_not_restored(make_edge, make_client, edge_settings):
    first = make_edge()
    sub = make_client("transient", clean_session=True, port=first.port)
    sub.subscribe("t/#", qos=1)
    first.stop()
    snapshot = edge_settings.data_dir / "state" / edge_settings.node_id / "snapshot.json"
    doc = json.loads(snapshot.read_text())
    assert [s["client_id"] for s in doc["sessions"]] == []
    second = make_edge()
    again = make_client("transient", clean_session=False, port=second.port)
    assert not again.session_present


def test_inflight_qos1_redelivered_with_dup_after_restart(make_edge, make_client):
    first = make_edge()
    # A raw subscriber with a persistent session that receives a QoS 1 PUBLISH and never
    # acknowledges it: the delivery stays in flight.
    sock = socket.create_connection(("127.0.0.1", first.port), timeout=10)
    body = b"\x00\x04MQTT\x04\x00\x00\x3c\x00\x04slow"  # CleanSession=0
    sock.sendall(bytes([0x10, len(body)]) + body)
    assert sock.recv(4) == b"\x20\x02\x00\x00"
    sock.sendall(b"\x82\x08\x00\x01\x00\x03s/#\x01")  # SUBSCRIBE s/# QoS 1
    assert sock.recv(5) == b"\x90\x03\x00\x01\x01"
    pub = make_client(None, port=first.port)
    pub.publish("s/x", b"pending", qos=1)
    first_delivery = sock.recv(64)
    assert first_delivery[0] == 0x32  # PUBLISH QoS 1, DUP 0
    assert first_delivery.endswith(b"pending")
    sock.close()
    pub.close()
    first.stop()

    second = make_edge()
    received: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
    again = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="slow", clean_session=False)
    again.on_message = lambda c, u, m: received.put(m)
    again.connect("127.0.0.1", second.port)
    again.loop_start()
    try:
        msg = received.get(timeout=10)
        assert (msg.payload, msg.qos, msg.dup) == (b"pending", 1, True)  # [MQTT-4.4.0-1]
    finally:
        again.disconnect()
        again.loop_stop()


def test_a_stop_mid_snapshot_waits_for_that_write_before_the_last_one(
    make_edge, make_client, edge_settings, monkeypatch
):
    """stop() cancels the snapshot loop while its write runs in a thread; the final snapshot
    must not write beside it (both use snapshot.tmp: one truncates or loses the other's)."""
    real = store.write_encoded
    lock = threading.Lock()
    writing = 0
    most = 0
    first_write = threading.Event()

    def slow_write(path, data):
        nonlocal writing, most
        with lock:
            writing += 1
            most = max(most, writing)
        first_write.set()
        try:
            time.sleep(0.5)
            real(path, data)
        finally:
            with lock:
                writing -= 1

    monkeypatch.setattr(store, "write_encoded", slow_write)
    edge = make_edge()
    sub = make_client("durable-sub", clean_session=False, port=edge.port)
    sub.subscribe("fleet/#", qos=1)  # a persistent session: snapshot within a second
    assert first_write.wait(10), "no snapshot was written"
    pub = make_client(None, port=edge.port)
    pub.publish("cfg/a", b"last", qos=1, retain=True)
    pub.close()
    edge.stop()  # mid-write: the loop's snapshot is cancelled, the final one follows it

    assert most == 1
    path = edge_settings.data_dir / "state" / edge_settings.node_id / "snapshot.json"
    doc = json.loads(path.read_text())
    assert [m["topic"] for m in doc["retained"]] == ["cfg/a"]
    assert [s["client_id"] for s in doc["sessions"]] == ["durable-sub"]
