"""The edge mesh's pure parts (broker_edge.mesh): frames, interest, peer routes, acks, dedup."""

from __future__ import annotations

import contextlib
import json

import pytest

from broker_edge import mesh
from broker_edge.mesh import (
    AckGate,
    Dedup,
    FrameBuffer,
    Interest,
    MeshProtocolError,
    MeshState,
    MeshStateError,
    PeerRoutes,
    PeerState,
    Unacked,
)
from broker_edge.message import Message
from broker_edge.packets import NO_PROPERTIES, Properties, QoS, Subscription
from broker_edge.router import Router, SessionBounds
from broker_edge.tenants import OPERATOR_TENANT as OPERATOR


def _message(**kwargs: object) -> Message:
    fields: dict[str, object] = {
        "tenant": "acme",
        "topic": "fleet/v1/telemetry",
        "payload": b"\x00\x01payload",
        "qos": QoS.AT_LEAST_ONCE,
        "retain": True,
        "client_id": "dev-1",
        "ts_us": 1_700_000_000_000_000,
        "properties": Properties(content_type="application/json", user_properties=(("k", "v"),)),
        "seq": 42,
    }
    fields.update(kwargs)
    return Message(**fields)  # type: ignore[arg-type]


def test_publish_frame_round_trips_whole_and_byte_by_byte() -> None:
    message = _message()
    data = mesh.publish_frame(message) + mesh.ack_frame([1, 2, 3])
    whole = FrameBuffer(1 << 20).feed(data)
    pieces = FrameBuffer(1 << 20)
    by_byte = [f for i in range(len(data)) for f in pieces.feed(data[i : i + 1])]
    assert whole == by_byte
    assert [kind for kind, _ in whole] == [mesh.PUBLISH, mesh.ACK]
    got, shares = mesh.parse_publish(whole[0][1], "edge-a")
    assert shares == ()
    assert (got.tenant, got.topic, got.payload, got.qos, got.client_id, got.ts_us, got.seq) == (
        "acme",
        "fleet/v1/telemetry",
        b"\x00\x01payload",
        QoS.AT_LEAST_ONCE,
        "dev-1",
        1_700_000_000_000_000,
        42,
    )
    assert got.properties.content_type == "application/json"
    assert got.properties.user_properties == (("k", "v"),)
    assert got.retain is True  # a receiver keeps it if it is the newest of its topic
    assert got.origin == "edge-a"  # the link's other end
    assert mesh.parse_ack(whole[1][1]) == (1, 2, 3)


def test_a_big_frame_right_after_the_welcome_is_read_once_the_bound_is_raised() -> None:
    """What an acceptor sends right after its WELCOME (what was not acknowledged, its retained
    set) often comes in the same read: the dialer raises its bound between the two frames."""
    big = mesh.publish_frame(_message(payload=b"x" * 10_000))
    frames = FrameBuffer(mesh.MAX_HELLO_FRAME)
    frames.push(mesh.welcome("a", 1) + big + mesh.PING_FRAME[:3])
    first = frames.pop()
    assert first is not None
    assert first[0] == mesh.WELCOME
    frames.max_frame = 1 << 20
    second = frames.pop()
    assert second is not None
    assert mesh.parse_publish(second[1], "a")[0].payload == b"x" * 10_000
    assert frames.pop() is None  # half a PING so far
    assert frames.feed(mesh.PING_FRAME[3:]) == [(mesh.PING, b"")]
    with pytest.raises(MeshProtocolError):  # without raising it: too big
        FrameBuffer(mesh.MAX_HELLO_FRAME).feed(mesh.welcome("a", 1) + big)


