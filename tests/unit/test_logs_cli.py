"""``edgebus logs`` over a small ``logs`` Delta table written with the pipeline's own writer."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder
from lake_fixture import DeltaBatchWriter, log_row
from repeated_runs import outputs_of_repeated_runs

from edgebus import logs_cli
from edgebus.log_query import Cursor
from edgebus.logs_cli import LogQuery, time_arg
from schemas.tables import LOGS_PARTITION_BY, LOGS_SCHEMA

UTC = dt.UTC
NOW = dt.datetime(2024, 3, 12, 12, 0, tzinfo=UTC)


def event(
    tenant: str, when: str, event_type: str, client_id: str, node: str, seq: int, **extra: Any
) -> dict[str, Any]:
    ts = dt.datetime.fromisoformat(when).replace(tzinfo=UTC)
    row = log_row(tenant, ts, node, seq, event_type, client_id)
    row["details"] = json.dumps({"seq": seq}, separators=(",", ":"))
    row["time"] = ts.isoformat(timespec="milliseconds")
    row.update(extra)
    return row


# Newest first, as the command must list them.
ACME = [
    event(
        "acme",
        "2024-03-12T11:30:00",
        "connect",
        None,  # type: ignore[arg-type]
        "edge-a",
        5,
        details=None,
        time=None,
        payload_valid=False,
        invalid_reason="payload is not a JSON object",
        raw=b"not json\n\xff",
    ),
    event("acme", "2024-03-12T06:00:00", "quota_warn", "", "edge-a", 4),
    event("acme", "2024-03-12T00:00:00", "connect", "truck-3", "edge-b", 2),
    event("acme", "2024-03-11T23:59:59.999999", "acl_denied", "truck-2", "edge-a", 3),
    event("acme", "2024-03-11T10:00:00", "disconnect", "truck-2", "edge-b", 1),
    event("acme", "2024-03-10T09:00:00", "subscribe", "truck-1", "edge-a", 2),
    event("acme", "2024-03-10T08:00:00", "connect", "truck-1", "edge-a", 1),
]
OTHER = [
    event("other", "2024-03-12T11:00:00", "connect", "truck-9", "edge-c", 1),
    event("other", "2024-03-10T08:00:00", "connect", "truck-1", "edge-a", 6),
]


def seqs(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(row["node"], row["seq"]) for row in rows]


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lake")
    writer = DeltaBatchWriter(root / "logs", "edgebus.logs", LOGS_SCHEMA, LOGS_PARTITION_BY)
    rows = ACME + OTHER
    # Two commits, so partitions hold more than one file.
    writer.write(0, pa.Table.from_pylist(rows[::2], schema=LOGS_SCHEMA))
    writer.write(1, pa.Table.from_pylist(rows[1::2], schema=LOGS_SCHEMA))
    return root


def run_json(lake: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    code = logs_cli.main(["--lake", str(lake), "--format", "json", *args], now=NOW)
    out, _ = capsys.readouterr()
    assert code == 0
    return [json.loads(line) for line in out.splitlines()]


def test_newest_first_only_the_tenant(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert seqs(run_json(lake, "--tenant", "acme", capsys=capsys)) == seqs(ACME)
    assert seqs(run_json(lake, "--tenant", "other", capsys=capsys)) == seqs(OTHER)


def test_json_lines(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(lake, "--tenant", "acme", capsys=capsys)
    cursor = Cursor.decode(rows[2].pop("cursor"))
    assert cursor == Cursor(1_710_201_600_000_000, "edge-b", 2)  # (ts in µs, node, seq)
    assert rows[2] == {
        "ts": "2024-03-12T00:00:00.000000Z",
        "node": "edge-b",
        "seq": 2,
        "tenant": "acme",
        "origin": "mqtt",
        "event_type": "connect",
        "client_id": "truck-3",
        "details": {"seq": 2},
        "time": "2024-03-12T00:00:00.000+00:00",
        "payload_valid": True,
    }
    invalid = rows[0]
    assert invalid["payload_valid"] is False
    assert invalid["invalid_reason"] == "payload is not a JSON object"
    assert invalid["raw"] == "not json\n\\xff"
    assert invalid["details"] is None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(["--since", "2024-03-11"], ACME[:5], id="since-date"),
        pytest.param(["--since", "2024-03-11T23:59:59.999999Z"], ACME[:4], id="since-inclusive"),
        pytest.param(["--until", "2024-03-12"], ACME[3:], id="until-exclusive"),
        pytest.param(
            ["--since", "2024-03-11T00:00:00+01:00", "--until", "2024-03-11T12:00"],
            ACME[4:5],
            id="since-with-zone-and-until",
        ),
        pytest.param(["--since", "12h"], ACME[:3], id="since-12h"),
        pytest.param(["--since", "30m"], ACME[:1], id="since-30m"),
        pytest.param(["--since", "1d", "--until", "6h"], ACME[2:4], id="durations-both"),
        pytest.param(["--since", "7d"], ACME, id="since-7d"),
        pytest.param(["--event-type", "connect"], [ACME[0], ACME[2], ACME[6]], id="event-type"),
        pytest.param(["--client-id", "truck-2"], ACME[3:5], id="client-id"),
        pytest.param(["--client-id", ""], ACME[1:2], id="empty-client-id"),
        pytest.param(
            ["--event-type", "connect", "--client-id", "truck-1"], ACME[6:], id="both-filters"
        ),
        pytest.param(["--limit", "2"], ACME[:2], id="limit"),
        pytest.param(["--since", "2d", "--limit", "3"], ACME[:3], id="since-and-limit"),
        pytest.param(["--client-id", "it's"], [], id="quote-in-value"),
    ],
)
def test_filters(
    lake: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: list[Any]
) -> None:
    assert seqs(run_json(lake, "--tenant", "acme", *args, capsys=capsys)) == seqs(expected)


def test_a_full_page_says_there_may_be_more(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert logs_cli.main(["--lake", str(lake), "--tenant", "acme", "--limit", "3"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 + 3
    assert "the newest 3 shown" in err
    assert logs_cli.main(["--lake", str(lake), "--tenant", "acme", "--limit", "7"]) == 0
    assert "shown" in capsys.readouterr().err  # exactly a full page: cannot tell, says so
    assert logs_cli.main(["--lake", str(lake), "--tenant", "acme", "--limit", "8"]) == 0
    assert capsys.readouterr().err == ""


def test_table_format(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert logs_cli.main(["--lake", str(lake), "--tenant", "acme"], now=NOW) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(ACME)
    header = lines[0]
    assert header.split() == ["TIME", "EVENT_TYPE", "CLIENT_ID", "NODE", "DETAILS"]
    # Aligned: every column starts where its header does.
    starts = [header.index(name) for name in ("EVENT_TYPE", "CLIENT_ID", "NODE", "DETAILS")]
    for line in lines[1:]:
        for start in starts:
            assert line[start - 2 : start] == "  "
            assert line[start] != " "
    assert lines[3].split() == [
        "2024-03-12T00:00:00.000Z",
        "connect",
        "truck-3",
        "edge-b",
        '{"seq":2}',
    ]
    assert lines[2].split()[2] == "-"  # an empty client id (a tenant-wide quota event)
    invalid = lines[1][starts[-1] :]
    assert invalid == "INVALID (payload is not a JSON object): not json\\x0a\\xff"


def test_long_details_are_truncated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    long = event("acme", "2024-03-12T00:00:00", "subscribe", "t", "e", 1)
    long["details"] = json.dumps({"filters": ["fleet/#"] * 50})
    writer = DeltaBatchWriter(tmp_path / "logs", "t", LOGS_SCHEMA, LOGS_PARTITION_BY)
    writer.write(0, pa.Table.from_pylist([long], schema=LOGS_SCHEMA))
    assert logs_cli.main(["--lake", str(tmp_path), "--tenant", "acme"], now=NOW) == 0
    header, line = capsys.readouterr().out.splitlines()
    details = line[header.index("DETAILS") :]
    assert len(details) == logs_cli.DETAILS_WIDTH
    assert details.endswith("…")
    assert long["details"].startswith(details[:-1])


def test_no_match_and_unknown_tenant_exit_0(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert logs_cli.main(["--lake", str(lake), "--tenant", "acme", "--client-id", "x"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "no log events match" in err

    assert logs_cli.main(["--lake", str(lake), "--tenant", "nobody"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "no log events for tenant 'nobody'" in err


def test_missing_lake_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert logs_cli.main(["--lake", str(tmp_path / "nope"), "--tenant", "acme"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"no lake at {tmp_path / 'nope'}" in err


def test_a_lake_without_logs_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert logs_cli.main(["--lake", str(tmp_path), "--tenant", "acme"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "no logs table" in err


@pytest.mark.parametrize(
    "args",
    [
        ["--since", "yesterday"],
        ["--since", "15x"],
        ["--until", "-5m"],
        ["--limit", "0"],
        ["--limit", "ten"],
        ["--format", "csv"],
        [],  # no --tenant
    ],
)
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    tenant = ["--tenant", "acme"] if args else []
    with pytest.raises(SystemExit) as exc:
        logs_cli.main([*tenant, *args])
    assert exc.value.code == 2
    assert "edgebus logs: error:" in capsys.readouterr().err


def test_since_not_before_until_exits_2(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--lake", str(lake), "--tenant", "acme", "--since", "1h", "--until", "2h"]
    assert logs_cli.main(args, now=NOW) == 2
    assert "is not before --until" in capsys.readouterr().err


def test_time_arguments() -> None:
    assert time_arg("15m") == dt.timedelta(minutes=15)
    assert time_arg("2h") == dt.timedelta(hours=2)
    assert time_arg("7d") == dt.timedelta(days=7)
    assert time_arg("90s") == dt.timedelta(seconds=90)
    assert time_arg("2w") == dt.timedelta(weeks=2)
    assert time_arg("2024-03-10T08:00:00Z") == dt.datetime(2024, 3, 10, 8, tzinfo=UTC)
    assert time_arg("2024-03-10T10:00:00+02:00") == dt.datetime(2024, 3, 10, 8, tzinfo=UTC)
    assert time_arg("2024-03-10 08:00") == dt.datetime(2024, 3, 10, 8, tzinfo=UTC)  # UTC
    assert time_arg("2024-03-10") == dt.datetime(2024, 3, 10, tzinfo=UTC)


def test_hooks_into_a_parent_command(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="edgebus")
    logs_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["logs", "--lake", str(lake), "--tenant", "other", "--format", "json"])
    assert args.command == "logs"
    assert logs_cli.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["seq"] for line in lines] == [1, 6]


# --- partition pruning -----------------------------------------------------------------------


def scanned_files(lake: Path, query: LogQuery) -> set[str]:
    """The file names DataFusion's physical plan for ``query`` would read.

    EXPLAIN VERBOSE, because the plain EXPLAIN lists only the first five files of a group.
    """
    delta = DeltaTable(str(lake / "logs"))
    plan = pa.table(
        QueryBuilder()
        .register(logs_cli.QUERY_TABLE, delta)
        .execute(f"EXPLAIN VERBOSE {query.sql()}")
        .read_all()
    ).to_pylist()
    [text] = [row["plan"] for row in plan if row["plan_type"] == "physical_plan"]
    assert "file_groups=" in text, text
    assert "..." not in text, text
    return {Path(name).name for name in re.findall(r"[^\s\[\],{}]+\.parquet", text)}


def partition_files(lake: Path, predicate: str) -> set[str]:
    delta = DeltaTable(str(lake / "logs"))
    return {Path(uri).name for uri in delta.file_uris(file_pruning_predicate=predicate)}


@pytest.mark.parametrize(
    ("query", "predicate"),
    [
        pytest.param(LogQuery("acme"), "tenant = 'acme'", id="tenant"),
        pytest.param(
            LogQuery(
                "acme",
                since=dt.datetime(2024, 3, 11, 9, tzinfo=UTC),
                until=dt.datetime(2024, 3, 12, tzinfo=UTC),
            ),
            "tenant = 'acme' AND date = '2024-03-11'",
            id="one-day",
        ),
        pytest.param(
            LogQuery("other", since=dt.datetime(2024, 3, 11, tzinfo=UTC), event_types=("connect",)),
            "tenant = 'other' AND date >= '2024-03-11'",
            id="since",
        ),
        pytest.param(
            # --until is exclusive: an until at midnight needs nothing of that day.
            LogQuery("acme", until=dt.datetime(2024, 3, 12, tzinfo=UTC)),
            "tenant = 'acme' AND date <= '2024-03-11'",
            id="until-midnight",
        ),
    ],
)
def test_only_matching_partitions_are_scanned(lake: Path, query: LogQuery, predicate: str) -> None:
    # (A ts bound can prune more, by file statistics; these cases keep every matching file.)
    expected = partition_files(lake, predicate)
    assert expected  # the case reads something, and less than everything
    assert expected < partition_files(lake, "tenant IS NOT NULL")
    assert scanned_files(lake, query) == expected


# --- the delta-rs exit trap ------------------------------------------------------------------


def test_a_process_reading_the_table_exits_0_every_time(lake: Path) -> None:
    command = [sys.executable, "-m", "edgebus.logs_cli", "--lake", str(lake), "--tenant", "acme"]
    table, json_lines = outputs_of_repeated_runs(command)
    assert len(table.splitlines()) == 1 + len(ACME)
    assert len(json_lines.splitlines()) == len(ACME)


def test_the_edgebus_command_flushes_everything_before_it_ends(lake: Path, tmp_path: Path) -> None:
    """``edgebus logs`` ends with ``os._exit`` (edgebus.cli.console): its output is whole, into
    a pipe and into a file (block-buffered), every time."""
    command = [sys.executable, "-m", "edgebus.cli", "--log-level", "WARNING", "logs"]
    command += ["--lake", str(lake), "--tenant", "acme"]
    table, json_lines = outputs_of_repeated_runs(command, runs=6)
    assert len(table.splitlines()) == 1 + len(ACME)
    assert len({json.loads(line)["cursor"] for line in json_lines.splitlines()}) == len(ACME)
    out = tmp_path / "out.json"
    with out.open("w") as file:
        done = subprocess.run([*command, "--format", "json"], stdout=file, timeout=60, check=False)
    assert done.returncode == 0
    assert out.read_text() == json_lines
