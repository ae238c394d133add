"""MQTT over TLS, WebSocket and WebSocket over TLS (issue 13), on both event loops: stock paho
clients on every listener of one edge, which all feed the same broker; client certificates;
clean refusals with a ``tls_handshake_failed`` log event; WebSocket handshakes and framing."""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import ssl
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from conftest import TIMEOUT, RunningEdge
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Request, TextMessage

from bench.certs import Certs, make_certs
from broker_edge.codec import Decoder, encode
from broker_edge.packets import (
    Connack,
    Connect,
    Disconnect,
    ProtocolVersion,
    Publish,
    QoS,
    Suback,
    Subscribe,
    Subscription,
)
from ingest.journal import JournalReader

TENANT = "acme-1"
OPERATOR = "op-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _listeners(certs: Certs, **more: Any) -> dict[str, Any]:
    return {
        "listen_tls": "127.0.0.1:0",
        "listen_ws": "127.0.0.1:0",
        "listen_wss": "127.0.0.1:0",
        "tls_cert": str(certs.server_cert),
        "tls_key": str(certs.server_key),
        "journal_fsync": False,
        **more,
    }


@pytest.fixture
def tls_edge(make_edge: Any, tenants_file: Path, certs: Certs) -> RunningEdge:
    edge: RunningEdge = make_edge(tenants_file, **_listeners(certs))
    return edge


@pytest.fixture
def mtls_edge(make_edge: Any, tenants_file: Path, certs: Certs) -> RunningEdge:
    """Client certificates required: the test CA's."""
    edge: RunningEdge = make_edge(tenants_file, **_listeners(certs, tls_cafile=str(certs.ca)))
    return edge


def _on(edge: RunningEdge, kind: str, certs: Certs, **tls: Any) -> dict[str, Any]:
    """make_client's arguments for the ``kind`` listener."""
    kwargs: dict[str, Any] = {"port": edge.node.ports[kind], "username": TENANT}
    if kind in ("ws", "wss"):
        kwargs["transport"] = "websockets"
    if kind in ("tls", "wss"):
        kwargs["tls"] = {"ca_certs": str(certs.ca), **tls}
    return kwargs


@pytest.mark.parametrize(
    ("publisher", "subscriber"),
    [("tls", "mqtt"), ("wss", "mqtt"), ("mqtt", "wss"), ("mqtt", "ws"), ("ws", "tls")],
)
def test_every_listener_feeds_the_same_broker(
    tls_edge: RunningEdge, make_client: Any, certs: Certs, publisher: str, subscriber: str
) -> None:
    sub = make_client(**_on(tls_edge, subscriber, certs))
    sub.subscribe("fleet/#", qos=1)
    pub = make_client(**_on(tls_edge, publisher, certs))
    payload = f"from {publisher} to {subscriber}".encode()
    pub.publish(f"fleet/{publisher}/telemetry", payload, qos=1)  # acked: journaled
    got = sub.get()
    assert (got.topic, got.payload, got.qos) == (f"fleet/{publisher}/telemetry", payload, 1)
    journal = JournalReader(tls_edge.settings.journal_root / tls_edge.settings.node_id)
    records = list(journal.read_records(0, journal.last_seq()))
    assert any(r["payload"] == payload and r["tenant"] == "acme" for r in records)


def test_client_certificates_required_with_a_cafile(
    mtls_edge: RunningEdge, make_client: Any, certs: Certs
) -> None:
    operator = make_client(port=mtls_edge.port, username=OPERATOR)
    operator.subscribe("$log/tls/#", qos=1)
    good = {"certfile": str(certs.client_cert), "keyfile": str(certs.client_key)}
    rogue = {"certfile": str(certs.rogue_cert), "keyfile": str(certs.rogue_key)}
    for kind in ("tls", "wss"):
        sub = make_client(**_on(mtls_edge, kind, certs, **good))
        sub.subscribe("fleet/#")
        for refused, reason in (({}, "CERTIFICATE"), (rogue, "certificate verify failed")):
            _refused(mtls_edge.node.ports[kind], certs, **refused)
            event = json.loads(operator.get().payload)
            assert event["event"] == "tls_handshake_failed"
            assert event["details"]["peer"].startswith("127.0.0.1:")
            assert event["details"]["listener"] == kind
            assert reason in event["details"]["reason"]
        # The edge kept serving: the client with a good certificate still gets its messages.
        make_client(**_on(mtls_edge, kind, certs, **good)).publish("fleet/x", b"after", qos=1)
        assert sub.get().payload == b"after"


