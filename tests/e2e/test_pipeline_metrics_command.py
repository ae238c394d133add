"""``edgebus pipeline --once --metrics 127.0.0.1:0`` as an operator runs it: the metrics URL is
printed, /metrics answers (before and while Spark starts: the journal's lag), the run ends 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from metrics_text import parse, value

from ingest.journal import JournalWriter

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EDGEBUS = [sys.executable, "-m", "edgebus.cli"]
ENV = {**os.environ, "PYSPARK_PYTHON": sys.executable}
RECORDS = 25


def test_once_with_metrics(tmp_path: Path) -> None:
    data, lake = tmp_path / "data", tmp_path / "lake"
    with JournalWriter.open(data / "journal", "edge-a", fsync=False) as writer:
        for i in range(RECORDS):
            writer.append(
                ts_us=1_710_028_800_000_000 + i,
                tenant="acme",
                client_id="truck",
                topic=f"fleet/truck/{i}",
                qos=1,
                retain=False,
                payload=b"{}",
            )
        writer.flush()
    command = [*EDGEBUS, "pipeline", "--data-dir", str(data), "--lake", str(lake), "--once"]
    process = subprocess.Popen(
        [*command, "--metrics", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("edgebus pipeline metrics on http://127.0.0.1:"), line
    url = line.rsplit(" ", 1)[1].strip()
    assert url.endswith("/metrics")
    samples = parse(httpx.get(url, timeout=10.0).text)  # while the run starts
    assert value(samples, "edgebus_pipeline_durable_seq", node="edge-a") == RECORDS
    lag = value(samples, "edgebus_pipeline_lag_records", node="edge-a")
    assert lag in (0, RECORDS)  # 0 only if the run was that quick
    _, err = process.communicate(timeout=540)
    assert process.returncode == 0, err
    assert "Traceback" not in err


def test_a_bad_metrics_address_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.toml"
    config.write_text('[pipeline]\nmetrics_listen = "nowhere"\n')
    done = subprocess.run(
        [*EDGEBUS, "pipeline", "--config", str(config), "--once"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "pipeline.metrics_listen" in done.stderr
    done = subprocess.run(
        [*EDGEBUS, "pipeline", "--metrics", "nowhere", "--once"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--metrics" in done.stderr
