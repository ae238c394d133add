"""The pipeline's metrics without Spark: lag against real journals, the batch counters, quality
results, the ``metrics_listen`` setting; scraped over HTTP and parsed as Prometheus text."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from metrics_text import Samples, parse, value

from edgebus.platform_cli import serve_metrics
from edgebus.settings import SettingsError, load_pipeline
from ingest.journal import JournalWriter
from streaming.metrics import PipelineMetrics
from streaming.quality import QualityResult, QualitySchedule
from streaming.settings import PipelineSettings

NOW = 1_710_064_800.0  # 2024-03-10T10:00:00Z
TS = dt.datetime(2024, 3, 10, 9, 59, 30, tzinfo=dt.UTC)


def journal(settings: PipelineSettings, node: str, records: int) -> None:
    with JournalWriter.open(settings.journal_root, node, fsync=False) as writer:
        for i in range(records):
            writer.append(
                ts_us=int(TS.timestamp() * 1_000_000) + i,
                tenant="acme",
                client_id="truck-1",
                topic="fleet/truck-1/telemetry",
                qos=1,
                retain=False,
                payload=b"{}",
            )
        writer.flush()


@pytest.fixture
def settings(tmp_path: Path) -> PipelineSettings:
    return PipelineSettings(data_dir=tmp_path / "data", lake=tmp_path / "lake")


class Scraper:
    def __init__(self, metrics: PipelineMetrics) -> None:
        self.server = serve_metrics(metrics, "127.0.0.1", 0)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.server.server_address[1]}")

    def __call__(self) -> Samples:
        response = self.client.get("/metrics")
        assert response.status_code == 200
        return parse(response.text)

    def close(self) -> None:
        self.client.close()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scraped(settings: PipelineSettings) -> Iterator[tuple[PipelineMetrics, Scraper]]:
    metrics = PipelineMetrics(settings, clock=lambda: NOW)
    scraper = Scraper(metrics)
    yield metrics, scraper
    scraper.close()


def test_lag_per_node_against_the_journals(
    settings: PipelineSettings, scraped: tuple[PipelineMetrics, Scraper]
) -> None:
    metrics, scrape = scraped
    journal(settings, "edge-a", 10)
    journal(settings, "edge-b", 3)
    samples = scrape()
    assert value(samples, "edgebus_pipeline_lag_records", node="edge-a") == 10
    assert value(samples, "edgebus_pipeline_lag_records", node="edge-b") == 3
    # The oldest waiting record, seq 1, was journaled at TS: 30 s before NOW.
    assert value(samples, "edgebus_pipeline_lag_seconds", node="edge-a") == 30.0
    metrics.batch_done(
        {"messages": 8, "counters": 2, "logs": None},
        {"route": 0.25, "messages": 0.5},
        {"edge-a": 8, "edge-b": 3},
        0.75,
    )
    samples = scrape()
    assert value(samples, "edgebus_pipeline_batch_duration_seconds_sum") == 0.75
    assert value(samples, "edgebus_pipeline_lag_records", node="edge-a") == 2
    # Now seq 9 waits: journaled 8 µs after TS.
    assert value(samples, "edgebus_pipeline_lag_seconds", node="edge-a") == pytest.approx(
        30.0 - 8e-6
    )
    assert value(samples, "edgebus_pipeline_lag_records", node="edge-b") == 0
    assert value(samples, "edgebus_pipeline_lag_seconds", node="edge-b") == 0
    assert value(samples, "edgebus_pipeline_committed_seq", node="edge-a") == 8
    assert value(samples, "edgebus_pipeline_durable_seq", node="edge-a") == 10
    assert value(samples, "edgebus_pipeline_batches_total") == 1
    assert value(samples, "edgebus_pipeline_rows_total", table="messages") == 8
    assert value(samples, "edgebus_pipeline_rows_total", table="usage") == 2
    assert value(samples, "edgebus_pipeline_step_seconds_total", step="route") == 0.25
    assert value(samples, "edgebus_pipeline_batch_duration_seconds_sum") == 0.75
    assert value(samples, "edgebus_pipeline_batch_duration_seconds_bucket", le="1.0") == 1
    assert value(samples, "edgebus_pipeline_last_batch_timestamp_seconds") == NOW


def test_a_restart_starts_from_the_checkpoints_last_committed_batch(
    settings: PipelineSettings,
) -> None:
    journal(settings, "edge-a", 10)
    checkpoint = settings.checkpoint_path("journal")
    (checkpoint / "offsets").mkdir(parents=True)
    (checkpoint / "commits").mkdir()
    for batch, seq in ((2, 4), (3, 6), (4, 9)):
        (checkpoint / "offsets" / str(batch)).write_text(f'v1\n{{}}\n{{"edge-a":{seq}}}\n')
    for batch in (2, 3):  # batch 4 was planned, never marked done
        (checkpoint / "commits" / str(batch)).write_text("v1\n{}\n")
    scrape = Scraper(PipelineMetrics(settings, clock=lambda: NOW))
    try:
        samples = scrape()
    finally:
        scrape.close()
    assert value(samples, "edgebus_pipeline_committed_seq", node="edge-a") == 6
    assert value(samples, "edgebus_pipeline_lag_records", node="edge-a") == 4


def test_an_edge_that_does_not_answer_has_no_lag(tmp_path: Path) -> None:
    settings = PipelineSettings(data_dir=tmp_path / "data", edges=("127.0.0.1:9",))
    scrape = Scraper(PipelineMetrics(settings))
    try:
        samples = scrape()
    finally:
        scrape.close()
    assert not [key for key in samples if key[0] == "edgebus_pipeline_lag_records"]


def quality_result(table: str, *, success: bool) -> QualityResult:
    return QualityResult(
        1,
        TS,
        table,
        f"{table}_suite",
        "expect_x",
        None,
        None,
        success,
        None,
        None,
        None,
        None,
        None,
    )


def test_quality_failures_per_table(
    settings: PipelineSettings, scraped: tuple[PipelineMetrics, Scraper]
) -> None:
    metrics, scrape = scraped
    results = [
        quality_result("logs", success=False),
        quality_result("logs", success=False),
        quality_result("messages", success=True),
    ]
    schedule = QualitySchedule(
        settings.lake, 60.0, run=lambda lake, now: results, on_results=metrics.quality_ran
    )
    schedule.run_once()
    samples = scrape()
    assert value(samples, "edgebus_pipeline_quality_runs_total") == 1
    assert value(samples, "edgebus_pipeline_quality_failures_total", table="logs") == 2
    assert value(samples, "edgebus_pipeline_quality_failures_total", table="messages") is None


@pytest.mark.parametrize(
    ("listen", "address"),
    [("", None), ("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:9464", ("::1", 9464))],
)
def test_metrics_listen_setting(
    tmp_path: Path, listen: str, address: tuple[str, int] | None
) -> None:
    config = tmp_path / "pipeline.toml"
    config.write_text(f'[pipeline]\nmetrics_listen = "{listen}"\n')
    assert load_pipeline(config, {}).metrics_address == address


@pytest.mark.parametrize("listen", ["9464", "localhost:", ":9464", "host:70000", "host:x"])
def test_a_bad_metrics_listen_is_refused(tmp_path: Path, listen: str) -> None:
    config = tmp_path / "pipeline.toml"
    config.write_text(f'[pipeline]\nmetrics_listen = "{listen}"\n')
    with pytest.raises(SettingsError, match=r"pipeline\.metrics_listen"):
        load_pipeline(config, {})
    config.write_text("[pipeline]\nmetrics_listen = 9464\n")
    with pytest.raises(SettingsError, match=r"pipeline\.metrics_listen: must be a string"):
        load_pipeline(config, {})
