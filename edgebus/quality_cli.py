"""``edgebus quality``: what the latest great-expectations runs found, from ``quality_results``.

Hooked into ``edgebus`` with :func:`add_parser` and :func:`run`; ``python -m edgebus.quality_cli``
runs it alone (:func:`main`). What users see is :data:`DESCRIPTION`.

The pipeline's quality schedule (``streaming.quality``) commits each run as one Delta commit
whose app transaction is the run's number, so the latest run's number comes from the table's log
without reading any data; the rows of the runs asked for are then one DataFusion query on
``run >= first``, which Delta's per-file statistics turn into reading only those runs' files.
Reads go through :mod:`edgebus.lake_command` (delta-rs ``QueryBuilder``, never
``DeltaTable.to_pyarrow_*``); great-expectations is never imported here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from itertools import groupby
from typing import Any, TextIO

from edgebus import lake_command
from edgebus.lake_command import CommandError, iso, open_table, sql_string
from sinks.storage import LakePath

# Mirrors schemas.quality (kept literal so building the parser imports no pyarrow); a unit
# test holds them equal.
TABLE = "quality_results"
APP_ID = "edgebus.quality"
QUERY_TABLE = "quality_results"
OBSERVED_WIDTH = 100
DESCRIPTION = """\
Show what the latest data quality runs found: the pipeline validates each table's recent rows
(today's and yesterday's) against its great-expectations suite every quality_interval_seconds
and keeps the results in the lake's Delta table "quality_results".

