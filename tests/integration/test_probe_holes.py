"""The holes an outside probe of the edge found (issue 10), each closed, over real sockets:
wills checked like publishes, no tenant sees the node's $SYS, the DISCONNECT's session expiry,
the sessions limit counting offline sessions, log lines a client id cannot forge, bounded
auth_failed records, and a DISCONNECT the client can read before the close."""

from __future__ import annotations

import json
import logging
import queue
import socket
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions
from test_reason_codes import _read_packet, _str, _varint, connect_v5, connect_v311

from broker_edge.errors import ConfigError
from broker_edge.tenants import parse

TIMEOUT = 10.0

TENANTS = """
[operator]
token = "op-token"

[tenants.acme]
tokens = ["acme-1", "acme-ro"]
[tenants.acme.acl."acme-ro"]
publish = ["fleet/+/telemetry"]
subscribe = ["fleet/#", "$log/#"]

[tenants.tiny]
tokens = ["tiny-1"]
[tenants.tiny.limits]
sessions = 2
max_payload_bytes = 16
"""

NOT_AUTHORIZED_V5 = 0x87
NOT_AUTHORIZED_311 = 0x05


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    return path


@pytest.fixture
def tenant_edge(make_edge: Any, tenants_file: Path) -> Any:
    return make_edge(tenants=tenants_file, sys_interval=0.2)


def _connack_code(port: int, connect: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(connect)
        connack = _read_packet(sock)
    assert connack[0] == 0x20, connack.hex(" ")
    return connack[3]  # fixed header, remaining length, flags, reason code


def _will_connect(version: int, topic: str, token: str, client_id: bytes = b"w") -> bytes:
    """CONNECT with clean start, a QoS 0 will on ``topic`` and ``token`` as the user name."""
    flags = 0x02 | 0x04 | 0x80
    will = _str(topic.encode()) + _str(b"will payload") + _str(token.encode())
    if version == 5:
        return connect_v5(client_id, flags=flags, tail=_varint(0) + will)
    return connect_v311(client_id, flags=flags, tail=will)


class V5:
    """A paho MQTT 5 client that records what it gets."""

    def __init__(self, port: int, token: str | None, client_id: str, **connect: Any) -> None:
        self.inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        if token is not None:
            self.client.username_pw_set(token)
        connected: queue.Queue[Any] = queue.Queue()
        self.client.on_connect = lambda c, u, f, rc, p: connected.put((f, rc))
        self.client.on_message = lambda c, u, m: self.inbox.put(m)
        self.client.connect("127.0.0.1", port, **connect)
        self.client.loop_start()
        flags, self.rc = connected.get(timeout=TIMEOUT)
        self.session_present = flags.session_present

    def subscribe(self, topic_filter: str, qos: int = 1) -> int:
        done: queue.Queue[Any] = queue.Queue()
        self.client.on_subscribe = lambda c, u, mid, codes, p: done.put(codes)
        self.client.subscribe(topic_filter, options=SubscribeOptions(qos=qos))
        return int(done.get(timeout=TIMEOUT)[0].value)

    def until(self, topic: str) -> Any:
        """Messages up to the first on ``topic``, which is last."""
        seen = []
        deadline = time.monotonic() + TIMEOUT
        while not seen or seen[-1].topic != topic:
            seen.append(self.inbox.get(timeout=max(0.01, deadline - time.monotonic())))
        return seen

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# -- wills ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "topic"),
    [
        ("acme-ro", "fleet/v1/status"),  # outside its publish rules
        ("acme-1", "$counters/messages_in"),  # the edge's own topics, in its own namespace
        ("acme-1", "$quota/messages_per_day"),
        ("acme-1", "$log/mqtt/connect"),
        ("acme-1", "$SYS/broker/uptime"),
        ("acme-1", "$control/quota/acme"),
    ],
)
@pytest.mark.parametrize("version", [5, 4])
def test_a_will_the_client_may_not_publish_refuses_the_connect(
    tenant_edge: Any, token: str, topic: str, version: int
) -> None:
    code = _connack_code(tenant_edge.port, _will_connect(version, topic, token))
    assert code == (NOT_AUTHORIZED_V5 if version == 5 else NOT_AUTHORIZED_311)


