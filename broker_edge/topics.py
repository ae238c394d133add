"""Topic names, topic filters and shared-subscription filters (MQTT 5.0 section 4.7 and 4.8.2).

Two kinds of strings travel through the broker: a *topic name* (what a PUBLISH is sent to; no
wildcards) and a *topic filter* (what a SUBSCRIBE asks for; may contain ``+`` and ``#``). They
are checked once, where they enter, by ``validate_topic_name`` / ``validate_topic_filter``,
which return the same string so the hot path can keep passing plain ``str`` around. The frozen
value objects ``TopicName`` and ``TopicFilter`` wrap the same checks for code that wants the
distinction in its types. ``matches`` tests one filter against one name (the retained store
walks its topics with it); matching a name against many filters at once is ``broker_edge.trie``.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker_edge.errors import ProtocolError
from broker_edge.packets import ReasonCode

MAX_TOPIC_BYTES = 65535  # a UTF-8 Encoded String carries a 2-byte length [MQTT-1.5.4]
SHARE_PREFIX = "$share/"


# Named like MalformedPacket and PacketTooLarge in errors.py: what is wrong, not "...Error".
class InvalidTopic(ProtocolError):
    """A topic name or filter the specification forbids.

    ``reason_code`` is ``TOPIC_NAME_INVALID`` (0x90) for a name and ``TOPIC_FILTER_INVALID``
    (0x8F) for a filter, ready for the DISCONNECT or the SUBACK.
    """

    def __init__(self, message: str, reason_code: ReasonCode) -> None:
        super().__init__(message, reason_code)


def _check_string(s: str, reason: ReasonCode) -> None:
    """Checks shared by names and filters: non-empty, well-formed UTF-8, bounded, no NUL."""
    if not s:
        # [MQTT-4.7.3-1] names and filters are at least one character long.
        raise InvalidTopic("empty topic", reason)
    if "\x00" in s:
        # [MQTT-1.5.4-2] no U+0000 in a UTF-8 Encoded String.
        raise InvalidTopic("topic contains U+0000", reason)
    # The encode both measures the wire size and rejects lone surrogates [MQTT-1.5.4-1].
    try:
        size = len(s.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidTopic("topic is not well-formed UTF-8", reason) from exc
    if size > MAX_TOPIC_BYTES:
        raise InvalidTopic(f"topic is {size} bytes, over {MAX_TOPIC_BYTES}", reason)


def validate_topic_name(s: str) -> str:
    """Return ``s`` if it is a legal topic name, else raise ``InvalidTopic`` (0x90)."""
    _check_string(s, ReasonCode.TOPIC_NAME_INVALID)
    if "+" in s or "#" in s:
        # [MQTT-3.3.2-2] a PUBLISH topic name has no wildcard characters.
        raise InvalidTopic(f"wildcard in topic name {s!r}", ReasonCode.TOPIC_NAME_INVALID)
    return s


def validate_topic_filter(s: str) -> str:
    """Return ``s`` if it is a legal topic filter, else raise ``InvalidTopic`` (0x8F)."""
    reason = ReasonCode.TOPIC_FILTER_INVALID
    _check_string(s, reason)
    if "+" not in s and "#" not in s:
        return s  # the common case: no wildcard, nothing to split
    levels = s.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if level == "+":
            continue
        if level == "#":
            if i != last:
                # [MQTT-4.7.1-2] '#' is the last character of the filter.
                raise InvalidTopic(f"'#' not last in topic filter {s!r}", reason)
            continue
        if "#" in level:
            # [MQTT-4.7.1-2] '#' occupies a whole level on its own.
            raise InvalidTopic(f"'#' shares a level in topic filter {s!r}", reason)
        if "+" in level:
            # [MQTT-4.7.1-3] '+' occupies a whole level on its own.
            raise InvalidTopic(f"'+' shares a level in topic filter {s!r}", reason)
    return s


def matches(topic_filter: str, topic: str) -> bool:
    """Whether a valid ``topic_filter`` matches a valid topic name (MQTT 5.0 section 4.7)."""
    if topic_filter == topic:
        return True  # the common case: no wildcards (a topic name has none)
    if "+" not in topic_filter and "#" not in topic_filter:
        return False
    if topic[:1] == "$" and topic_filter[:1] in ("+", "#"):
        return False  # wildcards never match a first level starting with '$' [MQTT-4.7.2-1]
    flevels = topic_filter.split("/")
    tlevels = topic.split("/")
    for i, flevel in enumerate(flevels):
        if flevel == "#":
            # The parent level and any number of child levels [MQTT-4.7.1-2].
            return True
        if i >= len(tlevels) or (flevel != "+" and flevel != tlevels[i]):
            return False  # '+' matches exactly one level, an empty one too [MQTT-4.7.1-3]
    return len(flevels) == len(tlevels)


def _levels(s: str) -> tuple[str, ...]:
    return tuple(s.split("/"))


@dataclass(frozen=True, slots=True)
class TopicName:
    """A validated topic name (no wildcards). ``levels`` keeps empty levels: ``/a`` is ('', 'a')."""

    value: str

    def __post_init__(self) -> None:
        validate_topic_name(self.value)

    def __str__(self) -> str:
        return self.value

    @property
    def levels(self) -> tuple[str, ...]:
        # Computed on demand so building the object stays a single validation.
        return _levels(self.value)


@dataclass(frozen=True, slots=True)
class TopicFilter:
    """A validated topic filter; may contain ``+`` and a trailing ``#``."""

    value: str

    def __post_init__(self) -> None:
        validate_topic_filter(self.value)

    def __str__(self) -> str:
        return self.value

    @property
    def levels(self) -> tuple[str, ...]:
        return _levels(self.value)

    @property
    def is_wildcard(self) -> bool:
        return "+" in self.value or "#" in self.value


