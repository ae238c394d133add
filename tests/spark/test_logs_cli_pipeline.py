"""``edgebus logs`` and ``edgebus sql`` over what the real pipeline writes: ``--follow`` started
before the table exists prints each batch's rows as the pipeline commits them; ``--where``
matches the pipeline's own ``details`` text; ``edgebus sql`` counts the same rows."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

import pytest
from pyspark.sql import SparkSession
from test_logs_job import log_rows, run_logs, write_journal

from streaming.settings import PipelineSettings

pytestmark = pytest.mark.spark
WAIT = 60.0


def lines_of(stream: IO[str]) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def oldest_first(rows: list[dict[str, Any]], tenant: str) -> list[tuple[str, int]]:
    mine = sorted(
        (row for row in rows if row["tenant"] == tenant),
        key=lambda r: (r["ts"], r["node"], r["seq"]),
    )
    return [(row["node"], row["seq"]) for row in mine]


def test_follow_where_and_sql_over_the_pipelines_table(
    edgebus_spark: SparkSession, make_settings: Callable[..., PipelineSettings]
) -> None:
    settings = make_settings(max_records_per_batch=10)
    settings.lake.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "edgebus.logs_cli", "--lake", str(settings.lake)]
    follow = subprocess.Popen(
        [*command, "--tenant", "acme", "--follow", "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert follow.stdout is not None
        assert follow.stderr is not None
        out, err = lines_of(follow.stdout), lines_of(follow.stderr)
        assert "following acme's new events" in err.get(timeout=WAIT)  # no table yet

        write_journal(settings, "edge-a", 24)
        run_logs(edgebus_spark, settings)  # several batches, several commits
        first = oldest_first(log_rows(settings), "acme")
        assert first
        shown = [json.loads(out.get(timeout=WAIT)) for _ in first]
        # Batches commit in journal order, one after the other: oldest first overall.
        assert [(row["node"], row["seq"]) for row in shown] == first

        write_journal(settings, "edge-b", 8, start=24)
        run_logs(edgebus_spark, settings)
        rows = log_rows(settings)
        new = [key for key in oldest_first(rows, "acme") if key[0] == "edge-b"]
        assert new
        shown = [json.loads(out.get(timeout=WAIT)) for _ in new]
        assert [(row["node"], row["seq"]) for row in shown] == new

        follow.send_signal(signal.SIGINT)
        assert follow.wait(timeout=WAIT) == 0
        assert out.empty()
        rest = "".join(err.get() for _ in range(err.qsize()))
        assert "Traceback" not in rest
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()

    # --where on the details the pipeline stored: the number i=4, not the string.
    done = subprocess.run(
        [*command, "--tenant", "acme", "--where", "i=4", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=True,
    )
    [row] = [json.loads(line) for line in done.stdout.splitlines()]
    assert row["details"]["i"] == 4
    assert row["details"]["peer"] == "10.0.0.4:1883"

    query = "SELECT tenant, count(*) AS n FROM logs GROUP BY tenant ORDER BY tenant"
    done = subprocess.run(
        [sys.executable, "-m", "edgebus.sql_cli", "--lake", str(settings.lake), "--format", "json"]
        + [query],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=True,
    )
    counts = {r["tenant"]: r["n"] for r in map(json.loads, done.stdout.splitlines())}
    assert counts == {t: sum(1 for r in rows if r["tenant"] == t) for t in ("acme", "globex")}
