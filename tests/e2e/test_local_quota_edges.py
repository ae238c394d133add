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
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from edge_process import EdgeProcess
from quota_clients import QUOTA_EXCEEDED, Client, clear_of_utc_midnight, wait_for

from schemas.control import ConfirmedUsage, usage_control_topic

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

LIMIT = 30
OPERATOR = "op-secret"


def tenants_toml(limit: int) -> str:
    """Two tenants with the daily limit ``limit``: ``fleet`` (two edges) and ``solo`` (one)."""
    lines = ["[operator]", f'token = "{OPERATOR}"']
    for name in ("fleet", "solo"):
        lines += [f"[tenants.{name}]", f'tokens = ["{name}-1"]', f"[tenants.{name}.limits]"]
        lines.append(f"messages_per_day = {limit}")
    return "\n".join(lines) + "\n"


def connected(port: int, token: str, client_id: str) -> Client:
    client = Client(port, token, client_id)
    assert client.connack == 0
    return client


def confirmed(nodes: dict[str, int], limit: int, day: dt.date | None = None) -> bytes:
    """The quota step's ``$control/usage/fleet`` payload for these node parts."""
    today = day or dt.datetime.now(dt.UTC).date()
    totals = {"messages_in": (sum(nodes.values()), nodes)}
    limits = {"messages_per_day": limit, "bytes_per_day": None}
    return ConfirmedUsage("fleet", today, totals, limits, "now").payload()


@pytest.fixture
def edges(tmp_path: Path) -> Iterator[tuple[Path, list[EdgeProcess]]]:
    clear_of_utc_midnight(60)  # each test's counts within one quota day
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_toml(LIMIT))
    started: list[EdgeProcess] = []
    try:
        for node in ("edge-a", "edge-b"):
            edge = EdgeProcess(tmp_path / "data", node, tenants, tmp_path / f"{node}.log")
            started.append(edge.start())
        yield tenants, started
    finally:
        for edge in started:
            edge.stop()


def test_edges_stop_a_tenant_at_its_limit_and_release_it(
    edges: tuple[Path, list[EdgeProcess]],
) -> None:
    tenants, (edge_a, edge_b) = edges
    port_a, port_b = edge_a.mqtt_port, edge_b.mqtt_port
    clients: list[Client] = []
    try:
        # One edge alone, no pipeline: its own count stops the tenant at the limit.
        solo = connected(port_a, "solo-1", "solo-pub")
        watcher = connected(port_a, "solo-1", "solo-watch")
        clients += [solo, watcher]
        watcher.subscribe("$log/quota/#")
        assert solo.codes(LIMIT + 3) == [0] * LIMIT + [QUOTA_EXCEEDED] * 3
        event = watcher.inbox.get(timeout=10)
        assert event.topic == "$log/quota/quota_reached"

        # Two edges: each counts its own, and adds the other's part confirmed by the pipeline.
        on_a = connected(port_a, "fleet-1", "fleet-a")
        on_b = connected(port_b, "fleet-1", "fleet-b")
        operator_a = connected(port_a, OPERATOR, "pipeline-a")
        operator_b = connected(port_b, OPERATOR, "pipeline-b")
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
        assert edge_a.proc is not None
        edge_a.proc.send_signal(signal.SIGHUP)
        wait_for("the release on edge-a", lambda: on_a.publish() == 0, 15.0)
        assert solo.publish() == 0
    finally:
        for client in clients:
            client.close()
