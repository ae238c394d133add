"""Peers gone for good (broker_edge.mesh, "Peers gone for good"): the away clock, sans-IO with
a fake clock, and an origin's Mesh forgetting a peer without sockets."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_sysstats import FakeJournal

from broker_edge import mesh
from broker_edge.broker import Broker
from broker_edge.mesh import Absences, MeshState, MeshStateError, PeerState
from broker_edge.meshlink import FORGOTTEN, Mesh
from broker_edge.message import Message
from broker_edge.packets import QoS
from broker_edge.settings import EdgeSettings
from schemas.journal import DEFAULT_TENANT

S = 1_000_000  # a second, in microseconds
HOUR = 3600 * S
GRACE = 60 * S


def test_a_peer_away_longer_than_the_expiry_is_forgotten_once() -> None:
    absences = Absences(2 * HOUR, 0, GRACE)
    absences.down("b", 10 * S)
    absences.down("c", HOUR)
    absences.down("b", 20 * S)  # a second link going down does not move the clock
    assert absences.expire(2 * HOUR + 10 * S) == []  # not longer than the expiry yet
    assert absences.expire(2 * HOUR + 11 * S) == [("b", 2 * HOUR + S)]
    assert absences.forgotten == {"b"}
    assert absences.expire(2 * HOUR + 12 * S) == []  # said once
    assert absences.seen("b", 5 * HOUR) == 10 * S
    assert absences.expire(3 * HOUR + S) == [("c", 2 * HOUR + S)]


def test_a_peer_back_in_time_is_not_forgotten_and_one_forgotten_is_back() -> None:
    absences = Absences(HOUR, 0, GRACE)
    absences.down("b", 0)
    assert absences.up("b") is False  # it was not forgotten
    assert absences.seen("b", 2 * HOUR) == 2 * HOUR  # up: seen now
    assert absences.expire(2 * HOUR) == []
    absences.down("b", 2 * HOUR)
    assert absences.expire(3 * HOUR + S) == [("b", HOUR + S)]
    assert absences.up("b") is True
    assert absences.forgotten == set()
    assert absences.up("b") is False
    absences.down("b", 4 * HOUR)  # the clock starts again from its last time up
    assert absences.expire(5 * HOUR) == []
    assert absences.expire(5 * HOUR + S) == [("b", HOUR + S)]


def test_no_expiry_never_forgets() -> None:
    absences = Absences(0, 0, GRACE)
    absences.down("b", 0)
    assert absences.expire(10_000 * HOUR) == []


def test_a_restarted_edge_keeps_the_clock_and_gives_peers_the_grace_to_dial_in() -> None:
    started = 100 * HOUR  # this edge was down for days
    absences = Absences(24 * HOUR, started, GRACE)
    absences.restore("b", 10 * HOUR, False, started)  # last up before this edge stopped
    absences.restore("c", None, False, started)  # a snapshot that did not say: from now
    absences.restore("d", 99 * HOUR, True, started)  # forgotten stays forgotten
    absences.restore("e", started + HOUR, False, started)  # a clock that went back: now
    assert absences.forgotten == {"d"}
    assert absences.expire(started + GRACE - 1) == []  # b may be up and dialing
    absences.up("e")
    assert absences.expire(started + GRACE) == [("b", 90 * HOUR + GRACE)]
    assert absences.expire(started + 24 * HOUR + S) == [("c", 24 * HOUR + S)]
    # With an expiry shorter than the grace, the expiry is the grace.
    short = Absences(2 * S, started, GRACE)
    short.restore("b", 0, False, started)
    assert short.expire(started + S) == []
    assert short.expire(started + 2 * S) == [("b", started + 2 * S)]


def test_the_mesh_state_keeps_when_a_peer_was_seen_and_whether_it_is_forgotten() -> None:
    state = MeshState(
        {
            "b": PeerState(41, {"acme": ["fleet/#"]}, {}, 1_700_000_000_000_000, False),
            "c": PeerState(7, {"acme": ["x/#"]}, {}, 5, True),
        },
        {},
    )
    doc = json.loads(json.dumps(state.doc()))
    assert MeshState.of(doc) == state
    assert state.floor() == 41  # the forgotten one is due nothing: not read for it
    assert MeshState({"c": state.peers["c"]}, {}).floor() is None
    older = {"peers": {"b": {"acked": 3, "filters": {}}}}  # a snapshot of an earlier release
    assert MeshState.of(older).peers["b"] == PeerState(3, {}, {}, None, False)


@pytest.mark.parametrize(
    "peer",
    [
        {"acked": 1, "filters": {}, "seen": -1},
        {"acked": 1, "filters": {}, "seen": "yesterday"},
        {"acked": 1, "filters": {}, "seen": 1.5},
        {"acked": 1, "filters": {}, "forgotten": 1},
        {"acked": 1, "filters": {}, "forgotten": None},
    ],
)
def test_a_bad_away_clock_in_a_mesh_state_is_an_error(peer: dict[str, Any]) -> None:
    with pytest.raises(MeshStateError, match="seen must be a time"):
        MeshState.of({"peers": {"b": peer}})


# -- an origin's Mesh, no sockets --------------------------------------------------------------


class Clock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


class DurableJournal(FakeJournal):
    """Everything appended is durable at once (what tell_acked bounds the peers' seqs by)."""

    durable_seq = 1_000
    peer_acked: dict[str, int]


def _origin(clock: Clock, expiry_hours: float) -> tuple[Mesh, DurableJournal]:
    journal = DurableJournal()
    broker = Broker(EdgeSettings(node_id="a"), journal, wall_clock_us=clock)
    settings = EdgeSettings(node_id="a", peer_expiry_hours=expiry_hours)
    return Mesh(broker, settings, lambda: None), journal


def _message(seq: int, topic: str = "fleet/v1") -> Message:
    return Message(DEFAULT_TENANT, topic, b"m", QoS.AT_LEAST_ONCE, False, "dev", 1, seq=seq)


def _events(journal: FakeJournal, event: str) -> list[dict[str, Any]]:
    return [
        json.loads(fields[6])  # type: ignore[arg-type]
        for fields in journal.records
        if fields[3] == f"$log/mesh/{event}"
    ]


def test_an_origin_forgets_a_peer_away_too_long_and_keeps_it_forgotten_across_a_restart() -> None:
    clock = Clock(10 * HOUR)
    origin, journal = _origin(clock, 1.0)
    away_since = 10 * HOUR - 30 * 60 * S  # down half an hour before this edge's last stop
    state = MeshState(
        {
            "b": PeerState(5, {DEFAULT_TENANT: ["fleet/#"]}, {}, away_since),
            "c": PeerState(5, {DEFAULT_TENANT: ["fleet/#"]}, {}, None),
        },
        {},
    )
    origin.restore(state)
    for seq in (5, 6, 7):
        origin.replay(_message(seq))
    origin.replayed_all()
    assert list(origin.unacked["b"].frames) == [6, 7]
    assert journal.peer_acked == {"b": 5, "c": 5}  # both hold the journal

    clock.now = away_since + HOUR  # b: an hour away, not longer
    origin.expire()
    assert _events(journal, "peer_forgotten") == []
    clock.now += S
    origin.expire()
    [event] = _events(journal, "peer_forgotten")
    assert event["details"] == {"peer": "b", "away_seconds": 3601.0, "dropped": 2}
    assert not origin.unacked["b"].frames
    assert origin.unacked["b"].dropped == 2  # given up, counted
    assert dict(origin.sys_values())["publish/unacked_dropped"] == "2"
    assert dict(origin.sys_values())["inbound/b"] == FORGOTTEN
    assert journal.peer_acked == {"c": 5}  # the journal's floor ignores b
    assert origin.state_changed  # the next snapshot says so
    origin.expire()
    assert len(_events(journal, "peer_forgotten")) == 1  # once

    # Nothing is kept for it any more: a QoS 1 publish it wants waits for c alone.
    origin.forward(_message(8))
    assert list(origin.pending) == [8]
    origin._durable(8, {"b": b"frame", "c": b"frame"})  # routed before it was forgotten
    assert list(origin.unacked["b"].frames) == []
    assert list(origin.unacked["c"].frames) == [6, 7, 8]

    # Restarted: b is still forgotten (its Unacked is not rebuilt, its seqs not read).
    saved = MeshState.of(json.loads(json.dumps(origin.state(8).doc())))
    assert saved.peers["b"].forgotten
    assert saved.peers["b"].seen_us == away_since
    assert saved.peers["c"].seen_us == 10 * HOUR  # counted from the restore
    assert saved.floor() == 5
    again, journal = _origin(clock, 1.0)
    again.restore(saved)
    for seq in (6, 7, 8):
        again.replay(_message(seq))
    again.replayed_all()
    assert list(again.unacked["b"].frames) == []
    assert list(again.unacked["c"].frames) == [6, 7, 8]
    assert journal.peer_acked == {"c": 5}
    assert dict(again.sys_values())["inbound/b"] == FORGOTTEN


def test_without_an_expiry_a_peer_away_holds_the_journal_for_ever() -> None:
    clock = Clock(0)
    origin, journal = _origin(clock, 0.0)
    origin.restore(MeshState({"b": PeerState(5, {DEFAULT_TENANT: ["fleet/#"]}, {}, 0)}, {}))
    origin.replay(_message(6))
    origin.replayed_all()
    clock.now = 10_000 * HOUR
    origin.expire()
    assert _events(journal, "peer_forgotten") == []
    assert list(origin.unacked["b"].frames) == [6]
    assert journal.peer_acked == {"b": 5}
    assert not origin.state(6).peers["b"].forgotten


def test_a_restored_peer_is_not_forgotten_before_the_grace() -> None:
    clock = Clock(100 * HOUR)
    origin, journal = _origin(clock, 1.0)
    origin.restore(MeshState({"b": PeerState(5, {}, {}, 0)}, {}))
    origin.replayed_all()
    clock.now += round(mesh.START_GRACE * S) - 1
    origin.expire()
    assert journal.peer_acked == {"b": 1_000}
    clock.now += 1
    origin.expire()
    assert journal.peer_acked == {}
    assert [e["details"]["peer"] for e in _events(journal, "peer_forgotten")] == ["b"]
