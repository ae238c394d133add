"""Retention of history: delete a table's partitions older than each tenant's cutoff.

Theory of operation: ``logs`` and ``messages`` are partitioned by ``tenant`` and ``date``, so
history expires a whole partition at a time. The cutoffs come decided (:class:`Retention`: the
first date each tenant keeps; :mod:`streaming.maintenance` computes them from the settings and
the tenants file); :func:`expired_partitions` finds the partitions dated before them in the
table's log (delta-rs, no Spark job), and :func:`delete_expired` deletes them all with one Delta
``DELETE`` through Spark whose predicate names partition columns only. Delta then removes whole
files and rewrites none (no deletion vector either), so:

- the latest version, and every reader of it (Spark, ``edgebus logs``/``sql``, delta-rs,
  DuckDB...), no longer has the rows; older versions still do (time travel) until vacuum
  deletes the files, after its own retention, as for any file a commit removed;
- the table's history records what went: the ``DELETE`` commit's predicate names every tenant
  and cutoff, its ``operationMetrics`` the rows and files (see :func:`delete_expired`).

A table with no expired partition gets no commit at all.

Concurrency: the streams append to today's partitions, which the predicate never matches, so
the ``DELETE`` and the appends do not conflict. A late record written into an expired partition
while the ``DELETE`` runs either survives it (a blind append the delete never read) or makes it
fail (then maintenance logs it and retries at its next run); either way the next run deletes it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

# The partition columns retention works on (``messages`` and ``logs`` both have them).
TENANT = "tenant"
DATE = "date"


@dataclass(frozen=True, slots=True)
class Retention:
    """The first date each tenant keeps: rows dated before it go. None: kept forever.

    ``tenants`` holds the tenants with their own cutoff; every other tenant has ``default``.
    """

    default: date | None
    tenants: Mapping[str, date | None] = field(default_factory=dict)

    def cutoff(self, tenant: str) -> date | None:
        return self.tenants.get(tenant, self.default)


@dataclass(frozen=True, slots=True)
class Expiry:
    """One tenant's partitions dated before ``before``: to delete (or deleted)."""

    tenant: str
    before: date
    dates: tuple[date, ...]  # the partitions' dates, oldest first
    files: int
    rows: int  # from the files' statistics

    @property
    def partitions(self) -> int:
        return len(self.dates)


def expired_partitions(actions: pa.Table, retention: Retention) -> tuple[Expiry, ...]:
    """The partitions that ``retention`` expires among a snapshot's add ``actions`` (delta-rs
    ``get_add_actions(flatten=True)``), one :class:`Expiry` per tenant (sorted by tenant); ()
    when the table is not partitioned by tenant and date."""
    if {f"partition.{TENANT}", f"partition.{DATE}"} - set(actions.column_names):
        return ()
    tenants = actions.column(f"partition.{TENANT}").to_pylist()
    dates = actions.column(f"partition.{DATE}").to_pylist()
    rows = actions.column("num_records").to_pylist()
    found: dict[str, tuple[set[date], int, int]] = {}
    for tenant, value, count in zip(tenants, dates, rows, strict=True):
        day = as_date(value)
        cutoff = retention.cutoff(tenant)
        if cutoff is None or day >= cutoff:
            continue
        days, files, total = found.get(tenant, (set(), 0, 0))
        days.add(day)
        found[tenant] = (days, files + 1, total + (count or 0))
    return tuple(
        Expiry(tenant, cutoff, tuple(sorted(days)), files, total)
        for tenant, (days, files, total) in sorted(found.items())
        if (cutoff := retention.cutoff(tenant)) is not None
    )


def as_date(value: object) -> date:
    """A partition's ``date`` value as delta-rs gives it (a date, or its ISO text)."""
    return value if isinstance(value, date) else date.fromisoformat(str(value))


def predicate(expired: Sequence[Expiry]) -> str:
    """The SQL condition of the partitions in ``expired``: tenants grouped by cutoff, so a
    thousand tenants on the default make one ``IN`` list, not a thousand terms."""
    by_cutoff: dict[date, list[str]] = {}
    for expiry in expired:
        by_cutoff.setdefault(expiry.before, []).append(expiry.tenant)
    terms = []
    for cutoff, tenants in sorted(by_cutoff.items()):
        names = ", ".join("'" + tenant.replace("'", "''") + "'" for tenant in sorted(tenants))
        terms.append(f"(`{TENANT}` IN ({names}) AND `{DATE}` < DATE '{cutoff.isoformat()}')")
    return " OR ".join(terms)


def delete_expired(
    spark: SparkSession, target: str, expired: Sequence[Expiry]
) -> Mapping[str, str]:
    """Delete the partitions in ``expired`` from the Delta table at ``target`` (a Spark URI)
    in one commit; that commit's ``operationMetrics`` (``numDeletedRows``,
    ``numRemovedFiles``, ``numAddedFiles``, ``numDeletionVectorsAdded``...)."""
    from delta.tables import DeltaTable as SparkDeltaTable

    if not expired:
        return {}
    table = SparkDeltaTable.forPath(spark, target)
    table.delete(predicate(expired))
    name = target.rstrip("/").rsplit("/", 1)[-1]
    for expiry in expired:
        logger.info(
            "%s: deleted %d rows of %s older than %s for tenant %s (%d partitions, %d files)",
            target,
            expiry.rows,
            name,
            expiry.before,
            expiry.tenant,
            expiry.partitions,
            expiry.files,
        )
    # The streams may have committed since: the newest DELETE is this one (only maintenance,
    # one run at a time, deletes).
    row = table.history(20).where("operation = 'DELETE'").select("operationMetrics").first()
    metrics = dict(row["operationMetrics"] or {}) if row is not None else {}
    logger.info("%s: retention DELETE committed: %s", target, metrics)
    return metrics
