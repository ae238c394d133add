"""A scanner on the TLS port (broker_edge.refusals): real sockets send plain TCP to it; the
operator's ``$log`` gets at most the limits' worth of ``tls_handshake_failed`` events per window
and one ``tls_handshake_failures_suppressed`` summary for the rest, and the edge keeps serving.
Refused WebSocket upgrades get as many log lines, and one for the rest."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from conftest import TIMEOUT, RunningEdge

from bench.certs import Certs, make_certs
from broker_edge.codec import encode
from broker_edge.packets import Connect, ProtocolVersion
from ingest.journal import JournalReader

OPERATOR = "op-token"
SCANS = 200
PER_SOURCE = 3
PER_LISTENER = 5
# Sources on the loopback network (Linux routes all of 127.0.0.0/8 to lo).
SOURCES = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _edge(make_edge: Any, tenants_file: Path, certs: Certs, interval: float) -> RunningEdge:
    running: RunningEdge = make_edge(
        tenants_file,
        listen_tls="127.0.0.1:0",
        listen_ws="127.0.0.1:0",
        tls_cert=str(certs.server_cert),
        tls_key=str(certs.server_key),
        journal_fsync=False,
        handshake_refusals_per_source=PER_SOURCE,
        handshake_refusals_per_listener=PER_LISTENER,
        handshake_refusal_interval=interval,
    )
    return running


@pytest.fixture
def edge(make_edge: Any, tenants_file: Path, certs: Certs) -> RunningEdge:
    return _edge(make_edge, tenants_file, certs, 1.0)


def _scan(port: int, source: str) -> None:
    """Plain MQTT on the TLS port, read until the edge closes it (without a byte)."""
    hello = encode(Connect("scanner"), ProtocolVersion.MQTT_3_1_1)
    with socket.create_connection(("127.0.0.1", port), TIMEOUT, (source, 0)) as sock:
        sock.sendall(hello)
        assert sock.recv(100) == b""


def test_a_scanner_gets_a_bounded_number_of_events_and_a_summary(
    edge: RunningEdge, make_client: Any, certs: Certs
) -> None:
    operator = make_client(port=edge.port, username=OPERATOR)
    operator.subscribe("$log/tls/#", qos=1)
    port = edge.node.ports["tls"]
    for n in range(SCANS):
        _scan(port, SOURCES[n % len(SOURCES)])
    # Every refusal is either reported or counted in a window's summary: read until all are.
    windows: list[list[dict[str, Any]]] = [[]]
    summaries: list[dict[str, Any]] = []
    accounted = 0
    while accounted < SCANS:
        event = json.loads(operator.get().payload)
        details = event["details"]
        if event["event"] == "tls_handshake_failed":
            assert details["listener"] == "tls"
            assert details["reason"] == "[SSL: WRONG_VERSION_NUMBER] wrong version number"
            windows[-1].append(details)
            accounted += 1
        else:
            assert event["event"] == "tls_handshake_failures_suppressed", event
            assert details["listener"] == "tls"
            assert details["interval"] == 1.0
            assert 1 <= details["sources"] <= len(SOURCES)
            summaries.append(details)
            windows.append([])
            accounted += details["suppressed"]
    assert accounted == SCANS
    assert summaries, "200 refusals within the limits of every window"
    for reported in windows:
        assert len(reported) <= PER_LISTENER
        for source in SOURCES:
            from_source = [d for d in reported if d["peer"].startswith(f"{source}:")]
            assert len(from_source) <= PER_SOURCE
    # The first window saw more than one source: the listener's limit held, not one source's.
    assert len(windows[0]) == PER_LISTENER
    assert len(windows) - 1 <= SCANS // (PER_LISTENER + 1)
    # The edge still serves TLS clients.
    good = make_client(
        port=edge.node.ports["tls"], username="acme-1", tls={"ca_certs": str(certs.ca)}
    )
    good.subscribe("fleet/#", qos=1)
    good.publish("fleet/x", b"still serving", qos=1)
    assert good.get().payload == b"still serving"


def test_what_a_window_held_back_is_journaled_when_the_edge_stops(
    make_edge: Any, tenants_file: Path, certs: Certs
) -> None:
    edge = _edge(make_edge, tenants_file, certs, 3600.0)  # the window never ends by itself
    for _ in range(PER_SOURCE + 4):
        _scan(edge.node.ports["tls"], SOURCES[0])
    edge.stop()
    journal = JournalReader(edge.settings.journal_root / edge.settings.node_id)
    events = [
        json.loads(record["payload"])
        for record in journal.read_records(0, journal.last_seq())
        if record["topic"].startswith("$log/tls/")
    ]
    assert [e["event"] for e in events] == ["tls_handshake_failed"] * PER_SOURCE + [
        "tls_handshake_failures_suppressed"
    ]
    assert events[-1]["details"] == {
        "listener": "tls",
        "suppressed": 4,
        "sources": 1,
        "interval": 3600.0,
    }


def test_refused_websocket_upgrades_get_a_bounded_number_of_log_lines(
    make_edge: Any, tenants_file: Path, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="broker_edge.node")
    edge = _edge(make_edge, tenants_file, certs, 3600.0)
    request = (
        b"GET /nope HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: MDEyMzQ1Njc4OWFiY2RlZg==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    for _ in range(PER_SOURCE + 5):
        with socket.create_connection(("127.0.0.1", edge.node.ports["ws"]), TIMEOUT) as sock:
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(65_536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 404 "), answer
    lines = [r.getMessage() for r in caplog.records if "WebSocket upgrade" in r.getMessage()]
    assert len(lines) == PER_SOURCE, lines
    assert all(line.startswith("ws: refusing WebSocket upgrade from 127.0.0.1:") for line in lines)
    edge.stop()
    summaries = [r.getMessage() for r in caplog.records if "more refused" in r.getMessage()]
    assert summaries == [
        "ws: 5 more refused WebSocket upgrades from 1 sources in 3600 s not logged"
    ]
    journal = JournalReader(edge.settings.journal_root / edge.settings.node_id)
    topics = [r["topic"] for r in journal.read_records(0, journal.last_seq())]
    assert not [t for t in topics if t.startswith("$log/tls/")]  # upgrades are not TLS events
