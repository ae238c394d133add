"""What ``edgebus logs`` asks of the ``logs`` table: filters, order, a cursor, and the SQL.

One DataFusion query through delta-rs (``deltalake.QueryBuilder``, never
``DeltaTable.to_pyarrow_*``, which can abort the interpreter at exit). Its condition names the
partition columns, ``tenant = ...`` and ``date`` bounds derived from ``--since``/``--until`` and
from the cursor, so delta-rs opens only the files of the matching partitions (``ts`` bounds then
prune more by file statistics); ``ORDER BY ... LIMIT`` lets DataFusion keep just the first rows
(a top-k) instead of sorting them all.

Order and cursor: rows are ordered by ``(ts, node, seq)``, newest first unless oldest first.
``(node, seq)`` is unique (a journal record's identity), so the triple orders every row: a page
ends at a row, and its :class:`Cursor` says exactly which rows come after it, also when many
events share a timestamp.

``--where`` on the ``details`` JSON: DataFusion here has no JSON functions, so the SQL keeps the
rows whose text contains what a match must contain (the key in quotes; ``false``, ``true`` or
``null`` for those values), and :class:`DetailMatch` decides on the parsed JSON. Pages of such
candidates are read after each other (with the cursor) until ``limit`` rows match.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

from edgebus import lake_command
from edgebus.lake_command import CommandError, sql_date, sql_string, sql_timestamp

# The edges' event types from the pure-Python declaration: schemas.payloads would import pyarrow,
# 0.15 s of a command's start-up.
from schemas.names import LOG_EVENTS

if TYPE_CHECKING:
    from deltalake import DeltaTable

# The name the table is registered under in the queries.
QUERY_TABLE = "logs"
DEFAULT_LIMIT = 100
# A page is a list held in memory and a top-k in DataFusion: more at once is edgebus sql's job.
MAX_LIMIT = 1_000_000
# How many candidate rows a --where query reads per page, at least.
CANDIDATE_PAGE = 2_000
# The columns read for rows, in the order of the JSON output.
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
ORDER_COLUMNS = ("ts", "node", "seq")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
# A key that the JSON writers (json.dumps, orjson) put between quotes as it is.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_. -]+")


def ts_us(when: datetime) -> int:
    return (when - _EPOCH) // _MICROSECOND


@dataclass(frozen=True, slots=True, order=True)
class Cursor:
    """A row's place in the order: ``(ts, node, seq)``, opaque to users (URL-safe base64)."""

    ts_us: int
    node: str
    seq: int

    @classmethod
    def of(cls, row: dict[str, Any]) -> Cursor:
        return cls(ts_us(row["ts"]), row["node"], row["seq"])

    def encode(self) -> str:
        text = json.dumps([self.ts_us, self.node, self.seq], separators=(",", ":"))
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor:
        """A cursor printed by ``edgebus logs``, or exit 2."""
        try:
            raw = base64.urlsafe_b64decode(text.strip() + "=" * (-len(text.strip()) % 4))
            ts, node, seq = json.loads(raw)
            cursor = cls(ts, node, seq)
            valid = type(ts) is int and isinstance(node, str) and type(seq) is int
            valid = valid and lake_command.EARLIEST <= cursor.ts() < lake_command.LATEST
        except (ValueError, TypeError, binascii.Error, OverflowError):
            valid = False
        if not valid:
            raise CommandError(
                f'--after {text!r} is not a cursor: give the "cursor" of a row printed by '
                "edgebus logs --format json",
                exit_code=2,
            )
        return cursor

    def ts(self) -> datetime:
        return _EPOCH + self.ts_us * _MICROSECOND


@dataclass(frozen=True, slots=True)
class DetailMatch:
    """``--where KEY=VALUE``: the ``details`` field KEY (``a.b`` for nested) equals VALUE.

    VALUE is read as JSON when it is JSON (``false``, ``0``, ``1.5``, ``null``, ``"text"``),
    otherwise as a string: ``clean=false`` is the boolean, ``reason=timeout`` the string,
    ``reason_code=0`` the number (0 and 0.0 alike, never ``false`` or ``"0"``).
    """

    path: tuple[str, ...]
    value: Any

    @classmethod
    def parse(cls, text: str) -> DetailMatch:
        key, sep, value = text.partition("=")
        path = tuple(key.strip().split("."))
        if not sep or not all(path):
            raise CommandError(
                f"--where {text!r}: expected KEY=VALUE on a details field, e.g. clean=false",
                exit_code=2,
            )
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        return cls(path, parsed)

    def matches(self, details: dict[str, Any] | None) -> bool:
        found: Any = details
        for key in self.path:
            if not isinstance(found, dict) or key not in found:
                return False
            found = found[key]
        return same_json(found, self.value)

    def candidates_sql(self) -> list[str]:
        """Conditions every matching row's ``details`` text keeps (not enough by themselves)."""
        conditions = ["details IS NOT NULL"]
        if _PLAIN_KEY.fullmatch(self.path[-1]):
            conditions.append(f"strpos(details, {sql_string(json.dumps(self.path[-1]))}) > 0")
        if self.value is None or isinstance(self.value, bool):
            conditions.append(f"strpos(details, {sql_string(json.dumps(self.value))}) > 0")
        return conditions


def same_json(found: Any, wanted: Any) -> bool:
    """JSON equality: a boolean is not a number (Python says ``False == 0``), 1 is 1.0."""
    if isinstance(found, bool) or isinstance(wanted, bool):
        return isinstance(found, bool) and isinstance(wanted, bool) and found == wanted
    if isinstance(found, int | float) and isinstance(wanted, int | float):
        return found == wanted
    return type(found) is type(wanted) and bool(found == wanted)