def test_a_message_expiry_interval_crosses() -> None:
    props = Properties(content_type=None, message_expiry_interval=0x01020304)
    frames = FrameBuffer(1 << 20).feed(mesh.publish_frame(_message(properties=props)))
    got, _ = mesh.parse_publish(frames[0][1], "edge-a")
    assert got.properties.message_expiry_interval == 0x01020304
    assert got.properties.content_type is None
    body = bytearray(frames[0][1])
    flags_at = body.index(b"fleet/v1/telemetry") + len("fleet/v1/telemetry") + 2  # empty type
    assert body[flags_at] == 2
    body[flags_at] = 8  # a flag this version does not know
    with pytest.raises(MeshProtocolError, match="flags"):
        mesh.parse_publish(bytes(body), "edge-a")


def test_publish_without_properties() -> None:
    frames = FrameBuffer(1 << 20).feed(mesh.publish_frame(_message(properties=Properties())))
    got, _ = mesh.parse_publish(frames[0][1], "edge-a")
    assert got.properties.content_type is None
    assert got.properties.user_properties == ()


def test_a_plain_publish_takes_the_short_paths_to_the_same_bytes_and_message() -> None:
    """No properties, no shares: publish_frame and parse_publish's fast paths (the mesh's hot
    path) give what their general paths give (a list of shares, even empty, takes those)."""
    for qos in QoS:
        message = _message(properties=NO_PROPERTIES, qos=qos, retain=qos == QoS.AT_MOST_ONCE)
        data = mesh.publish_frame(message)
        assert data == mesh.publish_frame(message, shares=[])
        assert mesh.publish_frame(message, QoS.AT_MOST_ONCE)[13] == 0  # the qos asked for
        [(kind, body)] = FrameBuffer(1 << 20).feed(data)
        got, shares = mesh.parse_publish(body, "edge-a")
        assert (kind, shares, got.properties) == (mesh.PUBLISH, (), NO_PROPERTIES)
        assert (got.qos, got.retain, got.payload, got.client_id) == (
            qos,
            message.retain,
            message.payload,
            "dev-1",
        )
        assert type(got.qos) is QoS
        for cut in range(len(body)):  # cut short: a shorter payload or the protocol error
            with contextlib.suppress(MeshProtocolError):
                assert mesh.parse_publish(body[:cut], "edge-a")[0].payload != message.payload
    with pytest.raises(MeshProtocolError):  # QoS 3
        mesh.parse_publish(b"\x00" * 16 + b"\x03" + body[17:], "edge-a")
    with pytest.raises(MeshProtocolError, match="empty topic or tenant"):
        mesh.parse_publish(body[:18] + b"\x00\x00" + body[24:], "edge-a")


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x00\x00\x00\x05",  # length 0
        b"\xff\xff\xff\xff\x05",  # longer than allowed
        b"\x00\x00\x00\x01\x63",  # unknown kind
    ],
)
def test_bad_frames_are_protocol_errors(data: bytes) -> None:
    with pytest.raises(MeshProtocolError):
        FrameBuffer(4096).feed(data)


@pytest.mark.parametrize(
    "body", [b"", b"\x00" * 10, b"\x00" * 18 + b"\x00\x05ab", b"\x00" * 18 + b"\xff\xff"]
)
def test_truncated_publish_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(MeshProtocolError):
        mesh.parse_publish(body, "edge-a")


def _frame(data: bytes) -> tuple[int, bytes]:
    [(kind, body)] = FrameBuffer(4096).feed(data)
    return kind, body


