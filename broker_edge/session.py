"""Session state of one client id: subscriptions, outbound in-flight window and offline queue.

Pure data and bookkeeping; the router drives it. The in-flight window holds QoS 1/2
deliveries awaiting PUBACK (or PUBREC/PUBCOMP); messages beyond the window wait in ``queue``,
which is bounded by ``max_queued``: when full, the oldest QoS 0 message is dropped first, then
the new message is refused (counted in ``dropped``) — never unbounded growth. The same policy
applies to ``max_queued_bytes`` (payload bytes waiting in the queue).

Memory: there is one session per connected client, and most clients of a fleet sit idle with
nothing queued and no QoS 2 exchange open. An empty ``deque`` is 760 bytes and an empty ``set``
216 (CPython 3.11), so the queue and the QoS 2 packet ids are created on first use and read
through :attr:`Session.queue` / :attr:`Session.awaiting_rel` (issue 9: ≤ 3 KiB per idle
connection); so are the MQTT 5 subscription identifiers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from broker_edge.message import Message
from broker_edge.packets import QoS, Subscription
from broker_edge.states import Flow

if TYPE_CHECKING:
    from broker_edge.connection import Connection


NO_CLAIM: tuple[int, str] = (0, "")  # the oldest claim: a session held without one


@dataclass(slots=True)
class Outbound:
    message: Message
    qos: QoS
    retain: bool
    state: Flow  # OUT_AWAIT_*: where the exchange stands (broker_edge.states)
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
    # MQTT 5 subscription identifiers by topic filter [MQTT-3.8.2.1.2], created on first use:
    # read them through subscription_ids, change them with set_subscription_id.
    _subscription_ids: dict[str, int] | None = None
    inflight: dict[int, Outbound] = field(default_factory=dict)
    # Created on first use (see the module's docstring): read them through queue/awaiting_rel.
    _queue: deque[Pending] | None = None
    # Inbound QoS 2 packet ids received and not yet released by PUBREL [MQTT-4.3.3].
    _awaiting_rel: set[int] | None = None
    dropped: int = 0
    # In a mesh (broker_edge.handover): the (µs, node) of the CONNECT this edge holds the
    # session by, and of the clean start that began it; a copy older than that was discarded.
    claim: tuple[int, str] = NO_CLAIM
    since: tuple[int, str] = NO_CLAIM
    connection: Connection | None = None
    disconnected_at: float | None = None
    _next_packet_id: int = 1

    @property
    def subscription_ids(self) -> Mapping[str, int]:
        ids = self._subscription_ids
        return ids if ids is not None else _NO_SUBSCRIPTION_IDS

    def set_subscription_id(self, topic_filter: str, sub_id: int | None) -> None:
        """Set (or with None, remove) the identifier of ``topic_filter``."""
        ids = self._subscription_ids
        if sub_id is not None:
            if ids is None:
                ids = self._subscription_ids = {}
            ids[topic_filter] = sub_id
        elif ids is not None:
            ids.pop(topic_filter, None)
            if not ids:
                self._subscription_ids = None

    def clear_subscription_ids(self) -> None:
        self._subscription_ids = None

    @property
    def queue(self) -> Sequence[Pending]:
        """The deliveries waiting, oldest first (read only: use enqueue/pop/clear_queue)."""
        queue = self._queue
        return queue if queue is not None else ()

    @property
    def awaiting_rel(self) -> AbstractSet[int]:
        """Inbound QoS 2 packet ids received and not yet released (read only)."""
        ids = self._awaiting_rel
        return ids if ids is not None else _NO_IDS

    def hold_rel(self, packet_id: int) -> None:
        """An inbound QoS 2 publish was accepted: its id waits for the client's PUBREL."""
        if self._awaiting_rel is None:
            self._awaiting_rel = set()
        self._awaiting_rel.add(packet_id)

    def release_rel(self, packet_id: int) -> bool:
        """The exchange of ``packet_id`` ended; False if it was not open."""
        ids = self._awaiting_rel
        if ids is None or packet_id not in ids:
            return False
        ids.discard(packet_id)
        if not ids:
            self._awaiting_rel = None
        return True

    def restore(self, queued: Iterable[Pending], awaiting_rel: Iterable[int]) -> None:
        """Put back a snapshot's queue and QoS 2 ids as they were (no bounds applied: they
        were within them when the snapshot was taken)."""
        for pending in queued:
            self._append(pending)
        for pid in awaiting_rel:
            self.hold_rel(pid)

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
        queue = self.queue
        while len(queue) >= self.max_queued or (
            queue and self.queued_bytes + size > self.max_queued_bytes
        ):
            if pending.qos == QoS.AT_MOST_ONCE or not self._drop_oldest_qos0():
                self.dropped += 1
                return False
        self._append(pending)
        return True

    def _append(self, pending: Pending) -> None:
        if self._queue is None:
            self._queue = deque()
        self._queue.append(pending)
        self.queued_bytes += len(pending.message.payload)

    def pop(self) -> Pending:
        """The oldest delivery waiting; the queue must not be empty."""
        queue = self._queue
        assert queue is not None
        pending = queue.popleft()
        self.queued_bytes -= len(pending.message.payload)
        if not queue:
            self._queue = None  # an idle session holds no empty deque
        return pending

    def forget(self, origin: str, seq: int) -> bool:
        """Take the message ``(origin, seq)`` out of the in-flight window or the queue (the
        restore of a crossing message its subscriber finished, broker_edge.receipts)."""
        for pid, out in self.inflight.items():
            if out.message.seq == seq and out.message.origin == origin:
                del self.inflight[pid]
                return True
        queue = self._queue
        for i, pending in enumerate(queue or ()):
            if pending.message.seq == seq and pending.message.origin == origin:
                assert queue is not None
                del queue[i]
                self.queued_bytes -= len(pending.message.payload)
                if not queue:
                    self._queue = None
                return True
        return False

    def clear_queue(self) -> None:
        self._queue = None
        self.queued_bytes = 0

    def _drop_oldest_qos0(self) -> bool:
        queue = self._queue
        if queue is None:
            return False
        for i, queued in enumerate(queue):
            if queued.qos == QoS.AT_MOST_ONCE:
                del queue[i]
                self.queued_bytes -= len(queued.message.payload)
                self.dropped += 1
                return True
        return False


_NO_IDS: frozenset[int] = frozenset()
_NO_SUBSCRIPTION_IDS: Mapping[str, int] = MappingProxyType({})
