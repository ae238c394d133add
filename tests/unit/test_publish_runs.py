"""Runs: the QoS 0 publishes to one topic that follow each other in a read are taken as one
(``Decoder.same_publishes``, ``Connection.take_run``, ``Broker.accept_run``), and nothing a
client, a subscriber or the journal sees may differ from taking them one by one. Sans-IO, a
fake journal; the one-by-one reference is the same bytes fed a byte at a time (no read then
holds two packets, so no run is ever taken)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_connection import FakeJournal, Peer, connected

from broker_edge.broker import Broker
from broker_edge.codec import Decoder, PacketTooLarge, encode
from broker_edge.errors import ProtocolError
from broker_edge.message import Message
from broker_edge.packets import (
    Connect,
    Properties,
    ProtocolVersion,
    Puback,
    Publish,
    QoS,
    ReasonCode,
    Subscribe,
    Subscription,
)
from broker_edge.settings import EdgeSettings
from broker_edge.tenants import parse

V4 = ProtocolVersion.MQTT_3_1_1
V5 = ProtocolVersion.MQTT_5
VERSIONS = [V4, V5]


def _topic(first: Publish) -> bytes:
    """What Connection.take_run compares: the topic name in ``first``'s packet."""
    assert first.wire is not None
    head = 2 if first.wire[1] < 0x80 else 3
    return first.wire[head : head + 2 + len(first.topic.encode())]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_run_is_the_packets_of_the_same_topic_up_to_the_first_other_one(version) -> None:
    same = [Publish(topic="a/b", payload=b"%d" % i * (i * 40)) for i in range(5)]  # 0..160 B
    after = [
        Publish(topic="a/c", payload=b"other topic"),
        Publish(topic="a/b", payload=b"qos 1", qos=QoS.AT_LEAST_ONCE, packet_id=1),
    ]
    decoder = Decoder(protocol_version=version)
    decoder.feed(b"".join(encode(p, version) for p in same + after))
    first = decoder.next_packet()
    assert first == same[0]
    assert isinstance(first, Publish)
    run = decoder.same_publishes(0, _topic(first), 100, 10**6)
    assert run is not None
    payloads, pids, (wire,) = run
    assert pids == []
    assert payloads == [p.payload for p in same[1:]]
    # The packets as they came (one with a two-byte remaining length among them).
    assert wire == b"".join(encode(p, version) for p in same[1:])
    assert decoder.decoded == 5
    assert list(decoder.packets()) == after


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "breaker",
    [
        Publish(topic="a/b", payload=b"kept", retain=True),
        Publish(topic="a/bc", payload=b"longer topic"),
        Publish(topic="a", payload=b"shorter topic"),
        Publish(topic="a/b", payload=b"", qos=QoS.AT_LEAST_ONCE, packet_id=9),
    ],
    ids=["retain", "longer-topic", "shorter-topic", "qos1"],
)
def test_a_run_stops_at_a_packet_that_is_not_the_same(version, breaker) -> None:
    sent = [Publish(topic="a/b", payload=b"1"), Publish(topic="a/b", payload=b"2"), breaker]
    decoder = Decoder(protocol_version=version)
    decoder.feed(b"".join(encode(p, version) for p in sent))
    first = decoder.next_packet()
    assert isinstance(first, Publish)
    run = decoder.same_publishes(0, _topic(first), 100, 10**6)
    assert run is not None
    assert run[0] == [b"2"]
    assert decoder.same_publishes(0, _topic(first), 100, 10**6) is None
    assert decoder.next_packet() == breaker


@pytest.mark.parametrize("version", VERSIONS)
def test_a_qos1_run_gives_each_packet_and_its_id_and_stops_at_id_0(version) -> None:
    same = [
        Publish(topic="a/b", payload=b"%d" % i * (i * 60), qos=QoS.AT_LEAST_ONCE, packet_id=i + 1)
        for i in range(4)
    ]
    decoder = Decoder(protocol_version=version)
    zero = bytearray(encode(Publish(topic="a/b", qos=QoS.AT_LEAST_ONCE, packet_id=1), version))
    zero[7:9] = b"\x00\x00"  # packet id 0 [MQTT-2.3.1-1]: the header, 3, "a/b", then the id
    decoder.feed(b"".join(encode(p, version) for p in same) + bytes(zero))
    first = decoder.next_packet()
    assert first == same[0]
    assert isinstance(first, Publish)
    run = decoder.same_publishes(1, _topic(first), 100, 10**6)
    assert run is not None
    assert run == (
        [p.payload for p in same[1:]],
        [2, 3, 4],
        [encode(p, version) for p in same[1:]],
    )
    with pytest.raises(ProtocolError):
        decoder.next_packet()


