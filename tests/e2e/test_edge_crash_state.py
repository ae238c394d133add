"""A SIGKILLed edge rebuilds persistent sessions, queues and retained messages on restart:
the last snapshot plus the journal records after it."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _edge(data_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgebus.cli", "--log-level", "WARNING", "edge"]
        + ["--listen", "127.0.0.1:0", "--data-dir", str(data_dir), "--node-id", "crash"],
        stdout=subprocess.PIPE,
        env={**os.environ},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert " listening on 127.0.0.1:" in line, line
    return proc, int(line.rsplit(":", 1)[1])


def _client(port: int, client_id: str, inbox: queue.Queue[mqtt.MQTTMessage]) -> mqtt.Client:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
    connected: queue.Queue[bool] = queue.Queue()
    client.on_connect = lambda c, u, flags, rc, p: connected.put(flags.session_present)
    client.on_message = lambda c, u, m: inbox.put(m)
    client.connect("127.0.0.1", port)
    client.loop_start()
    client.session_present = connected.get(timeout=10)  # type: ignore[attr-defined]
    return client


def _subscribe_and_leave(port: int, client_id: str, inbox: queue.Queue[mqtt.MQTTMessage]) -> None:
    """A persistent session subscribed to ``fleet/#`` at QoS 1 (SUBACK received), offline."""
    sub = _client(port, client_id, inbox)
    done: queue.Queue[int] = queue.Queue()
    sub.on_subscribe = lambda c, u, mid, codes, p: done.put(mid)
    sub.subscribe("fleet/#", qos=1)
    done.get(timeout=10)
    sub.disconnect()
    sub.loop_stop()


def test_sigkilled_edge_rebuilds_sessions_queues_and_retained(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    edge, port = _edge(data_dir)
    inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
    _subscribe_and_leave(port, "crash-sub", inbox)
    # The new persistent subscription reaches a snapshot within about a second.
    snapshot = data_dir / "state" / "crash" / "snapshot.json"
    deadline = time.monotonic() + 10
    while b"crash-sub" not in (snapshot.read_bytes() if snapshot.exists() else b""):
        assert time.monotonic() < deadline, "no snapshot with the session"
        time.sleep(0.05)

    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="crash-pub")
    pub.connect("127.0.0.1", port)
    pub.loop_start()
    infos = [pub.publish("fleet/v1/pos", f"p{i}".encode(), qos=1) for i in range(20)]
    infos.append(pub.publish("fleet/v1/config", b"retained-cfg", qos=1, retain=True))
    for info in infos:
        info.wait_for_publish(10)
        assert info.is_published()
    pub.disconnect()
    pub.loop_stop()
    edge.send_signal(signal.SIGKILL)
    edge.wait(10)

    edge, port = _edge(data_dir)
    try:
        again = _client(port, "crash-sub", inbox)
        assert again.session_present  # type: ignore[attr-defined]
        got = [inbox.get(timeout=10).payload for _ in range(21)]
        assert got == [f"p{i}".encode() for i in range(20)] + [b"retained-cfg"]
        again.disconnect()
        again.loop_stop()
        late: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        viewer = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="viewer")
        viewer.on_message = lambda c, u, m: late.put(m)
        viewer.connect("127.0.0.1", port)
        viewer.loop_start()
        viewer.subscribe("fleet/+/config", qos=1)
        msg = late.get(timeout=10)
        assert (msg.payload, msg.retain) == (b"retained-cfg", True)
        viewer.disconnect()
        viewer.loop_stop()
    finally:
        edge.send_signal(signal.SIGTERM)
        assert edge.wait(20) == 0


def _publisher(port: int, client_id: str) -> mqtt.Client:
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
    pub.connect("127.0.0.1", port)
    pub.loop_start()
    return pub


def _acked(pub: mqtt.Client, payload: bytes) -> None:
    """One QoS 1 publish to ``fleet/v1/pos``, returning once the edge acknowledged it."""
    info = pub.publish("fleet/v1/pos", payload, qos=1)
    info.wait_for_publish(10)
    assert info.is_published()


def _leave(client: mqtt.Client) -> None:
    client.disconnect()
    client.loop_stop()


def _stop(edge: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    edge.send_signal(sig)
    edge.wait(10)


def test_a_session_confirmed_just_before_a_sigkill_survives_it(tmp_path: Path) -> None:
    """SUBACK, DISCONNECT, one QoS 1 publish acknowledged, SIGKILL: no snapshot can have
    caught the session yet (they come at most once a second), the session log has."""
    data_dir = tmp_path / "data"
    edge, port = _edge(data_dir)
    inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
    try:
        _leave(_client(port, "quick-open", queue.Queue()))  # a CONNACK, nothing else
        _subscribe_and_leave(port, "quick-sub", inbox)  # SUBACK, DISCONNECT
        pub = _publisher(port, "quick-pub")
        _acked(pub, b"acked")
        _leave(pub)
    finally:
        _stop(edge, signal.SIGKILL)
    snapshot = data_dir / "state" / "crash" / "snapshot.json"
    assert b"quick-sub" not in (snapshot.read_bytes() if snapshot.exists() else b"")

    edge, port = _edge(data_dir)
    try:
        back = _client(port, "quick-open", queue.Queue())
        assert back.session_present  # type: ignore[attr-defined]
        _leave(back)
        again = _client(port, "quick-sub", inbox)
        assert again.session_present  # type: ignore[attr-defined]
        assert inbox.get(timeout=10).payload == b"acked"
        _leave(again)
    finally:
        _stop(edge, signal.SIGTERM)


def test_after_a_sigkill_a_session_gets_what_came_after_its_subscription_only(
    tmp_path: Path,
) -> None:
    """The session log is applied in journal order: a QoS 1 message acknowledged before the
    SUBACK is not queued for the subscription after the crash, one after it is."""
    data_dir = tmp_path / "data"
    edge, port = _edge(data_dir)
    inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
    try:
        pub = _publisher(port, "order-pub")
        _acked(pub, b"before")
        _subscribe_and_leave(port, "order-sub", inbox)
        _acked(pub, b"after")
        _leave(pub)
    finally:
        _stop(edge, signal.SIGKILL)

    edge, port = _edge(data_dir)
    try:
        again = _client(port, "order-sub", inbox)
        assert inbox.get(timeout=10).payload == b"after"
        assert inbox.empty()
        _leave(again)
    finally:
        _stop(edge, signal.SIGTERM)