def details_of(row: dict[str, Any]) -> dict[str, Any] | None:
    text = row.get("details")
    if text is None:
        return None
    doc = json.loads(text)
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True, slots=True)
class LogQuery:
    """The filters of one ``edgebus logs`` call, with absolute UTC times.

    Values of one filter are alternatives (OR), different filters all hold (AND), as in
    ``journalctl``.
    """

    tenant: str
    since: datetime | None = None
    until: datetime | None = None
    event_types: tuple[str, ...] = ()
    client_ids: tuple[str, ...] = ()
    origins: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    where: tuple[DetailMatch, ...] = ()
    after: Cursor | None = None
    oldest_first: bool = False
    limit: int = DEFAULT_LIMIT
    columns: tuple[str, ...] = field(default=COLUMNS)

    def conditions(self) -> list[str]:
        """The SQL conditions of the filters, the cursor included."""
        where = [f"tenant = {sql_string(self.tenant)}"]
        # The partition column bounds: they are what lets delta-rs skip other days' files.
        first_day = self.since.date() if self.since else None
        # --until is exclusive: an until at midnight does not need that day's partition.
        last_day = (self.until - _MICROSECOND).date() if self.until else None
        if self.after is not None:
            if self.oldest_first:
                first_day = max(first_day or date.min, self.after.ts().date())
            else:
                last_day = min(last_day or date.max, self.after.ts().date())
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
        for column, values in (
            ("event_type", self.event_types),
            ("client_id", self.client_ids),
            ("origin", self.origins),
            ("node", self.nodes),
        ):
            if values:
                where.append(f"{column} IN ({', '.join(sql_string(v) for v in values)})")
        for match in self.where:
            where.extend(match.candidates_sql())
        if self.after is not None:
            where.extend(self._after_sql(self.after))
        return where

    def _after_sql(self, cursor: Cursor) -> list[str]:
        """The rows after ``cursor`` in this order: a lexicographic comparison of the triple,
        plus a plain ``ts`` bound that file statistics can prune with."""
        op, bound = (">", ">=") if self.oldest_first else ("<", "<=")
        ts, node = sql_timestamp(cursor.ts()), sql_string(cursor.node)
        return [
            f"ts {bound} {ts}",
            f"(ts {op} {ts} OR (ts = {ts} AND (node {op} {node} OR "
            f"(node = {node} AND seq {op} {cursor.seq}))))",
        ]

    def order_sql(self) -> str:
        direction = "ASC" if self.oldest_first else "DESC"
        return ", ".join(f"{column} {direction}" for column in ORDER_COLUMNS)

    def sql(self, limit: int | None = None) -> str:
        """The rows' query over the table registered as :data:`QUERY_TABLE`."""
        needed = [*self.columns, *ORDER_COLUMNS, *(["details"] if self.where else [])]
        columns = ", ".join(f'"{name}"' for name in dict.fromkeys(needed))
        limit_sql = "" if limit is None else f" LIMIT {limit}"
        # Every value is a quoted literal or a formatted date/time: no injection.
        return (
            f"SELECT {columns} FROM {QUERY_TABLE} "  # noqa: S608
            f"WHERE {' AND '.join(self.conditions())} ORDER BY {self.order_sql()}{limit_sql}"
        )

    def count_sql(self) -> str:
        """Totals per event type (the candidates' event types and details, with --where)."""
        where = " AND ".join(self.conditions())
        if self.where:
            return f"SELECT event_type, details FROM {QUERY_TABLE} WHERE {where}"  # noqa: S608
        return (
            f"SELECT event_type, count(*) AS count FROM {QUERY_TABLE} "  # noqa: S608
            f"WHERE {where} GROUP BY event_type"
        )

    def keeps(self, row: dict[str, Any]) -> bool:
        """Whether a row the SQL returned matches ``--where`` too."""
        if not self.where:
            return True
        details = details_of(row)
        return all(match.matches(details) for match in self.where)


def fetch(delta: DeltaTable, query: LogQuery) -> list[dict[str, Any]]:
    """The first ``query.limit`` matching rows in the query's order."""
    if not query.where:
        return lake_command.query(delta, QUERY_TABLE, query.sql(query.limit))
    found: list[dict[str, Any]] = []
    page_size = max(CANDIDATE_PAGE, 4 * query.limit)
    page = query
    while True:
        candidates = lake_command.query(delta, QUERY_TABLE, page.sql(page_size))
        found.extend(row for row in candidates if query.keeps(row))
        if len(found) >= query.limit or len(candidates) < page_size:
            return found[: query.limit]
        page = replace(page, after=Cursor.of(candidates[-1]))


def count(delta: DeltaTable, query: LogQuery) -> dict[str | None, int]:
    """How many rows match, per event type."""
    rows = lake_command.query(delta, QUERY_TABLE, query.count_sql())
    if not query.where:
        return {row["event_type"]: row["count"] for row in rows}
    totals: dict[str | None, int] = {}
    for row in rows:
        if query.keeps(row):
            totals[row["event_type"]] = totals.get(row["event_type"], 0) + 1
    return totals


def check_event_types(event_types: Sequence[str]) -> None:
    """Exit 2 for an event type no edge logs, naming the ones they do."""
    unknown = [name for name in event_types if name not in LOG_EVENTS]
    if unknown:
        raise CommandError(
            f"unknown event type {', '.join(map(repr, unknown))}: the edges log "
            f"{', '.join(sorted(LOG_EVENTS))}",
            exit_code=2,
        )
