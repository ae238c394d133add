"""``edgebus pipeline --master spark://...`` on a real Spark standalone cluster started from the
pyspark installation (a master and a worker on 127.0.0.1): the executors get Delta's jars from
the driver (``spark.jars``) and write every table with Spark's Delta, exactly once."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# bench/ is a tool directory, not an installed package; make it importable however pytest runs.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.cluster import standalone_cluster  # noqa: E402
from ingest.journal import JournalWriter  # noqa: E402
from sinks.delta import read_table  # noqa: E402

pytestmark = pytest.mark.e2e


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