def test_a_v5_publish_with_properties_ends_a_run() -> None:
    props = Publish(topic="a/b", payload=b"typed", properties=Properties(content_type="x"))
    decoder = Decoder(protocol_version=V5)
    decoder.feed(b"".join(encode(p, V5) for p in [Publish(topic="a/b", payload=b"1"), props]))
    first = decoder.next_packet()
    assert isinstance(first, Publish)
    assert decoder.same_publishes(0, _topic(first), 100, 10**6) is None
    assert decoder.next_packet() == props


def test_a_run_takes_no_more_than_it_is_allowed() -> None:
    sent = [Publish(topic="t", payload=bytes(10)) for _ in range(10)]
    decoder = Decoder(protocol_version=V4)
    decoder.feed(b"".join(encode(p, V4) for p in sent))
    first = decoder.next_packet()
    assert isinstance(first, Publish)
    prefix = _topic(first)
    run = decoder.same_publishes(0, prefix, 3, 10**6)
    assert run is not None
    assert len(run[0]) == 3  # by count
    run = decoder.same_publishes(0, prefix, 100, 25)
    assert run is not None
    assert len(run[0]) == 2  # by payload bytes: a third would be 30
    assert decoder.same_publishes(0, prefix, 100, 9) is None
    assert len(list(decoder.packets())) == 4  # what is left comes out one by one
    assert decoder.decoded == 10


def test_a_packet_cut_by_the_read_or_too_large_is_left_to_next_packet() -> None:
    small = encode(Publish(topic="t", payload=b"ok"), V4)
    big = encode(Publish(topic="t", payload=bytes(200)), V4)
    decoder = Decoder(protocol_version=V4, max_packet_size=100)
    decoder.feed(small + small + small[:3])
    first = decoder.next_packet()
    assert isinstance(first, Publish)
    run = decoder.same_publishes(0, _topic(first), 100, 10**6)
    assert run is not None
    assert run[0] == [b"ok"]  # not the half packet
    decoder.feed(small[3:] + big)
    assert decoder.next_packet() == first
    assert decoder.same_publishes(0, _topic(first), 100, 10**6) is None  # not the big one
    with pytest.raises(PacketTooLarge):
        decoder.next_packet()


# -- the broker: a run delivers, journals and counts as one publish at a time would --------


def _subscriber(broker: Broker, name: str, version: ProtocolVersion, sub: Subscription) -> Peer:
    peer = connected(broker, name, version)
    peer.send(Subscribe(packet_id=1, subscriptions=(sub,)))
    peer.replies()
    return peer


def _feed(broker: Broker, peer: Peer, read: bytes) -> None:
    """One read, handled in as many turns as it takes."""
    data = read
    while broker.receive(peer.conn, data, 0.0):
        data = b""  # a turn cut short: the rest of the read


class Forwarder:
    """The mesh as the broker sees it: what it was given to forward, in order."""

    def __init__(self) -> None:
        self.forwarded: list[tuple[int, str, bytes, int]] = []

    def forward(self, message: Message) -> None:
        self.forwarded.append((message.seq, message.topic, message.payload, message.qos))

    def sys_values(self) -> tuple[tuple[str, str], ...]:
        return ()

    def claim(self, claim: object, done: object) -> bool:
        return False  # nobody to wait for


world_runs: list[list[int]] = []  # the runs of each _world, newest last