def test_handshake_proves_the_token_both_ways_without_sending_it() -> None:
    token = "secret-token-123456"
    data = mesh.hello("edge-a", "n-dial")
    assert data.startswith(mesh.MAGIC)
    assert token.encode() not in data
    kind, body = _frame(data[len(mesh.MAGIC) :])
    assert kind == mesh.HELLO
    hello = mesh.parse_hello(body)
    assert hello == mesh.Hello("edge-a", "n-dial")
    assert mesh.refusal(hello, token, "edge-b") is None
    assert "no links" in str(mesh.refusal(hello, None, "edge-b"))
    assert "own" in str(mesh.refusal(hello, token, "edge-a"))
    # The acceptor proves first, over both challenges; the dialer checks, then proves.
    accept = mesh.proof(token, "accept", hello.nonce, "n-acc", "edge-b")
    kind, body = _frame(mesh.challenge("edge-b", "n-acc", accept))
    assert kind == mesh.CHALLENGE
    node, nonce, given = mesh.parse_challenge(body)
    assert mesh.proven(given, token, "accept", "n-dial", nonce, node)
    assert not mesh.proven(given, "other-token-123456", "accept", "n-dial", nonce, node)
    assert not mesh.proven(given, token, "dial", "n-dial", nonce, node)  # roles differ
    assert not mesh.proven(given, token, "accept", "n-replayed", nonce, node)
    dial = mesh.proof(token, "dial", nonce, "n-dial", "edge-a")
    kind, body = _frame(mesh.auth(dial))
    assert kind == mesh.AUTH
    assert mesh.proven(mesh.parse_auth(body), token, "dial", "n-acc", "n-dial", "edge-a")
    with pytest.raises(MeshProtocolError):
        mesh.parse_hello(b'{"v": 99, "node": "x", "nonce": "n"}')
    with pytest.raises(MeshProtocolError):
        mesh.parse_hello(b'{"v": 1, "node": "a/b", "nonce": "n"}')
    with pytest.raises(MeshProtocolError):
        mesh.parse_auth(b'{"proof": 7}')
    assert mesh.nonce() != mesh.nonce()


def test_interest_counts_a_filter_once_per_node() -> None:
    interest = Interest()
    told: list[int] = []
    interest.on_change = lambda: told.append(1)
    interest.add("acme", "fleet/#")
    interest.add("acme", "fleet/#")
    interest.add("globex", "fleet/#")
    [*frames] = interest.take_changes()
    parsed = sorted(_interest(f) for f in frames)
    assert parsed == [("acme", ["fleet/#"], []), ("globex", ["fleet/#"], [])]
    interest.remove("acme", "fleet/#")
    assert interest.take_changes() == []  # one subscriber left
    interest.remove("acme", "fleet/#")
    [removed] = interest.take_changes()
    assert _interest(removed) == ("acme", [], ["fleet/#"])
    interest.add("acme", "x")
    interest.remove("acme", "x")
    assert interest.take_changes() == []  # added and removed before it was sent
    [snapshot] = interest.snapshot()
    assert _interest(snapshot) == ("globex", ["fleet/#"], [])


def _interest(data: bytes) -> tuple[str, list[str], list[str]]:
    """An INTEREST frame's tenant, filters added and filters removed."""
    change = mesh.parse_interest(FrameBuffer(4096).feed(data)[0][1])
    return change.tenant, change.add, change.remove


def test_router_reports_trie_entries_to_interest() -> None:
    router = Router(SessionBounds(10, 10, 1 << 20))
    interest = router.interest = Interest()
    a = router.new_session("acme", "a", True, None)
    b = router.new_session("acme", "b", True, None)
    sub = Subscription("fleet/#", QoS.AT_LEAST_ONCE)
    shared = Subscription("$share/g/fleet/#", QoS.AT_LEAST_ONCE)
    router.subscribe(a, [(None, "fleet/#", sub)], None, 0)
    router.subscribe(a, [(None, "fleet/#", sub)], None, 0)  # again: no new entry
    router.subscribe(b, [(None, "fleet/#", sub), ("g", "fleet/#", shared)], None, 0)
    assert interest.counts == {("acme", "fleet/#"): 2}  # a, b; the group is a share
    assert interest.shares == {("acme", "g", "fleet/#"): 0}  # nobody connected
    router.unsubscribe(a, ["fleet/#"])
    router.drop_session(b)
    assert interest.counts == {}
    assert interest.changes == {}  # came and went before anything was sent


