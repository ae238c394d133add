"""The edge mesh, sans-IO: link frames, who wants what, what is unacknowledged, what was seen.

Theory of operation
-------------------
Every edge lists the others (``edge.peers``: full mesh, one hop) and *dials* each of them. A link
is a TCP connection to the peer's MQTT port that opens with :data:`MAGIC`, whose first byte
(0x00, MQTT's reserved packet type) no MQTT client can send, so the listener hands it over
before the MQTT machine sees it. Each dialed link carries data one way: the dialer tells the
peer what its sessions subscribe to (:data:`INTEREST` frames) and acknowledges (:data:`ACK`);
the peer sends the dialer the publishes that match (:data:`PUBLISH`). So A→B traffic flows on
the link B dialed, and a link's owner (the dialer) is the one that reconnects it. Why not an
MQTT 5 connection per link: every delivery over it would go through a client session (its
queue bounds drop, its expiry ends it) and the dialer would need an MQTT client; a frame of
our own carries the origin, the tenant and the journal seq without properties to parse.

Frames: ``u32 length | u8 kind | body``. Both ends prove they hold the link token, which never
crosses the wire: the dialer's :data:`HELLO` (version, node, a random challenge) is answered by
:data:`CHALLENGE` (the acceptor's node, its own challenge, and an HMAC of both challenges under
the token), which the dialer checks before it sends :data:`AUTH` (its HMAC); the acceptor
answers :data:`WELCOME` (its run) or :data:`REFUSE` (a reason, then close). So an impostor
at a peer's address learns nothing and can inject nothing, and a recorded handshake cannot be
replayed. A link not admitted within the CONNECT timeout is closed; an admitted one is kept
alive by :data:`PING` frames both ways (closed when silent for three intervals). The link token
is the operator token when the edge has a tenants file with one, else ``edge.mesh_token``; an
edge with neither refuses every link. A tenant's token never opens a link, and a link is never
an MQTT client: it cannot subscribe or publish anywhere itself.

Routing state: each edge counts, per tenant namespace, the filters its sessions hold
(:class:`Interest`: a filter once per node however many subscribers). A new link gets the whole
set, ended by :data:`SYNCED`, then changes as they happen (a filter's first subscriber adds it,
its last removes it). The whole set replaces the peer's filters only once it is all there: until
then the origin routes by the filters the peer had (and the new ones as they arrive), so a
publish made between the link's admission and the end of the set is not missed.
A filter subscribed while the link was down is one the origin does not hold when the set comes:
the set says when each filter was subscribed, and SYNCED the highest seq of the origin delivered
at the dialer; the origin rescans its journal after that seq for the QoS 1/2 messages such a
filter matches that were published since it was subscribed (:class:`CatchUp`; as if the link
had been up: a QoS 0 message is not sent again, what was published before the subscription does
not go) and merges them into the peer's Unacked. Since Dedup keeps a high-water mark, nothing
goes to an accepted link before that (its frames wait until SYNCED, at most ``SYNC_WAIT``, and
the rescan): then Unacked, in seq order, then what waited. Chosen where the issue is silent:
edges' clocks are in sync (as for retained messages); a filter's time is its first subscriber's
on this run of the dialer (a filter restored at start counts from the restart); shares are not
rescanned.
The origin keeps each peer's filters in a trie per tenant (:class:`PeerRoutes`) and sends a
publish once to each peer with a matching filter. Only the origin journals a publish: the
receiver routes it to its own sessions and never forwards it again (one hop, no loops).
What crosses (:func:`reach`): the tenants' own topics and the edge-made ``$log/`` and
``$counters/`` (they name their node) go by the peers' filters; the operator's decisions and
confirmed usage (``$control/quota/``, ``$control/usage/``) go to every peer, and a journal
notice (``$control/journal/{node}``) to the peer that is that node (each edge deletes only its
own segments); ``$SYS``, ``$quota`` (each edge makes its own from the decision it applies) and
every other ``$`` topic are each node's own. A peer's frame on a topic that does not cross to
the receiver is a protocol error.

Shared subscriptions (``$share/{group}/{filter}``) are not filters here: an edge tells its
*shares* apart (INTEREST's ``sset``/``sdel``, with each share's connected members), the origin
gives each message of a share to one edge, and a PUBLISH frame names the shares given to the
peer it goes to (see :mod:`broker_edge.meshgroups`). A peer's shares are kept, and survive a
restart, as its filters are (below).

Retained messages are mesh-wide. Every edge keeps, per tenant namespace and topic, the newest
retained message by *version* ``(origin ts, origin node, origin seq)`` (see
:mod:`broker_edge.retained`; a clear is kept as a tombstone with its version, so a set older
than a clear stays cleared whichever reaches an edge first): the same rule everywhere, so the
edges agree whatever order publishes reach them in. A retained publish (set or clear) crosses
to *every* peer, whatever its filters, as one PUBLISH frame (with its retain flag; QoS 1/2 kept
in Unacked like any other): the receiver keeps it if it is newer, and routes it to its own
sessions by its own filters like any crossing publish, so a live subscriber gets it once. When
a link comes up its acceptor sends, after what the peer had not acknowledged, every retained
message and tombstone it holds that crosses to that peer (:data:`RETAINED` frames, whatever
their origin: a peer that was away, restarted or is new gets what it missed even while the
origin itself is down), which the receiver keeps where newer and delivers to nobody. Retained
copies from peers are in the receiver's snapshots (taken soon after one is kept: they are not
in its journal); what a crash lost of them comes back with the next link's sets. Chosen where
the issue is silent: edges' clocks are assumed in sync (NTP): a retained publish on an edge
whose clock is behind the time of the one held loses, on that edge too; a stale live retained
publish is still delivered live (it was published) but not kept; tombstones are kept up to
``retained.MAX_CLEARED`` per tenant (the oldest forgotten beyond); whole sets rather than a
digest (retained messages are few; a digest is left for later); a message's content type, user
properties and expiry interval cross with it (its other MQTT 5 properties do not), and a
receiver counts the expiry from the origin's time, as the origin does. A journal notice is not
journaled (it has no seq to be resent by): it crosses at once if the link is up, as QoS 0, and
else with the link's retained set when it comes up.

The operator's decisions apply on every edge as if published there: an edge that takes a
crossing (or synced) ``$control/...`` message applies it as the tenancy would a local one, and
only when it is the newest retained message of its topic there (a decision older than the one
held is not applied, on any edge). The pipeline so needs one ``--broker``. Tenants still cannot
publish any ``$control`` topic (the tenancy's rule, on each edge); a link is the operator's.

QoS: the seq of a crossing message is its journal seq at the origin (unique and increasing per
node, and never given out again once durable). A QoS 0 message crosses at once and is never
sent again. A QoS 1/2 message crosses only once its journal record is durable (as its publisher
is acknowledged only then): so a seq a peer has seen is never reused by a crash of the origin,
and (origin node, seq) names one message for good. It stays in the peer's :class:`Unacked`
(bounded) until the receiver acks it, and is sent again, in seq order, when the peer dials in
again, so a link break loses none; the receiver drops what it has delivered already
(:class:`Dedup`: the highest seq per origin, since an origin sends QoS 1/2 in seq order). The
peer's filters survive a break too: what matches them while the link is down waits for it in
Unacked.

Sessions move with their clients (:mod:`broker_edge.handover`): a CONNECT claims its client id
from every peer linked both ways (:data:`CLAIM`, sent where this edge's publishes to the peer go,
so after them), and a peer that held the session closes its connection and hands it over in
:data:`SESSION` frames on the link its own publishes take, keeping it until the claimer's
:data:`TAKEN` says a durable snapshot holds it; the last CONNECT wins.

Restarts (the journal is the replication log). Each state snapshot of an edge (``store``) holds its
:class:`MeshState`: per peer, the filters it holds and ``acked``, the highest seq at or below which
the peer acknowledged every QoS 1/2 message it was due; and per origin, the highest seq delivered
here. An origin that restarts (a crash included) takes its peers' filters back and rebuilds each
peer's Unacked from its journal: every QoS 1/2 record after ``acked`` that matches them (what the
peer had since is dropped by its Dedup; beyond Unacked's bound the oldest are given up and counted,
as for a peer away too long; records retention removed are gone, and logged). A snapshot follows a
change of a peer's filters within a second or two; until then the change is in the session log
(:mod:`broker_edge.sessionlog`, ``{"op": "peer"}`` with the seq of the last journal record before
it), synced before any publish read after it is acknowledged (its sync is queued on the loop before
the journal's report of that publish), and applied at restore before the records after that seq are
replayed: an origin killed a moment after a peer told it a new filter still sends that peer every
message it acknowledged since. The journal is read from the oldest peer's ``acked`` at start (a
forgotten peer's is not: below), so a peer away makes that read at most its expiry long. A
receiver acknowledges a QoS 1/2 message at once when no persistent session took it (a clean
session does not outlive a restart anyway), else only once a snapshot holding its sessions with
the message in them, and its Dedup past it, is durable (:class:`AckGate`; the edge snapshots
every second while acks wait): a receiver killed before that has not acknowledged it, so its
origin sends it again. Such a message is in the
receiver's session log (:mod:`broker_edge.receipts`) before any subscriber sees it: the restore puts
it back where it was in each session and moves Dedup past it, so the copy sent again is dropped (a
session gets it again only as the MQTT redelivery of what its subscriber had not acknowledged).
The WELCOME carries the origin's newest durable seq: a receiver whose Dedup is past it (the
origin's journal started over) forgets that origin's seqs. Each end's promise is only as durable
as its journal and snapshot (``edge.journal_fsync``).

Retention (issue 9) keeps the journal for the peers: the origin tells its journal each peer's
``acked`` (on every ACK and every second) and no segment holding a record after the lowest is
deleted, however long ago the lake committed it. A peer away for long must not fill the disk
forever: once the journal is over its budget (``journal_max_bytes``, ``journal_min_free_bytes``)
the oldest segments the lake committed go even so (see broker_edge.durability), and each peer
that had not acknowledged their records gives them up (dropped from its Unacked, counted in
``publish/unacked_dropped``) with a ``peer_dropped`` event in the operator's ``$log`` naming the
peer and the seqs.

Peers gone for good. The budget alone lets a dead peer (decommissioned with its entry left in
``edge.peers``, or down for days) hold every edge's journal until it is full, each edge then
refusing publishes at every turn of the budget. So each edge tracks since when each peer has
been away (:class:`Absences`: its link to this origin, the one its acks come on, down; since it
was last up) and *forgets* a peer away longer than ``edge.peer_expiry_hours`` (default 24; 0:
never): what it is due is given up (counted in ``publish/unacked_dropped``), nothing is kept
for it any more, the journal's floor ignores it, and the operator's ``$log`` gets one
``peer_forgotten`` (the peer, how long it was away, how many messages it gave up); ``$SYS``
shows its ``inbound/{node}`` as ``forgotten``. When it was last up is in the snapshot's mesh state
(a snapshot follows a link going down within a second), so a restart of this edge does not
reset the clock (a peer of a snapshot without it counts from the restore); forgotten stays
forgotten across restarts, its Unacked is not rebuilt. No peer is forgotten before this edge has
run ``min(START_GRACE, expiry)``: after this edge's own downtime, a peer that is up gets its
chance to dial in first. A forgotten peer that comes back is not refused: its link comes up
(``link_up``) and its filters were kept; its SYNCED seq (the highest of this origin it had)
starts a rescan of the journal as for filters subscribed while its link was down
(:class:`CatchUp`), but for every filter it held, whatever its time: it gets what the journal
still holds of what it is due (what retention removed meanwhile is gone, and logged). While a
rescan for a peer runs, the journal keeps what follows the SYNCED seq. Chosen where the issues
are silent: a time rather than a size (a peer down for a day is gone whatever the traffic, and
a peer back within the expiry loses nothing, as before); the peer's filters are kept rather
than dropped, so its return gets what the journal holds for them, not only what its sessions
subscribe to from then on (as a new peer would).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from broker_edge.errors import EdgeError
from broker_edge.meshgroups import PeerShares, Share
from broker_edge.message import Message
from broker_edge.packets import NO_PROPERTIES, Properties, QoS
from broker_edge.tenants import OPERATOR_TENANT
from broker_edge.topics import InvalidTopic
from broker_edge.trie import TopicTrie
from schemas.topics import (
    CONTROL_TOPIC_PREFIX,
    JOURNAL_CONTROL_TOPIC_PREFIX,
    USAGE_CONTROL_TOPIC_PREFIX,
)

MAGIC = b"\x00EBMESH1"
# 2: QoS 1/2 seqs are durable at the origin (Dedup outlives a run); 3: retained messages and
# the operator's decisions cross (PUBLISH keeps its retain flag; RETAINED); 4: shared
# subscriptions are mesh-wide (INTEREST tells shares, PUBLISH names the shares given to the peer:
# see broker_edge.meshgroups); 5: sessions move between edges (CLAIM, SESSION:
# broker_edge.handover)
VERSION = 5

HELLO = 1
WELCOME = 2
REFUSE = 3
INTEREST = 4
PUBLISH = 5
ACK = 6
PING = 7
CHALLENGE = 8
AUTH = 9
SYNCED = 10
RETAINED = 11
CLAIM = 16  # dialer -> acceptor: a CONNECT claims a client id (broker_edge.handover)
SESSION = 17  # acceptor -> dialer: the answer, with the session when it moves
TAKEN = 18  # acceptor -> dialer: a session handed over is in a durable snapshot of the dialer
KINDS = frozenset(
    {
        HELLO, WELCOME, REFUSE, INTEREST, PUBLISH, ACK, PING, CHALLENGE, AUTH, SYNCED, RETAINED,
        CLAIM, SESSION, TAKEN,
    }
)  # fmt: skip

_HEADER = struct.Struct(">IB")  # length of what follows the length, kind
_PUBLISH = struct.Struct(">QQBB")  # seq, ts_us, qos, retain
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
# A PUBLISH without properties or shares ends its body so before its payload: an empty content
# type (u16 0), flags 0, no user properties (u16 0). _PLAIN_SIZE: its frame's length field less
# its strings and payload (kind, the fixed fields, four string lengths, that tail).
_PLAIN_END = b"\x00\x00\x00"
_PLAIN_TAIL = b"\x00\x00" + _PLAIN_END
_PLAIN_SIZE = 1 + _PUBLISH.size + 3 * _U16.size + len(_PLAIN_TAIL)
_QOS = tuple(QoS)  # by value: an index (a value out of range is an IndexError)

# Edge-made "$" topics that cross links (each names its node); every other "$" topic is local,
# but for the operator's decisions (DECIDED_PREFIXES) and journal notices (reach).
CROSSING_PREFIXES = ("$log/", "$counters/")
DECIDED_PREFIXES = (CONTROL_TOPIC_PREFIX, USAGE_CONTROL_TOPIC_PREFIX)
# Messages waiting for one peer's acknowledgement at most (the oldest go first beyond).
MAX_UNACKED = 100_000
MAX_UNACKED_BYTES = 64 * 2**20
# Seconds an edge runs before it forgets any peer (Absences): a peer that is up redials within
# its backoff (meshlink.BACKOFF_MAX, +20 %) and a handshake, well within this.
START_GRACE = 60.0
# Frames before a link is admitted are small (a HELLO): an unknown peer cannot make us buffer.
MAX_HELLO_FRAME = 4096


class MeshProtocolError(EdgeError):
    """The other end of a link broke the link protocol (the link is closed)."""


# Which peers a message goes to (reach): none; those whose filters match it (all of them for
# a retained message); every peer; the one peer whose node the topic names.
LOCAL, FILTERS, EVERY = "", "*filters", "*every"


def reach(tenant: str, topic: str) -> str:
    """Which peers a message of ``tenant`` on ``topic`` goes to (see the theory of operation):
    LOCAL, FILTERS, EVERY, or a peer's node id (a journal notice: that node's own)."""
    if topic[0] != "$" or topic.startswith(CROSSING_PREFIXES):
        return FILTERS
    if tenant != OPERATOR_TENANT:
        return LOCAL
    if topic.startswith(DECIDED_PREFIXES):
        return EVERY
    if topic.startswith(JOURNAL_CONTROL_TOPIC_PREFIX):
        node = topic[len(JOURNAL_CONTROL_TOPIC_PREFIX) :]
        return node if node and "/" not in node else LOCAL
    return LOCAL


def goes_to(tenant: str, topic: str, node: str) -> bool:
    """Whether a message of ``tenant`` on ``topic`` may go to peer ``node`` (what a link
    coming up sends it, what it may receive: every one that crosses, a journal notice only to
    its node)."""
    where = reach(tenant, topic)
    return where in (FILTERS, EVERY) or where == node


# -- frames ------------------------------------------------------------------------------------


def frame(kind: int, body: bytes) -> bytes:
    return _HEADER.pack(len(body) + 1, kind) + body


class FrameBuffer:
    """Bytes in, ``(kind, body)`` frames out; a frame longer than ``max_frame`` is an error.

    :meth:`pop` takes one frame at a time, so a caller may raise ``max_frame`` between two
    frames of one read (a link admitted by the first: what follows it may be big)."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0  # where the next frame starts in _buf

    def push(self, data: bytes) -> None:
        self._buf += data

    def pop(self) -> tuple[int, bytes] | None:
        """The next whole frame, or None until more bytes come."""
        buf, start = self._buf, self._pos
        if len(buf) - start >= _HEADER.size:
            length, kind = _HEADER.unpack_from(buf, start)
            if length < 1 or length > self.max_frame:
                raise MeshProtocolError(f"frame of {length} bytes (at most {self.max_frame})")
            if kind not in KINDS:
                raise MeshProtocolError(f"unknown frame kind {kind}")
            end = start + 4 + length
            if len(buf) >= end:
                self._pos = end
                return kind, bytes(buf[start + _HEADER.size : end])
        del buf[:start]  # every whole frame was taken: drop them at once
        self._pos = 0
        return None

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """:meth:`push`, then every whole frame."""
        self.push(data)
        frames: list[tuple[int, bytes]] = []
        while (one := self.pop()) is not None:
            frames.append(one)
        return frames


