"""A mesh link that breaks while both edges run (issue 11): two edges in this process (their
state is read on their loops), linked with a mesh token, and stock paho clients."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from broker_edge import mesh
from broker_edge.meshlink import Mesh
from broker_edge.settings import EdgeSettings
from ingest.journal import JournalReader
from tests.helpers.mesh_clients import SETTLE, settle
from tests.integration.conftest import RunningEdge

TOKEN = "mesh-token-for-tests"


@pytest.fixture
def pair(edge_settings: EdgeSettings) -> Iterator[tuple[RunningEdge, RunningEdge]]:
    """Edge "a", and edge "b" dialing it: publishes on a reach subscribers on b."""
    base = replace(edge_settings, mesh_token=TOKEN)
    a = RunningEdge(replace(base, node_id="a", data_dir=base.data_dir / "a")).start()
    b_settings = replace(
        base, node_id="b", data_dir=base.data_dir / "b", peers=(f"127.0.0.1:{a.port}",)
    )
    b = RunningEdge(b_settings).start()
    yield a, b
    b.stop()
    a.stop()


def _mesh(edge: RunningEdge) -> Mesh:
    assert edge.node.mesh is not None
    return edge.node.mesh


def _until(edge: RunningEdge, read: Any) -> None:
    deadline = time.monotonic() + SETTLE
    while not edge.call(read):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _break_link(b: RunningEdge) -> None:
    """Reset b's link to a (as a network fault would), on b's loop."""

    def reset() -> None:
        for link in _mesh(b).outbound.values():
            assert link.transport is not None
            link.transport.abort()

    b.call(reset)


def _crossing(
    pair: tuple[RunningEdge, RunningEdge], make_client: Any, prefix: str, qos: int
) -> tuple[Any, Any]:
    """A subscriber to ``prefix/#`` on b and a publisher on a, once a routes it to b."""
    a, b = pair
    sub = make_client("sub", port=b.port)
    sub.subscribe(f"{prefix}/#", qos=qos)
    pub = make_client("pub", port=a.port)
    settle(pub, [sub], f"{prefix}/probe")
    return sub, pub


def test_a_broken_link_resends_what_was_not_acknowledged_once(
    pair: tuple[RunningEdge, RunningEdge], make_client: Any
) -> None:
    a, b = pair
    sub, pub = _crossing(pair, make_client, "brk", 1)

    # b gets these and acknowledges them, but a never hears the acks: after the break a sends
    # them again, and b drops them by (origin, seq).
    unheard: list[int] = []

    def deaf() -> None:
        _mesh(a).unacked["b"].ack = unheard.extend  # type: ignore[method-assign]

    a.call(deaf)
    for i in range(3):
        pub.publish("brk/x", f"m{i}".encode(), qos=1)
    assert [sub.get().payload for _ in range(3)] == [b"m0", b"m1", b"m2"]
    _until(a, lambda: len(unheard) == 3)  # no ack of them comes on this link any more
    a.call(lambda: delattr(_mesh(a).unacked["b"], "ack"))
    _break_link(b)
    _until(b, lambda: _mesh(b).dedup.dropped == 3)
    _until(a, lambda: not _mesh(a).unacked["b"].frames)  # acknowledged this time
    sub.nothing_more()

    # Published while the link is down (or going down): kept by a, sent when b is back.
    _break_link(b)
    for i in range(3, 6):
        pub.publish("brk/x", f"m{i}".encode(), qos=1)
    assert [sub.get(timeout=SETTLE).payload for _ in range(3)] == [b"m3", b"m4", b"m5"]
    sub.nothing_more()
    assert b.call(lambda: _mesh(b).states) == {f"127.0.0.1:{a.port}": "up"}


def test_what_a_persistent_session_took_is_acknowledged_once_a_snapshot_holds_it(
    pair: tuple[RunningEdge, RunningEdge], make_client: Any
) -> None:
    """A receiver killed before its snapshot holds the message must not have acknowledged it
    (its origin would never send it again)."""
    a, b = pair
    sub = make_client("durable", port=b.port, clean_session=False)
    sub.subscribe("gate/#", qos=1)
    pub = make_client("pub", port=a.port)
    settle(pub, [sub], "gate/probe")
    pub.publish("gate/x", b"kept", qos=1)
    assert sub.get().payload == b"kept"
    reader = JournalReader(a.node.settings.journal_root / "a")
    [seq] = [r["seq"] for r in reader.read_records(0, reader.last_seq()) if r["payload"] == b"kept"]
    _until(a, lambda: seq not in _mesh(a).unacked["b"].frames)
    snapshot = json.loads(b.node.snapshot_path.read_bytes())
    assert snapshot["mesh"]["delivered"]["a"] >= seq
    sub.nothing_more()