def test_a_refused_will_is_never_published_and_an_allowed_one_is(tenant_edge: Any) -> None:
    watcher = V5(tenant_edge.port, "acme-1", "watcher")
    try:
        assert watcher.subscribe("$counters/#") == 1
        assert watcher.subscribe("fleet/#") == 1
        assert watcher.subscribe("$log/#") == 1
        refused = _will_connect(5, "$counters/messages_in", "acme-1", b"eraser")
        assert _connack_code(tenant_edge.port, refused) == NOT_AUTHORIZED_V5
        event = watcher.until("$log/mqtt/acl_denied")[-1]
        assert json.loads(event.payload)["details"] == {
            "action": "will",
            "topic": "$counters/messages_in",
            "qos": 0,
        }
        # Allowed: the connection then drops without DISCONNECT and the will goes out.
        with socket.create_connection(("127.0.0.1", tenant_edge.port), timeout=TIMEOUT) as sock:
            sock.sendall(_will_connect(5, "fleet/v1/telemetry", "acme-ro", b"dies"))
            assert _read_packet(sock)[3] == 0
        seen = watcher.until("fleet/v1/telemetry")
        assert seen[-1].payload == b"will payload"
        assert all(b"will payload" not in m.payload for m in seen[:-1])
    finally:
        watcher.close()


def test_a_will_the_reloaded_rules_forbid_is_dropped(tenant_edge: Any, tenants_file: Path) -> None:
    broker = tenant_edge.node.broker
    with socket.create_connection(("127.0.0.1", tenant_edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(_will_connect(5, "fleet/v1/telemetry", "acme-ro", b"reloaded"))
        assert _read_packet(sock)[3] == 0
        key = ("acme", "reloaded")
        assert tenant_edge.call(lambda: broker.connections[key].will is not None)
        tenants_file.write_text(TENANTS.replace('publish = ["fleet/+/telemetry"]', "publish = []"))
        tenant_edge.call(tenant_edge.node.reload_tenants)
        assert tenant_edge.call(lambda: broker.connections[key].will is None)


# -- $SYS and the reserved tenant name --------------------------------------------------------


def test_a_tenants_file_cannot_name_a_tenant_default() -> None:
    with pytest.raises(ConfigError, match=r"tenants\.default: 'default' is reserved"):
        parse({"tenants": {"default": {"tokens": ["t"]}}})


def test_no_tenant_sees_the_node_sys_topics_the_operator_does(tenant_edge: Any) -> None:
    tenant = V5(tenant_edge.port, "acme-1", "curious")
    operator = V5(tenant_edge.port, "op-token", "ops")
    try:
        assert tenant.subscribe("$SYS/#", qos=0) == 0
        assert operator.subscribe("$SYS/#", qos=0) == 0
        first = operator.inbox.get(timeout=TIMEOUT)
        assert first.topic.startswith("$SYS/broker/")
        time.sleep(0.5)  # two more $SYS intervals: nothing may reach the tenant
        assert tenant.inbox.empty()
    finally:
        tenant.close()
        operator.close()


# -- the DISCONNECT's session expiry [MQTT-3.14.2.2.2] -----------------------------------------


def _session_expiry(seconds: int) -> bytes:
    return b"\x11" + seconds.to_bytes(4, "big")


def _disconnect_v5(props: bytes) -> bytes:
    body = b"\x00" + _varint(len(props)) + props
    return b"\xe0" + _varint(len(body)) + body


def _expire_later(edge: Any, seconds: float) -> None:
    """Run the edge's session expiry as if ``seconds`` had passed (no sleeping)."""
    broker = edge.node.broker
    edge.call(lambda: broker.expire_sessions(edge.loop.time() + seconds))


def test_disconnect_extends_the_session_expiry(edge: Any) -> None:
    connect = connect_v5(b"extends", flags=0x00, props=_session_expiry(1))
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect)
        assert _read_packet(sock)[3] == 0
        sock.sendall(_disconnect_v5(_session_expiry(5)))
        assert sock.recv(1) == b""  # the edge closes after a client's DISCONNECT
    _expire_later(edge, 3)
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect)
        connack = _read_packet(sock)
        assert (connack[2], connack[3]) == (1, 0)  # session present
        sock.sendall(_disconnect_v5(b""))  # keeps the CONNECT's 1 s this time
        assert sock.recv(1) == b""
    _expire_later(edge, 2)
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect)
        assert _read_packet(sock)[2] == 0  # no session present


