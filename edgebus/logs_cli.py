"""``edgebus logs``: a tenant's log events from the Delta ``logs`` table, newest first.

Hooked into ``edgebus`` with :func:`add_parser` and :func:`run`; ``python -m edgebus.logs_cli``
runs it alone (:func:`main`). What users see is :data:`DESCRIPTION`.

One DataFusion query through delta-rs (``deltalake.QueryBuilder``, never
``DeltaTable.to_pyarrow_*``, which can abort the interpreter at exit). Its condition names the
partition columns, ``tenant = ...`` and ``date`` bounds derived from ``--since``/``--until``, so
delta-rs opens only the files of the matching partitions (``ts`` bounds then prune more by file
statistics); ``ORDER BY ... LIMIT`` lets DataFusion keep just the newest rows (a top-k) instead
of sorting them all. Heavy imports (pyarrow, deltalake) wait until a query runs, so building
the ``edgebus`` parser stays cheap. What it shares with ``edgebus usage`` is in
:mod:`edgebus.lake_command`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from edgebus import lake_command
from edgebus.lake_command import (
    CommandError,
    has_tenant,
    iso,
    open_table,
    sql_date,
    sql_string,
    sql_timestamp,
)

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    lake_command.add_lake_arguments(parser, tenant_help="whose events to show")
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
        type=lake_command.positive_int,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"at most N rows (default {DEFAULT_LIMIT})",
    )
    lake_command.add_format_argument(parser, json_help="one object per line")


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``logs`` command to ``edgebus``'s subcommands; dispatch it to :func:`run`."""
    return lake_command.add_command(
        subparsers,
        "logs",
        summary="show a tenant's log events from the lake, newest first",
        description=DESCRIPTION,
        add_arguments=add_arguments,
    )


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
            raise CommandError(
                f"--since {iso(since)} is not before --until {iso(until)}", exit_code=2
            )
        return cls(args.tenant, since, until, args.event_type, args.client_id, args.limit)

    def sql(self) -> str:
        """The DataFusion query over the table registered as :data:`QUERY_TABLE`."""
        where = [f"tenant = {sql_string(self.tenant)}"]
        # The partition column bounds: they are what lets delta-rs skip other days' files.
        first_day = self.since.date() if self.since else None
        # --until is exclusive: an until at midnight does not need that day's partition.
        last_day = (self.until - timedelta(microseconds=1)).date() if self.until else None
        if first_day and last_day:
            where.append(f"date BETWEEN {sql_date(first_day)} AND {sql_date(last_day)}")
        elif first_day:
            where.append(f"date >= {sql_date(first_day)}")
        elif last_day:
            where.append(f"date <= {sql_date(last_day)}")
        if self.since:
            where.append(f"ts >= {sql_timestamp(self.since)}")
        if self.until:
            where.append(f"ts < {sql_timestamp(self.until)}")
        if self.event_type is not None:
            where.append(f"event_type = {sql_string(self.event_type)}")
        if self.client_id is not None:
            where.append(f"client_id = {sql_string(self.client_id)}")
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


def query_rows(lake: Path, query: LogQuery) -> list[dict[str, Any]]:
    """The rows of ``query``, newest first, or :class:`CommandError`."""
    delta = open_table(lake, TABLE)
    if delta is None:
        raise CommandError(
            f"no {TABLE} table in {lake} yet: the pipeline creates {lake / TABLE} with the "
            "first log event it processes",
            exit_code=0,
        )
    rows = lake_command.query(delta, QUERY_TABLE, query.sql())
    if not rows and not has_tenant(delta, query.tenant):
        raise CommandError(
            f"no log events for tenant {query.tenant!r} in {lake / TABLE} "
            "(an unknown tenant, or none logged yet)",
            exit_code=0,
        )
    return rows


def run(args: argparse.Namespace, *, now: datetime | None = None) -> int:
    """Run ``edgebus logs`` with parsed ``args``; the exit code."""
    try:
        query = LogQuery.from_args(args, now if now is not None else datetime.now(UTC))
        rows = query_rows(args.lake, query)
    except CommandError as exc:
        return lake_command.fail("logs", exc)
    if not rows:
        print("edgebus logs: no log events match", file=sys.stderr)
        return 0
    lake_command.write_out(partial(write_json if args.format == "json" else write_table, rows))
    if len(rows) == query.limit:
        print(
            f"edgebus logs: the newest {query.limit} shown; older ones may match "
            "(--limit, --until)",
            file=sys.stderr,
        )
    return 0


def write_json(rows: Sequence[dict[str, Any]], out: TextIO) -> None:
    """One JSON object per row and line; ``details`` as the object itself."""
    for row in rows:
        doc = {name: row[name] for name in COLUMNS if name not in ("raw", "invalid_reason")}
        doc["ts"] = iso(row["ts"])
        if row["details"] is not None:
            doc["details"] = json.loads(row["details"])
        if not row["payload_valid"]:
            doc["invalid_reason"] = row["invalid_reason"]
            doc["raw"] = _raw_text(row["raw"])
        out.write(json.dumps(doc) + "\n")


def write_table(rows: Sequence[dict[str, Any]], out: TextIO) -> None:
    """Aligned columns: time, event type, client id, node, details (truncated)."""
    header = ("TIME", "EVENT_TYPE", "CLIENT_ID", "NODE", "DETAILS")
    lake_command.write_columns([header, *(_table_cells(row) for row in rows)], out)


def _table_cells(row: dict[str, Any]) -> tuple[str, str, str, str, str]:
    if row["payload_valid"]:
        details = row["details"] or ""
    else:
        details = f"INVALID ({row['invalid_reason']}): {_raw_text(row['raw'])}"
    return (
        iso(row["ts"], "milliseconds"),
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
    return lake_command.standalone("logs", DESCRIPTION, add_arguments, run, argv, now)


if __name__ == "__main__":
    sys.exit(main())
