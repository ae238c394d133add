"""Two real quality runs over a small lake, one that keeps every expectation and one that
breaks some: what each finds (the breaking rows by their keys too), and what ``edgebus
quality`` shows of them, with its exit status."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from lake_fixture import DeltaBatchWriter
from pyspark.sql import SparkSession
from quality_lake import NOW, bad_lake, good_lake
from repeated_runs import outputs_of_repeated_runs

from edgebus import cli
from schemas.expectations import build_suite
from schemas.quality import (
    QUALITY_APP_ID,
    QUALITY_RESULTS_PARTITION_BY,
    QUALITY_RESULTS_SCHEMA,
    QUALITY_RESULTS_TABLE,
)
from schemas.tables import TABLES
from streaming.quality import QualityResult, run_quality

LATER = NOW + dt.timedelta(minutes=10)
# quality_results as the first runs made it, before the column naming the breaking rows.
BEFORE_ROWS_SCHEMA = pa.schema([f for f in QUALITY_RESULTS_SCHEMA if f.name != "unexpected_rows"])


@dataclass(frozen=True, slots=True)
class Runs:
    lake: Path
    good: list[QualityResult]  # run 0
    bad: list[QualityResult]  # run 1


@pytest.fixture(scope="module")
def runs(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Run 0 over tables that keep every expectation; run 1, ten minutes later, after they were
    replaced by tables that break some. The results table is there before run 0, empty, as
    runs made it before it had ``unexpected_rows``: run 0 adds the column."""
    lake = tmp_path_factory.mktemp("quality") / "lake"
    good_lake(lake)
    results = lake / QUALITY_RESULTS_TABLE
    results.mkdir(parents=True)
    DeltaTable.create(
        str(results), BEFORE_ROWS_SCHEMA, partition_by=list(QUALITY_RESULTS_PARTITION_BY)
    )
    good = run_quality(spark, lake, now=NOW)
    for table in TABLES:
        if table != QUALITY_RESULTS_TABLE:
            shutil.rmtree(lake / table, ignore_errors=True)
    # Spark's Delta caches each path's log; a table deleted and made anew at the same path
    # (only tests do that) must not be read through the old one.
    spark._jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()
    bad_lake(lake)
    bad = run_quality(spark, lake, now=LATER)
    return Runs(lake, good, bad)


@pytest.fixture
def lake(runs: Runs) -> Path:
    return runs.lake


pytestmark = pytest.mark.spark


