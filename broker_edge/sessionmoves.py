"""An edge's side of sessions that move between the edges of the mesh: its copy handed over when
a peer claims it, a copy handed to it taken in, and the stand-in between (the rule, the frames
and the theory of operation are in :mod:`broker_edge.handover`; the wiring that calls this is
:mod:`broker_edge.meshlink`). No IO, no clock of its own: the broker's."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from broker_edge.handover import (
    ADOPTED_WINDOW,
    MOVED,
    STALE,
    Claim,
    Version,
    seen_doc,
    seen_of,
    verdict,
)
from broker_edge.logtext import printable
from broker_edge.message import Message
from broker_edge.packets import ReasonCode
from broker_edge.session import Pending, Session
from broker_edge.store import session_doc, session_from, subscription_doc, subscription_from
from broker_edge.topics import parse_subscription_filter

if TYPE_CHECKING:
    from broker_edge.broker import Broker

log = logging.getLogger(__name__)

# The client id of a session's stand-in once it moved to a peer begins with this: no client's
# can, MQTT strings hold no NUL [MQTT-1.5.4-2].
STAND_IN = "\x00"


class SessionMoves:
    """The sessions of ``broker`` that come and go."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        # Sessions handed here lately, by (tenant, client id): until when, and the (origin, seq)
        # of all that reached them since (handed with them, routed here, merged from a stand-in,
        # or taken on the edge they came from): a stand-in's late messages are not given twice.
        self.adopted: dict[tuple[str, str], tuple[float, set[tuple[str, int]]]] = {}
        self._stand_ins = 0

    def claimed(self, claim: Claim, pending: Version | None) -> tuple[str, dict[str, Any] | None]:
        """A peer's CONNECT claims a client id (``pending``: the version of a CONNECT of it
        here still waiting for its own claim): the answer, and the session document when it
        moves. Unless this edge's CONNECT is the newer, its connection is closed (0x8E) and
        its copy of the session dropped (logged: a restart does not bring it back)."""
        broker = self.broker
        key = claim.key
        session = broker.router.sessions.get(key)
        held = session.claim if session is not None else None
        if pending is not None:
            held = pending if held is None else max(held, pending)
        answer = verdict(held, session is not None and not session.clean, claim)
        if answer == STALE:
            return answer, None
        conn = broker.connections.get(key)
        if conn is not None:
            log.info("client %s taken over by a CONNECT on %s", printable(key[1]), claim.version[1])
            details = {"old_peer": conn.peer, "new_node": claim.version[1]}
            broker.log(claim.tenant, "session_taken_over", claim.client_id, details)
            broker.close(conn, ReasonCode.SESSION_TAKEN_OVER)
            broker._detach(conn, broker.clock())
        session = broker.router.sessions.get(key)  # a clean one ended with its connection
        doc = None
        if session is not None:
            if answer == MOVED:
                doc = session_doc(session)
                entry = self.adopted.get(key)
                if entry is not None and entry[0] > broker.clock():
                    # A stand-in of an edge it left lately may hold some of it too.
                    doc["seen"] = seen_doc(entry[1])
            broker.pending_wills.pop(key, None)  # it lives on elsewhere: no will for its end
            broker._drop_session(session)
        broker.flush_dirty()
        return answer, doc

    def adopt(self, doc: dict[str, Any]) -> None:
        """A session a peer handed over: installed here offline (or merged into the copy held
        here: the subscriptions it lacks, then its messages after its queue), and logged like
        one opened here. ``late`` in ``doc``: what the peer's stand-in took after the handover
        (only the messages not delivered here already, into the session if it is still here)."""
        broker = self.broker
        router = broker.router
        bounds = router.bounds
        now = broker.clock()
        moved = session_from(doc, bounds.max_queued, bounds.max_inflight, now)
        key = (moved.tenant, moved.client_id)
        if doc.get("late"):
            self._merge_late(key, moved)
            return
        self.adopted = {k: v for k, v in self.adopted.items() if v[0] > now}
        seen = seen_of(doc.get("seen", []))  # what it took on the edge it comes from
        seen.update((o.message.origin, o.message.seq) for o in moved.inflight.values())
        seen.update((p.message.origin, p.message.seq) for p in moved.queue)
        earlier = self.adopted.get(key)
        self.adopted[key] = (now + ADOPTED_WINDOW, seen | earlier[1] if earlier else seen)
        session = router.sessions.get(key)
        if session is None:
            session = moved
            router.add_session(session)
            for full, sub in session.subscriptions.items():
                router.install(session, full, sub)
        else:
            self._merge(session, moved)
        broker.state_changed = True  # its queue is only in a snapshot: take one soon
        broker.log_session(session, None)
        for full, sub in session.subscriptions.items():
            sub_id = session.subscription_ids.get(full)
            broker._log_session_change(
                session, "sub", None, sub=subscription_doc(full, sub), id=sub_id
            )
        broker.outbox.drain(session)
        broker.flush_dirty()

    def _merge(self, session: Session, moved: Session) -> None:
        """A copy made elsewhere into the one held here (see broker_edge.handover)."""
        router = self.broker.router
        for full, sub in moved.subscriptions.items():
            if full not in session.subscriptions:
                session.subscriptions[full] = sub
                session.set_subscription_id(full, moved.subscription_ids.get(full))
                router.install(session, full, sub)
        waiting = [Pending(o.message, o.qos, o.retain) for o in moved.inflight.values()]
        for pending in (*waiting, *moved.queue):
            session.enqueue(pending)
        session.since = max(session.since, moved.since)
        if session.clean:  # a clean session here takes the persistent one's expiry
            router.set_expiry(session, moved.expiry_interval)

    def _merge_late(self, key: tuple[str, str], late: Session) -> None:
        broker = self.broker
        session = broker.router.sessions.get(key)
        entry = self.adopted.get(key)
        if session is None or entry is None:
            return  # it ended here meanwhile (a clean start), or came long ago
        seen = entry[1]
        for pending in late.queue:
            message = pending.message
            if (message.origin, message.seq) not in seen:
                # Reached the session now: another stand-in's copy of it is not merged again.
                seen.add((message.origin, message.seq))
                session.enqueue(pending)
        broker.state_changed = True
        broker.outbox.drain(session)
        broker.flush_dirty()

    def note(self, deliveries: Iterable[tuple[Session, Message, int, bool, Any]]) -> None:
        """Remember what reached a session handed here lately (see ``adopted``)."""
        adopted = self.adopted
        now = self.broker.clock()
        for session, message, *_ in deliveries:
            key = (session.tenant, session.client_id)
            entry = adopted.get(key)
            if entry is None:
                continue
            if entry[0] < now:
                del adopted[key]
            else:
                entry[1].add((message.origin, message.seq))

    def stand_in(self, doc: dict[str, Any]) -> Session:
        """For a moment after its session moved to a peer (broker_edge.handover: RELAY_WINDOW)
        a stand-in subscribed as it was (but for shared subscriptions) keeps what reaches this
        edge for it: what a third edge sent here before it learned where the session went."""
        router = self.broker.router
        self._stand_ins += 1  # each its own id: a session may move twice within the window
        stand_in_id = f"{STAND_IN}{self._stand_ins}{STAND_IN}{doc['client_id']}"
        stand_in = router.new_session(doc["tenant"], stand_in_id, True, None)
        # Clean (never snapshotted, never expired: it is not offline), but its late document
        # carries the session's expiry, for the edge that may have to hold it after all.
        stand_in.expiry_interval = int(doc["expiry_interval"])
        for sub_doc in doc["subscriptions"]:
            full = sub_doc["filter"]
            if parse_subscription_filter(full)[0] is None:
                sub = subscription_from(sub_doc)
                stand_in.subscriptions[full] = sub
                router.install(stand_in, full, sub)
        return stand_in

    def stand_in_done(self, stand_in: Session) -> dict[str, Any] | None:
        """The stand-in ends: what it took, as a late session document for the peer (None:
        nothing)."""
        doc = session_doc(stand_in) if stand_in.queue else None
        self.broker.router.drop_session(stand_in)
        if doc is not None:
            client_id = stand_in.client_id.split(STAND_IN, 2)[2]
            doc.update(client_id=client_id, subscriptions=[], late=True)
        return doc