def test_disconnect_setting_an_expiry_after_connect_with_0_is_a_protocol_error(
    edge: Any, connect: Any
) -> None:
    watcher = connect("will-watcher")
    watcher.subscribe("wills/#")
    will = _str(b"wills/zero") + _str(b"gone")
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect_v5(b"zero", flags=0x02 | 0x04, tail=_varint(0) + will))
        assert _read_packet(sock)[3] == 0
        sock.sendall(_disconnect_v5(_session_expiry(5)))
        answer = _read_packet(sock)
        assert (answer[0], answer[2]) == (0xE0, 0x82)  # DISCONNECT, Protocol Error
    got = watcher.get()
    assert (got.topic, got.payload) == ("wills/zero", b"gone")  # [MQTT-3.14.2-2]


# -- the sessions limit counts offline persistent sessions -------------------------------------


def test_the_sessions_limit_counts_offline_persistent_sessions(tenant_edge: Any) -> None:
    keep = {"clean_start": False, "properties": _expiry_props(3600)}
    for client_id in ("p1", "p2"):
        V5(tenant_edge.port, "tiny-1", client_id, **keep).close()
    third = V5(tenant_edge.port, "tiny-1", "p3", **keep)
    third.close()
    assert third.rc.value == 0x97  # two sessions exist, offline or not: sessions = 2
    back = V5(tenant_edge.port, "tiny-1", "p1", **keep)  # its own session: no new one
    back.close()
    assert (back.rc.value, back.session_present) == (0, True)


def _expiry_props(seconds: int) -> Properties:
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = seconds
    return props


# -- what a client id can do to the edge's logs ------------------------------------------------


def test_a_client_id_cannot_forge_a_log_line(edge: Any, caplog: pytest.LogCaptureFixture) -> None:
    evil = b"dev\n2026-01-01 00:00:00 CRITICAL forged line"
    caplog.set_level(logging.INFO, logger="broker_edge")
    with (
        socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as first,
        socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as second,
    ):
        first.sendall(connect_v311(evil))
        assert _read_packet(first)[3] == 0
        second.sendall(connect_v311(evil))  # takes the session over: logged with the client id
        assert _read_packet(second)[3] == 0
        assert first.recv(1) == b""  # the first one is closed once the takeover is done
    messages = [r.getMessage() for r in caplog.records]
    assert any("taken over" in m and "dev\\x0a2026" in m for m in messages), messages
    assert not any("\n" in m for m in messages), messages


def test_auth_failed_records_keep_at_most_256_characters_of_the_client_id(
    tenant_edge: Any,
) -> None:
    operator = V5(tenant_edge.port, "op-token", "ops")
    try:
        assert operator.subscribe("$log/#", qos=0) == 0
        huge = b"x" * 60_000
        connect = connect_v5(huge, flags=0x82, tail=_str(b"wrong-token"))
        assert _connack_code(tenant_edge.port, connect) == 0x86
        event = json.loads(operator.until("$log/mqtt/auth_failed")[-1].payload)
        assert event["client_id"] == "x" * 256 + "…[truncated]"
    finally:
        operator.close()


# -- closing: the client reads the reason before the connection goes ---------------------------


def test_the_client_reads_the_disconnect_even_while_it_keeps_writing(edge: Any) -> None:
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect_v5(b"late-writer"))
        assert _read_packet(sock)[3] == 0
        # A topic alias the edge never offered: DISCONNECT 0x94 [MQTT-3.3.2-9]. The PINGREQs
        # behind it are still unread by the edge when it closes.
        violation = b"\x30" + _varint(6) + _str(b"") + b"\x03\x23\xff\xff"
        sock.sendall(violation + b"\xc0\x00" * 200_000)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        assert data[:1] == b"\xe0", data[:16].hex(" ")
        assert data[2] == 0x94


# -- memory one client can take ----------------------------------------------------------------


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize(("token", "limit"), [("tiny-1", 16 + 128 * 1024), (None, 2**20)])
def test_a_publish_header_declaring_more_than_allowed_is_refused_before_its_body(
    make_edge: Any, tenants_file: Path, token: str | None, limit: int
) -> None:
    edge = make_edge(tenants=tenants_file if token else None)
    tail = _str(token.encode()) if token else b""
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect_v5(b"big", flags=0x82 if token else 0x02, tail=tail))
        connack = _read_packet(sock)
        assert connack[3] == 0
        assert b"\x27" + limit.to_bytes(4, "big") in connack  # Maximum Packet Size
        # 100 MB declared, a few bytes sent: refused from the fixed header, nothing buffered.
        sock.sendall(b"\x30" + _varint(100_000_000) + _str(b"t") + b"slow body")
        answer = _read_all(sock)
    assert (answer[0], answer[2]) == (0xE0, 0x95)  # DISCONNECT, Packet too large
