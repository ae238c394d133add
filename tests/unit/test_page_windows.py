"""Reading a page day window after day window (edgebus.page.fetch_by_days) gives exactly the
rows of one query over every day: checked against a brute-force sort over a lake whose days
have gaps, for both orders, time bounds, cursors and limits."""

from __future__ import annotations

import datetime as dt
import itertools
import random
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from lake_fixture import DeltaBatchWriter, log_row

from edgebus import lake_command, log_query
from edgebus.log_query import LogQuery
from edgebus.page import Cursor, Page, next_window_days
from schemas.tables import LOGS_PARTITION_BY, LOGS_SCHEMA

UTC = dt.UTC
DAY0 = dt.datetime(2024, 3, 1, tzinfo=UTC)
# Days with rows (others are gaps); day 9 has many rows sharing one timestamp.
DAYS = [0, 1, 4, 5, 6, 9, 13, 14]


def rows() -> list[dict[str, Any]]:
    rng = random.Random(7)
    out = []
    seq = itertools.count(1)
    for day in DAYS:
        for _i in range(rng.randint(1, 9)):
            ts = DAY0 + dt.timedelta(days=day, seconds=rng.randint(0, 86_399))
            out.append(log_row("acme", ts, rng.choice(["edge-a", "edge-b"]), next(seq)))
    same = DAY0 + dt.timedelta(days=9, hours=12)
    out += [log_row("acme", same, f"edge-{'ab'[i % 2]}", next(seq)) for i in range(12)]
    out.append(log_row("other", DAY0 + dt.timedelta(days=20), "edge-a", next(seq)))
    return out


ROWS = rows()


@pytest.fixture(scope="module")
def delta(tmp_path_factory: pytest.TempPathFactory) -> DeltaTable:
    path = tmp_path_factory.mktemp("lake") / "logs"
    writer = DeltaBatchWriter(path, "edgebus.logs", LOGS_SCHEMA, LOGS_PARTITION_BY)
    writer.write(0, pa.Table.from_pylist(ROWS[::2], schema=LOGS_SCHEMA))
    writer.write(1, pa.Table.from_pylist(ROWS[1::2], schema=LOGS_SCHEMA))
    return DeltaTable(str(path))


def expected(query: LogQuery) -> list[tuple[str, int]]:
    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        return (row["ts"], row["node"], row["seq"])

    kept = [
        row
        for row in ROWS
        if row["tenant"] == query.tenant
        and (query.since is None or row["ts"] >= query.since)
        and (query.until is None or row["ts"] < query.until)
    ]
    kept.sort(key=key, reverse=not query.oldest_first)
    if query.after is not None:
        after = query.after
        kept = [
            row
            for row in kept
            if (Cursor.of(row) > after if query.oldest_first else Cursor.of(row) < after)
        ]
    return [(row["node"], row["seq"]) for row in kept[: query.limit]]


def one_query(delta: DeltaTable, query: LogQuery) -> list[tuple[str, int]]:
    """The page as a single query over every day (what the windows must reproduce)."""
    found = lake_command.query(delta, log_query.QUERY_TABLE, query.sql(query.limit))
    return [(row["node"], row["seq"]) for row in found]


BOUNDS = [
    (None, None),
    (DAY0 + dt.timedelta(days=2), None),
    (None, DAY0 + dt.timedelta(days=9, hours=12)),
    (DAY0 + dt.timedelta(days=1, hours=3), DAY0 + dt.timedelta(days=13, hours=1)),
    (DAY0 + dt.timedelta(days=7), DAY0 + dt.timedelta(days=8)),  # a gap: nothing
]


@pytest.mark.parametrize("oldest_first", [False, True])
@pytest.mark.parametrize("limit", [1, 2, 5, 13, 100])
@pytest.mark.parametrize(("since", "until"), BOUNDS)
def test_windows_give_one_querys_rows(
    delta: DeltaTable,
    oldest_first: bool,
    limit: int,
    since: dt.datetime | None,
    until: dt.datetime | None,
) -> None:
    query = LogQuery("acme", since, until, oldest_first=oldest_first, limit=limit)
    assert [(r["node"], r["seq"]) for r in log_query.fetch(delta, query)] == expected(query)
    assert one_query(delta, query) == expected(query)


@pytest.mark.parametrize("oldest_first", [False, True])
@pytest.mark.parametrize("limit", [1, 3, 7])
def test_paging_through_every_row(delta: DeltaTable, oldest_first: bool, limit: int) -> None:
    query = LogQuery("acme", oldest_first=oldest_first, limit=limit)
    seen: list[tuple[str, int]] = []
    while True:
        page = log_query.fetch(delta, query)
        seen += [(row["node"], row["seq"]) for row in page]
        if len(page) < limit:
            break
        query = LogQuery("acme", oldest_first=oldest_first, limit=limit, after=Cursor.of(page[-1]))
    everything = LogQuery("acme", oldest_first=oldest_first, limit=len(ROWS))
    assert seen == expected(everything)
    assert len(seen) == len(set(seen)) == len(ROWS) - 1  # every acme row, once


def test_windows_follow_the_pages_order_and_range() -> None:
    days = [dt.date(2024, 3, 1) + dt.timedelta(days=d) for d in range(10)]
    newest = Page("acme").days_in_order(days)
    assert newest == sorted(days, reverse=True)
    assert Page("acme", oldest_first=True).days_in_order(days) == days
    bounded = Page(
        "acme", since=DAY0 + dt.timedelta(days=2, hours=6), until=DAY0 + dt.timedelta(days=4)
    )
    assert bounded.days_in_order(days) == [days[3], days[2]]  # until is exclusive
    # A window is whole days, cut to the page's own bounds.
    assert bounded.window([days[3], days[2]]) == (bounded.since, bounded.until)
    assert Page("acme").window([days[0]]) == (DAY0, DAY0 + dt.timedelta(days=1))


@pytest.mark.parametrize(
    ("days_read", "rows_found", "rows_wanted", "expected"),
    [
        (1, 0, 100, 1),  # no row yet: no rate, the windows double
        (2, 0, 100, 2),
        (4, 0, 100, 4),
        (1, 60, 100, 1),  # 40 more at 60 a day: one day (with half again as margin)
        (1, 30, 100, 4),  # 70 more at 30 a day: 3.5 days
        (1, 4, 100, 36),  # rare rows: the rest in one window
        (3, 99, 100, 1),
    ],
)
def test_next_window_is_sized_from_the_rate_so_far(
    days_read: int, rows_found: int, rows_wanted: int, expected: int
) -> None:
    assert next_window_days(days_read, rows_found, rows_wanted) == expected
