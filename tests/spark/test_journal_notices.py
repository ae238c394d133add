"""The pipeline tells the edges how far the lake holds each node's journal (issue 9's retention):
after a batch is committed in every table and marked done by Spark, each node's last seq goes
retained to ``$control/journal/{node}`` on every ``--broker``, with the operator token."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from counter_records import write_records
from paho.mqtt.enums import CallbackAPIVersion
from pyspark.sql import SparkSession
from test_quota_job import TENANTS, RunningEdge

from broker_edge.settings import EdgeSettings
from edgebus.platform_cli import local_notices
from schemas.control import JournalCommitted, journal_control_topic
from streaming import pipeline
from streaming.quota_settings import QuotaSettings, TenantLimits
from streaming.settings import PipelineSettings

pytestmark = pytest.mark.spark


@pytest.fixture
def edge(tmp_path: Path) -> Iterator[Any]:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    settings = EdgeSettings(host="127.0.0.1", port=0, data_dir=tmp_path / "edge", node_id="edge-n")
    running = RunningEdge(settings, "asyncio", tenants).start()
    yield running
    running.stop()


def retained_notices(
    port: int, nodes: list[str], token: str = "op-token"
) -> dict[str, JournalCommitted]:
    """The retained ``$control/journal/{node}`` notices, read as the operator."""
    got: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="notice-reader")
    client.username_pw_set(token)
    client.on_message = lambda c, u, message: got.put(message)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        for node in nodes:
            client.subscribe(journal_control_topic(node), qos=1)
        notices = {}
        for _ in nodes:
            message = got.get(timeout=10)
            assert message.retain
            notice = JournalCommitted.parse(message.payload)
            notices[notice.node] = notice
        return notices
    finally:
        client.loop_stop()
        client.disconnect()


def test_each_nodes_last_committed_seq_reaches_the_edges(
    edgebus_spark: SparkSession, make_settings: Callable[..., PipelineSettings], edge: Any
) -> None:
    settings = make_settings(max_records_per_batch=7)
    write_records(
        settings.journal_root, "edge-x", [("acme", f"fleet/t/{i}", b"{}") for i in range(20)]
    )
    write_records(
        settings.journal_root, "edge-y", [("acme", "$log/mqtt/connect", b"bad") for _ in range(5)]
    )
    quota = QuotaSettings(
        load_limits=lambda: {"acme": TenantLimits()},
        operator_token="op-token",
        brokers=(("127.0.0.1", edge.port),),
    )
    pipeline.run(settings, once=True, spark=edgebus_spark, quota=quota)

    notices = retained_notices(edge.port, ["edge-x", "edge-y"])
    assert {node: n.committed_seq for node, n in notices.items()} == {"edge-x": 20, "edge-y": 5}


def test_without_a_tenants_file_the_notices_use_the_edges_own_token(
    edgebus_spark: SparkSession, make_settings: Callable[..., PipelineSettings]
) -> None:
    settings = make_settings()
    # An edge with no tenants file on the pipeline's data dir: it makes the operator token there.
    edge_settings = EdgeSettings(
        host="127.0.0.1", port=0, data_dir=settings.data_dir, node_id="edge-anon"
    )
    edge = RunningEdge(edge_settings, "asyncio", None).start()
    try:
        write_records(
            settings.journal_root, "edge-z", [("default", f"t/{i}", b"{}") for i in range(9)]
        )
        notices = local_notices(settings.data_dir, [("127.0.0.1", edge.port)])
        assert notices is not None
        pipeline.run(settings, once=True, spark=edgebus_spark, notices=notices)
        got = retained_notices(edge.port, ["edge-z"], token=notices.operator_token)
        assert got["edge-z"].committed_seq == 9
    finally:
        edge.stop()
