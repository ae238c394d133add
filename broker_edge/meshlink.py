"""The edge mesh's wiring (asyncio): links dialed with backoff, links accepted, frames handled.

The protocol, the routing state and why it is shaped so are in :mod:`broker_edge.mesh` (pure).
Here: one :class:`Link` per TCP connection (dialed by this edge, or handed over by the listener
when a connection opens with the link magic), and :class:`Mesh`, which owns them and talks to
the broker: it forwards the node's publishes (``Broker.mesh.forward``; QoS 1/2 once their
journal record is durable), delivers the peers' (``Broker.deliver_remote``), acknowledges them
when the node's snapshots hold them (:meth:`Mesh.covered`), tells the peers what this node's
sessions want, rebuilds what its peers had not acknowledged from the journal when the node
starts (:meth:`Mesh.restore`, :meth:`Mesh.replay`), sends a peer whose link comes up every
retained message and tombstone that crosses to it (:meth:`Mesh._send_retained`), publishes
``link_up`` / ``link_down`` / ``link_refused`` in the operator's ``$log`` and keeps each peer's
state for ``$SYS/broker/mesh/peers/{HOST:PORT}``, and forgets the peers away longer than
``edge.peer_expiry_hours`` (:meth:`Mesh.expire`, ``peer_forgotten``).

Writes are batched: a link's frames wait in its ``out`` until the end of the loop iteration,
then go in one ``transport.write``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import typing
from collections import OrderedDict, deque
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

from broker_edge import handover, mesh
from broker_edge.handover import Assembly, Claim, Version, Waiting
from broker_edge.logtext import printable, truncated
from broker_edge.mesh import (
    Absences,
    AckGate,
    Dedup,
    FrameBuffer,
    Interest,
    MeshProtocolError,
    MeshState,
    MeshStateError,
    PeerRoutes,
    PeerState,
    Unacked,
)
from broker_edge.meshgroups import Share, ShareChoice
from broker_edge.message import Message, message_from_row
from broker_edge.packets import QoS
from broker_edge.session import Session
from broker_edge.settings import EdgeSettings
from broker_edge.tenants import OPERATOR_TENANT
from broker_edge.topics import parse_subscription_filter
from ingest.journal import JournalReader

if typing.TYPE_CHECKING:
    from broker_edge.broker import Broker

log = logging.getLogger(__name__)

# Redial delays: doubled after each failed attempt up to the maximum, +-20 % jitter.
BACKOFF_MIN = 0.2
BACKOFF_MAX = 10.0

# Each end of an admitted link sends a PING this often (seconds) and closes a link it heard
# nothing on for three times as long (a peer gone without a FIN: its host died, a cable).
LINK_KEEPALIVE = 5.0

# How long an accepted link's frames wait for the dialer's whole set of filters (Mesh._catch_up)
# at most: a dialer sends it at once, but one that never does must not stop the link.
SYNC_WAIT = 5.0

# A link's states as $SYS shows them; a peer away too long (its inbound link) is forgotten.
CONNECTING, UP, DOWN, REFUSED = "connecting", "up", "down", "refused"
FORGOTTEN = "forgotten"


class Link(asyncio.Protocol):
    """One link: ``outbound`` when this edge dialed it (it receives publishes and sends its
    interest and acks), else accepted (it sends publishes, receives interest and acks)."""

    def __init__(self, owner: Mesh, outbound: bool, address: str) -> None:
        self.mesh = owner
        self.outbound = outbound
        self.address = address  # the peer's HOST:PORT (dialed) or its socket's (accepted)
        self.transport: asyncio.Transport | None = None
        self.frames = FrameBuffer(mesh.MAX_HELLO_FRAME)
        self.node: str | None = None  # the other end's node id, once admitted
        # The handshake (broker_edge.mesh): our challenge; accepted: the HELLO; dialed: the
        # acceptor's node once it proved the token.
        self.nonce = mesh.nonce()
        self.hello: mesh.Hello | None = None
        self.proven: str | None = None
        self.up = False
        self.out: list[bytes] = []
        # Accepted, until the dialer's whole set of filters is here and what it missed is
        # merged into its Unacked (Mesh._catch_up): what goes to it waits here, in order.
        self.held: list[bytes] | None = None
        self.told = False  # accepted: the dialer's whole set of filters is here (SYNCED)
        self.returning = False  # accepted: the dialer was forgotten (Mesh.expire) till now
        self.acks: list[int] = []
        self.sessions = Assembly()  # dialed: the SESSION frames of an answer being read
        self._loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = self._loop.create_future()
        self._magic = b"" if outbound else mesh.MAGIC  # what is still to be read of it
        self.opened = self.heard = self._loop.time()  # connected; last read
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)
        first = min(LINK_KEEPALIVE, self.mesh.connect_timeout)  # the admission deadline
        self._timer = self._loop.call_later(first, self._tick)
        if self.outbound:
            self.mesh.dialed(self)

    def _tick(self) -> None:
        """Keepalive: PING the other end; close a link that went silent, or that was not
        admitted within the CONNECT timeout (an unknown peer holds nothing for long)."""
        now = self._loop.time()
        if now - self.heard > 3 * LINK_KEEPALIVE or (
            not self.up and now - self.opened > self.mesh.connect_timeout
        ):
            log.warning(
                "link %s (%s): silent or not admitted: closing", self.node or "?", self.address
            )
            self.close()
            return
        if self.up:
            self.send_now(mesh.PING_FRAME)
        delay = LINK_KEEPALIVE if self.up else self.opened + self.mesh.connect_timeout - now
        self._timer = self._loop.call_later(max(delay, 0.01), self._tick)

    def congested(self) -> bool:
        """Its socket buffer is over the mesh's high-water mark (QoS 0 is dropped then)."""
        transport = self.transport
        return transport is not None and transport.get_write_buffer_size() > self.mesh.high_water

    def data_received(self, data: bytes) -> None:
        self.heard = self._loop.time()
        if self._magic:
            n = min(len(data), len(self._magic))
            if data[:n] != self._magic[:n]:
                self.close()
                return
            self._magic = self._magic[n:]
            data = data[n:]
        frames = self.frames
        frames.push(data)
        try:
            # One at a time: a WELCOME raises the frame bound for what follows it in this read.
            while (one := frames.pop()) is not None:
                self.mesh.handle(self, *one)
                if self.transport is None or self.transport.is_closing():
                    return
        except MeshProtocolError as exc:
            log.warning("link %s (%s): %s: closing", self.node or "?", self.address, exc)
            self.close()
            return
        except Exception:
            # Our bug, not the peer's: close this link (it comes back), keep the node serving.
            log.exception("internal error on link %s (%s)", self.node or "?", self.address)
            self.close()
            return
        self.mesh.after_read(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.mesh.lost(self)
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self, data: bytes) -> None:
        if self.held is not None:
            self.held.append(data)
            return
        self.send_now(data)

    def send_now(self, data: bytes) -> None:
        """Send ``data`` even while the link's frames are held (a WELCOME, a PING)."""
        if not self.out:
            self.mesh.dirty.add(self)
            self.mesh.want_flush()
        self.out.append(data)

    def release(self) -> list[bytes]:
        """Stop holding the link's frames; returns those held."""
        held, self.held = self.held or [], None
        return held

    def write_out(self) -> None:
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def close(self) -> None:
        self.write_out()
        if self.transport is not None:
            self.transport.close()


