"""Sessions that move between the edges of the mesh (issue 11): three real ``edgebus edge``
processes (tests.helpers.mesh_edges), stock paho clients with persistent sessions (3.1.1 clean
session 0, MQTT 5 with a session expiry) that reconnect to another edge."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.edge_process import TENANT_TOKEN, EdgeProcess
from tests.helpers.mesh_clients import SETTLE, settle
from tests.helpers.mesh_edges import GLOBEX, meshed, wait_links_up
from tests.helpers.session_clients import SESSION_TAKEN_OVER, TIMEOUT, SessionClient

ACME = TENANT_TOKEN
VERSIONS = pytest.mark.parametrize("v5", [False, True], ids=["mqtt311", "mqtt5"])


@pytest.fixture(scope="module")
def edges(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EdgeProcess]]:
    with meshed(tmp_path_factory.mktemp("mesh-sessions")) as started:
        yield started


@dataclass
class Sessions:
    """Session clients on the mesh's edges (closed after the test), and QoS 1 publishers."""

    edges: list[EdgeProcess]
    make_client: Any
    made: list[SessionClient] = field(default_factory=list)

    def __call__(self, edge: EdgeProcess, client_id: str, v5: bool, **kwargs: Any) -> SessionClient:
        token = kwargs.pop("token", ACME)
        client = SessionClient(edge.mqtt_port, client_id, token, v5=v5, **kwargs)
        self.made.append(client)
        return client

    def close(self) -> None:
        for client in self.made:
            client.close()

    def subscribed(
        self, prefix: str, v5: bool, token: str = ACME, client_id: str | None = None
    ) -> tuple[SessionClient, str, dict[str, Any]]:
        """A persistent session on edge-a subscribed to ``move/{client id}/#`` at QoS 1, once
        every edge routes that to it; its topic, and a QoS 1 publisher on each edge by node."""
        client_id = client_id or f"{prefix}-{uuid.uuid4().hex[:8]}"
        topic = f"move/{client_id}"
        client = self(self.edges[0], client_id, v5, token=token)
        assert not client.session_present
        client.subscribe(f"{topic}/#")
        publishers = {
            e.node: self.make_client(port=e.mqtt_port, username=token) for e in self.edges
        }
        for publisher in publishers.values():
            settle(publisher, [client], f"{topic}/probe")
        return client, topic, publishers


@pytest.fixture
def session(edges: list[EdgeProcess], make_client: Any) -> Iterator[Sessions]:
    sessions = Sessions(edges, make_client)
    yield sessions
    sessions.close()


@VERSIONS
def test_a_session_moves_to_another_edge_with_what_was_queued(session: Sessions, v5: bool) -> None:
    first, topic, pub = session.subscribed("mover", v5)
    first.close()
    away = (("edge-a", b"a1"), ("edge-b", b"b1"), ("edge-a", b"a2"), ("edge-b", b"b2"))
    for node, payload in away:
        pub[node].publish(f"{topic}/x", payload, qos=1)
    b = session.edges[1]
    moved = session(b, first.client_id, v5)
    assert moved.session_present  # the session existed: on another edge
    assert sorted(moved.payloads(4)) == [b"a1", b"a2", b"b1", b"b2"]
    moved.nothing_more()
    # Its subscription moved with it: publishes on every edge reach it on b, once.
    pub["edge-a"].publish(f"{topic}/x", b"a3", qos=1)
    pub["edge-b"].publish(f"{topic}/x", b"b3", qos=1)
    assert sorted(moved.payloads(2)) == [b"a3", b"b3"]
    settle(pub["edge-c"], [moved], f"{topic}/probe")
    pub["edge-c"].publish(f"{topic}/x", b"c3", qos=1)
    assert moved.payloads(1) == [b"c3"]
    moved.nothing_more()
    # Away again: what is published while it is away waits on b, not on a any more.
    moved.close()
    for node, payload in (("edge-a", b"a4"), ("edge-c", b"c4"), ("edge-b", b"b4")):
        pub[node].publish(f"{topic}/x", payload, qos=1)
    back = session(b, first.client_id, v5)
    assert back.session_present
    assert sorted(back.payloads(3)) == [b"a4", b"b4", b"c4"]
    back.nothing_more()


@VERSIONS
def test_the_session_moves_back(session: Sessions, v5: bool) -> None:
    a, b, c = session.edges
    last, topic, pub = session.subscribed("back", v5)
    for step, edge in enumerate([b, a, c, a]):
        last.close()
        payload = f"away-{step}".encode()
        pub["edge-c"].publish(f"{topic}/x", payload, qos=1)
        last = session(edge, last.client_id, v5)
        assert last.session_present, edge.node
        assert last.payloads(1) == [payload], edge.node
        last.nothing_more(0.5)
        settle(pub["edge-c"], [last], f"{topic}/probe")  # edge-c routes to its new edge


@VERSIONS
def test_the_last_connect_wins_across_edges(session: Sessions, v5: bool) -> None:
    on_a, topic, pub = session.subscribed("takeover", v5)
    on_b = session(session.edges[1], on_a.client_id, v5)
    assert on_b.session_present
    assert on_a.ended.wait(TIMEOUT), "the connection on edge-a was not closed"
    if v5:
        assert on_a.end_reason == SESSION_TAKEN_OVER
    pub["edge-a"].publish(f"{topic}/x", b"after", qos=1)
    pub["edge-b"].publish(f"{topic}/x", b"after too", qos=1)
    assert sorted(on_b.payloads(2)) == [b"after", b"after too"]
    on_b.nothing_more()
    on_a.nothing_more(0.1)


