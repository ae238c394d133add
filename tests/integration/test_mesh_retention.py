"""The journal's retention (issue 9) in a mesh (issue 11): the origin's journal is its peers'
replication log, so retention keeps what a peer has not acknowledged, until the disk budget
says otherwise. Two edges in this process (their state is read on their loops), linked with a
mesh token, and stock paho clients; edge "b" dials edge "a"."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from v5_publisher import V5Publisher

from broker_edge.meshlink import Mesh
from broker_edge.settings import EdgeSettings
from ingest.journal import JournalGapError, JournalReader
from tests.helpers.mesh_clients import SETTLE, settle
from tests.integration.conftest import RunningEdge
from tests.integration.test_mesh_links import TOKEN, _until

SEGMENT = 4096
BIG = 500  # bytes of payload: a few records fill a segment


class Pair:
    """Edge "a" (segments of 4 KiB, retention as soon as the lake committed) and edge "b",
    which dials it; either may be stopped and started again on its data dir."""

    def __init__(self, base: EdgeSettings, **a_settings: Any) -> None:
        base = replace(
            base,
            mesh_token=TOKEN,
            journal_segment_bytes=SEGMENT,
            journal_retention_hours=0.0,
        )
        self.a_settings = replace(base, node_id="a", data_dir=base.data_dir / "a", **a_settings)
        self.b_settings = replace(base, node_id="b", data_dir=base.data_dir / "b")
        self.a: RunningEdge | None = None
        self.b: RunningEdge | None = None

    def start_a(self) -> RunningEdge:
        self.a = RunningEdge(self.a_settings).start()
        return self.a

    def start_b(self) -> RunningEdge:
        assert self.a is not None
        peers = (f"127.0.0.1:{self.a.port}",)
        self.b = RunningEdge(replace(self.b_settings, peers=peers)).start()
        return self.b

    def stop_a(self) -> None:
        if self.a is not None:
            self.a.stop()
            self.a = None

    def stop_b(self) -> None:
        if self.b is not None:
            self.b.stop()
            self.b = None


@pytest.fixture
def pair(edge_settings: EdgeSettings) -> Iterator[Pair]:
    edges = Pair(edge_settings)
    yield edges
    edges.stop_b()
    edges.stop_a()


@pytest.fixture
def budget_pair(edge_settings: EdgeSettings) -> Iterator[Pair]:
    edges = Pair(edge_settings, journal_max_bytes=6 * SEGMENT)
    yield edges
    edges.stop_b()
    edges.stop_a()


def _mesh(edge: RunningEdge) -> Mesh:
    assert edge.node.mesh is not None
    return edge.node.mesh


def _journal(edge: RunningEdge) -> dict[bytes, int]:
    """Payload -> seq of every record in ``edge``'s journal now."""
    for _ in range(50):
        reader = JournalReader(edge.settings.journal_root / edge.settings.node_id)
        first = reader.first_seq() or 1
        try:
            return {
                r["payload"]: r["seq"] for r in reader.read_records(first - 1, reader.last_seq())
            }
        except JournalGapError:  # retention removed the oldest segment under the read
            continue
    raise AssertionError("the journal's oldest segment kept going while it was read")


def _b_away(pair: Pair, make_client: Any) -> tuple[RunningEdge, Any]:
    """A persistent session on b subscribed to ``ret/#`` (a routes it there), records b does
    not want filling segments of a's journal, then b stopped: edge a and a publisher on it."""
    a = pair.start_a()
    b = pair.start_b()
    sub = make_client("durable", port=b.port, clean_session=False)
    sub.subscribe("ret/#", qos=1)
    pub = make_client("pub", port=a.port)
    settle(pub, [sub], "ret/probe")
    for i in range(12):  # sealed segments that only the lake wants
        pub.publish("other/x", b"%d" % i + b"f" * BIG, qos=1)
    # b acknowledged all of it before it goes: else (a loaded host, b's acknowledgement not
    # sent yet) a keeps every record for b, retention frees nothing, and the budget gives up
    # these set-up records instead of the ones a test publishes next.
    committer = a.node._committer
    assert committer is not None
    written: int = a.call(lambda: committer.durable_seq)
    _until(a, lambda: committer.peer_acked.get("b", 0) >= written)
    sub.close()
    pair.stop_b()
    _until(a, lambda: _mesh(a).inbound_states.get("b") == "down")
    return a, pub


def _lake_committed_everything(a: RunningEdge) -> int:
    """What the pipeline's journal notice does (tests/integration/test_edge_journal_faults
    sends the real one): the lake has every durable record of a."""
    assert a.node.broker is not None
    assert a.node._committer is not None
    committed: int = a.call(lambda: a.node._committer.durable_seq)  # type: ignore[union-attr]
    a.call(a.node.broker.journal_committed, committed)
    return committed


