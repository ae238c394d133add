"""Tenants on the edge with real paho clients: tokens, isolation, ACLs, log topics, counters,
quota enforcement (also across a restart) and local limits."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.subscribeoptions import SubscribeOptions

TIMEOUT = 10.0

TENANTS = """
[operator]
token = "op-token"

[tenants.acme]
tokens = ["acme-1", "acme-ro"]
[tenants.acme.limits]
messages_per_day = 1000
[tenants.acme.acl."acme-ro"]
publish = ["fleet/+/telemetry"]
subscribe = ["fleet/#", "$log/#"]

[tenants.globex]
tokens = ["globex-1"]

[tenants.tiny]
tokens = ["tiny-1"]
[tenants.tiny.limits]
sessions = 2
max_payload_bytes = 16
messages_per_second = 20
"""


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    return path


@pytest.fixture
def tenant_edge(make_edge, tenants_file):
    return make_edge(tenants=tenants_file, counter_interval=1.0)


class V5:
    """A paho MQTT 5 client that records what it gets, including acks' reason codes."""

    def __init__(self, port: int, token: str | None, client_id: str = "") -> None:
        self.inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.acks: queue.Queue[Any] = queue.Queue()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        if token is not None:
            self.client.username_pw_set(token)
        connected: queue.Queue[Any] = queue.Queue()
        self.client.on_connect = lambda c, u, f, rc, p: connected.put(rc)
        self.client.on_message = lambda c, u, m: self.inbox.put(m)
        self.client.on_publish = lambda c, u, mid, rc, p: self.acks.put(rc)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.rc = connected.get(timeout=TIMEOUT)

    def subscribe(self, topic_filter: str, qos: int = 1) -> Any:
        done: queue.Queue[Any] = queue.Queue()
        self.client.on_subscribe = lambda c, u, mid, codes, p: done.put(codes)
        self.client.subscribe(topic_filter, options=SubscribeOptions(qos=qos))
        return done.get(timeout=TIMEOUT)[0]

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> Any:
        self.client.publish(topic, payload, qos=qos, retain=retain)
        return self.acks.get(timeout=TIMEOUT) if qos else None

    def events(self, wanted: str, within: float = TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while True:
            msg = self.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            if msg.topic.endswith("/" + wanted):
                doc: dict[str, Any] = json.loads(msg.payload)
                return doc

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def v5(tenant_edge):
    made: list[V5] = []

    def _make(token: str | None, client_id: str = "", port: int | None = None) -> V5:
        client = V5(port or tenant_edge.port, token, client_id)
        made.append(client)
        return client

    yield _make
    for client in made:
        client.close()


def test_bad_token_is_refused_and_logged_for_the_operator(v5, tenant_edge, make_client):
    ops = v5("op-token", "ops")
    assert ops.subscribe("$log/#") == 1
    bad = v5("wrong-token", "intruder")
    assert bad.rc.value == 0x86  # bad user name or password: the token
    event = ops.events("auth_failed")
    assert (event["client_id"], event["event"], event["tenant"]) == (
        "intruder",
        "auth_failed",
        "$operator",
    )
    missing = v5(None, "anonymous")
    assert missing.rc.value == 0x86
    with pytest.raises(AssertionError):
        make_client("v3-intruder", port=tenant_edge.port, username="nope")  # CONNACK 0x05


def test_tenants_are_isolated(v5):
    acme, globex = v5("acme-1", "a"), v5("globex-1", "g")
    assert globex.subscribe("#") == 1
    assert globex.subscribe("$share/grp/#") == 1
    assert globex.subscribe("$log/#") == 1
    acme.publish("fleet/v1/telemetry", b"acme-data")
    acme.publish("cfg/x", b"acme-retained", retain=True)
    # A will from acme, published on an abnormal close.
    doomed = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="doomed", protocol=mqtt.MQTTv5)
    doomed.username_pw_set("acme-1")
    doomed.will_set("wills/doomed", b"acme-will")
    doomed.connect("127.0.0.1", acme.client._port)
    doomed.loop_start()
    time.sleep(0.3)
    doomed.loop_stop()
    doomed.socket().close()
    # Same topic names inside globex reach globex's subscribers only.
    globex.publish("fleet/v1/telemetry", b"globex-data")
    got = []
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            got.append(globex.inbox.get(timeout=0.2))
        except queue.Empty:
            continue
    payloads = [m.payload for m in got if not m.topic.startswith("$")]
    assert b"globex-data" in payloads
    assert not any(p.startswith(b"acme") for p in payloads)
    # globex's own log shows only globex clients.
    logs = [json.loads(m.payload) for m in got if m.topic.startswith("$log/")]
    assert logs
    assert {e["tenant"] for e in logs} == {"globex"}
    late = v5("globex-1", "late")
    assert late.subscribe("cfg/#") == 1
    time.sleep(0.3)
    assert late.inbox.empty()  # acme's retained message is not in globex's namespace