Per run and table: ok, or FAILED with each failed expectation, how many rows broke it, which
rows (by the table's key: (node, seq) for messages and logs; the first 20) and what was
observed (the unexpected values among the first 20 such rows, with their counts).
--format json gives every result, one object per line (passing ones too, unless --failed).

Rows go to stdout, messages to stderr. Exit status, like a great-expectations checkpoint: 0 when
the latest run of every table shown met all its expectations (also when no run has happened
yet), 1 when the latest run of a table shown failed (or the results cannot be read), 2 for bad
arguments or a missing lake.

examples:
  edgebus quality --lake lake
  edgebus quality --lake lake --table messages --runs 5 --failed --format json
"""
COLUMNS = (
    "run",
    "run_at",
    "table",
    "suite",
    "expectation",
    "columns",
    "kwargs",
    "success",
    "observed",
    "unexpected_count",
    "element_count",
    "error",
    "unexpected_rows",
)
# How much of the breaking rows' keys a line of the table shows (all of them: --format json).
ROWS_WIDTH = 60
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    lake_command.add_lake_arguments(parser, tenant_help=None)
    parser.add_argument("--table", metavar="T", help="only this table's results, e.g. messages")
    parser.add_argument(
        "--runs",
        type=lake_command.positive_int,
        default=1,
        metavar="N",
        help="the latest N runs (default 1), newest first",
    )
    parser.add_argument("--failed", action="store_true", help="only failed expectations")
    lake_command.add_format_argument(parser, json_help="one object per result and line")


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``quality`` command to ``edgebus``'s subcommands; dispatch it to :func:`run`."""
    return lake_command.add_command(
        subparsers,
        "quality",
        summary="show the latest data quality (great-expectations) results",
        description=DESCRIPTION,
        add_arguments=add_arguments,
    )


@dataclass(frozen=True, slots=True)
class QualityQuery:
    """The runs ``first..last`` (by number), optionally one table's, optionally failures only."""

    first: int
    last: int
    table: str | None = None
    failed: bool = False

    def runs_text(self) -> str:
        return f"run {self.last}" if self.first == self.last else f"runs {self.first}..{self.last}"

    def sql(self, have: Collection[str] = COLUMNS) -> str:
        """The DataFusion query over the table registered as :data:`QUERY_TABLE`, whose columns
        are ``have`` (a column added since a table was made is null in it). Every result of the
        runs, the passing ones too: :meth:`shown` keeps the failed ones for ``--failed``, after
        :func:`failing_tables` has looked at all."""
        where = [f"run BETWEEN {self.first} AND {self.last}"]
        if self.table is not None:
            where.append(f'"table" = {sql_string(self.table)}')
        columns = ", ".join(
            f'"{name}"' if name in have else f'NULL AS "{name}"' for name in COLUMNS
        )
        # Every value above is an int or a quoted literal: no injection.
        return (
            f"SELECT {columns} FROM {QUERY_TABLE} WHERE {' AND '.join(where)} "  # noqa: S608
            'ORDER BY run DESC, "table", success, expectation, "columns"'
        )

    def shown(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows the command shows: the failed ones only with ``--failed``."""
        return [row for row in rows if not (self.failed and row["success"])]


def failing_tables(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The tables among ``rows`` (every result of the runs asked for) whose latest run there
    failed: what makes the command exit 1."""
    latest: dict[str, int] = {}
    for row in rows:
        latest[row["table"]] = max(row["run"], latest.get(row["table"], row["run"]))
    return sorted({r["table"] for r in rows if r["run"] == latest[r["table"]] and not r["success"]})


def query_rows(
    lake: LakePath, runs: int, table: str | None, failed: bool
) -> tuple[QualityQuery, list[dict[str, Any]]]:
    """The query for the latest ``runs`` runs and all their rows (the passing ones too), newest
    first, or :class:`CommandError`."""
    delta = open_table(lake, TABLE)
    last = None if delta is None else delta.transaction_version(APP_ID)
    if delta is None or last is None:
        raise CommandError(
            f"no quality runs in {lake} yet: the pipeline runs every table's suite every "
            "quality_interval_seconds (pipeline settings; 0 turns it off) and keeps the "
            f"results in {lake / TABLE}",
            exit_code=0,
        )
    query = QualityQuery(max(0, last - runs + 1), last, table, failed)
    have = {field.name for field in delta.schema().fields}
    rows = lake_command.query(delta, QUERY_TABLE, query.sql(have))
    if not rows and table is not None:
        raise CommandError(
            f"no results for table {table!r} in {query.runs_text()} "
            "(not a table with a suite, or not in the lake yet)",
            exit_code=0,
        )
    return query, rows


def run(args: argparse.Namespace, *, now: datetime | None = None) -> int:
    """Run ``edgebus quality`` with parsed ``args``; the exit code. (``now`` is unused: the
    runs are numbered, not timed; it is there for :func:`lake_command.standalone`.)"""
    try:
        query, rows = query_rows(args.lake, args.runs, args.table, args.failed)
    except CommandError as exc:
        return lake_command.fail("quality", exc)
    status = 1 if failing_tables(rows) else 0
    shown = query.shown(rows)
    if not shown:
        of = f" of {query.table}" if query.table else ""
        print(
            f"edgebus quality: no failed expectations{of} in {query.runs_text()}",
            file=sys.stderr,
        )
        return status
    lake_command.write_out(partial(write_json if args.format == "json" else write_table, shown))
    return status


def write_json(rows: Sequence[dict[str, Any]], out: TextIO) -> None:
    """One JSON object per result; ``columns`` a list, ``kwargs``, ``observed`` and
    ``unexpected_rows`` (a list of the rows' keys, as objects) as JSON."""
    for row in rows:
        doc = dict(row)
        doc["run_at"] = iso(row["run_at"])
        doc["columns"] = row["columns"].split(", ") if row["columns"] else []
        for key in ("kwargs", "observed", "unexpected_rows"):
            doc[key] = json.loads(row[key]) if row[key] is not None else None
        out.write(json.dumps(doc) + "\n")


def write_table(rows: Sequence[dict[str, Any]], out: TextIO) -> None:
    """Per run a header line, per table one line (ok / FAILED), then its failed expectations."""
    for (number, run_at), run_rows in groupby(rows, key=lambda r: (r["run"], r["run_at"])):
        tables = [list(group) for _, group in groupby(run_rows, key=lambda r: r["table"])]
        failed_tables = sum(1 for results in tables if not all(r["success"] for r in results))
        out.write(
            f"run {number}  {iso(run_at, 'seconds')}  "
            f"{failed_tables} of {len(tables)} tables failed\n"
        )
        width = max(len(results[0]["table"]) for results in tables)
        for results in tables:
            out.write(_table_line(results, width))
            failures = [_failure_cells(r) for r in results if not r["success"]]
            if failures:
                header = ["EXPECTATION", "COLUMNS", "UNEXPECTED", "ROWS", "DETAIL"]
                # Indented under the table: the first column carries the indent.
                lines = [["    " + cells[0], *cells[1:]] for cells in [header, *failures]]
                lake_command.write_columns(lines, out)


def _table_line(results: Sequence[dict[str, Any]], width: int) -> str:
    failed = [r for r in results if not r["success"]]
    rows = max((r["element_count"] or 0 for r in results), default=0)
    if failed:
        status, summary = "FAILED", f"{len(failed)} of {len(results)} expectations failed"
    else:
        status, summary = "ok", f"{len(results)} expectations met"
    return f"  {results[0]['table'].ljust(width)}  {status:<6}  {summary}, {rows} rows\n"


def _failure_cells(row: dict[str, Any]) -> list[str]:
    if row["error"] is not None:
        detail = f"error: {row['error']}"
    else:
        detail = f"observed {row['observed'] or '-'}"
        if row["kwargs"]:
            detail += f"  expected {row['kwargs']}"
    unexpected = (
        f"{row['unexpected_count']} of {row['element_count']}"
        if row["unexpected_count"] is not None
        else "-"
    )
    return [
        row["expectation"],
        row["columns"] or "-",
        unexpected,
        _truncate(_printable(_rows_text(row)), ROWS_WIDTH),
        _truncate(_printable(detail), OBSERVED_WIDTH),
    ]


def _rows_text(row: dict[str, Any]) -> str:
    """The breaking rows' keys: ``node, seq: (edge-a, 2), (edge-b, 7)``; ``-`` for none."""
    keys: list[dict[str, Any]] = json.loads(row["unexpected_rows"] or "[]")
    if not keys:
        return "-"
    names = ", ".join(keys[0])
    return f"{names}: " + ", ".join(
        "(" + ", ".join(str(value) for value in key.values()) + ")" for key in keys
    )


def _printable(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _truncate(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def main(argv: Sequence[str] | None = None, *, now: datetime | None = None) -> int:
    """``python -m edgebus.quality_cli ...``: the same command without the ``edgebus`` front."""
    return lake_command.standalone("quality", DESCRIPTION, add_arguments, run, argv, now)


if __name__ == "__main__":
    sys.exit(main())
