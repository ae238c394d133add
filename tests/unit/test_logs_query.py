"""``edgebus logs``: filters, ``--where`` on details, ``--fields``, ``--count``, the cursor and
bad input, over real ``logs`` Delta tables written with the pipeline's own writer."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from lake_fixture import DeltaBatchWriter
from repeated_runs import outputs_of_repeated_runs

from edgebus import log_query, logs_cli
from edgebus.log_query import Cursor, DetailMatch, same_json
from schemas.tables import LOGS_PARTITION_BY, LOGS_SCHEMA

UTC = dt.UTC
NOW = dt.datetime(2024, 3, 12, 12, 0, tzinfo=UTC)
LOGS = [sys.executable, "-m", "edgebus.logs_cli"]
# Three instants, many events on each: across two days and two nodes.
INSTANTS = [
    dt.datetime(2024, 3, 11, 23, 59, 59, 999_999, tzinfo=UTC),
    dt.datetime(2024, 3, 12, 8, 0, tzinfo=UTC),
    dt.datetime(2024, 3, 12, 8, 0, 0, 1, tzinfo=UTC),
]
DETAILS: list[dict[str, Any]] = [
    {"peer": "10.0.0.1:5000", "clean": False, "reason_code": 0},
    {"peer": "10.0.0.2:5000", "clean": True, "reason_code": 0.0},
    {"peer": "10.0.0.3:5000", "clean": "false", "reason_code": False},
    {"filters": ["fleet/#"], "qos": {"max": 1}},
    {},
]
EVENTS = ["disconnect", "disconnect", "disconnect", "subscribe", "connect"]


def row(i: int, tenant: str = "acme") -> dict[str, Any]:
    ts = INSTANTS[i % 3]
    return {
        "node": ("edge-a", "edge-b")[i % 2],
        "seq": 1000 + i,
        "ts": ts,
        "date": ts.date(),
        "tenant": tenant,
        "origin": "quota" if i % 7 == 0 else "mqtt",
        "event_type": EVENTS[i % 5],
        "client_id": f"truck-{i % 4}",
        "details": json.dumps(DETAILS[i % 5]),
        "time": ts.isoformat(),
        "payload_valid": True,
        "invalid_reason": None,
        "raw": None,
    }


ROWS = [row(i) for i in range(60)]


def ordered(rows: list[dict[str, Any]], *, oldest_first: bool = False) -> list[tuple[str, int]]:
    keyed = sorted(rows, key=lambda r: (r["ts"], r["node"], r["seq"]), reverse=not oldest_first)
    return [(r["node"], r["seq"]) for r in keyed]


def write(path: Path, batch: int, rows: list[dict[str, Any]]) -> None:
    writer = DeltaBatchWriter(path / "logs", "edgebus.logs", LOGS_SCHEMA, LOGS_PARTITION_BY)
    writer.write(batch, pa.Table.from_pylist(rows, schema=LOGS_SCHEMA))


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lake")
    for batch in range(3):  # several files per partition
        write(root, batch, ROWS[batch::3] + [row(batch, tenant="other")])
    return root


def run_json(lake: Path, *args: str, capsys: Any) -> tuple[list[dict[str, Any]], str]:
    code = logs_cli.main(["--lake", str(lake), "--tenant", "acme", "--format", "json", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()], err


def keys(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(r["node"], r["seq"]) for r in rows]


@pytest.mark.parametrize("oldest_first", [False, True])
@pytest.mark.parametrize("page", [1, 7, 20])
def test_paging_by_cursor_loses_and_repeats_nothing(
    lake: Path, capsys: pytest.CaptureFixture[str], oldest_first: bool, page: int
) -> None:
    order = ["--oldest-first"] if oldest_first else []
    seen: list[dict[str, Any]] = []
    after: list[str] = []
    while True:
        rows, err = run_json(lake, "--limit", str(page), *order, *after, capsys=capsys)
        seen += rows
        if len(rows) < page:
            break
        # The full page names the next one; it is the last row's cursor.
        assert f"--after {rows[-1]['cursor']}" in err
        after = ["--after", rows[-1]["cursor"]]
    assert keys(seen) == ordered(ROWS, oldest_first=oldest_first)


def test_paging_with_filters_and_where(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--event-type", "disconnect", "--where", "reason_code=0", "--limit", "4"]
    seen: list[dict[str, Any]] = []
    after: list[str] = []
    while True:
        rows, _ = run_json(lake, *args, *after, capsys=capsys)
        seen += rows
        if len(rows) < 4:
            break
        after = ["--after", rows[-1]["cursor"]]
    wanted = [r for i, r in enumerate(ROWS) if i % 5 in (0, 1)]  # 0 and 0.0, not false
    assert keys(seen) == ordered(wanted)


def test_where_reads_candidate_pages_until_the_page_is_full(
    lake: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pages of 5, then 20 candidates (one in five matches): the loop, and growing pages.
    monkeypatch.setattr(log_query, "CANDIDATES_PER_ROW", 1)
    rows, _ = run_json(lake, "--where", "clean=false", "--limit", "5", capsys=capsys)
    wanted = [r for i, r in enumerate(ROWS) if i % 5 == 0]
    assert keys(rows) == ordered(wanted)[:5]


@pytest.mark.parametrize(
    ("args", "which"),
    [
        pytest.param(["--where", "clean=false"], lambda i: i % 5 == 0, id="boolean"),
        pytest.param(["--where", "clean=true"], lambda i: i % 5 == 1, id="true"),
        pytest.param(["--where", 'clean="false"'], lambda i: i % 5 == 2, id="json-string"),
        pytest.param(["--where", "reason_code=false"], lambda i: i % 5 == 2, id="not-zero"),
        pytest.param(["--where", "reason_code=0.0"], lambda i: i % 5 in (0, 1), id="number"),
        pytest.param(["--where", "peer=10.0.0.2:5000"], lambda i: i % 5 == 1, id="bare-string"),
        pytest.param(["--where", "qos.max=1"], lambda i: i % 5 == 3, id="nested"),
        pytest.param(["--where", 'filters=["fleet/#"]'], lambda i: i % 5 == 3, id="list"),
        pytest.param(
            ["--where", "clean=false", "--where", "reason_code=0"],
            lambda i: i % 5 == 0,
            id="and",
        ),
        pytest.param(["--where", "missing=1"], lambda i: False, id="no-such-key"),
        pytest.param(
            ["--event-type", "connect", "--event-type", "subscribe"],
            lambda i: i % 5 in (3, 4),
            id="event-types-or",
        ),
        pytest.param(["--origin", "quota"], lambda i: i % 7 == 0, id="origin"),
        pytest.param(["--node", "edge-b"], lambda i: i % 2 == 1, id="node"),
        pytest.param(
            ["--client-id", "truck-1", "--client-id", "truck-2"],
            lambda i: i % 4 in (1, 2),
            id="client-ids-or",
        ),
        pytest.param(
            ["--node", "edge-a", "--event-type", "disconnect"],
            lambda i: i % 2 == 0 and i % 5 < 3,
            id="and-across-options",
        ),
        pytest.param(
            ["--since", "2024-03-12T08:00:00.000001Z"], lambda i: i % 3 == 2, id="since-µs"
        ),
        pytest.param(["--until", "2024-03-12"], lambda i: i % 3 == 0, id="until"),
    ],
)
def test_filters(
    lake: Path, capsys: pytest.CaptureFixture[str], args: list[str], which: Any
) -> None:
    rows, _ = run_json(lake, *args, "--limit", "1000", capsys=capsys)
    assert keys(rows) == ordered([r for i, r in enumerate(ROWS) if which(i)])


def test_json_equality() -> None:
    assert same_json(False, False)
    assert not same_json(0, False)
    assert not same_json(False, 0)
    assert same_json(1, 1.0)
    assert not same_json("1", 1)
    assert same_json(None, None)
    assert DetailMatch.parse("a.b=x y") == DetailMatch(("a", "b"), "x y")
    assert DetailMatch.parse("n=") == DetailMatch(("n",), "")


def test_fields(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fields = "ts,event_type,details.clean,details.qos.max,cursor"
    rows, _ = run_json(lake, "--fields", fields, "--limit", "5", "--oldest-first", capsys=capsys)
    first = ROWS[0]
    assert rows[0] == {
        "ts": "2024-03-11T23:59:59.999999Z",
        "event_type": "disconnect",
        "details.clean": False,
        "details.qos.max": None,
        "cursor": Cursor.of(first).encode(),
    }
    rows, _ = run_json(lake, "--fields", "seq", "--limit", "1", capsys=capsys)
    assert set(rows[0]) == {"seq", "cursor"}  # a JSON row always has its cursor
    assert logs_cli.main(["--lake", str(lake), "--tenant", "acme", "--fields", "seq,node"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["SEQ", "NODE"]
    assert len(lines) == 1 + 60


def test_count(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, _ = run_json(lake, "--count", capsys=capsys)
    assert rows == [
        {"event_type": "disconnect", "count": 36},
        {"event_type": "connect", "count": 12},
        {"event_type": "subscribe", "count": 12},
    ]
    rows, _ = run_json(lake, "--count", "--where", "clean=false", "--node", "edge-a", capsys=capsys)
    assert rows == [{"event_type": "disconnect", "count": 6}]
    assert logs_cli.main(["--lake", str(lake), "--tenant", "acme", "--count"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "EVENT_TYPE  COUNT",
        "disconnect  36",
        "connect     12",
        "subscribe   12",
        "TOTAL       60",
    ]


def test_the_event_types_known_without_importing_pyarrow_are_the_edges() -> None:
    from schemas.payloads import LOG_EVENTS

    assert log_query.LOG_EVENTS is LOG_EVENTS


def test_cursor_encoding() -> None:
    cursor = Cursor.of(ROWS[2])
    assert Cursor.decode(cursor.encode()) == cursor
    assert cursor.ts() == ROWS[2]["ts"]
    assert "=" not in cursor.encode()  # URL-safe, no padding


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LOGS, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "99999999d"], "--since is out of range"),
        (["--since", "9" * 30 + "w"], "--since is out of range"),
        (["--until", "99999999d"], "--until is out of range"),
        (["--since", "2999-01-01"], "--since is out of range"),
        (["--limit", str(2**64)], f"--limit {2**64} is more than 1,000,000"),
        (["--event-type", "conect"], "unknown event type 'conect': the edges log acl_denied"),
        (["--after", "not-a-cursor"], "--after 'not-a-cursor' is not a cursor"),
        (["--after", Cursor(2**62, "x", 1).encode()], "is not a cursor"),
        (["--where", "clean"], "--where 'clean': expected KEY=VALUE"),
        (["--follow", "--count"], "--follow shows new events as they come: not with --count"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(lake: Path, args: list[str], message: str) -> None:
    done = run_cli("--lake", str(lake), "--tenant", "acme", *args)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith("edgebus logs: "), done.stderr
    assert message in done.stderr
    assert done.stderr.count("\n") == 1
    if "unknown event type" in message:
        assert "quota_blocked" in done.stderr


def test_unparseable_arguments_are_argparse_errors_without_a_traceback() -> None:
    for args in (["--since", "15x"], ["--limit", "x"], ["--fields", "nope"]):
        done = run_cli("--tenant", "acme", *args)
        assert done.returncode == 2
        assert "edgebus logs: error: argument" in done.stderr
        assert "Traceback" not in done.stderr


def test_a_directory_that_is_no_lake(lake: Path, tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("hello")
    for where, message in [
        (tmp_path, f"{tmp_path} is not a lake"),
        (lake / "logs", "is a Delta table, not a lake"),
        (tmp_path / "missing", "no lake at"),
    ]:
        done = run_cli("--lake", str(where), "--tenant", "acme")
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert message in done.stderr
        assert done.stderr.count("\n") == 1


def test_help_has_no_raw_markup() -> None:
    for command in ([*LOGS, "--help"], [sys.executable, "-m", "edgebus.cli", "--help"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
        assert "``" not in done.stdout
        assert ":func:" not in done.stdout
        assert "**" not in done.stdout


def test_processes_paging_counting_and_filtering_exit_0_every_time(lake: Path) -> None:
    after = Cursor.of(sorted(ROWS, key=lambda r: (r["ts"], r["node"], r["seq"]))[40])
    base = [*LOGS, "--lake", str(lake), "--tenant", "acme"]
    table, json_lines = outputs_of_repeated_runs(
        [
            *base,
            "--where",
            "clean=false",
            "--after",
            after.encode(),
            "--fields",
            "seq,details.clean",
        ],
        runs=10,
    )
    # Newest first: after the cursor is below it in (ts, node, seq).
    wanted = [r for i, r in enumerate(ROWS) if i % 5 == 0 and Cursor.of(r) < after]
    assert len(table.splitlines()) == 1 + len(wanted)
    assert len(json_lines.splitlines()) == len(wanted)
    table, json_lines = outputs_of_repeated_runs([*base, "--count", "--node", "edge-b"], runs=6)
    assert table.splitlines()[-1].split() == ["TOTAL", "30"]
