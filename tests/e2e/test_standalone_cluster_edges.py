"""``edgebus pipeline --master spark://... --edge ... --edge ...`` on a real Spark standalone
cluster (issue 12): two ``edgebus edge`` processes with their own data dirs, which the pipeline
is never told about, serve their journals over HTTP; the executors fetch the ranges from the
edges, every acknowledged publish lands once in ``messages``, and each edge gets its node's
retained journal notice; a driver SIGKILLed mid-run and run again, then a worker SIGKILLed
mid-run (the other one finishes the run), leave every record once, in ``messages`` and in
``logs`` (the edges' log events). One cluster for the cluster tests: an application's start
(driver, executors) is most of what they cost."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from edge_process import (  # noqa: F401 (two_edges: the fixture)
    OPERATOR_TOKEN,
    EdgeProcess,
    publish_acked,
    retained_notice,
    two_edges,
)

from bench.cluster import Cluster, standalone_cluster
from sinks.delta import read_table

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def commit_file(lake: Path, version: int) -> Path:
    return lake / "messages" / "_delta_log" / f"{version:020d}.json"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Two workers of one core each."""
    with standalone_cluster(tmp_path, workers=2, cores=1) as running:
        yield running


def wait_for_commit(path: Path, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # another process's commit: there is no event to await
    assert process.poll() is None, log.read_text()[-3000:]


def test_a_standalone_cluster_reads_two_edges_over_http(
    cluster: Cluster,
    two_edges: list[EdgeProcess],  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    a, b = two_edges
    sent = {
        "edge-a": publish_acked(a.mqtt_port, "a", 300),
        "edge-b": publish_acked(b.mqtt_port, "b", 250),
    }
    lake, workdir = tmp_path / "lake", tmp_path / "pipeline"
    workdir.mkdir()  # its default data dir (./data) does not exist: no local journal
    command = [
        sys.executable,
        "-m",
        "edgebus.cli",
        "pipeline",
        *("--master", cluster.url, "--lake", str(lake), "--tenants", str(a.tenants)),
        *("--edge", a.http_address, "--edge", b.http_address),
        *("--broker", f"127.0.0.1:{a.mqtt_port}", "--broker", f"127.0.0.1:{b.mqtt_port}"),
        "--once",
    ]
    # Killed mid-run (SIGKILL, after its first messages commit), then run again: every record
    # once. Small batches, so the kill lands between batches of both nodes.
    config = tmp_path / "pipeline.toml"
    config.write_text("[pipeline]\nmax_records_per_batch = 100\n")
    command += ["--config", str(config)]
    log = tmp_path / "pipeline.log"
    killed = subprocess.Popen([*command], stderr=log.open("ab"), cwd=workdir)
    wait_for_commit(commit_file(lake, 1), killed, log)
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    partial = read_table(lake / "messages", columns=["seq"]).num_rows
    assert 0 < partial < sum(map(len, sent.values()))
    # Run again, and lose a worker (and its executor) after the next commit: the other worker
    # takes its tasks over and the run ends well.
    version = max(int(p.stem) for p in (lake / "messages" / "_delta_log").glob("*.json"))
    survived = subprocess.Popen([*command], stderr=log.open("ab"), cwd=workdir)
    wait_for_commit(commit_file(lake, version + 1), survived, log)
    cluster.kill_worker(0)
    assert survived.wait(600) == 0, log.read_text()[-3000:]
    assert read_table(lake / "messages", columns=["seq"]).num_rows == sum(map(len, sent.values()))
    # A run after these would find nothing new: test_edge_to_delta runs one (an application's
    # start on this cluster is a minute and a half, and a run's exactly-once does not depend on
    # where its tasks run). The pipeline never made a journal of its own.
    assert not (workdir / "data").exists()
    rows = read_table(lake / "messages", columns=["node", "seq", "payload"]).to_pylist()
    assert len({(r["node"], r["seq"]) for r in rows}) == len(rows)
    for node, payloads in sent.items():
        landed = [r["payload"] for r in sorted(rows, key=lambda r: r["seq"]) if r["node"] == node]
        assert landed == payloads
    for edge in two_edges:
        last = max(r["seq"] for r in rows if r["node"] == edge.node)
        assert retained_notice(edge.mqtt_port, edge.node).committed_seq >= last
    # The executors wrote the other tables too: each edge's log events of its publisher.
    logs = read_table(lake / "logs", columns=["node", "seq", "event_type", "client_id"])
    events = logs.to_pylist()
    assert len({(r["node"], r["seq"]) for r in events}) == len(events)
    logged = {(r["node"], r["event_type"], r["client_id"]) for r in events}
    for node, prefix in (("edge-a", "a"), ("edge-b", "b")):
        assert (node, "connect", f"pub-{prefix}-0") in logged
