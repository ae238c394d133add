"""`edgebus run`, the embedded default: an edge and the pipeline, stopped cleanly by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

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
            if (table / "_delta_log").exists():
                rows = read_table(table).num_rows
                if rows:
                    break
            time.sleep(0.5)
        assert rows == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
