"""Retained messages of one namespace: one per topic name, replaced or cleared by new publishes."""

from __future__ import annotations

from collections.abc import Iterator

from broker_edge.message import Message
from broker_edge.topics import matches


class RetainedStore:
    """Retained messages keyed by topic. A subscription's filter is tested against every stored
    topic: linear in the retained topics of one tenant, which Mosquitto also accepts, and only
    on SUBSCRIBE, never per publish."""

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

    def matching(self, topic_filter: str) -> list[Message]:
        """The retained messages whose topic ``topic_filter`` (valid) matches."""
        if "+" not in topic_filter and "#" not in topic_filter:
            message = self._by_topic.get(topic_filter)
            return [] if message is None else [message]
        return [m for topic, m in self._by_topic.items() if matches(topic_filter, topic)]

    def all(self) -> Iterator[Message]:
        return iter(self._by_topic.values())
