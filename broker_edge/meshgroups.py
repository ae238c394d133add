"""Shared subscriptions across the edge mesh, sans-IO: who holds which group, who gets a message.

Theory of operation
-------------------
A shared subscription ``$share/{group}/{filter}`` gives each message to one member of the group
[MQTT-4.8.2]; in a mesh its members may be on any edge, and each message must still reach one
of them, once, whichever edge it was published on. The origin edge decides, as it decides
everything else about its publishes (one hop, no loops): it is the one edge that sees the
publish first and the one that journals it, so the decision needs no agreement between edges.

What the origin knows: each edge tells its peers, beside its plain filters, the *shares* (a
share is a ``(group, filter)`` pair, per tenant) its sessions are members of, with how many of
those members are connected now (:class:`~broker_edge.mesh.Interest`; a share changes when a
member joins, leaves, connects or disconnects). A share is not a filter: a peer whose only
subscribers to ``work/#`` are members of ``$share/g/work/#`` is not sent every publish on
``work/...``, only the ones given to it. The origin keeps each peer's shares in a trie per
tenant (:class:`PeerShares`), beside its filters.

What it decides (:class:`ShareChoice`), per matching share, among the edges that hold it (this
one included): the edges that can deliver now (this one, and peers whose link is up) with
connected members, weighted by that number (smooth weighted round-robin, as nginx spreads
requests), so each connected member of the group gets about the same share of its messages
wherever it is connected: a client cannot tell which edge it is on, and adding a worker on any
edge takes load off all the others. This edge is not preferred: preferring it would give the
members on the publishers' edge everything and the others nothing. If no edge can deliver now
(every member offline, or on peers whose link is down), the edges that hold the share take
turns: the message waits in a persistent member's queue there, or in the link's Unacked for a
peer, as a message to an offline member of a group on one edge does.

How the decision travels: a PUBLISH frame to a peer carries the shares given to it. The receiver
routes the message to its own plain subscribers by its own filters as always (a frame reaches an
edge once, so a plain subscriber gets it once), and to one of its members of each share named
in the frame, and of no other (its own members' turn was decided by the origin). The frame is
kept in Unacked and sent again with the same shares, so a QoS 1/2 message given to a peer's
group is delivered there at least once and its Dedup drops the copies. The choice is final: a
message given to a peer whose link then breaks waits for that peer (taking it back would reuse
its seq on another peer, whose Dedup may be past it). A receiver that no longer holds a share
named in the frame (its last member left while the frame crossed, or its members were clean
sessions and the edge restarted) drops that share's delivery and counts it.

An origin that restarts has lost its decisions (they are not journaled). What it rebuilds for a
peer from its journal (the QoS 1/2 records after what the peer acknowledged: see "Restarts" in
:mod:`broker_edge.mesh`) names every share of that peer the record matches, and its own replay
delivers to its own members as a single edge does: at least once, so a message published just
before an origin's crash may reach a group twice (once per edge that holds it), never none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from broker_edge.topics import SharedFilter
from broker_edge.trie import TopicTrie

# (group, filter): one shared subscription of a tenant.
Share = tuple[str, str]

# Shares whose turns ShareChoice keeps at most (beyond, it forgets them all and starts over:
# a new turn order is as fair as the old one).
MAX_CHOICES = 10_000


class PeerShares:
    """The shares one peer's sessions are members of, per tenant, each with its number of
    connected members there."""

    def __init__(self) -> None:
        self.tries: dict[str, TopicTrie[Share, int]] = {}
        self.held: dict[str, dict[Share, int]] = {}

    def set(self, tenant: str, group: str, topic_filter: str, online: int) -> None:
        """Raises ``InvalidTopic`` for a share that is not one, ValueError for a bad count."""
        SharedFilter(group, topic_filter)  # validates both
        if type(online) is not int or online < 0:
            raise ValueError(f"bad member count {online!r}")
        trie = self.tries.get(tenant)
        if trie is None:
            trie = self.tries[tenant] = TopicTrie()
        share = (group, topic_filter)
        trie.add(topic_filter, share, online)
        self.held.setdefault(tenant, {})[share] = online

    def drop(self, tenant: str, group: str, topic_filter: str) -> None:
        trie = self.tries.get(tenant)
        if trie is None:
            return
        trie.remove(topic_filter, (group, topic_filter))
        self.held[tenant].pop((group, topic_filter), None)
        if not len(trie):
            del self.tries[tenant]
            del self.held[tenant]

    def matching(self, tenant: str, topic: str) -> list[tuple[Share, int]]:
        """The shares whose filter matches ``topic``, each with its connected members."""
        trie = self.tries.get(tenant)
        return trie.match(topic) if trie is not None else []

    def has(self, tenant: str) -> bool:
        return tenant in self.tries

    def state(self) -> dict[str, list[list[str | int]]]:
        """Per tenant, ``[group, filter, connected members]``, sorted (a snapshot keeps it)."""
        return {
            tenant: [[group, f, online] for (group, f), online in sorted(held.items())]
            for tenant, held in sorted(self.held.items())
        }


class ShareChoice:
    """Which edge gets each message of a share (see the theory of operation): smooth weighted
    round-robin over the edges that can deliver now, by their connected members; turns among
    every edge holding it when none can."""

    def __init__(self) -> None:
        self._credit: dict[tuple[str, Share], dict[str, int]] = {}

    def pick(self, tenant: str, share: Share, weights: Mapping[str, int]) -> str:
        """One of ``weights`` (edge -> connected members it can deliver to now, 0 when it holds
        the share but cannot deliver now); ``weights`` is not empty."""
        live = {node: w for node, w in weights.items() if w > 0}
        if not live:
            live = dict.fromkeys(weights, 1)
        key = (tenant, share)
        credit = self._credit.get(key)
        if credit is None:
            if len(self._credit) >= MAX_CHOICES:
                self._credit.clear()
            credit = self._credit[key] = {}
        for node in [n for n in credit if n not in live]:
            del credit[node]
        total = 0
        for node, weight in live.items():
            credit[node] = credit.get(node, 0) + weight
            total += weight
        best = max(live, key=lambda node: (credit[node], node))  # ties: the same order always
        credit[best] -= total
        return best

    def split(
        self,
        tenant: str,
        own: str,
        local: Mapping[Share, int],
        peers: Mapping[str, Iterable[tuple[Share, int]]],
        linked: Iterable[str],
    ) -> tuple[set[Share], dict[str, list[Share]]]:
        """A publish's shares: those this edge (``own``) delivers to its own members, and those
        given to each peer. ``local``: this edge's matching shares and their connected members;
        ``peers``: each peer's matching shares and theirs; ``linked``: the peers whose link is
        up (the others cannot deliver now)."""
        up = set(linked)
        holders: dict[Share, dict[str, int]] = {}
        for node, shares in peers.items():
            for share, online in shares:
                holders.setdefault(share, {})[node] = online if node in up else 0
        kept = {share for share in local if share not in holders}
        given: dict[str, list[Share]] = {}
        for share, weights in holders.items():
            if share in local:
                weights[own] = local[share]
            node = self.pick(tenant, share, weights)
            if node == own:
                kept.add(share)
            else:
                given.setdefault(node, []).append(share)
        return kept, given


__all__ = ["MAX_CHOICES", "PeerShares", "Share", "ShareChoice"]
