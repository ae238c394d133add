"""The analyst notebooks, executed top to bottom by a kernel of this venv over a demo lake that
the real pipeline built (``python -m edgebus.demo_lake``).

Each notebook marks the cells whose values matter with a tag; the test compares what they
show with what the demo journaled, and finds the figures (PNG) of the cells tagged
``figure-...``, drawn by matplotlib (``MPLBACKEND=Agg``: the notebooks ask for the inline
backend themselves). The demo's records end yesterday, so the day the notebooks pick by
default, the lake's latest, is not today's. The kernel must then exit by itself when asked:
nothing (a JVM, a delta-rs exit abort) may keep it alive or kill it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, time, timedelta
from itertools import accumulate
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from bench.s3_server import s3_server
from edgebus.demo_lake import FIRST_LIMIT, LIMITED, RAISED_LIMIT
from sinks.storage import ENVIRONMENT
from streaming import lake

BUCKET = "edgebus-notebooks"

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CELL_TIMEOUT = 300  # seconds; a cell that hangs fails the test instead of blocking it

# A Spark start (~7 s) in the demo build and one per Spark notebook, on a busy 2-core machine.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("demo")
    yesterday = datetime.combine(datetime.now(UTC).date() - timedelta(days=1), time(12), UTC)
    done = subprocess.run(
        [sys.executable, "-m", "edgebus.demo_lake"]
        + ["--data-dir", str(root / "data"), "--lake", str(root / "lake")]
        + ["--end", yesterday.isoformat()],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary: dict[str, Any] = json.loads(done.stdout)
    assert summary["day"] == yesterday.date().isoformat()
    return summary


@pytest.fixture(scope="module")
def demo_in_a_bucket(demo: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The demo lake copied into a bucket of an S3-compatible server (moto's, started here):
    the same tables, read over S3 (a Delta log names its files relative to the table). Each
    notebook runs once (CI's time): one over the bucket, one over the directory."""
    import boto3

    with s3_server(BUCKET) as options:
        client = boto3.client(
            "s3",
            endpoint_url=options.endpoint_url,
            region_name=options.region,
            aws_access_key_id=options.access_key_id,
            aws_secret_access_key=options.secret_access_key,
        )
        lake = Path(demo["lake"])
        for path in lake.rglob("*"):
            if path.is_file() and "_checkpoints" not in path.parts:
                client.upload_file(str(path), BUCKET, f"lake/{path.relative_to(lake)}")
        environment = {
            ENVIRONMENT[key]: str(value).lower() if isinstance(value, bool) else value
            for key, value in dataclasses.asdict(options).items()
            if value != ""
        }
        environment[ENVIRONMENT["allow_http"]] = "true"
        yield demo | {"lake": f"s3://{BUCKET}/lake", "environment": environment}


