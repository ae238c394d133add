"""``edgebus logs --follow`` as a process: history, then rows committed after it started, until
SIGINT/SIGTERM (exit 0, no traceback)."""

from __future__ import annotations

import datetime as dt
import json
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from lake_fixture import DeltaBatchWriter, log_row

from schemas.tables import LOGS_PARTITION_BY, LOGS_SCHEMA

UTC = dt.UTC
T0 = dt.datetime(2024, 3, 12, 8, 0, tzinfo=UTC)
WAIT = 30.0  # seconds for a line that must come (polls are every 0.5 s)


def event(seq: int, *, tenant: str = "acme", node: str = "edge-a", **extra: Any) -> dict[str, Any]:
    ts = extra.pop("ts", T0 + dt.timedelta(seconds=seq))
    return log_row(tenant, ts, node, seq, extra.pop("event_type", "connect"))


class Lake:
    """A lake written batch by batch, as the pipeline would."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.writer = DeltaBatchWriter(
            root / "logs", "edgebus.logs", LOGS_SCHEMA, LOGS_PARTITION_BY
        )
        self.batch = 0

    def commit(self, *rows: dict[str, Any]) -> None:
        self.writer.write(self.batch, pa.Table.from_pylist(list(rows), schema=LOGS_SCHEMA))
        self.batch += 1


class Follow:
    """``edgebus logs --follow`` running; its stdout and stderr lines as they come."""

    def __init__(self, lake: Path, *args: str) -> None:
        command = [sys.executable, "-m", "edgebus.logs_cli", "--lake", str(lake)]
        command += ["--tenant", "acme", "--follow", "--format", "json", *args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        assert self.process.stdout is not None
        assert self.process.stderr is not None
        for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, lines), daemon=True).start()

    @staticmethod
    def _pump(stream: IO[str], lines: queue.Queue[str]) -> None:
        for line in stream:
            lines.put(line)

    def following(self) -> None:
        """Wait until the history is out and it follows."""
        line = self.err.get(timeout=WAIT)
        self.stderr.append(line)
        assert "following acme's new events" in line, line

    def rows(self, n: int) -> list[tuple[str, int]]:
        got = [json.loads(self.out.get(timeout=WAIT)) for _ in range(n)]
        assert all("cursor" in row for row in got)
        return [(row["node"], row["seq"]) for row in got]

    def stop(self, signum: int = signal.SIGINT) -> None:
        self.process.send_signal(signum)
        assert self.process.wait(timeout=WAIT) == 0
        while not self.err.empty():
            self.stderr.append(self.err.get())
        assert "Traceback" not in "".join(self.stderr)
        assert self.out.empty(), "nothing more than asked for"


@pytest.fixture
def follow() -> Iterator[list[Follow]]:
    started: list[Follow] = []
    yield started
    for f in started:
        if f.process.poll() is None:
            f.process.kill()
            f.process.wait()


def test_a_table_that_does_not_exist_yet_then_new_rows_until_sigint(
    tmp_path: Path, follow: list[Follow]
) -> None:
    lake = Lake(tmp_path)
    f = Follow(tmp_path)
    follow.append(f)
    f.following()
    lake.commit(event(1), event(2, tenant="other", node="edge-c"))  # creates the table
    assert f.rows(1) == [("edge-a", 1)]
    lake.commit(event(2), event(1, node="edge-b"), event(3))
    assert f.rows(3) == [("edge-b", 1), ("edge-a", 2), ("edge-a", 3)]  # oldest first
    f.stop(signal.SIGINT)


def test_history_then_late_rows_and_no_repeats_after_a_compaction(
    tmp_path: Path, follow: list[Follow]
) -> None:
    lake = Lake(tmp_path)
    lake.commit(*(event(seq) for seq in range(1, 6)))
    lake.commit(event(6), event(7, event_type="disconnect"))
    f = Follow(tmp_path, "--limit", "3", "--event-type", "connect")
    follow.append(f)
    assert f.rows(3) == [("edge-a", 4), ("edge-a", 5), ("edge-a", 6)]  # the newest, oldest first
    f.following()
    # A late row (an edge's backlog): older than what was shown, a day earlier even. New all
    # the same: committed after.
    late = event(8, ts=T0 - dt.timedelta(days=1))
    lake.commit(late, event(9, event_type="disconnect"))
    assert f.rows(1) == [("edge-a", 8)]
    DeltaTable(str(tmp_path / "logs")).optimize.compact()  # rewrites the rows: not new
    lake.commit(event(10))
    assert f.rows(1) == [("edge-a", 10)]
    f.stop(signal.SIGTERM)


def test_after_a_cursor_every_row_after_it_first(tmp_path: Path, follow: list[Follow]) -> None:
    lake = Lake(tmp_path)
    lake.commit(*(event(seq) for seq in range(1, 8)))
    page = subprocess.run(
        [sys.executable, "-m", "edgebus.logs_cli", "--lake", str(tmp_path), "--tenant", "acme"]
        + ["--format", "json", "--oldest-first", "--limit", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    cursor = json.loads(page.stdout.splitlines()[-1])["cursor"]
    f = Follow(tmp_path, "--after", cursor, "--limit", "2")  # pages of 2 inside: all 5 come
    follow.append(f)
    assert f.rows(5) == [("edge-a", seq) for seq in range(3, 8)]
    f.following()
    lake.commit(event(8))
    assert f.rows(1) == [("edge-a", 8)]
    f.stop()
