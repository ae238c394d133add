"""Table maintenance on a schedule, off the streaming path.

The pipeline's loop calls :meth:`MaintenanceSchedule.maybe_run` with the monotonic clock every
time it polls its queries (:mod:`streaming.schedule`). Every ``maintenance_interval_seconds``
one background thread maintains every table of the lake in turn
(:func:`sinks.maintenance.maintain_table`): the streams never wait for a compaction. A table
that does not exist yet is skipped; a table whose maintenance fails is logged and tried again
at the next run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from schemas.tables import TABLES
from sinks.maintenance import MaintenanceReport, describe, maintain_table
from sinks.storage import LakePath
from sinks.upsert import table_exists
from streaming.schedule import IntervalSchedule
from streaming.settings import PipelineSettings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

# What maintains one table: its path and the vacuum retention in hours (tests inject a fake).
Maintainer = Callable[[LakePath, float], MaintenanceReport]


def spark_maintainer(spark: SparkSession) -> Maintainer:
    """Maintains tables with Spark's Delta on a session of its own (same SparkContext), so
    its SQL settings never mix with the stream's."""
    session = spark.newSession()

    def maintain(path: LakePath, retention_hours: float) -> MaintenanceReport:
        return maintain_table(session, path, vacuum_retention_hours=retention_hours)

    return maintain


class MaintenanceSchedule(IntervalSchedule):
    """Maintains every table of the lake every ``settings.maintenance_interval_seconds``.

    See :class:`~streaming.schedule.IntervalSchedule` for when (0: never) and how: off-thread,
    one run at a time. ``maintain`` does one table (:func:`spark_maintainer`; tests inject
    their own).
    """

    def __init__(
        self,
        settings: PipelineSettings,
        maintain: Maintainer,
        tables: Iterable[str] = TABLES,
    ) -> None:
        super().__init__("maintenance", settings.maintenance_interval_seconds)
        self._settings = settings
        self._tables = tuple(tables)
        self._maintain = maintain

    def run_once(self) -> list[MaintenanceReport]:
        """Maintain every existing table now, in this thread; the reports of those that worked.

        A table whose maintenance fails is logged and skipped: the others still get theirs,
        and the next run tries it again.
        """
        reports = []
        retention = self._settings.vacuum_retention_hours
        for table in self._tables:
            path = self._settings.table_path(table)
            try:
                if not table_exists(path):
                    logger.debug("%s: no table yet, nothing to maintain", path)
                    continue
                report = self._maintain(path, retention)
            # Any error: one table's trouble must not cost the others their maintenance.
            except Exception:
                logger.exception("%s: maintenance failed, retrying at the next run", path)
                continue
            logger.info("maintained %s", describe(report))
            reports.append(report)
        return reports
