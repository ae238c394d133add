"""Journal retention without a tenants file (issue 9): a real ``edgebus edge`` process with no
tenants file makes its own operator token in its data dir (0600), the pipeline's side reads it
from there (``edgebus pipeline``'s ``local_notices``) and its journal notice, sent with the
pipeline's own publisher, deletes a sealed committed segment; an anonymous client still may not
publish ``$control/...``, and the token survives a restart."""

from __future__ import annotations

import os
import queue
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from v5_publisher import V5Publisher

from edgebus.platform_cli import local_notices
from ingest.journal import list_segments
from schemas import operator_token
from schemas.control import journal_control_topic
from sinks.mqtt import DecisionPublisher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

TIMEOUT = 10.0
NODE = "anon"
CONFIG = """
[edge]
journal_segment_bytes = 4096
journal_retention_hours = 0
"""


def _start_edge(data_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    config = tmp_path / "edge.toml"
    config.write_text(CONFIG)
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgebus.cli", "edge", "--listen", "127.0.0.1:0"]
        + ["--data-dir", str(data_dir), "--node-id", NODE, "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "edge.log").open("ab"),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert " on 127.0.0.1:" in line, line
    return proc, int(line.rsplit(":", 1)[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    assert proc.wait(timeout=TIMEOUT) == 0


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def test_without_a_tenants_file_the_pipelines_notice_trims_the_journal(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    node_dir = data_dir / "journal" / NODE
    edge, port = _start_edge(data_dir, tmp_path)
    try:
        path = operator_token.token_path(data_dir)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        anon = V5Publisher(port, None, client_id="anon-1")
        try:
            for i in range(40):
                assert anon.publish(b"y" * 500 + b"%d" % i) == 0
            before = list_segments(node_dir)
            assert len(before) >= 3  # sealed segments, and the active one
            last_sealed_end = before[-1][0] - 1

            # An anonymous client may not send a notice, not even one that would delete
            # everything: NOT_AUTHORIZED, and nothing is removed.
            code = anon.publish(b'{"committed_seq": 1000000}', topic=journal_control_topic(NODE))
            assert code == 0x87
            time.sleep(1.5)  # the commit thread's retention tick is every second
            assert set(before) <= set(list_segments(node_dir))
            # Nor does it see the operator's retained notices.
            anon.paho.subscribe("$control/#", qos=1)

            # What `edgebus pipeline --data-dir DATA --broker HOST:PORT` sends with: the
            # token the edge made, read from the data dir the pipeline reads journals from.
            notices = local_notices(data_dir, [("127.0.0.1", port)])
            assert notices is not None
            publisher = DecisionPublisher(notices.brokers, notices.operator_token)
            # The lake holds everything up to the end of the first sealed segment.
            committed = before[1][0] - 1
            assert publisher.publish_committed(NODE, committed) == []
            _wait_for(lambda: list_segments(node_dir)[0][0] > before[0][0], "retention")
            after = list_segments(node_dir)
            assert after[0][0] == before[1][0]  # only what the lake has is gone
            assert after[0][0] <= last_sealed_end
            with pytest.raises(queue.Empty):
                anon.messages.get(timeout=0.5)
        finally:
            anon.close()
    finally:
        _stop(edge)

    # A restart keeps the token (a running pipeline keeps working), and it still opens the
    # operator's connection.
    token = operator_token.read(data_dir)
    edge, port = _start_edge(data_dir, tmp_path)
    try:
        assert operator_token.read(data_dir) == token
        publisher = DecisionPublisher([("127.0.0.1", port)], token or "")
        assert publisher.publish_committed(NODE, before[1][0] - 1) == []
    finally:
        _stop(edge)


def test_an_unsafe_token_file_stops_the_edge_with_a_clear_error(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = operator_token.token_path(data_dir)
    path.write_text("guessable\n")
    os.chmod(path, 0o644)
    done = subprocess.run(
        [sys.executable, "-m", "edgebus.cli", "edge", "--listen", "127.0.0.1:0"]
        + ["--data-dir", str(data_dir), "--node-id", NODE],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert b"operator.token: mode 0644 lets others read or change" in done.stderr
    assert b"Traceback" not in done.stderr
