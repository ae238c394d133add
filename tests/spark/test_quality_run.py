"""Quality runs (``streaming.quality.run_quality``) over small real Delta tables: what lands in
``quality_results``, which tables and rows a run reads, failures of a table. What a run finds
in a lake that keeps every expectation and in one that breaks some is in
``test_quality_cli.py``, beside what ``edgebus quality`` shows of those same two runs (a run
costs tens of seconds of Spark jobs here: CI's time)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from lake_fixture import DeltaBatchWriter
from pyspark.sql import SparkSession
from quality_lake import NOW, bad_lake, message, write

from schemas.quality import QUALITY_APP_ID, QUALITY_RESULTS_TABLE, VALIDATION_ERROR
from schemas.tables import TABLES
from sinks.delta import DeltaTableWriter, read_table
from streaming.quality import QualityResult, QualitySchedule, run_quality

pytestmark = pytest.mark.spark


def failures(results: list[QualityResult]) -> dict[tuple[str, str, str | None], QualityResult]:
    return {(r.table, r.expectation, r.columns): r for r in results if not r.success}


def test_results_are_kept_one_commit_per_run_numbered_from_zero(
    spark: SparkSession, tmp_path: Path
) -> None:
    bad_lake(tmp_path)

    first = run_quality(spark, tmp_path, now=NOW, tables=["messages"])
    second = run_quality(spark, tmp_path, now=NOW, tables=["messages", "quota_events"])

    assert {r.run for r in first} == {0}
    assert {r.run for r in second} == {1}
    kept = read_table(tmp_path / QUALITY_RESULTS_TABLE)
    assert kept.num_rows == len(first) + len(second)
    rows = kept.to_pylist()
    assert {(row["run"], row["table"]) for row in rows} == {
        (0, "messages"),
        (1, "messages"),
        (1, "quota_events"),
    }
    assert all(row["date"] == NOW.date() and row["run_at"] == NOW for row in rows)
    assert sum(not row["success"] for row in rows if row["run"] == 1) == 4
    # The run number is the app transaction: what `edgebus quality` starts from.
    writer = DeltaTableWriter(tmp_path / QUALITY_RESULTS_TABLE, QUALITY_APP_ID, kept.schema)
    assert writer.last_batch_id() == 1


def test_tables_the_lake_does_not_have_yet_are_skipped(spark: SparkSession, tmp_path: Path) -> None:
    write(tmp_path, "messages", [message(1)])

    results = run_quality(spark, tmp_path, now=NOW)

    assert {r.table for r in results} == {"messages"}
    assert run_quality(spark, tmp_path / "empty", now=NOW) == []
    assert not (tmp_path / "empty" / QUALITY_RESULTS_TABLE).exists()


def test_a_table_that_cannot_be_validated_is_a_failed_row_and_the_others_still_run(
    spark: SparkSession, tmp_path: Path
) -> None:
    write(tmp_path, "messages", [message(1), message(2)])
    # A "usage" table of someone else's making, without the columns the suite reads.
    schema = pa.schema([pa.field("tenant", pa.string()), pa.field("date", pa.date32())])
    DeltaBatchWriter(tmp_path / "usage", "other", schema, ("date",)).write(
        0, pa.table({"tenant": ["acme"], "date": [NOW.date()]}, schema=schema)
    )

    results = run_quality(spark, tmp_path, now=NOW)

    (broken,) = [r for r in results if r.table == "usage"]
    assert (broken.expectation, broken.success) == (VALIDATION_ERROR, False)
    assert "no such columns" in (broken.error or "")
    assert {r.table for r in results} == {"usage", "messages"}
    assert failures([r for r in results if r.table == "messages"]) == {}


def test_only_the_window_of_dates_is_read(spark: SparkSession, tmp_path: Path) -> None:
    write(tmp_path, "messages", [message(1, qos=5), message(2)])

    tomorrow = run_quality(spark, tmp_path, now=NOW.replace(day=NOW.day + 1), tables=["messages"])
    later = run_quality(spark, tmp_path, now=NOW.replace(day=NOW.day + 2), tables=["messages"])

    qos = [r for r in tomorrow if r.columns == "qos"]
    assert [(r.success, r.unexpected_count, r.element_count) for r in qos] == [(False, 1, 2)]
    assert {r.element_count for r in later} == {0}
    assert all(r.success for r in later)


def test_max_rows_caps_what_a_run_reads(spark: SparkSession, tmp_path: Path) -> None:
    write(tmp_path, "messages", [message(seq) for seq in range(1, 11)])

    results = run_quality(spark, tmp_path, now=NOW, tables=["messages"], max_rows=4)

    assert {r.element_count for r in results} == {4}


def test_bad_arguments_are_refused(spark: SparkSession, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no suite"):
        run_quality(spark, tmp_path, now=NOW, tables=["nope"])
    with pytest.raises(ValueError, match="time-zone aware"):
        run_quality(spark, tmp_path, now=NOW.replace(tzinfo=None))


@pytest.mark.skipif("quarantine" not in TABLES, reason="no quarantine table in the lake yet")
def test_quarantine_rows_are_held_to_one_row_per_record_and_table(
    spark: SparkSession, tmp_path: Path
) -> None:
    def quarantined(seq: int, table: str, rule: str = "json_payload") -> dict[str, Any]:
        row = message(seq)
        del row["size"]
        return {**row, "table": table, "rule": rule, "reason": "the payload is not JSON"}

    write(
        tmp_path,
        "quarantine",
        [
            quarantined(1, "messages"),
            quarantined(1, "messages", "ts_sane"),  # the same record twice for one table
            quarantined(2, "logs"),
            quarantined(3, "nowhere"),
        ],
    )

    found = failures(run_quality(spark, tmp_path, now=NOW, tables=["quarantine"]))

    assert set(found) == {
        ("quarantine", "expect_compound_columns_to_be_unique", "node, seq, table"),
        ("quarantine", "expect_column_values_to_be_in_set", "table"),
    }
    assert found["quarantine", "expect_column_values_to_be_in_set", "table"].unexpected_count == 1


def test_the_real_run_writes_results_from_the_background_thread(
    spark: SparkSession, tmp_path: Path
) -> None:
    bad_lake(tmp_path)
    quality = QualitySchedule(
        tmp_path, 60.0, run=functools.partial(run_quality, spark), clock=lambda: NOW
    )
    quality.maybe_run(0.0)

    assert quality.maybe_run(60.0)
    assert quality.wait(timeout=120)

    assert quality.failures == 0
    rows = read_table(tmp_path / QUALITY_RESULTS_TABLE, columns=["run", "success"]).to_pylist()
    assert {row["run"] for row in rows} == {0}
    assert sum(not row["success"] for row in rows) == 6
