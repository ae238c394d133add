"""Sessions and routing: who is subscribed to what, and who gets each message.

Theory of operation
-------------------
The router owns the sessions, each tenant's :class:`Namespace` (topic trie, retained store,
shared groups) and the outbound QoS 1/2 windows kept in the sessions. It takes events (a
message published, a subscribe, an unsubscribe, a session opened or closed, a delivery
acknowledged) and returns what follows from them as values: :data:`Delivery` tuples saying which
session gets which message at which QoS. It never writes into a connection: the broker turns
deliveries into bytes through each client's :class:`~broker_edge.connection.Connection`.

Tenants are isolated by construction: nothing here looks a topic up outside the publisher's
namespace. Overlapping subscriptions of one client give one delivery at the highest QoS
[MQTT-3.3.5-1] with every matching subscription identifier [MQTT-3.3.4-3]; a shared group gives
each message to one member [MQTT-4.8.2].
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from broker_edge.message import Message
from broker_edge.packets import QoS, RetainHandling, Subscription
from broker_edge.retained import RetainedStore
from broker_edge.session import Session
from broker_edge.states import FLOW_STEPS, FlowEvent
from broker_edge.topics import SHARE_PREFIX, parse_subscription_filter
from broker_edge.trie import TopicTrie

if TYPE_CHECKING:
    from broker_edge.connection import Connection
    from broker_edge.mesh import Interest
    from broker_edge.meshgroups import Share

# One delivery: (session, message, qos, retain, subscription identifiers).
Delivery = tuple[Session, Message, QoS, bool, tuple[int, ...]]

SESSION_NEVER_EXPIRES = 0xFFFFFFFF


@dataclass(slots=True)
class SharedGroup:
    """A shared subscription ``$share/{group}/{filter}``: each message goes to one member,
    round-robin, preferring members that are connected and can take it [MQTT-4.8.2]."""

    members: dict[str, Subscription] = field(default_factory=dict)
    cursor: int = 0
    share: tuple[str, str] = ("", "")  # (group, filter): which one it is (broker_edge.meshgroups)
    online: int = 0  # members connected here (kept while the edge is in a mesh)

    def pick(self, sessions: dict[tuple[str, str], Session], tenant: str) -> str | None:
        ids = list(self.members)
        n = len(ids)
        for i in range(n):
            client_id = ids[(self.cursor + i) % n]
            session = sessions.get((tenant, client_id))
            if session is not None and session.connection is not None and session.window_open():
                self.cursor = (self.cursor + i + 1) % n
                return client_id
        if not n:
            return None
        client_id = ids[self.cursor % n]  # nobody can take it now: queue it for the next one
        self.cursor = (self.cursor + 1) % n
        return client_id


# Trie entries: a client's own subscription (key: client id) or a shared group
# (key: ("$share", group)).
TrieKey = str | tuple[str, str]
TrieValue = Subscription | SharedGroup


@dataclass(slots=True)
class Namespace:
    """One tenant's routing world."""

    subscriptions: TopicTrie[TrieKey, TrieValue] = field(default_factory=TopicTrie)
    retained: RetainedStore = field(default_factory=RetainedStore)
    shared: dict[tuple[str, str], SharedGroup] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SessionBounds:
    """What each new session may hold (from the edge's settings)."""

    max_queued: int
    max_inflight: int
    max_queued_bytes: int