def quality(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["quality", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def failures(results: list[QualityResult]) -> dict[tuple[str, str, str | None], QualityResult]:
    return {(r.table, r.expectation, r.columns): r for r in results if not r.success}


def test_a_lake_that_keeps_every_expectation_passes(runs: Runs) -> None:
    results = runs.good

    assert {r.table for r in results} == {"messages", "logs", "usage", "quota_events"}
    assert failures(results) == {}
    by_table = {
        r.table: r for r in results if r.expectation == "expect_column_values_to_not_be_null"
    }
    assert by_table["messages"].element_count == 5
    assert all(r.error is None and r.observed is None for r in results)
    assert all(r.unexpected_rows is None for r in results)


def test_a_results_table_made_before_the_rows_column_gets_it(runs: Runs) -> None:
    # The fixture's table had the schema of the first runs; run 0 added the column in place.
    delta = DeltaTable(str(runs.lake / QUALITY_RESULTS_TABLE))
    assert [f.name for f in delta.schema().fields] == QUALITY_RESULTS_SCHEMA.names
    assert delta.transaction_version(QUALITY_APP_ID) == 1


def test_broken_rows_are_reported_with_counts_and_observed_values(runs: Runs) -> None:
    found = failures(runs.bad)

    assert set(found) == {
        ("messages", "expect_compound_columns_to_be_unique", "node, seq"),
        ("messages", "expect_column_values_to_be_in_set", "qos"),
        ("messages", "expect_column_values_to_not_match_regex", "topic"),
        ("logs", "expect_column_values_to_be_in_set", "event_type"),
        ("usage", "expect_column_pair_values_a_to_be_greater_than_b", "day_value, value"),
        ("quota_events", "expect_column_values_to_be_in_set", "state"),
    }
    unique = found["messages", "expect_compound_columns_to_be_unique", "node, seq"]
    # Both rows of the duplicate count; the row 5 days old (qos 7) is outside the window.
    assert (unique.unexpected_count, unique.element_count) == (2, 7)
    assert json.loads(unique.observed or "") == [{"value": ["edge-a", 2], "count": 2}]
    # The rows that broke each one, by (node, seq): both duplicates are one key.
    assert json.loads(unique.unexpected_rows or "") == [{"node": "edge-a", "seq": 2}]
    qos = found["messages", "expect_column_values_to_be_in_set", "qos"]
    assert qos.unexpected_count == 2
    assert json.loads(qos.observed or "") == [{"value": 3, "count": 2}]
    assert json.loads(qos.kwargs or "") == {"value_set": [0, 1, 2]}
    assert json.loads(qos.unexpected_rows or "") == [
        {"node": "edge-a", "seq": 3},
        {"node": "edge-a", "seq": 4},
    ]
    topic = found["messages", "expect_column_values_to_not_match_regex", "topic"]
    assert json.loads(topic.unexpected_rows or "") == [{"node": "edge-a", "seq": 5}]
    # The invalid log row ("bogus", payload_valid false) is not held to the known events.
    event = found["logs", "expect_column_values_to_be_in_set", "event_type"]
    assert (event.unexpected_count, event.element_count) == (1, 2)
    assert json.loads(event.observed or "") == [{"value": "teleport", "count": 1}]
    assert json.loads(event.kwargs or "")["row_condition"] == "payload_valid == true"
    assert json.loads(event.unexpected_rows or "") == [{"node": "edge-a", "seq": 2}]
    state = found["quota_events", "expect_column_values_to_be_in_set", "state"]
    assert state.unexpected_count == 1
    assert json.loads(state.observed or "") == [{"value": "melting", "count": 1}]
    # Tables without a journal record's identity name rows by their own key.
    assert json.loads(state.unexpected_rows or "") == [
        {"tenant": "acme", "metric": "messages_per_day", "batch_id": 2}
    ]
    day = found["usage", "expect_column_pair_values_a_to_be_greater_than_b", "day_value, value"]
    assert day.unexpected_count == 1
    assert json.loads(day.observed or "") == [{"value": [4, 5], "count": 1}]
    assert json.loads(day.unexpected_rows or "") == [
        {
            "tenant": "acme",
            "date": "2024-03-10",
            "metric": "messages_in",
            "window_start": "2024-03-10T10:01:00",
        }
    ]
    # Expectations that held name no rows.
    assert all(r.unexpected_rows is None for r in runs.bad if r.success)


def test_the_latest_run_per_table_with_its_failed_expectations(
    lake: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = quality(capsys, "--lake", str(lake))

    # The latest run of a table failed: exit 1, as a great-expectations checkpoint would.
    assert (code, err) == (1, "")
    lines = out.splitlines()
    assert lines[0] == "run 1  2024-03-10T12:10:00Z  4 of 4 tables failed"
    assert lines[1].split() == [
        "logs",
        "FAILED",
        "1",
        "of",
        "8",
        "expectations",
        "failed,",
        "3",
        "rows",
    ]
    assert "    EXPECTATION" in lines[2]
    assert lines[3].split()[:5] == [
        "expect_column_values_to_be_in_set",
        "event_type",
        "1",
        "of",
        "2",
    ]
    assert 'observed [{"count":1,"value":"teleport"}]' in lines[3]
    assert "  node, seq: (edge-a, 2)  " in lines[3]
    unique = next(line for line in lines if "expect_compound_columns_to_be_unique" in line)
    assert unique.split()[1:6] == ["node,", "seq", "2", "of", "7"]
    assert '"value":["edge-a",2]' in unique
    qos = next(
        line for line in lines if "expect_column_values_to_be_in_set" in line and "qos" in line
    )
    assert "  node, seq: (edge-a, 3), (edge-a, 4)  " in qos
    assert "run 0" not in out  # only the latest run by default


def test_runs_n_shows_older_runs_too(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = quality(capsys, "--lake", str(lake), "--runs", "5")

    assert code == 1  # the latest run of each table failed; run 0's passing does not count
    headers = [line for line in out.splitlines() if line.startswith("run ")]
    assert headers == [
        "run 1  2024-03-10T12:10:00Z  4 of 4 tables failed",
        "run 0  2024-03-10T12:00:00Z  0 of 4 tables failed",
    ]
    assert "  messages      ok      8 expectations met, 5 rows" in out


def test_json_gives_every_result_of_a_table(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = quality(
        capsys, "--lake", str(lake), "--table", "quota_events", "--format", "json"
    )

    assert code == 1
    docs = [json.loads(line) for line in out.splitlines()]
    assert {d["table"] for d in docs} == {"quota_events"}
    assert len(docs) == 7
    assert [d["success"] for d in docs].count(False) == 1
    failed = docs[0]  # failures first
    assert failed["expectation"] == "expect_column_values_to_be_in_set"
    assert failed["columns"] == ["state"]
    assert failed["kwargs"] == {"value_set": ["ok", "warn", "blocked", "cleared"]}
    assert failed["observed"] == [{"value": "melting", "count": 1}]
    assert (failed["unexpected_count"], failed["element_count"]) == (1, 2)
    assert failed["run"] == 1
    assert failed["run_at"] == "2024-03-10T12:10:00.000000Z"
    assert failed["unexpected_rows"] == [
        {"tenant": "acme", "metric": "messages_per_day", "batch_id": 2}
    ]
    assert all(d["unexpected_rows"] is None for d in docs[1:])


def test_failed_only(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = quality(
        capsys, "--lake", str(lake), "--runs", "2", "--failed", "--format", "json"
    )

    docs = [json.loads(line) for line in out.splitlines()]
    assert code == 1
    assert len(docs) == 6
    assert all(not d["success"] and d["run"] == 1 for d in docs)


def test_unknown_table(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for failed in ((), ("--failed",)):
        code, out, err = quality(capsys, "--lake", str(lake), "--table", "nope", *failed)

        assert (code, out) == (0, "")
        assert "no results for table 'nope' in run 1" in err


def test_no_runs_yet_and_no_lake(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = quality(capsys, "--lake", str(tmp_path))
    assert (code, out) == (0, "")
    assert "no quality runs in" in err
    assert "quality_interval_seconds" in err

    code, out, err = quality(capsys, "--lake", str(tmp_path / "missing"))
    assert (code, out) == (2, "")
    assert "no lake at" in err


def test_bad_runs_argument(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["quality", "--runs", "0"])
    assert exit_info.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_twenty_runs_in_fresh_processes_exit_1_over_a_failed_run(lake: Path) -> None:
    command = [sys.executable, "-m", "edgebus.quality_cli", "--lake", str(lake), "--runs", "2"]

    table, doc = outputs_of_repeated_runs(command, returncode=1)

    assert table.startswith("run 1  2024-03-10T12:10:00Z")
    per_run = sum(
        len(build_suite(t).expectations) for t in ("messages", "logs", "usage", "quota_events")
    )
    assert len(doc.splitlines()) == 2 * per_run


def test_exit_0_when_the_latest_run_of_every_table_shown_passed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Results as runs made them before unexpected_rows (read as null): messages failed in
    # run 0 and passed in run 1; logs passed in run 0 and was not validated in run 1.
    writer = DeltaBatchWriter(
        tmp_path / QUALITY_RESULTS_TABLE,
        QUALITY_APP_ID,
        BEFORE_ROWS_SCHEMA,
        QUALITY_RESULTS_PARTITION_BY,
    )
    for run, rows in enumerate([[("messages", False), ("logs", True)], [("messages", True)]]):
        at = NOW + run * dt.timedelta(minutes=10)
        results = [
            QualityResult(
                run,
                at,
                table,
                table,
                "expect_column_values_to_be_in_set",
                "qos",
                None,
                ok,
                None,
                0 if ok else 1,
                5,
                None,
                None,
            ).row()
            for table, ok in rows
        ]
        for row in results:
            del row["unexpected_rows"]
        writer.write(run, pa.Table.from_pylist(results, schema=BEFORE_ROWS_SCHEMA))

    assert quality(capsys, "--lake", str(tmp_path))[0] == 0
    code, out, _ = quality(capsys, "--lake", str(tmp_path), "--runs", "2", "--format", "json")
    assert code == 0  # logs' latest run is run 0, and it passed
    assert [json.loads(line)["unexpected_rows"] for line in out.splitlines()] == [None] * 3
    code, out, _ = quality(capsys, "--lake", str(tmp_path), "--runs", "2", "--failed")
    assert code == 0
    assert "run 0" in out
    # Nothing failed in what was asked: said on stderr.
    code, out, err = quality(capsys, "--lake", str(tmp_path), "--failed")
    assert (code, out) == (0, "")
    assert err == "edgebus quality: no failed expectations in run 1\n"
    # In a process of its own, as a script would run it.
    done = subprocess.run(
        [sys.executable, "-m", "edgebus.quality_cli", "--lake", str(tmp_path), "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