def _refused(port: int, certs: Certs, **tls: Any) -> None:
    """A paho client over TLS is never connected: the handshake (TLS 1.2) or the first read
    after it (TLS 1.3, where the server checks the certificate after the client is done)
    fails."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="refused")
    client.tls_set(ca_certs=str(certs.ca), **tls)
    connacks: list[Any] = []
    client.on_connect = lambda c, u, flags, rc, props: connacks.append(rc)
    try:
        client.connect("127.0.0.1", port)
        for _ in range(int(TIMEOUT / 0.1)):
            if client.loop(0.1) != mqtt.MQTT_ERR_SUCCESS:
                break
    except (ssl.SSLError, OSError):
        pass  # refused during the handshake
    finally:
        client.disconnect()
    assert connacks == []


@pytest.mark.parametrize(
    "hello",
    [
        encode(Connect("plain"), ProtocolVersion.MQTT_3_1_1),  # plain MQTT on the TLS port
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
def test_a_plain_client_on_the_tls_port_is_refused_cleanly(
    tls_edge: RunningEdge, make_client: Any, certs: Certs, hello: bytes
) -> None:
    operator = make_client(port=tls_edge.port, username=OPERATOR)
    operator.subscribe("$log/tls/#", qos=1)
    with socket.create_connection(("127.0.0.1", tls_edge.node.ports["tls"]), TIMEOUT) as sock:
        sock.sendall(hello)
        assert _read_all(sock) == b""  # closed without a byte
    event = json.loads(operator.get().payload)
    assert event["event"] == "tls_handshake_failed", event
    assert event["details"]["reason"] in {
        "[SSL: WRONG_VERSION_NUMBER] wrong version number",
        "[SSL: HTTP_REQUEST] http request",
    }
    make_client(**_on(tls_edge, "tls", certs)).publish("fleet/x", b"still serving", qos=1)


def test_silent_clients_are_dropped_after_the_connect_timeout(
    make_edge: Any, tenants_file: Path, make_client: Any, certs: Certs
) -> None:
    edge: RunningEdge = make_edge(tenants_file, **_listeners(certs, connect_timeout=0.3))
    operator = make_client(port=edge.port, username=OPERATOR)
    operator.subscribe("$log/tls/#", qos=1)
    for kind in ("tls", "wss", "ws"):
        with socket.create_connection(("127.0.0.1", edge.node.ports[kind]), TIMEOUT) as sock:
            with contextlib.suppress(ConnectionResetError):  # dropped: aborted
                assert sock.recv(100) == b""
            if kind != "ws":
                event = json.loads(operator.get().payload)
                assert event["details"]["reason"] == "no TLS handshake within 0.3 s"
                assert event["details"]["listener"] == kind


def test_a_tls_client_on_a_plain_port_is_refused_cleanly(
    tls_edge: RunningEdge, make_client: Any, certs: Certs
) -> None:
    context = ssl.create_default_context(cafile=str(certs.ca))
    for kind in ("mqtt", "ws"):
        with (
            socket.create_connection(("127.0.0.1", tls_edge.node.ports[kind]), TIMEOUT) as raw,
            pytest.raises((ssl.SSLError, ConnectionError)),
        ):
            context.wrap_socket(raw, server_hostname="localhost")
        make_client(**_on(tls_edge, kind, certs)).publish("fleet/x", b"still serving", qos=1)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65_536):
        data += chunk
    return data


def _upgrade(port: int, target: str, subprotocols: list[str]) -> tuple[bytes, socket.socket]:
    """Send a WebSocket upgrade request; the response head and the socket."""
    sock = socket.create_connection(("127.0.0.1", port), TIMEOUT)
    key = base64.b64encode(b"0123456789abcdef").decode()
    lines = [
        f"GET {target} HTTP/1.1",
        "Host: localhost",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
    ]
    if subprotocols:
        lines.append(f"Sec-WebSocket-Protocol: {', '.join(subprotocols)}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, head
        head += chunk
    return head, sock


@pytest.mark.parametrize(
    ("target", "subprotocols", "status"),
    [
        ("/mqtt", ["mqtt"], b"101"),
        ("/mqtt?x=1", ["foo", "mqtt"], b"101"),
        ("/", ["mqtt"], b"404"),
        ("/other", ["mqtt"], b"404"),
        ("/mqtt", [], b"400"),
        ("/mqtt", ["foo"], b"400"),
    ],
)
def test_websocket_upgrade_needs_path_mqtt_and_subprotocol_mqtt(
    tls_edge: RunningEdge, target: str, subprotocols: list[str], status: bytes
) -> None:
    head, sock = _upgrade(tls_edge.node.ports["ws"], target, subprotocols)
    with sock:
        assert head.split(b" ")[1] == status, head
        if status == b"101":
            assert b"\r\nsec-websocket-protocol: mqtt\r\n" in head.lower()
        else:
            assert b"sec-websocket-protocol" not in head.lower()
            assert b"\r\ncontent-length:" in head.lower()


def test_packets_span_frames_and_frames_hold_packets(tls_edge: RunningEdge) -> None:
    """CONNECT and SUBSCRIBE in one frame, a PUBLISH cut across three; then a second client
    with the same id takes the session over: the first gets its DISCONNECT, then a close frame.
    """
    v5 = ProtocolVersion.MQTT_5
    first = _WsClient(tls_edge.node.ports["ws"])
    first.send(
        encode(Connect("ws-1", v5, username=TENANT), v5)
        + encode(Subscribe(1, (Subscription("fleet/#", QoS.AT_LEAST_ONCE),)), v5)
    )
    assert isinstance(first.packet(), Connack)
    assert isinstance(first.packet(), Suback)
    publish = encode(Publish("fleet/a", b"x" * 300), v5)
    for cut in (publish[:1], publish[1:150], publish[150:]):
        first.send(cut)
    got = first.packet()
    assert isinstance(got, Publish)
    assert got.payload == b"x" * 300
    second = _WsClient(tls_edge.node.ports["ws"])
    second.send(encode(Connect("ws-1", v5, username=TENANT), v5))
    assert isinstance(second.packet(), Connack)
    kicked = first.packet()
    assert isinstance(kicked, Disconnect)
    assert kicked.reason_code == 0x8E  # session taken over
    assert first.closed() == 1000


@pytest.mark.parametrize("kind", ["ws", "wss"])
def test_flow_control_passes_through_the_websocket(
    make_edge: Any, tenants_file: Path, make_client: Any, certs: Certs, kind: str
) -> None:
    """A publisher outrunning the journal has its reads paused, and a subscriber that does not
    read has the edge's writes paused, through the WebSocket (and TLS) layers; nothing is lost
    and both resume."""
    settings = _listeners(certs, max_journal_backlog=1, write_buffer_high_water=16_384)
    edge: RunningEdge = make_edge(tenants_file, **settings)
    v5 = ProtocolVersion.MQTT_5
    context = ssl.create_default_context(cafile=str(certs.ca)) if kind == "wss" else None
    slow = _WsClient(edge.node.ports[kind], context, receive_buffer=4096)
    slow.send(
        encode(Connect("slow", v5, username=TENANT), v5)
        + encode(Subscribe(1, (Subscription("fleet/#", QoS.AT_MOST_ONCE),)), v5)
    )
    assert isinstance(slow.packet(), Connack)
    assert isinstance(slow.packet(), Suback)
    pub = make_client(**_on(edge, kind, certs))
    payload = b"p" * 16_384  # 6.5 MB in all: more than the kernel buffers hold
    # QoS 0 first: paho keeps at most 20 QoS 1 publishes in flight, QoS 0 ones it sends at once.
    infos = [pub.paho.publish("fleet/bp", payload, qos=i // 200) for i in range(400)]
    for info in infos:
        info.wait_for_publish(TIMEOUT)
        assert info.is_published()
    broker = edge.node.broker
    assert broker is not None
    assert edge.call(lambda: broker.stats.reads_paused) > 0, "reads were never paused"
    conn = edge.call(lambda: broker.connections["acme", "slow"])
    assert edge.call(lambda: conn.write_paused), "writes to the reader were never paused"
    for _ in range(400):
        got = slow.packet()
        assert isinstance(got, Publish)
        assert got.payload == payload
    assert not edge.call(lambda: conn.write_paused)
    assert edge.call(lambda: len(broker.paused_readers)) == 0


@pytest.mark.parametrize("kind", ["mqtt", "tls", "ws", "wss"])
def test_what_a_client_sent_before_its_stream_ended_counts(
    make_edge: Any, tenants_file: Path, make_client: Any, certs: Certs, kind: str
) -> None:
    """Publishes, DISCONNECT and the end of the stream in one go, each read handled one packet
    per turn: over TLS and WebSocket the end arrives with the last read even while reading is
    paused between turns, and every publish must still be handled before the connection is."""
    edge: RunningEdge = make_edge(tenants_file, **_listeners(certs, max_turn_seconds=1e-9))
    sub = make_client(port=edge.port, username=TENANT)
    sub.subscribe("fleet/#")
    v311 = ProtocolVersion.MQTT_3_1_1
    burst = encode(Connect("burst", username=TENANT), v311) + b"".join(
        encode(Publish("fleet/burst", b"%d" % i), v311) for i in range(200)
    )
    burst += encode(Disconnect(), v311)
    sock = socket.create_connection(("127.0.0.1", edge.node.ports[kind]), TIMEOUT)
    if kind in ("tls", "wss"):
        context = ssl.create_default_context(cafile=str(certs.ca))
        sock = context.wrap_socket(sock, server_hostname="localhost")
    if kind in ("ws", "wss"):
        ws = _WsClient.over(sock).ws
        burst = ws.send(BytesMessage(data=burst)) + ws.send(CloseConnection(1000))
    sock.sendall(burst)
    sock.close()
    got = [sub.get().payload for _ in range(200)]
    assert got == [b"%d" % i for i in range(200)]


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"\x82\x00", 1002),  # a frame from the client without a mask [RFC 6455 5.1]
        (b"\x89\xfe\x00\x80" + b"\0" * 4 + b"p" * 128, 1002),  # a ping over 125 bytes
        (TextMessage(data="CONNECT"), 1003),  # [MQTT-6.0.0-1]
    ],
)
def test_websocket_protocol_errors_close_with_a_code(
    tls_edge: RunningEdge, make_client: Any, certs: Certs, frame: Any, code: int
) -> None:
    client = _WsClient(tls_edge.node.ports["ws"])
    client.sock.sendall(frame if isinstance(frame, bytes) else client.ws.send(frame))
    assert client.closed() == code
    make_client(**_on(tls_edge, "ws", certs)).publish("fleet/x", b"still serving", qos=1)


class _WsClient:
    """A raw WebSocket client (wsproto) that speaks MQTT 5 bytes."""

    def __init__(
        self, port: int, tls: ssl.SSLContext | None = None, receive_buffer: int = 0
    ) -> None:
        raw = socket.socket()
        if receive_buffer:  # before connecting: the window the edge sees stays that small
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        raw.settimeout(TIMEOUT)
        raw.connect(("127.0.0.1", port))
        self._upgrade(tls.wrap_socket(raw, server_hostname="localhost") if tls else raw)

    @classmethod
    def over(cls, sock: socket.socket) -> _WsClient:
        """On a socket already connected."""
        client = cls.__new__(cls)
        client._upgrade(sock)
        return client

    def _upgrade(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.decoder = Decoder(protocol_version=ProtocolVersion.MQTT_5)
        self.events: list[Any] = []
        request = Request(host="localhost", target="/mqtt", subprotocols=["mqtt"])
        self.sock.sendall(self.ws.send(request))
        assert isinstance(self._event(), AcceptConnection)

    def send(self, data: bytes) -> None:
        self.sock.sendall(self.ws.send(BytesMessage(data=data)))

    def _event(self) -> Any:
        while not self.events:
            data = self.sock.recv(65_536)
            self.ws.receive_data(data or None)
            self.events.extend(self.ws.events())
        return self.events.pop(0)

    def packet(self) -> Any:
        while (packet := self.decoder.next_packet()) is None:
            event = self._event()
            assert isinstance(event, BytesMessage), event
            self.decoder.feed(bytes(event.data))
        return packet

    def closed(self) -> int:
        """The edge's close frame's code, once it closed the socket too."""
        event = self._event()
        assert isinstance(event, CloseConnection), event
        with contextlib.suppress(ConnectionError):  # it may have closed at once (an error)
            self.sock.sendall(self.ws.send(event.response()))
            assert self.sock.recv(1) == b""
        self.sock.close()
        return event.code


def test_tls_reads_larger_than_the_decrypt_buffer_and_from_several_clients_stay_whole(
    tls_edge: RunningEdge, make_client: Any, certs: Certs
) -> None:
    """TLS connections decrypt into one shared buffer (broker_edge.listener,
    BufferedMqttProtocol): a publish bigger than it arrives whole, and two publishers'
    interleaved reads never mix."""
    sub = make_client(**_on(tls_edge, "tls", certs))
    sub.subscribe("fleet/#", qos=1)
    pubs = [make_client(**_on(tls_edge, "tls", certs)) for _ in range(2)]
    sent = []
    for i in range(6):
        for n, pub in enumerate(pubs):
            size = 600_000 if i % 3 == 0 else 1_000 + i  # above the 256 KiB buffer, and small
            payload = bytes([65 + n]) * size + f"/{n}/{i}".encode()
            pub.publish(f"fleet/p{n}/telemetry", payload, qos=1)
            sent.append((f"fleet/p{n}/telemetry", payload))
    got = [sub.get() for _ in sent]
    for n in range(2):
        topic = f"fleet/p{n}/telemetry"
        assert [m.payload for m in got if m.topic == topic] == [p for t, p in sent if t == topic]