def test_publishes_before_a_new_links_filters_are_all_there_still_cross(
    pair: tuple[RunningEdge, RunningEdge], make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dialer's whole set of filters takes a while to arrive after a link is admitted
    (here: forever); the origin routes by the filters the peer had until then."""
    a, b = pair
    sub = make_client("sub", port=b.port)
    sub.subscribe("gap/#", qos=1)
    pub = make_client("pub", port=a.port)
    settle(pub, [sub], "gap/probe")

    held = _mesh(b).interest.snapshot
    b.call(lambda: setattr(_mesh(b).interest, "snapshot", list))  # tells nothing
    monkeypatch.setattr(mesh, "synced", lambda seen: mesh.PING_FRAME)  # never ends the set
    _break_link(b)
    _until(b, lambda: _mesh(b).states[f"127.0.0.1:{a.port}"] == "up")
    _until(a, lambda: _mesh(a).routes["b"].incoming is not None)
    for qos in (0, 1):
        pub.publish("gap/x", f"q{qos}".encode(), qos=qos)
    assert sorted(sub.get(timeout=SETTLE).payload for _ in range(2)) == [b"q0", b"q1"]

    b.call(lambda: setattr(_mesh(b).interest, "snapshot", held))
    monkeypatch.undo()
    _break_link(b)
    _until(a, lambda: _mesh(a).routes["b"].incoming is None)  # the set came whole this time
    assert a.call(lambda: dict(_mesh(a).routes["b"].filters())) == {"default": ["gap/#"]}
    pub.publish("gap/y", b"after", qos=1)
    assert sub.get(timeout=SETTLE).payload == b"after"
    sub.nothing_more()


def test_an_impostor_at_a_peers_address_gets_no_proof_and_no_link(
    edge_settings: EdgeSettings,
) -> None:
    """Something listening at a peer's address without the token: its CHALLENGE proves
    nothing, so the edge sends no AUTH and gives the link up."""
    server = socket.create_server(("127.0.0.1", 0))
    heard: list[bytes] = []

    def impostor() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(SETTLE)
            heard.append(conn.recv(4096))
            conn.sendall(mesh.challenge("peer", "n-fake", "00" * 32))
            while chunk := conn.recv(4096):
                heard.append(chunk)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    settings = replace(edge_settings, mesh_token=TOKEN, peers=(address,))
    edge = RunningEdge(settings).start()
    try:
        _until(edge, lambda: _mesh(edge).states[address] == "refused")
        thread.join(SETTLE)
        assert heard[0].startswith(mesh.MAGIC)
        assert all(TOKEN.encode() not in data for data in heard)
        frames = mesh.FrameBuffer(4096).feed(b"".join(heard)[len(mesh.MAGIC) :])
        assert [kind for kind, _ in frames] == [mesh.HELLO]  # no AUTH
    finally:
        edge.stop()
        server.close()


def test_filters_are_told_once_per_node_and_a_publish_crosses_once(
    pair: tuple[RunningEdge, RunningEdge], make_client: Any
) -> None:
    a, b = pair
    subs = [make_client(f"sub-{i}", port=b.port) for i in range(3)]
    for sub in subs:
        sub.subscribe("agg/#", qos=1)
    subs[0].subscribe("agg/+/x", qos=0)  # a second filter of one client matching the same
    pub = make_client("pub", port=a.port)
    settle(pub, subs, "agg/probe/x")

    def wanted() -> dict[str, list[str]]:
        return _mesh(a).routes["b"].filters()

    assert a.call(wanted) == {"default": ["agg/#", "agg/+/x"]}
    before = a.call(lambda: _mesh(a).forwarded)
    pub.publish("agg/v/x", b"one", qos=1)
    for sub in subs:
        assert sub.get().payload == b"one"
        sub.nothing_more()
    assert a.call(lambda: _mesh(a).forwarded) == before + 1  # once to b, not once per sub
    subs[0].paho.unsubscribe("agg/+/x")
    subs[1].paho.unsubscribe("agg/#")
    _until(a, lambda: wanted() == {"default": ["agg/#"]})  # two subscribers still hold it
    for sub in (subs[0], subs[2]):
        sub.paho.unsubscribe("agg/#")
    _until(a, lambda: wanted() == {})


def test_a_link_that_comes_back_brings_the_retained_messages_missed_while_it_was_down(
    pair: tuple[RunningEdge, RunningEdge], make_client: Any
) -> None:
    a, b = pair
    live, pub = _crossing(pair, make_client, "lost", 0)
    a.call(lambda: setattr(_mesh(a), "forward", lambda message: None))  # lost on the way
    pub.publish("lost/x", b"set while cut off", qos=0, retain=True)
    assert a.node.broker is not None
    retained = a.node.broker.namespace("default").retained
    _until(a, lambda: retained.matching("lost/x"))  # a took it (QoS 0: no ack says so)
    a.call(lambda: delattr(_mesh(a), "forward"))
    live.nothing_more()
    taken = b.call(lambda: _mesh(b).retained_taken)
    _break_link(b)
    _until(b, lambda: _mesh(b).retained_taken > taken)
    late = make_client("late", port=b.port)
    late.subscribe("lost/#", qos=0)
    got = late.get()
    assert (got.topic, got.payload, got.retain) == ("lost/x", b"set while cut off", True)
    live.nothing_more()  # a link's retained set is state, not a publish: delivered to nobody