def _is_shared(s: str) -> bool:
    # The first level "$share" is reserved for shared subscriptions, so a bare "$share" is a
    # malformed shared filter rather than an ordinary one.
    return s == "$share" or s.startswith(SHARE_PREFIX)


@dataclass(frozen=True, slots=True)
class SharedFilter:
    """``$share/{group}/{topic_filter}``: a shared subscription (MQTT 5.0 section 4.8.2)."""

    group: str
    topic_filter: str

    def __post_init__(self) -> None:
        reason = ReasonCode.TOPIC_FILTER_INVALID
        _check_string(self.value, reason)  # NUL, UTF-8 and length, over the whole filter
        if not self.group:
            # [MQTT-4.8.2-1] the ShareName is at least one character long.
            raise InvalidTopic("empty share name", reason)
        if "/" in self.group or "+" in self.group or "#" in self.group:
            # [MQTT-4.8.2-2] the ShareName contains no '/', '+' or '#'.
            raise InvalidTopic(f"share name {self.group!r} contains '/', '+' or '#'", reason)
        validate_topic_filter(self.topic_filter)

    def __str__(self) -> str:
        return self.value

    @property
    def value(self) -> str:
        """The filter as it appears in SUBSCRIBE."""
        return f"{SHARE_PREFIX}{self.group}/{self.topic_filter}"

    @classmethod
    def parse(cls, s: str) -> SharedFilter:
        """Split ``$share/{group}/{filter}``; ``InvalidTopic`` if ``s`` is not a legal one."""
        reason = ReasonCode.TOPIC_FILTER_INVALID
        if not _is_shared(s):
            raise InvalidTopic(f"{s!r} is not a shared subscription filter", reason)
        group, sep, inner = s[len(SHARE_PREFIX) :].partition("/")
        if not sep:
            # [MQTT-4.8.2-2] the ShareName is followed by '/' and then a Topic Filter.
            raise InvalidTopic(f"{s!r} is not $share/{{ShareName}}/{{filter}}", reason)
        return cls(group, inner)


def parse_subscription_filter(s: str) -> tuple[str | None, str]:
    """Return ``(group, filter)`` for a SUBSCRIBE filter; ``group`` is None unless shared.

    The second element is what goes into the topic trie. Raises ``InvalidTopic`` (0x8F).
    """
    if _is_shared(s):
        shared = SharedFilter.parse(s)
        return shared.group, shared.topic_filter
    return None, validate_topic_filter(s)
