"""A lake in a bucket (issue 12): the real pipeline writes every table into ``s3://bucket/lake``
on an S3-compatible server (moto's, started here), and every reader reads it from there.

Spark writes through Hadoop's S3A (``hadoop-aws`` from ``.venv/delta-jars``), the readers read
with delta-rs; each reader runs as its own process (as analysts run it) and must exit 0 every
time. A replayed batch adds nothing; a bucket that is not there is one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from test_lake_readers import NOON, write_journal
from test_lake_upgrade import identities

from bench.s3_server import s3_server
from schemas.tables import TABLES
from sinks.delta import read_table
from sinks.maintenance import maintain_table
from sinks.storage import ObjectPath, StorageOptions, open_delta
from streaming import lake, pipeline
from streaming.quality import run_quality
from streaming.quota_settings import QuotaSettings, TenantLimits
from streaming.settings import PipelineSettings

pytestmark = pytest.mark.spark

BUCKET = "edgebus-lake"


@dataclass(frozen=True)
class Bucket:
    options: StorageOptions

    def env(self) -> dict[str, str]:
        """The environment a reader process gets: the standard AWS variables only."""
        return {
            **os.environ,
            "AWS_ACCESS_KEY_ID": self.options.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.options.secret_access_key,
            "AWS_ENDPOINT_URL": self.options.endpoint_url,
            "AWS_REGION": self.options.region,
        }


@pytest.fixture(scope="module")
def bucket() -> Iterator[Bucket]:
    with s3_server(BUCKET) as options:
        yield Bucket(options)


@pytest.fixture(scope="module")
def settings(
    spark: SparkSession, bucket: Bucket, tmp_path_factory: pytest.TempPathFactory
) -> PipelineSettings:
    from ingest import source

    source.register(spark)
    root = tmp_path_factory.mktemp("s3")
    found = PipelineSettings(
        data_dir=root / "data",
        lake=ObjectPath(BUCKET, "lake", bucket.options),
        master="local[2]",
        shuffle_partitions=2,
        quality_interval_seconds=0.0,
        maintenance_interval_seconds=0.0,
    )
    write_journal(found)
    pipeline.run(found, once=True, spark=spark, quota=_quota())
    run_quality(spark, found.lake, now=NOON)
    return found


def _quota() -> QuotaSettings:
    return QuotaSettings(
        load_limits=lambda: {"acme": TenantLimits(messages_per_day=10)},
        operator_token="operator",
        clock=lambda: NOON,
    )


def test_every_table_is_written_into_the_bucket_once(
    spark: SparkSession, settings: PipelineSettings
) -> None:
    for table in TABLES:
        assert read_table(settings.table_path(table)).num_rows > 0, table
    # The journal's 40 records of edge-a: each in messages, logs or quarantine, never twice.
    messages, logs = identities(settings, "messages"), identities(settings, "logs")
    quarantined = read_table(
        settings.table_path("quarantine"), "node = 'edge-a' AND \"table\" = 'messages'"
    ).num_rows
    assert set(messages.values()) == set(logs.values()) == {1}  # no row twice
    assert messages.total() + logs.total() + quarantined == 40
    # The checkpoint stays on this machine; the bucket holds tables only.
    assert settings.checkpoint_root.is_relative_to(settings.data_dir)
    assert (settings.checkpoint_path(pipeline.JOB) / "commits").is_dir()

    # A replay of the last batch against the same bucket (its commit marker gone, as when the
    # driver died after the Delta commits) adds nothing: each table skips the batch.
    before = {table: open_delta(settings.table_path(table)).version() for table in TABLES}
    commits = settings.checkpoint_path(pipeline.JOB) / "commits"
    last = max(int(entry.name) for entry in commits.iterdir() if entry.name.isdigit())
    (commits / str(last)).unlink()
    pipeline.run(settings, once=True, spark=spark, quota=_quota())
    assert identities(settings, "messages") == messages
    assert identities(settings, "logs") == logs
    after = {table: open_delta(settings.table_path(table)).version() for table in TABLES}
    assert after == before
    assert (commits / str(last)).is_file()  # the replayed batch is marked done again


def test_lake_load_reads_the_bucket_with_time_travel(
    spark: SparkSession, settings: PipelineSettings
) -> None:
    now = lake.load(spark, settings.lake, "messages")
    assert now.count() == read_table(settings.table_path("messages")).num_rows
    # Version 0, the table's first commit, holds the first batch only.
    assert 0 < lake.load(spark, settings.lake, "messages", version=0).count() <= now.count()
    acme = lake.load(spark, settings.lake, "logs", where="tenant = 'acme'")
    assert acme.count() == read_table(settings.table_path("logs"), "tenant = 'acme'").num_rows
    arrow = lake.load_arrow(settings.lake, "messages", version=0)
    assert arrow.num_rows == lake.load(spark, settings.lake, "messages", version=0).count()


def test_maintenance_in_the_bucket_keeps_the_rows(
    spark: SparkSession, settings: PipelineSettings
) -> None:
    path = settings.table_path("messages")
    rows = identities(settings, "messages")
    report = maintain_table(spark, path, vacuum_retention_hours=168)  # over S3A
    assert report.path == f"s3a://{BUCKET}/lake/messages"
    assert report.version_after >= report.version_before
    assert identities(settings, "messages") == rows
    assert lake.load(spark, settings.lake, "messages", version=report.version_before).count() == (
        rows.total()
    )


def _edgebus(bucket: Bucket, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgebus.cli", *args],
        env=bucket.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_readers_read_the_bucket_from_the_environment(
    settings: PipelineSettings, bucket: Bucket
) -> None:
    uri = str(settings.lake)
    assert uri == f"s3://{BUCKET}/lake"
    logs = read_table(settings.table_path("logs"), "tenant = 'acme'").num_rows
    for _attempt in range(2):  # exit 0 every time
        done = _edgebus(bucket, "logs", "--lake", uri, "--tenant", "acme", "--format", "json")
        assert done.returncode == 0, done.stderr
        assert len(done.stdout.splitlines()) == logs

    done = _edgebus(bucket, "sql", "SELECT count(*) AS n FROM messages", "--lake", uri)
    assert done.returncode == 0, done.stderr
    total = read_table(settings.table_path("messages")).num_rows
    assert done.stdout.split()[1:] == [str(total)]

    done = _edgebus(
        bucket, "usage", "--lake", uri, "--tenant", "acme", "--date", "2024-03-10", "--format",
        "json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    usage = json.loads(done.stdout)
    assert {row["metric"] for row in usage["counters"]} == {"messages_in", "sessions"}
    assert usage["quota"], usage  # acme's 10 messages a day: decided in the bucket too

    done = _edgebus(bucket, "quality", "--lake", uri, "--format", "json")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_a_bucket_that_is_not_there_is_one_line_and_exit_2(
    settings: PipelineSettings, bucket: Bucket, tmp_path: Path
) -> None:
    missing = "s3://no-such-bucket/lake"
    for args in (
        ["logs", "--lake", missing, "--tenant", "acme"],
        ["sql", "SELECT 1", "--lake", missing],
        ["usage", "--lake", missing, "--tenant", "acme"],
        ["pipeline", "--lake", missing, "--data-dir", str(tmp_path), "--once"],
        ["maintain", "--lake", missing],
    ):
        done = _edgebus(bucket, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert "Traceback" not in done.stderr, args
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (args, lines)
        assert "cannot reach the lake s3://no-such-bucket/lake" in lines[0], lines
        assert "404" in lines[0], lines


def test_wrong_keys_are_one_line_and_exit_2(tmp_path: Path) -> None:
    with s3_server("guarded-lake", authenticated=True) as options:
        right = Bucket(options)
        done = _edgebus(right, "sql", "SELECT 1", "--lake", "s3://guarded-lake/lake")
        assert "no tables in s3://guarded-lake/lake yet" in done.stderr  # the keys work
        wrong = Bucket(dataclasses.replace(options, secret_access_key="not-the-secret"))
        for args in (
            ["logs", "--lake", "s3://guarded-lake/lake", "--tenant", "acme"],
            ["pipeline", "--lake", "s3://guarded-lake/lake", "--data-dir", str(tmp_path)],
        ):
            done = _edgebus(wrong, *args)
            assert done.returncode == 2, (args, done.stderr)
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            assert len(lines) == 1, (args, lines)
            assert "cannot reach the lake s3://guarded-lake/lake" in lines[0], lines
            assert "403 Forbidden; SignatureDoesNotMatch: The request signature" in lines[0]
