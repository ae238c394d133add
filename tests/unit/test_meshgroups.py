"""Shared subscriptions across the edge mesh, pure parts (broker_edge.meshgroups, the share
parts of broker_edge.mesh and the router) and a receiving broker without sockets."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from test_sysstats import FakeJournal, Peer

from broker_edge import mesh
from broker_edge.broker import Broker
from broker_edge.meshgroups import PeerShares, ShareChoice
from broker_edge.message import Message
from broker_edge.packets import Disconnect, Publish, QoS, Subscribe, Subscription
from broker_edge.router import Router, SessionBounds
from broker_edge.settings import EdgeSettings
from schemas.journal import DEFAULT_TENANT

G = ("g", "work/#")  # the share $share/g/work/#


def _message(topic: str = "work/1", qos: QoS = QoS.AT_LEAST_ONCE, seq: int = 7) -> Message:
    return Message(DEFAULT_TENANT, topic, b"job", qos, False, "dev", 1_000, seq=seq, origin="a")


# -- which edge gets a message -----------------------------------------------------------------


def test_the_choice_spreads_by_connected_members_evenly_over_time() -> None:
    choice = ShareChoice()
    picks = [choice.pick("acme", G, {"a": 2, "b": 1, "c": 1}) for _ in range(400)]
    assert Counter(picks) == {"a": 200, "b": 100, "c": 100}
    # Smooth: never a long run on one edge (nginx's smooth weighted round-robin).
    assert all(picks[i : i + 4].count("a") == 2 for i in range(0, 400, 4))


def test_edges_that_cannot_deliver_now_take_turns_only_when_none_can() -> None:
    choice = ShareChoice()
    picks = [choice.pick("acme", G, {"a": 0, "b": 3, "c": 0}) for _ in range(10)]
    assert set(picks) == {"b"}  # the only edge with connected members
    picks = [choice.pick("acme", G, {"a": 0, "b": 0, "c": 0}) for _ in range(9)]
    assert Counter(picks) == {"a": 3, "b": 3, "c": 3}  # every holder in turn


def test_split_keeps_local_only_shares_and_gives_the_others() -> None:
    choice = ShareChoice()
    other = ("h", "work/+")
    only_here = ("l", "work/#")
    given_out: Counter[str] = Counter()
    kept_here = 0
    for _ in range(30):
        kept, given = choice.split(
            "acme",
            "a",
            {G: 1, only_here: 1},
            {"b": [(G, 1), (other, 2)], "c": [(G, 1)]},
            linked=["b", "c"],
        )
        assert only_here in kept
        assert other not in kept
        assert other in given["b"]  # only b holds it: always b
        kept_here += G in kept
        given_out.update(node for node, shares in given.items() if G in shares)
    # One of the three edges (one connected member each) gets each message of G.
    assert kept_here + given_out["b"] + given_out["c"] == 30
    assert (kept_here, given_out["b"], given_out["c"]) == (10, 10, 10)


def test_a_peer_whose_link_is_down_gets_nothing_while_another_edge_can_deliver() -> None:
    choice = ShareChoice()
    for _ in range(10):
        kept, given = choice.split("acme", "a", {G: 1}, {"b": [(G, 5)]}, linked=[])
        assert (kept, given) == ({G}, {})
    # Held by nobody who can deliver now: the holders take turns (b's Unacked keeps its turns).
    turns = [choice.split("acme", "a", {G: 0}, {"b": [(G, 5)]}, linked=[]) for _ in range(4)]
    assert [bool(given) for _, given in turns] == [True, False, True, False]


def test_the_choice_forgets_its_turns_beyond_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from broker_edge import meshgroups

    monkeypatch.setattr(meshgroups, "MAX_CHOICES", 3)
    choice = ShareChoice()
    for i in range(10):
        choice.pick("acme", (f"g{i}", "x"), {"a": 1})
    assert len(choice._credit) <= 3


# -- frames ------------------------------------------------------------------------------------


def test_a_publish_names_the_shares_it_is_given_to_whole_and_byte_by_byte() -> None:
    data = mesh.publish_frame(_message(), shares=[G, ("h", "work/+")]) + mesh.PING_FRAME
    whole = mesh.FrameBuffer(1 << 20).feed(data)
    pieces = mesh.FrameBuffer(1 << 20)
    assert whole == [f for i in range(len(data)) for f in pieces.feed(data[i : i + 1])]
    message, shares = mesh.parse_publish(whole[0][1], "a")
    assert shares == (G, ("h", "work/+"))
    assert (message.topic, message.payload, message.seq) == ("work/1", b"job", 7)
    [(_, plain)] = mesh.FrameBuffer(1 << 20).feed(mesh.publish_frame(_message()))
    assert mesh.parse_publish(plain, "a")[1] == ()


def test_bad_shares_in_frames_are_protocol_errors() -> None:
    body = bytearray(mesh.FrameBuffer(1 << 20).feed(mesh.publish_frame(_message()))[0][1])
    flags_at = body.index(b"work/1") + len("work/1") + 2  # after the empty content type
    body[flags_at] |= 4
    body[flags_at + 1 : flags_at + 1] = b"\x00\x00"  # flagged, but a count of none
    with pytest.raises(mesh.MeshProtocolError, match="empty list of shares"):
        mesh.parse_publish(bytes(body), "a")
    with pytest.raises(mesh.MeshProtocolError):  # cut inside the shares
        mesh.parse_publish(bytes(body[: flags_at + 2]), "a")
    retained = Message(DEFAULT_TENANT, "work/1", b"r", QoS.AT_MOST_ONCE, True, "d", 1, seq=1)
    frame_body = mesh.publish_frame(retained, shares=[G])[5:]
    with pytest.raises(mesh.MeshProtocolError, match="RETAINED"):
        mesh.parse_retained(b"\x00\x01a" + frame_body)


def test_interest_tells_shares_apart_from_filters() -> None:
    interest = mesh.Interest()
    told: list[int] = []
    interest.on_change = lambda: told.append(1)
    interest.add("acme", "work/#")
    interest.share("acme", "g", "work/#", 2)
    interest.share("acme", "g", "work/#", 2)  # no change: not told again
    assert len(told) == 2
    [data] = interest.take_changes()
    change = _parsed(data)
    assert (change.add, change.shares, change.unshared) == (["work/#"], [("g", "work/#", 2)], [])
    interest.share("acme", "g", "work/#", None)
    [data] = interest.take_changes()
    change = _parsed(data)
    assert (change.add, change.shares, change.unshared) == ([], [], [G])
    interest.share("globex", "g", "x", 0)
    frames = [_parsed(data) for data in interest.snapshot()]
    assert {(c.tenant, tuple(c.add), tuple(c.shares)) for c in frames} == {
        ("acme", ("work/#",), ()),
        ("globex", (), (("g", "x", 0),)),
    }


def _parsed(data: bytes) -> mesh.InterestChange:
    return mesh.parse_interest(mesh.FrameBuffer(4096).feed(data)[0][1])


@pytest.mark.parametrize(
    "doc",
    [
        {"t": "acme", "add": [], "del": [], "sset": [["g", "x"]]},
        {"t": "acme", "add": [], "del": [], "sset": [["g", "x", -1]]},
        {"t": "acme", "add": [], "del": [], "sset": [["g", "x", True]]},
        {"t": "acme", "add": [], "del": [], "sdel": [["g"]]},
        {"t": "acme", "add": [], "del": [], "sdel": "g"},
    ],
)
def test_a_bad_interest_share_is_a_protocol_error(doc: object) -> None:
    with pytest.raises(mesh.MeshProtocolError):
        mesh.parse_interest(json.dumps(doc).encode())


# -- a peer's shares ---------------------------------------------------------------------------


def test_peer_routes_hold_shares_apart_from_filters() -> None:
    routes = mesh.PeerRoutes()
    routes.apply_shares("acme", [("g", "work/#", 2), ("h", "work/+", 0)], [])
    assert not routes.wants("acme", "work/1")  # a share is not a filter
    assert sorted(routes.shared("acme", "work/1")) == [(G, 2), (("h", "work/+"), 0)]
    assert routes.shared("acme", "work/1/2") == [(G, 2)]
    assert routes.shared("globex", "work/1") == []
    routes.apply_shares("acme", [("g", "work/#", 1)], [("h", "work/+")])  # a count changes
    assert routes.shared("acme", "work/1") == [(G, 1)]
    routes.begin()  # a new link's whole set: what it had routes until the set ends
    routes.apply_shares("acme", [("n", "work/#", 1)], [])
    assert sorted(routes.shared("acme", "work/1")) == [(G, 1), (("n", "work/#"), 1)]
    routes.end()
    assert routes.shared("acme", "work/1") == [(("n", "work/#"), 1)]
    assert routes.has_shares("acme")
    routes.apply_shares("acme", [], [("n", "work/#")])
    assert not routes.has_shares("acme")
    for bad in [("a/b", "x", 1), ("g", "a/#/b", 1), ("", "x", 1), ("g", "x", -1)]:
        with pytest.raises(mesh.MeshProtocolError):
            routes.apply_shares("acme", [bad], [])


def test_mesh_state_keeps_the_peers_shares() -> None:
    held = PeerShares()
    held.set("acme", "g", "work/#", 2)
    state = mesh.MeshState({"b": mesh.PeerState(4, {"acme": ["x/#"]}, held.state())}, {})
    doc = json.loads(json.dumps(state.doc()))
    assert mesh.MeshState.of(doc) == state
    assert mesh.MeshState.of(doc).peers["b"].routes().shared("acme", "work/1") == [(G, 2)]
    old = {"peers": {"b": {"acked": 1, "filters": {}}}}  # a snapshot of link protocol 3
    assert mesh.MeshState.of(old).peers["b"].shares == {}
    short = {"peers": {"b": {"acked": 1, "filters": {}, "shares": {"acme": [["g"]]}}}}
    with pytest.raises(mesh.MeshStateError):
        mesh.MeshState.of(short)
    bad = {"peers": {"b": {"acked": 1, "filters": {}, "shares": {"acme": [["a/b", "x", 1]]}}}}
    with pytest.raises(mesh.MeshStateError):
        mesh.MeshState.of(bad).peers["b"].routes()


# -- the router: shares told, shares routed -----------------------------------------------------


def _router() -> tuple[Router, mesh.Interest]:
    router = Router(SessionBounds(10, 10, 1 << 20))
    interest = router.interest = mesh.Interest()
    return router, interest


def _member(router: Router, client_id: str, full: str = "$share/g/work/#") -> None:
    session = router.new_session(DEFAULT_TENANT, client_id, True, None)
    group, _, topic_filter = full[len("$share/") :].partition("/")
    sub = Subscription(full, QoS.AT_LEAST_ONCE)
    router.subscribe(session, [(group, topic_filter, sub)], None, 0)


def test_the_router_tells_a_share_and_its_connected_members() -> None:
    router, interest = _router()
    _member(router, "m1")
    _member(router, "m2")
    key = (DEFAULT_TENANT, "g", "work/#")
    assert interest.shares == {key: 0}
    assert interest.counts == {}  # members of a share are not a filter
    assert router.shares(DEFAULT_TENANT, "work/1") == {G: 0}
    m1 = router.sessions[(DEFAULT_TENANT, "m1")]
    conn = object()
    router.attach(m1, conn, 0, 10)  # type: ignore[arg-type]
    assert interest.shares == {key: 1}
    assert router.shares(DEFAULT_TENANT, "work/1") == {G: 1}
    router.detach(m1, conn, 1.0)  # type: ignore[arg-type]
    assert interest.shares == {key: 0}
    router.unsubscribe(m1, ["$share/g/work/#"])
    router.drop_session(router.sessions[(DEFAULT_TENANT, "m2")])
    assert interest.shares == {}
    assert router.shares(DEFAULT_TENANT, "work/1") == {}


def test_the_router_gives_a_message_to_the_shares_named_only() -> None:
    router, _ = _router()
    _member(router, "g1")
    _member(router, "h1", "$share/h/work/+")
    plain = router.new_session(DEFAULT_TENANT, "plain", True, None)
    router.subscribe(plain, [(None, "work/#", Subscription("work/#", QoS.AT_LEAST_ONCE))], None, 0)

    def to(shares: object) -> list[str]:
        deliveries = router.route(_message(), None, shares=shares) or []  # type: ignore[arg-type]
        return sorted(d[0].client_id for d in deliveries)

    assert to(None) == ["g1", "h1", "plain"]  # a single edge: every group
    assert to(()) == ["plain"]  # another edge's members have both
    assert to({G}) == ["g1", "plain"]


# -- a receiving broker ------------------------------------------------------------------------


def _receiver() -> Broker:
    broker = Broker(EdgeSettings(node_id="edge-b"), FakeJournal(), wall_clock_us=lambda: 1_000)
    broker.router.interest = mesh.Interest()
    return broker


def _subscribed(broker: Broker, client_id: str, topic_filter: str) -> Peer:
    peer = Peer(broker, client_id)
    peer.send(Subscribe(1, (Subscription(topic_filter, QoS.AT_LEAST_ONCE),)))
    peer.replies()
    return peer


def _got(peer: Peer) -> list[bytes]:
    return [p.payload for p in peer.replies() if isinstance(p, Publish)]


def test_a_peers_publish_reaches_one_member_of_each_share_it_names_and_every_plain_one() -> None:
    broker = _receiver()
    members = [_subscribed(broker, f"m{i}", "$share/g/work/#") for i in range(2)]
    plain = _subscribed(broker, "plain", "work/#")
    assert broker.router.interest is not None
    assert broker.router.interest.shares == {(DEFAULT_TENANT, "g", "work/#"): 2}
    for seq in range(1, 5):
        broker.deliver_remote(_message(seq=seq), (G,))
    broker.deliver_remote(_message(seq=5))  # given to another edge's members
    broker.flush_dirty()
    assert [len(_got(m)) for m in members] == [2, 2]  # one member each time, in turn
    assert len(_got(plain)) == 5  # plain subscribers get every one, once
    members[0].send(Disconnect())
    broker.connection_lost(members[0].conn, 1.0)  # what the listener does next
    assert broker.router.interest.shares == {(DEFAULT_TENANT, "g", "work/#"): 1}


def test_an_offline_persistent_member_takes_a_peers_message_and_a_gone_group_drops_it() -> None:
    broker = _receiver()
    member = Peer(broker, "durable", clean=False)
    member.send(Subscribe(1, (Subscription("$share/g/work/#", QoS.AT_LEAST_ONCE),)))
    broker.connection_lost(member.conn, 1.0)  # offline, its session kept
    assert broker.deliver_remote(_message(seq=1), (G,))  # queued: a snapshot must hold it
    [session] = broker.persistent_sessions()
    assert [p.message.payload for p in session.queue] == [b"job"]
    assert not broker.deliver_remote(_message(seq=2), (("gone", "work/#"),))  # nobody here
    assert len(session.queue) == 1


def test_a_restarted_origin_names_every_share_of_a_peer_in_what_it_rebuilds() -> None:
    from broker_edge.meshlink import Mesh

    origin = Mesh(_receiver(), EdgeSettings(node_id="a"), lambda: None)
    held = PeerShares()
    held.set(DEFAULT_TENANT, "g", "work/#", 1)
    held.set(DEFAULT_TENANT, "h", "work/+", 0)
    origin.restore(
        mesh.MeshState(
            {"b": mesh.PeerState(5, {}, held.state()), "c": mesh.PeerState(9, {}, {})}, {}
        )
    )
    for seq in (5, 6):  # b acknowledged everything up to 5
        origin.replay(_message(seq=seq))
    origin.replay(_message("other/1", seq=7))  # no share of b's
    frames = origin.unacked["b"].frames
    assert list(frames) == [6]
    [(_, body)] = mesh.FrameBuffer(1 << 20).feed(frames[6])
    assert sorted(mesh.parse_publish(body, "a")[1]) == [G, ("h", "work/+")]
    assert not origin.unacked["c"].frames


class _Link:
    """What Mesh.forward needs of a link: frames sent, never backed up."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    @staticmethod
    def congested() -> bool:
        return False


def test_the_origin_gives_each_qos0_publish_to_one_edge_and_sends_no_one_else_a_copy() -> None:
    from broker_edge.meshlink import Mesh

    broker = _receiver()
    _subscribed(broker, "local", "$share/g/work/#")  # one connected member here
    origin = Mesh(broker, EdgeSettings(node_id="a"), lambda: None)
    links = {node: _Link() for node in ("b", "c", "d")}
    for node in ("b", "c", "d"):
        routes = origin.routes[node] = mesh.PeerRoutes()
        routes.apply_shares(DEFAULT_TENANT, [("g", "work/#", 1)], [])
    origin.inbound = {node: links[node] for node in ("b", "c")}  # type: ignore[misc]
    kept = [origin.forward(_message(qos=QoS.AT_MOST_ONCE)) for _ in range(6)]
    assert sum(G in k for k in kept if k is not None) == 2  # here, in turn
    for node in ("b", "c"):
        shares = [mesh.parse_publish(b[5:], "a")[1] for b in links[node].sent]
        assert shares == [(G,), (G,)]
    assert links["d"].sent == []  # its link is down: others can deliver now
    assert origin.shares_given == 4
