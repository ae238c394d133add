"""Three real ``edgebus edge`` processes meshed as one bus (issue 11), and what they show in
``$SYS``. Each edge is first started on port 0 to learn its ports, then started again on them
with the others as peers (in its config file)."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from tests.helpers.edge_process import OPERATOR_TOKEN, EdgeProcess
from tests.helpers.edge_process import TENANTS as EDGE_TENANTS
from tests.helpers.mesh_clients import SETTLE

GLOBEX = "globex-1"
GLOBEX_DAY_LIMIT = 1_000_000  # far from what tests publish: only confirmed totals reach it
# The helper's operator and tenant acme, and a second tenant.
TENANTS = EDGE_TENANTS + (
    f'\n[tenants.globex]\ntokens = ["{GLOBEX}"]\n'
    f"[tenants.globex.limits]\nmessages_per_day = {GLOBEX_DAY_LIMIT}\n"
)
NODES = ("edge-a", "edge-b", "edge-c")


def _config(path: Path, peers: list[str]) -> Path:
    listed = ", ".join(f'"{peer}"' for peer in peers)
    path.write_text(f"[edge]\ncounter_interval = 60.0\nsys_interval = 1.0\npeers = [{listed}]\n")
    return path


# How many times the mesh is started afresh when a port it learned was taken meanwhile.
START_ATTEMPTS = 3
IN_USE = "address already in use"


def start_mesh(root: Path) -> list[EdgeProcess]:
    """Three meshed edges under ``root``. An edge's ports are learned on a first start (port 0)
    and bound again on the second: another process may take one in between (the suite's
    Spark JVMs bind ephemeral ports too); the mesh then starts again on new ports."""
    for attempt in range(1, START_ATTEMPTS + 1):
        edges = _learn_ports(root / f"attempt-{attempt}")
        started: list[EdgeProcess] = []
        try:
            for edge in edges:
                started.append(edge.start())  # noqa: PERF401 (each one as it starts: a failure stops those)
        except AssertionError as exc:
            for edge in started:
                edge.stop()
            if IN_USE not in str(exc) or attempt == START_ATTEMPTS:
                raise
            continue
        for edge in edges:
            wait_links_up(edge)
        return edges
    raise AssertionError("unreachable")


def _learn_ports(root: Path) -> list[EdgeProcess]:
    """The three edges, each started on port 0 and stopped, configured with the others as
    peers."""
    root.mkdir(parents=True)
    tenants = root / "tenants.toml"
    tenants.write_text(TENANTS)
    edges = []
    for node in NODES:
        edge = EdgeProcess(
            root / "edges" / node, node, tenants, root / f"{node}.log", config=None
        ).start()
        edge.stop()  # its ports are known now
        edges.append(edge)
    addresses = {edge.node: f"127.0.0.1:{edge.mqtt_port}" for edge in edges}
    for edge in edges:
        peers = [address for node, address in addresses.items() if node != edge.node]
        edge.config = _config(root / f"{edge.node}.toml", peers)
    return edges


@contextlib.contextmanager
def meshed(root: Path) -> Iterator[list[EdgeProcess]]:
    """:func:`start_mesh` under ``root``, every edge stopped after."""
    started = start_mesh(root)
    try:
        yield started
    finally:
        for edge in started:
            edge.stop()


def sys_values(
    port: int, topic_filter: str, wanted: Any, timeout: float = SETTLE
) -> dict[str, str]:
    """The retained ``$SYS`` values under ``topic_filter`` once ``wanted(values)`` holds."""
    got: queue.Queue[tuple[str, str]] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"sys-{time.monotonic()}")
    client.username_pw_set(OPERATOR_TOKEN)
    client.on_message = lambda c, u, m: got.put((m.topic, m.payload.decode()))
    client.connect("127.0.0.1", port)
    client.loop_start()
    values: dict[str, str] = {}
    try:
        client.subscribe(topic_filter)
        deadline = time.monotonic() + timeout
        while not wanted(values):
            topic, text = got.get(timeout=max(0.01, deadline - time.monotonic()))
            values[topic] = text
        return values
    finally:
        client.loop_stop()
        client.disconnect()


def peer_states(values: dict[str, str]) -> dict[str, str]:
    prefix = "$SYS/broker/mesh/peers/"
    return {t[len(prefix) :]: v for t, v in values.items() if t.startswith(prefix)}


def wait_links_up(edge: EdgeProcess) -> dict[str, str]:
    """The links ``edge`` dials, once all are up."""

    def up(values: dict[str, str]) -> bool:
        states = peer_states(values)
        return len(states) == len(NODES) - 1 and set(states.values()) == {"up"}

    return peer_states(sys_values(edge.mqtt_port, "$SYS/broker/mesh/peers/#", up))


def wait_inbound_up(edge: EdgeProcess, node: str) -> None:
    """Until ``node``'s link to ``edge`` is up (``edge``'s publishes reach ``node`` on it)."""
    topic = f"$SYS/broker/mesh/inbound/{node}"
    sys_values(edge.mqtt_port, topic, lambda values: values.get(topic) == "up")
