"""`edgebus run`, the embedded default: an edge and the pipeline as children that never outlive
it. What a run does (publishes into `messages`, quotas through the edge picked on port 0 with
the config's `[edge]` table, SIGHUP to both halves, exit 0 on SIGTERM) is tested in
`test_quota_loop.py`, which runs the quota loop through `edgebus run`: one Spark start for both."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_children_stop_when_run_is_killed(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgebus.cli", "--log-level", "WARNING", "run"]
        + ["--listen", "127.0.0.1:0", "--node-id", "orphan"]
        + ["--data-dir", str(tmp_path / "data"), "--lake", str(tmp_path / "lake")],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
        cwd=tmp_path,
    )
    assert proc.stdout is not None
    for raw in proc.stdout:
        if raw.decode().startswith("edgebus edge orphan listening on"):
            break
    children = subprocess.run(
        ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert len(children) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    alive = children
    while alive and time.monotonic() < deadline:
        alive = [
            pid
            for pid in children
            if Path(f"/proc/{pid}").exists()
            and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
        ]
        time.sleep(0.2)
    assert alive == [], "edge or pipeline outlived a SIGKILLed `edgebus run`"
