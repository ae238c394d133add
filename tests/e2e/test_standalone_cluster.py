"""``edgebus pipeline --master spark://...`` on a real Spark standalone cluster started from the
pyspark installation (a master and a worker on 127.0.0.1): the executors get Delta's jars from
the driver (``spark.jars``) and write every table with Spark's Delta, exactly once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyspark
import pytest

from ingest.journal import JournalWriter
from sinks.delta import read_table

pytestmark = pytest.mark.e2e

SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"
MASTER_URL = re.compile(rb"Starting Spark master at (spark://127\.0\.0\.1:\d+)")


def wait_for_line(log: Path, pattern: re.Pattern[bytes], process: subprocess.Popen[bytes]) -> bytes:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = pattern.search(log.read_bytes())
        if found:
            return found.group(1) if pattern.groups else found.group(0)
        assert process.poll() is None, log.read_text()[-2000:]
        time.sleep(0.2)  # the JVM writes its log; there is no event to await
    raise AssertionError(f"no {pattern.pattern!r} in {log}")


@dataclass
class Cluster:
    """A running standalone cluster: the master's URL and each worker's process."""

    url: str
    workers: list[subprocess.Popen[bytes]]

    def kill_worker(self, index: int) -> None:
        """SIGKILL worker ``index`` and the executors it started, as a lost machine would."""
        worker = self.workers[index]
        executors = [int(pid) for pid in _children(worker.pid) if b"Executor" in _cmdline(int(pid))]
        worker.send_signal(signal.SIGKILL)
        for pid in executors:
            os.kill(pid, signal.SIGKILL)
        worker.wait(30)


def _children(pid: int) -> list[str]:
    found: list[str] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += (task / "children").read_text().split()
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@contextlib.contextmanager
def standalone_cluster(tmp_path: Path, workers: int, cores: int) -> Iterator[Cluster]:
    """A master and ``workers`` workers of ``cores`` cores each on 127.0.0.1, from the pyspark
    installation (``spark-class``); stopped at the end."""
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_CLASS.parent.parent),
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    common = ["--host", "127.0.0.1", "--port", "0", "--webui-port", "0"]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        master_log = tmp_path / "master.log"
        with master_log.open("wb") as out:
            master = subprocess.Popen(
                [str(SPARK_CLASS), "org.apache.spark.deploy.master.Master", *common],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        processes.append(master)
        url = wait_for_line(master_log, MASTER_URL, master).decode()
        started: list[subprocess.Popen[bytes]] = []
        for index in range(workers):
            worker_log = tmp_path / f"worker-{index}.log"
            with worker_log.open("wb") as out:
                worker = subprocess.Popen(
                    [
                        str(SPARK_CLASS),
                        "org.apache.spark.deploy.worker.Worker",
                        *common,
                        *("--cores", str(cores), "--memory", "1g"),
                        *("--work-dir", str(tmp_path / f"work-{index}")),
                        url,
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            processes.append(worker)
            started.append(worker)
            registered = re.compile(rb"Successfully registered with master")
            wait_for_line(worker_log, registered, worker)
        yield Cluster(url, started)
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
        for process in processes:
            process.wait(timeout=60)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    """One worker with two cores."""
    with standalone_cluster(tmp_path, workers=1, cores=2) as running:
        yield running.url


def test_the_pipeline_writes_every_table_on_a_standalone_cluster(
    cluster: str, tmp_path: Path
) -> None:
    data, lake = tmp_path / "data", tmp_path / "lake"
    for node in ("edge-a", "edge-b"):
        with JournalWriter.open(data / "journal", node, fsync=False) as writer:
            for i in range(50):
                writer.append(
                    ts_us=1_790_000_000_000_000 + i,
                    tenant="acme",
                    client_id="truck-1",
                    topic="fleet/truck-1/telemetry" if i % 10 else "$log/mqtt/connect",
                    qos=1,
                    retain=False,
                    payload=b'{"speed": 1}' if i % 10 else b"not json",
                    content_type="application/json",
                )
            writer.flush()
    command = [
        sys.executable,
        "-m",
        "edgebus.cli",
        "pipeline",
        "--master",
        cluster,
        "--data-dir",
        str(data),
        "--lake",
        str(lake),
        "--once",
    ]
    for _ in range(2):  # the second run finds nothing new and writes nothing twice
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
    messages = read_table(lake / "messages", columns=["node", "seq"]).to_pylist()
    assert sorted((r["node"], r["seq"]) for r in messages) == [
        (node, seq) for node in ("edge-a", "edge-b") for seq in range(1, 51) if (seq - 1) % 10
    ]
    logs = read_table(lake / "logs", columns=["seq", "payload_valid"]).to_pylist()
    assert len(logs) == 10
    assert not any(r["payload_valid"] for r in logs)
    assert read_table(lake / "quarantine", columns=["seq"]).num_rows == 10
