"""Retained messages and the operator's decisions across the edge mesh (issue 11): three real
``edgebus edge`` processes (tests.helpers.mesh_edges), stock paho clients on each, and the
pipeline's own decision publisher given one edge."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from schemas.control import ConfirmedUsage
from sinks.mqtt import DecisionPublisher
from tests.helpers.edge_process import OPERATOR_TOKEN, TENANT_TOKEN, EdgeProcess
from tests.helpers.mesh_clients import SETTLE, settle
from tests.helpers.mesh_edges import (
    GLOBEX,
    GLOBEX_DAY_LIMIT,
    meshed,
    sys_values,
    wait_links_up,
)
from tests.helpers.quota_clients import QUOTA_EXCEEDED, wait_for
from tests.helpers.quota_clients import Client as V5Client

ACME = TENANT_TOKEN
NOT_AUTHORIZED = 0x87


@pytest.fixture(scope="module")
def edges(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EdgeProcess]]:
    with meshed(tmp_path_factory.mktemp("mesh-retained")) as started:
        yield started


def _retained(make_client: Any, edge: EdgeProcess, token: str, topic_filter: str) -> dict:
    """What a new subscriber to ``topic_filter`` on ``edge`` gets retained: the edge sends
    them at the SUBSCRIBE, before the marker the client publishes to itself after it."""
    client = make_client(port=edge.mqtt_port, username=token)
    client.subscribe(topic_filter, qos=1)
    marker = f"marker/{uuid.uuid4().hex[:8]}"
    client.subscribe(marker, qos=1)
    client.publish(marker, b"", qos=1)
    got: dict[str, bytes] = {}
    while (message := client.get()).topic != marker:
        if message.retain:  # not a live one, published while this looked
            got[message.topic] = message.payload
    client.close()
    return got


def _until_retained(
    make_client: Any, edge: EdgeProcess, token: str, topic_filter: str, wanted: dict
) -> None:
    """Until a new subscriber on ``edge`` gets exactly ``wanted`` (topic -> payload)."""
    deadline = time.monotonic() + SETTLE
    while (got := _retained(make_client, edge, token, topic_filter)) != wanted:
        assert time.monotonic() < deadline, f"{edge.node}: {got}, not {wanted}"
        time.sleep(0.1)


def test_the_latest_retained_message_of_any_edge_is_every_edges(
    edges: list[EdgeProcess], make_client: Any
) -> None:
    a, b, c = edges
    on = {e.node: make_client(port=e.mqtt_port, username=ACME) for e in edges}
    on["edge-a"].publish("ret/x", b"set on a", qos=1, retain=True)
    for edge in edges:
        _until_retained(make_client, edge, ACME, "ret/#", {"ret/x": b"set on a"})
    on["edge-c"].publish("ret/x", b"then on c", qos=0, retain=True)
    for edge in edges:
        _until_retained(make_client, edge, ACME, "ret/#", {"ret/x": b"then on c"})
    on["edge-b"].publish("ret/x", b"", qos=1, retain=True)  # cleared on b
    on["edge-b"].publish("ret/y", b"after the clear", qos=1, retain=True)
    for edge in (c, a, b):
        _until_retained(make_client, edge, ACME, "ret/#", {"ret/y": b"after the clear"})


def test_a_live_retained_publish_is_delivered_once_where_subscribed(
    edges: list[EdgeProcess], make_client: Any
) -> None:
    a, b, c = edges
    sub = make_client(port=b.mqtt_port, username=ACME)
    pub = make_client(port=a.mqtt_port, username=ACME)
    sub.subscribe("live/#", qos=1)
    settle(pub, [sub], "live/probe")
    pub.publish("live/x", b"one", qos=1, retain=True)
    pub.publish("live/y", b"two", qos=0, retain=True)
    got = sorted((m.topic, m.payload, m.retain) for m in (sub.get(), sub.get()))
    assert got == [("live/x", b"one", False), ("live/y", b"two", False)]  # [MQTT-3.3.1-9]
    sub.nothing_more(1.0)  # not a second copy for being retained
    # Where nobody subscribed, it is kept all the same.
    _until_retained(make_client, c, ACME, "live/#", {"live/x": b"one", "live/y": b"two"})


def test_retained_messages_stay_in_their_tenant(edges: list[EdgeProcess], make_client: Any) -> None:
    a, b, _ = edges
    make_client(port=a.mqtt_port, username=ACME).publish("iso/x", b"acme", qos=1, retain=True)
    make_client(port=a.mqtt_port, username=GLOBEX).publish("iso/y", b"globex", 1, retain=True)
    _until_retained(make_client, b, GLOBEX, "iso/#", {"iso/y": b"globex"})
    _until_retained(make_client, b, ACME, "iso/#", {"iso/x": b"acme"})


def _until_code(edge: EdgeProcess, token: str, code: int) -> None:
    """Until a publish of the tenant of ``token`` on ``edge`` is answered with ``code``."""
    client = V5Client(edge.mqtt_port, token, f"code-{uuid.uuid4().hex[:8]}")
    try:
        wait_for(f"reason code {code:#x} on {edge.node}", lambda: client.publish() == code, SETTLE)
    finally:
        client.close()


def _decision(state: str) -> bytes:
    doc = {"state": state, "metric": "messages_per_day", "limit": 10, "value": 12}
    return json.dumps({**doc, "decided_at": "2026-11-27T00:00:00Z"}).encode()


def _decide(edge: EdgeProcess, tenant: str, state: str) -> None:
    """The pipeline's decision publisher, given this one edge, publishes a decision."""
    publisher = DecisionPublisher([("127.0.0.1", edge.mqtt_port)], OPERATOR_TOKEN)
    assert publisher.publish({f"$control/quota/{tenant}": [_decision(state)]}) == []


