"""``edgebus usage``: a tenant's counters for one UTC day and its quota state, from the lake.

Hooked into ``edgebus`` with :func:`add_parser` and :func:`run`; ``python -m edgebus.usage_cli``
runs it alone (:func:`main`). What users see is :data:`DESCRIPTION`.

Two reads through delta-rs (see :mod:`edgebus.lake_command`), each naming the partition
columns so only the tenant's files are opened:

- ``usage`` (``tenant = T AND date = D``): per metric the day's last one-minute window, whose
  ``day_value`` is the running day total (a gauge's: the day's peak) through that minute.
- ``quota_events`` (``tenant = T AND date <= D``): per quota metric the latest recorded state
  (:func:`streaming.quota.load_recorded`). A state holds until the next change, which may be
  days old, so earlier days count; the day's usage of the counter that measures it is shown
  beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from functools import partial
from typing import Any, TextIO

from edgebus import lake_command
from edgebus.lake_command import CommandError, iso, open_table, sql_date, sql_string
from sinks.storage import LakePath

TABLE = "usage"
QUOTA_TABLE = "quota_events"
# The name the usage table is registered under in UsageQuery.usage_sql.
QUERY_TABLE = "usage"
DESCRIPTION = """\
Show a tenant's usage counters for one UTC day (today unless --date) from the lake's Delta
table "usage", and its quota state from "quota_events".