def _json(doc: dict[str, object]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _doc(body: bytes, what: str) -> dict[str, object]:
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise MeshProtocolError(f"{what}: not JSON") from exc
    if not isinstance(doc, dict):
        raise MeshProtocolError(f"{what}: not an object")
    return doc


def nonce() -> str:
    """A fresh challenge for one handshake."""
    return secrets.token_hex(16)


def hello(node: str, dialer_nonce: str) -> bytes:
    """What a dialer sends first: the magic, then its HELLO (its node and a challenge)."""
    return MAGIC + frame(HELLO, _json({"v": VERSION, "node": node, "nonce": dialer_nonce}))


def proof(token: str, role: str, first: str, second: str, node: str) -> str:
    """What shows ``node`` holds the link token in this handshake: an HMAC of both challenges
    (``role``: "accept" or "dial", so one side's proof is never the other's)."""
    text = f"{role}|{first}|{second}|{node}".encode()
    return hmac.new(token.encode(), text, hashlib.sha256).hexdigest()


def proven(given: str, token: str, role: str, first: str, second: str, node: str) -> bool:
    return hmac.compare_digest(given.encode(), proof(token, role, first, second, node).encode())


def challenge(node: str, acceptor_nonce: str, acceptor_proof: str) -> bytes:
    """The acceptor's answer to a HELLO: its node, its challenge and its proof."""
    body: dict[str, object] = {"node": node, "nonce": acceptor_nonce, "proof": acceptor_proof}
    return frame(CHALLENGE, _json(body))


def auth(dialer_proof: str) -> bytes:
    return frame(AUTH, _json({"proof": dialer_proof}))


def welcome(node: str, durable_seq: int) -> bytes:
    """The answer to an admitted AUTH: this node, and the newest seq of its journal that is
    durable (a receiver that delivered a higher seq from it forgets it, see :class:`Dedup`)."""
    return frame(WELCOME, _json({"node": node, "seq": durable_seq}))


def parse_welcome(body: bytes) -> tuple[str, int]:
    """(node, newest durable seq) of a WELCOME."""
    seq = _doc(body, "WELCOME").get("seq")
    if type(seq) is not int or seq < 0:
        raise MeshProtocolError("WELCOME: bad seq")
    return node_of(body, "WELCOME"), seq


PING_FRAME = frame(PING, b"")


def synced(seen: int) -> bytes:
    """The end of a link's whole set of filters, with the highest QoS 1/2 seq of the acceptor
    delivered here (where the acceptor rescans its journal from for the filters it did not
    know: :class:`CatchUp`)."""
    return frame(SYNCED, _json({"seen": seen}))


def parse_synced(body: bytes) -> int | None:
    """The seq a SYNCED names (None: it names none, no rescan)."""
    if not body:
        return None
    seen = _doc(body, "SYNCED").get("seen")
    if type(seen) is not int or seen < 0:
        raise MeshProtocolError("SYNCED: bad seen")
    return seen


def refuse(reason: str) -> bytes:
    return frame(REFUSE, _json({"reason": reason}))


def node_of(body: bytes, what: str) -> str:
    """The ``node`` of a HELLO, CHALLENGE or WELCOME."""
    node = _doc(body, what).get("node")
    if not isinstance(node, str) or not node or "/" in node:
        raise MeshProtocolError(f"{what}: bad node {node!r}")
    return node


def _text(body: bytes, what: str, key: str) -> str:
    value = _doc(body, what).get(key)
    if not isinstance(value, str) or not 0 < len(value) <= 200:
        raise MeshProtocolError(f"{what}: bad {key}")
    return value


def reason_of(body: bytes) -> str:
    return str(_doc(body, "REFUSE").get("reason", ""))[:200]


@dataclass(frozen=True, slots=True)
class Hello:
    node: str
    nonce: str


def parse_hello(body: bytes) -> Hello:
    doc = _doc(body, "HELLO")
    if doc.get("v") != VERSION:
        raise MeshProtocolError(f"HELLO: link protocol version {doc.get('v')!r}, not {VERSION}")
    return Hello(node_of(body, "HELLO"), _text(body, "HELLO", "nonce"))


def parse_challenge(body: bytes) -> tuple[str, str, str]:
    """(node, nonce, proof) of a CHALLENGE."""
    return (
        node_of(body, "CHALLENGE"),
        _text(body, "CHALLENGE", "nonce"),
        _text(body, "CHALLENGE", "proof"),
    )


def parse_auth(body: bytes) -> str:
    return _text(body, "AUTH", "proof")


def refusal(hello: Hello, expected: str | None, own_node: str) -> str | None:
    """Why a HELLO is refused at once (None: challenge it). ``expected``: the link token
    (None: this edge takes no links)."""
    if expected is None:
        return "this edge takes no links (no operator token, no edge.mesh_token)"
    if hello.node == own_node:
        return f"node id {own_node!r} is this edge's own"
    return None


@dataclass(frozen=True, slots=True)
class InterestChange:
    """One INTEREST frame: a tenant's filters added and removed, and its shares (see
    :mod:`broker_edge.meshgroups`) set, with their connected members, and dropped."""

    tenant: str
    add: list[str]
    remove: list[str]
    shares: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    unshared: list[Share] = dataclasses.field(default_factory=list)
    # A link's whole set only: when each filter added was subscribed (µs since the epoch).
    at: dict[str, int] = dataclasses.field(default_factory=dict)


def interest_frame(
    tenant: str,
    add: Iterable[str],
    remove: Iterable[str],
    shares: Iterable[tuple[str, str, int]] = (),
    unshared: Iterable[Share] = (),
    at: dict[str, int] | None = None,
) -> bytes:
    doc: dict[str, object] = {"t": tenant, "add": list(add), "del": list(remove)}
    sset = [list(share) for share in shares]
    sdel = [list(share) for share in unshared]
    if sset:
        doc["sset"] = sset
    if sdel:
        doc["sdel"] = sdel
    if at:
        doc["at"] = at
    return frame(INTEREST, _json(doc))


def interest_doc(change: InterestChange) -> dict[str, object]:
    """An INTEREST frame's body as a JSON document (what :func:`parse_interest` reads)."""
    return {
        "t": change.tenant,
        "add": change.add,
        "del": change.remove,
        "sset": [list(share) for share in change.shares],
        "sdel": [list(share) for share in change.unshared],
    }


def parse_interest(body: bytes) -> InterestChange:
    doc = _doc(body, "INTEREST")
    tenant, add, remove = doc.get("t"), doc.get("add"), doc.get("del")
    shares, unshared = doc.get("sset", []), doc.get("sdel", [])
    at = doc.get("at", {})
    if (
        not isinstance(tenant, str)
        or not isinstance(add, list)
        or not isinstance(remove, list)
        or not all(isinstance(f, str) for f in (*add, *remove))
        or not isinstance(shares, list)
        or not isinstance(unshared, list)
        or not all(_is_share(share, 3) for share in shares)
        or not all(_is_share(share, 2) for share in unshared)
    ):
        raise MeshProtocolError("INTEREST: expected t, add, del (and sset, sdel)")
    if (
        not isinstance(at, dict)
        or not all(type(ts) is int and ts >= 0 for ts in at.values())
        or not set(at) <= set(add)
    ):
        raise MeshProtocolError("INTEREST: at must give a time to filters added")
    return InterestChange(
        tenant,
        add,
        remove,
        [(g, f, n) for g, f, n in shares],
        [(g, f) for g, f in unshared],
        dict(at),
    )


def _is_share(item: object, size: int) -> bool:
    """[group, filter] (size 2) or [group, filter, connected members] (size 3)."""
    return (
        isinstance(item, list)
        and len(item) == size
        and isinstance(item[0], str)
        and isinstance(item[1], str)
        and (size == 2 or (type(item[2]) is int and item[2] >= 0))
    )


def ack_frame(seqs: list[int]) -> bytes:
    return frame(ACK, struct.pack(f">{len(seqs)}Q", *seqs))


def parse_ack(body: bytes) -> tuple[int, ...]:
    if len(body) % 8:
        raise MeshProtocolError("ACK: not a list of u64")
    return struct.unpack(f">{len(body) // 8}Q", body)


def _put_str(parts: list[bytes], text: str) -> None:
    data = text.encode()
    parts.append(_U16.pack(len(data)))
    parts.append(data)


def publish_frame(message: Message, qos: QoS | None = None, shares: Iterable[Share] = ()) -> bytes:
    """One crossing message (its origin is the link's other end), at ``qos`` if given;
    ``shares``: the shared subscriptions of the peer it is given to (broker_edge.meshgroups)."""
    props = message.properties
    qos = message.qos if qos is None else qos
    if props is NO_PROPERTIES and shares == ():
        # The usual message (per publish and peer: the hot path): the same bytes as below,
        # built in one join with the frame's header.
        tenant = message.tenant.encode()
        client_id = message.client_id.encode()
        topic = message.topic.encode()
        payload = message.payload
        size = _PLAIN_SIZE + len(tenant) + len(client_id) + len(topic) + len(payload)
        return b"".join(
            (
                _HEADER.pack(size, PUBLISH),
                _PUBLISH.pack(message.seq, message.ts_us, qos, message.retain),
                _U16.pack(len(tenant)),
                tenant,
                _U16.pack(len(client_id)),
                client_id,
                _U16.pack(len(topic)),
                topic,
                _PLAIN_TAIL,
                payload,
            )
        )
    parts = [_PUBLISH.pack(message.seq, message.ts_us, int(qos), message.retain)]
    _put_str(parts, message.tenant)
    _put_str(parts, message.client_id)
    _put_str(parts, message.topic)
    _put_str(parts, props.content_type if props.content_type is not None else "")
    expiry = props.message_expiry_interval
    given = tuple(shares)
    # Flags: a content type (bit 0), a message expiry interval (bit 1: its u32 follows), which
    # the receiver counts from the origin's time like the origin [MQTT-3.3.2-5]; shares
    # (bit 2: their count, u16, then each group and filter follow).
    flags = (props.content_type is not None) | (expiry is not None) << 1 | bool(given) << 2
    parts.append(bytes((flags,)))
    if expiry is not None:
        parts.append(_U32.pack(expiry))
    if given:
        parts.append(_U16.pack(len(given)))
        for group, topic_filter in given:
            _put_str(parts, group)
            _put_str(parts, topic_filter)
    parts.append(_U16.pack(len(props.user_properties)))
    for key, value in props.user_properties:
        _put_str(parts, key)
        _put_str(parts, value)
    parts.append(message.payload)
    return frame(PUBLISH, b"".join(parts))


def retained_frame(message: Message) -> bytes:
    """A retained message (or tombstone) of the sender's store, for a link that came up: its
    origin node (any edge's), then as in a PUBLISH."""
    origin = message.origin.encode()
    body = publish_frame(message)[_HEADER.size :]
    return frame(RETAINED, _U16.pack(len(origin)) + origin + body)


def parse_retained(body: bytes) -> Message:
    """A RETAINED frame back into the message (its ``origin`` as the frame names it)."""
    try:
        (n,) = _U16.unpack_from(body, 0)
        origin = body[2 : 2 + n].decode()
    except (struct.error, UnicodeDecodeError) as exc:
        raise MeshProtocolError(f"RETAINED: malformed ({exc})") from exc
    if not origin or "/" in origin or len(body) < 2 + n:
        raise MeshProtocolError("RETAINED: bad origin")
    message, shares = parse_publish(body[2 + n :], origin)
    if not message.retain or shares:
        raise MeshProtocolError("RETAINED: not a retained message (or given to shares)")
    return message


def parse_publish(body: bytes, origin: str) -> tuple[Message, tuple[Share, ...]]:
    """A PUBLISH frame from ``origin`` back into a message, not journaled here (seq: the
    origin's), and the shares it is given to here."""
    try:
        seq, ts_us, qos, retain = _PUBLISH.unpack_from(body, 0)
        # The four strings unrolled (per crossing publish: the hot path).
        pos = _PUBLISH.size + 2
        end = pos + _U16.unpack_from(body, pos - 2)[0]
        tenant = body[pos:end].decode()
        pos = end + 2
        end = pos + _U16.unpack_from(body, pos - 2)[0]
        client_id = body[pos:end].decode()
        pos = end + 2
        end = pos + _U16.unpack_from(body, pos - 2)[0]
        topic = body[pos:end].decode()
        pos = end + 2
        end = pos + _U16.unpack_from(body, pos - 2)[0]
        content_type = body[pos:end].decode()
        pos = end
        qos_value = _QOS[qos]
        if body[pos : pos + 3] == _PLAIN_END and tenant and topic:
            # No flags, no user properties: the usual message, as the general path builds it.
            message = Message(
                tenant,
                topic,
                body[pos + 3 :],
                qos_value,
                bool(retain),
                client_id,
                ts_us,
                NO_PROPERTIES,
                seq,
                origin,
            )
            return message, ()
        flags = body[pos]
        if flags > 7:
            raise MeshProtocolError(f"PUBLISH: unknown flags {flags:#x}")
        pos += 1
        expiry = None
        if flags & 2:
            (expiry,) = _U32.unpack_from(body, pos)
            pos += 4
        named: list[str] = []
        if flags & 4:
            named, pos = _pairs_of_strings(body, pos)
        pairs, pos = _pairs_of_strings(body, pos)
        payload = body[pos:]
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
        raise MeshProtocolError(f"PUBLISH: malformed ({exc})") from exc
    if not topic or not tenant:
        raise MeshProtocolError("PUBLISH: empty topic or tenant")
    shares = tuple(zip(named[::2], named[1::2], strict=True))
    if flags & 4 and not shares:
        raise MeshProtocolError("PUBLISH: an empty list of shares")
    props = NO_PROPERTIES
    user = tuple(zip(pairs[::2], pairs[1::2], strict=True))
    if flags & 3 or user:
        props = Properties(
            content_type=content_type if flags & 1 else None,
            message_expiry_interval=expiry,
            user_properties=user,
        )
    message = Message(
        tenant, topic, payload, qos_value, bool(retain), client_id, ts_us, props, seq, origin
    )
    return message, shares


def _pairs_of_strings(body: bytes, pos: int) -> tuple[list[str], int]:
    """A u16 count of pairs at ``pos``, then their strings; and where they end."""
    (count,) = _U16.unpack_from(body, pos)
    pos += 2
    strings = []
    for _ in range(count * 2):
        (n,) = _U16.unpack_from(body, pos)
        strings.append(body[pos + 2 : pos + 2 + n].decode())
        pos += 2 + n
    return strings, pos


# -- routing state -----------------------------------------------------------------------------


class Interest:
    """The filters this node's sessions hold, per tenant, counted (a filter once per node),
    and the shares they are members of (broker_edge.meshgroups) with their connected members:
    the router reports every trie entry added or removed and every change of a share; changes
    wait in ``changes`` and ``share_changes`` until the mesh sends them, and ``on_change`` is
    told there are some."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.changes: dict[tuple[str, str], bool] = {}  # (tenant, filter) -> wanted now
        # (tenant, group, filter) -> connected members (None: not a share here any more)
        self.shares: dict[tuple[str, str, str], int] = {}
        self.share_changes: dict[tuple[str, str, str], int | None] = {}
        self.on_change: Callable[[], None] = _nothing
        # When each filter got its first subscriber (µs since the epoch, by ``clock``).
        self.since: dict[tuple[str, str], int] = {}
        self.clock: Callable[[], int] = _zero

    def add(self, tenant: str, topic_filter: str) -> None:
        key = (tenant, topic_filter)
        count = self.counts.get(key, 0)
        self.counts[key] = count + 1
        if not count:
            self.since[key] = self.clock()
            self._changed(key, True)

    def remove(self, tenant: str, topic_filter: str) -> None:
        key = (tenant, topic_filter)
        count = self.counts.get(key, 0)
        if count <= 1:
            self.counts.pop(key, None)
            self.since.pop(key, None)
            if count:
                self._changed(key, False)
        else:
            self.counts[key] = count - 1

    def share(self, tenant: str, group: str, topic_filter: str, online: int | None) -> None:
        """``$share/{group}/{topic_filter}`` of ``tenant`` has ``online`` connected members
        here now (None: no member at all any more)."""
        key = (tenant, group, topic_filter)
        if self.shares.get(key) == online:
            return
        if online is None:
            del self.shares[key]
        else:
            self.shares[key] = online
        self.share_changes[key] = online
        self.on_change()

    def _changed(self, key: tuple[str, str], wanted: bool) -> None:
        if self.changes.get(key, not wanted) is wanted:
            return
        if key in self.changes:
            del self.changes[key]  # added and removed again before it was sent: no change
        else:
            self.changes[key] = wanted
        self.on_change()

    def snapshot(self) -> list[bytes]:
        """INTEREST frames of every filter and share held now, with when each filter was
        subscribed (for a new link: see :class:`CatchUp`)."""
        return _frames(dict.fromkeys(self.counts, True), dict(self.shares), self.since)

    def take_changes(self) -> list[bytes]:
        """INTEREST frames of the changes since the last call."""
        changes, self.changes = self.changes, {}
        share_changes, self.share_changes = self.share_changes, {}
        return _frames(changes, share_changes)


def _frames(
    changes: dict[tuple[str, str], bool],
    shares: dict[tuple[str, str, str], int | None],
    since: dict[tuple[str, str], int] | None = None,
) -> list[bytes]:
    by_tenant: dict[str, InterestChange] = {}

    def of(tenant: str) -> InterestChange:
        change = by_tenant.get(tenant)
        if change is None:
            change = by_tenant[tenant] = InterestChange(tenant, [], [])
        return change

    for (tenant, topic_filter), wanted in changes.items():
        change = of(tenant)
        (change.add if wanted else change.remove).append(topic_filter)
        if since is not None:
            change.at[topic_filter] = since.get((tenant, topic_filter), 0)
    for (tenant, group, topic_filter), online in shares.items():
        change = of(tenant)
        if online is None:
            change.unshared.append((group, topic_filter))
        else:
            change.shares.append((group, topic_filter, online))
    return [
        interest_frame(c.tenant, c.add, c.remove, c.shares, c.unshared, c.at)
        for c in by_tenant.values()
    ]


class PeerRoutes:
    """What one peer's sessions subscribe to, per tenant (told by the peer): filters, and
    shares (broker_edge.meshgroups).

    A new link's whole set (:meth:`begin` ... :meth:`end`) is gathered beside the filters held
    before, which keep matching until it replaces them."""

    def __init__(self) -> None:
        self.tenants: dict[str, TopicTrie[int, None]] = {}
        self._filters: dict[str, set[str]] = {}  # the same, as filters (to read)
        self.shares = PeerShares()
        self.incoming: PeerRoutes | None = None  # the set being told, while it is
        self.at: dict[tuple[str, str], int] = {}  # a set's filters: when each was subscribed

    def begin(self) -> None:
        """A link's whole set comes next (a set begun before and not ended is dropped)."""
        self.incoming = PeerRoutes()

    def end(self) -> dict[tuple[str, str], int]:
        """The whole set was told: it replaces the filters held before. Returns the filters
        of the set not held before, with when each was subscribed (those the set timed)."""
        incoming = self.incoming
        if incoming is None:
            raise MeshProtocolError("SYNCED without a link's set of filters before it")
        held = self._filters
        new = {
            (tenant, f): ts
            for (tenant, f), ts in incoming.at.items()
            if f in incoming._filters.get(tenant, ()) and f not in held.get(tenant, ())
        }
        self.tenants, self._filters, self.incoming = incoming.tenants, incoming._filters, None
        self.shares = incoming.shares
        return new

    def filters(self) -> dict[str, list[str]]:
        """The peer's filters per tenant, sorted."""
        return {tenant: sorted(held) for tenant, held in self._filters.items()}

    def apply(
        self,
        tenant: str,
        add: Iterable[str],
        remove: Iterable[str],
        at: dict[str, int] | None = None,
    ) -> None:
        """Raises MeshProtocolError for a filter that is not one. ``at``: when filters of a
        link's whole set were subscribed (kept while it is told)."""
        if self.incoming is not None:
            self.incoming.apply(tenant, add, remove)
            if at:
                self.incoming.at.update({(tenant, f): ts for f, ts in at.items()})
            return
        trie = self.tenants.get(tenant)
        if trie is None:
            trie = self.tenants[tenant] = TopicTrie()
        held = self._filters.setdefault(tenant, set())
        for topic_filter in remove:
            trie.remove(topic_filter, 0)
            held.discard(topic_filter)
        for topic_filter in add:
            try:
                trie.add(topic_filter, 0, None)
            except InvalidTopic as exc:
                raise MeshProtocolError(f"INTEREST: bad filter {topic_filter!r}") from exc
            held.add(topic_filter)
        if not len(trie):
            del self.tenants[tenant]
            del self._filters[tenant]

    def wants(self, tenant: str, topic: str) -> bool:
        trie = self.tenants.get(tenant)
        if trie is not None and trie.match(topic):
            return True
        return self.incoming is not None and self.incoming.wants(tenant, topic)

    def apply_shares(
        self, tenant: str, shares: Iterable[tuple[str, str, int]], unshared: Iterable[Share]
    ) -> None:
        """Shares set (with their connected members) and dropped; raises MeshProtocolError
        for a share that is not one."""
        if self.incoming is not None:
            self.incoming.apply_shares(tenant, shares, unshared)
            return
        held = self.shares
        try:
            for group, topic_filter in unshared:
                held.drop(tenant, group, topic_filter)
            for group, topic_filter, online in shares:
                held.set(tenant, group, topic_filter, online)
        except (InvalidTopic, ValueError) as exc:
            raise MeshProtocolError(f"INTEREST: bad share ({exc})") from exc

    def has_shares(self, tenant: str) -> bool:
        incoming = self.incoming
        return self.shares.has(tenant) or (incoming is not None and incoming.has_shares(tenant))

    def shared(self, tenant: str, topic: str) -> list[tuple[Share, int]]:
        """The peer's shares matching ``topic``, with their connected members there (a new
        link's set, while it is told, beside what it had)."""
        found = self.shares.matching(tenant, topic)
        if self.incoming is not None:
            newer = self.incoming.shared(tenant, topic)
            if newer:
                return list({**dict(found), **dict(newer)}.items())
        return found


class CatchUp:
    """Filters a peer subscribed while its link to this origin was down (told when the link
    came up, with when each was subscribed, and the highest seq of this origin it had): what
    this node's journal holds after that seq that they match and that was published since goes
    to the peer as if the link had been up: merged into its Unacked, in seq order."""

    def __init__(self, seen: int, new: dict[tuple[str, str], int]) -> None:
        self.seen = seen
        self.tries: dict[str, TopicTrie[str, int]] = {}
        for (tenant, topic_filter), since in new.items():
            trie = self.tries.get(tenant)
            if trie is None:
                trie = self.tries[tenant] = TopicTrie()
            trie.add(topic_filter, topic_filter, since)

    def wants(self, message: Message) -> bool:
        """Whether the peer is due ``message`` (a record of this node's journal after
        ``seen``) by its new filters alone (a retained one went to it anyway)."""
        if not message.qos or message.retain or message.seq <= self.seen:
            return False
        trie = self.tries.get(message.tenant)
        if trie is None or reach(message.tenant, message.topic) != FILTERS:
            return False
        return any(since <= message.ts_us for _, since in trie.match(message.topic))


class Unacked:
    """QoS 1/2 frames sent (or waiting) to one peer until it acknowledges them, by seq; at
    most ``limit`` frames and ``limit_bytes`` bytes (beyond, the oldest are given up)."""

    def __init__(self, limit: int = MAX_UNACKED, limit_bytes: int = MAX_UNACKED_BYTES) -> None:
        self.limit = limit
        self.limit_bytes = limit_bytes
        self.frames: OrderedDict[int, bytes] = OrderedDict()
        self.bytes = 0
        self.dropped = 0  # the oldest given up because the peer was away too long

    def add(self, seq: int, data: bytes) -> None:
        frames = self.frames
        frames[seq] = data
        self.bytes += len(data)
        while frames and (len(frames) > self.limit or self.bytes > self.limit_bytes):
            _, oldest = frames.popitem(last=False)
            self.bytes -= len(oldest)
            self.dropped += 1

    def merge(self, frames: dict[int, bytes]) -> None:
        """Frames of seqs below some held already (a rescan of the journal: :class:`CatchUp`):
        added, and the whole kept in seq order (the receiver's Dedup drops a lower seq sent
        after a higher one)."""
        if not frames:
            return
        merged = sorted([*self.frames.items(), *frames.items()])
        self.frames = OrderedDict()
        self.bytes = 0
        for seq, data in merged:
            self.add(seq, data)

    def ack(self, seqs: Iterable[int]) -> None:
        for seq in seqs:
            data = self.frames.pop(seq, None)
            if data is not None:
                self.bytes -= len(data)

    def give_up(self, upto: int) -> int:
        """Drop every frame at or below ``upto`` (the journal no longer holds them, or the peer
        is forgotten); how many."""
        frames = self.frames
        gone = 0
        while frames:
            seq, data = next(iter(frames.items()))
            if seq > upto:
                break
            del frames[seq]
            self.bytes -= len(data)
            gone += 1
        self.dropped += gone
        return gone

    def acked(self, upto: int) -> int:
        """The highest seq at or below ``upto`` at or below which nothing waits here."""
        for oldest in self.frames:
            return min(oldest - 1, upto)
        return upto

    def __len__(self) -> int:
        return len(self.frames)


class Dedup:
    """The highest QoS 1/2 seq delivered per origin: an origin sends those in seq order, and
    sends again only what was not acknowledged, so anything at or below it was delivered
    already. Seqs are the origin's durable journal seqs, so this outlives a restart of either
    end (the receiver's is restored from its snapshot: :meth:`restore`)."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}
        self.dropped = 0

    def restore(self, delivered: dict[str, int]) -> None:
        self.last = dict(delivered)

    def delivered(self, origin: str, seq: int) -> None:
        """``seq`` of ``origin`` was delivered here (a session log record at restore:
        broker_edge.receipts)."""
        if seq > self.last.get(origin, 0):
            self.last[origin] = seq

    def origin_at(self, origin: str, durable_seq: int) -> bool:
        """``origin`` says its journal's newest durable seq (WELCOME): if this delivered a
        higher one, that journal started over (a new data dir): its seqs are forgotten. True
        then."""
        if self.last.get(origin, 0) <= durable_seq:
            return False
        del self.last[origin]
        return True

    def fresh(self, origin: str, seq: int) -> bool:
        if seq <= self.last.get(origin, 0):
            self.dropped += 1
            return False
        self.last[origin] = seq
        return True


class AckGate:
    """On a receiver: QoS 1/2 seqs delivered to persistent sessions (or delivered already) and
    not yet acknowledged to their origin, until a snapshot holding them is durable."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}  # origin -> seqs, in the order they arrived

    def hold(self, origin: str, seq: int) -> None:
        self.held.setdefault(origin, []).append(seq)

    def release(self, covered: dict[str, int]) -> dict[str, list[int]]:
        """What a durable snapshot covers (its Dedup: the highest seq delivered per origin)
        may be acknowledged now: those seqs per origin."""
        released: dict[str, list[int]] = {}
        for origin, seqs in list(self.held.items()):
            upto = covered.get(origin, 0)
            done = [seq for seq in seqs if seq <= upto]
            if not done:
                continue
            released[origin] = done
            rest = [seq for seq in seqs if seq > upto]
            if rest:
                self.held[origin] = rest
            else:
                del self.held[origin]
        return released

    def __bool__(self) -> bool:
        return bool(self.held)


class Absences:
    """Since when each peer has been away, and which are forgotten (see the theory of
    operation, "Peers gone for good"); wall-clock microseconds, given, never read here.

    A peer is away while its link to this origin (the one it dialed, where its acks come) is
    down, since it was last up; one away longer than ``expiry_us`` (0: never) is forgotten,
    but not before this edge has run ``min(grace_us, expiry_us)`` since ``started_us``: a peer
    that is up had its chance to dial in again after this edge's own downtime."""

    def __init__(self, expiry_us: int, started_us: int, grace_us: int) -> None:
        self.expiry_us = expiry_us
        self.not_before = started_us + min(grace_us, expiry_us)
        self.since: dict[str, int] = {}  # by node, for the peers away: since when
        self.forgotten: set[str] = set()

    def restore(self, node: str, seen_us: int | None, forgotten: bool, now_us: int) -> None:
        """A peer of a snapshot, last seen up at ``seen_us`` (None: not known, as in a snapshot
        of an earlier release: away from now on), forgotten still if it was."""
        self.since[node] = now_us if seen_us is None else min(seen_us, now_us)
        if forgotten:
            self.forgotten.add(node)

    def up(self, node: str) -> bool:
        """``node``'s link is up; True if it was forgotten (it is not any more)."""
        self.since.pop(node, None)
        if node not in self.forgotten:
            return False
        self.forgotten.discard(node)
        return True

    def down(self, node: str, now_us: int) -> None:
        self.since.setdefault(node, now_us)

    def seen(self, node: str, now_us: int) -> int:
        """When ``node`` was last up (now if it is)."""
        return self.since.get(node, now_us)

    def expire(self, now_us: int) -> list[tuple[str, int]]:
        """The peers forgotten now, each with how long it has been away."""
        if not self.expiry_us or now_us < self.not_before:
            return []
        gone = [
            (node, now_us - since)
            for node, since in sorted(self.since.items())
            if node not in self.forgotten and now_us - since > self.expiry_us
        ]
        self.forgotten.update(node for node, _ in gone)
        return gone


class MeshStateError(EdgeError):
    """A snapshot's mesh state is not one (the snapshot is corrupt)."""


@dataclass(frozen=True, slots=True)
class PeerState:
    """What an origin keeps of one peer across its restarts: every QoS 1/2 message at or below
    ``acked`` the peer was due is acknowledged; ``filters``: per tenant, what it wanted;
    ``shares``: per tenant, its shares as ``[group, filter, connected members]``; ``seen_us``:
    when its link was last up (wall clock; None: not known); ``forgotten``: away too long
    (:class:`Absences`)."""

    acked: int
    filters: dict[str, list[str]]
    shares: dict[str, list[list[str | int]]] = dataclasses.field(default_factory=dict)
    seen_us: int | None = None
    forgotten: bool = False

    def routes(self) -> PeerRoutes:
        """The filters as the routes of the peer (MeshStateError for a bad one)."""
        routes = PeerRoutes()
        try:
            for tenant, filters in self.filters.items():
                routes.apply(tenant, filters, ())
            for tenant, shares in self.shares.items():
                routes.apply_shares(tenant, [(str(g), str(f), int(n)) for g, f, n in shares], ())
        except MeshProtocolError as exc:
            raise MeshStateError(str(exc)) from exc
        return routes


@dataclass(frozen=True, slots=True)
class MeshState:
    """One edge's mesh state in its snapshot (see the theory of operation): its peers as an
    origin, and as a receiver the highest seq delivered per origin."""

    peers: dict[str, PeerState]
    delivered: dict[str, int]

    def doc(self) -> dict[str, object]:
        peers = {
            node: {
                "acked": peer.acked,
                "filters": peer.filters,
                "shares": peer.shares,
                "seen": peer.seen_us,
                "forgotten": peer.forgotten,
            }
            for node, peer in sorted(self.peers.items())
        }
        return {"peers": peers, "delivered": dict(sorted(self.delivered.items()))}

    @classmethod
    def of(cls, doc: object) -> MeshState:
        """The state a snapshot holds (an empty one for a snapshot without any)."""
        if doc is None:
            return cls({}, {})
        if not isinstance(doc, dict):
            raise MeshStateError("mesh: not an object")
        peers = doc.get("peers", {})
        delivered = doc.get("delivered", {})
        if not isinstance(peers, dict) or not isinstance(delivered, dict):
            raise MeshStateError("mesh: peers and delivered must be objects")
        return cls({str(n): _peer_state(n, p) for n, p in peers.items()}, _seqs(delivered))

    def floor(self) -> int | None:
        """Where the journal must be read from to rebuild every peer's Unacked (None: no
        peer it keeps anything for: a forgotten one is due nothing)."""
        return min((peer.acked for peer in self.peers.values() if not peer.forgotten), default=None)


def _peer_state(node: object, doc: object) -> PeerState:
    if not isinstance(doc, dict):
        raise MeshStateError(f"mesh: peer {node!r}: not an object")
    acked = doc.get("acked")
    filters = doc.get("filters")
    if (
        type(acked) is not int
        or acked < 0
        or not isinstance(filters, dict)
        or not all(
            isinstance(held, list) and all(isinstance(f, str) for f in held)
            for held in filters.values()
        )
    ):
        raise MeshStateError(f"mesh: peer {node!r}: expected acked (a seq) and filters")
    shares = doc.get("shares", {})  # a snapshot of link protocol 3 has none
    if not isinstance(shares, dict) or not all(
        isinstance(held, list) and all(_is_share(share, 3) for share in held)
        for held in shares.values()
    ):
        raise MeshStateError(f"mesh: peer {node!r}: shares must be [group, filter, n] lists")
    seen = doc.get("seen")  # a snapshot of an earlier release has neither
    forgotten = doc.get("forgotten", False)
    if (seen is not None and (type(seen) is not int or seen < 0)) or type(forgotten) is not bool:
        raise MeshStateError(f"mesh: peer {node!r}: seen must be a time, forgotten true/false")
    return PeerState(
        acked,
        {str(tenant): list(held) for tenant, held in filters.items()},
        {str(tenant): list(held) for tenant, held in shares.items()},
        seen,
        forgotten,
    )


def _seqs(doc: dict[object, object]) -> dict[str, int]:
    seqs: dict[str, int] = {}
    for origin, seq in doc.items():
        if type(seq) is not int or seq < 0:
            raise MeshStateError(f"mesh: delivered from {origin!r}: not a seq")
        seqs[str(origin)] = seq
    return seqs


def _nothing() -> None:
    pass


def _zero() -> int:
    return 0


__all__ = [
    "ACK",
    "AUTH",
    "CHALLENGE",
    "CLAIM",
    "HELLO",
    "INTEREST",
    "MAGIC",
    "PING",
    "PUBLISH",
    "REFUSE",
    "RETAINED",
    "SESSION",
    "SYNCED",
    "TAKEN",
    "WELCOME",
    "Absences",
    "AckGate",
    "CatchUp",
    "Dedup",
    "FrameBuffer",
    "Interest",
    "InterestChange",
    "MeshProtocolError",
    "MeshState",
    "MeshStateError",
    "PeerRoutes",
    "PeerState",
    "Unacked",
    "frame",
    "goes_to",
    "interest_doc",
    "publish_frame",
    "reach",
    "retained_frame",
]
