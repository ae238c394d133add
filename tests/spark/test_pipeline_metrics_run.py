"""``edgebus pipeline --metrics``: the real pipeline's /metrics, scraped with a real HTTP client
while it runs, parsed as Prometheus text."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from counter_records import Counter, write_counters, write_records
from metrics_text import Samples, parse, value
from pyspark.sql import SparkSession

from edgebus.platform_cli import serve_metrics
from streaming import pipeline
from streaming.metrics import PipelineMetrics
from streaming.quota_settings import QuotaSettings, TenantLimits
from streaming.settings import PipelineSettings

pytestmark = pytest.mark.spark

NODE = "edge-a"
NOW = dt.datetime(2024, 3, 10, 12, 0, tzinfo=dt.UTC)
DEVICE = [("acme", f"fleet/truck-{i}/telemetry", b'{"speed": 3}') for i in range(40)]
LOGS = [
    ("acme", "$log/mqtt/connect", json.dumps({"client_id": f"t{i}", "details": {}}).encode())
    for i in range(6)
]
# 150 messages counted against a limit of 100: one "blocked" decision.
COUNTERS = [Counter("acme", "messages_in", 60.0, 150)]
WAIT = 180.0


def scrape(client: httpx.Client) -> Samples:
    """Every sample of /metrics by (name, labels)."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


@pytest.fixture
def settings(make_settings: Callable[..., PipelineSettings]) -> PipelineSettings:
    return make_settings(max_records_per_batch=20)  # a few batches


@pytest.fixture
def served(settings: PipelineSettings) -> Iterator[tuple[PipelineMetrics, httpx.Client]]:
    metrics = PipelineMetrics(settings)
    server = serve_metrics(metrics, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with httpx.Client(base_url=url, timeout=10.0) as client:
            yield metrics, client
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_during_a_real_run(
    edgebus_spark: SparkSession,
    settings: PipelineSettings,
    served: tuple[PipelineMetrics, httpx.Client],
) -> None:
    metrics, client = served
    write_records(settings.journal_root, NODE, DEVICE + LOGS)
    write_counters(settings.journal_root, NODE, COUNTERS)
    total = len(DEVICE) + len(LOGS) + len(COUNTERS)

    # Before the pipeline runs: the whole journal is behind.
    before = scrape(client)
    assert value(before, "edgebus_pipeline_durable_seq", node=NODE) == total
    assert value(before, "edgebus_pipeline_lag_records", node=NODE) == total
    lag_seconds = value(before, "edgebus_pipeline_lag_seconds", node=NODE)
    assert lag_seconds is not None
    assert lag_seconds >= 0
    assert value(before, "edgebus_pipeline_batches_total") == 0

    quota = QuotaSettings(
        load_limits=lambda: {"acme": TenantLimits(messages_per_day=100, bytes_per_day=None)},
        operator_token="op-token",
        brokers=(),
        clock=lambda: NOW,
    )
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            pipeline.run(
                settings, once=False, stop=stop, spark=edgebus_spark, quota=quota, metrics=metrics
            )
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT
        while True:
            samples = scrape(client)  # scraped while the query runs
            if value(samples, "edgebus_pipeline_lag_records", node=NODE) == 0:
                break
            assert not failure, failure
            assert time.monotonic() < deadline, samples
            time.sleep(0.5)
    finally:
        stop.set()
        thread.join(timeout=WAIT)
    assert not failure, failure

    samples = scrape(client)
    batches = value(samples, "edgebus_pipeline_batches_total")
    assert batches is not None
    assert batches >= total / 20
    assert value(samples, "edgebus_pipeline_rows_total", table="messages") == len(DEVICE)
    assert value(samples, "edgebus_pipeline_rows_total", table="logs") == len(LOGS)
    assert value(samples, "edgebus_pipeline_rows_total", table="usage") == len(COUNTERS)
    assert value(samples, "edgebus_pipeline_batch_duration_seconds_count") == batches
    duration = value(samples, "edgebus_pipeline_batch_duration_seconds_sum")
    assert duration is not None
    assert duration > 0
    assert value(samples, "edgebus_pipeline_committed_seq", node=NODE) == total
    assert value(samples, "edgebus_pipeline_lag_seconds", node=NODE) == 0
    blocked = value(
        samples,
        "edgebus_pipeline_quota_decisions_total",
        metric="messages_per_day",
        state="blocked",
    )
    assert blocked == 1
    last_batch = value(samples, "edgebus_pipeline_last_batch_timestamp_seconds")
    assert last_batch is not None
    assert last_batch > time.time() - WAIT
