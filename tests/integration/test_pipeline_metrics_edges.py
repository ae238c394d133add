"""The pipeline's lag metrics for a node read over HTTP: a real ``edgebus edge --http`` process,
its durable end and its oldest waiting record asked over the network at scrape time."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from edge_process import OPERATOR_TOKEN, publish_acked, start_edges
from metrics_text import parse, value

from edgebus.platform_cli import serve_metrics
from streaming.metrics import PipelineMetrics
from streaming.settings import PipelineSettings


def test_lag_of_an_edge_read_over_http(tmp_path: Path) -> None:
    [edge] = start_edges(tmp_path, ["edge-a"])
    try:
        started = time.time()
        publish_acked(edge.mqtt_port, "truck-1", 20)
        settings = PipelineSettings(data_dir=tmp_path / "pipeline", edges=(edge.http_address,))
        metrics = PipelineMetrics(settings, edge_token=OPERATOR_TOKEN)
        server = serve_metrics(metrics, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        try:
            samples = parse(httpx.get(url, timeout=10.0).text)
            durable = value(samples, "edgebus_pipeline_durable_seq", node="edge-a")
            assert durable >= 20  # the publishes, and the edge's own log events
            assert value(samples, "edgebus_pipeline_lag_records", node="edge-a") == durable
            waited = value(samples, "edgebus_pipeline_lag_seconds", node="edge-a")
            assert 0 <= waited <= time.time() - started + 1  # its first record's age
            metrics.batch_done({"messages": 20}, {"messages": 0.1}, {"edge-a": int(durable)}, 0.1)
            samples = parse(httpx.get(url, timeout=10.0).text)
            assert value(samples, "edgebus_pipeline_committed_seq", node="edge-a") == durable
            lag = value(samples, "edgebus_pipeline_lag_records", node="edge-a")
            assert lag == value(samples, "edgebus_pipeline_durable_seq", node="edge-a") - durable
            edge.stop()  # an edge that does not answer: no lag for it, the scrape still works
            samples = parse(httpx.get(url, timeout=10.0).text)
            assert value(samples, "edgebus_pipeline_lag_records", node="edge-a") is None
            assert value(samples, "edgebus_pipeline_committed_seq", node="edge-a") == durable
        finally:
            server.shutdown()
            server.server_close()
    finally:
        edge.stop()
