"""``edgebus logs``: a tenant's log events from the Delta ``logs`` table, newest first.

Hooked into ``edgebus`` with :func:`add_parser` and :func:`run`; ``python -m edgebus.logs_cli``
runs it alone (:func:`main`). What users see is :data:`DESCRIPTION`.

One DataFusion query through delta-rs (``deltalake.QueryBuilder``, never
``DeltaTable.to_pyarrow_*``, which can abort the interpreter at exit). Its condition names the
partition columns, ``tenant = ...`` and ``date`` bounds derived from ``--since``/``--until``, so
delta-rs opens only the files of the matching partitions (``ts`` bounds then prune more by file
statistics); ``ORDER BY ... LIMIT`` lets DataFusion keep just the newest rows (a top-k) instead
of sorting them all. Heavy imports (pyarrow, deltalake) wait until a query runs, so building
the ``edgebus`` parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

TABLE = "logs"
# The name the table is registered under in the query (see LogQuery.sql).
QUERY_TABLE = "logs"
DEFAULT_LIMIT = 100
DETAILS_WIDTH = 80
DESCRIPTION = """\
Show a tenant's log events (connect, disconnect, acl_denied, quota_blocked, ...) from the
lake's Delta table "logs", newest first.

Times are ISO 8601 (a time without a zone is UTC) or durations back from now: 90s, 15m, 2h,
7d, 2w. --since is inclusive, --until exclusive. Rows go to stdout, messages to stderr. Exit
status: 0 (also when nothing matches, the tenant is unknown or nothing was logged yet), 2 for
bad arguments or a missing lake, 1 when the table cannot be read.

examples:
  edgebus logs --lake lake --tenant acme --since 2h --event-type connect
  edgebus logs --tenant acme --since 2024-03-10 --until 2024-03-11T06:00Z --format json
