"""What ``edgebus logs`` asks of the ``logs`` table: filters, order, a cursor, and the SQL.

One DataFusion query through delta-rs (``deltalake.QueryBuilder``, never
``DeltaTable.to_pyarrow_*``, which can abort the interpreter at exit), paged as every reader of
journal records pages (:mod:`edgebus.page`: the partition bounds, the ``(ts, node, seq)`` order
and its cursor). ``edgebus logs`` and the REST API's ``GET /logs`` both run it.

``--where`` on the ``details`` JSON: DataFusion here has no JSON functions, so the SQL keeps the
rows whose text contains what a match must contain (the key in quotes; ``false``, ``true`` or
``null`` for those values), and :class:`DetailMatch` decides on the parsed JSON. Pages of such
candidates are read after each other (with the cursor) until ``limit`` rows match.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from edgebus import lake_command
from edgebus.lake_command import CommandError, iso, sql_string
from edgebus.page import ORDER_COLUMNS as ORDER_COLUMNS  # noqa: PLC0414 (re-exported)
from edgebus.page import Cursor as Cursor  # noqa: PLC0414 (re-exported)
from edgebus.page import Page, fetch_by_days
from edgebus.page import ts_us as ts_us  # noqa: PLC0414 (re-exported)

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
# A --where query's first page of candidates: this many per row asked for (the SQL prefilter
# is usually close: more would read rows for nothing); later pages grow 4 times each, to
# CANDIDATE_PAGE_MAX rows (a prefilter that lets most rows through costs a few pages).
CANDIDATES_PER_ROW = 4
CANDIDATE_PAGE_MAX = 50_000
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
# A key that the JSON writers (json.dumps, orjson) put between quotes as it is.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_. -]+")


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


def event_doc(row: dict[str, Any]) -> dict[str, Any]:
    """One row of every column as JSON: ``details`` as the object itself, ``raw`` and
    ``invalid_reason`` only for a row whose payload broke its contract, and its cursor."""
    doc = {name: row[name] for name in COLUMNS if name not in ("raw", "invalid_reason")}
    doc["ts"] = iso(row["ts"])
    if row["details"] is not None:
        doc["details"] = json.loads(row["details"])
    if not row["payload_valid"]:
        doc["invalid_reason"] = row["invalid_reason"]
        doc["raw"] = raw_text(row["raw"])
    doc["cursor"] = Cursor.of(row).encode()
    return doc


def raw_text(raw: bytes | None) -> str:
    return "" if raw is None else raw.decode("utf-8", "backslashreplace")


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

    def page(self) -> Page:
        return Page(self.tenant, self.since, self.until, self.after, self.oldest_first)

    def conditions(self) -> list[str]:
        """The SQL conditions of the filters, the time range and the cursor included."""
        where = self.page().conditions()
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
        return where

    def order_sql(self) -> str:
        return self.page().order_sql()

    def sql(self, limit: int | None = None) -> str:
        """The rows' query over the table registered as :data:`QUERY_TABLE`."""
        columns = [*self.columns, *(["details"] if self.where else [])]
        return self.page().sql(QUERY_TABLE, columns, self.conditions(), limit)

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
    return fetch_by_days(delta, query, partial(_fetch, delta))


def _fetch(delta: DeltaTable, query: LogQuery) -> list[dict[str, Any]]:
    if not query.where:
        return lake_command.query(delta, QUERY_TABLE, query.sql(query.limit))
    found: list[dict[str, Any]] = []
    page_size = CANDIDATES_PER_ROW * query.limit
    largest = max(CANDIDATE_PAGE_MAX, page_size)
    page = query
    while True:
        candidates = lake_command.query(delta, QUERY_TABLE, page.sql(page_size))
        found.extend(row for row in candidates if query.keeps(row))
        if len(found) >= query.limit or len(candidates) < page_size:
            return found[: query.limit]
        page = replace(page, after=Cursor.of(candidates[-1]))
        page_size = min(4 * page_size, largest)


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