def test_retention_keeps_what_a_stopped_peer_has_not_acknowledged(
    pair: Pair, make_client: Any
) -> None:
    """The lake committed everything, b is stopped: the segments before the first record b is
    due go, the ones holding what b is due stay, and a restarted a (which rebuilds what b is
    due from its journal) still gives b every one."""
    a, pub = _b_away(pair, make_client)
    due = [b"r%d-" % i + b"r" * BIG for i in range(20)]
    for payload in due:
        pub.publish("ret/x", payload, qos=1)
    for i in range(12):  # seal the segments holding them
        pub.publish("other/y", b"%d" % i + b"g" * BIG, qos=1)
    seqs = _journal(a)
    assert a.node._committer is not None
    committer = a.node._committer
    _lake_committed_everything(a)
    _until(a, lambda: committer.segments_removed > 0)  # retention ran
    left = _journal(a)
    assert seqs[b"0" + b"f" * BIG] not in left.values()  # what b acknowledged went
    assert [payload for payload in due if payload not in left] == []  # what it is due stays
    pub.close()

    # a restarts (its Unacked rebuilt from the journal), then b comes back.
    pair.stop_a()
    a = pair.start_a()
    pair.start_b()
    back = make_client("durable", port=pair.b.port, clean_session=False)  # type: ignore[union-attr]
    assert [back.get(timeout=SETTLE).payload for _ in due] == due
    back.nothing_more()


def test_the_disk_budget_wins_over_a_peer_away_and_says_what_it_dropped(
    budget_pair: Pair, make_client: Any
) -> None:
    """b is away while a's journal fills to its budget with what b is due: once the lake
    committed it, a removes the oldest segments anyway (publishes are taken again), logs
    ``peer_dropped`` naming b and the seqs, and b, back, gets exactly the rest, in order."""
    a, _ = _b_away(budget_pair, make_client)
    operator = make_client(port=a.port, username=a.node._local_token)
    operator.subscribe("$log/journal/#")
    v5 = V5Publisher(a.port, None)
    accepted: list[bytes] = []
    seqs: dict[bytes, int] = {}
    drops: list[dict[str, Any]] = []
    try:
        # Fill the journal, have the lake commit it: retention first removes what only the
        # lake wanted (b's acknowledged records, a's own events); once that is not enough,
        # the budget removes what b is due.
        for _ in range(5):
            code = 0
            while code == 0:
                payload = b"r%d-" % len(accepted) + b"r" * BIG
                code = v5.publish(payload, topic="ret/x")
                if code == 0:
                    accepted.append(payload)
                assert len(accepted) < 500, "the journal never filled up"
            assert code == 0x97
            seqs.update(_journal(a))
            _lake_committed_everything(a)
            while (doc := json.loads(operator.get(timeout=SETTLE).payload))["event"] != (
                "journal_resumed"
            ):
                if doc["event"] == "peer_dropped":
                    drops.append(doc["details"])
            if drops:
                break
        # Taken again, with room to spare. The events read may be an earlier round's (a round
        # can resume twice), so the journal may still be freeing what this round filled.
        deadline = time.monotonic() + SETTLE
        while (code := v5.publish(b"after", topic="other/z")) == 0x97:
            assert time.monotonic() < deadline, "publishes were never taken again"
            time.sleep(0.1)
        assert code == 0
    finally:
        v5.close()
    assert {drop["peer"] for drop in drops} == {"b"}
    for before, after in itertools.pairwise(drops):
        assert after["first"] > before["last"]  # each seq given up once
    last = drops[-1]["last"]
    assert drops[0]["first"] <= seqs[accepted[0]] <= last
    assert last < seqs[accepted[-1]]  # only enough to be under budget
    gone = [p for p in accepted if seqs[p] <= last]
    assert sum(drop["dropped"] for drop in drops) == len(gone)  # b's own, dropped for it
    assert not set(gone) & set(_journal(a))

    # a restarts with room (no more drops while b comes back): b gets what a's journal still
    # holds of what it is due, in order, and nothing that was given up.
    budget_pair.stop_a()
    budget_pair.a_settings = replace(budget_pair.a_settings, journal_max_bytes=0)
    left = _journal(budget_pair.start_a())
    rest = [p for p in accepted if p in left]
    assert rest
    assert rest == accepted[len(accepted) - len(rest) :]  # the oldest went
    assert not set(gone) & set(rest)
    budget_pair.start_b()
    back = make_client("durable", port=budget_pair.b.port, clean_session=False)  # type: ignore[union-attr]
    assert [back.get(timeout=SETTLE).payload for _ in rest] == rest
    back.nothing_more()
