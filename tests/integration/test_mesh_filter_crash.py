"""Edges SIGKILLed a moment after a subscriber on another edge subscribed (issue 11): three
real ``edgebus edge`` processes (tests.helpers.mesh_edges), stock paho clients. A QoS 1 message
acknowledged at its origin after the subscriber's SUBACK reaches it once both edges are back,
though neither edge wrote a snapshot since the filter was told (they follow within a second or
two: these kills come within a few tens of milliseconds)."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.edge_process import TENANT_TOKEN, EdgeProcess
from tests.helpers.mesh_clients import SETTLE
from tests.helpers.mesh_edges import meshed, wait_inbound_up, wait_links_up

ACME = TENANT_TOKEN


def _routed_then_killed(make_client: Any, a: EdgeProcess, b: EdgeProcess) -> tuple[Any, Any]:
    """A persistent session on b subscribes to ``fresh/#``; a QoS 1 probe published on a
    reaches it (so a routes the filter to b), and b is SIGKILLed at once. The subscriber (to
    close, which takes paho up to a second, once the kills are done) and a publisher on a."""
    sub = make_client("fresh", port=b.mqtt_port, username=ACME, clean_session=False)
    sub.subscribe("fresh/#", qos=1)
    pub = make_client(port=a.mqtt_port, username=ACME)
    deadline = time.monotonic() + SETTLE
    while True:  # the filter reaches a a moment after the SUBACK
        pub.publish("fresh/probe", b"probe", qos=1)
        try:
            if sub.get(timeout=0.05).payload == b"probe":
                break
        except queue.Empty:
            assert time.monotonic() < deadline, "the filter never reached the origin"
    b.kill()
    return sub, pub


def _delivered_once_back(make_client: Any, a: EdgeProcess, b: EdgeProcess) -> list[bytes]:
    """The subscriber back on b: what it gets that is not a probe (until it is quiet)."""
    wait_links_up(b)
    wait_inbound_up(a, b.node)
    back = make_client("fresh", port=b.mqtt_port, username=ACME, clean_session=False)
    got: list[bytes] = []
    deadline = time.monotonic() + SETTLE
    while time.monotonic() < deadline:
        try:
            payload = back.get(timeout=1.0 if got else SETTLE).payload
        except queue.Empty:
            break
        if payload != b"probe":
            got.append(payload)
    return got


@pytest.mark.parametrize("killed", ["receiver", "both"])
def test_a_message_acknowledged_after_a_new_filter_survives_kills(
    tmp_path: Path, make_client: Any, killed: str
) -> None:
    """receiver: b (the subscriber's edge) is killed, a keeps what b is due. both: a (the
    origin) is killed too, right after acknowledging the message: its last snapshot does not
    know b's filter, the session log does."""
    with meshed(tmp_path) as (a, b, _):
        sub, pub = _routed_then_killed(make_client, a, b)
        pub.publish("fresh/x", b"acked", qos=1)  # returns once a acknowledged it
        if killed == "both":
            a.kill()
        sub.close()  # (before b is back: paho would reconnect it)
        if killed == "both":
            pub.close()
            a.start()
        b.start()
        assert _delivered_once_back(make_client, a, b) == [b"acked"]
