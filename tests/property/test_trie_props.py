"""The topic trie and the one-filter matcher against a brute-force matcher, and validation
totality properties."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from broker_edge.packets import ReasonCode
from broker_edge.topics import (
    InvalidTopic,
    matches,
    parse_subscription_filter,
    validate_topic_filter,
    validate_topic_name,
)
from broker_edge.trie import TopicTrie


def reference_matches(topic_filter: str, topic: str) -> bool:
    """MQTT 5.0 section 4.7, one level at a time, written without looking at the trie."""
    flevels = topic_filter.split("/")
    tlevels = topic.split("/")
    if tlevels[0].startswith("$") and flevels[0] in ("+", "#"):
        return False  # [MQTT-4.7.2-1]
    for i, flevel in enumerate(flevels):
        if flevel == "#":
            # Matches the parent level and any number of children [MQTT-4.7.1-2].
            return len(tlevels) >= i
        if i >= len(tlevels):
            return False
        if flevel not in ("+", tlevels[i]):
            return False
    return len(flevels) == len(tlevels)


# A small alphabet so filters and topics collide often: empty levels, '$' levels anywhere.
LITERAL_LEVELS = st.sampled_from(["", "a", "b", "$", "$a"])
# A topic of one empty level is the empty string, which is not a topic [MQTT-4.7.3-1].
topics = st.lists(LITERAL_LEVELS, min_size=1, max_size=4).map("/".join).filter(bool)


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.one_of(LITERAL_LEVELS, st.just("+")), min_size=0, max_size=4))
    if levels == [""] or not levels or draw(st.booleans()):
        levels.append("#")
    return "/".join(levels)


keys = st.integers(0, 3)
Op = tuple[bool, str, int, int]  # (is_add, filter, key, value)
ops = st.lists(st.tuples(st.booleans(), filters(), keys, st.integers(0, 9)), max_size=40)


def expected(model: dict[tuple[str, int], int], topic: str) -> Counter[tuple[int, int]]:
    return Counter((k, v) for (f, k), v in model.items() if reference_matches(f, topic))


@given(ops=ops, probes=st.lists(topics, min_size=1, max_size=6))
def test_trie_agrees_with_reference_under_interleaved_add_remove(
    ops: list[Op], probes: list[str]
) -> None:
    trie: TopicTrie[int, int] = TopicTrie(cache_size=4)  # small, so eviction is exercised too
    model: dict[tuple[str, int], int] = {}
    for is_add, f, key, value in ops:
        if is_add:
            assert trie.add(f, key, value) == ((f, key) not in model)
            model[f, key] = value
        else:
            assert trie.remove(f, key) == ((f, key) in model)
            model.pop((f, key), None)
        assert len(trie) == len(model)
        # Matching after every step checks that the cache never serves a stale result.
        for topic in probes:
            assert Counter(trie.match(topic)) == expected(model, topic), (topic, model)
            assert Counter(trie.matches(topic)) == expected(model, topic), (topic, model)
    for f, key in list(model):
        assert trie.remove(f, key)
    assert len(trie) == 0
    assert trie.node_count() == 0


@given(f=st.one_of(filters(), topics), topic=topics)
def test_single_filter_agrees_with_reference(f: str, topic: str) -> None:
    trie: TopicTrie[str, None] = TopicTrie(cache_size=0)
    trie.add(f, "k", None)
    assert bool(trie.match(topic)) is reference_matches(f, topic)
    assert matches(f, topic) is reference_matches(f, topic)  # the one-filter matcher too


@given(topic=topics)
def test_a_topic_name_matches_itself_as_a_filter(topic: str) -> None:
    trie: TopicTrie[str, None] = TopicTrie()
    trie.add(topic, "k", None)
    assert trie.match(topic) == [("k", None)]


# --- validation: total functions onto (value, InvalidTopic) ---

SMALL = st.text(alphabet="ab/+#$\x00", max_size=12)


def reference_filter_ok(s: str) -> bool:
    if not s or "\x00" in s:
        return False
    levels = s.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def reference_name_ok(s: str) -> bool:
    return bool(s) and not set(s) & {"+", "#", "\x00"}


def raised(fn: Callable[[str], object], s: str) -> InvalidTopic | None:
    """The InvalidTopic ``fn(s)`` raises, or None; any other exception fails the test."""
    try:
        fn(s)
    except InvalidTopic as exc:
        return exc
    return None


@given(s=st.one_of(SMALL, st.text(max_size=40)))
def test_validation_is_total_and_agrees_with_reference(s: str) -> None:
    for validate, reference, reason in [
        (validate_topic_name, reference_name_ok, ReasonCode.TOPIC_NAME_INVALID),
        (validate_topic_filter, reference_filter_ok, ReasonCode.TOPIC_FILTER_INVALID),
    ]:
        error = raised(validate, s)
        if error is None:
            assert validate(s) is s
            assert reference(s)
        else:
            assert error.reason_code is reason
            assert not reference(s)


def accepts(validate: Callable[[str], object], s: str) -> bool:
    return raised(validate, s) is None


@given(s=st.one_of(SMALL, st.text(max_size=20)))
def test_every_name_is_a_filter_and_plain_filters_are_names(s: str) -> None:
    name_ok = accepts(validate_topic_name, s)
    filter_ok = accepts(validate_topic_filter, s)
    assert not name_ok or filter_ok
    if filter_ok and "+" not in s and "#" not in s:
        assert name_ok


@given(s=st.one_of(st.text(alphabet="$share/gab+#\x00", max_size=16), st.text(max_size=20)))
def test_subscription_filter_parsing_is_total(s: str) -> None:
    error = raised(parse_subscription_filter, s)
    if error is not None:
        assert error.reason_code is ReasonCode.TOPIC_FILTER_INVALID
    else:
        group, inner = parse_subscription_filter(s)
        assert validate_topic_filter(inner) == inner
        if group is None:
            assert inner == s
        else:
            assert s == f"$share/{group}/{inner}"
            assert group
            assert not set(group) & {"/", "+", "#"}


@given(group=st.text(alphabet="gh$", min_size=1, max_size=3), inner=filters())
def test_shared_filters_round_trip(group: str, inner: str) -> None:
    assert parse_subscription_filter(f"$share/{group}/{inner}") == (group, inner)
