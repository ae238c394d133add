"""What the commands that read the lake (``edgebus logs``, ``sql``, ``usage``, ...) share.

Their common arguments (``--lake``, ``--tenant``, ``--format``, times), how they hook into
``edgebus`` and run alone, what counts as a lake, SQL literals, opening a table and querying it
through delta-rs (``deltalake.QueryBuilder``; never ``DeltaTable.to_pyarrow_*``, which can
abort the interpreter at exit), the error that carries an exit code, and writing rows as
aligned columns.

Start-up is most of what a command costs (the query itself takes some 30 ms on a 10M-row
table): deltalake waits until a query runs, so building the ``edgebus`` parser stays cheap, and
results go to Python through arro3 (which deltalake returns and brings along), not pyarrow:
importing pyarrow (and numpy with it) costs some 150 ms, pandas another 300.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from sinks.storage import (
    LakePath,
    ObjectPath,
    StorageError,
    is_delta_table,
    lake_path,
    one_line,
    open_delta,
)

if TYPE_CHECKING:
    from arro3.core import RecordBatch, RecordBatchReader
    from deltalake import DeltaTable

FORMATS = ("table", "json")
# Where a Structured Streaming query keeps its checkpoints inside the lake (not a table).
CHECKPOINTS = "_checkpoints"
# The times a query may name: DataFusion's timestamp literals are nanoseconds in an int64
# (1677-2262); the data contracts keep every row's ts within 2000-2100 anyway.
EARLIEST = datetime(1900, 1, 1, tzinfo=UTC)
LATEST = datetime(2200, 1, 1, tzinfo=UTC)

_DURATION = re.compile(r"(\d+)([smhdw])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}

# A point in time as given: absolute, or a duration back from the moment the command runs.
TimeArg = datetime | timedelta

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[..., int]


class CommandError(Exception):
    """The command cannot run as asked; the message says why, ``exit_code`` what to return."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def add_lake_arguments(parser: argparse.ArgumentParser, tenant_help: str | None) -> None:
    """``--lake DIR|s3://bucket/prefix`` (default ./lake) and, with ``tenant_help``,
    ``--tenant T`` (required)."""
    parser.add_argument(
        "--lake",
        type=lake_arg,
        default=Path("lake"),
        metavar="DIR",
        help="directory of the Delta tables, or s3://bucket/prefix (reached as the AWS_* "
        "environment variables say: AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, ...; "
        "default ./lake)",
    )
    if tenant_help is not None:
        parser.add_argument("--tenant", required=True, metavar="T", help=tenant_help)


