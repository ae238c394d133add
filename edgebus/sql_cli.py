"""``edgebus sql``: one SQL query over the lake's Delta tables, on this machine, without a JVM.

Hooked into ``edgebus`` with :func:`add_parser` and :func:`run`; ``python -m edgebus.sql_cli``
runs it alone (:func:`main`). What users see is :data:`DESCRIPTION`.

Each table of the lake is registered under its directory name with delta-rs's DataFusion
(``deltalake.QueryBuilder``; never ``DeltaTable.to_pyarrow_*``, which can abort the
interpreter at exit) as a Delta table provider: a condition on the partition columns
(``tenant``, ``date``) keeps the other partitions' files from being opened at all, and file
statistics prune more. Only the tables the query names are opened (a table's name that does not
occur in the text cannot be read by it), so a query of ``logs`` does not pay for ``messages``.

Errors: the query is planned when it is handed to DataFusion, so a mistake in it (syntax, an
unknown table or column, a type mismatch) is a ``DeltaError`` before any row is read: its
message on one line, exit 2. A failure while rows are read (a data file gone, a division by
zero) is exit 1.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from functools import partial
from typing import TYPE_CHECKING, Any, TextIO

from edgebus import lake_command
from edgebus.lake_command import CommandError, TimeArg, iso, resolve_time
from sinks.storage import LakePath, open_delta

if TYPE_CHECKING:
    from arro3.core import RecordBatchReader
    from deltalake import DeltaTable

FORMATS = ("table", "json", "csv")
DESCRIPTION = """\
Run one SQL query (DataFusion's dialect) over the lake's Delta tables and print the result.

Every table of the lake is there under its name: logs, messages, usage, quota_events,
quarantine, quality_results. A condition on the partition columns, tenant and date, means
the other partitions' files are not read at all (see EXPLAIN).

Rows go to stdout, messages to stderr. Exit status: 0, 2 for a query DataFusion refuses
(its message, on one line), bad arguments or a directory that is no lake, 1 when the data
cannot be read.

examples:
  edgebus sql "SELECT event_type, count(*) AS n FROM logs WHERE tenant = 'acme'
               AND date = DATE '2024-03-10' GROUP BY event_type ORDER BY n DESC"
  edgebus sql --as-of 3 "SELECT count(*) FROM messages"
  edgebus sql --as-of 2024-03-10T08:00Z --format csv "SELECT * FROM quota_events"
  edgebus sql "EXPLAIN SELECT * FROM logs WHERE tenant = 'acme'"
"""
_VERSION = re.compile(r"\d+")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def as_of_arg(text: str) -> int | TimeArg:
    """``--as-of``: a Delta version (a whole number) or a time (ISO 8601 or a duration ago)."""
    if _VERSION.fullmatch(text.strip()):
        return int(text)
    return lake_command.time_arg(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("query", metavar="SQL", help='the query, e.g. "SELECT * FROM logs"')
    lake_command.add_lake_arguments(parser, tenant_help=None)
    parser.add_argument(
        "--as-of",
        type=as_of_arg,
        metavar="VERSION|TIME",
        help="read each table as it was: at this Delta version (a number), or at this time "
        "(ISO 8601, or a duration ago: 2h)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="table (aligned columns, the default), json (one object per line) or csv "
        "(with a header line)",
    )


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``sql`` command to ``edgebus``'s subcommands; dispatch it to :func:`run`."""
    return lake_command.add_command(
        subparsers,
        "sql",
        summary="run a SQL query over the lake's Delta tables",
        description=DESCRIPTION,
        add_arguments=add_arguments,
    )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Which state of each table a query reads: the latest, a version or a time."""

    version: int | None = None
    at: datetime | None = None

    def open(self, path: LakePath) -> DeltaTable | None:
        """The table at ``path`` as of this snapshot; None when it did not exist yet then."""
        if self.version is not None:
            return open_delta(path, version=self.version)
        delta = open_delta(path)
        if self.at is not None:
            delta.load_as_version(self.at)
            # delta-rs gives version 0 for a time before the table existed.
            if self.at.timestamp() * 1000 < delta.metadata().created_time:
                return None
        return delta


def referenced(sql: str, names: Sequence[str]) -> list[str]:
    """The table names that occur in ``sql`` as a word: the only tables it can read."""
    words = {word.lower() for word in re.findall(r"\w+", sql)}
    return [name for name in names if name.lower() in words]


@dataclass(frozen=True, slots=True)
class Opened:
    """The tables a query names, as of its snapshot, and why any named one is not there."""

    tables: dict[str, DeltaTable]
    missing: dict[str, str]
    names: list[str]  # every table of the lake


def open_tables(lake: LakePath, sql: str, snapshot: Snapshot) -> Opened:
    """The tables ``sql`` names, as of ``snapshot``."""
    from deltalake.exceptions import DeltaError

    names = lake_command.lake_tables(lake)
    if not names:
        raise CommandError(
            f"no tables in {lake} yet: the pipeline creates them as it processes records",
            exit_code=2,
        )
    tables: dict[str, DeltaTable] = {}
    missing: dict[str, str] = {}
    for name in referenced(sql, names):
        try:
            delta = snapshot.open(lake / name)
        except (DeltaError, OSError) as exc:
            missing[name] = _why_not(lake / name, snapshot, exc)
            continue
        if delta is None:
            missing[name] = f"{name} did not exist yet at {_describe(snapshot)}"
        else:
            tables[name] = delta
    return Opened(tables, missing, names)


def execute(
    tables: dict[str, DeltaTable], sql: str, missing: dict[str, str], names: Sequence[str] = ()
) -> RecordBatchReader:
    """Plan ``sql`` over ``tables``; a query DataFusion refuses is exit 2 with its message.

    ``missing`` says why a table the query names is not among ``tables``; ``names`` are the
    lake's tables, listed when the query names another.
    """
    from deltalake.exceptions import DeltaError

    try:
        return lake_command.execute(tables, sql)
    except DeltaError as exc:
        message = _one_line(exc)
        why = [reason for name, reason in missing.items() if f".{name}'" in message]
        if not why and names and "not found" in message:
            why = [f"the lake's tables: {', '.join(names)}"]
        raise CommandError(message + "".join(f" ({reason})" for reason in why), 2) from exc


def run(args: argparse.Namespace, *, now: datetime | None = None) -> int:
    """Run ``edgebus sql`` with parsed ``args``; the exit code."""
    try:
        snapshot = _snapshot(args.as_of, now if now is not None else datetime.now(UTC))
        opened = open_tables(args.lake, args.query, snapshot)
        reader = execute(opened.tables, args.query, opened.missing, opened.names)
        write = {"table": write_table, "json": write_json, "csv": write_csv}[args.format]
        lake_command.write_out(partial(write, reader))
    except CommandError as exc:
        return lake_command.fail("sql", exc)
    except KeyboardInterrupt:  # Ctrl-C during a long query: the shell's code, no traceback
        return 130
    # Rows are read while they are written: a failure then is DataFusion's (a file gone, ...).
    except Exception as exc:
        print(f"edgebus sql: the query failed while reading: {_one_line(exc)}", file=sys.stderr)
        return 1
    return 0


def _why_not(path: LakePath, snapshot: Snapshot, exc: Exception) -> str:
    """Why the table at ``path`` cannot be read as of ``snapshot``."""
    from deltalake.exceptions import DeltaError

    if snapshot.version is not None:
        try:
            latest = open_delta(path).version()
        except (DeltaError, OSError):
            pass
        else:
            if snapshot.version > latest:
                return f"{path.name} has no version {snapshot.version}: its latest is {latest}"
    return f"{path.name} cannot be read as of {_describe(snapshot)}: {_one_line(exc)}"


def _snapshot(as_of: int | TimeArg | None, now: datetime) -> Snapshot:
    if isinstance(as_of, int):
        return Snapshot(version=as_of)
    return Snapshot(at=resolve_time("--as-of", as_of, now))


def _describe(snapshot: Snapshot) -> str:
    if snapshot.version is not None:
        return f"version {snapshot.version}"
    return iso(snapshot.at) if snapshot.at is not None else "now"


def _one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def batches_of_rows(reader: RecordBatchReader) -> Iterator[list[tuple[Any, ...]]]:
    """The result's rows, a batch at a time (a large result is never held whole)."""
    for batch in reader:
        yield lake_command.batch_values(batch)


def write_json(reader: RecordBatchReader, out: TextIO) -> None:
    """One JSON object per row and line."""
    names = reader.schema.names
    for rows in batches_of_rows(reader):
        for row in rows:
            doc = dict(zip(names, row, strict=True))
            out.write(json.dumps(doc, default=_json_value, ensure_ascii=False) + "\n")


def write_csv(reader: RecordBatchReader, out: TextIO) -> None:
    """A header line, then one line per row (NULL is an empty field)."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(reader.schema.names)
    for rows in batches_of_rows(reader):
        writer.writerows([_text(value, null="") for value in row] for row in rows)


def write_table(reader: RecordBatchReader, out: TextIO) -> None:
    """Aligned columns under a header (the whole result is read first, to size them)."""
    lines = [[name.upper() for name in reader.schema.names]]
    for rows in batches_of_rows(reader):
        lines.extend([_CONTROL.sub(_escape, _text(value)) for value in row] for row in rows)
    lake_command.write_columns(lines, out)


def _escape(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def _text(value: Any, null: str = "NULL") -> str:
    """A cell as text: times in ISO 8601 (UTC with a Z), nested values as JSON."""
    if value is None:
        return null
    if isinstance(value, bool | int | float | str | Decimal):
        return str(value)
    if isinstance(value, datetime | date | time | timedelta | bytes):
        return str(_json_value(value))
    return json.dumps(value, default=_json_value, ensure_ascii=False)


def _json_value(value: Any) -> Any:
    """What JSON cannot hold as it is: times as ISO 8601, bytes as text, decimals as numbers."""
    if isinstance(value, datetime):
        return iso(value) if value.tzinfo is not None else value.isoformat()
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, Decimal):
        return float(value)
    raise TypeError(f"cannot show a {type(value).__name__}")


def main(argv: Sequence[str] | None = None, *, now: datetime | None = None) -> int:
    """``python -m edgebus.sql_cli ...``: the same command without the ``edgebus`` front."""
    return lake_command.standalone("sql", DESCRIPTION, add_arguments, run, argv, now)


if __name__ == "__main__":
    sys.exit(main())
