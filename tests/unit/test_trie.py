"""TopicTrie: the spec's matching examples, add/remove/replace, pruning and the match cache."""

from __future__ import annotations

import pytest

from broker_edge import topics
from broker_edge.topics import InvalidTopic
from broker_edge.trie import TopicTrie


def matches(topic_filter: str, topic: str) -> bool:
    trie: TopicTrie[str, int] = TopicTrie()
    trie.add(topic_filter, "k", 1)
    return trie.match(topic) == [("k", 1)]


# (filter, topic, matches?) from MQTT 5.0 section 4.7 unless noted.
SPEC_CASES = [
    # 4.7.1.2 multi-level wildcard
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/tennis/player1/#", "sport/tennis", False),
    ("sport/tennis/player1/#", "sport/tennis/player2", False),
    ("sport/#", "sport", True),
    ("#", "sport", True),
    ("#", "sport/tennis/player1", True),
    ("#", "/", True),
    # 4.7.1.3 single-level wildcard
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player2", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+", "finance", True),
    ("sport/+/player1", "sport/tennis/player1", True),
    ("+/tennis/#", "sport/tennis/player1/ranking", True),
    ("+/tennis/#", "sport/tennis", True),
    # 4.7.2 topics beginning with $ [MQTT-4.7.2-1]
    ("#", "$SYS/monitor/Clients", False),
    ("#", "$SYS", False),
    ("+", "$SYS", False),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("+/#", "$SYS/x", False),
    ("$SYS/#", "$SYS/monitor/Clients", True),
    ("$SYS/#", "$SYS/x", True),
    ("$SYS/#", "$SYS", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("$SYS/+", "$SYS/x", True),
    ("a/#", "a/$x", True),  # only the first level is special
    ("+/$x", "a/$x", True),
    # 4.7.3 names are case-sensitive; empty levels are levels
    ("ACCOUNTS", "Accounts", False),
    ("Accounts payable", "Accounts payable", True),
    ("/finance", "finance", False),
    ("finance", "/finance", False),
    ("/", "/", True),
    ("+/+", "/", True),
    ("+", "/", False),
    ("a//b", "a//b", True),
    ("a/+/b", "a//b", True),
    ("a/+/b", "a/b", False),
    ("+/a", "/a", True),
    ("a/+", "a/", True),
    ("a/#", "a/", True),
    ("a/#", "a//", True),
    ("a//#", "a/", True),
    ("a//#", "a", False),
]


@pytest.mark.parametrize(("topic_filter", "topic", "expected"), SPEC_CASES)
def test_spec_examples(topic_filter: str, topic: str, expected: bool) -> None:
    assert matches(topic_filter, topic) is expected
    assert topics.matches(topic_filter, topic) is expected  # the one-filter matcher agrees


def test_match_reports_every_matching_filter_once() -> None:
    trie: TopicTrie[str, str] = TopicTrie()
    for f in ["a/b", "a/+", "a/#", "+/b", "#", "+/+", "a/b/#", "a/c", "b/#"]:
        trie.add(f, "client", f)
    got = sorted(v for _, v in trie.match("a/b"))
    # A key matching through several filters appears once per filter; the router merges.
    assert got == sorted(["a/b", "a/+", "a/#", "+/b", "#", "+/+", "a/b/#"])


def test_several_keys_per_filter() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    assert trie.add("a/+", "c1", 0)
    assert trie.add("a/+", "c2", 1)
    assert trie.add("a/#", "c1", 2)
    assert sorted(trie.match("a/x")) == [("c1", 0), ("c1", 2), ("c2", 1)]
    assert len(trie) == 3


def test_add_replaces_value_for_existing_key() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    assert trie.add("a/b", "c", 0) is True
    assert trie.add("a/b", "c", 2) is False
    assert len(trie) == 1
    assert trie.match("a/b") == [("c", 2)]


