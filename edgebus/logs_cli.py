"""``edgebus logs``: a tenant's log events from the Delta ``logs`` table.

Hooked into ``edgebus`` with :func:`add_parser` and :func:`run`; ``python -m edgebus.logs_cli``
runs it alone (:func:`main`). What users see is :data:`DESCRIPTION`.

The query (filters, order, cursor, SQL) is :mod:`edgebus.log_query`; following new events is
:mod:`edgebus.logs_follow`; what it shares with the other lake commands is
:mod:`edgebus.lake_command`. Heavy imports (pyarrow, deltalake) wait until a query runs, so
building the ``edgebus`` parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any, TextIO

from edgebus import lake_command, log_query
from edgebus.lake_command import (
    CommandError,
    has_tenant,
    iso,
    open_table,
    resolve_time,
    time_arg,
)
from edgebus.log_query import (
    COLUMNS,
    DEFAULT_LIMIT,
    MAX_LIMIT,
    QUERY_TABLE,
    Cursor,
    DetailMatch,
    LogQuery,
)
from sinks.storage import LakePath

if TYPE_CHECKING:
    from deltalake import DeltaTable

__all__ = ["QUERY_TABLE", "LogQuery", "add_parser", "main", "query_rows", "run", "time_arg"]

TABLE = "logs"
DETAILS_WIDTH = 80
# What --fields may name besides the columns: the row's cursor, and details.KEY.
CURSOR = "cursor"
DETAILS_PREFIX = "details."
DEFAULT_TABLE_HEADER = ("TIME", "EVENT_TYPE", "CLIENT_ID", "NODE", "DETAILS")
DESCRIPTION = """\
Show a tenant's log events (connect, disconnect, acl_denied, quota_blocked, ...) from the
lake's Delta table "logs", newest first.

Filters: the values of one option are alternatives (--event-type connect --event-type
disconnect: either), different options must all hold. --where KEY=VALUE compares a field of
the event's details as JSON: clean=false is the boolean false, reason_code=0 the number,
reason=timeout the string; a.b names a nested field.

Times are ISO 8601 (a time without a zone is UTC) or durations back from now: 90s, 15m, 2h,
7d, 2w. --since is inclusive, --until exclusive.

Paging: every JSON row has a "cursor"; --after CURSOR gives the rows after that row in the
same order (also when several events share a timestamp), so pages never lose or repeat a
row. A full page names the cursor to go on with.

--follow: the newest events (--limit), oldest first, then each new event as the pipeline
commits it, until Ctrl-C; it waits for a table that is not there yet. With --after, every
event after that row first.

Rows go to stdout, messages to stderr. Exit status: 0 (also when nothing matches, the tenant
is unknown or nothing was logged yet), 2 for bad arguments or a directory that is no lake, 1
when the table cannot be read.

examples:
  edgebus logs --lake lake --tenant acme --since 2h --event-type connect
  edgebus logs --tenant acme --event-type disconnect --where clean=false --format json
  edgebus logs --tenant acme --since 2024-03-10 --until 2024-03-11 --count
  edgebus logs --tenant acme --format json --after eyJ0cyI6... (a row's cursor)
  edgebus logs --tenant acme --follow --fields ts,event_type,client_id,details.reason
"""
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def fields_arg(text: str) -> tuple[str, ...]:
    """``--fields``: comma-separated columns, ``cursor`` or ``details.KEY``."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    bad = [
        name
        for name in names
        if name not in COLUMNS
        and name != CURSOR
        and not (name.startswith(DETAILS_PREFIX) and len(name) > len(DETAILS_PREFIX))
    ]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"unknown field {', '.join(bad) or text!r}: choose from {', '.join(COLUMNS)}, "
            f"{CURSOR}, details.KEY"
        )
    return names


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
    for option, metavar, what in (
        ("--event-type", "E", "of this event type, e.g. connect"),
        ("--client-id", "C", "about this client id"),
        ("--origin", "O", "from this origin: mqtt, quota"),
        ("--node", "N", "logged by this edge node"),
    ):
        parser.add_argument(
            option,
            action="append",
            default=[],
            metavar=metavar,
            help=f"only events {what} (repeatable: any of them)",
        )
    parser.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only events whose details field KEY is VALUE, e.g. clean=false (repeatable: all)",
    )
    parser.add_argument(
        "--fields",
        type=fields_arg,
        metavar="F,F,...",
        help="the fields to show: columns (ts, node, seq, event_type, client_id, origin, "
        "details, ...), cursor, or details.KEY",
    )
    parser.add_argument("--oldest-first", action="store_true", help="oldest events first")
    parser.add_argument(
        "--after", metavar="CURSOR", help="only the events after the row with this cursor"
    )
    parser.add_argument(
        "--limit",
        type=lake_command.positive_int,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"at most N rows (default {DEFAULT_LIMIT}, at most {MAX_LIMIT:,})",
    )
    parser.add_argument(
        "--count", action="store_true", help="how many events match, per event type, not the rows"
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="after the newest events, show new ones as they are committed, until Ctrl-C",
    )
    lake_command.add_format_argument(parser, json_help="one object per line, with a cursor")


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


