"""``edgebus sql`` over a small real lake (every table written with the pipeline's own writer)."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from quality_lake import TODAY, good_lake, log, write
from repeated_runs import outputs_of_repeated_runs

from edgebus import sql_cli

UTC = dt.UTC
SQL = [sys.executable, "-m", "edgebus.sql_cli"]
OTHER_DAY = TODAY - dt.timedelta(days=1)


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every table of ``good_lake``; ``logs`` gets a second commit (another tenant and day)."""
    root = tmp_path_factory.mktemp("lake")
    good_lake(root)
    (root / "_checkpoints").mkdir()  # the pipeline's, not a table
    time.sleep(0.05)  # commit times apart, for --as-of TIME
    others = [log(10 + i, tenant="other", date=OTHER_DAY) for i in range(3)]
    for row in others:
        row["ts"] -= dt.timedelta(days=1)
    write(root, "logs", others, batch_id=1)
    return root


def sql(lake: Path, query: str, *args: str, capsys: pytest.CaptureFixture[str]) -> str:
    code = sql_cli.main(["--lake", str(lake), *args, query])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def json_rows(lake: Path, query: str, *args: str, capsys: Any) -> list[dict[str, Any]]:
    out = sql(lake, query, "--format", "json", *args, capsys=capsys)
    return [json.loads(line) for line in out.splitlines()]