def test_peer_routes_match_per_tenant() -> None:
    routes = PeerRoutes()
    routes.apply("acme", ["fleet/+/telemetry", "$log/#"], [])
    assert routes.wants("acme", "fleet/v1/telemetry")
    assert routes.wants("acme", "$log/mqtt/connect")
    assert not routes.wants("globex", "fleet/v1/telemetry")
    assert not routes.wants("acme", "fleet/v1/status")
    assert routes.filters() == {"acme": ["$log/#", "fleet/+/telemetry"]}
    routes.apply("acme", [], ["fleet/+/telemetry", "$log/#"])
    assert routes.tenants == {}
    assert routes.filters() == {}
    with pytest.raises(MeshProtocolError):
        routes.apply("acme", ["a/#/b"], [])


def test_a_new_links_set_replaces_the_filters_only_once_it_is_all_there() -> None:
    routes = PeerRoutes()
    routes.apply("acme", ["old/#", "kept/#"], [])
    routes.begin()  # the peer dialed again: its whole set comes next
    assert routes.wants("acme", "old/x")  # until it is all here, what it wanted routes
    routes.apply("acme", ["kept/#", "new/#"], [])
    assert routes.wants("acme", "new/x")
    assert routes.wants("acme", "old/x")
    assert routes.filters() == {"acme": ["kept/#", "old/#"]}
    routes.end()
    assert routes.filters() == {"acme": ["kept/#", "new/#"]}
    assert not routes.wants("acme", "old/x")
    routes.apply("acme", [], ["kept/#"])  # changes after the set apply to it
    assert routes.filters() == {"acme": ["new/#"]}
    with pytest.raises(MeshProtocolError):
        routes.end()  # no set was begun
    routes.begin()
    routes.begin()  # a link dropped before its set ended: the next one starts afresh
    routes.apply("acme", ["other/#"], [])
    routes.end()
    assert routes.filters() == {"acme": ["other/#"]}
    [(kind, body)] = FrameBuffer(64).feed(mesh.synced(17))
    assert (kind, mesh.parse_synced(body)) == (mesh.SYNCED, 17)
    assert mesh.parse_synced(b"") is None  # names no seq: no rescan
    with pytest.raises(MeshProtocolError):
        mesh.parse_synced(b'{"seen": -1}')


def test_what_crosses() -> None:
    assert mesh.reach("acme", "fleet/v1") == mesh.FILTERS
    assert mesh.reach("acme", "$log/mqtt/connect") == mesh.FILTERS
    assert mesh.reach("acme", "$counters/messages_in") == mesh.FILTERS
    for local in ("$SYS/broker/uptime", "$control/quota/acme", "$quota/messages_per_day"):
        assert mesh.reach("acme", local) == mesh.LOCAL
    # The operator's decisions reach every edge; journal notices the one they name.
    assert mesh.reach(OPERATOR, "$control/quota/acme") == mesh.EVERY
    assert mesh.reach(OPERATOR, "$control/usage/acme") == mesh.EVERY
    assert mesh.reach(OPERATOR, "$control/journal/edge-b") == "edge-b"
    for local in ("$SYS/broker/uptime", "$quota/x", "$control/other/x", "$control/journal/"):
        assert mesh.reach(OPERATOR, local) == mesh.LOCAL
    assert mesh.reach(OPERATOR, "fleet/x") == mesh.FILTERS
    # A retained message goes to each peer a new link names: a notice only to its own node.
    assert mesh.goes_to("acme", "fleet/x", "edge-b")
    assert mesh.goes_to(OPERATOR, "$control/quota/acme", "edge-b")
    assert mesh.goes_to(OPERATOR, "$control/journal/edge-b", "edge-b")
    assert not mesh.goes_to(OPERATOR, "$control/journal/edge-c", "edge-b")
    assert not mesh.goes_to("acme", "$quota/messages_per_day", "edge-b")


