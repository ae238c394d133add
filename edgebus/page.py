"""A page of a tenant's time-ordered rows: the time range, the cursor, the order, the SQL.

Shared by every reader of a table whose rows are journal records (``logs``, ``messages``): the
``edgebus logs`` command and the REST API (``GET /logs``, ``GET /messages``) page the same way.

Order and cursor: rows are ordered by ``(ts, node, seq)``, newest first unless oldest first.
``(node, seq)`` is unique (a journal record's identity), so the triple orders every row: a page
ends at a row, and its :class:`Cursor` says exactly which rows come after it, also when many
rows share a timestamp.

Pruning: the conditions name the partition columns, ``tenant = ...`` and ``date`` bounds derived
from the time range and from the cursor, so delta-rs opens only the files of the matching
partitions (``ts`` bounds then prune more by file statistics); ``ORDER BY ... LIMIT`` lets
DataFusion keep just the first rows (a top-k) instead of sorting them all.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from edgebus import lake_command
from edgebus.lake_command import CommandError, sql_date, sql_string, sql_timestamp

ORDER_COLUMNS = ("ts", "node", "seq")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


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
    def decode(cls, text: str, option: str = "--after") -> Cursor:
        """A cursor a row was printed (or served) with, or :class:`CommandError` (exit 2)
        naming ``option``."""
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
                f'{option} {text!r} is not a cursor: give the "cursor" of a row printed by '
                "edgebus logs --format json (or served by the API)",
                exit_code=2,
            )
        return cursor

    def ts(self) -> datetime:
        return _EPOCH + self.ts_us * _MICROSECOND


@dataclass(frozen=True, slots=True)
class Page:
    """The rows of ``tenant`` in ``[since, until)`` after ``after``, in one direction."""

    tenant: str
    since: datetime | None = None
    until: datetime | None = None
    after: Cursor | None = None
    oldest_first: bool = False

    def conditions(self) -> list[str]:
        """The SQL conditions of the range and the cursor (the partition bounds first)."""
        where = [f"tenant = {sql_string(self.tenant)}"]
        # The partition column bounds: they are what lets delta-rs skip other days' files.
        first_day = self.since.date() if self.since else None
        # until is exclusive: an until at midnight does not need that day's partition.
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

    def sql(
        self, table: str, columns: Sequence[str], conditions: Sequence[str], limit: int | None
    ) -> str:
        """The page's rows of ``table``: ``columns`` (the order columns added) where
        ``conditions`` (this page's and the caller's filters) hold, in order."""
        names = ", ".join(f'"{name}"' for name in dict.fromkeys([*columns, *ORDER_COLUMNS]))
        limit_sql = "" if limit is None else f" LIMIT {limit}"
        # Every value is a quoted literal or a formatted date/time: no injection.
        return (
            f"SELECT {names} FROM {table} "  # noqa: S608
            f"WHERE {' AND '.join(conditions)} ORDER BY {self.order_sql()}{limit_sql}"
        )