def query_from_args(args: argparse.Namespace, now: datetime) -> LogQuery:
    """The query ``args`` ask for, or :class:`CommandError` (exit 2) naming what is wrong."""
    since = resolve_time("--since", args.since, now)
    until = resolve_time("--until", args.until, now)
    if since is not None and until is not None and since >= until:
        raise CommandError(f"--since {iso(since)} is not before --until {iso(until)}", exit_code=2)
    if args.limit > MAX_LIMIT:
        raise CommandError(
            f"--limit {args.limit} is more than {MAX_LIMIT:,}: page with --after CURSOR, or "
            "use edgebus sql",
            exit_code=2,
        )
    if args.follow and (args.count or until is not None):
        raise CommandError(
            "--follow shows new events as they come: not with "
            + ("--count" if args.count else "--until"),
            exit_code=2,
        )
    if args.event_type:
        log_query.check_event_types(args.event_type)
    return LogQuery(
        args.tenant,
        since,
        until,
        event_types=tuple(args.event_type),
        client_ids=tuple(args.client_id),
        origins=tuple(args.origin),
        nodes=tuple(args.node),
        where=tuple(DetailMatch.parse(text) for text in args.where),
        after=Cursor.decode(args.after) if args.after is not None else None,
        oldest_first=args.oldest_first or args.follow,
        limit=args.limit,
        columns=_columns(args.fields),
    )


def _columns(fields: tuple[str, ...] | None) -> tuple[str, ...]:
    """The table columns to read for ``fields`` (every column without ``--fields``)."""
    if fields is None:
        return COLUMNS
    wanted = {"details" if name.startswith(DETAILS_PREFIX) else name for name in fields}
    return tuple(name for name in COLUMNS if name in wanted)


def query_rows(lake: LakePath, query: LogQuery) -> list[dict[str, Any]]:
    """The rows of ``query`` in its order, or :class:`CommandError`."""
    delta = open_logs(lake)
    rows = log_query.fetch(delta, query)
    if not rows:
        _check_tenant(delta, query.tenant)
    return rows


def open_logs(lake: LakePath) -> DeltaTable:
    """The ``logs`` table, or exit 0 saying the pipeline has not created it yet."""
    delta = open_table(lake, TABLE)
    if delta is None:
        raise CommandError(
            f"no {TABLE} table in {lake} yet: the pipeline creates {lake / TABLE} with the "
            "first log event it processes",
            exit_code=0,
        )
    return delta


def _check_tenant(delta: DeltaTable, tenant: str) -> None:
    if not has_tenant(delta, tenant):
        raise CommandError(
            f"no log events for tenant {tenant!r} in {delta.table_uri} "
            "(an unknown tenant, or none logged yet)",
            exit_code=0,
        )


def run(args: argparse.Namespace, *, now: datetime | None = None) -> int:
    """Run ``edgebus logs`` with parsed ``args``; the exit code."""
    try:
        query = query_from_args(args, now if now is not None else datetime.now(UTC))
        if args.follow:
            from edgebus import logs_follow

            return logs_follow.follow(args.lake, query, Output(args.format, args.fields))
        if args.count:
            return _count(args.lake, query, args.format)
        rows = query_rows(args.lake, query)
    except CommandError as exc:
        return lake_command.fail("logs", exc)
    except KeyboardInterrupt:  # Ctrl-C during a long query: the shell's code, no traceback
        return 130
    if not rows:
        print("edgebus logs: no log events match", file=sys.stderr)
        return 0
    Output(args.format, args.fields).write(rows)
    if len(rows) == query.limit:
        which = "oldest" if query.oldest_first else "newest"
        print(
            f"edgebus logs: the {which} {query.limit} shown; more may match: "
            f"--after {Cursor.of(rows[-1]).encode()}",
            file=sys.stderr,
        )
    return 0


