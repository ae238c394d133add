"""A real ``edgebus edge`` process whose files may not grow past a real limit (RLIMIT_FSIZE: the
kernel answers EFBIG, no root needed), with a real paho client (issue 9).

The edge must refuse what it cannot make durable (MQTT 5: PUBACK 0x80), never hang, retry by
itself, and take publishes again once the limit is raised on the running process (prlimit),
without a restart. Afterwards every acknowledged publish is in the journal exactly once."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from v5_publisher import V5Publisher

from ingest.journal import JournalReader

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

LIMIT = 256 * 1024  # bytes any file of the edge may reach
TIMEOUT = 10.0


def _limit_file_size() -> None:
    # Runs in the child before exec: writes past LIMIT fail with EFBIG instead of the default
    # SIGXFSZ killing the process (an ignored signal stays ignored across exec).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))


def _start_edge(data_dir: Path, log: Path, *, limited: bool) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgebus.cli", "edge", "--listen", "127.0.0.1:0"]
        + ["--data-dir", str(data_dir), "--node-id", "fsize"],
        stdout=subprocess.PIPE,
        stderr=log.open("ab"),
        preexec_fn=_limit_file_size if limited else None,  # noqa: PLW1509 (no threads here)
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert " on 127.0.0.1:" in line, line
    return proc, int(line.rsplit(":", 1)[1])


def test_file_size_limit_refuses_then_resumes_without_restart(tmp_path: Path) -> None:
    data_dir, log = tmp_path / "data", tmp_path / "edge.log"
    edge, port = _start_edge(data_dir, log, limited=True)
    acked: list[bytes] = []
    try:
        pub = V5Publisher(port, None, client_id="fsize")
        code, i = 0, 0
        while code == 0:
            payload = b"%06d" % i + b"x" * 1000
            code = pub.publish(payload)
            if code == 0:
                acked.append(payload)
            i += 1
            assert i < 1000, "the limit never bit"
        assert code == 0x80  # the frame that hit EFBIG: refused, the client knows
        assert pub.publish(b"while failing") == 0x80  # refused at once while it fails
        assert len(acked) > 50  # ~2.7 KiB a one-record frame: the limit bit after ~90

        # The operator raises the limit on the running process: the edge resumes by itself.
        resource.prlimit(edge.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        deadline = time.monotonic() + TIMEOUT
        while (code := pub.publish(b"retry")) != 0:
            assert code == 0x80
            assert time.monotonic() < deadline, "the edge did not resume"
            time.sleep(0.2)
        acked.append(b"retry")
        pub.publish(b"after")
        acked.append(b"after")
        pub.close()
    finally:
        edge.send_signal(signal.SIGTERM)
        assert edge.wait(30) == 0
    text = log.read_text()
    assert "File too large" in text
    assert "journal writes again" in text

    # A restart without the limit recovers exactly the acknowledged publishes, once each.
    edge, _ = _start_edge(data_dir, log, limited=False)
    edge.send_signal(signal.SIGTERM)
    assert edge.wait(30) == 0
    reader = JournalReader(data_dir / "journal" / "fsize")
    rows = [r for b in reader.read(0, reader.last_seq()) for r in b.to_pylist()]
    device = [r["payload"] for r in rows if r["topic"] == "fleet/v1/telemetry"]
    assert device == acked
    assert [r["seq"] for r in rows] == list(range(1, len(rows) + 1))  # no gap, no reuse
    # The operator's $log has the journal_error event (it was written by the first retry).
    assert any(r["topic"] == "$log/journal/journal_error" for r in rows)
    assert os.path.getsize(log) > 0
