"""Sessions that move between edges (issue 11, broker_edge.handover): the claim rule, the CLAIM
and SESSION frames, and what an edge does when it is claimed from or handed a session, without
sockets (two brokers and a fake mesh between them)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from test_connection import FakeJournal, Peer

from broker_edge import handover, mesh, packets
from broker_edge.broker import Broker
from broker_edge.codec import encode
from broker_edge.handover import MOVED, NONE, STALE, Assembly, Claim, Waiting, verdict
from broker_edge.mesh import FrameBuffer, Interest, MeshProtocolError, PeerRoutes, Unacked
from broker_edge.meshlink import Link, Mesh
from broker_edge.message import Message
from broker_edge.packets import Connect, ProtocolVersion, Publish, QoS, Subscribe, Subscription
from broker_edge.session import Session
from broker_edge.settings import EdgeSettings
from schemas.journal import DEFAULT_TENANT

V4 = ProtocolVersion.MQTT_3_1_1
V5 = ProtocolVersion.MQTT_5


def _claim(version: tuple[int, str], since: tuple[int, str] = (0, ""), wait: bool = True) -> Claim:
    return Claim(DEFAULT_TENANT, "dev-1", version, since, wait)


# -- the rule ------------------------------------------------------------------------------------


def test_the_last_connect_wins() -> None:
    claim = _claim((20, "edge-b"))
    assert verdict(None, False, claim) == NONE  # nothing here
    assert verdict((10, "edge-a"), True, claim) == MOVED  # an older copy moves
    assert verdict((10, "edge-a"), False, claim) == NONE  # a live clean session: just closed
    assert verdict((30, "edge-a"), True, claim) == STALE  # this edge's CONNECT is newer
    assert verdict((20, "edge-c"), True, claim) == STALE  # same time: the node id decides
    assert verdict((20, "edge-a"), True, claim) == MOVED
    assert verdict((0, ""), True, claim) == MOVED  # a copy held by no CONNECT (restored)


def test_a_copy_older_than_a_clean_start_is_dropped_not_moved() -> None:
    clean = _claim((20, "edge-b"), since=(20, "edge-b"), wait=False)
    assert verdict((10, "edge-a"), True, clean) == NONE
    resumed = _claim((40, "edge-b"), since=(20, "edge-b"))  # the same session, later
    assert verdict((10, "edge-a"), True, resumed) == NONE  # from before the clean start
    assert verdict((30, "edge-a"), True, resumed) == MOVED  # made after it (a partition)


def test_two_copies_held_by_no_connect_stay_where_they_are() -> None:
    assert verdict((0, ""), True, _claim((0, ""), wait=False)) == STALE


def test_a_claim_waits_for_every_peer_and_learns_it_lost() -> None:
    waiting = Waiting(_claim((20, "edge-b")), ["edge-a", "edge-c"])
    assert not waiting.answered("edge-a", MOVED)
    waiting.superseded((10, "edge-c"))  # an older claim: no matter
    assert not waiting.stale
    assert waiting.answered("edge-c", NONE)
    assert waiting.moved
    waiting.superseded((30, "edge-c"))
    assert waiting.stale


# -- frames --------------------------------------------------------------------------------------


def test_a_claim_round_trips() -> None:
    claim = _claim((1_700_000_000_000_000, "edge-b"), since=(5, "edge-c"))
    assert handover.parse_claim(handover.claim_body(claim)) == claim


@pytest.mark.parametrize(
    "doc",
    [
        {"t": "", "c": "x", "v": [1, "a"], "s": [0, ""], "w": True},  # no tenant
        {"t": "t", "c": "x", "v": [1, "a"], "s": [0, ""], "w": 1},  # w not a bool
        {"t": "t", "c": "x", "v": [-1, "a"], "s": [0, ""], "w": True},  # negative time
        {"t": "t", "c": "x", "v": [1], "s": [0, ""], "w": True},  # not a pair
        {"t": "t", "c": 7, "v": [1, "a"], "s": [0, ""], "w": True},
    ],
)
def test_a_bad_claim_is_a_protocol_error(doc: dict[str, object]) -> None:
    with pytest.raises(MeshProtocolError):
        handover.parse_claim(json.dumps(doc).encode())
    with pytest.raises(MeshProtocolError):
        handover.parse_claim(b"[1, 2]")


def test_what_a_session_took_lately_round_trips_its_newest_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = {("edge-c", 9), ("edge-a", 12), ("edge-c", 3)}
    doc = json.loads(json.dumps(handover.seen_doc(seen)))
    assert handover.seen_of(doc) == seen
    monkeypatch.setattr(handover, "SEEN_CARRIED", 2)
    assert handover.seen_of(handover.seen_doc(seen)) == {("edge-c", 9), ("edge-a", 12)}


@pytest.mark.parametrize("seen", [{}, [["edge-c"]], [["edge-c", "9"]], [[9, 9]], [["c", True]]])
def test_a_bad_seen_list_is_a_protocol_error(seen: object) -> None:
    with pytest.raises(MeshProtocolError):
        handover.seen_of(seen)


def _session_doc(queued: int, size: int = 10) -> dict[str, object]:
    entry = {"qos": 1, "retain": False, "message": {"payload": "x" * size}}
    return {"tenant": DEFAULT_TENANT, "client_id": "dev-1", "queue": [entry] * queued}


def _answers(bodies: list[bytes]) -> list[handover.Answer]:
    assembly = Assembly()
    return [a for a in (assembly.feed(body) for body in bodies) if a is not None]


def test_an_answer_without_a_session_is_one_frame() -> None:
    claim = _claim((20, "edge-b"))
    bodies, left_out = handover.frames(claim, STALE, None, 1000, 2000)
    assert (len(bodies), left_out) == (1, 0)
    (answer,) = _answers(bodies)
    assert (answer.answer, answer.session, answer.version) == (STALE, None, (20, "edge-b"))


def test_a_long_queue_is_cut_into_frames_and_put_back_together() -> None:
    claim = _claim((20, "edge-b"))
    doc = _session_doc(50, size=100)
    bodies, left_out = handover.frames(claim, MOVED, doc, 1000, 2000)
    assert left_out == 0
    assert len(bodies) > 5
    assert all(len(body) < 1300 for body in bodies)
    assembly = Assembly()
    assert all(assembly.feed(body) is None for body in bodies[:-1])  # not whole yet
    answer = assembly.feed(bodies[-1])
    assert answer is not None
    assert answer.session == doc
    assert answer.answer == MOVED


def test_a_queued_message_over_the_frame_bound_is_left_out() -> None:
    doc = _session_doc(3, size=10)
    doc["queue"] = [*doc["queue"], {"qos": 1, "message": {"payload": "y" * 5000}}]  # type: ignore[list-item]
    bodies, left_out = handover.frames(_claim((20, "edge-b")), MOVED, doc, 1000, 2000)
    assert left_out == 1
    (answer,) = _answers(bodies)
    assert answer.session is not None
    assert len(answer.session["queue"]) == 3


def test_frames_of_two_sessions_must_not_interleave() -> None:
    first, _ = handover.frames(_claim((20, "edge-b")), MOVED, _session_doc(20, 100), 500, 2000)
    second, _ = handover.frames(_claim((30, "edge-b")), MOVED, _session_doc(20, 100), 500, 2000)
    assembly = Assembly()
    assembly.feed(first[0])
    with pytest.raises(MeshProtocolError):
        assembly.feed(second[0])  # a session before the last one ended
    with pytest.raises(MeshProtocolError):
        Assembly().feed(first[1])  # part of a queue without its session
    with pytest.raises(MeshProtocolError):
        Assembly().feed(b'{"t": "t", "c": "x", "v": [1, "a"], "a": "maybe", "end": true}')


# -- the brokers ---------------------------------------------------------------------------------


class FakeMesh:
    """The mesh as the broker sees it: claims are kept, answered when the test says."""

    def __init__(self, wait: bool) -> None:
        self.wait = wait
        self.claims: list[tuple[Claim, Callable[[bool, bool], None]]] = []

    def forward(self, message: Message) -> None:
        pass

    def sys_values(self) -> tuple[tuple[str, str], ...]:
        return ()

    def claim(self, claim: Claim, done: Callable[[bool, bool], None]) -> bool:
        self.claims.append((claim, done))
        return self.wait and claim.wait


def _edge(node: str, now_us: int, wait: bool = True) -> tuple[Broker, FakeMesh]:
    broker = Broker(EdgeSettings(node_id=node), FakeJournal(), wall_clock_us=lambda: now_us)
    mesh = FakeMesh(wait)
    broker.mesh = mesh
    broker.router.interest = Interest()
    return broker, mesh


def _connect(broker: Broker, version: ProtocolVersion, clean: bool = False, **props: int) -> Peer:
    peer = Peer(broker, version)
    properties = packets.Properties(**props) if props else packets.Properties()  # type: ignore[arg-type]
    peer.send(Connect(client_id="dev-1", protocol_version=version, clean_start=clean,
                      properties=properties))  # fmt: skip
    return peer


def _away_on_a() -> tuple[Broker, Peer]:
    """edge-a with dev-1's persistent session (3.1.1), subscribed to fleet/#, offline, and one
    QoS 1 message queued for it."""
    a, mesh = _edge("edge-a", 10, wait=False)
    peer = _connect(a, V4)
    sub = Subscription("fleet/#", QoS.AT_LEAST_ONCE)
    peer.send(Subscribe(packet_id=1, subscriptions=(sub,)))
    peer.send(packets.Disconnect())
    a.connection_gone(peer.conn, 0.0)
    a.accept(DEFAULT_TENANT, "pub", Publish("fleet/x", b"queued", QoS.AT_LEAST_ONCE, 1), "pub")
    assert mesh.claims[0][0].version == (10, "edge-a")
    return a, peer


def test_a_claimed_session_is_handed_over_and_its_filters_withdrawn() -> None:
    a, _ = _away_on_a()
    interest = a.router.interest
    assert interest is not None
    assert interest.counts == {(DEFAULT_TENANT, "fleet/#"): 1}
    answer, doc = a.moves.claimed(_claim((20, "edge-b")), None)
    assert answer == MOVED
    assert doc is not None
    assert [s["filter"] for s in doc["subscriptions"]] == ["fleet/#"]
    assert [q["message"]["topic"] for q in doc["queue"]] == ["fleet/x"]
    assert doc["claim"] == [10, "edge-a"]
    assert (DEFAULT_TENANT, "dev-1") not in a.sessions  # dropped here
    assert interest.counts == {}  # so its filters leave the peers' routes


def test_the_connect_waits_for_the_claim_and_gets_the_session_that_moved() -> None:
    a, _ = _away_on_a()
    b, mesh = _edge("edge-b", 20)
    peer = _connect(b, V4)
    (claim, done), = mesh.claims  # fmt: skip
    assert claim == Claim(DEFAULT_TENANT, "dev-1", (20, "edge-b"), (0, ""), True)
    assert peer.replies() == []  # no CONNACK before the peers answered
    _, doc = a.moves.claimed(claim, None)
    assert doc is not None
    b.moves.adopt(doc)
    done(True, False)
    b.flush_dirty()
    replies = peer.replies()
    assert replies[0] == packets.Connack(session_present=True, reason_code=0)
    assert [(p.topic, p.payload) for p in replies[1:] if isinstance(p, Publish)] == [
        ("fleet/x", b"queued")
    ]
    session = b.sessions[(DEFAULT_TENANT, "dev-1")]
    assert list(session.subscriptions) == ["fleet/#"]
    assert session.claim == (20, "edge-b")
    assert b.router.interest is not None
    assert b.router.interest.counts == {(DEFAULT_TENANT, "fleet/#"): 1}  # told to the peers


def test_a_live_v5_client_is_told_its_session_was_taken_over() -> None:
    a, _ = _edge("edge-a", 10, wait=False)
    peer = _connect(a, V5, session_expiry_interval=300)
    peer.replies()
    answer, doc = a.moves.claimed(_claim((20, "edge-b")), None)
    assert answer == MOVED
    assert doc is not None
    assert doc["expiry_interval"] == 300
    assert peer.replies() == [packets.Disconnect(reason_code=0x8E)]


def test_a_newer_connect_here_is_not_taken_over() -> None:
    a, _ = _edge("edge-a", 30, wait=False)
    peer = _connect(a, V5, session_expiry_interval=300)
    peer.replies()
    assert a.moves.claimed(_claim((20, "edge-b")), None) == (STALE, None)
    assert peer.replies() == []
    assert (DEFAULT_TENANT, "dev-1") in a.sessions
    # A CONNECT of it here, still waiting for its own claim, is newer too.
    assert a.moves.claimed(_claim((25, "edge-b")), (30, "edge-a")) == (STALE, None)


def test_a_connect_that_lost_the_race_is_closed_without_connack() -> None:
    b, mesh = _edge("edge-b", 20)
    peer = _connect(b, V4)
    (_, done), = mesh.claims  # fmt: skip
    done(False, True)
    b.flush_dirty()
    assert peer.replies() == []
    assert peer.closed
    assert (DEFAULT_TENANT, "dev-1") not in b.sessions


def test_a_clean_start_drops_the_older_copy_and_waits_for_nobody() -> None:
    a, _ = _away_on_a()
    b, mesh = _edge("edge-b", 20)
    peer = _connect(b, V4, clean=True)
    assert peer.replies() == [packets.Connack(session_present=False, reason_code=0)]
    (claim, _), = mesh.claims  # fmt: skip
    assert (claim.since, claim.wait) == ((20, "edge-b"), False)
    assert a.moves.claimed(claim, None) == (NONE, None)
    assert (DEFAULT_TENANT, "dev-1") not in a.sessions


def test_a_session_handed_over_merges_into_the_copy_held() -> None:
    a, _ = _away_on_a()
    b, _ = _edge("edge-b", 20, wait=False)
    peer = _connect(b, V4)
    sub = Subscription("other/#", QoS.AT_LEAST_ONCE)
    peer.send(Subscribe(packet_id=1, subscriptions=(sub,)))
    peer.replies()
    _, doc = a.moves.claimed(_claim((20, "edge-b"), wait=False), None)
    assert doc is not None
    b.moves.adopt(doc)  # a copy made while edge-a was unreachable, merged
    session = b.sessions[(DEFAULT_TENANT, "dev-1")]
    assert sorted(session.subscriptions) == ["fleet/#", "other/#"]
    publishes = [p for p in peer.replies() if isinstance(p, Publish)]
    assert [p.payload for p in publishes] == [b"queued"]  # delivered at once: it is online


def test_what_follows_a_waiting_connect_is_handled_after_its_connack() -> None:
    b, mesh = _edge("edge-b", 20)
    peer = Peer(b, V4)
    connect = Connect(client_id="dev-1", protocol_version=V4, clean_start=False)
    sub = Subscribe(packet_id=1, subscriptions=(Subscription("fleet/#", QoS.AT_LEAST_ONCE),))
    b.receive(peer.conn, encode(connect, V4) + encode(sub, V4), 0.0)  # one read
    b.flush_dirty()
    assert peer.replies() == []
    assert (DEFAULT_TENANT, "dev-1") not in b.sessions  # no SUBSCRIBE before the CONNACK
    (_, done), = mesh.claims  # fmt: skip
    done(False, False)
    b.flush_dirty()
    replies = peer.replies()
    assert replies[0] == packets.Connack(session_present=False, reason_code=0)
    assert isinstance(replies[1], packets.Suback)
    assert list(b.sessions[(DEFAULT_TENANT, "dev-1")].subscriptions) == ["fleet/#"]


def _from_c(seq: int, payload: bytes) -> Message:
    return Message(DEFAULT_TENANT, "fleet/x", payload, QoS.AT_LEAST_ONCE, False, "pub", 5, seq=seq,
                   origin="edge-c")  # fmt: skip


def test_a_stand_in_keeps_what_a_third_edge_sent_too_soon_and_it_is_delivered_once() -> None:
    a, _ = _away_on_a()
    b, _ = _edge("edge-b", 20, wait=False)
    _, doc = a.moves.claimed(_claim((20, "edge-b"), wait=False), None)
    assert doc is not None
    stand_in = a.moves.stand_in(doc)
    assert a.router.interest is not None
    assert a.router.interest.counts == {(DEFAULT_TENANT, "fleet/#"): 1}  # still routed here
    b.moves.adopt(doc)
    # edge-c did not know yet: both went to edge-a; the second reached edge-b directly too.
    a.deliver_remote(_from_c(7, b"only to a"))
    a.deliver_remote(_from_c(8, b"to both"))
    b.deliver_remote(_from_c(8, b"to both"))
    late = a.moves.stand_in_done(stand_in)
    assert a.router.interest.counts == {}  # withdrawn now
    assert late is not None
    assert (late["client_id"], late["late"], late["subscriptions"]) == ("dev-1", True, [])
    b.moves.adopt(late)
    peer = _connect(b, V4)
    publishes = [p for p in peer.replies() if isinstance(p, Publish)]
    assert sorted(p.payload for p in publishes) == [b"only to a", b"queued", b"to both"]


def test_late_messages_for_a_session_that_ended_meanwhile_are_dropped() -> None:
    b, _ = _edge("edge-b", 20, wait=False)
    late = {"tenant": DEFAULT_TENANT, "client_id": "dev-1", "expiry_interval": 0, "inflight": [],
            "subscriptions": [], "queue": [], "awaiting_rel": [], "late": True}  # fmt: skip
    b.moves.adopt(late)
    assert (DEFAULT_TENANT, "dev-1") not in b.sessions


def test_an_mqtt5_session_moves_with_its_window_and_subscription_identifiers() -> None:
    a, _ = _edge("edge-a", 10, wait=False)
    on_a = _connect(a, V5, session_expiry_interval=300)
    sub = Subscription("fleet/#", QoS.EXACTLY_ONCE)
    ids = packets.Properties(subscription_identifiers=(7,))
    on_a.send(Subscribe(packet_id=1, subscriptions=(sub,), properties=ids))
    a.accept(DEFAULT_TENANT, "pub", Publish("fleet/x", b"in flight", QoS.EXACTLY_ONCE, 1), "pub")
    a.flush_dirty()
    sent = [p for p in on_a.replies() if isinstance(p, Publish)]
    assert [p.payload for p in sent] == [b"in flight"]  # not acknowledged (no PUBREC)
    a.connection_gone(on_a.conn, 0.0)
    _, doc = a.moves.claimed(_claim((20, "edge-b"), wait=False), None)
    assert doc is not None
    b, _ = _edge("edge-b", 20, wait=False)
    b.moves.adopt(doc)
    on_b = _connect(b, V5, session_expiry_interval=300)
    connack, again = on_b.replies()
    assert isinstance(connack, packets.Connack)
    assert (connack.session_present, connack.reason_code) == (True, 0)
    assert isinstance(again, Publish)
    assert (again.payload, again.dup, again.packet_id) == (b"in flight", True, sent[0].packet_id)
    b.accept(DEFAULT_TENANT, "pub", Publish("fleet/y", b"new", QoS.AT_LEAST_ONCE, 2), "pub")
    b.flush_dirty()
    (new,) = [p for p in on_b.replies() if isinstance(p, Publish)]
    assert new.properties.subscription_identifiers == (7,)


# -- the links: a handover is acknowledged once durable, taken back if a link goes first ----------


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def _linked(broker: Broker, node: str, peer: str) -> tuple[Mesh, Link, Link]:
    """``broker``'s mesh, linked both ways with ``peer`` (no sockets): the link the peer dialed
    (what goes to the peer), the link this edge dialed (what comes from the peer)."""
    links = Mesh(broker, EdgeSettings(node_id=node), lambda: "a-link-token-of-16+")
    inbound, outbound = Link(links, False, f"{peer}:1"), Link(links, True, f"{peer}:1883")
    for link in (inbound, outbound):
        link.transport = FakeTransport()  # type: ignore[assignment]
        link.node, link.up = peer, True
    links.inbound[peer], links.outbound[outbound.address] = inbound, outbound
    links.routes[peer], links.unacked[peer] = PeerRoutes(), Unacked()
    return links, inbound, outbound


def _sent(link: Link, kind: int) -> list[bytes]:
    frames = FrameBuffer(1 << 24).feed(b"".join(link.out))
    return [body for k, body in frames if k == kind]


def test_a_handover_is_kept_until_taken_and_taken_back_if_the_link_goes_first() -> None:
    async def run() -> None:
        a, _ = _away_on_a()
        on_a, to_b, from_b = _linked(a, "edge-a", "edge-b")
        claim = _claim((20, "edge-b"))
        on_a.handle(from_b, mesh.CLAIM, handover.claim_body(claim))
        bodies = _sent(to_b, mesh.SESSION)
        assert (DEFAULT_TENANT, "dev-1") not in a.sessions
        assert len(on_a.handed) == 1
        # edge-b takes it in; it says so once a snapshot holding it is durable.
        b, _ = _edge("edge-b", 20, wait=False)
        on_b, to_a, from_a = _linked(b, "edge-b", "edge-a")
        for body in bodies:
            on_b.handle(from_a, mesh.SESSION, body)
        assert (DEFAULT_TENANT, "dev-1") in b.sessions
        assert _sent(to_a, mesh.TAKEN) == []
        on_b.state(0)  # a snapshot is taken ...
        on_b.covered({})  # ... and durable
        (taken,) = _sent(to_a, mesh.TAKEN)
        on_a.handle(from_b, mesh.TAKEN, taken)
        assert on_a.handed == {}
        # Again, but a link with edge-b goes down before it says it has it: edge-a holds it.
        a2, _ = _away_on_a()
        on_a2, to_b2, from_b2 = _linked(a2, "edge-a", "edge-b")
        on_a2.handle(from_b2, mesh.CLAIM, handover.claim_body(claim))
        assert (DEFAULT_TENANT, "dev-1") not in a2.sessions
        on_a2.lost(to_b2)
        assert on_a2.handed == {}
        session = a2.sessions[(DEFAULT_TENANT, "dev-1")]
        assert [p.message.payload for p in session.queue] == [b"queued"]
        assert session.claim == (10, "edge-a")  # by its old CONNECT: the newer one wins later

    asyncio.run(run())


def _published(peer: Peer) -> list[bytes]:
    """What ``peer`` was sent, acknowledged at once (QoS 1)."""
    publishes = [p for p in peer.replies() if isinstance(p, Publish)]
    for publish in publishes:
        assert publish.packet_id is not None
        peer.send(packets.Puback(packet_id=publish.packet_id))
    return [p.payload for p in publishes]


def _moved_to_b() -> tuple[Broker, Broker, Session, Peer]:
    """dev-1's session moved from edge-a (its stand-in there) to edge-b, where its client got
    the queued message and acknowledged it."""
    a, _ = _away_on_a()
    b, _ = _edge("edge-b", 20, wait=False)
    _, to_b = a.moves.claimed(_claim((20, "edge-b"), wait=False), None)
    assert to_b is not None
    a_stand_in = a.moves.stand_in(to_b)
    b.moves.adopt(to_b)
    on_b = _connect(b, V4)
    assert _published(on_b) == [b"queued"]
    return a, b, a_stand_in, on_b


def test_a_session_that_moves_back_is_sent_a_late_message_once_by_two_stand_ins() -> None:
    """dev-1 moves a -> b -> a -> c, each within the stand-ins' window. edge-c's away-1 (sent
    while the client is off b) reaches edge-a's first stand-in, and edge-b only after edge-a
    claimed the session back: edge-b's stand-in takes it too. The first stand-in's copy is
    delivered on edge-a; edge-b's, coming later, is not (nor handed on to edge-c)."""
    a, b, a_stand_in, on_b = _moved_to_b()
    b.connection_gone(on_b.conn, 0.0)
    a.deliver_remote(_from_c(1, b"away-1"))
    _, to_a = b.moves.claimed(_claim((30, "edge-a"), wait=False), None)
    assert to_a is not None
    assert to_a["queue"] == []  # away-1 reaches edge-b after the claim ...
    b_stand_in = b.moves.stand_in(to_a)
    b.deliver_remote(_from_c(1, b"away-1"))  # ... so its stand-in takes it
    a.moves.adopt(to_a)
    on_a = _connect(a, V4)
    assert _published(on_a) == []
    late = a.moves.stand_in_done(a_stand_in)
    assert late is not None
    a.moves.adopt(late)  # the session came back here: merged here (Mesh._relay)
    assert _published(on_a) == [b"away-1"]
    late = b.moves.stand_in_done(b_stand_in)
    assert late is not None
    a.moves.adopt(late)
    assert _published(on_a) == []  # delivered already
    a.connection_gone(on_a.conn, 0.0)
    _, to_c = a.moves.claimed(_claim((40, "edge-c"), wait=False), None)
    assert to_c is not None
    assert (to_c["inflight"], to_c["queue"]) == ([], [])


def test_what_a_session_took_on_the_edge_it_left_is_not_sent_again_by_a_stand_in() -> None:
    """dev-1 moves a -> b -> a within the stand-in's window: edge-c's message reached edge-a's
    stand-in and the client on edge-b, which acknowledged it. Back on edge-a, the stand-in's
    copy is not delivered: edge-b told what the session took there."""
    a, b, a_stand_in, on_b = _moved_to_b()
    a.deliver_remote(_from_c(1, b"to both"))
    b.deliver_remote(_from_c(1, b"to both"))
    b.flush_dirty()
    assert _published(on_b) == [b"to both"]
    _, to_a = b.moves.claimed(_claim((30, "edge-a"), wait=False), None)
    assert to_a is not None
    assert (to_a["inflight"], to_a["queue"]) == ([], [])
    a.moves.adopt(to_a)
    on_a = _connect(a, V4)
    late = a.moves.stand_in_done(a_stand_in)
    assert late is not None
    a.moves.adopt(late)
    assert _published(on_a) == []
