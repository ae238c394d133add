"""A real ``edgebus edge`` process (uvloop) with its TLS, WebSocket and WebSocket-over-TLS
listeners, and stock clients that are not Python's: ``mosquitto_pub``/``mosquitto_sub
--cafile`` and MQTT.js over ``wss://`` in Node (issue 13). Refused clients leave a log line in
the edge's stderr, never a traceback."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from edge_process import TENANT_TOKEN, TENANTS, EdgeProcess

from bench.certs import Certs, make_certs
from ingest.journal import JournalReader

pytestmark = pytest.mark.e2e

JS_DIR = Path(__file__).resolve().parents[1] / "js"
TIMEOUT = 20


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _start(tmp_path: Path, certs: Certs, *more: str) -> EdgeProcess:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    listeners = ("--listen-tls", "--listen-ws", "--listen-wss")
    extra = [arg for flag in listeners for arg in (flag, "127.0.0.1:0")]
    extra += ["--cert", str(certs.server_cert), "--key", str(certs.server_key), *more]
    return EdgeProcess(
        tmp_path / "data", "tls-node", tenants, tmp_path / "edge.log", extra=tuple(extra)
    ).start()


@pytest.fixture
def edge(tmp_path: Path, certs: Certs) -> Iterator[EdgeProcess]:
    running = _start(tmp_path, certs)
    yield running
    running.stop()
    _no_traceback(running)


def _no_traceback(edge: EdgeProcess) -> None:
    log = edge.log.read_text()
    assert "Traceback" not in log, log[-3000:]


def _paho(port: int, **tls: Any) -> tuple[mqtt.Client, list[mqtt.MQTTMessage]]:
    """A connected, looping paho client (over TLS with ``tls``) and what it receives."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"paho-{port}")
    client.username_pw_set(TENANT_TOKEN)
    if tls:
        client.tls_set(**tls)
    received: list[mqtt.MQTTMessage] = []
    client.on_message = lambda c, u, message: received.append(message)
    client.connect("127.0.0.1", port)
    client.loop_start()
    return client, received


def _subscribed(port: int, topic: str) -> tuple[mqtt.Client, list[mqtt.MQTTMessage]]:
    client, received = _paho(port)
    done: list[Any] = []
    client.on_subscribe = lambda c, u, mid, codes, props: done.append(codes)
    client.subscribe(topic, qos=1)
    _wait(lambda: bool(done))
    return client, received


def _wait(ready: Any) -> None:
    import time

    deadline = time.monotonic() + TIMEOUT
    while not ready():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)  # paho's callbacks run on its own thread


