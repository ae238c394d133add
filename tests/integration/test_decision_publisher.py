"""The pipeline's MQTT decision publisher against real edges: retained QoS 1 publishes with the
operator token, in order; clear errors naming the broker; a broker that is down gets its
decisions on a later attempt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.brokers import free_port
from sinks.mqtt import DecisionPublisher


def decision(state: str, metric: str = "messages_per_day") -> bytes:
    doc = {"state": state, "metric": metric, "limit": 100, "value": 120, "decided_at": None}
    return json.dumps(doc).encode()


def retained_decision(make_client: Any, port: int) -> bytes:
    watcher = make_client(port=port, username="op-token")
    watcher.subscribe("$control/quota/acme", qos=1)
    message = watcher.get()
    assert message.retain
    payload: bytes = message.payload
    return payload


def test_delivers_in_order_retained_to_every_edge(
    make_edge: Any, make_client: Any, tenants_file: Path
) -> None:
    edges = [make_edge(tenants=tenants_file), make_edge(tenants=tenants_file, node_id="other")]
    acme = make_client(port=edges[0].port, username="acme-1")
    acme.subscribe("$quota/#", qos=1)
    publisher = DecisionPublisher([("127.0.0.1", e.port) for e in edges], "op-token")

    blocked = decision("blocked", "bytes_per_day")
    errors = publisher.publish({"$control/quota/acme": [decision("warn"), blocked]})

    assert errors == []
    assert publisher.pending() == {}
    seen = {(m.topic, json.loads(m.payload)["state"]) for m in (acme.get(), acme.get())}
    assert seen == {("$quota/messages_per_day", "warn"), ("$quota/bytes_per_day", "blocked")}
    for edge in edges:
        assert retained_decision(make_client, edge.port) == blocked  # the last one sent


def test_a_broker_that_is_down_gets_the_decisions_later(
    make_edge: Any, make_client: Any, tenants_file: Path
) -> None:
    up = make_edge(tenants=tenants_file)
    down_port = free_port()
    brokers = [("127.0.0.1", up.port), ("127.0.0.1", down_port)]
    publisher = DecisionPublisher(brokers, "op-token", retry_backoff=(0.0, 0.0))

    errors = publisher.publish({"$control/quota/acme": [decision("warn")]})
    assert [str(e) for e in errors] == [
        f"broker 127.0.0.1:{down_port}: cannot connect: [Errno 111] Connection refused"
    ]
    # A newer decision for the same topic replaces the undelivered one.
    errors = publisher.publish({"$control/quota/acme": [decision("blocked")]})
    assert len(errors) == 1
    assert publisher.pending() == {f"127.0.0.1:{down_port}": 1}

    late = make_edge(tenants=tenants_file, node_id="late", port=down_port)
    assert publisher.publish({}) == []  # the next batch, nothing new: the retry
    assert publisher.pending() == {}
    assert retained_decision(make_client, late.port) == decision("blocked")
    assert retained_decision(make_client, up.port) == decision("blocked")


@pytest.mark.parametrize(
    ("token", "error"),
    [
        ("wrong", "connection refused: Bad user name or password (0x86)"),
        ("acme-1", "publish to $control/quota/acme refused: Not authorized (0x87)"),
    ],
)
def test_refusals_name_the_broker_and_keep_the_decision(
    make_edge: Any, tenants_file: Path, token: str, error: str
) -> None:
    edge = make_edge(tenants=tenants_file)
    publisher = DecisionPublisher([("127.0.0.1", edge.port)], token, timeout=5.0)
    errors = publisher.publish({"$control/quota/acme": [decision("blocked")]})
    assert [str(e) for e in errors] == [f"broker 127.0.0.1:{edge.port}: {error}"]
    assert publisher.pending() == {f"127.0.0.1:{edge.port}": 1}


def test_a_failing_broker_is_not_tried_again_before_its_back_off(
    make_edge: Any, tenants_file: Path
) -> None:
    down_port = free_port()
    publisher = DecisionPublisher([("127.0.0.1", down_port)], "op-token", retry_backoff=(60, 60))
    assert len(publisher.publish({"$control/quota/acme": [decision("warn")]})) == 1
    make_edge(tenants=tenants_file, port=down_port)
    assert publisher.publish({"$control/quota/acme": [decision("blocked")]}) == []  # not tried
    assert publisher.pending() == {f"127.0.0.1:{down_port}": 1}


def test_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="token"):
        DecisionPublisher([("127.0.0.1", 1883)], "")
    with pytest.raises(ValueError, match="timeout"):
        DecisionPublisher([("127.0.0.1", 1883)], "op", timeout=0)
    with pytest.raises(ValueError, match="retry_backoff"):
        DecisionPublisher([("127.0.0.1", 1883)], "op", retry_backoff=(2, 1))