def test_a_decision_published_to_one_edge_applies_on_every_edge(
    edges: list[EdgeProcess], make_client: Any
) -> None:
    a, b, c = edges
    _decide(a, "globex", "blocked")
    try:
        for edge in (b, c, a):
            _until_code(edge, GLOBEX, QUOTA_EXCEEDED)
        # Applied on c as if published there: the tenant's retained $quota state.
        dashboard = V5Client(c.mqtt_port, GLOBEX, "dashboard")  # blocked: it reads, not publishes
        dashboard.subscribe("$quota/#")
        state = dashboard.inbox.get(timeout=SETTLE)
        dashboard.close()
        assert (state.topic, state.retain) == ("$quota/messages_per_day", True)
        assert json.loads(state.payload)["state"] == "blocked"
        # Operator only, on every edge.
        sneaky = V5Client(b.mqtt_port, ACME, "sneaky")
        assert sneaky.publish("$control/quota/globex", _decision("ok")) == NOT_AUTHORIZED
        assert sneaky.publish("$control/usage/globex", b"{}") == NOT_AUTHORIZED
        sneaky.close()
    finally:
        _decide(a, "globex", "ok")
    for edge in (b, c, a):
        _until_code(edge, GLOBEX, 0)


def _confirmed(edge: EdgeProcess, others: int) -> None:
    """The pipeline, given this one edge, confirms globex's day total: ``others`` messages in
    on a node of no edge here (so every edge adds them to its own count)."""
    usage = ConfirmedUsage(
        "globex",
        datetime.now(UTC).date(),
        {"messages_in": (others, {"edge-x": others})},
        {"messages_per_day": GLOBEX_DAY_LIMIT},
        "2026-11-27T00:00:00Z",
    )
    publisher = DecisionPublisher([("127.0.0.1", edge.mqtt_port)], OPERATOR_TOKEN)
    assert publisher.publish({"$control/usage/globex": [usage.payload()]}) == []


def test_confirmed_usage_published_to_one_edge_applies_on_every_edge(
    edges: list[EdgeProcess],
) -> None:
    """Each edge's local quota adds the confirmed totals to its own count: at the limit, each
    stops the tenant by itself."""
    a, b, c = edges
    _confirmed(b, GLOBEX_DAY_LIMIT)
    try:
        for edge in (a, c, b):
            _until_code(edge, GLOBEX, QUOTA_EXCEEDED)
    finally:
        _confirmed(b, 0)
    for edge in (a, c, b):
        _until_code(edge, GLOBEX, 0)