"""
FORMATS = ("table", "json")

# The columns read, in the order of the JSON output.
COLUMNS = (
    "ts",
    "node",
    "seq",
    "tenant",
    "origin",
    "event_type",
    "client_id",
    "details",
    "time",
    "payload_valid",
    "invalid_reason",
    "raw",
)

_DURATION = re.compile(r"(\d+)([smhdw])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# A point in time as given: absolute, or a duration back from the moment the command runs.
TimeArg = datetime | timedelta


class LogsCommandError(Exception):
    """The command cannot run as asked; the message says why, ``exit_code`` what to return."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def time_arg(text: str) -> TimeArg:
    """``--since``/``--until``: an ISO 8601 time (UTC unless it names a zone) or a duration."""
    duration = _DURATION.fullmatch(text.strip())
    if duration:
        amount, unit = duration.groups()
        return timedelta(**{_UNITS[unit]: int(amount)})
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO 8601 time (2024-03-10T08:00:00Z) or a duration "
            f"(15m, 2h, 7d), got {text!r}"
        ) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lake",
        type=Path,
        default=Path("lake"),
        metavar="DIR",
        help="directory of the Delta tables (default ./lake)",
    )
    parser.add_argument("--tenant", required=True, metavar="T", help="whose events to show")
    parser.add_argument(
        "--since",
        type=time_arg,
        metavar="TIME|DURATION",
        help="from this time on (inclusive), or this long ago: 15m, 2h, 7d",
    )
    parser.add_argument(
        "--until",
        type=time_arg,
        metavar="TIME|DURATION",
        help="up to this time (exclusive), or this long ago",
    )
    parser.add_argument("--event-type", metavar="E", help="only this event type, e.g. connect")
    parser.add_argument("--client-id", metavar="C", help="only events about this client id")
    parser.add_argument(
        "--limit",
        type=_positive,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"at most N rows (default {DEFAULT_LIMIT})",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="table (aligned columns, the default) or json (one object per line)",
    )


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``logs`` command to ``edgebus``'s subcommands; dispatch it to :func:`run`."""
    parser = subparsers.add_parser(
        "logs",
        help="show a tenant's log events from the lake, newest first",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


@dataclass(frozen=True, slots=True)
class LogQuery:
    """The filters of one ``edgebus logs`` call, with absolute UTC times."""

    tenant: str
    since: datetime | None = None
    until: datetime | None = None
    event_type: str | None = None
    client_id: str | None = None
    limit: int = DEFAULT_LIMIT

    @classmethod
    def from_args(cls, args: argparse.Namespace, now: datetime) -> LogQuery:
        since, until = _resolve(args.since, now), _resolve(args.until, now)
        if since is not None and until is not None and since >= until:
            raise LogsCommandError(
                f"--since {_iso(since)} is not before --until {_iso(until)}", exit_code=2
            )
        return cls(args.tenant, since, until, args.event_type, args.client_id, args.limit)

    def sql(self) -> str:
        """The DataFusion query over the table registered as :data:`QUERY_TABLE`."""
        where = [f"tenant = {_string(self.tenant)}"]
        # The partition column bounds: they are what lets delta-rs skip other days' files.
        first_day = self.since.date() if self.since else None
        # --until is exclusive: an until at midnight does not need that day's partition.
        last_day = (self.until - timedelta(microseconds=1)).date() if self.until else None
        if first_day and last_day:
            where.append(f"date BETWEEN {_date(first_day)} AND {_date(last_day)}")
        elif first_day:
            where.append(f"date >= {_date(first_day)}")
        elif last_day:
            where.append(f"date <= {_date(last_day)}")
        if self.since:
            where.append(f"ts >= {_timestamp(self.since)}")
        if self.until:
            where.append(f"ts < {_timestamp(self.until)}")
        if self.event_type is not None:
            where.append(f"event_type = {_string(self.event_type)}")
        if self.client_id is not None:
            where.append(f"client_id = {_string(self.client_id)}")
        columns = ", ".join(f'"{name}"' for name in COLUMNS)
        # Every value above is a quoted literal or a formatted date/time: no injection.
        return (
            f"SELECT {columns} FROM {QUERY_TABLE} WHERE {' AND '.join(where)} "  # noqa: S608
            f"ORDER BY ts DESC, node DESC, seq DESC LIMIT {self.limit}"
        )


def _resolve(value: TimeArg | None, now: datetime) -> datetime | None:
    if isinstance(value, timedelta):
        return now - value
    return value


def _string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _date(day: date) -> str:
    return f"DATE '{day.isoformat()}'"


def _timestamp(when: datetime) -> str:
    return f"TIMESTAMP '{when.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%S.%fZ')}'"


def _iso(when: datetime, timespec: str = "microseconds") -> str:
    return when.astimezone(UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


def query_rows(lake: Path, query: LogQuery) -> list[dict[str, Any]]:
    """The rows of ``query``, newest first, or :class:`LogsCommandError`."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder
    from deltalake.exceptions import DeltaError

    if not lake.is_dir():
        raise LogsCommandError(f"no lake at {lake}: give --lake DIR (the pipeline's)", exit_code=2)
    path = lake / TABLE
    try:
        if not DeltaTable.is_deltatable(str(path)):
            raise LogsCommandError(
                f"no {TABLE} table in {lake} yet: the pipeline creates {path} with the first "
                "log event it processes",
                exit_code=0,
            )
        delta = DeltaTable(str(path))
        result = QueryBuilder().register(QUERY_TABLE, delta).execute(query.sql()).read_all()
        rows: list[dict[str, Any]] = pa.table(result).to_pylist()
        if not rows and not delta.partitions(
            file_pruning_predicate=[("tenant", "=", query.tenant)]
        ):
            raise LogsCommandError(
                f"no log events for tenant {query.tenant!r} in {path} "
                "(an unknown tenant, or none logged yet)",
                exit_code=0,
            )
    except (DeltaError, OSError) as exc:
        raise LogsCommandError(f"cannot read {path}: {exc}", exit_code=1) from exc
    return rows


def run(args: argparse.Namespace, *, now: datetime | None = None) -> int:
    """Run ``edgebus logs`` with parsed ``args``; the exit code."""
    try:
        query = LogQuery.from_args(args, now if now is not None else datetime.now(UTC))
        rows = query_rows(args.lake, query)
    except LogsCommandError as exc:
        print(f"edgebus logs: {exc}", file=sys.stderr)
        return exc.exit_code
    if not rows:
        print("edgebus logs: no log events match", file=sys.stderr)
        return 0
    try:
        if args.format == "json":
            write_json(rows, sys.stdout)
        else:
            write_table(rows, sys.stdout)
        sys.stdout.flush()
        if len(rows) == query.limit:
            print(
                f"edgebus logs: the newest {query.limit} shown; older ones may match "
                "(--limit, --until)",
                file=sys.stderr,
            )
    except BrokenPipeError:
        # The reader went away (| head): not an error. Keep the exit-time flush quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def write_json(rows: Sequence[dict[str, Any]], out: TextIO) -> None:
    """One JSON object per row and line; ``details`` as the object itself."""
    for row in rows:
        doc = {name: row[name] for name in COLUMNS if name not in ("raw", "invalid_reason")}
        doc["ts"] = _iso(row["ts"])
        if row["details"] is not None:
            doc["details"] = json.loads(row["details"])
        if not row["payload_valid"]:
            doc["invalid_reason"] = row["invalid_reason"]
            doc["raw"] = _raw_text(row["raw"])
        out.write(json.dumps(doc) + "\n")


def write_table(rows: Sequence[dict[str, Any]], out: TextIO) -> None:
    """Aligned columns: time, event type, client id, node, details (truncated)."""
    header = ("TIME", "EVENT_TYPE", "CLIENT_ID", "NODE", "DETAILS")
    lines = [header, *(_table_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    for line in lines:
        cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)]
        out.write("  ".join([*cells, line[-1]]).rstrip() + "\n")


def _table_cells(row: dict[str, Any]) -> tuple[str, str, str, str, str]:
    if row["payload_valid"]:
        details = row["details"] or ""
    else:
        details = f"INVALID ({row['invalid_reason']}): {_raw_text(row['raw'])}"
    return (
        _iso(row["ts"], "milliseconds"),
        row["event_type"] or "-",
        row["client_id"] or "-",
        row["node"],
        _truncate(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", details), DETAILS_WIDTH),
    )


def _raw_text(raw: bytes | None) -> str:
    return "" if raw is None else raw.decode("utf-8", "backslashreplace")


def _truncate(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def main(argv: Sequence[str] | None = None, *, now: datetime | None = None) -> int:
    """``python -m edgebus.logs_cli ...``: the same command without the ``edgebus`` front."""
    parser = argparse.ArgumentParser(
        prog="edgebus logs",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv), now=now)


if __name__ == "__main__":
    sys.exit(main())