@pytest.mark.parametrize("payload", [b"kept", b""])  # a retained message, a tombstone
def test_retained_frame_names_its_origin(payload: bytes) -> None:
    message = _message(payload=payload, origin="edge-c")
    data = mesh.retained_frame(message)
    pieces = FrameBuffer(1 << 20)
    [(kind, body)] = [f for i in range(len(data)) for f in pieces.feed(data[i : i + 1])]
    assert kind == mesh.RETAINED
    got = mesh.parse_retained(body)
    assert (got.origin, got.topic, got.payload, got.ts_us, got.seq, got.retain) == (
        "edge-c",
        "fleet/v1/telemetry",
        payload,
        1_700_000_000_000_000,
        42,
        True,
    )


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00\x00" + mesh.publish_frame(_message())[5:],  # no origin
        b"\x00\x03a/b" + mesh.publish_frame(_message())[5:],  # not a node id
        b"\x00\x01a" + mesh.publish_frame(_message(retain=False))[5:],  # not retained
        b"\x00\x09edge",  # truncated
    ],
)
def test_a_bad_retained_frame_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(MeshProtocolError):
        mesh.parse_retained(body)


def test_unacked_is_bounded_and_acked_in_any_order() -> None:
    unacked = Unacked(limit=3, limit_bytes=100)
    assert unacked.acked(7) == 7  # nothing waits: all up to there is acknowledged
    for seq in range(1, 6):
        unacked.add(seq, b"x" * 10)
    assert list(unacked.frames) == [3, 4, 5]
    assert unacked.dropped == 2
    assert unacked.acked(9) == 2  # the given-up ones wait no more
    unacked.ack([4, 99])
    assert list(unacked.frames) == [3, 5]
    assert unacked.bytes == 20
    unacked.ack([3])
    assert (unacked.acked(9), unacked.acked(4)) == (4, 4)
    unacked.add(6, b"y" * 95)  # over the byte bound: the oldest go
    assert list(unacked.frames) == [6]


def test_unacked_gives_up_what_the_journal_no_longer_holds() -> None:
    unacked = Unacked()
    for seq in (3, 5, 8):
        unacked.add(seq, b"x" * 10)
    assert unacked.give_up(2) == 0
    assert unacked.give_up(6) == 2
    assert (list(unacked.frames), unacked.bytes, unacked.dropped) == ([8], 10, 2)
    assert unacked.acked(20) == 7
    assert unacked.give_up(100) == 1
    assert unacked.acked(20) == 20


def test_dedup_drops_what_an_origin_sent_again_across_restarts_of_either_end() -> None:
    dedup = Dedup()
    assert [dedup.fresh("a", s) for s in (1, 3, 3, 2, 4)] == [True, True, False, False, True]
    assert dedup.fresh("b", 1)
    assert dedup.dropped == 2
    assert not dedup.origin_at("a", 10)  # a restarted origin: its journal goes on
    assert not dedup.fresh("a", 4)  # what it sends again is dropped
    restored = Dedup()  # a restarted receiver, from its snapshot
    restored.restore({"a": 3})
    assert [restored.fresh("a", s) for s in (2, 3, 4)] == [False, False, True]
    assert dedup.origin_at("a", 2)  # its journal ends before what it sent: it started over
    assert dedup.fresh("a", 1)
    assert dedup.last == {"a": 1, "b": 1}


def test_welcome_names_the_node_and_its_durable_seq() -> None:
    [(kind, body)] = FrameBuffer(4096).feed(mesh.welcome("edge-b", 17))
    assert kind == mesh.WELCOME
    assert mesh.parse_welcome(body) == ("edge-b", 17)
    for bad in (
        b'{"node": "edge-b"}',
        b'{"node": "edge-b", "seq": -1}',
        b'{"node": "b", "seq": "1"}',
    ):
        with pytest.raises(MeshProtocolError):
            mesh.parse_welcome(bad)


def test_the_ack_gate_releases_what_a_durable_snapshot_covers() -> None:
    gate = AckGate()
    assert not gate
    for seq in (5, 7, 9):
        gate.hold("a", seq)
    gate.hold("b", 2)
    assert gate.release({"a": 7}) == {"a": [5, 7]}
    assert gate.release({"a": 7}) == {}  # each acknowledged once
    assert gate
    assert gate.release({"a": 9, "b": 3, "c": 1}) == {"a": [9], "b": [2]}
    assert not gate


