"""Sessions that move between the edges of the mesh, sans-IO: claims, answers, handed sessions.

Theory of operation
-------------------
A client id names one session per tenant in the whole mesh, wherever the client connects, and
the last CONNECT wins [MQTT-3.1.4-3]. Each CONNECT is given a *claim version*
``(wall clock in µs, node)``: ordered by time, ties broken by node id, so every edge orders
two CONNECTs the same way (edges' clocks are assumed in sync, as for retained messages). The
edge that takes a CONNECT sends a :data:`CLAIM` (tenant, client id, version, ``since``, whether
it waits) to every peer linked both ways, on the link that carries its publishes to that peer
(the one the peer dialed), so the peer reads it after every publish sent before it: what the
claimer's clients published while the client was away is in the session the peer hands over.
The peer answers with :data:`SESSION` frames on the link that carries *its* publishes, after
them too (a peer that cannot answer, its link down, does nothing: its copy stays):

- a peer whose own CONNECT (or the one its copy of the session came with) is newer than the
  claim answers :data:`STALE`: the claimer's CONNECT is not the last one, so it is closed;
- else the peer closes its connection of that client (MQTT 5: DISCONNECT 0x8E, session taken
  over; 3.1.1: closed), and if it holds the persistent session it answers :data:`MOVED` with
  the session (subscriptions with their options and identifiers, the in-flight window, the
  queue, the QoS 2 ids awaiting PUBREL, the expiry, its claim and ``since``) and drops its copy
  (logged as dropped, so a restart does not bring it back); it answers :data:`NONE` when it
  holds nothing, or when the copy it held is older than the claim's ``since`` (a clean start
  discarded it: it is dropped, not sent).

``since`` is the version of the CONNECT with clean start that began the claimer's session: a
copy made before it belongs to a session the client threw away. A CONNECT with clean start
waits for nobody (nothing is to come back); one without waits up to :data:`CLAIM_WAIT` seconds
for the peers whose links are up, then opens the session with what came (CONNACK's session
present says a copy existed anywhere). A session handed over is restored like a snapshot's:
its filters go into the router (so the peers are told), its queue is delivered when the client
is attached. The handing edge also adds the session's filters to the claimer's routes at once,
so a publish it takes before the claimer's INTEREST arrives still goes to the claimer.

A third edge learns where the session went one INTEREST later, and meanwhile routes what
matches it to the edge that held it. So that edge keeps, for :data:`RELAY_WINDOW` seconds, a
*stand-in*: a clean session subscribed as the moved one was (not to its shared subscriptions),
under an id no client can have. When its time is over what it took goes to the session's new
edge as a late SESSION, which merges only what did not reach the session since the handover,
by ``(origin, seq)``: messages that took both ways (the handing edge's own publishes, routed to
the claimer too) are delivered once. The claimer remembers for :data:`ADOPTED_WINDOW` all that
reached a session handed to it: the document's messages, what it routed to it, and what a late
SESSION merged (two stand-ins may hold one message: a session moving a -> b -> a within the
window has a's stand-in and b's at once). A session moving on within that window takes
the record with it (``seen`` in its document, the newest :data:`SEEN_CARRIED`), merged into the
next edge's: a stand-in's late SESSION may reach an edge the session left and came back to, and
what the session took (and its client acknowledged) elsewhere meanwhile is only in that record.

A peer unreachable at the CONNECT (either link down) is not waited for. When the second link
with a peer comes up, each edge claims again, without waiting, every persistent session it
holds, with the version it holds it by: a peer holding an older copy hands it over and the
claimer merges it (the subscriptions it lacks, the peer's in-flight and queued messages after
its own queue); a peer holding a newer one answers STALE and its own claim hands this edge's
copy to it. So after a partition the copies end up merged on the edge of the last CONNECT.
Equal versions (two copies restored from before the mesh knew of claims) both stay.

Chosen where the issue is silent, and the gaps that remain:

- the wait is bounded (:data:`CLAIM_WAIT`): a peer that answers later still hands its copy
  over, merged into the session (then live) here;
- the handed session is durable on the claimer through its session log (the session and its
  subscriptions, synced before the CONNACK) and its next snapshot (the queue, soon after), which
  it then acknowledges (:data:`TAKEN`). The handing edge logs its copy dropped at once but keeps
  it in memory until then: if a link with the claimer goes down first, it takes the copy back
  (an offline session held by its old CONNECT), and the links coming up merge it where the last
  CONNECT is (at least once: what the claimer had delivered of it comes again). A crash of the
  handing edge before the TAKEN loses the copy if the claimer crashes too;
- the stand-in is not in snapshots: a crash of the handing edge in its window loses what it
  took; a publish a third edge sends after the window to the old edge (an INTEREST slower than
  :data:`RELAY_WINDOW`) reaches nobody; a late SESSION goes to the edge the session moved to
  when the stand-in began: if the session moved on from there meanwhile, it is dropped;
- a session that took more than :data:`SEEN_CARRIED` messages within :data:`ADOPTED_WINDOW`
  and moves on may be given a stand-in's copy of one of the older ones again (at least once);
- an expiry interval counts again from the handover; a queued message whose document is over
  the peer's frame bound is left out (counted in ``Mesh.sessions_cut``);
- each link coming up sends one CLAIM per persistent session held (no digest yet).

Frames are JSON. A session with a long queue is sent in several SESSION frames (:func:`frames`:
the first has everything but the rest of the queue, ``end`` marks the last), each well under a
link's frame bound; :class:`Assembly` puts them back together.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The link protocol's JSON bodies, read and written as every JSON frame of the mesh is.
from broker_edge.mesh import MeshProtocolError, _doc, _json
from broker_edge.session import NO_CLAIM

# A claim's version: (wall clock at the CONNECT in µs, the node that took it); the oldest
# possible, held by a session restored without one.
Version = tuple[int, str]
NO_VERSION: Version = NO_CLAIM

# Seconds a CONNECT without clean start waits for the peers' answers at most.
CLAIM_WAIT = 1.0
# Seconds the edge that handed a session over keeps a stand-in for it (see the theory of
# operation), and (longer) the claimer remembers what reached the session meanwhile.
RELAY_WINDOW = 2.0
ADOPTED_WINDOW = 3 * RELAY_WINDOW

# At most this many ``(origin, seq)`` of what a session took lately go with it when it moves on
# (``seen`` in its document; see the theory of operation): ~75 kB, well under a frame's bound.
SEEN_CARRIED = 4096

# Answers to a claim.
MOVED, NONE, STALE = "moved", "none", "stale"
ANSWERS = frozenset({MOVED, NONE, STALE})


@dataclass(frozen=True, slots=True)
class Claim:
    """One edge's CONNECT of ``client_id`` in ``tenant``, told to a peer."""

    tenant: str
    client_id: str
    version: Version
    since: Version  # the clean start that began the session (NO_VERSION: it inherits all)
    wait: bool  # the claimer waits for the answer before its CONNACK

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.client_id)