def _world(
    read: bytes,
    *,
    byte_by_byte: bool,
    version: ProtocolVersion,
    shared: bool = False,
    meshed: bool = False,
) -> dict[str, Any]:
    """A publisher of ``version`` sends ``read`` (one read, or a byte at a time) to subscribers
    of both versions, one with a subscription identifier, one with retain-as-published (and,
    ``shared``, two members of a shared group; ``meshed``, a mesh that is given each
    publish); what each got, what the journal holds, what the mesh was given and what the
    broker counted."""
    journal = FakeJournal()
    broker = Broker(EdgeSettings(node_id="unit"), journal, wall_clock_us=lambda: 5_000_000)
    mesh = Forwarder()
    if meshed:
        broker.mesh = mesh
    subs = {
        "v4": _subscriber(broker, "v4", V4, Subscription("#")),
        "v5": _subscriber(broker, "v5", V5, Subscription("a/#", qos=QoS.AT_LEAST_ONCE)),
        "v5-rap": _subscriber(broker, "v5-rap", V5, Subscription("a/b", retain_as_published=True)),
    }
    if shared:  # the tenant's runs are then routed message by message
        for name, version_ in (("shared-1", V4), ("shared-2", V5)):
            subs[name] = _subscriber(broker, name, version_, Subscription("$share/g/a/#"))
    subs["v5-id"] = connected(broker, "v5-id", V5)
    subs["v5-id"].send(
        Subscribe(
            packet_id=1,
            subscriptions=(Subscription("a/b"),),
            properties=Properties(subscription_identifiers=(7,)),
        )
    )
    subs["v5-id"].replies()
    publisher = connected(broker, "pub", version)
    publisher.replies()
    in_runs: list[int] = []  # how many publishes each run took (not compared: a byte at a
    accept_run = broker.accept_run  # time takes none)

    def counted(*args: Any) -> int:
        in_runs.append(len(args[4]))
        return accept_run(*args)

    broker.accept_run = counted  # type: ignore[method-assign]
    chunks = [read[i : i + 1] for i in range(len(read))] if byte_by_byte else [read]
    for chunk in chunks:
        _feed(broker, publisher, chunk)
        broker.flush_dirty()
        journal.make_durable()
        broker.flush_dirty()
    stats = broker.stats
    world_runs.append(in_runs)
    return {
        "got": {name: peer.replies() for name, peer in subs.items()},
        "publisher": publisher.replies(),
        "journal": journal.device,
        "forwarded": mesh.forwarded,
        "counts": (stats.messages_in, stats.bytes_in, stats.messages_out, stats.bytes_out),
        "packets_in": stats.packets_in,
    }


# Bursts: publishes to one topic at one QoS in a row (a run after the first, unless retained),
# their payloads of one- and two-byte remaining lengths.
_bursts = st.lists(
    st.tuples(
        st.sampled_from(["a/b", "a/c", "b"]),
        st.sampled_from([QoS.AT_MOST_ONCE] * 2 + [QoS.AT_LEAST_ONCE]),
        st.sampled_from([False] * 5 + [True]),
        st.lists(st.binary(max_size=300), min_size=1, max_size=6),
    ),
    max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bursts=_bursts,
    version=st.sampled_from(VERSIONS),
    shared=st.booleans(),
    meshed=st.booleans(),
)
def test_a_read_in_runs_gives_what_one_packet_at_a_time_gives(
    bursts, version, shared, meshed
) -> None:
    ids = iter(range(1, 1000))
    sent = [
        Publish(topic, payload, qos, retain, False, next(ids) if qos else None)
        for topic, qos, retain, payloads in bursts
        for payload in payloads
    ]
    read = b"".join(encode(p, version) for p in sent)
    kind = {"version": version, "shared": shared, "meshed": meshed}
    assert _world(read, byte_by_byte=False, **kind) == _world(read, byte_by_byte=True, **kind)


def test_a_long_run_reaches_every_subscriber_once_and_in_order() -> None:
    sent = [Publish(topic="a/b", payload=b"%04d" % i) for i in range(3000)]
    read = b"".join(encode(p, V4) for p in sent)
    world = _world(read, byte_by_byte=False, version=V4)
    assert world_runs[-1] == [1024, 1024, 949]  # each after one publish taken on its own
    assert [p.payload for p in world["got"]["v4"]] == [p.payload for p in sent]
    assert [p.payload for p in world["got"]["v5-id"]] == [p.payload for p in sent]
    assert {p.properties.subscription_identifiers for p in world["got"]["v5-id"]} == {(7,)}
    assert [r["payload"] for r in world["journal"]] == [p.payload for p in sent]
    assert world["counts"] == (3000, 4 * 3000, 4 * 3000, 4 * 4 * 3000)


