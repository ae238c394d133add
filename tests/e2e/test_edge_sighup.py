"""SIGHUP makes an edge process reload its tenants file without dropping connections."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

TENANTS = """
[tenants.acme]
tokens = ["acme-1"]
[tenants.acme.acl."acme-1"]
publish = ["allowed/#"]
"""


def test_sighup_reloads_tenants_and_keeps_connections(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgebus.cli", "--log-level", "INFO", "edge"]
        + ["--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--node-id", "hup"]
        + ["--tenants", str(tenants)],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "edge.log").open("wb"),
        env={**os.environ},
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().decode().rsplit(":", 1)[1])
        acks: queue.Queue[Any] = queue.Queue()
        disconnected: queue.Queue[Any] = queue.Queue()
        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id="hup", protocol=mqtt.MQTTv5
        )
        client.username_pw_set("acme-1")
        client.on_publish = lambda c, u, mid, rc, p: acks.put(rc)
        client.on_disconnect = lambda c, u, f, rc, p: disconnected.put(rc)
        client.connect("127.0.0.1", port)
        client.loop_start()
        client.publish("other/x", b"1", qos=1)
        assert acks.get(timeout=10).value == 0x87  # not in the ACL yet
        tenants.write_text(TENANTS.replace('["allowed/#"]', '["allowed/#", "other/#"]'))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while b"reloaded" not in (tmp_path / "edge.log").read_bytes():
            assert time.monotonic() < deadline, "no reload logged"
            time.sleep(0.05)
        client.publish("other/x", b"2", qos=1)
        assert acks.get(timeout=10).value == 0  # same connection, new rule
        assert disconnected.empty()
        client.disconnect()
        client.loop_stop()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
