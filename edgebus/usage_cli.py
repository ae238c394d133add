"""``edgebus usage``: a tenant's counters for one UTC day and its quota state, from the lake.

Hooked into ``edgebus`` with :func:`add_parser` and :func:`run`; ``python -m edgebus.usage_cli``
runs it alone (:func:`main`). What users see is :data:`DESCRIPTION`.

The reads (shared with the REST API's ``GET /usage``) are :mod:`edgebus.usage_query`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import UTC, date, datetime
from functools import partial
from typing import Any, TextIO

from edgebus import lake_command
from edgebus.lake_command import CommandError, iso
from edgebus.usage_query import TenantUsage, UsageQuery, read_usage, usage_doc
from schemas.names import COUNTED_QUOTAS

DESCRIPTION = """\
Show a tenant's usage counters for one UTC day (today unless --date) from the lake's Delta
table "usage", and its quota state from "quota_events".

Counters (messages_in, bytes_in, sessions, ...): DAY_TOTAL is the day's total so far, summed
across every edge (for a gauge such as sessions: the day's peak); LAST_MINUTE and LAST_VALUE
are the latest one-minute window and its value; QUOTA names the quota metric a counter
measures (messages_in counts messages_per_day, bytes_in bytes_per_day). Quota
(messages_per_day, bytes_per_day): the latest state the pipeline decided (ok, warn, blocked,
cleared), its limit then, and the day's USAGE of the counter that measures it (COUNTED_BY).

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
    out.write(json.dumps(usage_doc(result)) + "\n")


def write_table(result: TenantUsage, out: TextIO) -> None:
    """A counters block and a quota block, each as aligned columns."""
    out.write(f"tenant {result.tenant}, {result.day} (UTC)\n")
    if result.counters:
        header: tuple[str, ...] = (
            "METRIC",
            "KIND",
            "DAY_TOTAL",
            "LAST_MINUTE",
            "LAST_VALUE",
            "QUOTA",
        )
        cells = [
            (
                row["metric"],
                row["kind"],
                str(row["day_value"]),
                iso(row["window_start"], "minutes"),
                str(row["value"]),
                COUNTED_QUOTAS.get(row["metric"], "-"),
            )
            for row in result.counters
        ]
        out.write("\n")
        lake_command.write_columns([header, *cells], out)
    if result.quota:
        header = ("QUOTA", "COUNTED_BY", "STATE", "LIMIT", "USAGE", "USED", "DECIDED_AT")
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
        row["usage_metric"] or "-",
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