def test_a_run_stops_at_the_local_quota_and_the_rest_is_refused() -> None:
    """Issue 14's local quota looks at each publish: a run stops short of the one that
    reaches the limit, which handle_publish takes (the tenant is blocked with it)."""
    tenants = parse(
        {
            "operator": {"token": "op"},
            "tenants": {"acme": {"tokens": ["acme-1"], "limits": {"messages_per_day": 10}}},
        }
    )
    journal = FakeJournal()
    broker = Broker(EdgeSettings(node_id="unit"), journal, wall_clock_us=lambda: 1, tenants=tenants)
    peers = []
    for name in ("sub", "pub"):
        peer = Peer(broker, V5)
        peer.send(Connect(client_id=name, protocol_version=V5, username="acme-1"))
        peer.replies()
        peers.append(peer)
    sub, pub = peers
    sub.send(Subscribe(packet_id=1, subscriptions=(Subscription("t"),)))
    sub.replies()
    read = b"".join(encode(Publish(topic="t", payload=b"%d" % i), V5) for i in range(15))
    try:
        broker.receive(pub.conn, read, 0.0)
    except ProtocolError as exc:  # pragma: no cover (the refusals are not protocol errors)
        raise AssertionError(exc) from exc
    broker.flush_dirty()
    assert [p.payload for p in sub.replies()] == [b"%d" % i for i in range(10)]
    assert [r["payload"] for r in journal.device] == [b"%d" % i for i in range(10)]
    assert "acme" in broker.tenancy.blocked


@pytest.mark.parametrize("version", VERSIONS)
def test_a_qos1_run_is_acknowledged_in_order_once_durable(version) -> None:
    sent = [
        Publish(topic="a/b", payload=b"%d" % i, qos=QoS.AT_LEAST_ONCE, packet_id=i + 1)
        for i in range(90)  # under the receive maximum (100): nothing is durable mid-read
    ]
    read = b"".join(encode(p, version) for p in sent)
    world = _world(read, byte_by_byte=False, version=version)
    assert world_runs[-1] == [89]
    assert world == _world(read, byte_by_byte=True, version=version)
    assert world["publisher"] == [Puback(packet_id=i + 1) for i in range(90)]
    assert [(r["payload"], r["qos"]) for r in world["journal"]] == [(p.payload, 1) for p in sent]
    v5 = world["got"]["v5"]  # at QoS 1, its in-flight window full, the rest queued
    assert [p.payload for p in v5] == [p.payload for p in sent[: len(v5)]]
    assert {p.qos for p in v5} == {QoS.AT_LEAST_ONCE}
    assert len({p.packet_id for p in v5}) == len(v5)


def test_a_v5_qos1_run_over_the_receive_maximum_is_refused_as_one_by_one() -> None:
    limit = EdgeSettings(node_id="unit").max_inflight_messages
    sent = [
        Publish(topic="a/b", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=i + 1)
        for i in range(limit + 5)
    ]
    read = b"".join(encode(p, V5) for p in sent)
    # Nothing is durable until the whole read is handled: the publish over the limit comes
    # while every one before it is unacknowledged.
    journal = FakeJournal()
    broker = Broker(EdgeSettings(node_id="unit"), journal, wall_clock_us=lambda: 1)
    publisher = connected(broker, "pub", V5)
    publisher.replies()
    with pytest.raises(ProtocolError) as refused:
        _feed(broker, publisher, read)
    assert refused.value.reason_code == ReasonCode.RECEIVE_MAXIMUM_EXCEEDED
    assert len(journal.device) == limit


# -- a subscriber's PUBACKs in a row: taken at once, the queue drained after them -----------