def execute(name: str, demo: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run ``notebooks/{name}.ipynb`` in a new kernel; the value each tagged cell shows, and
    for each ``figure-...`` tag how many PNG images its cell drew. No ``EDGEBUS_DATE``: the
    notebooks find the day themselves."""
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    env = {
        **{k: v for k, v in os.environ.items() if k != "EDGEBUS_DATE"},
        **demo.get("environment", {}),
        "EDGEBUS_LAKE": demo["lake"],
        "EDGEBUS_TENANT": LIMITED,
        "MPLBACKEND": "Agg",
        "PYSPARK_PYTHON": sys.executable,
    }
    manager = KernelManager(kernel_name="python3")
    assert manager.format_kernel_cmd()[0] == sys.executable  # this venv's interpreter
    manager.start_kernel(cwd=str(workdir), env=env)
    kernel = manager.provisioner.process
    try:
        NotebookClient(notebook, km=manager, timeout=CELL_TIMEOUT).execute()
        manager.request_shutdown()
        # Asked to shut down, the kernel exits by itself (the wait only bounds a hang).
        assert kernel.wait(timeout=120) == 0
    finally:
        if kernel.poll() is None:
            manager.shutdown_kernel(now=True)
        else:
            manager.cleanup_resources()
    shown = {}
    for cell in notebook.cells:
        for tag in cell.metadata.get("tags", []):
            if tag.startswith("figure-"):
                shown[tag] = sum("image/png" in out.get("data", {}) for out in cell.outputs)
                continue
            [result] = [out for out in cell.outputs if out.output_type == "execute_result"]
            shown[tag] = ast.literal_eval(result.data["text/plain"])
    return shown


def test_fleet_history(demo_in_a_bucket: dict[str, Any], tmp_path: Path) -> None:
    # Over the bucket: Spark's Delta reader through S3A (a directory lake is every other
    # test's; the light readers over a bucket: tests/spark/test_s3_lake.py).
    demo = demo_in_a_bucket
    shown = execute("fleet_history", demo, tmp_path)
    vehicles = demo["messages_per_vehicle"][LIMITED]
    assert shown["messages-count"] == sum(vehicles.values())
    assert shown["messages-per-vehicle"] == vehicles
    # The figure: the lake's latest day (yesterday here), each vehicle's messages per minute.
    assert shown["day"] == demo["day"]
    assert shown["figure-messages-per-vehicle"] == 1
    assert shown["messages-per-vehicle-plotted"] == vehicles
    # Time travel: every version as it was; each run added its messages in one commit.
    per_run = [sum(run) for run in zip(*demo["messages_per_run"].values(), strict=True)]
    rows = shown["rows-per-version"]
    assert demo["messages_versions"][0] == 0  # the first commit made the table too
    assert [rows[v] for v in demo["messages_versions"]] == list(accumulate(per_run))


def test_tenant_logs_and_quota(demo: dict[str, Any], tmp_path: Path) -> None:
    shown = execute("tenant_logs_and_quota", demo, tmp_path)
    assert shown["day"] == demo["day"]  # the lake's latest day, yesterday: not today's date
    assert shown["logs-by-type"] == demo["log_events"][LIMITED]
    assert shown["figure-logs-by-type"] == 1
    assert shown["logs-by-type-plotted"] == demo["log_events"][LIMITED]
    # One figure per quota metric with decisions that day; its marks are quota_events' rows.
    assert shown["figure-usage-vs-limit"] == 1
    recorded = lake.load_arrow(demo["lake"], "quota_events", where=f"tenant = '{LIMITED}'")
    assert shown["quota-moments"] == [
        (row["metric"], row["state"], row["decided_at"].isoformat())
        for row in sorted(recorded.to_pylist(), key=lambda row: row["decided_at"])
    ]
    assert [state for _, state, _ in shown["quota-moments"]] == ["warn", "blocked", "cleared"]
    # The demo's one quality run, as the notebook reads it: every table met its suite.
    assert shown["quality"] == demo["quality"]
    assert set(demo["quality"]) == {"messages", "logs", "usage", "quota_events"}
    assert all(demo["quality"].values())
    # warn at 80 %, blocked past the limit, cleared once it was raised (see edgebus.demo_lake)
    usage = list(accumulate(demo["messages_per_run"][LIMITED]))
    assert shown["quota-timeline"] == [
        ("messages_per_day", "warn", FIRST_LIMIT, usage[0]),
        ("messages_per_day", "blocked", FIRST_LIMIT, usage[1]),
        ("messages_per_day", "cleared", RAISED_LIMIT, usage[2]),
    ]
    assert shown["usage-vs-limit"] == {"messages_per_day": ("cleared", usage[-1], RAISED_LIMIT)}
    # The typed columns of logs, read without parsing: the quota events the edge's own code
    # logged for the pipeline's decisions (run 3's came after the last phase), and the
    # disconnects as a real edge's (a DISCONNECT sent, a keepalive run out: 0x8D).
    assert shown["quota-in-logs"] == [
        ("quota_warn", "messages_per_day", FIRST_LIMIT, usage[0]),
        ("quota_blocked", "messages_per_day", FIRST_LIMIT, usage[1]),
    ]
    assert shown["disconnects"] == [("veh-03", None), ("veh-04", 0x8D)]


def test_edgebus_quality_over_the_demo_lake(demo: dict[str, Any]) -> None:
    # The demo's quality run is the latest; every table passed, so the command exits 0.
    done = subprocess.run(
        [sys.executable, "-m", "edgebus.cli", "quality", "--lake", demo["lake"]],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert (done.returncode, done.stderr) == (0, "")
    lines = done.stdout.splitlines()
    assert lines[0].startswith("run 0  ")
    assert lines[0].endswith("0 of 4 tables failed")
    assert sorted(line.split()[0] for line in lines[1:]) == sorted(demo["quality"])
    assert all(line.split()[1] == "ok" for line in lines[1:])
