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


def test_run_serves_mqtt_and_fills_messages(tmp_path: Path) -> None:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgebus.cli", "--log-level", "WARNING", "run"]
        + ["--listen", "127.0.0.1:0", "--node-id", "runner"]
        + ["--data-dir", str(tmp_path / "data"), "--lake", str(tmp_path / "lake")],
        stdout=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        port = None
        for raw in proc.stdout:
            line = raw.decode()
            if line.startswith("edgebus edge runner listening on 127.0.0.1:"):
                port = int(line.rsplit(":", 1)[1])
                break
        assert port, "the edge did not report its port"
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="run-test")
        client.connect("127.0.0.1", port)
        client.loop_start()
        info = client.publish("fleet/v9/telemetry", b'{"speed":1}', qos=1)
        info.wait_for_publish(10)
        assert info.is_published()
        client.disconnect()
        client.loop_stop()

        table = tmp_path / "lake" / "messages"
        deadline = time.monotonic() + 180
        rows = 0
        while time.monotonic() < deadline and proc.poll() is None:
            if DeltaTable.is_deltatable(str(table)):  # a first commit, not just the folder
                rows = read_table(table).num_rows
                if rows:
                    break
            time.sleep(0.5)
        assert rows == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()  # its children get SIGTERM through the parent-death signal
            proc.wait()


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


def test_sighup_reaches_the_edge_and_the_pipeline(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[operator]\ntoken = "op"\n[tenants.acme]\ntokens = ["acme-1"]\n')
    with running(tmp_path, "--node-id", "hup", "--tenants", str(tenants)) as (proc, log):

        def wait_logged(text: bytes) -> None:
            deadline = time.monotonic() + 120
            while text not in log.read_bytes():
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, f"{text!r} not logged"
                time.sleep(0.1)

        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(b"edgebus edge hup listening on")
        wait_logged(b"tenant(s)")  # the pipeline read the file: its SIGHUP handler is set
        tenants.write_text(tenants.read_text() + '[tenants.b]\ntokens = ["b-1"]\n')
        proc.send_signal(signal.SIGHUP)
        reloaded = b": SIGHUP: tenants file " + str(tenants).encode() + b" reloaded (2 tenants)"
        wait_logged(b"broker_edge.node" + reloaded)  # the edge's logger
        wait_logged(b"edgebus" + reloaded)  # the pipeline's
        assert proc.poll() is None


def test_run_on_port_0_enforces_quotas_with_the_edge_settings_of_its_config(
    tmp_path: Path,
) -> None:
    # Quota decisions must reach the edge whose port was picked at start, and the config's
    # [edge] table must reach the edge (counters every second: a decision within seconds).
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
            client.publish("fleet/v1/telemetry", b"{}", qos=1)
            codes.append(acks.get(timeout=10))
            time.sleep(0.2)
        assert codes[:5] == [0] * 5
        client.disconnect()
        client.loop_stop()
        assert b"edgebus: no --broker" not in log.read_bytes()