Counters (messages_in, bytes_in, sessions, ...): DAY_TOTAL is the day's total so far, summed
across every edge (for a gauge such as sessions: the day's peak); LAST_MINUTE and LAST_VALUE
are the latest one-minute window and its value. Quota (messages_per_day, bytes_per_day): the
latest state the pipeline decided (ok, warn, blocked, cleared), its limit then, and the day's
usage of the counter that measures it.

Rows go to stdout, messages to stderr. Exit status: 0 (also for an unknown tenant or a lake
the pipeline has not written usage to yet), 2 for bad arguments or a missing lake, 1 when a
table cannot be read.

examples:
  edgebus usage --lake lake --tenant acme
  edgebus usage --tenant acme --date 2024-03-10 --format json
"""


def day_arg(text: str) -> date:
    """``--date``: a UTC day, YYYY-MM-DD."""
    try:
        return date.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date YYYY-MM-DD, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    lake_command.add_lake_arguments(parser, tenant_help="whose usage to show")
    parser.add_argument(
        "--date",
        type=day_arg,
        metavar="YYYY-MM-DD",
        help="this UTC day (default today); the quota state as it was at its end",
    )
    lake_command.add_format_argument(parser, json_help="one object")


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``usage`` command to ``edgebus``'s subcommands; dispatch it to :func:`run`."""
    return lake_command.add_command(
        subparsers,
        "usage",
        summary="show a tenant's counters for a day and its quota state",
        description=DESCRIPTION,
        add_arguments=add_arguments,
    )


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """One tenant and UTC day."""

    tenant: str
    day: date

    def usage_sql(self) -> str:
        """Per metric the day's last window, over the table registered as :data:`QUERY_TABLE`."""
        columns = "metric, kind, window_start, window_end, value, day_value"
        # Every value is a quoted literal or a formatted date: no injection.
        return (
            f"SELECT {columns} FROM ("  # noqa: S608
            f" SELECT {columns}, row_number() OVER"
            "  (PARTITION BY metric ORDER BY window_start DESC) AS newest"
            f" FROM {QUERY_TABLE} WHERE {self.partitions('=')}"
            ") WHERE newest = 1 ORDER BY metric"
        )

    def quota_where(self) -> str:
        """The ``quota_events`` rows that can hold the state at the end of the day."""
        return self.partitions("<=")

    def partitions(self, date_op: str) -> str:
        return f"tenant = {sql_string(self.tenant)} AND date {date_op} {sql_date(self.day)}"


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """What the command shows: counter rows and quota rows (``usage``: the day's usage of the
    measuring counter; ``value``: the usage when the state was decided)."""

    tenant: str
    day: date
    counters: list[dict[str, Any]] = field(default_factory=list)
    quota: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_usage(lake: LakePath, query: UsageQuery) -> TenantUsage:
    """The tenant's counters and quota state, or :class:`CommandError`; ``notes`` say what is
    missing (no table yet, nothing for this tenant)."""
    from streaming.quota import QUOTA_METRICS, load_recorded

    result = TenantUsage(query.tenant, query.day)
    usage = open_table(lake, TABLE)  # also: no lake at all is an error
    if usage is None:
        result.notes.append(
            f"no {TABLE} table in {lake} yet: the pipeline creates {lake / TABLE} with the "
            "first counters it processes"
        )
    else:
        result.counters.extend(lake_command.query(usage, QUERY_TABLE, query.usage_sql()))
        if not result.counters:
            result.notes.append(
                f"no counters for tenant {query.tenant!r} on {query.day} "
                "(an unknown tenant, or nothing counted that day)"
            )
    try:
        recorded = load_recorded(lake / QUOTA_TABLE, query.quota_where())
    # DeltaSinkError, or DataFusion's plain Exception for a missing or corrupt data file.
    except Exception as exc:
        raise CommandError(f"cannot read {lake / QUOTA_TABLE}: {exc}", exit_code=1) from exc
    day_totals = {row["metric"]: row["day_value"] for row in result.counters}
    rank = {metric: i for i, metric in enumerate(QUOTA_METRICS)}
    for event in sorted(recorded.values(), key=lambda e: (rank.get(e.metric, len(rank)), e.metric)):
        result.quota.append(
            {
                "metric": event.metric,
                "state": event.state,
                "limit": event.limit,
                "usage": day_totals.get(QUOTA_METRICS.get(event.metric, ""), 0),
                "value": event.value,
                "decided_at": event.decided_at,
                "batch_id": event.batch_id,
            }
        )
    if not recorded:
        result.notes.append(
            f"no quota decisions recorded for tenant {query.tenant!r} up to {query.day} "
            "(no limit reached: ok)"
        )
    return result


def run(args: argparse.Namespace, *, now: datetime | None = None) -> int:
    """Run ``edgebus usage`` with parsed ``args``; the exit code."""
    day = args.date or (now if now is not None else datetime.now(UTC)).astimezone(UTC).date()
    try:
        result = read_usage(args.lake, UsageQuery(args.tenant, day))
    except CommandError as exc:
        return lake_command.fail("usage", exc)
    for note in result.notes:
        print(f"edgebus usage: {note}", file=sys.stderr)
    if args.format == "json":
        lake_command.write_out(partial(write_json, result))
    elif result.counters or result.quota:
        lake_command.write_out(partial(write_table, result))
    return 0


def write_json(result: TenantUsage, out: TextIO) -> None:
    """One JSON object: tenant, date, counters and quota (times ISO 8601 UTC)."""
    doc = {
        "tenant": result.tenant,
        "date": result.day.isoformat(),
        "counters": [
            {
                "metric": row["metric"],
                "kind": row["kind"],
                "day_total": row["day_value"],
                "last_window_start": iso(row["window_start"]),
                "last_window_end": iso(row["window_end"]),
                "last_value": row["value"],
            }
            for row in result.counters
        ],
        "quota": [{**row, "decided_at": iso(row["decided_at"])} for row in result.quota],
    }
    out.write(json.dumps(doc) + "\n")


def write_table(result: TenantUsage, out: TextIO) -> None:
    """A counters block and a quota block, each as aligned columns."""
    out.write(f"tenant {result.tenant}, {result.day} (UTC)\n")
    if result.counters:
        header: tuple[str, ...] = ("METRIC", "KIND", "DAY_TOTAL", "LAST_MINUTE", "LAST_VALUE")
        cells = [
            (
                row["metric"],
                row["kind"],
                str(row["day_value"]),
                iso(row["window_start"], "minutes"),
                str(row["value"]),
            )
            for row in result.counters
        ]
        out.write("\n")
        lake_command.write_columns([header, *cells], out)
    if result.quota:
        header = ("QUOTA", "STATE", "LIMIT", "USAGE", "USED", "DECIDED_AT")
        out.write("\n")
        lake_command.write_columns([header, *(_quota_cells(row) for row in result.quota)], out)


def _quota_cells(row: dict[str, Any]) -> tuple[str, ...]:
    limit = row["limit"]
    if limit is None:
        used = "-"
    elif limit == 0:
        used = "-" if row["usage"] == 0 else "inf"
    else:
        used = f"{100 * row['usage'] // limit}%"
    return (
        row["metric"],
        row["state"],
        "-" if limit is None else str(limit),
        str(row["usage"]),
        used,
        iso(row["decided_at"], "seconds"),
    )


def main(argv: Sequence[str] | None = None, *, now: datetime | None = None) -> int:
    """``python -m edgebus.usage_cli ...``: the same command without the ``edgebus`` front."""
    return lake_command.standalone("usage", DESCRIPTION, add_arguments, run, argv, now)


if __name__ == "__main__":
    sys.exit(main())
