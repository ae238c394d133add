"""Session state of one client id: subscriptions, outbound in-flight window and offline queue.

Pure data and bookkeeping; the connection drives it. The in-flight window holds QoS 1/2
deliveries awaiting PUBACK (or PUBREC/PUBCOMP); messages beyond the window wait in ``queue``,
which is bounded by ``max_queued``: when full, the oldest QoS 0 message is dropped first, then
the new message is refused (counted in ``dropped``) — never unbounded growth. The same policy
applies to ``max_queued_bytes`` (payload bytes waiting in the queue).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from broker_edge.message import Message
from broker_edge.packets import QoS, Subscription

if TYPE_CHECKING:
    from broker_edge.connection import Connection


class OutState(Enum):
    AWAIT_PUBACK = 1
    AWAIT_PUBREC = 2
    AWAIT_PUBCOMP = 3


@dataclass(slots=True)
class Outbound:
    message: Message
    qos: QoS
    retain: bool
    state: OutState
    subscription_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class Pending:
    """A delivery waiting in the queue for room in the in-flight window or for the client."""

    message: Message
    qos: QoS
    retain: bool
    subscription_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class Session:
    client_id: str
    tenant: str
    clean: bool
    max_queued: int
    max_inflight: int
    max_queued_bytes: int = 4 * 2**20
    queued_bytes: int = 0
    expiry_interval: int = 0  # seconds after disconnect; 0xFFFFFFFF = never (MQTT 5)
    subscriptions: dict[str, Subscription] = field(default_factory=dict)
    # MQTT 5 subscription identifiers by topic filter [MQTT-3.8.2.1.2].
    subscription_ids: dict[str, int] = field(default_factory=dict)
    inflight: dict[int, Outbound] = field(default_factory=dict)
    queue: deque[Pending] = field(default_factory=deque)
    # Inbound QoS 2 packet ids received and not yet released by PUBREL [MQTT-4.3.3].
    awaiting_rel: set[int] = field(default_factory=set)
    dropped: int = 0
    connection: Connection | None = None
    disconnected_at: float | None = None
    _next_packet_id: int = 1

    def next_packet_id(self) -> int | None:
        """A packet id not in use by an in-flight delivery [MQTT-2.3.1-2], or None if all are."""
        if len(self.inflight) >= 65_535:
            return None
        pid = self._next_packet_id
        while pid in self.inflight:
            pid = pid % 65_535 + 1
        self._next_packet_id = pid % 65_535 + 1
        return pid

    def window_open(self) -> bool:
        return len(self.inflight) < self.max_inflight

    def enqueue(self, pending: Pending) -> bool:
        """Queue a delivery; False when it had to be dropped because the queue is full."""
        size = len(pending.message.payload)
        while len(self.queue) >= self.max_queued or (
            self.queue and self.queued_bytes + size > self.max_queued_bytes
        ):
            if pending.qos == QoS.AT_MOST_ONCE or not self._drop_oldest_qos0():
                self.dropped += 1
                return False
        self.queue.append(pending)
        self.queued_bytes += size
        return True

    def pop(self) -> Pending:
        pending = self.queue.popleft()
        self.queued_bytes -= len(pending.message.payload)
        return pending

    def clear_queue(self) -> None:
        self.queue.clear()
        self.queued_bytes = 0

    def _drop_oldest_qos0(self) -> bool:
        for i, queued in enumerate(self.queue):
            if queued.qos == QoS.AT_MOST_ONCE:
                del self.queue[i]
                self.queued_bytes -= len(queued.message.payload)
                self.dropped += 1
                return True
        return False
