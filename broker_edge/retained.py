"""Retained messages of one namespace: one per topic name, replaced or cleared by new publishes.

Which publish is the newest of a topic is decided by its *version* ``(ts_us, origin, seq)``: the
time its origin node accepted it, that node's id (ties between nodes), its journal seq there
(ties within one node's microsecond). The same rule on every edge of a mesh makes the edges
agree whatever order the publishes reach them in (see :mod:`broker_edge.mesh`). A clear (an
empty retained payload) is kept as a *tombstone* with its version, so a set older than the
clear, arriving after it (over a link that was down), does not bring the message back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from broker_edge.message import Message
from broker_edge.topics import matches

# Tombstones kept per namespace at most (the oldest cleared are forgotten beyond: a set older
# than a forgotten clear, from a peer away that long, would come back).
MAX_CLEARED = 10_000


def newer(message: Message, held: Message) -> bool:
    """Whether ``message`` replaces ``held`` on the same topic. An equal version is the same
    journaled publish again (a peer's copy: kept as first stored, with all its properties),
    except for an unjournaled one (seq 0: ``$SYS`` values, journal notices), which replaces."""
    if message.origin == held.origin and message.seq and held.seq:
        # One node's own publishes: its journal's order, whatever its clock did between them
        # (a clock stepped back must not keep an edge's retained message from being replaced).
        return message.seq > held.seq
    new = (message.ts_us, message.origin, message.seq)
    old = (held.ts_us, held.origin, held.seq)
    return new > old or (new == old and not message.seq)


class RetainedStore:
    """Retained messages keyed by topic. A subscription's filter is tested against every stored
    topic: linear in the retained topics of one tenant, which Mosquitto also accepts, and only
    on SUBSCRIBE, never per publish."""

    def __init__(self) -> None:
        self._by_topic: dict[str, Message] = {}
        self._cleared: OrderedDict[str, Message] = OrderedDict()  # tombstones, oldest first

    def __len__(self) -> int:
        return len(self._by_topic)

    def set(self, message: Message) -> bool:
        """Store, replace, or (empty payload) clear the retained message of its topic
        [MQTT-3.3.1-6, MQTT-3.3.1-10], unless what is held for it is newer; True if taken."""
        topic = message.topic
        held = self._by_topic.get(topic)
        if held is None:
            held = self._cleared.get(topic)
        if held is not None and not newer(message, held):
            return False
        if message.payload:
            self._by_topic[topic] = message
            if self._cleared:
                self._cleared.pop(topic, None)
            return True
        self._by_topic.pop(topic, None)
        cleared = self._cleared
        cleared[topic] = message
        cleared.move_to_end(topic)
        if len(cleared) > MAX_CLEARED:
            cleared.popitem(last=False)
        return True

    def remove(self, topic: str) -> None:
        self._by_topic.pop(topic, None)

    def matching(self, topic_filter: str) -> list[Message]:
        """The retained messages whose topic ``topic_filter`` (valid) matches."""
        if "+" not in topic_filter and "#" not in topic_filter:
            message = self._by_topic.get(topic_filter)
            return [] if message is None else [message]
        return [m for topic, m in self._by_topic.items() if matches(topic_filter, topic)]

    def all(self) -> Iterator[Message]:
        return iter(self._by_topic.values())

    def state(self) -> Iterator[Message]:
        """Every retained message and every tombstone (an empty payload): what snapshots keep
        and what a mesh link that comes up sends."""
        yield from self._by_topic.values()
        yield from self._cleared.values()
