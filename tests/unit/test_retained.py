"""The retained store's newest-wins rule (broker_edge.retained): the same on every edge of a
mesh, whatever order the sets and clears reach an edge in."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from broker_edge import retained
from broker_edge.message import Message
from broker_edge.packets import QoS
from broker_edge.retained import RetainedStore


def _m(payload: bytes, ts_us: int, origin: str, seq: int = 1, topic: str = "a/b") -> Message:
    return Message(
        "acme", topic, payload, QoS.AT_MOST_ONCE, True, "c", ts_us, seq=seq, origin=origin
    )


def _held(store: RetainedStore, topic: str = "a/b") -> bytes | None:
    got = store.matching(topic)
    return got[0].payload if got else None


def test_the_newest_by_origin_time_wins_in_any_order() -> None:
    sets = [_m(b"old", 10, "edge-c"), _m(b"new", 20, "edge-a"), _m(b"mid", 15, "edge-b")]
    for order in itertools.permutations(sets):
        store = RetainedStore()
        taken = [store.set(m) for m in order]
        assert _held(store) == b"new"
        assert taken[order.index(sets[1])]  # the newest is always taken


def test_a_tie_in_time_goes_to_the_higher_node_id_then_the_higher_seq() -> None:
    for order in itertools.permutations([_m(b"a", 10, "edge-a"), _m(b"b", 10, "edge-b")]):
        store = RetainedStore()
        for m in order:
            store.set(m)
        assert _held(store) == b"b"
    store = RetainedStore()
    store.set(_m(b"first", 10, "edge-a", seq=1))
    assert store.set(_m(b"second", 10, "edge-a", seq=2))  # one node, one microsecond
    assert _held(store) == b"second"


def test_a_copy_of_the_held_message_keeps_the_original() -> None:
    store = RetainedStore()
    original = _m(b"x", 10, "edge-a", seq=7)
    store.set(original)
    assert not store.set(_m(b"x", 10, "edge-a", seq=7))  # a peer's copy (fewer properties)
    assert store.matching("a/b")[0] is original
    store.set(_m(b"n1", 10, "edge-a", seq=0, topic="n"))
    assert store.set(_m(b"n2", 10, "edge-a", seq=0, topic="n"))  # unjournaled: equal replaces
    assert _held(store, "n") == b"n2"


def test_a_clear_is_kept_so_an_older_set_arriving_later_stays_cleared() -> None:
    store = RetainedStore()
    store.set(_m(b"x", 10, "edge-a"))
    assert store.set(_m(b"", 20, "edge-b"))
    assert _held(store) is None
    assert len(store) == 0
    assert not store.set(_m(b"late", 15, "edge-c"))  # set before the clear, arrived after it
    assert _held(store) is None
    assert [m.payload for m in store.state()] == [b""]  # the tombstone, for snapshots
    assert not list(store.all())
    assert store.set(_m(b"again", 30, "edge-c"))  # newer than the clear
    assert _held(store) == b"again"
    assert [m.payload for m in store.state()] == [b"again"]


def test_tombstones_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retained, "MAX_CLEARED", 3)
    store = RetainedStore()
    for i in range(5):
        store.set(_m(b"", 10 + i, "edge-a", topic=f"t/{i}"))
    assert [m.topic for m in store.state()] == ["t/2", "t/3", "t/4"]


def test_a_snapshot_keeps_tombstones_and_origins(tmp_path: Path) -> None:
    from broker_edge import store

    held = RetainedStore()
    held.set(_m(b"from a peer", 10, "edge-a", seq=3, topic="kept"))
    held.set(_m(b"x", 10, "edge-b", topic="cleared"))
    held.set(_m(b"", 20, "edge-c", seq=9, topic="cleared"))
    path = tmp_path / "snapshot.json"
    store.write_encoded(path, store.encode(1, [], list(held.state())))
    snapshot = store.load(path, max_queued=10, max_inflight=10, now=0.0)
    assert snapshot is not None
    restored = RetainedStore()
    for message in snapshot.retained:
        restored.set(message)
    versions = [(m.topic, m.payload, m.ts_us, m.origin, m.seq) for m in restored.state()]
    assert versions == [
        ("kept", b"from a peer", 10, "edge-a", 3),
        ("cleared", b"", 20, "edge-c", 9),
    ]
    assert not restored.set(_m(b"late", 15, "edge-b", topic="cleared"))  # still cleared


def test_one_nodes_own_publishes_replace_in_journal_order_whatever_its_clock() -> None:
    store = RetainedStore()
    assert store.set(_m(b"first", 20, "edge-a", seq=1))
    assert store.set(_m(b"second", 10, "edge-a", seq=2))  # the clock stepped back
    assert _held(store) == b"second"
    assert not store.set(_m(b"late copy", 30, "edge-a", seq=1))  # an older copy arriving late
    assert _held(store) == b"second"