def _acks_world(*, byte_by_byte: bool, skip: int, version: ProtocolVersion) -> dict[str, Any]:
    """A v5 subscriber with a receive maximum of 5 gets 23 QoS 1 messages (one read of a
    ``version`` publisher: v5, its packets with the subscriber's ids): it acknowledges what
    it got each time in one read (or a byte at a time), but for ``skip`` (acknowledged late:
    a gap in the run), until it has them all. What it got, write by write."""
    journal = FakeJournal()
    broker = Broker(EdgeSettings(node_id="unit"), journal, wall_clock_us=lambda: 1)
    sub = Peer(broker, V5)
    sub.send(
        Connect(client_id="sub", protocol_version=V5, properties=Properties(receive_maximum=5))
    )
    sub.replies()
    sub.send(Subscribe(packet_id=1, subscriptions=(Subscription("t", qos=QoS.AT_LEAST_ONCE),)))
    sub.replies()
    pub = connected(broker, "pub", version)
    pub.replies()
    sent = [
        Publish(topic="t", payload=b"%d" % i, qos=QoS.AT_LEAST_ONCE, packet_id=i + 1)
        for i in range(23)
    ]
    _feed(broker, pub, b"".join(encode(p, version) for p in sent))
    broker.flush_dirty()
    got: list[list[tuple[bytes, int | None]]] = []
    late: list[int] = []
    for _ in range(40):
        new = [p for p in sub.replies() if isinstance(p, Publish)]
        if not new and not late:
            break
        got.append([(p.payload, p.packet_id) for p in new])
        pids = [p.packet_id for p in new if p.packet_id is not None]
        if skip in pids:
            pids.remove(skip)
            late.append(skip)
        elif late and not new:
            pids, late = late, []
        read = b"".join(encode(Puback(packet_id=pid), V5) for pid in pids)
        for chunk in [read[i : i + 1] for i in range(len(read))] if byte_by_byte else [read]:
            _feed(broker, sub, chunk)
            broker.flush_dirty()
    session = broker.session_of[sub.conn]
    return {
        "got": got,
        "inflight": sorted(session.inflight),
        "queued": len(session.queue),
        "out": broker.stats.messages_out,
        "packets_in": broker.stats.packets_in,
    }


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("skip", [0, 3], ids=["in-order", "one-late"])
def test_pubacks_in_a_row_free_the_window_as_one_at_a_time_does(skip, version) -> None:
    world = _acks_world(byte_by_byte=False, skip=skip, version=version)
    assert world == _acks_world(byte_by_byte=True, skip=skip, version=version)
    got = world["got"]
    assert [payload for write in got for payload, _ in write] == [b"%d" % i for i in range(23)]
    assert max(map(len, got)) == 5  # its receive maximum [MQTT-3.3.4-7]
    assert world["inflight"] == []
    assert world["queued"] == 0


def _shared_world(*, byte_by_byte: bool) -> dict[str, Any]:
    """Two members of one shared group and a plain subscriber; a publisher's run of QoS 0,
    then of QoS 1, to their topic."""
    journal = FakeJournal()
    broker = Broker(EdgeSettings(node_id="unit"), journal, wall_clock_us=lambda: 1)
    peers = {
        name: _subscriber(broker, name, V4, Subscription(topic_filter, qos=QoS.AT_LEAST_ONCE))
        for name, topic_filter in (("m1", "$share/g/t"), ("m2", "$share/g/t"), ("plain", "t"))
    }
    pub = connected(broker, "pub", V4)
    pub.replies()
    sent = [Publish(topic="t", payload=b"%d" % i) for i in range(10)] + [
        Publish(topic="t", payload=b"q%d" % i, qos=QoS.AT_LEAST_ONCE, packet_id=i + 1)
        for i in range(10)
    ]
    read = b"".join(encode(p, V4) for p in sent)
    for chunk in [read[i : i + 1] for i in range(len(read))] if byte_by_byte else [read]:
        _feed(broker, pub, chunk)
        broker.flush_dirty()
    journal.make_durable()
    broker.flush_dirty()
    return {name: [p.payload for p in peer.replies()] for name, peer in peers.items()}


def test_a_run_to_a_shared_group_is_shared_out_message_by_message() -> None:
    world = _shared_world(byte_by_byte=False)
    assert world == _shared_world(byte_by_byte=True)
    assert len(world["m1"]) == len(world["m2"]) == 10  # each message to the next member
    assert len(world["plain"]) == 20


def test_a_meshed_edge_forwards_each_message_of_a_run_in_seq_order() -> None:
    sent = [Publish(topic="a/b", payload=b"%d" % i) for i in range(50)] + [
        Publish(topic="a/b", payload=b"q%d" % i, qos=QoS.AT_LEAST_ONCE, packet_id=i + 1)
        for i in range(50)
    ]
    read = b"".join(encode(p, V5) for p in sent)
    world = _world(read, byte_by_byte=False, version=V5, meshed=True)
    assert world_runs[-1] == [49, 49]
    assert world == _world(read, byte_by_byte=True, version=V5, meshed=True)
    device = [(seq, payload) for seq, topic, payload, _ in world["forwarded"] if topic[0] != "$"]
    assert [payload for _, payload in device] == [p.payload for p in sent]
    first = device[0][0]
    assert [seq for seq, _ in device] == list(range(first, first + 100))  # the journal's order