def test_acl_denials_and_their_log_events(v5, make_client, tenant_edge):
    watcher = v5("acme-1", "watcher")
    watcher.subscribe("$log/mqtt/acl_denied")
    ro = v5("acme-ro", "ro")
    assert ro.subscribe("other/#").value == 0x87  # not authorized
    assert ro.subscribe("fleet/+/telemetry").value == 1
    assert ro.publish("fleet/v1/status", b"x").value == 0x87  # PUBACK 0x87
    assert ro.publish("fleet/v1/telemetry", b"ok").value == 0
    first, second = watcher.events("acl_denied"), watcher.events("acl_denied")
    assert first["details"] == {"action": "subscribe", "topic_filter": "other/#"}
    assert second["details"] == {"action": "publish", "topic": "fleet/v1/status", "qos": 1}
    v3 = make_client("ro-v3", port=tenant_edge.port, username="acme-ro")
    granted: queue.Queue[Any] = queue.Queue()
    v3.paho.on_subscribe = lambda c, u, mid, codes, p: granted.put(codes)
    v3.paho.subscribe("other/#", 1)
    assert granted.get(timeout=TIMEOUT)[0].value == 0x80  # 3.1.1 SUBACK failure


def test_log_topics_carry_the_documented_fields(v5):
    watcher = v5("acme-1", "log-watcher")
    watcher.subscribe("$log/#")
    client = v5("acme-1", "logged")
    client.subscribe("fleet/#")
    client.close()
    connect = watcher.events("connect")
    assert set(connect) == {
        "time",
        "ts_us",
        "node",
        "tenant",
        "client_id",
        "origin",
        "event",
        "details",
    }
    assert (connect["client_id"], connect["origin"], connect["tenant"]) == (
        "logged",
        "mqtt",
        "acme",
    )
    assert connect["details"]["protocol"] == 5
    subscribe = watcher.events("subscribe")
    assert subscribe["details"]["topic_filters"] == ["fleet/#"]
    disconnect = watcher.events("disconnect")
    assert disconnect["details"]["clean"] is True


def test_counters_are_published_per_tenant(v5):
    watcher = v5("acme-1", "counter-watcher")
    watcher.subscribe("$counters/#")
    for i in range(3):
        watcher.publish("fleet/x", str(i).encode())
    deadline = time.monotonic() + 5
    while True:
        msg = watcher.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
        doc = json.loads(msg.payload)
        if msg.topic == "$counters/messages_in" and doc["total"] >= 3:
            break
    assert doc["tenant"] == "acme"
    assert doc["kind"] == "counter"
    assert {"node", "delta", "interval_start", "interval_end"} <= set(doc)


def _decide(ops: V5, tenant: str, state: str) -> None:
    decision = {
        "state": state,
        "metric": "messages_per_day",
        "limit": 1000,
        "value": 1200,
        "decided_at": "2026-11-22T12:00:00Z",
    }
    assert (
        ops.publish(f"$control/quota/{tenant}", json.dumps(decision).encode(), retain=True).value
        == 0
    )


