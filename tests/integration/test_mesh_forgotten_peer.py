"""A peer gone for good (broker_edge.mesh, "Peers gone for good"): with two real ``edgebus edge``
processes, edge-b (which dials edge-a, and is listed by it) is stopped while edge-a's journal
holds what b is due; once b has been away longer than ``peer_expiry_hours``, a's retention no
longer keeps it, and b, back, is linked as any and gets what the journal still holds."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import pytest

from ingest.journal import JournalGapError, JournalReader
from sinks.mqtt import DecisionPublisher
from tests.helpers.edge_process import OPERATOR_TOKEN, TENANT_TOKEN, TENANTS, EdgeProcess
from tests.helpers.mesh_clients import SETTLE, settle
from tests.helpers.mesh_edges import sys_values

TINY_EXPIRY = 0.0005  # hours: 1.8 s
BIG = 500  # bytes of payload: a few records fill a 4 KiB segment


def _config(path: Path, expiry: float, peer: EdgeProcess | None) -> Path:
    peers = f'peers = ["127.0.0.1:{peer.mqtt_port}"]\n' if peer is not None else ""
    path.write_text(
        "[edge]\ncounter_interval = 60.0\nsys_interval = 1.0\njournal_segment_bytes = 4096\n"
        f"journal_retention_hours = 0.0\npeer_expiry_hours = {expiry}\n{peers}"
    )
    return path


def _journal(edge: EdgeProcess) -> set[bytes]:
    """The payloads of ``edge``'s journal now."""
    for _ in range(50):
        reader = JournalReader(edge.data_dir / "journal" / edge.node)
        first = reader.first_seq() or 1
        try:
            return {r["payload"] for r in reader.read_records(first - 1, reader.last_seq())}
        except JournalGapError:  # retention removed the oldest segment under the read
            continue
    raise AssertionError("the journal's oldest segment kept going while it was read")


def _until(what: str, done: Any) -> None:
    deadline = time.monotonic() + SETTLE
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _events(operator: Any, wanted: str, peer: str) -> list[dict[str, Any]]:
    """The operator's ``$log/mesh`` events up to ``wanted`` about ``peer`` (fails at SETTLE)."""
    seen = []
    while True:
        doc = json.loads(operator.get(timeout=SETTLE).payload)
        seen.append(doc)
        if doc["event"] == wanted and doc["details"]["peer"] == peer:
            return seen


def _drain(operator: Any) -> list[dict[str, Any]]:
    """The operator's events received so far (until none comes for half a second)."""
    seen = []
    while True:
        try:
            seen.append(json.loads(operator.get(timeout=0.5).payload))
        except queue.Empty:
            return seen


@pytest.mark.parametrize("expiry", [TINY_EXPIRY, 0.0])
def test_a_peer_away_past_its_expiry_no_longer_holds_the_journal(
    tmp_path: Path, make_client: Any, expiry: float
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    b_config = _config(tmp_path / "b.toml", expiry, None)
    b = EdgeProcess(tmp_path / "b", "edge-b", tenants, tmp_path / "b.log", config=b_config)
    a = EdgeProcess(tmp_path / "a", "edge-a", tenants, tmp_path / "a.log")
    try:
        b.start().stop()  # its port is known now: a lists it (and keeps dialing it)
        a.config = _config(tmp_path / "a.toml", expiry, b)
        a.start()
        _config(b_config, expiry, a)
        b.start()
        _check(a, b, make_client, expiry)
    finally:
        b.stop()
        a.stop()


def _check(a: EdgeProcess, b: EdgeProcess, make_client: Any, expiry: float) -> None:
    operator = make_client(port=a.mqtt_port, username=OPERATOR_TOKEN)
    operator.subscribe("$log/mesh/#")
    sub = make_client("durable", port=b.mqtt_port, username=TENANT_TOKEN, clean_session=False)
    sub.subscribe("fleet/#", qos=1)
    pub = make_client(port=a.mqtt_port, username=TENANT_TOKEN)
    settle(pub, [sub], "fleet/probe")
    before = [b"%d-" % i + b"f" * BIG for i in range(12)]  # sealed segments b does not want
    for payload in before:
        pub.publish("other/x", payload, qos=1)
    sub.close()
    b.stop()
    stopped = time.monotonic()
    _events(operator, "link_down", "edge-b")
    due = [b"due-%d-" % i + b"r" * BIG for i in range(20)]
    for payload in due:
        pub.publish("fleet/x", payload, qos=1)
    for i in range(12):  # seal the segments holding them
        pub.publish("other/y", b"%d-" % i + b"g" * BIG, qos=1)
    assert set(due) <= _journal(a)

    # b away longer than the tiny expiry: forgotten (logged), or not without one.
    if expiry:
        events = _events(operator, "peer_forgotten", "edge-b")
        [forgotten] = [e for e in events if e["event"] == "peer_forgotten"]
        assert forgotten["details"]["away_seconds"] >= TINY_EXPIRY * 3600
        assert forgotten["details"]["dropped"] == len(due)  # what it was due, given up
    else:
        time.sleep(max(0.0, stopped + 2 * TINY_EXPIRY * 3600 + 1 - time.monotonic()))
    state = "forgotten" if expiry else "down"
    topic = "$SYS/broker/mesh/inbound/edge-b"
    sys_values(a.mqtt_port, topic, lambda values: values.get(topic) == state)

    # The lake committed everything: retention ran once what only the lake wanted went.
    reader = JournalReader(a.data_dir / "journal" / a.node)
    notice = DecisionPublisher([("127.0.0.1", a.mqtt_port)], OPERATOR_TOKEN)
    assert notice.publish_committed(a.node, reader.last_seq()) == []
    # (The segment with the last of them may hold the first that b is due.)
    _until("retention never ran", lambda: before[0] not in _journal(a))
    if expiry:
        _until("what b was due was kept", lambda: not set(due) & _journal(a))
    else:
        assert set(due) <= _journal(a)  # b still holds it
        assert "peer_forgotten" not in {e["event"] for e in _drain(operator)}
        return

    # b comes back: linked as any, it gets what the journal still holds of what it is due.
    after = [b"after-%d" % i for i in range(5)]
    for payload in after:
        pub.publish("fleet/x", payload, qos=1)
    b.start()
    _events(operator, "link_up", "edge-b")
    sys_values(a.mqtt_port, topic, lambda values: values.get(topic) == "up")
    back = make_client("durable", port=b.mqtt_port, username=TENANT_TOKEN, clean_session=False)
    got = []
    while len(got) < len(after):
        try:
            got.append(back.get(timeout=SETTLE).payload)
        except queue.Empty:
            break
    assert got == after
    back.nothing_more()
