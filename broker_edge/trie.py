"""The topic tree: which subscriptions match a topic name. Match only, no delivery, no ACL.

Theory of operation. Each topic filter is stored as a path of levels from the root, one node per
level, with ``+`` and ``#`` stored as ordinary child labels; the node at the end of the path holds
the entries ``{key: value}`` of that filter (typically key = client id, value = subscription
options). Matching a topic name walks its levels breadth-first, carrying the *frontier* of nodes
whose path matches the levels read so far. For each level, every frontier node contributes:

* its ``#`` child, whose entries match now, whatever levels remain [MQTT-4.7.1-2];
* its child labelled with the level itself, and its ``+`` child [MQTT-4.7.1-3], as the next
  frontier.

When the levels run out, the frontier nodes' own entries match, and so do their ``#`` children's,
since ``#`` also matches the parent level (``sport/#`` matches ``sport``) [MQTT-4.7.1-2].

Topics whose first level starts with ``$`` never reach the root's ``+`` and ``#`` children: the
walk starts below the root's literal child instead [MQTT-4.7.2-1]. That is the shape of the walk,
not a filter on its output, so ``$SYS/#`` still matches ``$SYS/x`` and ``#`` never does.

Each node is reached by one path only, so a filter's entries are reported at most once per
``match``. A key subscribed through several matching filters (``a/+`` and ``a/#``) is reported
once *per filter*; resolving that overlap (highest QoS, subscription identifiers) is the router's
job, not the tree's.

``match`` results are memoised per topic name in an LRU cache that is cleared by every ``add``
and every successful ``remove``; publish-heavy, subscribe-light traffic mostly hits it. The cache
is bounded by entries and by an estimate of the bytes it holds (the topic names and the result
tuples), so long distinct topic names cannot make it hold hundreds of megabytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

from broker_edge.topics import validate_topic_filter

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

DEFAULT_CACHE_SIZE = 4096
DEFAULT_CACHE_BYTES = 2**20
# Estimated bytes of one cache entry beyond its topic's characters: the OrderedDict slot and the
# result tuple, and per match the (key, value) pair in it.
_ENTRY_BYTES = 200
_MATCH_BYTES = 72


class _Node(Generic[K, V]):
    __slots__ = ("children", "entries")

    def __init__(self) -> None:
        self.children: dict[str, _Node[K, V]] = {}
        self.entries: dict[K, V] = {}


class TopicTrie(Generic[K, V]):
    """Topic filters to ``{key: value}`` entries, matched against topic names.

    ``add`` validates the filter (``InvalidTopic``); ``match`` trusts its argument to be a valid
    topic name (the codec checked it), because it is the hot path.
    """

    __slots__ = ("_cache", "_cache_bytes", "_cache_held", "_cache_size", "_root", "_size")

    def __init__(
        self, cache_size: int = DEFAULT_CACHE_SIZE, cache_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self._root: _Node[K, V] = _Node()
        self._size = 0
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._cache_held = 0  # estimated bytes in _cache
        self._cache: OrderedDict[str, tuple[tuple[K, V], ...]] = OrderedDict()

    @property
    def cache_bytes(self) -> int:
        """Estimated bytes the match cache holds now (diagnostics and tests)."""
        return self._cache_held

    def __len__(self) -> int:
        """Number of (filter, key) entries."""
        return self._size

    def add(self, topic_filter: str, key: K, value: V) -> bool:
        """Store ``value`` for ``key`` under ``topic_filter``.

        Returns True if ``key`` is new for that filter, False if its value was replaced.
        """
        validate_topic_filter(topic_filter)
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        is_new = key not in node.entries
        node.entries[key] = value
        if is_new:
            self._size += 1
        self._clear_cache()
        return is_new

    def remove(self, topic_filter: str, key: K) -> bool:
        """Drop ``key`` from ``topic_filter``; False if it was not there.

        Nodes left with neither entries nor children are pruned, so churn does not grow memory.
        """
        path: list[tuple[_Node[K, V], str]] = []
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        if key not in node.entries:
            return False
        del node.entries[key]
        self._size -= 1
        for parent, level in reversed(path):
            if node.entries or node.children:
                break
            del parent.children[level]
            node = parent
        self._clear_cache()
        return True

    def _clear_cache(self) -> None:
        self._cache.clear()
        self._cache_held = 0

    def match(self, topic: str) -> list[tuple[K, V]]:
        """Every (key, value) of every filter matching the topic name ``topic``.

        A key appears once per matching filter (see the module docstring). Order is unspecified.
        The returned list is the caller's to keep or mutate.
        """
        return list(self.matches(topic))

    def matches(self, topic: str) -> tuple[tuple[K, V], ...]:
        """What :meth:`match` returns, as the cached tuple itself: no copy per publish."""
        cache = self._cache
        hit = cache.get(topic)
        if hit is not None:
            cache.move_to_end(topic)
            return hit
        result = tuple(self._walk(topic))
        if self._cache_size:
            cost = len(topic) + _ENTRY_BYTES + _MATCH_BYTES * len(result)
            if cost <= self._cache_bytes // 8:  # one entry never takes over the cache
                cache[topic] = result
                self._cache_held += cost
                while len(cache) > self._cache_size or self._cache_held > self._cache_bytes:
                    old, matched = cache.popitem(last=False)
                    self._cache_held -= len(old) + _ENTRY_BYTES + _MATCH_BYTES * len(matched)
        return result

    def node_count(self) -> int:
        """Nodes below the root (diagnostics: 0 once every entry is removed)."""
        count = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count

    def _walk(self, topic: str) -> list[tuple[K, V]]:
        out: list[tuple[K, V]] = []
        levels = iter(topic.split("/"))
        frontier: list[_Node[K, V]]
        if topic[:1] == "$":
            # [MQTT-4.7.2-1] wildcards at the first level do not match '$' topics: start below
            # the root's literal child, so its '+' and '#' children are never visited.
            start = self._root.children.get(next(levels))
            if start is None:
                return out
            frontier = [start]
        else:
            frontier = [self._root]
        for level in levels:
            nxt: list[_Node[K, V]] = []
            for node in frontier:
                children = node.children
                if not children:
                    continue
                multi = children.get("#")
                if multi is not None:
                    out.extend(multi.entries.items())
                child = children.get(level)
                if child is not None:
                    nxt.append(child)
                child = children.get("+")
                if child is not None:
                    nxt.append(child)
            if not nxt:
                return out
            frontier = nxt
        for node in frontier:
            if node.entries:
                out.extend(node.entries.items())
            multi = node.children.get("#")
            if multi is not None:
                # [MQTT-4.7.1-2] '#' also matches the parent level: 'sport/#' matches 'sport'.
                out.extend(multi.entries.items())
        return out
