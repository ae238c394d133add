"""``edgebus usage`` over small ``usage`` and ``quota_events`` Delta tables written with the
pipeline's own writers."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from repeated_runs import outputs_of_repeated_runs
from usage_lake import write_lake

from edgebus import cli, usage_cli

NOW = dt.datetime(2024, 3, 10, 12, 0, tzinfo=dt.UTC)


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lake(tmp_path_factory.mktemp("lake"))


def run_json(lake: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code = usage_cli.main(["--lake", str(lake), "--format", "json", *args], now=NOW)
    out, _ = capsys.readouterr()
    assert code == 0
    [line] = out.splitlines()
    doc: dict[str, Any] = json.loads(line)
    return doc


def test_today_json(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(lake, "--tenant", "acme", capsys=capsys)
    assert doc["tenant"] == "acme"
    assert doc["date"] == "2024-03-10"
    assert doc["counters"] == [
        {
            "metric": "bytes_in",
            "quota_metric": "bytes_per_day",
            "kind": "counter",
            "day_total": 9000,
            "last_window_start": "2024-03-10T11:58:00.000000Z",
            "last_window_end": "2024-03-10T11:59:00.000000Z",
            "last_value": 9000,
        },
        {
            "metric": "messages_in",
            "quota_metric": "messages_per_day",
            "kind": "counter",
            "day_total": 200,  # not yesterday's 999
            "last_window_start": "2024-03-10T11:59:00.000000Z",
            "last_window_end": "2024-03-10T12:00:00.000000Z",
            "last_value": 60,
        },
        {
            "metric": "sessions",
            "quota_metric": None,
            "kind": "gauge",
            "day_total": 5,  # the day's peak
            "last_window_start": "2024-03-10T11:59:00.000000Z",
            "last_window_end": "2024-03-10T12:00:00.000000Z",
            "last_value": 2,  # now
        },
    ]
    assert doc["quota"] == [
        {
            "metric": "messages_per_day",
            "usage_metric": "messages_in",
            "state": "warn",
            "limit": 250,
            "usage": 200,  # the day's messages_in
            "value": 200,
            "decided_at": "2024-03-10T11:59:00.000000Z",
            "batch_id": 7,
        },
        {
            "metric": "bytes_per_day",
            "usage_metric": "bytes_in",
            "state": "cleared",
            "limit": None,
            "usage": 9000,
            "value": 3000,
            "decided_at": "2024-03-10T08:00:00.000000Z",
            "batch_id": 5,
        },
    ]


def test_another_day_and_its_quota_state(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(lake, "--tenant", "acme", "--date", "2024-03-09", capsys=capsys)
    assert [(c["metric"], c["day_total"]) for c in doc["counters"]] == [("messages_in", 999)]
    # The state at the end of that day, whatever came later.
    assert [
        (q["metric"], q["state"], q["limit"], q["usage"], q["batch_id"]) for q in doc["quota"]
    ] == [
        ("messages_per_day", "blocked", 1000, 999, 3),
        ("bytes_per_day", "blocked", 5000, 0, 2),
    ]


def test_a_state_holds_across_days(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # No decision on 2024-03-12: the latest ones still stand; no counters that day.
    code = usage_cli.main(
        ["--lake", str(lake), "--tenant", "other", "--date", "2024-03-12", "--format", "json"]
    )
    out, err = capsys.readouterr()
    assert code == 0
    doc = json.loads(out)
    assert doc["counters"] == []
    assert [(q["metric"], q["state"], q["usage"]) for q in doc["quota"]] == [
        ("messages_per_day", "blocked", 0)
    ]
    assert "no counters for tenant 'other' on 2024-03-12" in err


def test_only_the_tenant(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(lake, "--tenant", "other", capsys=capsys)
    assert [(c["metric"], c["day_total"]) for c in doc["counters"]] == [("messages_in", 7)]
    assert [(q["metric"], q["state"], q["limit"]) for q in doc["quota"]] == [
        ("messages_per_day", "blocked", 5)
    ]


def test_table_format(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert usage_cli.main(["--lake", str(lake), "--tenant", "acme"], now=NOW) == 0
    out, err = capsys.readouterr()
    assert err == ""
    title, blank, *rest = out.splitlines()
    assert title == "tenant acme, 2024-03-10 (UTC)"
    assert blank == ""
    split = rest.index("")
    counters, quota = rest[:split], rest[split + 1 :]
    assert [line.split() for line in counters] == [
        ["METRIC", "KIND", "DAY_TOTAL", "LAST_MINUTE", "LAST_VALUE", "QUOTA"],
        ["bytes_in", "counter", "9000", "2024-03-10T11:58Z", "9000", "bytes_per_day"],
        ["messages_in", "counter", "200", "2024-03-10T11:59Z", "60", "messages_per_day"],
        ["sessions", "gauge", "5", "2024-03-10T11:59Z", "2", "-"],
    ]
    # Each quota names the counter that measures it, each counter the quota it counts.
    assert [line.split() for line in quota] == [
        ["QUOTA", "COUNTED_BY", "STATE", "LIMIT", "USAGE", "USED", "DECIDED_AT"],
        ["messages_per_day", "messages_in", "warn", "250", "200", "80%", "2024-03-10T11:59:00Z"],
        ["bytes_per_day", "bytes_in", "cleared", "-", "9000", "-", "2024-03-10T08:00:00Z"],
    ]
    for block in (counters, quota):
        # Aligned: every column starts where its header does.
        header = block[0]
        starts = [header.index(name) for name in header.split()[1:]]
        for line in block[1:]:
            for start in starts:
                assert line[start - 2 : start] == "  "
                assert line[start] != " "


def test_unknown_tenant_exits_0_with_a_clear_answer(
    lake: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert usage_cli.main(["--lake", str(lake), "--tenant", "nobody"], now=NOW) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "no counters for tenant 'nobody' on 2024-03-10" in err
    assert "no quota decisions recorded for tenant 'nobody' up to 2024-03-10" in err

    doc = run_json(lake, "--tenant", "nobody", capsys=capsys)
    assert doc == {"tenant": "nobody", "date": "2024-03-10", "counters": [], "quota": []}


def test_missing_tables_are_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert usage_cli.main(["--lake", str(tmp_path), "--tenant", "acme"], now=NOW) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "no usage table" in err
    assert "no quota decisions recorded" in err

    # Usage without any quota decision yet (a pipeline without a tenants file).
    write_lake(tmp_path, quota=False)
    doc = run_json(tmp_path, "--tenant", "acme", capsys=capsys)
    assert [c["metric"] for c in doc["counters"]] == ["bytes_in", "messages_in", "sessions"]
    assert doc["quota"] == []


def test_missing_lake_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert usage_cli.main(["--lake", str(tmp_path / "nope"), "--tenant", "acme"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"edgebus usage: no lake at {tmp_path / 'nope'}" in err


@pytest.mark.parametrize("table", ["usage", "quota_events"])
def test_an_unreadable_table_exits_1(
    tmp_path: Path, table: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write_lake(tmp_path)
    for data in (tmp_path / table).rglob("*.parquet"):
        data.write_bytes(b"not parquet")
    assert usage_cli.main(["--lake", str(tmp_path), "--tenant", "acme"], now=NOW) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("edgebus usage: cannot read ")
    assert f"{tmp_path / table}" in err


@pytest.mark.parametrize(
    "args",
    [
        ["--date", "2024-13-01"],
        ["--date", "today"],
        ["--format", "csv"],
        [],  # no --tenant
    ],
)
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Through the edgebus command, which must report them as its usage command's errors.
    argv = ["usage", *(["--tenant", "acme"] if args else []), *args]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert (exc.value.code, capsys.readouterr().err.splitlines()[-1].split(":")[0]) == (
        2,
        "edgebus usage",
    )


def test_hooks_into_a_parent_command(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="edgebus")
    usage_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["usage", "--lake", str(lake), "--tenant", "other", "--format", "json"]
    )
    assert args.command == "usage"
    assert usage_cli.run(args, now=NOW) == 0
    assert json.loads(capsys.readouterr().out)["counters"][0]["day_total"] == 7


def test_the_edgebus_command_runs_it(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["usage", "--lake", str(lake), "--tenant", "acme", "--date", "2024-03-09"]
    assert cli.main([*argv, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["counters"][0]["day_total"] == 999


# --- partition pruning -----------------------------------------------------------------------


def test_only_the_tenants_partitions_are_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every other file is deleted: a query that opened one would fail (exit 1)."""
    lake = write_lake(tmp_path / "lake")
    args = ["--tenant", "acme", "--date", "2024-03-09", "--format", "json"]
    expected = run_json(lake, *args, capsys=capsys)
    keep = {
        "usage": "tenant = 'acme' AND date = '2024-03-09'",
        "quota_events": "tenant = 'acme' AND date <= '2024-03-09'",
    }
    for table, predicate in keep.items():
        delta = DeltaTable(str(lake / table))
        kept = set(delta.file_uris(file_pruning_predicate=predicate))
        others = set(delta.file_uris()) - kept
        assert kept
        assert others  # the case deletes something
        for uri in others:
            Path(uri.removeprefix("file://")).unlink()
    assert run_json(lake, *args, capsys=capsys) == expected
    # The deleted files were really needed by other queries.
    assert usage_cli.main(["--lake", str(lake), "--tenant", "other"], now=NOW) == 1
    assert "cannot read" in capsys.readouterr().err


# --- the delta-rs exit trap ------------------------------------------------------------------


def test_a_process_reading_the_tables_exits_0_every_time(lake: Path) -> None:
    command = [sys.executable, "-m", "edgebus.usage_cli", "--lake", str(lake), "--tenant", "acme"]
    table, doc = outputs_of_repeated_runs([*command, "--date", "2024-03-10"])
    assert "messages_per_day  messages_in  warn" in table
    assert json.loads(doc)["counters"][1]["day_total"] == 200
