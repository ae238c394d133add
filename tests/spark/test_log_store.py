"""edgebus's Delta log store for local tables (sinks/jvm): Delta's listing, without asking the
status of every entry in the log's directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from sinks.delta import checkpoint_and_clean
from streaming.session import LOCAL_LOG_STORE, LOG_STORE_KEY

pytestmark = pytest.mark.spark


def names(statuses: Any) -> list[str]:
    found = []
    while statuses.hasNext():
        found.append(statuses.next().getPath().getName())
    return found


def stores(spark: SparkSession) -> tuple[Any, Any, Any]:
    jvm = spark._jvm
    assert jvm is not None
    conf = spark._jsc.hadoopConfiguration()  # type: ignore[union-attr]
    ours = getattr(jvm, LOCAL_LOG_STORE)(conf)
    delta = jvm.io.delta.storage.HDFSLogStore(conf)
    return ours, delta, conf


def test_lists_what_deltas_own_store_lists_in_the_same_order(
    spark: SparkSession, tmp_path: Path
) -> None:
    log = tmp_path / "_delta_log"
    log.mkdir()
    made = [
        f"{9:020d}.json",
        f"{10:020d}.json",
        f"{10:020d}.crc",
        f"{11:020d}.json",
        f"{12:020d}.checkpoint.parquet",
        f"{12:020d}.json",
        f".{12:020d}.json.crc",  # Hadoop's checksum of a file: neither store lists it
        f".{12:020d}.json.{'u' * 8}.tmp",  # a commit being written: before every version
        "_last_checkpoint",
    ]
    for name in made:
        (log / name).write_text("{}")
    (log / "_staged_commits").mkdir()
    ours, delta, conf = stores(spark)
    jvm = spark._jvm
    assert jvm is not None
    for start in (0, 10, 12, 13):
        path = jvm.org.apache.hadoop.fs.Path(f"file:{log}/{start:020d}")
        assert names(ours.listFrom(path, conf)) == names(delta.listFrom(path, conf))
    path = jvm.org.apache.hadoop.fs.Path(f"file:{log}/{10:020d}")
    assert names(ours.listFrom(path, conf)) == [
        f"{10:020d}.crc",
        f"{10:020d}.json",
        f"{11:020d}.json",
        f"{12:020d}.checkpoint.parquet",
        f"{12:020d}.json",
        "_last_checkpoint",
        "_staged_commits",
    ]
    statuses = ours.listFrom(path, conf)
    first = statuses.next()
    assert (first.getLen(), first.isDirectory()) == (2, False)


def test_a_file_deleted_while_listed_is_left_out_and_a_missing_log_is_an_error(
    spark: SparkSession, tmp_path: Path
) -> None:
    log = tmp_path / "_delta_log"
    log.mkdir()
    for version in range(3):
        (log / f"{version:020d}.json").write_text("{}")
    ours, _, conf = stores(spark)
    jvm = spark._jvm
    assert jvm is not None
    statuses = ours.listFrom(jvm.org.apache.hadoop.fs.Path(f"file:{log}/{0:020d}"), conf)
    (log / f"{1:020d}.json").unlink()  # Delta's log cleanup, between the names and the statuses
    assert names(statuses) == [f"{0:020d}.json", f"{2:020d}.json"]
    missing = jvm.org.apache.hadoop.fs.Path(f"file:{tmp_path}/nothing/{0:020d}")
    with pytest.raises(Exception, match="FileNotFoundException"):
        ours.listFrom(missing, conf)


def test_every_session_of_the_project_uses_it(spark: SparkSession, tmp_path: Path) -> None:
    assert spark.sparkContext.getConf().get(LOG_STORE_KEY) == LOCAL_LOG_STORE
    spark.range(3).write.format("delta").save(str(tmp_path / "t"))
    jvm = spark._jvm
    assert jvm is not None
    log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(
        spark._jsparkSession, str(tmp_path / "t")
    )
    # Delta picks a store per scheme (DelegatingLogStore); a Java one comes in an adaptor.
    delegate = log.store().getDelegate(log.logPath())
    assert delegate.logStoreImpl().getClass().getName() == LOCAL_LOG_STORE
    assert spark.read.format("delta").load(str(tmp_path / "t")).count() == 3
    # The log is written without Hadoop's hidden checksum files (the Parquet files have them).
    assert not [p.name for p in (tmp_path / "t" / "_delta_log").glob(".*.crc")]


def test_a_stale_hadoop_checksum_of_the_last_checkpoint_goes_at_the_next_checkpoint(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A lake written before the log went without Hadoop's checksum files has one beside
    ``_last_checkpoint``; rewritten without it, the checksum would no longer match, and Hadoop's
    checksummed local file system would refuse to read the file."""
    table = str(tmp_path / "t")
    spark.range(3).write.format("delta").save(table)
    stale = tmp_path / "t" / "_delta_log" / "._last_checkpoint.crc"
    stale.write_bytes(b"crc\x00")
    checkpoint_and_clean(spark, table)
    assert (tmp_path / "t" / "_delta_log" / "_last_checkpoint").is_file()
    assert not stale.exists()
