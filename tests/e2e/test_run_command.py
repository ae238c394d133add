"""`edgebus run`, the embedded default: an edge and the pipeline, stopped cleanly by SIGTERM."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from deltalake import DeltaTable

from sinks.delta import read_table

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


@contextlib.contextmanager
def running(tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`edgebus run` on port 0 with ``args``; stopped by SIGTERM (exit 0) at the end."""
    log = tmp_path / "run.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgebus.cli", "--log-level", "INFO", "run"]
        + ["--listen", "127.0.0.1:0", *args]
        + ["--data-dir", str(tmp_path / "data"), "--lake", str(tmp_path / "lake")],
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
        cwd=tmp_path,
    )
    try:
        yield proc, log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(600)
def test_run_serves_mqtt_fills_messages_enforces_quotas_and_reloads_on_sighup(
    tmp_path: Path,
) -> None:
    # One `edgebus run` (one Spark start) for what a user of the embedded default meets: a
    # publish becomes a row of `messages`; quota decisions reach the edge whose port was picked
    # at start, with the config's [edge] table (counters every second: a decision within
    # seconds); SIGHUP reaches the edge and the pipeline; SIGTERM ends everything with exit 0.
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        '[operator]\ntoken = "op"\n'
        '[tenants.tiny]\ntokens = ["tiny-1"]\n[tenants.tiny.limits]\nmessages_per_day = 5\n'
    )
    config = tmp_path / "edgebus.toml"
    config.write_text(
        "[edge]\ncounter_interval = 1.0\n[pipeline]\ntrigger_interval_seconds = 0.5\n"
    )
    args = ("--node-id", "quota", "--tenants", str(tenants), "--config", str(config))
    with running(tmp_path, *args) as (proc, log):

        def wait_logged(text: bytes) -> None:
            deadline = time.monotonic() + 120
            while text not in log.read_bytes():
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, f"{text!r} not logged"
                time.sleep(0.1)

        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("edgebus edge quota listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        assert f"edgebus: edge on 127.0.0.1:{port}," in proc.stdout.readline().decode()
        acks: queue.Queue[int] = queue.Queue()
        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id="tiny-pub", protocol=mqtt.MQTTv5
        )
        client.username_pw_set("tiny-1")
        client.on_publish = lambda c, u, mid, rc, p: acks.put(rc.value)
        client.connect("127.0.0.1", port)
        client.loop_start()
        codes = []
        deadline = time.monotonic() + 240
        while 0x97 not in codes:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the tenant was never blocked"
            client.publish("fleet/v1/telemetry", b'{"speed":1}', qos=1)
            codes.append(acks.get(timeout=10))
            time.sleep(0.2)
        assert codes[:5] == [0] * 5
        client.disconnect()
        client.loop_stop()
        assert b"edgebus: no --broker" not in log.read_bytes()
        # Every accepted publish is a row of `messages`, once.
        accepted = codes.count(0)
        table = tmp_path / "lake" / "messages"
        deadline = time.monotonic() + 120
        rows: list[dict[str, object]] = []
        while len(rows) < accepted:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"{len(rows)} of {accepted} rows"
            if DeltaTable.is_deltatable(str(table)):  # a first commit, not just the folder
                rows = read_table(table, columns=["tenant", "topic", "seq"]).to_pylist()
            time.sleep(0.5)
        device = [r for r in rows if r["topic"] == "fleet/v1/telemetry"]
        assert len(device) == accepted
        assert {r["tenant"] for r in device} == {"tiny"}
        assert len({r["seq"] for r in rows}) == len(rows)
        # SIGHUP: both halves reload the tenants file.
        wait_logged(b"tenant(s)")  # the pipeline read the file: its SIGHUP handler is set
        tenants.write_text(tenants.read_text() + '[tenants.b]\ntokens = ["b-1"]\n')
        proc.send_signal(signal.SIGHUP)
        reloaded = b": SIGHUP: tenants file " + str(tenants).encode() + b" reloaded (2 tenants)"
        wait_logged(b"broker_edge.node" + reloaded)  # the edge's logger
        wait_logged(b"edgebus" + reloaded)  # the pipeline's
        assert proc.poll() is None