@VERSIONS
def test_nothing_is_lost_when_a_session_moves_in_the_middle_of_a_stream(
    session: Sessions, v5: bool
) -> None:
    """A QoS 1 stream published on edge-c while the client's CONNECT moves its session from
    edge-a to edge-b: every message reaches the client on one edge or the other (edge-c learns
    where the session went one INTEREST later: what it sent to edge-a meanwhile follows)."""
    on_a, topic, pub = session.subscribed("stream", v5)
    sent: list[bytes] = []

    def publish() -> None:
        for n in range(400):
            payload = str(n).encode()
            pub["edge-c"].publish(f"{topic}/x", payload, qos=1)
            sent.append(payload)

    publisher = threading.Thread(target=publish)
    publisher.start()
    while len(sent) < 100:
        time.sleep(0.01)
    on_b = session(session.edges[1], on_a.client_id, v5)
    publisher.join(SETTLE)
    assert len(sent) == 400
    got = set()
    while len(got | _drained(on_a)) < 400:
        got.add(on_b.get(SETTLE).payload)
    assert got | _drained(on_a) == set(sent)


def _drained(client: SessionClient) -> set[bytes]:
    """What ``client`` received (all of it: it is closed)."""
    return {m.payload for m in list(client.messages.queue)}


@VERSIONS
def test_a_clean_start_on_another_edge_discards_the_session_everywhere(
    session: Sessions, v5: bool
) -> None:
    a, b, _ = session.edges
    first, topic, pub = session.subscribed("clean", v5)
    first.close()
    pub["edge-a"].publish(f"{topic}/x", b"queued", qos=1)
    clean = session(b, first.client_id, v5, clean=True)
    assert not clean.session_present
    clean.nothing_more()
    clean.close()
    pub["edge-a"].publish(f"{topic}/x", b"after the clean start", qos=1)
    again = session(a, first.client_id, v5)
    assert not again.session_present  # edge-a's copy is gone, and no edge has another
    again.nothing_more()
    again.close()
    # The session just opened on a is the one that moves now: empty, no subscription.
    last = session(b, first.client_id, v5)
    assert last.session_present
    pub["edge-b"].publish(f"{topic}/x", b"nobody subscribed", qos=1)
    last.nothing_more()


def test_an_mqtt5_session_resumed_with_expiry_0_moves_and_then_ends(session: Sessions) -> None:
    first, topic, pub = session.subscribed("expiry0", True)
    first.close()
    pub["edge-a"].publish(f"{topic}/x", b"queued", qos=1)
    b = session.edges[1]
    last = session(b, first.client_id, True, expiry=0)  # clean start 0: resumed [MQTT-3.1.2-4]
    assert last.session_present
    assert last.payloads(1) == [b"queued"]
    last.close()  # expiry 0: the session ends with this connection
    again = session(b, first.client_id, True)
    assert not again.session_present


def test_the_same_client_id_in_two_tenants_is_two_sessions(session: Sessions) -> None:
    acme, topic, acme_pub = session.subscribed("tenants", True)
    globex, _, globex_pub = session.subscribed("", True, GLOBEX, acme.client_id)
    acme.close()
    acme_pub["edge-b"].publish(f"{topic}/x", b"for acme", qos=1)
    moved = session(session.edges[1], acme.client_id, True)
    assert moved.session_present
    assert moved.payloads(1) == [b"for acme"]
    # globex's client of the same id on a was neither closed nor moved.
    assert not globex.ended.wait(1.0)
    globex_pub["edge-b"].publish(f"{topic}/x", b"for globex", qos=1)
    assert globex.payloads(1) == [b"for globex"]
    moved.nothing_more(0.5)


def test_copies_made_while_an_edge_was_away_merge_when_it_is_back(
    tmp_path: Path, make_client: Any
) -> None:
    """edge-a holds a session with a message queued, and is down when the client connects to
    edge-b: edge-b cannot know, so it opens a new session. When edge-a is back, the links coming
    up hand edge-a's copy (the older CONNECT) to edge-b, merged: the queued message arrives.
    edge-a logged the copy as gone: killed and restarted, it does not bring it back."""
    with meshed(tmp_path) as edges:
        a, b, _ = edges
        session = Sessions(edges, make_client)
        try:
            first, topic, pub = session.subscribed("partition", False)
            first.close()
            pub["edge-a"].publish(f"{topic}/x", b"queued on a", qos=1)
            a.stop()
            on_b = session(b, first.client_id, False)
            assert not on_b.session_present  # the only copy is on an edge it cannot reach
            a.start()
            wait_links_up(a)
            assert on_b.get(SETTLE).payload == b"queued on a"
            on_b.nothing_more()
            a.kill()
            a.start()
            wait_links_up(a)
            wait_links_up(b)
            make_client(port=a.mqtt_port, username=ACME).publish(f"{topic}/x", b"after", qos=1)
            assert on_b.get(SETTLE).payload == b"after"  # its subscription came with it
            on_b.nothing_more(2.0)  # and no copy came back from edge-a's restart
        finally:
            session.close()