def test_mesh_state_round_trips_and_rebuilds_routes() -> None:
    state = MeshState(
        {"edge-b": PeerState(41, {"acme": ["fleet/#", "$log/#"]}), "edge-c": PeerState(7, {})},
        {"edge-b": 12},
    )
    doc = json.loads(json.dumps(state.doc()))
    assert MeshState.of(doc) == state
    assert state.floor() == 7
    routes = MeshState.of(doc).peers["edge-b"].routes()
    assert routes.wants("acme", "fleet/v1")
    assert routes.wants("acme", "$log/mqtt/connect")
    assert not routes.wants("globex", "fleet/v1")
    assert MeshState.of(None) == MeshState({}, {})
    assert MeshState.of(None).floor() is None


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"peers": []},
        {"peers": {"b": {"acked": -1, "filters": {}}}},
        {"peers": {"b": {"acked": 1, "filters": {"acme": "fleet/#"}}}},
        {"peers": {"b": {"acked": True, "filters": {}}}},
        {"delivered": {"b": "3"}},
    ],
)
def test_a_bad_mesh_state_is_an_error(doc: object) -> None:
    with pytest.raises(MeshStateError):
        MeshState.of(doc)


def test_a_bad_filter_in_a_mesh_state_is_an_error() -> None:
    with pytest.raises(MeshStateError):
        MeshState.of({"peers": {"b": {"acked": 1, "filters": {"acme": ["a/#/b"]}}}}).peers[
            "b"
        ].routes()


def test_a_new_links_set_tells_when_each_filter_was_subscribed() -> None:
    interest = Interest()
    interest.clock = iter([100, 200]).__next__
    interest.add("acme", "old/#")
    interest.add("acme", "new/#")
    [(_, body)] = FrameBuffer(4096).feed(b"".join(interest.snapshot()))
    change = mesh.parse_interest(body)
    assert change.at == {"old/#": 100, "new/#": 200}
    assert all(b'"at"' not in data for data in interest.take_changes())  # changes: not timed
    routes = PeerRoutes()
    routes.apply("acme", ["old/#"], [])
    routes.begin()
    routes.apply(change.tenant, change.add, change.remove, change.at)
    assert routes.end() == {("acme", "new/#"): 200}  # the origin did not hold it before
    with pytest.raises(MeshProtocolError):
        mesh.parse_interest(b'{"t": "acme", "add": ["a/#"], "del": [], "at": {"b/#": 1}}')


def test_catch_up_takes_what_new_filters_match_since_they_were_subscribed() -> None:
    catch_up = mesh.CatchUp(10, {("acme", "new/#"): 1_000, ("acme", "late/#"): 5_000})

    def wanted(**kwargs: object) -> bool:
        fields: dict[str, object] = {"topic": "new/x", "retain": False, "seq": 11, "ts_us": 2_000}
        fields.update(kwargs)
        return catch_up.wants(_message(**fields))

    assert wanted()
    assert not wanted(seq=10)  # the peer had it (or it was before its subscription)
    assert not wanted(ts_us=999)  # published before the filter was subscribed
    assert not wanted(topic="late/x")  # ... this one
    assert wanted(topic="late/x", ts_us=5_000)
    assert not wanted(qos=QoS.AT_MOST_ONCE)  # never sent again, as if the link had been up
    assert not wanted(retain=True)  # a retained message went to every peer
    assert not wanted(topic="other/x")
    assert not wanted(tenant="globex")


def test_unacked_merges_older_seqs_in_seq_order() -> None:
    unacked = Unacked(limit=3)
    unacked.add(5, b"five")
    unacked.add(9, b"nine")
    unacked.merge({2: b"two", 7: b"seven"})
    assert list(unacked.frames) == [5, 7, 9]  # over the bound: the oldest given up
    assert unacked.dropped == 1
    assert unacked.bytes == len(b"fivesevennine")