def verdict(held: Version | None, has_copy: bool, claim: Claim) -> str:
    """What a peer answers ``claim``: ``held`` is the version of its own connection or copy of
    the session (None: it has neither); ``has_copy``: it holds a persistent session."""
    if held is not None and held >= claim.version:
        # This edge's CONNECT is the last one (equal: two copies held by no CONNECT at all,
        # restored from before the mesh: each edge keeps its own rather than swap them).
        return STALE
    if has_copy and held is not None and held >= claim.since:
        return MOVED
    return NONE


# -- frames --------------------------------------------------------------------------------------


def claim_body(claim: Claim) -> bytes:
    doc = {
        "t": claim.tenant,
        "c": claim.client_id,
        "v": list(claim.version),
        "s": list(claim.since),
        "w": claim.wait,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def parse_claim(body: bytes) -> Claim:
    doc = _doc(body, "CLAIM")
    tenant, client_id, wait = doc.get("t"), doc.get("c"), doc.get("w")
    if not isinstance(tenant, str) or not tenant or not isinstance(client_id, str):
        raise MeshProtocolError("CLAIM: expected t, c")
    if not isinstance(wait, bool):
        raise MeshProtocolError("CLAIM: expected w")
    return Claim(tenant, client_id, version_of(doc.get("v")), version_of(doc.get("s")), wait)


def version_of(value: object) -> Version:
    """A version as JSON gives it back ([µs, node]); MeshProtocolError if it is not one."""
    if (
        not isinstance(value, list)
        or len(value) != 2
        or type(value[0]) is not int
        or value[0] < 0
        or not isinstance(value[1], str)
    ):
        raise MeshProtocolError(f"not a claim version: {value!r}")
    return (value[0], value[1])


def seen_doc(seen: Iterable[tuple[str, int]]) -> list[list[str | int]]:
    """What a session took lately, for its document when it moves on: the newest
    :data:`SEEN_CARRIED` (by seq: a stand-in holds what came last)."""
    newest = sorted(seen, key=lambda entry: entry[1], reverse=True)[:SEEN_CARRIED]
    return [[origin, seq] for origin, seq in newest]


def seen_of(value: object) -> set[tuple[str, int]]:
    """``seen`` of a session document back (:func:`seen_doc`); MeshProtocolError if it is not."""
    if not isinstance(value, list):
        raise MeshProtocolError(f"SESSION: not a seen list: {value!r}")
    seen = set()
    for entry in value:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not isinstance(entry[0], str)
            or type(entry[1]) is not int
        ):
            raise MeshProtocolError(f"SESSION: not an (origin, seq): {entry!r}")
        seen.add((entry[0], entry[1]))
    return seen