def test_every_table_by_its_name(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = {
        table: json_rows(lake, f"SELECT count(*) AS n FROM {table}", capsys=capsys)[0]["n"]
        for table in ("messages", "logs", "usage", "quota_events")
    }
    assert counts == {"messages": 5, "logs": 6, "usage": 3, "quota_events": 2}
    joined = json_rows(
        lake,
        "SELECT q.state, u.day_value FROM quota_events q JOIN usage u ON q.tenant = u.tenant "
        "WHERE u.window_start = (SELECT max(window_start) FROM usage) ORDER BY q.batch_id",
        capsys=capsys,
    )
    assert joined == [{"state": "warn", "day_value": 15}, {"state": "blocked", "day_value": 15}]


def test_only_the_tables_named_are_opened() -> None:
    names = ["logs", "messages", "usage", "quota_events"]
    assert sql_cli.referenced("select * from LOGS l join usage on true", names) == [
        "logs",
        "usage",
    ]
    assert sql_cli.referenced('SELECT 1 FROM "quota_events"', names) == ["quota_events"]
    assert sql_cli.referenced("SELECT logs_x FROM t", names) == []


def test_json_values(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    [row] = json_rows(
        lake,
        "SELECT ts, logs.date, seq, payload_valid, raw, details, nodes FROM logs, usage "
        "WHERE logs.tenant = 'acme' AND seq = 3 AND window_start = "
        "(SELECT min(window_start) FROM usage)",
        capsys=capsys,
    )
    assert row == {
        "ts": f"{TODAY.isoformat()}T09:00:03.000000Z",
        "date": TODAY.isoformat(),
        "seq": 3,
        "payload_valid": False,
        "raw": "{oops",
        "details": "{}",
        "nodes": [
            {"node": "edge-a", "value": 10, "reported_at": f"{TODAY.isoformat()}T10:01:00.000000Z"}
        ],
    }


def test_csv_and_table(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    query = "SELECT seq, event_type, invalid_reason FROM logs WHERE tenant = 'acme' ORDER BY seq"
    out = sql(lake, query, "--format", "csv", capsys=capsys)
    assert list(csv.reader(io.StringIO(out))) == [
        ["seq", "event_type", "invalid_reason"],
        ["1", "connect", ""],
        ["2", "disconnect", ""],
        ["3", "bogus", "not_json"],
    ]
    assert sql_cli.main(["--lake", str(lake), query]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "SEQ  EVENT_TYPE  INVALID_REASON",
        "1    connect     NULL",
        "2    disconnect  NULL",
        "3    bogus       not_json",
    ]
    assert err == ""


def test_as_of_a_version_or_a_time(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    query = "SELECT count(*) AS n FROM logs"
    assert json_rows(lake, query, "--as-of", "1", capsys=capsys) == [{"n": 3}]
    assert json_rows(lake, query, "--as-of", "2", capsys=capsys) == [{"n": 6}]
    history = DeltaTable(str(lake / "logs")).history()
    commit_ms = {entry["version"]: entry["timestamp"] for entry in history}
    between = dt.datetime.fromtimestamp((commit_ms[1] + commit_ms[2]) / 2000, UTC)
    assert json_rows(lake, query, "--as-of", between.isoformat(), capsys=capsys) == [{"n": 3}]
    assert json_rows(lake, query, "--as-of", "0s", capsys=capsys) == [{"n": 6}]


def test_as_of_before_a_table_or_past_its_versions(
    lake: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sql_cli.main(["--lake", str(lake), "--as-of", "9", "SELECT * FROM logs"]) == 2
    assert "logs has no version 9: its latest is 2" in capsys.readouterr().err
    args = ["--lake", str(lake), "--as-of", "2001-01-01", "SELECT * FROM usage"]
    assert sql_cli.main(args) == 2
    assert "usage did not exist yet at 2001-01-01T00:00:00.000000Z" in capsys.readouterr().err


def plan_files(lake: Path, query: str, capsys: pytest.CaptureFixture[str]) -> set[str]:
    """The data files DataFusion's physical plan reads (EXPLAIN VERBOSE lists them all)."""
    plan = json_rows(lake, f"EXPLAIN VERBOSE {query}", capsys=capsys)
    [text] = [row["plan"] for row in plan if row["plan_type"] == "physical_plan"]
    assert "..." not in text
    return {Path(name).name for name in re.findall(r"[^\s\[\],{}]+\.parquet", text)}


def test_partition_pruning_in_the_plan(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    delta = DeltaTable(str(lake / "logs"))

    def files(predicate: str) -> set[str]:
        return {Path(uri).name for uri in delta.file_uris(file_pruning_predicate=predicate)}

    everything = plan_files(lake, "SELECT * FROM logs", capsys)
    assert everything == files("tenant IS NOT NULL")
    acme = plan_files(lake, "SELECT * FROM logs WHERE tenant = 'acme'", capsys)
    assert acme == files("tenant = 'acme'")
    assert acme
    assert acme < everything
    day = f"DATE '{OTHER_DAY.isoformat()}'"
    other_day = plan_files(lake, f"SELECT seq FROM logs WHERE date = {day}", capsys)
    assert other_day == files(f"date = '{OTHER_DAY.isoformat()}'")
    assert other_day.isdisjoint(acme)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SQL, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("SELEC 1", 'SQL error: ParserError("Expected: an SQL statement, found: SELEC'),
        ("SELECT nope FROM logs", "Schema error: No field named nope."),
        (
            "SELECT * FROM nothing",
            "table 'datafusion.public.nothing' not found (the lake's "
            "tables: logs, messages, quota_events, usage)",
        ),
        ("SELECT seq + 'x' FROM logs", "Error"),
    ],
)
def test_a_query_datafusion_refuses_is_one_line_and_exit_2(
    lake: Path, query: str, message: str
) -> None:
    done = run_cli("--lake", str(lake), query)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith("edgebus sql: ")
    assert message in done.stderr
    assert done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr


def test_no_lake_is_exit_2(lake: Path, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a lake")
    for where, message in [
        (tmp_path / "nope", f"no lake at {tmp_path / 'nope'}"),
        (tmp_path, f"{tmp_path} is not a lake"),
        (lake / "logs", f"{lake / 'logs'} is a Delta table, not a lake"),
    ]:
        done = run_cli("--lake", str(where), "SELECT 1")
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert message in done.stderr
        assert done.stderr.count("\n") == 1


def test_a_data_file_gone_is_exit_1(tmp_path: Path) -> None:
    write(tmp_path, "logs", [log(1)])
    [data_file] = (tmp_path / "logs").rglob("*.parquet")
    data_file.unlink()
    done = run_cli("--lake", str(tmp_path), "SELECT * FROM logs")
    assert done.returncode == 1
    assert done.stderr.startswith("edgebus sql: the query failed while reading: ")
    assert "Traceback" not in done.stderr


def test_a_process_reading_the_lake_exits_0_every_time(lake: Path) -> None:
    query = "SELECT tenant, date, count(*) AS n FROM logs GROUP BY tenant, date ORDER BY tenant"
    table, json_lines = outputs_of_repeated_runs([*SQL, "--lake", str(lake), query])
    assert table.splitlines()[0].split() == ["TENANT", "DATE", "N"]
    assert [json.loads(line)["n"] for line in json_lines.splitlines()] == [3, 3]
