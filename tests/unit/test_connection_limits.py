"""What one client may cost the edge (issue 10): time per turn, topic levels, subscriptions per
session, and the caches of topic names, bounded by bytes. Sans-IO, with a fake clock."""

from __future__ import annotations

import pytest
from test_connection import FakeJournal, Peer, connected

from broker_edge.broker import Broker
from broker_edge.codec import encode
from broker_edge.connection import VALID_TOPIC_CACHE_CHARS
from broker_edge.errors import ConfigError
from broker_edge.packets import (
    Disconnect,
    ProtocolVersion,
    Publish,
    Suback,
    Subscribe,
    Subscription,
)
from broker_edge.settings import EdgeSettings
from broker_edge.trie import DEFAULT_CACHE_BYTES, TopicTrie

V5 = ProtocolVersion.MQTT_5


def _broker(**settings: object) -> Broker:
    return Broker(
        EdgeSettings(node_id="unit", **settings),  # type: ignore[arg-type]
        FakeJournal(),
        wall_clock_us=lambda: 1,
    )


def test_a_read_that_takes_too_long_is_handled_in_turns() -> None:
    broker = _broker(max_turn_seconds=0.005)
    peer = connected(broker, "slow", V5)
    ticks = iter(range(1000))
    broker.clock = lambda: next(ticks) / 1000  # every packet handled takes 1 ms
    # A topic each: publishes to one topic in a row are one step (a run: test_publish_runs).
    read = b"".join(encode(Publish(topic=f"t{i}", payload=b"%d" % i), V5) for i in range(20))
    assert broker.receive(peer.conn, read, 0.0) is True  # yields after ~5 ms of work
    handled = len(broker.journal.device)  # type: ignore[attr-defined]
    assert 1 <= handled < 20
    while broker.receive(peer.conn, b"", next(ticks) / 1000):
        pass
    assert len(broker.journal.device) == 20  # type: ignore[attr-defined]


@pytest.mark.parametrize("version", [ProtocolVersion.MQTT_3_1_1, V5])
def test_a_filter_of_more_levels_than_allowed_is_refused(version: ProtocolVersion) -> None:
    peer = connected(_broker(max_topic_levels=4), "deep", version)
    peer.replies()
    filters = ("a/b/c/d", "a/b/c/d/e", "$share/g/a/+/c/#", "$share/g/a/+/c/d/#")
    peer.send(Subscribe(1, tuple(Subscription(f) for f in filters)))
    refused = 0x8F if version == V5 else 0x80
    assert peer.replies() == [Suback(1, (0, refused, 0, refused))]


def test_a_publish_to_more_levels_than_allowed_disconnects_with_0x90() -> None:
    peer = connected(_broker(max_topic_levels=4), "deep", V5)
    peer.replies()
    peer.send(Publish(topic="a/b/c/d/e", payload=b"x"))
    (reply,) = peer.replies()
    assert isinstance(reply, Disconnect)
    assert reply.reason_code == 0x90
    assert peer.closed


@pytest.mark.parametrize("version", [ProtocolVersion.MQTT_3_1_1, V5])
def test_subscriptions_per_session_are_capped(version: ProtocolVersion) -> None:
    peer = connected(_broker(max_subscriptions_per_client=2), "many", version)
    peer.replies()
    peer.send(Subscribe(1, (Subscription("a"), Subscription("b"), Subscription("c"))))
    refused = 0x97 if version == V5 else 0x80
    assert peer.replies() == [Suback(1, (0, 0, refused))]
    peer.send(Subscribe(2, (Subscription("a", qos=1),)))  # replacing one is no new one
    assert peer.replies() == [Suback(2, (1,))]


def test_long_distinct_topic_names_do_not_pile_up_in_the_valid_topic_cache() -> None:
    broker = _broker()
    peer = connected(broker, "long", V5)
    for i in range(40):  # 40 x 60 KB: over the cache's character budget
        peer.send(Publish(topic=f"{i}/" + "x" * 60_000, payload=b""))
    assert peer.replies()[1:] == []
    assert broker.topics.chars <= VALID_TOPIC_CACHE_CHARS
    assert sum(map(len, broker.topics.names)) == broker.topics.chars
    cache = broker.namespace("default").subscriptions
    assert cache.cache_bytes <= DEFAULT_CACHE_BYTES


def test_the_match_cache_is_bounded_by_bytes() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    trie.add("#", "c", 0)
    for i in range(3000):
        assert trie.match(f"{i}/" + "y" * 60_000) == [("c", 0)]
    assert trie.cache_bytes <= DEFAULT_CACHE_BYTES
    assert trie.match("short") == [("c", 0)]  # short topics are cached as before
    assert trie.cache_bytes > 0


def _paused_by_its_backlog() -> tuple[Broker, Peer, list[bool]]:
    """A client whose 4 x 30 KB wait for the journal: over its 100,000 bytes, paused."""
    broker = _broker(max_journal_backlog_bytes_per_client=100_000)
    peer = connected(broker, "big", V5)
    paused: list[bool] = []
    peer.io.pause_reading = lambda: paused.append(True)
    peer.io.resume_reading = lambda: paused.append(False)
    read = b"".join(encode(Publish(topic="t", payload=b"x" * 30_000), V5) for _ in range(4))
    broker.receive(peer.conn, read, 0.0)
    assert paused == [True]
    return broker, peer, paused


def test_a_client_is_paused_while_its_records_awaiting_the_journal_hold_too_many_bytes() -> None:
    broker, peer, paused = _paused_by_its_backlog()
    broker.journal.make_durable()  # type: ignore[attr-defined]
    assert paused == [True, False]
    assert peer.conn.journal_bytes == 0


def test_records_a_failed_journal_frame_dropped_no_longer_hold_their_client() -> None:
    # The journal refuses the frame (issue 9: cut back to the last durable frame): the bytes
    # it held are not waiting any more, so the client's reads resume.
    broker, peer, paused = _paused_by_its_backlog()
    broker.journal.fail()  # type: ignore[attr-defined]
    assert paused == [True, False]
    assert peer.conn.journal_bytes == 0


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_topic_levels", 0),
        ("max_subscriptions_per_client", 0),
        ("max_journal_backlog_bytes_per_client", 0),
        ("max_turn_seconds", 0.0),
        ("max_turn_seconds", float("nan")),
    ],
)
def test_bad_limits_are_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^edge\.{key}: "):
        EdgeSettings(**{key: value})  # type: ignore[arg-type]