def test_quota_block_and_release(v5, make_client, tenant_edge):
    ops = v5("op-token", "pipeline")
    acme = v5("acme-1", "acme-dev")
    acme.subscribe("$quota/#")
    acme.subscribe("$log/quota/#")
    globex = v5("globex-1", "globex-dev")
    v3 = make_client("acme-v3", port=tenant_edge.port, username="acme-1")
    _decide(ops, "acme", "blocked")
    state = acme.events("messages_per_day")
    assert state["state"] == "blocked"
    assert acme.events("quota_blocked")["details"]["metric"] == "messages_per_day"
    assert acme.publish("fleet/x", b"refused").value == 0x97  # quota exceeded
    assert globex.publish("fleet/x", b"fine").value == 0  # other tenants unaffected
    # A blocked tenant's dashboard still connects and reads why; it may not publish.
    looking = v5("acme-1", "acme-new")
    assert looking.rc.value == 0
    looking.subscribe("$quota/#")
    assert looking.events("messages_per_day")["state"] == "blocked"  # retained
    assert looking.publish("fleet/x", b"refused").value == 0x97
    v3.paho.publish("fleet/x", b"v3", qos=1)
    assert v3.disconnected.wait(TIMEOUT)  # 3.1.1: not acknowledged, connection closed
    _decide(ops, "acme", "ok")
    assert acme.events("quota_cleared")["event"] == "quota_cleared"
    assert acme.publish("fleet/x", b"accepted again").value == 0


def test_other_clients_cannot_publish_control_topics(v5):
    acme = v5("acme-1", "sneaky")
    decision = json.dumps({"state": "ok", "metric": "m"}).encode()
    assert acme.publish("$control/quota/acme", decision).value == 0x87


def test_blocked_tenant_stays_blocked_across_restart(make_edge, tenants_file):
    first = make_edge(tenants=tenants_file)
    ops = V5(first.port, "op-token", "pipeline")
    _decide(ops, "acme", "blocked")
    ops.close()
    first.stop()
    second = make_edge(tenants=tenants_file)
    after = V5(second.port, "acme-1", "after-restart")
    try:
        assert after.rc.value == 0  # it may connect and look ...
        assert after.publish("fleet/x", b"refused").value == 0x97  # ... not publish
    finally:
        after.close()


def test_local_limits_sessions_payload_and_rate(v5):
    one, two = v5("tiny-1", "t1"), v5("tiny-1", "t2")
    assert (one.rc.value, two.rc.value) == (0, 0)
    assert v5("tiny-1", "t3").rc.value == 0x97  # sessions = 2
    assert one.publish("x", b"y" * 17).value == 0x97  # max_payload_bytes = 16
    started = time.monotonic()
    for i in range(50):  # 20 per second, bucket of 20: the last 30 wait ~1.5 s
        assert one.publish("x", str(i).encode()).value == 0
    assert time.monotonic() - started >= 1.2


def test_sighup_reload_keeps_connections_and_applies_new_rules(v5, tenant_edge, tenants_file):
    ro = v5("acme-ro", "reloaded")
    assert ro.publish("fleet/v1/status", b"x").value == 0x87
    tenants_file.write_text(
        TENANTS.replace('publish = ["fleet/+/telemetry"]', 'publish = ["fleet/#"]')
    )
    tenant_edge.call(tenant_edge.node.reload_tenants)
    assert ro.publish("fleet/v1/status", b"x").value == 0  # same connection, new rules


def _drain(client: V5, seconds: float = 0.6) -> list[mqtt.MQTTMessage]:
    got = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            got.append(client.inbox.get(timeout=0.05))
        except queue.Empty:
            continue
    return got


def _will_from(port: int, token: str) -> None:
    doomed = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id="doomed-matrix", protocol=mqtt.MQTTv5
    )
    doomed.username_pw_set(token)
    doomed.will_set("w/doomed", b"secret-will")
    connected = queue.Queue()
    doomed.on_connect = lambda c, u, f, rc, p: connected.put(rc)
    doomed.connect("127.0.0.1", port)
    doomed.loop_start()
    connected.get(timeout=TIMEOUT)
    doomed.loop_stop()
    doomed.socket().close()


