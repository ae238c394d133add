"""A filter subscribed on edge B while B's link from edge A is cut (a network partition: both
edges keep serving) gets what A acknowledged meanwhile once the link is back, as if it had been
up (issue 11): A rescans its journal for it (broker_edge.mesh.CatchUp). Two real ``edgebus
edge`` processes, B dialing A through a TCP forwarder the test cuts, stock paho clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.edge_process import TENANT_TOKEN, TENANTS, EdgeProcess
from tests.helpers.link_proxy import LinkProxy, link_proxy
from tests.helpers.mesh_clients import numbers_until_quiet
from tests.helpers.mesh_edges import peer_states, sys_values

pytestmark = pytest.mark.timeout(120)


def _config(path: Path, peer: str) -> Path:
    path.write_text(f'[edge]\ncounter_interval = 60.0\nsys_interval = 0.5\npeers = ["{peer}"]\n')
    return path


@pytest.fixture
def partitioned(tmp_path: Path) -> Iterator[tuple[EdgeProcess, EdgeProcess, LinkProxy]]:
    """Edges A and B; B dials A through the proxy, A dials B directly (B's publishes)."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    a, b = (
        EdgeProcess(tmp_path / node, node, tenants, tmp_path / f"{node}.log").start()
        for node in ("edge-a", "edge-b")
    )
    a.stop()  # their ports are known now
    b.stop()
    with link_proxy(a.mqtt_port) as proxy:
        a.config = _config(tmp_path / "a.toml", f"127.0.0.1:{b.mqtt_port}")
        b.config = _config(tmp_path / "b.toml", f"127.0.0.1:{proxy.port}")
        try:
            a.start()
            b.start()
            yield a, b, proxy
        finally:
            a.stop()
            b.stop()


def _link(b: EdgeProcess, proxy: LinkProxy, state: str) -> None:
    """Until B's link to A (through the proxy) is in ``state``."""
    address = f"127.0.0.1:{proxy.port}"
    values = sys_values(
        b.mqtt_port,
        "$SYS/broker/mesh/peers/#",
        lambda values: peer_states(values).get(address) == state,
    )
    assert peer_states(values)[address] == state


@pytest.mark.parametrize("qos", [1, 2])
def test_a_filter_subscribed_while_the_link_is_down_gets_what_its_origin_took_meanwhile(
    make_client: Any, partitioned: tuple[EdgeProcess, EdgeProcess, LinkProxy], qos: int
) -> None:
    a, b, proxy = partitioned
    _link(b, proxy, "up")
    pub = make_client(port=a.mqtt_port, username=TENANT_TOKEN)
    proxy.cut()
    _link(b, proxy, "down")
    for n in range(50):  # before the subscription: not for it, as if the link had been up
        pub.publish("part/x", str(n).encode(), qos=qos)
    sub = make_client(f"part-{qos}", port=b.mqtt_port, username=TENANT_TOKEN, clean_session=False)
    sub.subscribe("part/#", qos=qos)
    for n in range(50, 150):  # acknowledged by A while B's link from it is down
        pub.publish("part/x", str(n).encode(), qos=qos)
    proxy.heal()
    _link(b, proxy, "up")
    for n in range(150, 200):  # A may route them before B's filters reach it: no matter
        pub.publish("part/x", str(n).encode(), qos=qos)
    got = numbers_until_quiet(sub, set(range(50, 200)))
    # Each once, in order, none from before the subscription.
    assert got == list(range(50, 200)), f"{len(got)} messages: {got[:10]}...{got[-10:]}"
    topic = "$SYS/broker/mesh/publish/caught_up"
    found = int(sys_values(a.mqtt_port, topic, lambda values: topic in values)[topic])
    assert 100 <= found <= 150  # from A's journal: 50..149, and any of 150.. before the filter
