"""A real edge whose journal disk fails or fills up, with real paho clients (issue 9).

Faults are injected in the journal's file layer (``ingest.journal.FileOps``); the disk budget is
a real ``journal_max_bytes``; retention runs on the pipeline's real notice, published by the
pipeline's real publisher (``sinks.mqtt.DecisionPublisher.publish_committed``)."""

from __future__ import annotations

import errno
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from v5_publisher import V5Publisher

from ingest.journal import FileOps, JournalReader, list_segments
from sinks.mqtt import DecisionPublisher

TIMEOUT = 10.0
SYS = "$SYS/broker/journal/"


class FailingSync(FileOps):
    """The real file layer; ``fail(err, n)`` makes the next ``n`` syncs raise ``err``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[int] = []
        self.failed = threading.Event()  # set once the last armed fault fired

    def fail(self, err: int, times: int) -> None:
        with self._lock:
            self._errors.extend([err] * times)
            self.failed.clear()

    def datasync(self, fd: int) -> None:
        with self._lock:
            err = self._errors.pop(0) if self._errors else 0
            if err and not self._errors:
                self.failed.set()
        if err:
            raise OSError(err, os.strerror(err))
        super().datasync(fd)


def watch(make_client: Any, port: int) -> Any:
    """The operator, watching its $log and the journal's $SYS values."""
    operator = make_client(port=port, username="op-token")
    operator.subscribe("$log/journal/#")
    return operator


def next_event(client: Any) -> dict[str, Any]:
    while True:
        msg = client.get()
        if msg.topic.startswith("$log/journal/"):
            doc: dict[str, Any] = json.loads(msg.payload)
            assert msg.topic == f"$log/journal/{doc['event']}"
            return doc


def sys_value(make_client: Any, port: int, topic: str, want: bytes) -> None:
    """Wait until the retained ``$SYS`` value of ``topic`` is ``want`` (a new client each
    time: retained values are what a late subscriber sees)."""
    deadline = time.monotonic() + TIMEOUT
    seen = None
    while time.monotonic() < deadline:
        client = make_client(port=port, username="op-token")
        client.subscribe(SYS + topic)
        try:
            seen = client.get(timeout=1.0).payload
        except queue.Empty:
            seen = None
        client.close()
        if seen == want:
            return
    pytest.fail(f"{SYS}{topic} is {seen!r}, expected {want!r}")


def journal_payloads(edge: Any) -> list[bytes]:
    reader = JournalReader(edge.settings.journal_root / edge.settings.node_id)
    rows = [r for b in reader.read(0, reader.last_seq()) for r in b.to_pylist()]
    return [r["payload"] for r in rows if r["topic"] == "fleet/v1/telemetry"]


def test_v5_failed_sync_is_refused_then_the_edge_resumes_by_itself(
    make_edge: Any, make_client: Any, tenants_file: Path
) -> None:
    files = FailingSync()
    edge = make_edge(tenants=tenants_file, files=files, sys_interval=0.2)
    operator = watch(make_client, edge.port)
    pub = V5Publisher(edge.port, "acme-1")
    try:
        assert pub.publish(b"before") == 0
        files.fail(errno.EIO, 3)  # the frame, then two retries a second apart
        assert pub.publish(b"lost") == 0x80  # its frame failed: refused, not left waiting
        event = next_event(operator)
        assert event["event"] == "journal_error"
        assert "Input/output error" in event["details"]["error"]
        sys_value(make_client, edge.port, "state", b"error")
        assert pub.publish(b"while failing") == 0x80  # refused at once
        assert files.failed.wait(TIMEOUT)
        assert next_event(operator)["event"] == "journal_resumed"
        sys_value(make_client, edge.port, "state", b"ok")
        assert pub.publish(b"after") == 0
    finally:
        pub.close()
    # Exactly the acknowledged publishes, each once; the refused ones are not in the journal.
    assert journal_payloads(edge) == [b"before", b"after"]


def test_311_failed_sync_closes_the_connection_and_the_resend_lands_once(
    make_edge: Any, make_client: Any, tenants_file: Path
) -> None:
    files = FailingSync()
    edge = make_edge(tenants=tenants_file, files=files)
    operator = watch(make_client, edge.port)
    pub = make_client("dev-311", port=edge.port, username="acme-1", clean_session=False)
    pub.publish("fleet/v1/telemetry", b"one", qos=1)
    files.fail(errno.ENOSPC, 2)
    info = pub.paho.publish("fleet/v1/telemetry", b"two", qos=1)
    assert pub.disconnected.wait(TIMEOUT)  # 3.1.1 has no negative PUBACK: closed
    assert next_event(operator)["event"] == "journal_error"
    assert files.failed.wait(TIMEOUT)
    assert next_event(operator)["event"] == "journal_resumed"
    # paho reconnects by itself (1 s, then 2 s, ... apart) and resends the unacknowledged QoS 1
    # publish (a second, explicit reconnect could drop the connection between the resend and
    # its PUBACK: then paho resends once more, a legitimate QoS 1 duplicate).
    info.wait_for_publish(3 * TIMEOUT)
    assert info.is_published()
    pub.publish("fleet/v1/telemetry", b"three", qos=1)
    assert journal_payloads(edge) == [b"one", b"two", b"three"]