@pytest.mark.parametrize(
    ("kind", "spy_filter"),
    [
        ("publish", "#"),
        ("publish", "w/#"),
        ("retained", "#"),
        ("shared", "$share/g/#"),
        ("will", "#"),
        ("logs", "$log/#"),
        ("counters", "$counters/#"),
        ("quota", "$quota/#"),
    ],
)
def test_isolation_matrix(v5, tenant_edge, kind, spy_filter):
    """Nothing acme does is visible to globex, whatever globex subscribes to."""
    spy = v5("globex-1", "spy")
    assert spy.subscribe(spy_filter) in (0, 1)
    acme = v5("acme-1", "victim")
    if kind == "publish":
        acme.publish("w/secret", b"secret")
    elif kind == "retained":
        acme.publish("w/secret", b"secret", retain=True)
        late = v5("globex-1", "late-spy")
        late.subscribe("#")
        assert not [m for m in _drain(late) if m.payload == b"secret"]
    elif kind == "shared":
        acme.subscribe("$share/g/#")
        acme.publish("w/secret", b"secret")
    elif kind == "will":
        _will_from(tenant_edge.port, "acme-1")
    elif kind == "logs":
        acme.subscribe("w/#")
    elif kind == "quota":
        ops = v5("op-token", "ops")
        _decide(ops, "acme", "warn")
    time.sleep(1.2 if kind == "counters" else 0.2)
    leaked = [
        m
        for m in _drain(spy)
        if b"acme" in m.payload or b"secret" in m.payload or b"victim" in m.payload
    ]
    assert leaked == []


def test_same_client_id_in_two_tenants_are_two_sessions(v5):
    acme = v5("acme-1", "same-id")
    globex = v5("globex-1", "same-id")
    assert acme.subscribe("t/#") == 1
    assert globex.subscribe("t/#") == 1
    acme.publish("t/x", b"from acme")
    assert acme.inbox.get(timeout=TIMEOUT).payload == b"from acme"  # not taken over
    assert globex.inbox.empty()


def test_takeover_and_malformed_packets_are_logged(v5, tenant_edge):
    watcher = v5("acme-1", "watch")
    watcher.subscribe("$log/#")
    v5("acme-1", "dup-id")
    v5("acme-1", "dup-id")
    taken = watcher.events("session_taken_over")
    assert taken["client_id"] == "dup-id"
    sock = __import__("socket").create_connection(("127.0.0.1", tenant_edge.port), timeout=5)
    token = b"acme-1"
    body = (
        b"\x00\x04MQTT\x05\x82\x00\x3c\x00" + b"\x00\x03bad" + len(token).to_bytes(2, "big") + token
    )
    sock.sendall(bytes([0x10, len(body)]) + body)
    assert sock.recv(64)[0] == 0x20
    sock.sendall(b"\x30\x03\x00\x05a")  # malformed PUBLISH
    sock.recv(64)
    sock.close()
    bad = watcher.events("malformed_packet")
    assert (bad["client_id"], bad["details"]["reason_code"]) == ("bad", 0x81)


def test_v311_isolation_acl_and_logs(make_client, tenant_edge):
    port = tenant_edge.port
    spy = make_client("v3-spy", port=port, username="globex-1")
    spy.subscribe("#")
    own = make_client("v3-own", port=port, username="acme-1")
    own.subscribe("fleet/#", qos=1)
    own.subscribe("$log/mqtt/acl_denied", qos=1)
    ro = make_client("v3-ro", port=port, username="acme-ro")
    ro.publish("fleet/v1/status", b"denied", qos=1)  # acked (3.1.1 has no refusal), dropped
    ro.publish("fleet/v1/telemetry", b"allowed", qos=1)
    got = [own.get(), own.get()]
    by_topic = {m.topic: m.payload for m in got}
    assert by_topic["fleet/v1/telemetry"] == b"allowed"
    assert json.loads(by_topic["$log/mqtt/acl_denied"])["details"]["topic"] == "fleet/v1/status"
    own.nothing_more()
    spy.nothing_more()  # globex saw none of it