def test_remove() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    trie.add("a/b", "c1", 0)
    trie.add("a/b", "c2", 0)
    assert trie.remove("a/b", "c1") is True
    assert trie.remove("a/b", "c1") is False
    assert trie.remove("a/x", "c2") is False
    assert trie.remove("a", "c2") is False  # a prefix of a stored filter, not a filter
    assert trie.remove("a/b/c", "c2") is False
    assert trie.match("a/b") == [("c2", 0)]
    assert len(trie) == 1


def test_add_validates_the_filter() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    for bad in ["", "a/#/b", "a+", "#a"]:
        with pytest.raises(InvalidTopic):
            trie.add(bad, "k", 0)
    assert len(trie) == 0
    assert trie.node_count() == 0


def test_empty_trie_and_no_match() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    assert trie.match("a") == []
    assert trie.match("$SYS/x") == []
    trie.add("b", "k", 0)
    assert trie.match("a") == []
    assert trie.match("b/c") == []


def test_pruning_returns_to_empty() -> None:
    trie: TopicTrie[int, None] = TopicTrie()
    filters = ["a/b/c", "a/b", "a/+/c/#", "#", "+", "/", "//", "$SYS/#", "a/b/c/d/e/f"]
    for i, f in enumerate(filters):
        trie.add(f, i, None)
        trie.add(f, -i - 1, None)
    assert trie.node_count() > 0
    assert len(trie) == 2 * len(filters)
    for i, f in enumerate(filters):
        assert trie.remove(f, i)
        assert trie.remove(f, -i - 1)
    assert len(trie) == 0
    assert trie.node_count() == 0


def test_pruning_keeps_shared_prefixes() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    trie.add("a/b/c/d", "k", 0)
    trie.add("a/b", "k", 0)
    assert trie.node_count() == 4
    trie.remove("a/b/c/d", "k")
    assert trie.node_count() == 2  # 'a' and 'a/b' stay: 'a/b' still has an entry
    assert trie.match("a/b") == [("k", 0)]
    trie.remove("a/b", "k")
    assert trie.node_count() == 0


def test_churn_does_not_grow_nodes() -> None:
    trie: TopicTrie[int, int] = TopicTrie()
    trie.add("keep/this", 0, 0)
    baseline = trie.node_count()
    for i in range(200):
        f = f"dev/{i}/+/telemetry/#"
        trie.add(f, i, i)
        trie.remove(f, i)
    assert trie.node_count() == baseline


def test_cache_is_invalidated_by_add_and_remove() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    assert trie.match("a/b") == []
    trie.add("a/+", "c", 1)
    assert trie.match("a/b") == [("c", 1)]
    assert trie.match("a/b") == [("c", 1)]  # served from the cache
    trie.add("a/+", "c", 2)  # a replaced value is a change too
    assert trie.match("a/b") == [("c", 2)]
    trie.add("#", "d", 3)
    assert sorted(trie.match("a/b")) == [("c", 2), ("d", 3)]
    trie.remove("#", "d")
    assert trie.match("a/b") == [("c", 2)]
    trie.remove("a/+", "c")
    assert trie.match("a/b") == []


def test_cached_result_is_not_shared_with_callers() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    trie.add("a", "c", 1)
    first = trie.match("a")
    first.append(("intruder", 0))
    assert trie.match("a") == [("c", 1)]
    trie.match("a").clear()
    assert trie.match("a") == [("c", 1)]


def test_cache_is_bounded_lru() -> None:
    trie: TopicTrie[str, int] = TopicTrie(cache_size=2)
    trie.add("#", "c", 1)
    trie.match("a")
    trie.match("b")
    trie.match("a")  # 'a' is now most recent
    trie.match("c")  # evicts 'b'
    assert list(trie._cache) == ["a", "c"]
    for i in range(50):
        trie.match(f"t{i}")
    assert len(trie._cache) == 2


def test_cache_can_be_disabled() -> None:
    trie: TopicTrie[str, int] = TopicTrie(cache_size=0)
    trie.add("a/#", "c", 1)
    assert trie.match("a/b") == [("c", 1)]
    assert trie.match("a/b") == [("c", 1)]
    assert len(trie._cache) == 0
    with pytest.raises(ValueError, match="cache_size"):
        TopicTrie(cache_size=-1)