def lake_arg(text: str) -> LakePath:
    """An argument type: a lake directory, or ``s3://bucket/prefix`` with the environment's
    storage options."""
    try:
        return lake_path(text)
    except StorageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    """An argument type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def time_arg(text: str) -> TimeArg:
    """An ISO 8601 time (UTC unless it names a zone) or a duration back from now (15m, 2h, 7d).

    Only the syntax is checked here; :func:`resolve_time` checks the range.
    """
    duration = _DURATION.fullmatch(text.strip())
    if duration:
        amount, unit = duration.groups()
        try:
            return timedelta(**{_UNITS[unit]: int(amount)})
        except OverflowError:
            return timedelta.max  # out of range: resolve_time says so, on one line
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO 8601 time (2024-03-10T08:00:00Z) or a duration "
            f"(15m, 2h, 7d), got {text!r}"
        ) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def resolve_time(option: str, value: TimeArg | None, now: datetime) -> datetime | None:
    """``value`` of ``option`` as an absolute UTC time, or exit 2 when it is out of range."""
    if value is None:
        return None
    try:
        when = now - value if isinstance(value, timedelta) else value
    except OverflowError:
        when = None
    if when is None or not EARLIEST <= when < LATEST:
        raise CommandError(
            f"{option} is out of range: give a time between {EARLIEST:%Y-%m-%d} and "
            f"{LATEST:%Y-%m-%d}",
            exit_code=2,
        )
    return when


def add_format_argument(parser: argparse.ArgumentParser, json_help: str) -> None:
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help=f"table (aligned columns, the default) or json ({json_help})",
    )


def add_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    summary: str,
    description: str,
    add_arguments: AddArguments,
) -> argparse.ArgumentParser:
    """Add command ``name`` to ``edgebus``'s subcommands."""
    parser = subparsers.add_parser(
        name,
        help=summary,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def standalone(
    name: str,
    description: str,
    add_arguments: AddArguments,
    run: Run,
    argv: Sequence[str] | None,
    now: datetime | None,
) -> int:
    """``python -m edgebus.{name}_cli ...``: the command without the ``edgebus`` front."""
    parser = argparse.ArgumentParser(
        prog=f"edgebus {name}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv), now=now)


def sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def sql_date(day: date) -> str:
    return f"DATE '{day.isoformat()}'"


def sql_timestamp(when: datetime) -> str:
    return f"TIMESTAMP '{when.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%S.%fZ')}'"


def iso(when: datetime, timespec: str = "microseconds") -> str:
    """``when`` in UTC as ISO 8601 with a ``Z``."""
    return when.astimezone(UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


def is_table(path: Path) -> bool:
    """Whether ``path`` is a Delta table (on a local disk: it has a ``_delta_log``)."""
    return (path / "_delta_log").is_dir()


def bucket_tables(lake: ObjectPath) -> list[str]:
    """The edgebus tables a lake in a bucket holds, sorted; exit 2 when the bucket does not
    answer. A bucket has no directories to list: each table the pipeline writes is looked for
    (one listing of its ``_delta_log`` each)."""
    from schemas.tables import TABLES

    try:
        return [name for name in sorted(TABLES) if is_delta_table(lake / name)]
    except OSError as exc:
        raise CommandError(f"cannot reach the lake {lake}: {one_line(exc)}", exit_code=2) from exc


def lake_tables(lake: LakePath) -> list[str]:
    """The names of the Delta tables in ``lake``, sorted; exit 2 when it is no lake.

    No lake: a directory that is not there (a mistyped ``--lake``), a table's own directory
    (``--lake lake/logs``), or one that holds other things but no table. An empty directory is
    a lake the pipeline has not written to yet. In a bucket: see :func:`bucket_tables`.
    """
    if isinstance(lake, ObjectPath):
        return bucket_tables(lake)
    if not lake.is_dir():
        raise CommandError(f"no lake at {lake}: give --lake DIR (the pipeline's)", exit_code=2)
    if is_table(lake):
        raise CommandError(
            f"{lake} is a Delta table, not a lake: give the directory that holds the tables "
            f"(--lake {lake.parent})",
            exit_code=2,
        )
    try:
        entries = list(lake.iterdir())
    except OSError as exc:
        raise CommandError(f"cannot read the lake {lake}: {exc}", exit_code=2) from exc
    tables = sorted(entry.name for entry in entries if entry.is_dir() and is_table(entry))
    if entries and not tables and not (lake / CHECKPOINTS).is_dir():
        raise CommandError(
            f"{lake} is not a lake: it holds no Delta table (logs, messages, usage, ...)",
            exit_code=2,
        )
    return tables


def open_table(lake: LakePath, table: str) -> DeltaTable | None:
    """``table`` of ``lake``; None when the pipeline has not created it yet.

    A directory that is no lake is an error (exit 2, see :func:`lake_tables`).
    """
    from deltalake.exceptions import DeltaError

    tables = lake_tables(lake)
    path = lake / table
    try:
        if table not in tables or not is_delta_table(path):
            return None
        return open_delta(path)
    except (DeltaError, OSError) as exc:
        raise CommandError(f"cannot read {path}: {one_line(exc)}", exit_code=1) from exc


def execute(tables: dict[str, DeltaTable], sql: str) -> RecordBatchReader:
    """``sql`` over ``tables`` registered by name: an arro3 stream of its result.

    DataFusion plans the query here: a query it refuses raises ``DeltaError``; failures while
    the rows are read (a data file gone) come from the stream, as plain exceptions.
    """
    from deltalake import QueryBuilder

    builder = QueryBuilder()
    for name, delta in tables.items():
        builder.register(name, delta)
    return builder.execute(sql)


def batch_values(batch: RecordBatch) -> list[tuple[Any, ...]]:
    """The rows of ``batch`` as tuples of Python values (zoned times with their zone)."""
    return list(zip(*(column.to_pylist() for column in batch.columns), strict=True))


def query(delta: DeltaTable, name: str, sql: str) -> list[dict[str, Any]]:
    """The rows of ``sql`` over ``delta`` registered as ``name`` (exit 1 when it fails)."""
    try:
        rows: list[dict[str, Any]] = []
        for batch in execute({name: delta}, sql):
            names = batch.column_names
            rows.extend(dict(zip(names, values, strict=True)) for values in batch_values(batch))
    # DataFusion's errors (a data file missing or corrupt, ...) arrive as plain Exception,
    # not DeltaError: every failure of the query is "cannot read", not a traceback.
    except Exception as exc:
        raise CommandError(f"cannot read {delta.table_uri}: {one_line(exc)}", exit_code=1) from exc
    return rows


def has_tenant(delta: DeltaTable, tenant: str) -> bool:
    """Whether ``delta`` (partitioned by tenant) holds any row of ``tenant``."""
    from deltalake.exceptions import DeltaError

    try:
        return bool(delta.partitions(file_pruning_predicate=[("tenant", "=", tenant)]))
    except (DeltaError, OSError) as exc:
        raise CommandError(f"cannot read {delta.table_uri}: {exc}", exit_code=1) from exc


def fail(command: str, exc: CommandError) -> int:
    print(f"edgebus {command}: {exc}", file=sys.stderr)
    return exc.exit_code


def write_out(write: Callable[[TextIO], None]) -> bool:
    """Run ``write(sys.stdout)``; a reader that went away (``| head``) is not an error.

    False when it went away (a command that follows stops then).
    """
    try:
        write(sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        # Keep the exit-time flush quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False
    return True


def write_columns(lines: Sequence[Sequence[str]], out: TextIO) -> None:
    """A header and rows as aligned columns; the last column (free text) is not padded."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    for line in lines:
        cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)]
        out.write("  ".join([*cells, line[-1]]).rstrip() + "\n")