class Router:
    def __init__(self, bounds: SessionBounds) -> None:
        self.bounds = bounds
        self.namespaces: dict[str, Namespace] = {}
        self.sessions: dict[tuple[str, str], Session] = {}
        # Sessions per tenant, persistent offline ones included (the tenant's sessions limit).
        self.session_counts: dict[str, int] = {}
        # Told of every filter entering or leaving a trie when the edge is in a mesh (what
        # the peers are told this node wants: see broker_edge.mesh).
        self.interest: Interest | None = None

    def namespace(self, tenant: str) -> Namespace:
        ns = self.namespaces.get(tenant)
        if ns is None:
            ns = self.namespaces[tenant] = Namespace()
        return ns

    # -- sessions ------------------------------------------------------------------------------

    def new_session(self, tenant: str, client_id: str, clean: bool, now: float | None) -> Session:
        """Create and register a session (``now``: offline since, for a restored one)."""
        bounds = self.bounds
        session = Session(
            client_id=client_id,
            tenant=tenant,
            clean=clean,
            max_queued=bounds.max_queued,
            max_inflight=bounds.max_inflight,
            max_queued_bytes=bounds.max_queued_bytes,
            disconnected_at=now,
        )
        self.add_session(session)
        return session

    def add_session(self, session: Session) -> None:
        """Register a session (a restored one gets today's byte bound: not in snapshots)."""
        session.max_queued_bytes = self.bounds.max_queued_bytes
        key = (session.tenant, session.client_id)
        self.sessions[key] = session
        counts = self.session_counts
        counts[session.tenant] = counts.get(session.tenant, 0) + 1

    def attach(
        self, session: Session, connection: Connection, expiry: int, receive_maximum: int
    ) -> None:
        """A client (re)connected to ``session`` with this expiry; never more unacknowledged
        deliveries than its receive maximum [MQTT-3.3.4-7]."""
        session.max_inflight = min(self.bounds.max_inflight, receive_maximum)
        self.set_expiry(session, expiry)
        session.connection = connection
        session.disconnected_at = None
        self._shares_changed(session)

    def detach(self, session: Session, connection: Connection, now: float) -> bool:
        """``connection`` left ``session``; True when the session ends with it (expiry 0)."""
        if session.connection is not connection:
            return False  # taken over already
        session.connection = None
        session.disconnected_at = now
        self._shares_changed(session)
        return session.expiry_interval == 0

    @staticmethod
    def set_expiry(session: Session, expiry: int) -> bool:
        """Set the session expiry interval (0: ends with the connection); True when the
        session was persistent before."""
        was_persistent = not session.clean
        session.expiry_interval = expiry
        session.clean = expiry == 0
        return was_persistent

    def drop_session(self, session: Session) -> None:
        """Forget a session: its subscriptions, window and queue."""
        ns = self.namespace(session.tenant)
        for topic_filter in session.subscriptions:
            self._remove_subscription(session.tenant, ns, session.client_id, topic_filter)
        session.subscriptions.clear()
        session.clear_subscription_ids()
        session.inflight.clear()
        session.clear_queue()
        key = (session.tenant, session.client_id)
        if self.sessions.get(key) is session:
            del self.sessions[key]
            self.session_counts[session.tenant] -= 1

    def expired_sessions(self, now: float) -> list[Session]:
        """Disconnected sessions whose expiry interval has passed (MQTT 5) [MQTT-3.1.2-23]."""
        return [
            s
            for s in self.sessions.values()
            if s.disconnected_at is not None
            and s.expiry_interval != SESSION_NEVER_EXPIRES
            and now - s.disconnected_at >= s.expiry_interval
        ]

    # -- subscriptions -------------------------------------------------------------------------

    def subscribe(
        self,
        session: Session,
        subscriptions: Iterable[tuple[str | None, str, Subscription]],
        subscription_id: int | None,
        now_us: int,
    ) -> list[Delivery]:
        """Add (group, filter, options) subscriptions (group set for ``$share/...``); returns
        the retained messages they bring."""
        ns = self.namespace(session.tenant)
        deliveries: list[Delivery] = []
        for group, topic_filter, sub in subscriptions:
            full = sub.topic_filter
            is_new = full not in session.subscriptions
            session.subscriptions[full] = sub
            session.set_subscription_id(full, subscription_id)
            if group is not None:
                self._join_group(session.tenant, ns, group, topic_filter, session.client_id, sub)
                continue  # no retained messages for a shared subscription [MQTT-4.8.2]
            self._add_entry(session.tenant, ns, topic_filter, session.client_id, sub)
            if sub.retain_handling == RetainHandling.DO_NOT_SEND or (
                sub.retain_handling == RetainHandling.SEND_IF_NEW_SUBSCRIPTION and not is_new
            ):
                continue
            sub_ids = (subscription_id,) if subscription_id is not None else ()
            for message in ns.retained.matching(topic_filter):
                expiry = message.properties.message_expiry_interval
                if expiry is not None and now_us - message.ts_us >= expiry * 1_000_000:
                    ns.retained.remove(message.topic)  # expired retained message [MQTT-3.3.2-5]
                    continue
                # Retained messages go out with RETAIN 1 [MQTT-3.3.1-8].
                qos = message.qos if message.qos < sub.qos else sub.qos
                deliveries.append((session, message, qos, True, sub_ids))
        return deliveries

    def install(self, session: Session, full: str, sub: Subscription) -> None:
        """Put a restored subscription into its namespace's trie (no retained messages)."""
        ns = self.namespace(session.tenant)
        group, topic_filter = parse_subscription_filter(full)
        if group is None:
            self._add_entry(session.tenant, ns, topic_filter, session.client_id, sub)
        else:
            self._join_group(session.tenant, ns, group, topic_filter, session.client_id, sub)

    def _join_group(
        self,
        tenant: str,
        ns: Namespace,
        group: str,
        topic_filter: str,
        client_id: str,
        sub: Subscription,
    ) -> None:
        shared = ns.shared.get((group, topic_filter))
        if shared is None:
            shared = ns.shared[(group, topic_filter)] = SharedGroup(share=(group, topic_filter))
            # Not a filter the peers are told: a share (broker_edge.meshgroups).
            ns.subscriptions.add(topic_filter, ("$share", group), shared)
        shared.members[client_id] = sub
        self._share_changed(tenant, shared)

    def _add_entry(
        self, tenant: str, ns: Namespace, topic_filter: str, key: TrieKey, value: TrieValue
    ) -> None:
        if ns.subscriptions.add(topic_filter, key, value) and self.interest is not None:
            self.interest.add(tenant, topic_filter)

    def _remove_entry(self, tenant: str, ns: Namespace, topic_filter: str, key: TrieKey) -> None:
        if ns.subscriptions.remove(topic_filter, key) and self.interest is not None:
            self.interest.remove(tenant, topic_filter)

    def unsubscribe(self, session: Session, topic_filters: Iterable[str]) -> list[bool]:
        """Remove subscriptions; for each filter, whether it existed."""
        ns = self.namespace(session.tenant)
        found = []
        for topic_filter in topic_filters:
            had = session.subscriptions.pop(topic_filter, None) is not None
            session.set_subscription_id(topic_filter, None)
            if had:
                self._remove_subscription(session.tenant, ns, session.client_id, topic_filter)
            found.append(had)
        return found

    def _remove_subscription(
        self, tenant: str, ns: Namespace, client_id: str, full_filter: str
    ) -> None:
        group, topic_filter = parse_subscription_filter(full_filter)
        if group is None:
            self._remove_entry(tenant, ns, topic_filter, client_id)
            return
        shared = ns.shared.get((group, topic_filter))
        if shared is not None:
            shared.members.pop(client_id, None)
            if not shared.members:
                del ns.shared[(group, topic_filter)]
                ns.subscriptions.remove(topic_filter, ("$share", group))
            self._share_changed(tenant, shared)

    # -- shares: what the mesh is told of this node's shared groups (broker_edge.meshgroups) --

    def _online(self, tenant: str, shared: SharedGroup) -> int:
        """How many of the group's members are connected here."""
        sessions = self.sessions
        count = 0
        for client_id in shared.members:
            session = sessions.get((tenant, client_id))
            if session is not None and session.connection is not None:
                count += 1
        return count

    def _share_changed(self, tenant: str, shared: SharedGroup) -> None:
        interest = self.interest
        if interest is not None:
            shared.online = self._online(tenant, shared)
            interest.share(tenant, *shared.share, shared.online if shared.members else None)

    def _shares_changed(self, session: Session) -> None:
        """``session`` connected or disconnected: its groups' connected members changed."""
        if self.interest is None:
            return
        ns = self.namespace(session.tenant)
        for full in session.subscriptions:
            if full.startswith(SHARE_PREFIX):
                group, topic_filter = parse_subscription_filter(full)
                shared = ns.shared.get((group or "", topic_filter))
                if shared is not None:
                    self._share_changed(session.tenant, shared)

    def shares(self, tenant: str, topic: str) -> dict[Share, int]:
        """This node's shares matching ``topic``, with their connected members."""
        ns = self.namespaces.get(tenant)
        if ns is None or not ns.shared:
            return {}
        return {
            value.share: value.online
            for _, value in ns.subscriptions.match(topic)
            if type(value) is SharedGroup
        }

    # -- messages ------------------------------------------------------------------------------

    def route(  # positional or by name: the broker routes positionally, once per publish
        self,
        message: Message,
        publisher: str | None,
        retain: bool = True,
        shares: Container[Share] | None = None,
    ) -> list[Delivery] | None:
        """Retain ``message`` if it asks to be (and ``retain``: the caller did not already,
        :meth:`retain`), and say who gets it (None: nobody). ``publisher``: the client id that
        published it (for No Local), None for the edge. ``shares``: the shared groups that get
        it here (the mesh decided: broker_edge.meshgroups); None: every matching one."""
        tenant = message.tenant
        ns = self.namespaces.get(tenant)
        if ns is None:
            ns = self.namespace(tenant)
        if message.retain and retain:
            ns.retained.set(message)
        matches = ns.subscriptions.matches(message.topic)
        if not matches:
            return None
        sessions = self.sessions
        if len(matches) == 1 and type(matches[0][1]) is Subscription:
            # The common case: one plain subscription, no overlap to resolve.
            client_id, sub = matches[0]
            session = sessions.get((tenant, client_id))  # type: ignore[arg-type]
            if session is None:
                return None
            return self._to_session(session, message, sub, publisher, ())  # type: ignore[arg-type]
        # Overlapping subscriptions of one client: one delivery at the highest QoS
        # [MQTT-3.3.5-1], carrying every matching subscription identifier [MQTT-3.3.4-3].
        # Each shared group picks one member [MQTT-4.8.2].
        best: dict[str, Subscription] = {}
        ids: dict[str, list[int]] = {}
        for key, value in matches:
            if type(value) is SharedGroup:
                if shares is not None and value.share not in shares:
                    continue  # another edge's member has it
                picked = value.pick(sessions, tenant)
                if picked is None:
                    continue
                client_id = picked
                sub = value.members[picked]
            else:
                assert isinstance(key, str)
                assert isinstance(value, Subscription)
                client_id, sub = key, value
            have = best.get(client_id)
            if have is None or sub.qos > have.qos:
                best[client_id] = sub
            session = sessions.get((tenant, client_id))
            if session is not None and session.subscription_ids:
                sub_id = session.subscription_ids.get(sub.topic_filter)
                if sub_id is not None:
                    ids.setdefault(client_id, []).append(sub_id)
        deliveries: list[Delivery] = []
        for client_id, sub in best.items():
            session = sessions.get((tenant, client_id))
            if session is not None:
                one = self._to_session(
                    session, message, sub, publisher, tuple(ids.get(client_id, ()))
                )
                if one is not None:
                    deliveries += one
        return deliveries

    @staticmethod
    def _to_session(
        session: Session,
        message: Message,
        sub: Subscription,
        publisher: str | None,
        sub_ids: tuple[int, ...],
    ) -> list[Delivery] | None:
        if sub.no_local and session.client_id == publisher:
            return None  # [MQTT-3.8.3-3]
        if not sub_ids and session.subscription_ids:
            sub_id = session.subscription_ids.get(sub.topic_filter)
            if sub_id is not None:
                sub_ids = (sub_id,)
        message_qos = message.qos
        qos = message_qos if message_qos < sub.qos else sub.qos
        # Routed copies carry RETAIN 0 unless retain-as-published [MQTT-3.3.1-9, 3.3.1-12].
        return [(session, message, qos, message.retain and sub.retain_as_published, sub_ids)]

    def retain(self, message: Message) -> bool:
        """Store a retained ``message`` unless its topic holds a newer one (see
        broker_edge.retained); True if it was taken."""
        return self.namespace(message.tenant).retained.set(message)

    def retained_messages(self) -> list[Message]:
        return [m for ns in self.namespaces.values() for m in ns.retained.all()]

    def retained_state(self) -> list[Message]:
        """Every retained message and tombstone (broker_edge.retained), of every tenant."""
        return [m for ns in self.namespaces.values() for m in ns.retained.state()]

    # -- outbound QoS 1/2 (states.Flow.OUT_*) ------------------------------------------------

    @staticmethod
    def acked(session: Session, packet_id: int, event: FlowEvent) -> bool:
        """The client acknowledged a delivery (PUBACK, PUBREC or PUBCOMP): step its exchange
        through the table; False when no exchange matches (a late or repeated ack is ignored,
        except that a repeated PUBREC gets its PUBREL again)."""
        out = session.inflight.get(packet_id)
        if out is None:
            return False
        to = FLOW_STEPS[out.state].get(event)  # states.peer_ack, inline: once per ack
        if to is None:
            return False
        if to:
            out.state = to
        else:
            del session.inflight[packet_id]
        return True
