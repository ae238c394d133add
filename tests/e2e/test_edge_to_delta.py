"""End to end with real processes: edge → journal → pipeline → Delta `messages`.

Publish N QoS 1 messages with paho to an `edgebus edge` process, SIGKILL the edge, restart it on
the same journal, run `edgebus pipeline --once` and find every acknowledged message exactly once;
then SIGKILL a pipeline mid-run, rerun it, and still find each exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from ingest.journal import JournalReader
from sinks.delta import read_table

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EDGEBUS = [sys.executable, "-m", "edgebus.cli"]
ENV = {**os.environ, "PYSPARK_PYTHON": sys.executable}


def _start_edge(data_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [
            *EDGEBUS,
            "edge",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            str(data_dir),
            "--node-id",
            "e2e",
        ],
        stdout=subprocess.PIPE,
        stderr=log.open("ab"),
        env=ENV,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()  # "edgebus edge e2e on 127.0.0.1:PORT"
    assert " on 127.0.0.1:" in line, line
    return proc, int(line.rsplit(":", 1)[1])


def _publish_acked(port: int, count: int, prefix: str) -> list[bytes]:
    """Publish QoS 1 messages; return the payloads the edge acknowledged."""
    acked: list[bytes] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{prefix}")
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        # Logged by the edge before the publishes it acknowledges (the logs' typed columns).
        client.subscribe(f"cmd/{prefix}/#", qos=1)
        infos = []
        for i in range(count):
            payload = f'{{"vehicle":"{prefix}","i":{i}}}'.encode()
            infos.append((payload, client.publish(f"fleet/{prefix}/telemetry", payload, qos=1)))
        for payload, info in infos:
            info.wait_for_publish(30)
            if info.is_published():
                acked.append(payload)
    finally:
        client.disconnect()
        client.loop_stop()
    return acked


def _pipeline(data_dir: Path, lake: Path, config: Path) -> list[str]:
    return [
        *EDGEBUS,
        "pipeline",
        *("--data-dir", str(data_dir), "--lake", str(lake), "--config", str(config)),
        "--once",
    ]


def _payload_counts(lake: Path) -> Counter[bytes]:
    table = read_table(lake / "messages")
    keys = list(zip(table.column("node").to_pylist(), table.column("seq").to_pylist(), strict=True))
    assert len(keys) == len(set(keys)), "a (node, seq) appears twice"
    return Counter(table.column("payload").to_pylist())


def test_acknowledged_messages_land_exactly_once(tmp_path: Path) -> None:
    data_dir, lake, log = tmp_path / "data", tmp_path / "lake", tmp_path / "procs.log"
    config = tmp_path / "pipeline.toml"
    config.write_text("[pipeline]\nmax_records_per_batch = 300\ntrigger_interval_seconds = 0.2\n")

    edge, port = _start_edge(data_dir, log)
    acked = _publish_acked(port, 1000, "a")
    edge.send_signal(signal.SIGKILL)
    edge.wait(30)
    assert len(acked) == 1000

    edge, port = _start_edge(data_dir, log)  # recovers the journal, seq continues
    acked += _publish_acked(port, 500, "b")
    edge.send_signal(signal.SIGTERM)
    assert edge.wait(30) == 0

    # A pipeline killed mid-run: wait for its first Delta commit, then SIGKILL it.
    cmd = _pipeline(data_dir, lake, config)
    killed = subprocess.Popen(cmd, stderr=log.open("ab"), env=ENV)
    first_commit = lake / "messages" / "_delta_log" / f"{1:020d}.json"
    deadline = time.monotonic() + 240
    while not first_commit.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert killed.poll() is None, "pipeline finished before it could be killed mid-run"
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    partial = _payload_counts(lake)
    assert 0 < sum(partial.values()) < len(acked)

    done = subprocess.run(cmd, stderr=log.open("ab"), env=ENV, timeout=400, check=False)
    assert done.returncode == 0, log.read_text()[-4000:]
    counts = _payload_counts(lake)
    assert all(counts[p] == 1 for p in acked), "an acknowledged message is missing or doubled"
    assert sum(counts.values()) == len(acked)

    # Running again changes nothing.
    again = subprocess.run(cmd, stderr=log.open("ab"), env=ENV, timeout=400, check=False)
    assert again.returncode == 0
    assert _payload_counts(lake) == counts
    _assert_every_record_in_its_table_once(data_dir, lake)


def _assert_every_record_in_its_table_once(data_dir: Path, lake: Path) -> None:
    """Every journal record, the edge's log events and counters included, in its table once."""
    records = []
    for node in JournalReader.list_nodes(data_dir / "journal"):
        reader = JournalReader(data_dir / "journal" / node)
        for batch in reader.read(0, reader.last_seq()):
            records += batch.select(["node", "seq", "topic", "payload"]).to_pylist()

    def ids(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
        return sorted((r["node"], r["seq"]) for r in rows)

    device = [r for r in records if not r["topic"].startswith("$")]
    events = [r for r in records if r["topic"].startswith("$log/")]
    counters = [r for r in records if r["topic"] == "$counters/messages_in"]
    assert events, "the edge logged nothing"
    assert ids(read_table(lake / "messages", columns=["node", "seq"]).to_pylist()) == ids(device)
    assert ids(read_table(lake / "logs", columns=["node", "seq"]).to_pylist()) == ids(events)
    # usage sums the counters: each delta exactly once means the sums agree. (This edge runs
    # without a tenants file, so it publishes no counters: test_quota_loop covers usage.)
    if counters:
        journaled = sum(json.loads(r["payload"])["delta"] for r in counters)
        usage = read_table(lake / "usage", "metric = 'messages_in'", columns=["value"])
        assert sum(usage.column("value").to_pylist()) == journaled
    else:
        assert not (lake / "usage").exists()
    assert not (lake / "quarantine").exists(), "a valid record was quarantined"
    # What an analyst reads without parsing (issue 16 part 4), as a real edge's events and
    # payloads make it: each client's SUBSCRIBE, its filter, QoS and SUBACK code as columns,
    # and every payload as text.
    subscribes = read_table(
        lake / "logs", "event_type = 'subscribe'", ["client_id", "topic", "qos", "reason_code"]
    ).to_pylist()
    assert sorted(tuple(row.values()) for row in subscribes) == [
        ("pub-a", "cmd/a/#", 1, 1),
        ("pub-b", "cmd/b/#", 1, 1),
    ]
    messages = read_table(lake / "messages", columns=["payload", "payload_text"]).to_pylist()
    assert all(row["payload_text"] == row["payload"].decode() for row in messages)
