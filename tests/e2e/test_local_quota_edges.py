"""The local quota (issue 14) with real edge processes and paho clients, the pipeline's part
played by an operator client that publishes confirmed totals as the quota step does.

Two edges share a tenant with a daily limit. An edge stops the tenant on the publish after its
own count reaches the limit (PUBACK 0x97, with no decision from the pipeline); with confirmed
totals each edge adds the other's confirmed part to its own count and stops there; a raised
limit releases the block at once, by SIGHUP on the edge or by the pipeline's message; confirmed
totals of another UTC day are ignored.
"""

from __future__ import annotations

import datetime as dt
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from schemas.control import ConfirmedUsage, usage_control_topic

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

EDGEBUS = [sys.executable, "-m", "edgebus.cli", "--log-level", "INFO"]
QUOTA_EXCEEDED = 0x97
LIMIT = 30
OPERATOR = "op-secret"


def tenants_toml(limit: int) -> str:
    """Two tenants with the daily limit ``limit``: ``fleet`` (two edges) and ``solo`` (one)."""
    lines = ["[operator]", f'token = "{OPERATOR}"']
    for name in ("fleet", "solo"):
        lines += [f"[tenants.{name}]", f'tokens = ["{name}-1"]', f"[tenants.{name}.limits]"]
        lines.append(f"messages_per_day = {limit}")
    return "\n".join(lines) + "\n"


class Client:
    """A paho MQTT 5 client: QoS 1 publishes one at a time, and what it receives."""

    def __init__(self, port: int, token: str, client_id: str) -> None:
        self._acks: queue.Queue[tuple[int, int]] = queue.Queue()
        self.inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        connected: queue.Queue[int] = queue.Queue()
        self._subscribed: queue.Queue[object] = queue.Queue()
        self.mqtt = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        self.mqtt.username_pw_set(token)
        self.mqtt.on_connect = lambda c, u, f, rc, p: connected.put(rc.value)
        self.mqtt.on_publish = lambda c, u, mid, rc, p: self._acks.put((mid, rc.value))
        self.mqtt.on_message = lambda c, u, m: self.inbox.put(m)
        self.mqtt.on_subscribe = lambda c, u, mid, codes, p: self._subscribed.put(codes)
        self.mqtt.connect("127.0.0.1", port)
        self.mqtt.loop_start()
        assert connected.get(timeout=10) == 0

    def publish(self, topic: str = "fleet/v1/telemetry", payload: bytes = b"{}") -> int:
        info = self.mqtt.publish(topic, payload, qos=1, retain=topic.startswith("$control"))
        mid, code = self._acks.get(timeout=10)
        assert mid == info.mid
        return code

    def codes(self, count: int) -> list[int]:
        return [self.publish() for _ in range(count)]

    def subscribe(self, topic_filter: str) -> None:
        self.mqtt.subscribe(topic_filter, qos=1)
        self._subscribed.get(timeout=10)

    def close(self) -> None:
        self.mqtt.disconnect()
        self.mqtt.loop_stop()


def start_edge(tmp: Path, node: str, tenants: Path) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [*EDGEBUS, "edge", "--listen", "127.0.0.1:0", "--node-id", node]
        + ["--data-dir", str(tmp / "data"), "--tenants", str(tenants)],
        stdout=subprocess.PIPE,
        stderr=(tmp / f"{node}.log").open("wb"),
        env={**os.environ},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert " listening on " in line, (tmp / f"{node}.log").read_text()[-2000:]
    return proc, int(line.rsplit(":", 1)[1])


def wait_for(what: str, done: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.05)


def confirmed(nodes: dict[str, int], limit: int, day: dt.date | None = None) -> bytes:
    """The quota step's ``$control/usage/fleet`` payload for these node parts."""
    today = day or dt.datetime.now(dt.UTC).date()
    totals = {"messages_in": (sum(nodes.values()), nodes)}
    limits = {"messages_per_day": limit, "bytes_per_day": None}
    return ConfirmedUsage("fleet", today, totals, limits, "now").payload()


@pytest.fixture
def edges(tmp_path: Path) -> Iterator[tuple[Path, list[tuple[subprocess.Popen[bytes], int]]]]:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_toml(LIMIT))
    started = [start_edge(tmp_path, node, tenants) for node in ("edge-a", "edge-b")]
    try:
        yield tenants, started
    finally:
        for proc, _ in started:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_edges_stop_a_tenant_at_its_limit_and_release_it(
    edges: tuple[Path, list[tuple[subprocess.Popen[bytes], int]]],
) -> None:
    tenants, ((edge_a, port_a), (_, port_b)) = edges
    clients: list[Client] = []
    try:
        # One edge alone, no pipeline: its own count stops the tenant at the limit.
        solo = Client(port_a, "solo-1", "solo-pub")
        watcher = Client(port_a, "solo-1", "solo-watch")
        clients += [solo, watcher]
        watcher.subscribe("$log/quota/#")
        assert solo.codes(LIMIT + 3) == [0] * LIMIT + [QUOTA_EXCEEDED] * 3
        event = watcher.inbox.get(timeout=10)
        assert event.topic == "$log/quota/quota_reached"

        # Two edges: each counts its own, and adds the other's part confirmed by the pipeline.
        on_a = Client(port_a, "fleet-1", "fleet-a")
        on_b = Client(port_b, "fleet-1", "fleet-b")
        operator_a = Client(port_a, OPERATOR, "pipeline-a")
        operator_b = Client(port_b, OPERATOR, "pipeline-b")
        clients += [on_a, on_b, operator_a, operator_b]
        assert on_a.codes(10) == [0] * 10
        assert on_b.codes(12) == [0] * 12
        # The lake holds 8 of edge-a's 10 and 12 of edge-b's: each edge's room is the limit
        # minus the other's confirmed part, what it counted itself fills it.
        for operator in (operator_a, operator_b):
            code = operator.publish(
                usage_control_topic("fleet"), confirmed({"edge-a": 8, "edge-b": 12}, LIMIT)
            )
            assert code == 0
        assert on_a.codes(LIMIT - 12 - 10 + 1) == [0] * (LIMIT - 12 - 10) + [QUOTA_EXCEEDED]
        assert on_b.codes(LIMIT - 8 - 12 + 1) == [0] * (LIMIT - 8 - 12) + [QUOTA_EXCEEDED]

        # Another day's totals (a retained one from before midnight) change nothing.
        yesterday = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=1)
        operator_b.publish(usage_control_topic("fleet"), confirmed({}, 1000, yesterday))
        assert on_b.publish() == QUOTA_EXCEEDED

        # A raised limit: the pipeline's message releases edge-b at once ...
        operator_b.publish(usage_control_topic("fleet"), confirmed({"edge-a": 18}, 1000))
        assert on_b.codes(3) == [0] * 3
        assert on_a.publish() == QUOTA_EXCEEDED  # edge-a has not heard of it yet
        # ... and the tenants file with SIGHUP releases edge-a (the solo tenant too).
        tenants.write_text(tenants_toml(1000))
        edge_a.send_signal(signal.SIGHUP)
        wait_for("the release on edge-a", lambda: on_a.publish() == 0)
        assert solo.publish() == 0
    finally:
        for client in clients:
            client.close()