def _sys_int(edge: EdgeProcess, name: str) -> int:
    topic = f"$SYS/broker/{name}"
    return int(sys_values(edge.mqtt_port, topic, lambda values: topic in values)[topic])


def _committed(edge: EdgeProcess, seq: int) -> None:
    topic = "$SYS/broker/journal/committed_seq"
    sys_values(edge.mqtt_port, topic, lambda values: values.get(topic) == str(seq))


def test_a_journal_notice_reaches_the_edge_of_its_journal_only(
    edges: list[EdgeProcess], make_client: Any
) -> None:
    a, b, c = edges
    publisher = DecisionPublisher([("127.0.0.1", a.mqtt_port)], OPERATOR_TOKEN)
    assert publisher.publish_committed("edge-b", 1) == []
    assert publisher.publish_committed("edge-c", 2) == []
    _committed(b, 1)
    _committed(c, 2)
    _committed(a, 0)  # a holds both notices and applies neither
    notices = {
        edge.node: set(_retained(make_client, edge, OPERATOR_TOKEN, "$control/journal/#"))
        for edge in edges
    }
    assert notices == {
        "edge-a": {"$control/journal/edge-b", "$control/journal/edge-c"},
        "edge-b": {"$control/journal/edge-b"},
        "edge-c": {"$control/journal/edge-c"},
    }


def test_what_an_edge_missed_while_down_reaches_it_when_it_is_back(
    edges: list[EdgeProcess], make_client: Any, tmp_path: Path
) -> None:
    """Sets, clears and decisions made while c was stopped: c gets them from its peers' whole
    retained sets when its links come up (its own snapshot holds what it had before)."""
    a, b, c = edges
    on_a = make_client(port=a.mqtt_port, username=ACME)
    on_b = make_client(port=b.mqtt_port, username=ACME)
    on_a.publish("away/gone", b"g", qos=1, retain=True)
    on_a.publish("away/gone-too", b"g", qos=1, retain=True)
    wanted = {"away/gone": b"g", "away/gone-too": b"g"}
    _until_retained(make_client, c, ACME, "away/#", wanted)
    c.stop()
    on_a.publish("away/gone", b"", qos=1, retain=True)  # kept for c (QoS 1), and in the sets
    on_a.publish("away/a", b"set on a", qos=1, retain=True)
    # QoS 0 while c is away: only the peers' retained sets bring these.
    on_b.publish("away/gone-too", b"", qos=0, retain=True)
    big = b"b" * 20_000  # comes in the read of the WELCOME: bigger than a handshake frame
    on_b.publish("away/b", big, qos=0, retain=True)
    _decide(a, "globex", "blocked")
    try:
        c.start()
        wait_links_up(c)
        wanted = {"away/a": b"set on a", "away/b": big}
        _until_retained(make_client, c, ACME, "away/#", wanted)
        _until_code(c, GLOBEX, QUOTA_EXCEEDED)
        assert _sys_int(c, "mesh/retained/received") > 0  # since its start: the peers' sets
    finally:
        _decide(a, "globex", "ok")
    _until_code(c, GLOBEX, 0)


def test_a_peers_retained_message_outlives_a_sigkill_in_the_receivers_snapshot(
    edges: list[EdgeProcess], make_client: Any
) -> None:
    """Not in c's journal (its origin's holds it): c's snapshot keeps it, so c serves it after
    a SIGKILL even with no peer up to send it again."""
    a, b, c = edges
    make_client(port=a.mqtt_port, username=ACME).publish("kept/x", b"from a", 1, retain=True)
    _until_retained(make_client, c, ACME, "kept/#", {"kept/x": b"from a"})
    snapshot = c.data_dir / "state" / c.node / "snapshot.json"
    wait_for("c's snapshot of it", lambda: b'"kept/x"' in snapshot.read_bytes(), SETTLE)
    c.kill()
    a.stop()
    b.stop()
    c.start()
    try:
        assert _retained(make_client, c, ACME, "kept/#") == {"kept/x": b"from a"}
    finally:
        a.start()
        b.start()
    for edge in edges:
        wait_links_up(edge)
