"""Retained messages of one namespace: one per topic name, replaced or cleared by new publishes."""

from __future__ import annotations

from collections.abc import Iterator

from broker_edge.message import Message
from broker_edge.trie import TopicTrie


class RetainedStore:
    """Retained messages keyed by topic; lookup by filter goes through a trie of the *topics*.

    A filter is matched against stored topic names by walking a reverse structure: we keep the
    topics in a trie keyed by the topic itself (a topic name is a filter without wildcards), then
    for a subscription filter we test each stored topic's levels. Stores are small per tenant;
    the walk is linear in the number of retained topics, which Mosquitto also accepts.
    """

    def __init__(self) -> None:
        self._by_topic: dict[str, Message] = {}

    def __len__(self) -> int:
        return len(self._by_topic)

    def set(self, message: Message) -> None:
        """Store, replace, or (empty payload) clear the retained message of its topic
        [MQTT-3.3.1-6, MQTT-3.3.1-10]."""
        if message.payload:
            self._by_topic[message.topic] = message
        else:
            self._by_topic.pop(message.topic, None)

    def remove(self, topic: str) -> None:
        self._by_topic.pop(topic, None)

    def matching(self, topic_filter: str) -> Iterator[Message]:
        probe: TopicTrie[int, None] = TopicTrie()
        probe.add(topic_filter, 0, None)
        for topic, message in self._by_topic.items():
            if probe.match(topic):
                yield message

    def all(self) -> Iterator[Message]:
        return iter(self._by_topic.values())
