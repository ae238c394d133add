"""The edge against real paho-mqtt 3.1.1 clients over real sockets."""

from __future__ import annotations

import socket
import time

import pytest

from ingest.journal import JournalReader

TIMEOUT = 10.0


def test_wildcard_routing(connect):
    sub = connect()
    sub.subscribe("fleet/+/telemetry")
    sub.subscribe("alerts/#")
    pub = connect()
    pub.publish("fleet/v1/telemetry", b"t1")
    pub.publish("fleet/v1/status", b"no")
    pub.publish("fleet/v1/x/telemetry", b"no")
    pub.publish("alerts", b"a0")  # "#" also matches the parent level [MQTT-4.7.1-2]
    pub.publish("alerts/engine/temp", b"a1")
    got = [sub.get() for _ in range(3)]
    assert sorted((m.topic, m.payload) for m in got) == [
        ("alerts", b"a0"),
        ("alerts/engine/temp", b"a1"),
        ("fleet/v1/telemetry", b"t1"),
    ]
    sub.nothing_more()


def test_overlapping_subscriptions_deliver_once_at_highest_qos(connect):
    sub = connect()
    sub.subscribe("a/#", qos=0)
    sub.subscribe("a/+", qos=1)
    pub = connect()
    pub.publish("a/b", b"x", qos=1)
    msg = sub.get()
    assert (msg.topic, msg.qos) == ("a/b", 1)
    sub.nothing_more()


def test_qos1_both_ways_and_downgrade(connect):
    sub1 = connect()
    sub1.subscribe("q/#", qos=1)
    sub0 = connect()
    sub0.subscribe("q/#", qos=0)
    pub = connect()
    for i in range(50):
        pub.publish(f"q/{i}", str(i).encode(), qos=1)  # waits for PUBACK
    got1 = [sub1.get() for _ in range(50)]
    got0 = [sub0.get() for _ in range(50)]
    assert [m.payload for m in got1] == [str(i).encode() for i in range(50)]
    assert {m.qos for m in got1} == {1}
    assert {m.qos for m in got0} == {0}


def test_qos1_ack_only_after_journal(connect, edge):
    pub = connect("journaled")
    for i in range(20):
        pub.publish("j/t", f"m{i}".encode(), qos=1)
    # Every acknowledged publish is already durable in the journal.
    reader = JournalReader(edge.settings.journal_root / edge.settings.node_id)
    last = reader.last_seq()
    assert last >= 20
    rows = [r for b in reader.read(0, last) for r in b.to_pylist()]
    payloads = [r["payload"] for r in rows if r["client_id"] == "journaled"]
    assert payloads == [f"m{i}".encode() for i in range(20)]
    assert [r["seq"] for r in rows] == list(range(1, last + 1))


def test_qos2_exactly_once(connect):
    sub = connect()
    sub.subscribe("two/#", qos=2)
    pub = connect()
    for i in range(10):
        pub.publish("two/x", str(i).encode(), qos=2)
    got = [sub.get() for _ in range(10)]
    assert [m.payload for m in got] == [str(i).encode() for i in range(10)]
    assert {m.qos for m in got} == {2}
    sub.nothing_more()


def test_retained_set_replace_clear(connect):
    pub = connect()
    pub.publish("cfg/a", b"v1", qos=1, retain=True)
    pub.publish("cfg/a", b"v2", qos=1, retain=True)
    pub.publish("cfg/b", b"b1", qos=1, retain=True)
    sub = connect()
    sub.subscribe("cfg/+", qos=1)
    got = sorted((m.topic, m.payload, m.retain) for m in (sub.get(), sub.get()))
    assert got == [("cfg/a", b"v2", True), ("cfg/b", b"b1", True)]
    # A live publish matching an existing subscription arrives with RETAIN 0 [MQTT-3.3.1-9].
    pub.publish("cfg/a", b"v3", qos=1, retain=True)
    live = sub.get()
    assert (live.payload, live.retain) == (b"v3", False)
    pub.publish("cfg/a", b"", qos=1, retain=True)  # clears
    assert sub.get().payload == b""
    late = connect()
    late.subscribe("cfg/#")
    assert [(m.topic, m.payload) for m in [late.get()]] == [("cfg/b", b"b1")]
    late.nothing_more()


