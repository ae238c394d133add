"""The edge mesh (issue 11): three real ``edgebus edge`` processes linked as one bus
(tests.helpers.mesh_edges), stock paho clients on each."""

from __future__ import annotations

import json
import queue
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from broker_edge import mesh
from ingest.journal import JournalReader
from tests.helpers.edge_process import TENANT_TOKEN, EdgeProcess
from tests.helpers.mesh_clients import SETTLE, settle
from tests.helpers.mesh_edges import (
    GLOBEX,
    meshed,
    peer_states,
    sys_values,
    wait_links_up,
)
from tests.integration.conftest import RunningEdge

ACME = TENANT_TOKEN


@pytest.fixture(scope="module")
def edges(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EdgeProcess]]:
    with meshed(tmp_path_factory.mktemp("mesh")) as started:
        yield started


def journal_rows(edge: EdgeProcess) -> list[dict[str, Any]]:
    reader = JournalReader(edge.data_dir / "journal" / edge.node)
    return list(reader.read_records(0, reader.last_seq()))


def wait_journaled(edge: EdgeProcess, payloads: set[bytes]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + SETTLE
    while True:
        rows = journal_rows(edge)
        if payloads <= {r["payload"] for r in rows} or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def test_links_are_up_and_logged(edges: list[EdgeProcess]) -> None:
    a, b, c = edges
    assert set(wait_links_up(a)) == {f"127.0.0.1:{e.mqtt_port}" for e in (b, c)}
    inbound = sys_values(a.mqtt_port, "$SYS/broker/mesh/inbound/#", lambda values: len(values) == 2)
    assert inbound == {
        "$SYS/broker/mesh/inbound/edge-b": "up",
        "$SYS/broker/mesh/inbound/edge-c": "up",
    }
    events = [
        json.loads(r["payload"])
        for r in journal_rows(a)
        if r["tenant"] == "$operator" and r["topic"] == "$log/mesh/link_up"
    ]
    seen = {(e["details"]["peer"], e["details"]["direction"]) for e in events}
    assert seen >= {("edge-b", "out"), ("edge-c", "out"), ("edge-b", "in"), ("edge-c", "in")}


def test_cross_edge_delivery_qos0_qos1_and_wildcards(
    edges: list[EdgeProcess], make_client: Any
) -> None:
    a, b, c = edges
    on_b = make_client(port=b.mqtt_port, username=ACME)
    on_b.subscribe("fleet/+/telemetry", qos=1)
    on_c = make_client(port=c.mqtt_port, username=ACME)
    on_c.subscribe("fleet/#", qos=0)
    pub = make_client(port=a.mqtt_port, username=ACME)
    settle(pub, [on_b, on_c], "fleet/probe/telemetry")
    for i in range(10):
        pub.publish("fleet/v1/telemetry", f"q1-{i}".encode(), qos=1)
        pub.publish("fleet/v1/telemetry", f"q0-{i}".encode(), qos=0)
    pub.publish("fleet/v1/status", b"status", qos=1)
    got_b = [on_b.get() for _ in range(20)]
    assert [m.payload for m in got_b if m.qos == 1] == [f"q1-{i}".encode() for i in range(10)]
    assert [m.payload for m in got_b if m.qos == 0] == [f"q0-{i}".encode() for i in range(10)]
    got_c = [on_c.get() for _ in range(21)]
    assert {m.qos for m in got_c} == {0}
    assert got_c[-1].payload == b"status"
    on_b.nothing_more()
    on_c.nothing_more()


def test_cross_edge_qos2_exactly_once(edges: list[EdgeProcess], make_client: Any) -> None:
    a, _, c = edges
    sub = make_client(port=c.mqtt_port, username=ACME, protocol=mqtt.MQTTv5)
    sub.subscribe("exact/#", qos=2)
    pub = make_client(port=a.mqtt_port, username=ACME, protocol=mqtt.MQTTv5)
    settle(pub, [sub], "exact/probe")
    for i in range(5):
        pub.publish("exact/x", f"q2-{i}".encode(), qos=2)
    got = [sub.get() for _ in range(5)]
    assert [(m.payload, m.qos) for m in got] == [(f"q2-{i}".encode(), 2) for i in range(5)]
    sub.nothing_more()


def test_a_publish_crosses_once_and_is_journaled_once(
    edges: list[EdgeProcess], make_client: Any
) -> None:
    a, b, c = edges
    subs = [make_client(port=b.mqtt_port, username=ACME) for _ in range(2)]
    subs[0].subscribe("once/#", qos=1)
    subs[0].subscribe("once/+/x", qos=1)  # overlapping: still one delivery
    subs[1].subscribe("once/#", qos=1)
    pub = make_client(port=a.mqtt_port, username=ACME)
    settle(pub, subs, "once/probe/x")
    payloads = {f"once-{i}".encode() for i in range(20)}
    for payload in sorted(payloads):
        pub.publish("once/v/x", payload, qos=1)
    for sub in subs:
        assert sorted(sub.get().payload for _ in range(20)) == sorted(payloads)
        sub.nothing_more()
    rows = wait_journaled(a, payloads)
    assert sorted(r["payload"] for r in rows if r["payload"] in payloads) == sorted(payloads)
    for other in (b, c):  # the receiving edges deliver without journaling
        assert not [r for r in journal_rows(other) if r["payload"] in payloads]


def test_tenants_stay_apart_over_links(edges: list[EdgeProcess], make_client: Any) -> None:
    a, b, _ = edges
    globex = make_client(port=b.mqtt_port, username=GLOBEX)
    globex.subscribe("#", qos=1)
    globex.subscribe("fleet/#", qos=1)
    acme = make_client(port=b.mqtt_port, username=ACME)
    acme.subscribe("fleet/#", qos=1)
    pub = make_client(port=a.mqtt_port, username=ACME)
    settle(pub, [acme], "fleet/probe")
    pub.publish("fleet/secret", b"acme only", qos=1)
    assert acme.get().payload == b"acme only"
    globex_pub = make_client(port=a.mqtt_port, username=GLOBEX)
    globex_pub.publish("fleet/globex", b"globex only", qos=1)
    assert globex.get().payload == b"globex only"  # its own tenant's, from the other edge
    globex.nothing_more()
    acme.nothing_more()


def test_dollar_topics(edges: list[EdgeProcess], make_client: Any) -> None:
    a, b, c = edges
    everything = make_client(port=b.mqtt_port, username=ACME)
    everything.subscribe("#")
    logs = make_client(port=b.mqtt_port, username=ACME)
    logs.subscribe("$log/mqtt/connect")
    # The edge-made log event of a client connecting on edge A, for its tenant on edge B.
    deadline = time.monotonic() + SETTLE
    while True:
        make_client("dollar-probe", port=a.mqtt_port, username=ACME).close()
        try:
            event = json.loads(logs.get(timeout=0.5).payload)
        except queue.Empty:
            assert time.monotonic() < deadline
            continue
        if event["client_id"] == "dollar-probe":
            break
    assert (event["node"], event["tenant"]) == ("edge-a", "acme")
    everything.nothing_more()  # "#" never matches "$" topics, from any edge
    # $SYS is each edge's own: B shows its peers, never A's view of its peers.
    states = wait_links_up(b)
    assert set(states) == {f"127.0.0.1:{e.mqtt_port}" for e in (a, c)}


def _refusal(port: int, token: str) -> str:
    """Open a link as node "intruder" holding ``token``: the edge's reason to refuse it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(mesh.hello("intruder", "n-intruder"))
        frames = mesh.FrameBuffer(4096)
        got: list[tuple[int, bytes]] = []
        while chunk := sock.recv(4096):
            got += frames.feed(chunk)
            if got and got[0][0] == mesh.CHALLENGE and len(got) == 1:
                _, nonce, _ = mesh.parse_challenge(got[0][1])
                sock.sendall(mesh.auth(mesh.proof(token, "dial", nonce, "n-intruder", "intruder")))
    kind, body = got[-1]
    assert kind == mesh.REFUSE
    return mesh.reason_of(body)


def test_a_link_without_the_token_is_refused(edges: list[EdgeProcess]) -> None:
    a = edges[0]
    assert _refusal(a.mqtt_port, "wrong") == "bad token"
    assert _refusal(a.mqtt_port, ACME) == "bad token"  # a tenant's token opens no link
    deadline = time.monotonic() + SETTLE
    while not [r for r in journal_rows(a) if r["topic"] == "$log/mesh/link_refused"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_an_edge_without_a_token_takes_no_links(tmp_path: Path) -> None:
    from broker_edge.settings import EdgeSettings

    settings = EdgeSettings(port=0, data_dir=tmp_path / "data", node_id="lonely")
    edge = RunningEdge(settings).start()
    try:
        assert "no links" in _refusal(edge.port, "anything-at-all-123")
    finally:
        edge.stop()


def test_a_link_not_admitted_in_time_is_closed(tmp_path: Path) -> None:
    from broker_edge.settings import EdgeSettings

    settings = EdgeSettings(
        port=0, data_dir=tmp_path / "data", node_id="strict", connect_timeout=0.5
    )
    edge = RunningEdge(settings).start()
    try:
        with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as sock:
            sock.sendall(mesh.MAGIC)  # and never a HELLO
            started = time.monotonic()
            assert sock.recv(4096) == b""  # closed by the edge
            assert time.monotonic() - started < 3
    finally:
        edge.stop()


def test_links_come_back_and_qos1_waits_for_a_restarted_peer(
    edges: list[EdgeProcess], make_client: Any
) -> None:
    a, b, _ = edges
    durable = make_client("durable", port=b.mqtt_port, username=ACME, clean_session=False)
    durable.subscribe("restart/#", qos=1)
    pub = make_client(port=a.mqtt_port, username=ACME)
    settle(pub, [durable], "restart/probe")
    durable.close()
    b.stop()

    def b_down(values: dict[str, str]) -> bool:
        return peer_states(values).get(f"127.0.0.1:{b.mqtt_port}") == "down"

    sys_values(a.mqtt_port, "$SYS/broker/mesh/peers/#", b_down)
    payloads = [f"while-away-{i}".encode() for i in range(5)]
    for payload in payloads:
        pub.publish("restart/x", payload, qos=1)  # acknowledged by A, kept for B
    b.start()
    wait_links_up(b)
    wait_links_up(a)
    back = make_client("durable", port=b.mqtt_port, username=ACME, clean_session=False)
    got = [back.get().payload for _ in payloads]
    assert got == payloads
    back.nothing_more()
    pub.publish("restart/x", b"after", qos=1)
    assert back.get().payload == b"after"