def frames(
    claim: Claim, answer: str, session: dict[str, Any] | None, budget: int, limit: int
) -> tuple[list[bytes], int]:
    """The bodies of the SESSION frames answering ``claim``: ``session`` (a session document,
    :func:`broker_edge.store.session_doc`) when MOVED, its queue cut so that each body stays
    near ``budget`` bytes (a queued message bigger than that goes alone); a queued message
    over ``limit`` bytes (the peer's frame bound: its base64 is a third bigger than a packet)
    is left out. Also how many were left out."""
    head: dict[str, Any] = {"t": claim.tenant, "c": claim.client_id, "v": list(claim.version)}
    head["a"] = answer
    if session is None:
        return [_json({**head, "end": True})], 0
    first = dict(session)
    queue: list[Any] = first.pop("queue", [])
    chunks: list[list[Any]] = [[]]
    size = len(_json(first))
    left_out = 0
    for entry in queue:
        n = len(_json(entry))
        if n > limit:
            left_out += 1
            continue
        if chunks[-1] and size + n > budget:
            chunks.append([])
            size = 0
        chunks[-1].append(entry)
        size += n
    bodies = [_json({**head, "s": {**first, "queue": chunks[0]}, "end": len(chunks) == 1})]
    for i, chunk in enumerate(chunks[1:], 2):
        bodies.append(_json({**head, "q": chunk, "end": i == len(chunks)}))
    return bodies, left_out


def taken_body(tenant: str, client_id: str, version: Version, late: bool) -> bytes:
    """A TAKEN: the session (``late``: a stand-in's messages) handed over for the claim of
    ``version`` is in a durable snapshot of the claimer."""
    return _json({"t": tenant, "c": client_id, "v": list(version), "l": late})


def parse_taken(body: bytes) -> tuple[str, str, Version, bool]:
    doc = _doc(body, "TAKEN")
    tenant, client_id, late = doc.get("t"), doc.get("c"), doc.get("l")
    if not isinstance(tenant, str) or not isinstance(client_id, str) or not isinstance(late, bool):
        raise MeshProtocolError("TAKEN: expected t, c, l")
    return tenant, client_id, version_of(doc.get("v")), late


@dataclass(frozen=True, slots=True)
class Answer:
    """A peer's whole answer to one claim (``session``: the document when MOVED)."""

    tenant: str
    client_id: str
    version: Version
    answer: str
    session: dict[str, Any] | None


class Assembly:
    """SESSION frames of one link back into answers (a peer sends one session's frames one
    after the other)."""

    def __init__(self) -> None:
        self._open: dict[str, Any] | None = None  # the session being put together
        self._head: tuple[str, str, Version] | None = None

    def feed(self, body: bytes) -> Answer | None:
        """One SESSION frame's body: the answer once it is whole, else None."""
        doc = _doc(body, "SESSION")
        tenant, client_id, answer = doc.get("t"), doc.get("c"), doc.get("a")
        if not isinstance(tenant, str) or not isinstance(client_id, str) or answer not in ANSWERS:
            raise MeshProtocolError("SESSION: expected t, c, a")
        head = (tenant, client_id, version_of(doc.get("v")))
        if "q" in doc:  # the rest of a queue
            queue = doc["q"]
            if self._open is None or self._head != head or not isinstance(queue, list):
                raise MeshProtocolError("SESSION: part of a queue without its session")
            self._open["queue"].extend(queue)
        else:
            session = doc.get("s")
            if self._open is not None:
                raise MeshProtocolError("SESSION: a session before the last one ended")
            if session is not None:
                if answer != MOVED or not isinstance(session, dict):
                    raise MeshProtocolError("SESSION: a session with a bad answer")
                if not isinstance(session.get("queue"), list):
                    raise MeshProtocolError("SESSION: a session without its queue")
            self._open, self._head = session, head
        if doc.get("end") is not True:
            if self._open is None:
                raise MeshProtocolError("SESSION: not ended, and no session")
            return None
        session, self._open, self._head = self._open, None, None
        return Answer(tenant, client_id, head[2], str(answer), session)


# -- waiting for answers (the claimer's side) ------------------------------------------------------


class Waiting:
    """One CONNECT's claim waiting for its peers' answers: done when every peer asked
    answered (or its link went down), or at the deadline (:data:`CLAIM_WAIT`)."""

    def __init__(self, claim: Claim, peers: Iterable[str]) -> None:
        self.claim = claim
        self.peers = set(peers)
        self.moved = False  # a peer handed its copy over
        self.stale = False  # a peer had a newer CONNECT (this one is not the last)

    def answered(self, node: str, answer: str) -> bool:
        """``node`` answered; True when nobody else is waited for."""
        self.peers.discard(node)
        self.moved |= answer == MOVED
        self.stale |= answer == STALE
        return not self.peers

    def superseded(self, version: Version) -> None:
        """A peer's claim newer than this one came meanwhile: this CONNECT is not the last."""
        if version > self.claim.version:
            self.stale = True