def test_budget_refuses_with_0x97_and_retention_on_the_lake_notice_resumes(
    make_edge: Any, make_client: Any, tenants_file: Path
) -> None:
    edge = make_edge(
        tenants=tenants_file,
        journal_segment_bytes=4096,
        journal_max_bytes=5 * 4096,
        journal_retention_hours=0.0,
        sys_interval=0.2,
    )
    node_dir = edge.settings.journal_root / edge.settings.node_id
    operator = watch(make_client, edge.port)
    pub = V5Publisher(edge.port, "acme-1")
    sub = make_client(port=edge.port, username="acme-1")
    sub.subscribe("fleet/#")
    try:
        sent = 0
        code = 0
        while code == 0:
            code = pub.publish(b"x" * 500 + b"%d" % sent)
            sent += 1
            assert sent < 1000, "the journal never filled up"
        assert code == 0x97
        accepted = sent - 1
        event = next_event(operator)
        assert event["event"] == "journal_full"
        assert "journal_max_bytes" in event["details"]["reason"]
        sys_value(make_client, edge.port, "state", b"full")
        # QoS 0 while full: dropped (no subscriber sees it) and counted.
        pub.paho.publish("fleet/v1/telemetry", b"qos0 while full", qos=0)
        pub.acks.get(timeout=TIMEOUT)  # paho reports a QoS 0 publish once it is sent
        sys_value(make_client, edge.port, "publish/dropped", b"1")
        received = [sub.get().payload for _ in range(accepted)]
        assert b"qos0 while full" not in received
        sub.nothing_more()
        before = list_segments(node_dir)

        # The pipeline committed everything: retention frees the sealed segments at once.
        committed = edge.node._committer.durable_seq
        notice = DecisionPublisher([("127.0.0.1", edge.port)], "op-token")
        assert notice.publish_committed(edge.settings.node_id, committed) == []
        assert next_event(operator)["event"] == "journal_resumed"
        sys_value(make_client, edge.port, "committed_seq", str(committed).encode())

        def only_uncommitted_sealed() -> bool:
            firsts = [first for first, _ in list_segments(node_dir)]
            return all(next_first - 1 > committed for next_first in firsts[1:])

        # The segment being written when retention ran is never deleted; if the $SYS readers'
        # log events then sealed it with only committed records in it, the next retention pass
        # (every second) deletes it.
        deadline = time.monotonic() + TIMEOUT
        while not only_uncommitted_sealed() and time.monotonic() < deadline:
            time.sleep(0.1)
        after = list_segments(node_dir)
        firsts = [first for first, _ in after]
        # Every sealed segment the lake committed is gone; what is left starts at or before
        # the first uncommitted seq (the edge's own log events, connects and disconnects of
        # the $SYS readers, are journaled while full and may have sealed a segment since).
        assert firsts[0] > before[0][0]
        assert firsts[0] <= committed + 1
        assert all(next_first - 1 > committed for next_first in firsts[1:])
        assert pub.publish(b"after") == 0
    finally:
        pub.close()
    # Nothing acknowledged was removed before the lake had it: the reader reads what is left
    # from the active segment on, and says which seqs retention removed.
    reader = JournalReader(node_dir)
    assert reader.first_seq() == after[0][0]


def test_a_notice_for_another_node_or_past_the_journal_deletes_nothing(
    make_edge: Any, make_client: Any, tenants_file: Path
) -> None:
    edge = make_edge(tenants=tenants_file, journal_segment_bytes=4096, journal_retention_hours=0.0)
    node_dir = edge.settings.journal_root / edge.settings.node_id
    pub = V5Publisher(edge.port, "acme-1")
    try:
        for i in range(40):
            assert pub.publish(b"y" * 500 + b"%d" % i) == 0
    finally:
        pub.close()
    before = list_segments(node_dir)
    assert len(before) >= 3
    notice = DecisionPublisher([("127.0.0.1", edge.port)], "op-token")
    assert notice.publish_committed("some-other-node", 10**6) == []
    assert notice.publish_committed(edge.settings.node_id, 10**9) == []  # past the journal
    # Wait for the commit thread's maintenance tick (every second) to pass.
    probe = watch(make_client, edge.port)
    probe.nothing_more(wait=1.5)
    assert set(before) <= set(list_segments(node_dir))  # (log events may have added one)
    # Tenants may not send notices: "$control" is the operator's.
    acme = make_client(port=edge.port, username="acme-1", protocol=mqtt.MQTTv5)
    info = acme.paho.publish(f"$control/journal/{edge.settings.node_id}", b"{}", qos=1)
    info.wait_for_publish(TIMEOUT)
    probe.nothing_more(wait=1.5)
    assert set(before) <= set(list_segments(node_dir))
