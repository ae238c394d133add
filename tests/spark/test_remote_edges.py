"""The pipeline reads edges over HTTP (issue 12): two real ``edgebus edge`` processes with their
own data dirs (never given to the pipeline), real paho publishers, the real source and Delta
tables, with a local journal beside them. Every acknowledged publish lands once in ``messages``;
an edge that is down delays only its own records; a wrong token or a removed range stops the
query naming edge, node and seqs; the committed offsets reach each edge as its retained journal
notice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from counter_records import write_records
from edge_process import (  # noqa: F401 (two_edges: the fixture)
    OPERATOR_TOKEN,
    EdgeProcess,
    publish_acked,
    retained_notice,
    start_edges,
    two_edges,
)
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession

from ingest.journal import JournalReader, list_segments
from sinks.delta import read_table
from streaming import pipeline
from streaming.quota_settings import QuotaSettings, TenantLimits
from streaming.settings import PipelineSettings

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


def landed(settings: PipelineSettings) -> dict[str, list[bytes]]:
    """Each node's payloads in ``messages``, in seq order; no (node, seq) twice."""
    rows = read_table(settings.lake / "messages", columns=["node", "seq", "payload"]).to_pylist()
    keys = [(r["node"], r["seq"]) for r in rows]
    assert len(keys) == len(set(keys)), "a (node, seq) landed twice"
    by_node: dict[str, list[bytes]] = {}
    for row in sorted(rows, key=lambda r: (r["node"], r["seq"])):
        by_node.setdefault(row["node"], []).append(row["payload"])
    return by_node


def test_two_edges_over_http_one_down_midway(
    edgebus_spark: SparkSession,
    make_settings: Callable[..., PipelineSettings],
    two_edges: list[EdgeProcess],  # noqa: F811 (the fixture)
) -> None:
    a, b = two_edges
    settings = make_settings(edges=(a.http_address, b.http_address))
    # Mixed: one more node's journal on the pipeline's own disk; the edges' only over HTTP.
    local = [b'{"vehicle":"l","i":%d}' % i for i in range(10)]
    write_records(
        settings.journal_root, "edge-l", [("acme", "fleet/l/telemetry", p) for p in local]
    )
    assert sorted(p.name for p in settings.journal_root.iterdir()) == ["edge-l"]
    quota = QuotaSettings(
        load_limits=lambda: {"acme": TenantLimits()},
        operator_token=OPERATOR_TOKEN,
        brokers=(("127.0.0.1", a.mqtt_port), ("127.0.0.1", b.mqtt_port)),
    )

    def run() -> None:
        pipeline.run(
            settings, once=True, spark=edgebus_spark, quota=quota, edge_token=OPERATOR_TOKEN
        )

    sent = {
        "edge-a": publish_acked(a.mqtt_port, "a", 60),
        "edge-b": publish_acked(b.mqtt_port, "b", 50),
        "edge-l": local,
    }
    run()
    assert landed(settings) == sent

    b.stop()  # down: only its records wait
    sent["edge-a"] += publish_acked(a.mqtt_port, "a", 30, start=60)
    run()
    assert landed(settings) == sent

    b.start()  # back on the same address: its new records arrive, the old ones not again
    sent["edge-b"] += publish_acked(b.mqtt_port, "b", 20, start=50)
    run()
    assert landed(settings) == sent

    # Retention's input reached each edge: its node's last seq in the lake, retained.
    for edge in (a, b):
        committed = retained_notice(edge.mqtt_port, edge.node).committed_seq
        seqs = read_table(settings.lake / "messages", columns=["node", "seq"]).to_pylist()
        assert committed >= max(r["seq"] for r in seqs if r["node"] == edge.node)


def test_a_wrong_token_stops_the_query_naming_the_edge(
    edgebus_spark: SparkSession,
    make_settings: Callable[..., PipelineSettings],
    two_edges: list[EdgeProcess],  # noqa: F811 (the fixture)
) -> None:
    a, _ = two_edges
    publish_acked(a.mqtt_port, "a", 3)
    settings = make_settings(edges=(a.http_address,))
    with pytest.raises(StreamingQueryException) as failed:
        pipeline.run(settings, once=True, spark=edgebus_spark, edge_token="acme-1")
    assert f"edge {a.http_address} refused GET /journal: 403" in str(failed.value)
    assert not (settings.lake / "messages").exists()


def test_a_range_retention_removed_stops_the_query_naming_node_and_seqs(
    edgebus_spark: SparkSession,
    make_settings: Callable[..., PipelineSettings],
    tmp_path: Path,
) -> None:
    # Small segments, so that there is one to remove.
    (edge,) = start_edges(tmp_path, ["edge-r"], "journal_segment_bytes = 4096\n")
    try:
        publish_acked(edge.mqtt_port, "r", 80)
        node_dir = edge.data_dir / "journal" / "edge-r"
        segments = list_segments(node_dir)
        assert len(segments) >= 2
        segments[0][1].unlink()  # retention ahead of the lake (or a hand-removed segment)
        oldest = segments[1][0]
        settings = make_settings(edges=(edge.http_address,))
        with pytest.raises(StreamingQueryException) as failed:
            pipeline.run(settings, once=True, spark=edgebus_spark, edge_token=OPERATOR_TOKEN)
        message = str(failed.value)
        assert f"journal of node 'edge-r' no longer has seqs 1..{oldest - 1}" in message
        assert f"edge {edge.http_address}" in message
        assert JournalReader(node_dir).first_seq() == oldest
    finally:
        edge.stop()
