"""Table maintenance on a schedule, off the streaming path.

The pipeline's loop calls :meth:`MaintenanceSchedule.maybe_run` with the monotonic clock every
time it polls its queries (:mod:`streaming.schedule`). Every ``maintenance_interval_seconds``
one background thread maintains every table of the lake in turn
(:func:`sinks.maintenance.maintain_table`): the streams never wait for a compaction. A table
that does not exist yet is skipped; a table whose maintenance fails is logged and tried again
at the next run.

Retention (``logs``, ``messages``): each run decides every tenant's cutoff from the current UTC
date (:func:`table_retention`): a table keeping N days keeps today and the N whole days before
it, so no row goes before it is N days old; rows dated earlier are deleted (within a day after
they turn N days old, at the first run of a new UTC day). A tenant's own days come from the
tenants file, read afresh every run; a tenant without them, or not in the file, keeps the
``[pipeline]`` default; 0 days keeps history forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, date, timedelta
from typing import TYPE_CHECKING

from schemas.names import RETENTION_DAYS
from schemas.tables import TABLES
from sinks.maintenance import MaintenanceReport, describe, maintain_table
from sinks.retention import Retention
from sinks.storage import LakePath
from sinks.upsert import table_exists
from streaming.quota_settings import Clock, utc_now
from streaming.schedule import IntervalSchedule
from streaming.settings import PipelineSettings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

# What maintains one table: its path, the vacuum retention in hours and the tenants' cutoffs
# (None: history is kept). Tests inject a fake.
Maintainer = Callable[[LakePath, float, Retention | None], MaintenanceReport]

# Tenant -> table -> whole days of history besides today (the tenants file's
# ``logs_retention_days`` / ``messages_retention_days``), read afresh on every call.
RetentionLoader = Callable[[], Mapping[str, Mapping[str, int]]]


def spark_maintainer(spark: SparkSession) -> Maintainer:
    """Maintains tables with Spark's Delta on a session of its own (same SparkContext), so
    its SQL settings never mix with the stream's."""
    session = spark.newSession()

    def maintain(
        path: LakePath, retention_hours: float, retention: Retention | None
    ) -> MaintenanceReport:
        return maintain_table(
            session, path, vacuum_retention_hours=retention_hours, retention=retention
        )

    return maintain


def table_retention(
    table: str,
    settings: PipelineSettings,
    tenants: Mapping[str, Mapping[str, int]],
    today: date,
) -> Retention | None:
    """The cutoffs of ``table`` on ``today`` (UTC): ``settings``' days for every tenant,
    ``tenants``' own where given. None: the table keeps everything (or has no retention)."""
    key = RETENTION_DAYS.get(table)
    if key is None:
        return None

    def cutoff(days: int) -> date | None:
        return None if days == 0 else today - timedelta(days=days)

    own = {tenant: cutoff(days[table]) for tenant, days in tenants.items() if table in days}
    default = cutoff(getattr(settings, key))
    if default is None and not any(own.values()):
        return None
    return Retention(default, own)


class MaintenanceSchedule(IntervalSchedule):
    """Maintains every table of the lake every ``settings.maintenance_interval_seconds``.

    See :class:`~streaming.schedule.IntervalSchedule` for when (0: never) and how: off-thread,
    one run at a time. ``maintain`` does one table (:func:`spark_maintainer`; tests inject
    their own). ``tenants``: the tenants' own retention days (None: every tenant keeps the
    settings' days); ``clock`` says what day it is.
    """

    def __init__(
        self,
        settings: PipelineSettings,
        maintain: Maintainer,
        tables: Iterable[str] = TABLES,
        *,
        tenants: RetentionLoader | None = None,
        clock: Clock = utc_now,
    ) -> None:
        super().__init__("maintenance", settings.maintenance_interval_seconds)
        self._settings = settings
        self._tables = tuple(tables)
        self._maintain = maintain
        self._load_tenants = tenants
        self._tenants: Mapping[str, Mapping[str, int]] | None = None if tenants else {}
        self._clock = clock

    def run_once(self) -> list[MaintenanceReport]:
        """Maintain every existing table now, in this thread; the reports of those that worked.

        A table whose maintenance fails is logged and skipped: the others still get theirs,
        and the next run tries it again.
        """
        reports = []
        hours = self._settings.vacuum_retention_hours
        today = self._clock().astimezone(UTC).date()
        tenants = self._current_tenants()
        for table in self._tables:
            path = self._settings.table_path(table)
            try:
                if not table_exists(path):
                    logger.debug("%s: no table yet, nothing to maintain", path)
                    continue
                retention = None
                if tenants is not None:
                    retention = table_retention(table, self._settings, tenants, today)
                report = self._maintain(path, hours, retention)
            # Any error: one table's trouble must not cost the others their maintenance.
            except Exception:
                logger.exception("%s: maintenance failed, retrying at the next run", path)
                continue
            logger.info("maintained %s", describe(report))
            reports.append(report)
        return reports

    def _current_tenants(self) -> Mapping[str, Mapping[str, int]] | None:
        """The tenants' own retention days, read afresh; the last good ones when the file
        cannot be read now; None (no retention this run) when it never could: the defaults
        would delete the history of a tenant that keeps more."""
        if self._load_tenants is None:
            return self._tenants
        try:
            self._tenants = dict(self._load_tenants())
        # Any error (a file being edited): the history must not pay for it.
        except Exception as exc:
            if self._tenants is None:
                logger.exception("retention skipped: cannot read the tenants' retention")
            else:
                logger.warning("retention: keeping the last tenants' retention read: %s", exc)
        return self._tenants
