"""Real ``edgebus edge`` processes serving their journal over HTTP, and paho publishers: for the
tests (and the benchmark) of journals read over the network (issue 12)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from schemas.control import JournalCommitted, journal_control_topic

EDGEBUS = [sys.executable, "-m", "edgebus.cli"]
OPERATOR_TOKEN = "op-token"
TENANT_TOKEN = "acme-1"
TENANTS = f"""
[operator]
token = "{OPERATOR_TOKEN}"

[tenants.acme]
tokens = ["{TENANT_TOKEN}"]
"""


@dataclass
class EdgeProcess:
    """One edge node as a child process; ``start()`` again after ``stop()`` restarts it on the
    same data dir and the same ports (the pipeline's ``--edge`` address stays valid)."""

    data_dir: Path
    node: str
    tenants: Path
    log: Path
    mqtt_port: int = 0
    http_port: int = 0
    config: Path | None = None  # an [edge] settings file
    # More arguments: --listen-tls/--listen-ws/--listen-wss HOST:PORT, --cert ...
    extra: tuple[str, ...] = ()
    # The bound port of every MQTT listener by kind (mqtt, tls, ws, wss), once started.
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def http_address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def start(self) -> EdgeProcess:
        command = [
            *EDGEBUS,
            "edge",
            *("--listen", f"127.0.0.1:{self.mqtt_port}", "--http", f"127.0.0.1:{self.http_port}"),
            *("--data-dir", str(self.data_dir), "--node-id", self.node),
            *("--tenants", str(self.tenants)),
            *(("--config", str(self.config)) if self.config is not None else ()),
            *self.extra,
        ]
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 (no threads of ours yet)
            )
        assert self.proc.stdout is not None
        lines = [self.proc.stdout.readline().decode() for _ in range(2)]
        assert " http on 127.0.0.1:" in lines[1], (lines, self.log.read_text()[-2000:])
        self.mqtt_port = int(lines[0].rsplit(":", 1)[1])
        self.http_port = int(lines[1].rsplit(":", 1)[1])
        self.ports = {"mqtt": self.mqtt_port}
        for _ in range(sum(arg.startswith("--listen-") for arg in self.extra)):
            line = self.proc.stdout.readline().decode()  # "edgebus edge NODE KIND on HOST:PORT"
            kind = line.split()[3]
            self.ports[kind] = int(line.rsplit(":", 1)[1])
        return self

    def kill(self) -> None:
        """SIGKILL: the edge dies at once, nothing flushed or snapshotted."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            assert self.proc.wait(30) == 0, self.log.read_text()[-2000:]
        self.proc = None


def _die_with_parent() -> None:
    """An edge left by a killed test run stops too (Linux PR_SET_PDEATHSIG: SIGTERM)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def start_edges(tmp_path: Path, nodes: list[str], edge_settings: str = "") -> list[EdgeProcess]:
    """Edges with their own data dirs under ``tmp_path/edges/{node}``, one tenants file, and
    ``edge_settings`` (lines of the ``[edge]`` table): counters once a minute by default, so a
    pipeline catching up is not chasing them."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    config = tmp_path / "edge.toml"
    config.write_text(f"[edge]\ncounter_interval = 60.0\n{edge_settings}")
    return [
        EdgeProcess(
            tmp_path / "edges" / node, node, tenants, tmp_path / f"{node}.log", config=config
        ).start()
        for node in nodes
    ]


def publish_acked(port: int, prefix: str, count: int, start: int = 0) -> list[bytes]:
    """Publish QoS 1 messages as tenant ``acme``; every payload must be acknowledged."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{prefix}-{start}")
    client.username_pw_set(TENANT_TOKEN)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        infos = []
        for i in range(start, start + count):
            payload = f'{{"vehicle":"{prefix}","i":{i}}}'.encode()
            infos.append((payload, client.publish(f"fleet/{prefix}/telemetry", payload, qos=1)))
        for payload, info in infos:
            info.wait_for_publish(30)
            assert info.is_published(), payload
    finally:
        client.disconnect()
        client.loop_stop()
    return [payload for payload, _ in infos]


@pytest.fixture
def two_edges(tmp_path: Path) -> Iterator[list[EdgeProcess]]:
    """Edges ``edge-a`` and ``edge-b``, stopped after the test."""
    started = start_edges(tmp_path, ["edge-a", "edge-b"])
    yield started
    for edge in started:
        edge.stop()


def retained_notice(port: int, node: str) -> JournalCommitted:
    """The retained ``$control/journal/{node}`` notice at the edge on ``port``, as the operator."""
    got: queue.Queue[bytes] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"notice-{node}")
    client.username_pw_set(OPERATOR_TOKEN)
    client.on_message = lambda c, u, message: got.put(message.payload)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        client.subscribe(journal_control_topic(node), qos=1)
        return JournalCommitted.parse(got.get(timeout=30))
    finally:
        client.loop_stop()
        client.disconnect()