def _mosquitto(tool: str, edge: EdgeProcess, certs: Certs, *args: str) -> str:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (Debian: apt-get install mosquitto-clients)")
    command = [
        tool,
        *("-h", "localhost", "-p", str(edge.ports["tls"]), "--cafile", str(certs.ca)),
        *("-u", TENANT_TOKEN, *args),
    ]
    done = subprocess.run(command, capture_output=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, done
    return done.stdout.decode()


def test_mosquitto_clients_over_tls(edge: EdgeProcess, certs: Certs) -> None:
    sub, received = _subscribed(edge.mqtt_port, "fleet/#")
    _mosquitto("mosquitto_pub", edge, certs, "-t", "fleet/mosq", "-m", "over tls", "-q", "1")
    _wait(lambda: bool(received))
    assert received[0].payload == b"over tls"
    info = sub.publish("fleet/retained", b"kept", qos=1, retain=True)
    info.wait_for_publish(TIMEOUT)
    out = _mosquitto("mosquitto_sub", edge, certs, "-t", "fleet/retained", "-C", "1", "-W", "20")
    assert out.strip() == "kept"
    sub.loop_stop()
    sub.disconnect()


def test_mosquitto_clients_need_a_certificate_with_a_cafile(tmp_path: Path, certs: Certs) -> None:
    edge = _start(tmp_path, certs, "--cafile", str(certs.ca))
    try:
        good = ("--cert", str(certs.client_cert), "--key", str(certs.client_key))
        _mosquitto("mosquitto_pub", edge, certs, *good, "-t", "fleet/a", "-m", "ok", "-q", "1")
        for refused in ((), ("--cert", str(certs.rogue_cert), "--key", str(certs.rogue_key))):
            command = [
                "mosquitto_pub",
                *("-h", "localhost", "-p", str(edge.ports["tls"]), "--cafile", str(certs.ca)),
                *("-u", TENANT_TOKEN, *refused, "-t", "fleet/a", "-m", "no", "-q", "1"),
            ]
            done = subprocess.run(command, capture_output=True, timeout=TIMEOUT, check=False)
            assert done.returncode != 0, done
        _mosquitto("mosquitto_pub", edge, certs, *good, "-t", "fleet/a", "-m", "ok", "-q", "1")
    finally:
        edge.stop()
    log = edge.log.read_text()
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in log
    assert "certificate verify failed" in log
    _no_traceback(edge)


def test_mqtt_js_over_wss(edge: EdgeProcess, certs: Certs) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node (Node.js 18+) is needed for the MQTT.js test: see scripts/bootstrap.sh")
    if not (JS_DIR / "node_modules" / "mqtt").is_dir():
        pytest.fail(f"{JS_DIR}/node_modules is missing: run scripts/bootstrap.sh (npm ci there)")
    watcher, received = _subscribed(edge.mqtt_port, "fleet/js/out")
    url = f"wss://127.0.0.1:{edge.ports['wss']}/mqtt"  # the certificate names the IP too
    script = str(JS_DIR / "wss_client.mjs")
    with subprocess.Popen(
        [node, script, url, str(certs.ca), TENANT_TOKEN], stdout=subprocess.PIPE, cwd=JS_DIR
    ) as js:
        assert js.stdout is not None
        said = [json.loads(js.stdout.readline())]
        assert said == [{"subscribed": True}]
        sender, _ = _paho(edge.ports["tls"], ca_certs=str(certs.ca))
        sender.publish("fleet/js/in", b"to js", qos=1).wait_for_publish(TIMEOUT)
        sender.loop_stop()
        sender.disconnect()
        said += [json.loads(line) for line in js.stdout]
        assert js.wait(TIMEOUT) == 0, said
    assert {"received": "to js", "topic": "fleet/js/in"} in said
    _wait(lambda: bool(received))
    assert received[0].payload == b"hello from mqtt.js"
    watcher.loop_stop()
    watcher.disconnect()
    journal = JournalReader(edge.data_dir / "journal" / edge.node)
    payloads = [r["payload"] for r in journal.read_records(0, journal.last_seq())]
    assert b"hello from mqtt.js" in payloads
    assert b"to js" in payloads


def test_wrong_clients_on_each_port_get_no_traceback(edge: EdgeProcess, certs: Certs) -> None:
    context = ssl.create_default_context(cafile=str(certs.ca))
    for kind in ("tls", "wss"):  # plain TCP on the TLS ports
        with socket.create_connection(("127.0.0.1", edge.ports[kind]), TIMEOUT) as sock:
            sock.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")
            assert sock.recv(100) == b""
    for kind in ("mqtt", "ws"):  # TLS on the plain ports
        with (
            socket.create_connection(("127.0.0.1", edge.ports[kind]), TIMEOUT) as raw,
            pytest.raises((ssl.SSLError, ConnectionError)),
        ):
            context.wrap_socket(raw, server_hostname="localhost")
    client, _ = _paho(edge.ports["tls"], ca_certs=str(certs.ca))
    info = client.publish("fleet/after", b"still serving", qos=1)
    info.wait_for_publish(TIMEOUT)
    assert info.is_published()
    client.loop_stop()
    client.disconnect()
    log = edge.log.read_text()
    assert log.count("TLS handshake with 127.0.0.1:") == 2, log
    ports = edge.ports
    assert (  # the start-up line names every listener
        f"listening on mqtt 127.0.0.1:{ports['mqtt']}, tls 127.0.0.1:{ports['tls']}, "
        f"ws 127.0.0.1:{ports['ws']}, wss 127.0.0.1:{ports['wss']}, journal"
    ) in log