def test_dollar_topics_not_matched_by_wildcards(connect):
    sub = connect()
    sub.subscribe("#")
    pub = connect()
    pub.publish("$SYS/fake", b"x", qos=1)  # reserved: acknowledged but not routed
    pub.publish("plain", b"y")
    assert sub.get().topic == "plain"
    sub.nothing_more()


def test_unsubscribe_stops_delivery(connect):
    sub = connect()
    sub.subscribe("u/#")
    pub = connect()
    pub.publish("u/1", b"a")
    assert sub.get().payload == b"a"
    done = []
    sub.paho.on_unsubscribe = lambda *args: done.append(True)
    sub.paho.unsubscribe("u/#")
    deadline = time.monotonic() + TIMEOUT
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done
    pub.publish("u/2", b"b", qos=1)
    sub.nothing_more()


def test_persistent_session_queues_qos1_while_offline(connect):
    sub = connect("keeper", clean_session=False)
    sub.subscribe("p/#", qos=1)
    sub.close()
    pub = connect()
    for i in range(5):
        pub.publish("p/x", str(i).encode(), qos=1)
    again = connect("keeper", clean_session=False)
    assert again.session_present
    assert [again.get().payload for _ in range(5)] == [str(i).encode() for i in range(5)]


def test_clean_session_forgets(connect):
    sub = connect("forgetful", clean_session=True)
    sub.subscribe("f/#", qos=1)
    sub.close()
    again = connect("forgetful", clean_session=True)
    assert not again.session_present
    pub = connect()
    pub.publish("f/x", b"x", qos=1)
    again.nothing_more()


def test_will_published_on_abnormal_close(connect, edge):
    watcher = connect()
    watcher.subscribe("wills/#")
    doomed = connect("doomed", will=("wills/doomed", b"gone", 1, False))
    doomed.paho.loop_stop()
    doomed.paho.socket().close()  # no DISCONNECT: the will must be published
    msg = watcher.get()
    assert (msg.topic, msg.payload) == ("wills/doomed", b"gone")


def test_will_discarded_on_disconnect(connect):
    watcher = connect()
    watcher.subscribe("wills/#")
    polite = connect("polite", will=("wills/polite", b"gone", 0, False))
    polite.close()
    watcher.nothing_more()


def test_takeover_closes_older_connection(connect):
    first = connect("same-id")
    connect("same-id")
    assert first.disconnected.wait(TIMEOUT)


def _raw_connect(port: int, keepalive: int = 60, client_id: bytes = b"raw") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    var = b"\x00\x04MQTT\x04\x02" + keepalive.to_bytes(2, "big")
    payload = len(client_id).to_bytes(2, "big") + client_id
    body = var + payload
    sock.sendall(bytes([0x10, len(body)]) + body)
    assert sock.recv(4) == b"\x20\x02\x00\x00"  # CONNACK accepted
    return sock


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(1024)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def test_pingreq_and_keepalive_timeout(edge):
    sock = _raw_connect(edge.port, keepalive=1)
    sock.sendall(b"\xc0\x00")
    assert sock.recv(2) == b"\xd0\x00"  # PINGRESP
    started = time.monotonic()
    # Silent for 1.5 x keepalive: closed by the edge [MQTT-3.1.2-24].
    assert _closed_by_peer(sock, within=5.0)
    assert time.monotonic() - started >= 1.4


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xff\xff\xff\xff",  # reserved packet type and an over-long remaining length
        b"\x30\x05\x00\x10abc",  # topic length beyond the packet
        b"\x10\x00",  # a second CONNECT
        b"\x82\x05\x00\x01\x00\x01a",  # SUBSCRIBE without its options byte
        b"\x32\x04\x00\x01a/",  # QoS 1 PUBLISH cut before its packet id
    ],
)
def test_malformed_input_closes_only_that_connection(connect, edge, garbage):
    sub = connect()
    sub.subscribe("ok/#")
    bad = _raw_connect(edge.port, client_id=b"bad")
    bad.sendall(garbage)
    assert _closed_by_peer(bad, within=5.0)
    pub = connect()
    pub.publish("ok/still", b"served", qos=1)
    assert sub.get().payload == b"served"


def test_first_packet_must_be_connect(edge):
    sock = socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT)
    sock.sendall(b"\xc0\x00")  # PINGREQ before CONNECT [MQTT-3.1.0-1]
    assert _closed_by_peer(sock, within=5.0)