def test_unsubscribe_queue_overflow_and_quota_warn_are_logged(make_edge, tenants_file):
    edge = make_edge(tenants=tenants_file, max_queued_messages=2)
    watcher = V5(edge.port, "acme-1", "overflow-watcher")
    try:
        watcher.subscribe("$log/#")
        slow = V5(edge.port, "acme-1", "")
        slow.subscribe("q/#")
        slow.client.unsubscribe("q/#")
        assert watcher.events("unsubscribe")["details"]["topic_filters"] == ["q/#"]
        slow.close()
        # A persistent session offline with a queue of 2: the third QoS 1 message overflows.
        sub = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id="offline",
            protocol=mqtt.MQTTv311,
            clean_session=False,
        )
        sub.username_pw_set("acme-1")
        done: queue.Queue[Any] = queue.Queue()
        sub.on_subscribe = lambda c, u, mid, codes, p: done.put(mid)
        sub.connect("127.0.0.1", edge.port)
        sub.loop_start()
        sub.subscribe("q/#", 1)
        done.get(timeout=TIMEOUT)
        sub.disconnect()
        sub.loop_stop()
        # Publish only once the edge has seen it go (else the messages are not queued).
        while watcher.events("disconnect")["client_id"] != "offline":
            pass
        for i in range(3):
            watcher.publish("q/x", str(i).encode())
        overflow = watcher.events("queue_overflow")
        assert (overflow["client_id"], overflow["details"]["dropped"]) == ("offline", 1)
        ops = V5(edge.port, "op-token", "ops")
        decision = {"state": "warn", "metric": "messages_per_day", "limit": 1000, "value": 850}
        ops.publish("$control/quota/acme", json.dumps(decision).encode(), retain=True)
        warn = watcher.events("quota_warn")
        assert warn["details"]["value"] == 850
        ops.close()
    finally:
        watcher.close()


def test_an_idle_tenant_is_reported_once_then_not_until_it_moves(v5, tenant_edge, edge_settings):
    from ingest.journal import JournalReader

    def globex_counters() -> list[dict]:
        reader = JournalReader(edge_settings.data_dir / "journal" / edge_settings.node_id)
        rows = [row for batch in reader.read(0, reader.last_seq()) for row in batch.to_pylist()]
        return [
            json.loads(row["payload"])
            for row in rows
            if row["tenant"] == "globex" and row["topic"] == "$counters/messages_in"
        ]

    dev = v5("globex-1", "globex-idle")
    assert dev.publish("fleet/x", b"one").value == 0
    dev.close()
    # Counters every second: the report with the message, then one all-zero report
    # (sessions back to 0), then silence while nothing moves.
    deadline = time.monotonic() + 20
    while not any(c["delta"] == 0 for c in globex_counters()):
        assert time.monotonic() < deadline, globex_counters()
        time.sleep(0.2)
    seen = len(globex_counters())
    time.sleep(3.5)  # three more intervals
    assert len(globex_counters()) == seen
    assert sum(c["delta"] for c in globex_counters()) == 1
    v5("globex-1", "globex-back")  # it moves again (a session): reported again
    deadline = time.monotonic() + 20
    while len(globex_counters()) == seen:
        assert time.monotonic() < deadline, "never reported again"
        time.sleep(0.2)


def test_counters_go_out_early_when_a_tenant_passes_a_twentieth_of_its_limit(
    make_edge, tenants_file
):
    """Issue 14, several edges: a tenant's day that moves fast reaches the pipeline without
    waiting for the counter interval: at every 5 % of a limit (acme: 1,000 messages a day)."""
    edge = make_edge(tenants=tenants_file, counter_interval=600.0)
    watcher = V5(edge.port, "acme-1", "early-watcher")
    try:
        watcher.subscribe("$counters/messages_in")
        started = time.monotonic()
        for i in range(50):
            watcher.publish("fleet/x", str(i).encode())
        doc = json.loads(watcher.inbox.get(timeout=TIMEOUT).payload)
        assert (doc["tenant"], doc["total"], doc["delta"]) == ("acme", 50, 50)
        assert time.monotonic() - started < 60  # not the 600 s interval's
        for i in range(49):
            watcher.publish("fleet/x", str(i).encode())
        with pytest.raises(queue.Empty):
            watcher.inbox.get(timeout=0.5)  # 99: no report point passed
        watcher.publish("fleet/x", b"100th")
        doc = json.loads(watcher.inbox.get(timeout=TIMEOUT).payload)
        assert (doc["total"], doc["delta"]) == (100, 50)
    finally:
        watcher.close()
