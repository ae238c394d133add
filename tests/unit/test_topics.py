"""Topic name, topic filter and shared-filter validation (MQTT 5.0 sections 4.7, 4.8.2)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from broker_edge.errors import EdgeError, ProtocolError
from broker_edge.packets import ReasonCode
from broker_edge.topics import (
    MAX_TOPIC_BYTES,
    InvalidTopic,
    SharedFilter,
    TopicFilter,
    TopicName,
    parse_subscription_filter,
    validate_topic_filter,
    validate_topic_name,
)

# Examples from section 4.7.1 / 4.7.3 of the specification.
VALID_FILTERS = [
    "#",
    "sport/tennis/#",
    "sport/tennis/player1/#",
    "sport/#",
    "+",
    "+/tennis/#",
    "sport/+/player1",
    "+/+",
    "/+",
    "/",
    "//",
    "/finance",
    "Accounts payable",
    "$SYS/#",
    "$SYS/monitor/+",
    "a/+/+/#",
    "ünïcødé/+",
]
INVALID_FILTERS = [
    "",
    "sport/tennis#",  # [MQTT-4.7.1-2]
    "sport/tennis/#/ranking",  # [MQTT-4.7.1-2]
    "#/a",
    "##",
    "sport+",  # [MQTT-4.7.1-3]
    "+sport",
    "a/++/b",
    "a/b+/c",
    "a\x00b",
]
VALID_NAMES = [
    "sport/tennis/player1",
    "sport",
    "sport/",
    "/",
    "//",
    "/finance",
    "$SYS/monitor/Clients",
    "Accounts payable",
    " ",
    "ünïcødé",
]
INVALID_NAMES = ["", "sport/+", "sport/#", "+", "#", "a+b", "a#b", "a\x00b"]


def test_invalid_topic_is_a_protocol_error() -> None:
    exc = InvalidTopic("x", ReasonCode.TOPIC_NAME_INVALID)
    assert isinstance(exc, ProtocolError)
    assert isinstance(exc, EdgeError)
    assert exc.reason_code is ReasonCode.TOPIC_NAME_INVALID


@pytest.mark.parametrize("s", VALID_FILTERS)
def test_valid_filters(s: str) -> None:
    assert validate_topic_filter(s) is s
    assert TopicFilter(s).value == s


@pytest.mark.parametrize("s", INVALID_FILTERS)
def test_invalid_filters(s: str) -> None:
    with pytest.raises(InvalidTopic) as info:
        validate_topic_filter(s)
    assert info.value.reason_code is ReasonCode.TOPIC_FILTER_INVALID
    with pytest.raises(InvalidTopic):
        TopicFilter(s)


@pytest.mark.parametrize("s", VALID_NAMES)
def test_valid_names(s: str) -> None:
    assert validate_topic_name(s) is s
    assert TopicName(s).value == s


@pytest.mark.parametrize("s", INVALID_NAMES)
def test_invalid_names(s: str) -> None:
    with pytest.raises(InvalidTopic) as info:
        validate_topic_name(s)
    assert info.value.reason_code is ReasonCode.TOPIC_NAME_INVALID
    with pytest.raises(InvalidTopic):
        TopicName(s)


@pytest.mark.parametrize(
    ("validate", "reason"),
    [
        (validate_topic_name, ReasonCode.TOPIC_NAME_INVALID),
        (validate_topic_filter, ReasonCode.TOPIC_FILTER_INVALID),
    ],
)
def test_length_limit_is_in_utf8_bytes(validate: Callable[[str], str], reason: ReasonCode) -> None:
    assert validate("a" * MAX_TOPIC_BYTES) == "a" * MAX_TOPIC_BYTES
    with pytest.raises(InvalidTopic) as info:
        validate("a" * (MAX_TOPIC_BYTES + 1))
    assert info.value.reason_code is reason
    # 2 bytes per 'é': 32768 characters are 65536 bytes.
    with pytest.raises(InvalidTopic):
        validate("é" * 32768)
    assert validate("é" * 32767)


def test_lone_surrogate_is_rejected_with_cause() -> None:
    with pytest.raises(InvalidTopic) as info:
        validate_topic_name("a\ud800")
    assert isinstance(info.value.__cause__, UnicodeEncodeError)


def test_value_objects_are_frozen_and_expose_levels() -> None:
    name = TopicName("/a//b")
    assert name.levels == ("", "a", "", "b")
    assert str(name) == "/a//b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        name.value = "x"  # type: ignore[misc]
    assert TopicName("a") == TopicName("a")
    assert hash(TopicName("a")) == hash(TopicName("a"))
    assert TopicName("ACCOUNTS") != TopicName("Accounts")  # [MQTT-4.7.3] case-sensitive

    filt = TopicFilter("sport/+/#")
    assert filt.levels == ("sport", "+", "#")
    assert filt.is_wildcard
    assert not TopicFilter("sport/tennis").is_wildcard
    assert TopicFilter("+").is_wildcard


def test_names_and_filters_are_different_types() -> None:
    name: object = TopicName("a")
    assert name != TopicFilter("a")


# --- shared subscriptions [MQTT-4.8.2] ---


@pytest.mark.parametrize(
    ("s", "group", "inner"),
    [
        ("$share/g/sport/#", "g", "sport/#"),
        ("$share/consumer1/sport/tennis/+", "consumer1", "sport/tennis/+"),
        ("$share/g/#", "g", "#"),
        ("$share/g/$SYS/#", "g", "$SYS/#"),
        ("$share/g//", "g", "/"),
        ("$share/$g/a", "$g", "a"),
    ],
)
def test_shared_filters(s: str, group: str, inner: str) -> None:
    shared = SharedFilter.parse(s)
    assert (shared.group, shared.topic_filter) == (group, inner)
    assert shared.value == s
    assert str(shared) == s
    assert parse_subscription_filter(s) == (group, inner)


@pytest.mark.parametrize(
    "s",
    [
        "$share",
        "$share/",
        "$share/g",  # [MQTT-4.8.2-2] the ShareName is followed by '/' and a filter
        "$share/g/",
        "$share//a",  # [MQTT-4.8.2-1] ShareName at least one character
        "$share/+/a",  # [MQTT-4.8.2-2] no '+' or '#' in the ShareName
        "$share/#/a",
        "$share/g+/a",
        "$share/g#/a",
        "$share/g/a/#/b",
        "$share/g/a+",
        "$share/g\x00/a",
    ],
)
def test_invalid_shared_filters(s: str) -> None:
    with pytest.raises(InvalidTopic) as info:
        parse_subscription_filter(s)
    assert info.value.reason_code is ReasonCode.TOPIC_FILTER_INVALID
    with pytest.raises(InvalidTopic):
        SharedFilter.parse(s)


def test_shared_filter_constructor_validates() -> None:
    with pytest.raises(InvalidTopic):
        SharedFilter("a/b", "x")
    with pytest.raises(InvalidTopic):
        SharedFilter("g", "a/#/b")
    with pytest.raises(InvalidTopic):
        SharedFilter("g", "a" * MAX_TOPIC_BYTES)  # the whole filter is over the limit
    assert SharedFilter("g", "x").value == "$share/g/x"


def test_parse_rejects_non_shared() -> None:
    with pytest.raises(InvalidTopic):
        SharedFilter.parse("sport/#")


@pytest.mark.parametrize("s", ["sport/#", "$sharex/g/a", "a/$share/g/b", "+", "$SYS/#"])
def test_non_shared_subscription_filters(s: str) -> None:
    assert parse_subscription_filter(s) == (None, s)


def test_non_shared_subscription_filter_is_validated() -> None:
    with pytest.raises(InvalidTopic):
        parse_subscription_filter("a/#/b")