def _count(lake: LakePath, query: LogQuery, fmt: str) -> int:
    delta = open_logs(lake)
    totals = log_query.count(delta, query)
    if not totals:
        _check_tenant(delta, query.tenant)
    ordered = sorted(totals.items(), key=lambda item: (-item[1], item[0] or ""))
    if fmt == "json":
        lines = [json.dumps({"event_type": name, "count": n}) + "\n" for name, n in ordered]
        lake_command.write_out(lambda out: out.writelines(lines))
    else:
        table = [("EVENT_TYPE", "COUNT")]
        table += [(name or "-", str(n)) for name, n in ordered]
        table.append(("TOTAL", str(sum(totals.values()))))
        lake_command.write_out(partial(lake_command.write_columns, table))
    return 0


class Output:
    """Rows as ``--format`` and ``--fields`` ask; for --follow, one batch after another."""

    def __init__(self, fmt: str, fields: tuple[str, ...] | None) -> None:
        self.format = fmt
        self.fields = fields
        self.header_written = False

    def write(self, rows: Sequence[dict[str, Any]]) -> bool:
        """Write ``rows``; False when stdout was closed (``| head``)."""
        if self.format == "json":
            return lake_command.write_out(partial(self._json, rows))
        return lake_command.write_out(partial(self._table, rows))

    def _json(self, rows: Sequence[dict[str, Any]], out: TextIO) -> None:
        for row in rows:
            out.write(json.dumps(self._doc(row)) + "\n")

    def _doc(self, row: dict[str, Any]) -> dict[str, Any]:
        """One row as JSON: ``details`` as the object itself, and its cursor."""
        if self.fields is None:
            return log_query.event_doc(row)
        cursor = Cursor.of(row).encode()
        doc = {name: self._value(row, name, cursor) for name in self.fields}
        doc.setdefault(CURSOR, cursor)
        return doc

    @staticmethod
    def _value(row: dict[str, Any], name: str, cursor: str) -> Any:
        if name == CURSOR:
            return cursor
        if name.startswith(DETAILS_PREFIX):
            found: Any = log_query.details_of(row)
            for key in name[len(DETAILS_PREFIX) :].split("."):
                found = found.get(key) if isinstance(found, dict) else None
            return found
        value = row[name]
        if name == "ts":
            return iso(value)
        if name == "details" and value is not None:
            return json.loads(value)
        if name == "raw":
            return None if value is None else log_query.raw_text(value)
        return value

    def _table(self, rows: Sequence[dict[str, Any]], out: TextIO) -> None:
        """Aligned columns; for --follow the header only once."""
        fields = self.fields
        header = DEFAULT_TABLE_HEADER if fields is None else tuple(f.upper() for f in fields)
        lines = [header, *(self._cells(row, fields) for row in rows)]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
        for line in lines[1:] if self.header_written else lines:
            cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)]
            out.write("  ".join([*cells, line[-1]]).rstrip() + "\n")
        self.header_written = True

    def _cells(self, row: dict[str, Any], fields: Sequence[str] | None) -> tuple[str, ...]:
        if fields is None:
            return _default_cells(row)
        cursor = Cursor.of(row).encode() if CURSOR in fields else ""
        return tuple(_cell(self._value(row, name, cursor)) for name in fields)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    text = value if isinstance(value, str) else json.dumps(value)
    return _truncate(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text), DETAILS_WIDTH)


def _default_cells(row: dict[str, Any]) -> tuple[str, str, str, str, str]:
    if row["payload_valid"]:
        details = row["details"] or ""
    else:
        details = f"INVALID ({row['invalid_reason']}): {log_query.raw_text(row['raw'])}"
    return (
        iso(row["ts"], "milliseconds"),
        row["event_type"] or "-",
        row["client_id"] or "-",
        row["node"],
        _truncate(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", details), DETAILS_WIDTH),
    )


def _truncate(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def main(argv: Sequence[str] | None = None, *, now: datetime | None = None) -> int:
    """``python -m edgebus.logs_cli ...``: the same command without the ``edgebus`` front."""
    return lake_command.standalone("logs", DESCRIPTION, add_arguments, run, argv, now)


if __name__ == "__main__":
    sys.exit(main())