class Mesh:
    """This edge's links to its peers. ``token()``: what links authenticate with now (None:
    none are taken, none dialed)."""

    def __init__(
        self,
        broker: Broker,
        settings: EdgeSettings,
        token: Callable[[], str | None],
    ) -> None:
        self.broker = broker
        self.node_id = settings.node_id
        self.addresses = settings.peer_addresses
        self.token = token
        # Peers' frames may carry a whole publish: as big as a packet, plus topic and names.
        self.max_frame = settings.max_packet_size + 2**18
        self.connect_timeout = settings.connect_timeout
        self.high_water = settings.write_buffer_high_water * 4
        # Set by the node: the newest durable seq of its journal (told in WELCOME).
        self.durable_seq: Callable[[], int] = _zero
        self.interest = Interest()
        self.interest.on_change = self.want_flush
        self.interest.clock = broker.wall_clock_us
        self.journal_dir = settings.journal_root / settings.node_id
        # Journal rescans for peers' filters subscribed while their link was down, per peer
        # (Mesh._catch_up): its link's frames are held until none is running.
        self.catching: dict[str, int] = {}
        self.caught_up = 0  # QoS 1/2 messages a rescan found for such filters
        self._rescan_from: dict[str, int] = {}  # ... the lowest seq it reads after, per peer
        self._rescans: set[asyncio.Task[None]] = set()
        # By peer node, on the origin's side: what it wants, what it has not acknowledged.
        self.routes: dict[str, PeerRoutes] = {}
        self.unacked: dict[str, Unacked] = {}
        self.inbound: dict[str, Link] = {}  # the link each peer dialed (its publishes go there)
        self.outbound: dict[str, Link] = {}  # the links this edge dialed, by address
        self.states: dict[str, str] = {f"{h}:{p}": CONNECTING for h, p in self.addresses}
        self.inbound_states: dict[str, str] = {}  # the links peers dialed, by their node
        # QoS 1/2 publishes for peers waiting for their journal record to be durable, by seq.
        self.pending: deque[int] = deque()
        self.dedup = Dedup()
        self.gate = AckGate()  # on the receiver's side: acks waiting for a durable snapshot
        # A peer's filters or away clock changed since the last snapshot (the node snapshots
        # soon).
        self.state_changed = False
        # Peers away, and forgotten once away longer than edge.peer_expiry_hours (wall clock).
        self.absences = Absences(
            round(settings.peer_expiry_hours * 3600e6),
            broker.wall_clock_us(),
            round(mesh.START_GRACE * 1e6),
        )
        # While the node restores: the journal records after these seqs are each peer's due.
        self._replay_after: dict[str, int] = {}
        self.replayed = 0  # QoS 1/2 messages taken back from the journal for peers at start
        self.forwarded = 0  # frames of publishes sent to peers
        self.received = 0  # publishes from peers delivered here
        self.congested = 0  # QoS 0 publishes not sent to a peer whose link was backed up
        self.retained_sent = 0  # retained messages and tombstones sent to links that came up
        self.retained_taken = 0  # ... received from peers' links that came up
        # Shared groups across the mesh (broker_edge.meshgroups): which edge gets a message.
        self.choice = ShareChoice()
        self.shares_given = 0  # a publish's shared group given to a peer's members
        self.shares_dropped = 0  # ... given here, by a peer, to a group this node no longer has
        # CONNECTs here waiting for the peers' answers to their claims, by (tenant, client id):
        # the claim, what to call with the outcome, the deadline's timer.
        self.waiting: dict[tuple[str, str], tuple[Waiting, Done, asyncio.TimerHandle]] = {}
        self.sessions_in = 0  # sessions peers handed to this edge
        self.sessions_out = 0  # ... this edge handed to peers
        self.sessions_cut = 0  # queued messages too big for a SESSION frame, not handed over
        self.relays_lost = 0  # messages a stand-in took for a peer whose link was down then
        # Handed over and not yet in a durable snapshot of the claimer, by (its node, tenant,
        # client id, claim version, late: a stand-in's): the session documents, taken back if
        # a link with it goes down first.
        self.handed: dict[tuple[str, str, str, Version, bool], dict[str, Any]] = {}
        self.taken_back = 0
        # Handed here: TAKEN frames for the peers once a snapshot holding them is durable, and
        # how many of them the snapshot being written holds.
        self.taking: list[tuple[str, bytes]] = []
        self._taking_covered = 0
        self.on_state: Callable[[], None] = _nothing  # a peer's state changed ($SYS now)
        self.dirty: set[Link] = set()
        self._flush_soon = False
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for host, port in self.addresses:
            self._tasks.append(loop.create_task(self._dial(host, port), name=f"link {host}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for link in [*self.inbound.values(), *self.outbound.values()]:
            link.close()
        await asyncio.sleep(0)  # their connection_lost (link_down) while the journal is open

    async def _dial(self, host: str, port: int) -> None:
        address = f"{host}:{port}"
        delay = BACKOFF_MIN
        while True:
            if self.token() is not None and await self._link_once(host, port, address):
                delay = BACKOFF_MIN  # it was up: come back fast
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))  # noqa: S311 (jitter)
            delay = min(delay * 2, BACKOFF_MAX)

    async def _link_once(self, host: str, port: int, address: str) -> bool:
        """Dial ``address`` and serve the link until it closes; True if it was up."""
        link = Link(self, True, address)
        try:
            await asyncio.get_running_loop().create_connection(lambda: link, host, port)
        except OSError as exc:
            log.debug("link to %s: %s", address, exc)
            return False
        await link.closed
        return link.node is not None

    # -- links in and out ----------------------------------------------------------------------

    def accept(self, transport: Any, peer: str, data: bytes) -> None:
        """The listener's connection from ``peer`` opened with the link magic: a link now."""
        link = Link(self, False, peer)
        transport.set_protocol(link)
        link.connection_made(transport)
        link.data_received(data)

    def dialed(self, link: Link) -> None:
        self.outbound[link.address] = link
        link.send(mesh.hello(self.node_id, link.nonce))

    def lost(self, link: Link) -> None:
        self.dirty.discard(link)
        node = link.node
        if link.outbound:
            if self.outbound.get(link.address) is link:
                del self.outbound[link.address]
            if node is not None and link.up:
                self._unanswered(node)
                self._take_back(node)
            if link.up:
                self._set_state(link.address, DOWN)
        elif node is not None and self.inbound.get(node) is link:
            del self.inbound[node]
            self.inbound_states[node] = DOWN
            self.absences.down(node, self.broker.wall_clock_us())
            self.state_changed = True  # when it was last up: in the next snapshot
            self.on_state()
            self._unanswered(node)
            self._take_back(node)
        if link.up:
            link.up = False
            direction = "out" if link.outbound else "in"
            log.info("link %s %s (%s) down", direction, node, link.address)
            self._log("link_down", node or "", link.address, direction)

    def handle(self, link: Link, kind: int, body: bytes) -> None:
        if link.outbound:
            self._handle_outbound(link, kind, body)
        else:
            self._handle_inbound(link, kind, body)

    def _handle_outbound(self, link: Link, kind: int, body: bytes) -> None:
        if kind == mesh.PING and link.up:
            pass  # heard: that is all
        elif kind == mesh.PUBLISH and link.up:
            assert link.node is not None
            message, shares = mesh.parse_publish(body, link.node)
            self._check_reach(message, live=True)
            self._received(link, link.node, message, shares)
        elif kind == mesh.SESSION and link.up:
            assert link.node is not None
            self._session(link.node, link.sessions.feed(body))
        elif kind == mesh.CLAIM and link.up:
            assert link.node is not None
            self._claimed(link.node, handover.parse_claim(body))
        elif kind == mesh.TAKEN and link.up:
            assert link.node is not None
            self.handed.pop((link.node, *handover.parse_taken(body)), None)
        elif kind == mesh.RETAINED and link.up:
            message = mesh.parse_retained(body)
            self._check_reach(message, live=False)
            self.retained_taken += 1
            self.broker.retain_remote(message)
        elif kind == mesh.CHALLENGE and link.proven is None and not link.up:
            self._answer(link, *mesh.parse_challenge(body))
        elif kind == mesh.WELCOME and link.proven is not None and not link.up:
            node, durable_seq = mesh.parse_welcome(body)
            if node != link.proven:
                raise MeshProtocolError(f"WELCOME from {node!r}, not {link.proven!r}")
            link.node = node
            link.up = True
            link.frames.max_frame = self.max_frame
            if self.dedup.origin_at(node, durable_seq):
                log.warning(
                    "link out to %s: its journal ends at seq %d, before what it sent here: "
                    "it started over, its seqs are taken as new",
                    node,
                    durable_seq,
                )
            for data in self.interest.snapshot():
                link.send(data)
            link.send(mesh.synced(self.dedup.last.get(node, 0)))
            self._reclaim(node)
            log.info("link out to %s (%s) up", node, link.address)
            self._log("link_up", node, link.address, "out")
            self._set_state(link.address, UP)
        elif kind == mesh.REFUSE and not link.up:
            log.warning("link to %s refused: %s", link.address, printable(mesh.reason_of(body)))
            self._set_state(link.address, REFUSED)
            link.close()
        else:
            raise MeshProtocolError(f"unexpected frame kind {kind}")

    def _check_reach(self, message: Message, *, live: bool) -> None:
        """A peer's message must be one that goes to this node (a peer sends nothing else)."""
        topic = message.topic
        if topic[0] != "$":
            return
        if not mesh.goes_to(message.tenant, topic, self.node_id):
            kind = "PUBLISH" if live else "RETAINED"
            raise MeshProtocolError(f"{kind} on {topic!r}, which does not cross to this node")

    def _received(
        self, link: Link, origin: str, message: Message, shares: tuple[Share, ...]
    ) -> None:
        """A peer's publish: to this node's sessions unless delivered already (and to one
        member of each of ``shares``); a QoS 1/2 one acknowledged now, or once a snapshot holds
        it if a persistent session took it."""
        if not message.qos:
            self._deliver(message, shares)
            return
        kept = True  # a duplicate: what took it may not be in a durable snapshot yet
        if self.dedup.fresh(origin, message.seq):
            kept = self._deliver(message, shares)
        if kept:
            self.gate.hold(origin, message.seq)
        else:
            link.acks.append(message.seq)

    def _deliver(self, message: Message, shares: tuple[Share, ...]) -> bool:
        self.received += 1
        if shares:
            held = self.broker.namespace(message.tenant).shared
            self.shares_dropped += sum(share not in held for share in shares)
        return self.broker.deliver_remote(message, shares)

    def _answer(self, link: Link, node: str, nonce: str, proof: str) -> None:
        """The dialed edge's CHALLENGE: check its proof, then prove ours (AUTH)."""
        token = self.token()
        if token is None or node == self.node_id:
            reason = "a link to this edge itself" if token else "no link token"
        elif not mesh.proven(proof, token, "accept", link.nonce, nonce, node):
            reason = "the peer did not prove the link token"
        else:
            link.proven = node
            link.send(mesh.auth(mesh.proof(token, "dial", nonce, link.nonce, self.node_id)))
            return
        log.warning("link to %s (%s) given up: %s", printable(node), link.address, reason)
        self._set_state(link.address, REFUSED)
        self._log("link_refused", truncated(node), link.address, "out", reason=reason)
        link.close()

    def _handle_inbound(self, link: Link, kind: int, body: bytes) -> None:
        node = link.node
        if node is None:
            if kind == mesh.HELLO and link.hello is None:
                self._challenge(link, mesh.parse_hello(body))
            elif kind == mesh.AUTH and link.hello is not None:
                self._admit(link, link.hello, mesh.parse_auth(body))
            else:
                raise MeshProtocolError(f"frame kind {kind} before the link was admitted")
        elif kind == mesh.INTEREST:
            change = mesh.parse_interest(body)
            routes = self.routes[node]
            routes.apply(change.tenant, change.add, change.remove, change.at)
            routes.apply_shares(change.tenant, change.shares, change.unshared)
            self.state_changed = True
            # Durable before any publish read after it is acknowledged (broker_edge.mesh:
            # "Restarts"): an origin killed before its next snapshot still knows the filter.
            self.broker.log_peer_change(node, mesh.interest_doc(change))
        elif kind == mesh.SYNCED:
            seen = mesh.parse_synced(body)
            routes = self.routes[node]
            held = _filter_keys(routes) if link.returning else set()
            new = routes.end()
            if held:  # forgotten till now: what it held is due again, whatever its time
                new.update(dict.fromkeys(held & _filter_keys(routes), 0))
            self.state_changed = True
            if link.told:  # too late (_sync_overdue): what was sent is not sent again
                log.warning("link in from %s: its filters came after %g s", node, SYNC_WAIT)
                return
            link.told = True
            self._catch_up(link, node, new, seen)
        elif kind == mesh.ACK:
            self.unacked[node].ack(mesh.parse_ack(body))
            self.tell_acked()
        elif kind != mesh.PING:
            raise MeshProtocolError(f"unexpected frame kind {kind}")

    def _challenge(self, link: Link, hello: mesh.Hello) -> None:
        """A HELLO: refuse it, or prove this edge holds the token and challenge the dialer."""
        token = self.token()
        reason = mesh.refusal(hello, token, self.node_id)
        if reason is not None or token is None:
            self._refuse(link, hello, reason or "no link token")
            return
        link.hello = hello
        proof = mesh.proof(token, "accept", hello.nonce, link.nonce, self.node_id)
        link.send(mesh.challenge(self.node_id, link.nonce, proof))

    def _refuse(self, link: Link, hello: mesh.Hello, reason: str) -> None:
        # Whoever tries: the node id is theirs to choose, so it is cut and escaped.
        node = truncated(hello.node)
        log.warning("link from %s (%s) refused: %s", printable(node), link.address, reason)
        self._log("link_refused", node, link.address, "in", reason=reason)
        link.send(mesh.refuse(reason))
        link.close()

    def _admit(self, link: Link, hello: mesh.Hello, proof: str) -> None:
        """An AUTH: the dialer proved the token (or is refused); the link is up."""
        token = self.token()
        if token is None or not mesh.proven(
            proof, token, "dial", link.nonce, hello.nonce, hello.node
        ):
            self._refuse(link, hello, "bad token")
            return
        previous = self.inbound.get(hello.node)
        if previous is not None:
            previous.close()  # the peer dialed again: the newer link wins
            self.lost(previous)
        link.node = hello.node
        link.up = True
        link.frames.max_frame = self.max_frame
        self.inbound[hello.node] = link
        if self.absences.up(hello.node):  # back: linked as any (broker_edge.mesh)
            link.returning = True
            self.state_changed = True
            log.info("link in from %s: a forgotten peer is back", hello.node)
        # The peer sends all it wants next; what it wanted before routes until that is here.
        self.routes.setdefault(hello.node, PeerRoutes()).begin()
        self.unacked.setdefault(hello.node, Unacked())
        link.send(mesh.welcome(self.node_id, self.durable_seq()))
        # What it had not acknowledged goes first once its filters are here (_catch_up): what
        # it subscribed to while away may add older seqs.
        link.held = []
        asyncio.get_running_loop().call_later(SYNC_WAIT, self._sync_overdue, link)
        self._send_retained(link, hello.node)
        self._reclaim(hello.node)
        self.inbound_states[hello.node] = UP
        self.on_state()
        log.info("link in from %s (%s) up", hello.node, link.address)
        self._log("link_up", hello.node, link.address, "in")

    def _send_retained(self, link: Link, node: str) -> None:
        """Every retained message and tombstone this node holds that goes to ``node``, whatever
        its origin: what ``node`` missed while it was away (it keeps what is newer)."""
        for message in self.broker.retained_state():
            if mesh.goes_to(message.tenant, message.topic, node):
                link.send(mesh.retained_frame(message))
                self.retained_sent += 1

    def after_read(self, link: Link) -> None:
        if link.acks:
            link.send(mesh.ack_frame(link.acks))
            link.acks = []
        self.broker.flush_dirty()
        self.want_flush()

    # -- what the broker calls -----------------------------------------------------------------

    def forward(self, message: Message) -> Container[Share] | None:
        """A publish accepted on this node: once to each peer that wants it, or to every peer
        (retained, the operator's decisions), or to the node a journal notice names (QoS 1/2
        once its journal record is durable, see the theory of operation in broker_edge.mesh);
        each of its shared groups to one edge's members (broker_edge.meshgroups). Returns the
        shares that get it on this node (None: every one)."""
        topic = message.topic
        tenant = message.tenant
        where = mesh.FILTERS if topic[0] != "$" else mesh.reach(tenant, topic)
        if where == mesh.LOCAL:
            return None
        if where not in (mesh.FILTERS, mesh.EVERY):
            self._notice(message, where)
            return None
        every = where == mesh.EVERY or message.retain
        kept, given = self._split(message)
        if message.qos:
            forgotten = self.absences.forgotten  # nothing is kept for them (until they are back)
            nodes = [
                n
                for n, r in self.routes.items()
                if (every or n in given or r.wants(tenant, topic)) and n not in forgotten
            ]
            if nodes:
                self._when_durable(message, nodes, given)
            return kept
        plain = None
        for node, routes in self.routes.items():
            link = self.inbound.get(node)
            shares = given.get(node)
            if link is None or not (every or shares or routes.wants(tenant, topic)):
                continue
            if link.congested() and not every:  # what every peer keeps is never dropped
                self.congested += 1
                continue
            if shares:
                data = mesh.publish_frame(message, shares=shares)
            elif plain is None:
                data = plain = mesh.publish_frame(message)
            else:
                data = plain
            link.send(data)
            self.forwarded += 1
        return kept

    def _split(self, message: Message) -> tuple[Container[Share] | None, dict[str, list[Share]]]:
        """Which of a publish's shares get it here (None: every one), which each peer gets."""
        tenant = message.tenant
        topic = message.topic
        peers = {}
        forgotten = self.absences.forgotten  # their members get nothing until they are back
        for node, routes in self.routes.items():
            if routes.has_shares(tenant) and node not in forgotten:
                found = routes.shared(tenant, topic)
                if found:
                    peers[node] = found
        if not peers:
            return None, {}
        local = self.broker.router.shares(tenant, topic)
        kept, given = self.choice.split(tenant, self.node_id, local, peers, self.inbound)
        self.shares_given += sum(len(shares) for shares in given.values())
        return kept, given

    def _notice(self, message: Message, node: str) -> None:
        """A journal notice (not journaled, so no seq to resend it by): to ``node`` now if its
        link is up, as QoS 0; it is retained, so a link that comes up later gets it anyway."""
        link = self.inbound.get(node)
        if link is None:
            return
        link.send(mesh.publish_frame(message, QoS.AT_MOST_ONCE))
        self.forwarded += 1

    def _when_durable(
        self, message: Message, nodes: list[str], given: dict[str, list[Share]]
    ) -> None:
        seq = message.seq
        frames = _frames(message, nodes, given)
        self.pending.append(seq)
        # Refused: the journal dropped it and gives its seq out again (never sent, then).
        self.broker.journal.after_durable(
            seq, lambda: self._durable(seq, frames), self.pending.clear
        )

    def _durable(self, seq: int, frames: dict[str, bytes]) -> None:
        """A QoS 1/2 publish for the peers of ``frames`` is durable: kept for them, sent to
        those linked."""
        pending = self.pending
        if pending and pending[0] == seq:
            pending.popleft()
        forgotten = self.absences.forgotten
        for node, data in frames.items():
            if node in forgotten:  # forgotten since the publish was routed
                continue
            self.unacked[node].add(seq, data)
            link = self.inbound.get(node)
            if link is not None and link.held is None:  # held: it goes with its Unacked
                link.send(data)
                self.forwarded += 1

    # -- filters a peer subscribed while its link was down (broker_edge.mesh.CatchUp) ----------

    def _catch_up(
        self, link: Link, node: str, new: dict[tuple[str, str], int], seen: int | None
    ) -> None:
        """The dialer's whole set of filters is here: what this journal holds for the filters
        it had not told before (subscribed while the link was down) goes into its Unacked, in
        seq order, before the link's frames are released."""
        journal = self.broker.journal
        upto = journal.appended_seq  # later publishes were routed by the new filters
        if not new or seen is None or upto <= seen:
            self._release(node)
            return
        catch_up = mesh.CatchUp(seen, new)
        self.catching[node] = self.catching.get(node, 0) + 1
        # Retention keeps what the rescan reads until it is done (tell_acked).
        self._rescan_from[node] = min(seen, self._rescan_from.get(node, seen))
        self.tell_acked()

        def read() -> None:
            task = asyncio.get_running_loop().create_task(self._rescan(node, catch_up, upto))
            self._rescans.add(task)  # referenced while it runs
            task.add_done_callback(self._rescans.discard)

        def refused() -> None:  # the journal failed: what it holds up to upto is not known
            log.warning("link in from %s: journal failed, not rescanned for new filters", node)
            self._caught_up(node)

        journal.after_durable(upto, read, refused)

    async def _rescan(self, node: str, catch_up: mesh.CatchUp, upto: int) -> None:
        try:
            matched = await asyncio.get_running_loop().run_in_executor(
                None, _matching, self.journal_dir, self.node_id, catch_up, upto
            )
            unacked = self.unacked[node]
            found = {seq: data for seq, data in matched.items() if seq not in unacked.frames}
            unacked.merge(found)
            self.caught_up += len(found)
            log.info(
                "link in from %s: %d message(s) of seqs %d..%d for filters subscribed while "
                "the link was down",
                node,
                len(found),
                catch_up.seen + 1,
                upto,
            )
        except Exception:
            log.exception("link in from %s: journal rescan for new filters failed", node)
        finally:
            self._caught_up(node)

    def _sync_overdue(self, link: Link) -> None:
        """The dialer's whole set of filters did not come in time: the link's frames go now,
        and no rescan follows for it."""
        if link.told or link.node is None:
            return
        log.warning("link in from %s: no whole set of filters after %g s", link.node, SYNC_WAIT)
        link.told = True
        self._release(link.node)

    def _caught_up(self, node: str) -> None:
        left = self.catching[node] - 1
        if left:
            self.catching[node] = left
        else:
            del self.catching[node]
            del self._rescan_from[node]
        self._release(node)

    def _release(self, node: str) -> None:
        """Send ``node``'s link what it had not acknowledged (in seq order), then what waited
        there, once no rescan for it runs."""
        link = self.inbound.get(node)
        if link is None or link.held is None or not link.told or node in self.catching:
            return
        held = link.release()
        for data in self.unacked[node].frames.values():
            link.send(data)
        for data in held:
            link.send(data)
        self.tell_acked()
        self.want_flush()

    def tell_acked(self) -> None:
        """Tell the journal what each peer acknowledged: retention keeps every record after
        the lowest (broker_edge.mesh: "Retention"), and what a rescan for a peer reads, but
        nothing for a forgotten peer. A value told may only be too low (safe): every seq a peer
        is due later is above it."""
        journal = self.broker.journal
        upto = journal.durable_seq
        if self.pending:  # durable, and not yet in Unacked (_durable has not run)
            upto = min(upto, self.pending[0] - 1)
        forgotten = self.absences.forgotten
        acked = {node: u.acked(upto) for node, u in self.unacked.items() if node not in forgotten}
        for node, seen in self._rescan_from.items():
            acked[node] = min(acked.get(node, seen), seen)
        journal.peer_acked = acked

    def expire(self) -> None:
        """Forget the peers away longer than ``edge.peer_expiry_hours`` (every second): what
        each is due is given up, the journal keeps nothing more for it, the operator's
        ``$log`` gets ``peer_forgotten`` (broker_edge.mesh, "Peers gone for good")."""
        gone = self.absences.expire(self.broker.wall_clock_us())
        if not gone:
            return
        expiry_hours = self.absences.expiry_us / 3600e6
        for node, away_us in gone:
            unacked = self.unacked[node]
            dropped = unacked.give_up(max(unacked.frames, default=0))
            self.inbound_states[node] = FORGOTTEN
            away = away_us / 1e6
            log.warning(
                "peer %s away for %.1f h (edge.peer_expiry_hours %g): forgotten, %d message(s) "
                "it was due given up; the journal no longer keeps anything for it",
                node,
                away / 3600,
                expiry_hours,
                dropped,
            )
            details = {"peer": node, "away_seconds": round(away, 1), "dropped": dropped}
            self.broker.log(OPERATOR_TENANT, "peer_forgotten", "", details, origin="mesh")
        self.broker.flush_dirty()
        self.state_changed = True  # forgotten: in the next snapshot
        self.on_state()
        self.tell_acked()

    def gave_up(self, node: str, first: int, last: int) -> None:
        """The journal, over its budget, removed records ``first..last`` that ``node`` had not
        acknowledged: they are dropped for it, and the operator's ``$log`` says so."""
        unacked = self.unacked.get(node)
        dropped = unacked.give_up(last) if unacked is not None else 0
        details = {"peer": node, "first": first, "last": last, "dropped": dropped}
        self.broker.log(OPERATOR_TENANT, "peer_dropped", "", details, origin="journal")
        self.broker.flush_dirty()
        self.tell_acked()

    def covered(self, delivered: dict[str, int]) -> None:
        """A snapshot holding what was delivered from each origin up to ``delivered`` is
        durable: acknowledge what waited for it (on the origin's link, if it is up; if not,
        the origin sends it again and it is acknowledged then)."""
        taking, self._taking_covered = self.taking[: self._taking_covered], 0
        del self.taking[: len(taking)]
        for node, data in taking:
            link = self.inbound.get(node)
            if link is not None:
                link.send(data)
        released = self.gate.release(delivered)
        if not released:
            return
        for link in self.outbound.values():
            if link.up and link.node in released:
                link.send(mesh.ack_frame(released[link.node]))

    # -- across restarts (see broker_edge.mesh: "Restarts") ------------------------------------

    def state(self, snapshot_seq: int) -> MeshState:
        """What a snapshot of the node's state up to journal record ``snapshot_seq`` holds."""
        self.state_changed = False
        self._taking_covered = len(self.taking)
        upto = snapshot_seq if not self.pending else min(snapshot_seq, self.pending[0] - 1)
        now = self.broker.wall_clock_us()
        absences = self.absences
        peers = {
            node: PeerState(
                self.unacked[node].acked(upto),
                routes.filters(),
                routes.shares.state(),
                absences.seen(node, now),
                node in absences.forgotten,
            )
            for node, routes in self.routes.items()
        }
        return MeshState(peers, dict(self.dedup.last))

    def restore(self, state: MeshState) -> None:
        """Before the journal is replayed (:meth:`replay`): the peers' filters and what each
        acknowledged, this node's Dedup as a receiver."""
        self.dedup.restore(state.delivered)
        now = self.broker.wall_clock_us()
        for node, peer in state.peers.items():
            self.routes[node] = peer.routes()
            self.unacked[node] = Unacked()
            self.absences.restore(node, peer.seen_us, peer.forgotten, now)
            if peer.forgotten:  # due nothing till it is back (broker_edge.mesh)
                self.inbound_states[node] = FORGOTTEN
            else:
                self._replay_after[node] = peer.acked

    def replay(self, message: Message) -> None:
        """A journal record at restore: kept for each peer that wants it and had not
        acknowledged it (sent when the peer links). Which edge's members its shared groups went
        to is not journaled: it names every share of the peer it matches (at least once, see
        broker_edge.meshgroups)."""
        topic = message.topic
        tenant = message.tenant
        where = mesh.FILTERS if topic[0] != "$" else mesh.reach(tenant, topic)
        if not message.qos or where not in (mesh.FILTERS, mesh.EVERY):
            return
        every = where == mesh.EVERY or message.retain
        nodes = []
        given: dict[str, list[Share]] = {}
        for node, after in self._replay_after.items():
            if message.seq <= after:
                continue
            routes = self.routes[node]
            if routes.has_shares(tenant):
                shares = [share for share, _ in routes.shared(tenant, topic)]
                if shares:
                    given[node] = shares
            if every or node in given or routes.wants(tenant, topic):
                nodes.append(node)
        for node, data in _frames(message, nodes, given).items():
            self.unacked[node].add(message.seq, data)
            self.replayed += 1

    def restore_change(self, node: str, seq: int, doc: dict[str, Any]) -> None:
        """A change of ``node``'s filters the session log holds (told after the snapshot, after
        journal record ``seq``): in force for the replay of the records after it."""
        try:
            change = mesh.parse_interest(json.dumps(doc).encode())
            routes = self.routes.get(node)
            if routes is None:  # a peer the snapshot did not know yet
                routes = self.routes[node] = PeerRoutes()
                self.unacked[node] = Unacked()
                self._replay_after[node] = seq
                self.absences.restore(node, None, False, self.broker.wall_clock_us())
            routes.apply(change.tenant, change.add, change.remove)
            routes.apply_shares(change.tenant, change.shares, change.unshared)
        except MeshProtocolError as exc:
            raise MeshStateError(f"session log: peer {node!r}: {exc}") from exc
        self.state_changed = True  # the next snapshot holds it

    def replayed_all(self) -> None:
        """The journal was replayed to its end."""
        self._replay_after.clear()
        self.tell_acked()

    # -- sessions that move (see broker_edge.handover) -----------------------------------------

    def claim(self, claim: Claim, done: Done) -> bool:
        """A CONNECT here: its claim to every peer linked both ways; True when
        ``done(moved, stale)`` is called once they answered (or at the deadline), False when
        nobody is waited for (a clean start, or no peer linked).

        A claim goes where this edge's publishes to the peer go (the link the peer dialed), so
        the peer reads it after every publish this edge sent it before (the session it hands
        over has them queued); the answer comes back the same way, after the peer's."""
        data = mesh.frame(mesh.CLAIM, handover.claim_body(claim))
        peers = self._linked()
        for node in peers:
            self.inbound[node].send(data)
        if not claim.wait or not peers:
            return False
        earlier = self.waiting.get(claim.key)
        if earlier is not None:  # the same client id connected here again meanwhile
            earlier[0].superseded(claim.version)
            self._done(claim.key)
        timer = asyncio.get_running_loop().call_later(handover.CLAIM_WAIT, self._done, claim.key)
        self.waiting[claim.key] = (Waiting(claim, peers), done, timer)
        return True

    def _linked(self) -> list[str]:
        """The peers linked both ways (a claim goes on one link, its answer on the other)."""
        dialed = {link.node for link in self.outbound.values() if link.up}
        return [node for node in self.inbound if node in dialed]

    def _done(self, key: tuple[str, str]) -> None:
        waiting, done, timer = self.waiting.pop(key)
        timer.cancel()
        done(waiting.moved, waiting.stale)

    def _unanswered(self, node: str) -> None:
        """A link with ``node`` went down: its answers are not waited for any more."""
        for key, (waiting, _, _) in list(self.waiting.items()):
            if node in waiting.peers and waiting.answered(node, handover.NONE):
                self._done(key)

    def _claimed(self, node: str, claim: Claim) -> None:
        """A peer's CONNECT claims a client id: the answer (with the session when it moves
        there), and what the session's filters match routed to that peer from now on."""
        link = self.inbound.get(node)
        if link is None:
            return  # no way to answer: the copy stays here (the link coming up claims again)
        waiting = self.waiting.get(claim.key)
        pending = None
        if waiting is not None:
            pending = waiting[0].claim.version
            waiting[0].superseded(claim.version)
        answer, doc = self.broker.moves.claimed(claim, pending)
        if doc is not None:
            self.sessions_out += 1
            filters = [parse_subscription_filter(sub["filter"])[1] for sub in doc["subscriptions"]]
            self.routes[node].apply(claim.tenant, filters, ())
            self.handed[(node, *claim.key, claim.version, False)] = doc
            stand_in = self.broker.moves.stand_in(doc)
            asyncio.get_running_loop().call_later(
                handover.RELAY_WINDOW, self._relay, node, claim, stand_in
            )
        self._answer_claim(link, claim, answer, doc)

    def _answer_claim(
        self, link: Link, claim: Claim, answer: str, doc: dict[str, Any] | None
    ) -> None:
        limit = self.max_frame - 2**16
        bodies, cut = handover.frames(claim, answer, doc, limit // 2, limit)
        self.sessions_cut += cut
        for body in bodies:
            link.send(mesh.frame(mesh.SESSION, body))

    def _relay(self, node: str, claim: Claim, stand_in: Session) -> None:
        """A stand-in's time is over: what it took goes to where the session went."""
        doc = self.broker.moves.stand_in_done(stand_in)
        if doc is None:
            return
        if claim.key in self.broker.sessions:  # it came back meanwhile
            self.broker.moves.adopt(doc)
            return
        link = self.inbound.get(node)
        if link is None:
            lost = len(doc["queue"])
            self.relays_lost += lost
            log.warning("%d late messages of a session moved to %s lost: link down", lost, node)
            return
        self.handed[(node, *claim.key, claim.version, True)] = doc
        self._answer_claim(link, claim, handover.MOVED, doc)
        self.want_flush()

    def _session(self, node: str, answer: handover.Answer | None) -> None:
        """A peer's answer to a claim, once whole: its session installed here, the CONNECT
        waiting for it told once every peer answered."""
        if answer is None:
            return
        if answer.session is not None:
            self.sessions_in += 1
            self.broker.moves.adopt(answer.session)
            late = bool(answer.session.get("late"))
            body = handover.taken_body(answer.tenant, answer.client_id, answer.version, late)
            self.taking.append((node, mesh.frame(mesh.TAKEN, body)))
        key = (answer.tenant, answer.client_id)
        entry = self.waiting.get(key)
        if (
            entry is not None
            and entry[0].claim.version == answer.version
            and entry[0].answered(node, answer.answer)
        ):
            self._done(key)

    def _take_back(self, node: str) -> None:
        """A link with ``node`` went down before it said it holds what was handed to it: this
        edge holds it again (offline), for the links coming up to merge where it belongs."""
        for key in [key for key in self.handed if key[0] == node]:
            doc = self.handed.pop(key)
            self.taken_back += 1
            log.warning("session of %s handed to %s taken back: link down", printable(key[2]), node)
            self.broker.moves.adopt({**doc, "late": False})

    def _reclaim(self, node: str) -> None:
        """A link with ``node`` came up: once both are, claim again every persistent session
        held here, waiting for nobody, so a copy the peer made while it was unreachable comes
        here if this one is newer (or this one goes there: the peer claims too)."""
        if node not in self._linked():
            return
        link = self.inbound[node]
        for session in self.broker.persistent_sessions():
            claim = Claim(session.tenant, session.client_id, session.claim, session.since, False)
            link.send(mesh.frame(mesh.CLAIM, handover.claim_body(claim)))

    def sys_values(self) -> tuple[tuple[str, str], ...]:
        """Each configured peer's link state by HOST:PORT (the link this edge dials), each
        peer's link to this edge by node, and the traffic over links."""
        values = [(f"peers/{address}", state) for address, state in self.states.items()]
        values += [(f"inbound/{node}", state) for node, state in self.inbound_states.items()]
        values += [
            ("publish/forwarded", str(self.forwarded)),
            ("publish/received", str(self.received)),
            ("publish/duplicates", str(self.dedup.dropped)),
            ("publish/replayed", str(self.replayed)),
            ("publish/caught_up", str(self.caught_up)),
            ("publish/congested", str(self.congested)),
            ("publish/unacked", str(sum(len(u) for u in self.unacked.values()))),
            ("publish/unacked_dropped", str(sum(u.dropped for u in self.unacked.values()))),
            ("retained/sent", str(self.retained_sent)),
            ("retained/received", str(self.retained_taken)),
            ("shared/given", str(self.shares_given)),
            ("shared/dropped", str(self.shares_dropped)),
            ("sessions/received", str(self.sessions_in)),
            ("sessions/sent", str(self.sessions_out)),
            ("sessions/taken_back", str(self.taken_back)),
        ]
        return tuple(values)

    # -- internals -----------------------------------------------------------------------------

    def want_flush(self) -> None:
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        changes = self.interest.take_changes()
        if changes:
            for link in self.outbound.values():
                if link.up:
                    for data in changes:
                        link.send(data)
        dirty, self.dirty = self.dirty, set()
        for link in dirty:
            link.write_out()

    def _set_state(self, address: str, state: str) -> None:
        if self.states.get(address) != state:
            self.states[address] = state
            self.on_state()

    def _log(self, event: str, node: str, address: str, direction: str, **more: Any) -> None:
        details = {"peer": node, "address": address, "direction": direction, **more}
        self.broker.log(OPERATOR_TENANT, event, "", details, origin="mesh")
        self.broker.flush_dirty()


def _matching(directory: Path, node: str, catch_up: mesh.CatchUp, upto: int) -> dict[int, bytes]:
    """The PUBLISH frames of the journal records after ``catch_up.seen`` up to ``upto`` that
    ``catch_up`` wants, by seq (on an executor thread; the newest MAX_UNACKED at most, as
    Unacked keeps; records retention removed are gone)."""
    reader = JournalReader(directory)
    after = catch_up.seen
    oldest = reader.first_seq()
    if oldest is not None and after + 1 < oldest:
        log.warning("journal records %d..%d were removed: not rescanned", after + 1, oldest - 1)
        after = oldest - 1
    found: OrderedDict[int, bytes] = OrderedDict()
    if upto <= after:
        return found
    for row in reader.read_records(after, upto):
        message = message_from_row(row, node)
        if catch_up.wants(message):
            found[message.seq] = mesh.publish_frame(message)
            if len(found) > mesh.MAX_UNACKED:
                found.popitem(last=False)
    return found


def _filter_keys(routes: PeerRoutes) -> set[tuple[str, str]]:
    """The filters ``routes`` hold, as (tenant, filter)."""
    return {(tenant, f) for tenant, held in routes.filters().items() for f in held}


def _frames(message: Message, nodes: list[str], given: dict[str, list[Share]]) -> dict[str, bytes]:
    """The PUBLISH frame of ``message`` for each of ``nodes``: one for those given none of its
    shares, its own for each that is given some."""
    plain = b""
    frames = {}
    for node in nodes:
        shares = given.get(node)
        if shares:
            frames[node] = mesh.publish_frame(message, shares=shares)
        else:
            plain = plain or mesh.publish_frame(message)
            frames[node] = plain
    return frames


Done = Callable[[bool, bool], None]  # a claim's outcome: (a session moved here, superseded)


def _nothing() -> None:
    pass


def _zero() -> int:
    return 0
