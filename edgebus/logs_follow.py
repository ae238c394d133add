"""``edgebus logs --follow``: the newest events, then each new one as the pipeline commits it.

Theory of operation. A new event is not necessarily newer than the ones shown: a batch can
carry an edge's backlog, with older timestamps. What is new is what each node logged later:
``seq`` grows per node, and the pipeline commits a node's records in ``seq`` order (journal
ranges by offset, one batch after the other), so every row a later commit adds has a larger
``seq`` than every row of its node already in the table. The follower keeps, per node, the
largest ``seq`` among the rows that could match at the snapshot it read (the high-water mark)
and asks each new snapshot for the rows above it. That holds whatever else a commit does: a
compaction rewrites rows (their ``seq`` is not above the mark), a replayed batch is skipped by
the writer. To read little, a new snapshot is asked only about the ``date`` partitions of this
tenant that got data files since the last one (from the Delta log's add actions).

The table is polled every :data:`POLL_SECONDS`; a table that is not there yet is waited for.
SIGINT and SIGTERM end it between two polls, exit 0.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import replace
from datetime import date
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from edgebus import lake_command, log_query
from edgebus.lake_command import CommandError, sql_date, sql_string
from edgebus.log_query import QUERY_TABLE, Cursor, LogQuery
from sinks.storage import LakePath

if TYPE_CHECKING:
    from collections.abc import Sequence

    from deltalake import DeltaTable

POLL_SECONDS = 0.5
TABLE = "logs"


class Output(Protocol):
    def write(self, rows: Sequence[dict[str, Any]]) -> bool: ...


class Follower:
    """The rows of ``query`` committed to ``delta`` after the snapshot it has seen."""

    def __init__(self, delta: DeltaTable, query: LogQuery, version: int = -1) -> None:
        self.delta = delta
        # Oldest first, no cursor: the mark says what is new.
        self.query = replace(query, after=None, oldest_first=True)
        self.version = version
        self.files: set[str] = set()
        self.marks: dict[str, int] = {}

    def start(self) -> None:
        """Take the current snapshot as seen: its files and the marks of its rows."""
        self.version = self.delta.version()
        self.files = set(self._partitions())
        sql = (
            f"SELECT node, max(seq) AS seq FROM {QUERY_TABLE} "  # noqa: S608
            f"WHERE {' AND '.join(self.query.conditions())} GROUP BY node"
        )
        rows = lake_command.query(self.delta, QUERY_TABLE, sql)
        self.marks = {row["node"]: row["seq"] for row in rows}

    def poll(self) -> list[dict[str, Any]]:
        """The matching rows committed since the last call, oldest first."""
        from deltalake.exceptions import DeltaError

        try:
            self.delta.update_incremental()
        except (DeltaError, OSError) as exc:
            raise CommandError(f"cannot read {self.delta.table_uri}: {exc}", 1) from exc
        if self.delta.version() == self.version:
            return []
        partitions = self._partitions()
        days = {day for path, day in partitions.items() if path not in self.files}
        self.version = self.delta.version()
        self.files = set(partitions)
        if not days:
            return []
        rows = lake_command.query(self.delta, QUERY_TABLE, self._new_rows_sql(days))
        for row in rows:
            self.marks[row["node"]] = max(self.marks.get(row["node"], 0), row["seq"])
        return [row for row in rows if self.query.keeps(row)]

    def _partitions(self) -> dict[str, date]:
        """Each data file of this tenant in the current snapshot, with its day."""
        try:
            actions = self.delta.get_add_actions(flatten=True)
        except Exception as exc:
            raise CommandError(f"cannot read {self.delta.table_uri}: {exc}", 1) from exc
        if actions.num_rows == 0:
            return {}
        paths = actions.column("path").to_pylist()
        tenants = actions.column("partition.tenant").to_pylist()
        days = actions.column("partition.date").to_pylist()
        tenant = self.query.tenant
        return {p: d for p, t, d in zip(paths, tenants, days, strict=True) if t == tenant}

    def _new_rows_sql(self, days: set[date]) -> str:
        conditions = self.query.conditions()
        conditions.append(f"date IN ({', '.join(sql_date(day) for day in sorted(days))})")
        if self.marks:
            known = ", ".join(sql_string(node) for node in self.marks)
            above = " OR ".join(
                f"(node = {sql_string(node)} AND seq > {seq})" for node, seq in self.marks.items()
            )
            conditions.append(f"(node NOT IN ({known}) OR {above})")
        needed = [*self.query.columns, *log_query.ORDER_COLUMNS, "details"]
        columns = ", ".join(f'"{name}"' for name in dict.fromkeys(needed))
        return (
            f"SELECT {columns} FROM {QUERY_TABLE} "  # noqa: S608
            f"WHERE {' AND '.join(conditions)} ORDER BY {self.query.order_sql()}"
        )


def history(delta: DeltaTable, query: LogQuery) -> list[dict[str, Any]]:
    """What is shown before following: every row after ``--after``, else the newest
    ``--limit`` rows; oldest first."""
    if query.after is None:
        return log_query.fetch(delta, replace(query, oldest_first=False))[::-1]
    rows: list[dict[str, Any]] = []
    page = replace(query, oldest_first=True)
    while True:
        found = log_query.fetch(delta, page)
        rows.extend(found)
        if len(found) < page.limit:
            return rows
        page = replace(page, after=Cursor.of(found[-1]))


def follow(lake: LakePath, query: LogQuery, output: Output) -> int:
    """Show the history, then new rows until SIGINT/SIGTERM (exit 0)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _follow(lake, query, output, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _follow(lake: LakePath, query: LogQuery, output: Output, stop: threading.Event) -> int:
    follower: Follower | None = None
    delta = lake_command.open_table(lake, TABLE)  # exit 2 when the directory is no lake
    if delta is not None:
        if not output.write(history(delta, query)):
            return 0
        follower = Follower(delta, query)
        follower.start()
    print(
        f"edgebus logs: following {query.tenant}'s new events in {lake / TABLE} (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    while not stop.wait(POLL_SECONDS):
        if follower is None:
            delta = lake_command.open_table(lake, TABLE)
            if delta is None:
                continue
            follower = Follower(delta, query)  # version -1: every row is new
        rows = follower.poll()
        if rows and not output.write(rows):
            return 0
    return 0
