"""What ``edgebus usage`` and the REST API (``GET /usage``, ``GET /quota``) ask of the ``usage``
and ``quota_events`` tables.

Reads through delta-rs (see :mod:`edgebus.lake_command`), each naming the partition columns so
only the tenant's files are opened:

- ``usage`` (``tenant = T AND date = D``): per metric the day's last one-minute window, whose
  ``day_value`` is the running day total (a gauge's: the day's peak) through that minute.
- ``quota_events`` (``tenant = T AND date <= D``): per quota metric the latest recorded state
  (:func:`streaming.quota.load_recorded`). A state holds until the next change, which may be
  days old, so earlier days count; the day's usage of the counter that measures it is shown
  beside it.
- ``quota_events`` again for the history: every change of the tenant's states in a time
  range, newest first.

Usage metrics and quota metrics name each other in every answer: a counter row's
``quota_metric`` is the quota metric it counts (``messages_in``: ``messages_per_day``; null for
the others), a quota row's ``usage_metric`` the counter that measures it. Both come from the
metric's name (``schemas.names``), so rows written before the tables had those columns say
it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from edgebus import lake_command
from edgebus.lake_command import CommandError, iso, sql_date, sql_string, sql_timestamp
from schemas.names import COUNTED_QUOTAS, QUOTA_METRICS
from sinks.storage import LakePath

if TYPE_CHECKING:
    from deltalake import DeltaTable

TABLE = "usage"
QUOTA_TABLE = "quota_events"
# The name the usage table is registered under in UsageQuery.usage_sql.
QUERY_TABLE = "usage"
HISTORY_COLUMNS = ("metric", "limit", "value", "state", "decided_at", "batch_id")

# A table of the lake by name, None when the pipeline has not created it yet: the commands open
# it afresh (lake_command.open_table), a server keeps it open.
OpenTable = Callable[[str], "DeltaTable | None"]


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
    """Counter rows and quota rows (``usage``: the day's usage of the measuring counter;
    ``value``: the usage when the state was decided); ``notes`` say what is missing."""

    tenant: str
    day: date
    counters: list[dict[str, Any]] = field(default_factory=list)
    quota: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_usage(
    lake: LakePath, query: UsageQuery, open_table: OpenTable | None = None
) -> TenantUsage:
    """The tenant's counters and quota state, or :class:`CommandError`; ``notes`` say what is
    missing (no table yet, nothing for this tenant)."""
    from streaming.quota import load_recorded

    result = TenantUsage(query.tenant, query.day)
    opener = open_table or partial(lake_command.open_table, lake)
    usage = opener(TABLE)  # also: no lake at all is an error
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
                "usage_metric": QUOTA_METRICS.get(event.metric),
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


def usage_doc(result: TenantUsage) -> dict[str, Any]:
    """The result as JSON: tenant, date, counters and quota (times ISO 8601 UTC)."""
    return {
        "tenant": result.tenant,
        "date": result.day.isoformat(),
        "counters": [
            {
                "metric": row["metric"],
                "quota_metric": COUNTED_QUOTAS.get(row["metric"]),
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


@dataclass(frozen=True, slots=True)
class QuotaHistory:
    """The changes of ``tenant``'s quota states decided in ``[since, until)``, newest first."""

    tenant: str
    since: datetime | None = None
    until: datetime | None = None
    limit: int = 100

    def sql(self) -> str:
        """Over the table registered as :data:`QUOTA_TABLE`; the ``date`` bounds prune files."""
        where = [f"tenant = {sql_string(self.tenant)}"]
        if self.since is not None:
            where.append(f"date >= {sql_date(self.since.date())}")
            where.append(f"decided_at >= {sql_timestamp(self.since)}")
        if self.until is not None:
            where.append(f"date <= {sql_date((self.until - timedelta(microseconds=1)).date())}")
            where.append(f"decided_at < {sql_timestamp(self.until)}")
        columns = ", ".join(f'"{name}"' for name in HISTORY_COLUMNS)
        # Every value is a quoted literal or a formatted date/time: no injection.
        return (
            f"SELECT {columns} FROM {QUOTA_TABLE} WHERE {' AND '.join(where)} "  # noqa: S608
            f"ORDER BY decided_at DESC, batch_id DESC, metric LIMIT {self.limit}"
        )


def quota_history(quota: DeltaTable | None, query: QuotaHistory) -> list[dict[str, Any]]:
    """The rows of ``query`` as JSON objects ([] without a ``quota_events`` table)."""
    if quota is None:
        return []
    rows = lake_command.query(quota, QUOTA_TABLE, query.sql())
    return [
        {
            **row,
            "usage_metric": QUOTA_METRICS.get(row["metric"]),
            "decided_at": iso(row["decided_at"]),
        }
        for row in rows
    ]
