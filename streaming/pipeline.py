"""The pipeline: one streaming query over every node's journal, feeding every table.

Theory of operation
-------------------
The ``edgebus`` source replays the journals by offset (``ingest.source``). One query reads them
and, per micro-batch, :class:`TableFanout` (the ``foreachBatch`` function) does this, with
every row staying on the executors:

1. The batch arrives routed: the query reads the journals through
   :class:`streaming.route.RoutedJournal`, which runs the record contract and each table's pure
   step in the executors' Python workers as they read, and streams the ``messages`` rows.
2. ``messages`` is written from them by Spark's Delta writer (``sinks.delta``) in the same
   pass: nothing is persisted, and the commit's file statistics say how many rows it holds.
3. Only when that is fewer than the batch's records (its offsets, from the checkpoint, say how
   many) does the batch have other rows: a second, batch read of the same journal range
   (:func:`streaming.route.read_others`) brings every other destination's rows (log events,
   counter records, quarantined records: only they cross to the JVM), persisted while
   ``usage`` (an upsert, :mod:`streaming.usage`) and the quota step (``quota_events`` and the
   decisions to the edges) take their share, and beside them, in threads of their own, the
   ``logs`` and ``quarantine`` appends (each table's commit is its own transaction).

Each node's last seq in the batch is its end offset; nothing is counted on the driver.

Exactly once: every table's writer commits its rows with the Delta app transaction ``(app_id,
batch_id)`` in the same commit (``txnAppId``/``txnVersion``). Spark logs a batch's offsets
before running it and marks it done after ``foreachBatch`` returns, so a crash anywhere in
between replays the same batch with the same records, and each table skips it if it has it
already: tables committed before the crash are left alone, the others are written. The quota
step runs after the usage commit, so its decisions always see the usage that caused them.

Only small results reach the driver: the per-destination counts of the second read, the usage
step's day totals per tenant and metric, the quota step's decisions. The
driver's memory does not grow with the batch (BENCHMARKS.md, issue 18).

Retention (issue 9): once every table has committed a batch *and* Spark has marked it done in
the checkpoint (``commits/{batch_id}``), each node's last seq in it is what the lake holds of
that node's journal for good: no replay will ask for those records again. With edges to tell
(``--broker`` and the operator token: the quota settings', or without a tenants file the
edge's own from the data dir, ``schemas.operator_token``) it goes to them retained on
``$control/journal/{node}``, and each edge deletes the journal segments the lake has. Spark
marks a batch done after ``foreachBatch`` returns, so a batch's notice goes out when the next
batch starts (or when the query stops), never from inside its own ``foreachBatch``: a crash
between the two would replay a batch whose records an edge had already deleted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import date
from typing import TYPE_CHECKING, cast

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 (pyspark's own convention)
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import ArrayType

from ingest.source import Offset, checkpointed_offset
from sinks.delta import DeltaTableWriter, spark_schema
from sinks.mqtt import DecisionPublisher
from sinks.quarantine import quarantine_writer
from streaming import route
from streaming.errors import PipelineError
from streaming.history import messages_writer
from streaming.job import check_checkpoint, journal_options, journal_stream, start_query
from streaming.logs import logs_writer
from streaming.maintenance import MaintenanceSchedule, spark_maintainer
from streaming.metrics import PipelineMetrics
from streaming.quality import QualitySchedule
from streaming.quota_settings import NoticeSettings, QuotaSettings
from streaming.schedule import IntervalSchedule
from streaming.session import build_spark, use_lake
from streaming.settings import PipelineSettings
from streaming.usage import UsageStep

if TYPE_CHECKING:
    from streaming.quota import QuotaEvent

logger = logging.getLogger(__name__)

# The query's name and checkpoint directory (``{lake}/_checkpoints/journal``).
JOB = "journal"
QUARANTINE_TABLE = "quarantine"

# How often a long run checks whether the query failed (a set stop event is seen at once).
POLL_SECONDS = 0.5
# Journal notices go to the edges at most this often while the query runs (and when it stops):
# retention works in hours, and each delivery is a connection the edges log and journal.
NOTICE_INTERVAL_SECONDS = 10.0
# How long stopping waits for a running micro-batch to finish before interrupting it.
STOP_GRACE_SECONDS = 30.0


class TableFanout:
    """The ``foreachBatch`` function: one micro-batch of journal records into every table."""

    def __init__(
        self,
        settings: PipelineSettings,
        quota: QuotaSettings | None,
        notices: NoticeSettings | None = None,
        edge_token: str | None = None,
        metrics: PipelineMetrics | None = None,
    ) -> None:
        self.metrics = metrics
        self._checkpoint = settings.checkpoint_path(JOB)
        self._commits = self._checkpoint / "commits"
        # The journal source's options, for a batch's second read (its other tables' rows).
        self._journals = journal_options(settings, edge_token)
        # A batch's last seq per node, until Spark has marked the batch done.
        self._pending: tuple[int, dict[str, int]] | None = None
        self._noticed_at = -NOTICE_INTERVAL_SECONDS  # monotonic time of the last notices
        # The appends, in the order they commit: ``messages`` first (what analysts wait for).
        self.appends: dict[str, DeltaTableWriter] = {
            route.MESSAGES: messages_writer(settings),
            route.LOGS: logs_writer(settings),
        }
        # One connection per edge for the quota decisions and the journal notices.
        edges = quota if quota is not None else notices
        self.publisher = (
            DecisionPublisher(
                edges.brokers, edges.operator_token, timeout=edges.publish_timeout_seconds
            )
            if edges is not None
            else None
        )
        self.usage = UsageStep(settings, quota, self.publisher)
        self.quarantine = quarantine_writer(settings.table_path(QUARANTINE_TABLE))
        # The small tables' appends, beside the usage step (see ``_others``).
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="append")

    @property
    def writers(self) -> list[DeltaTableWriter]:
        return [*self.appends.values(), *self.usage.writers, self.quarantine]

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        self.send_notices(now=time.monotonic())  # the previous batch is marked done now
        started = time.monotonic()
        timings: dict[str, float] = {}

        def lap(step: str) -> None:
            timings[step] = time.monotonic() - started - sum(timings.values())

        # The range Spark logged for this batch before running it: a replay reads the same.
        start = checkpointed_offset(self._checkpoint, batch_id - 1)
        end = checkpointed_offset(self._checkpoint, batch_id)
        ends = {node: seq for node, seq in end.items() if seq > start.get(node, 0)}
        records = sum(seq - start.get(node, 0) for node, seq in ends.items())  # at most
        # The messages straight from the read: the batch's one pass when it holds nothing else.
        written = self.appends[route.MESSAGES].append(batch_id, _share(batch, route.MESSAGES))
        counts = {route.MESSAGES: written}
        lap(route.MESSAGES)
        if written is not None and written >= records:
            decided = self.usage(batch.sparkSession, batch_id, None, set())
        else:  # other rows, or a replay: every other table from a second read of the range
            others, decided = self._others(batch.sparkSession, batch_id, start, end, lap, timings)
            counts |= others
        logger.info(
            "batch %d: %s rows; %s",
            batch_id,
            counts,
            ", ".join(f"{step} {seconds:.2f} s" for step, seconds in timings.items()),
        )
        if self.metrics is not None:
            self.metrics.batch_done(counts, timings, ends, time.monotonic() - started)
            self.metrics.quota_decided(decided)
        self.batch_ended(batch_id, ends)

    def _others(
        self,
        spark: SparkSession,
        batch_id: int,
        start: Offset,
        end: Offset,
        lap: Callable[[str], None],
        timings: dict[str, float],
    ) -> tuple[dict[str, int], list[QuotaEvent]]:
        """Every table but ``messages`` from the batch's range read again, where only their
        rows cross to the JVM (persisted: several tables take their share). Their row counts,
        and the quota decisions the usage step made.

        The ``logs`` and ``quarantine`` appends run in threads of their own beside the usage
        upsert and the quota step: each is its own table's Delta transaction, so their order
        does not matter, and most of what a small table's commit costs is waiting (the
        driver's log reads and writes, a job's scheduling), not the cores."""
        others = route.read_others(spark, self._journals, start, end)
        others = others.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            counts: dict[str, int] = {}
            touched: set[tuple[str, date]] = set()  # the usage partitions of the counters
            for row in (
                others.groupBy("dest", "tenant", "date").agg(F.count("*").alias("n")).collect()
            ):
                counts[row["dest"]] = counts.get(row["dest"], 0) + row["n"]
                if row["dest"] == route.COUNTERS:
                    touched.add((row["tenant"], row["date"]))
            lap("others")
            small = ((route.LOGS, self.appends[route.LOGS]), (route.QUARANTINE, self.quarantine))
            pending = {
                dest: self._pool.submit(_timed, writer.append, batch_id, _share(others, dest))
                for dest, writer in small
                if counts.get(dest)
            }
            try:
                counters = _share(others, route.COUNTERS) if counts.get(route.COUNTERS) else None
                decided = self.usage(spark, batch_id, counters, touched)
                lap("usage")
            finally:
                # Every append ends (or fails) before the rows are unpersisted, whichever fails.
                wait(pending.values())
            for dest, future in pending.items():
                timings[dest] = future.result()[1]  # an append's failure is raised here
        finally:
            others.unpersist()
        return counts, decided

    def close(self) -> None:
        """The query has stopped: no batch runs, so no append is in flight."""
        self._pool.shutdown(wait=True)

    def batch_ended(self, batch_id: int, ends: dict[str, int]) -> None:
        """Batch ``batch_id`` is in every table, with each node's last seq in ``ends``: its
        notices go out once Spark marks it done. Nodes of earlier batches whose notices still
        wait (the interval) keep their seq: once this batch is marked done, so are they."""
        waiting = self._pending[1] if self._pending is not None else {}
        self._pending = (batch_id, {**waiting, **ends})

    def send_notices(self, *, now: float | None = None) -> None:
        """Tell the edges how far the lake holds each node's journal, for the last batch Spark
        has marked done (``$control/journal/{node}``, retained); nothing without edges.

        At most once every NOTICE_INTERVAL_SECONDS (``now=None``: now, whatever the interval,
        when the query stops): each delivery's connect and disconnect are log events the edge
        journals, so a notice per batch would make every notice start a batch of its own.
        """
        if self._pending is None or self.publisher is None or not self.publisher.brokers:
            return
        batch_id, ends = self._pending
        if not (self._commits / str(batch_id)).exists():
            return  # not marked done yet: a replay could still need these records
        if now is not None and now - self._noticed_at < NOTICE_INTERVAL_SECONDS:
            return
        self._noticed_at = time.monotonic() if now is None else now
        self._pending = None
        for node, seq in sorted(ends.items()):
            # Errors are logged; the next batch's notice (a higher seq) supersedes this one.
            self.publisher.publish_committed(node, seq)


def _timed(
    append: Callable[[int, DataFrame], int | None], batch_id: int, rows: DataFrame
) -> tuple[int | None, float]:
    """``append(batch_id, rows)`` and how long it took (run in a pool thread)."""
    began = time.monotonic()
    return append(batch_id, rows), time.monotonic() - began


def _share(routed: DataFrame, dest: str) -> DataFrame:
    """The routed rows for ``dest`` with that destination's columns (``user_properties``
    parsed back from its JSON text on the wire): the stream's rows for ``messages`` (all of
    them), a second read's rows with ``dest`` naming the table for the others."""
    schema = route.DESTINATIONS[dest]
    columns = [
        route.from_wire(F.col(name), cast(ArrayType, spark_schema(schema)[name].dataType)).alias(
            name
        )
        if name == route.WIRE_COLUMN
        else F.col(f"`{name}`")
        for name in schema.names
    ]
    if dest != route.MESSAGES:
        routed = routed.where(F.col("dest") == dest)
    return routed.select(*columns)


def start(
    spark: SparkSession,
    settings: PipelineSettings,
    quota: QuotaSettings | None = None,
    edge_token: str | None = None,
) -> StreamingQuery:
    """Start the journal query on ``spark`` (with the quota step when ``quota`` is given).

    With or without ``quota`` it is the same query (name, checkpoint, app ids), so quota
    enforcement can be switched on and off across restarts. ``edge_token`` is the bearer
    token for ``settings.edges`` (the operator token).
    """
    return _start(spark, settings, quota, edge_token=edge_token)[0]


def _start(
    spark: SparkSession,
    settings: PipelineSettings,
    quota: QuotaSettings | None,
    notices: NoticeSettings | None = None,
    edge_token: str | None = None,
    metrics: PipelineMetrics | None = None,
) -> tuple[StreamingQuery, TableFanout]:
    use_lake(spark, settings.lake)  # a caller's own session too
    checkpoint = settings.checkpoint_path(JOB)
    fanout = TableFanout(settings, quota, notices, edge_token, metrics)
    for writer in fanout.writers:
        check_checkpoint(checkpoint, writer)
    query = start_query(
        journal_stream(spark, settings, checkpoint, edge_token),
        job=JOB,
        sink=fanout,
        checkpoint=checkpoint,
        settings=settings,
    )
    logger.info(
        "started %s: %s%s -> %s (quota %s)",
        JOB,
        settings.journal_root,
        "".join(f", edge {edge}" for edge in settings.edges),
        settings.lake,
        "on" if quota is not None else "off",
    )
    return query, fanout


def run(
    settings: PipelineSettings,
    *,
    once: bool,
    stop: threading.Event | None = None,
    spark: SparkSession | None = None,
    quota: QuotaSettings | None = None,
    notices: NoticeSettings | None = None,
    edge_token: str | None = None,
    metrics: PipelineMetrics | None = None,
) -> None:
    """Run the journal query (with the quota step when ``quota`` is given).

    The journal notices go to the edges of ``quota``, or without it to those of ``notices``.

    ``once``: process everything available now, then return. Otherwise run until ``stop`` is
    set (never, without one), re-raising the query's error if it fails; meanwhile the quality
    suites and the table maintenance run on their schedules (``quality_interval_seconds``,
    ``maintenance_interval_seconds``) in background threads. The session is built from
    ``settings`` and stopped at the end, unless the caller passes its own ``spark`` (then the
    caller owns and stops it). ``edge_token``: the bearer token for ``settings.edges``.
    ``metrics``: counted once per batch and per quality run (:mod:`streaming.metrics`; the
    caller serves them).
    """
    session = spark if spark is not None else build_spark(settings)
    query: StreamingQuery | None = None
    fanout: TableFanout | None = None
    schedules: list[IntervalSchedule] = []
    try:
        query, fanout = _start(session, settings, quota, notices, edge_token, metrics)
        if once:
            query.processAllAvailable()
            logger.info("%s: caught up", query.name)
        else:
            schedules = [
                QualitySchedule.from_settings(
                    session, settings, on_results=metrics.quality_ran if metrics else None
                ),
                MaintenanceSchedule(settings, spark_maintainer(session)),
            ]
            _wait(query, stop if stop is not None else threading.Event(), schedules)
    finally:
        try:
            if query is not None:
                _stop_gracefully(query)
            if fanout is not None:
                fanout.send_notices()  # the last batch, if Spark marked it done
                fanout.close()
            for schedule in schedules:
                # A run in flight finishes its Delta commit before the process goes on.
                schedule.close(timeout=STOP_GRACE_SECONDS)
        finally:
            if spark is None:
                session.stop()


def _wait(query: StreamingQuery, stop: threading.Event, schedules: list[IntervalSchedule]) -> None:
    while not stop.wait(POLL_SECONDS):
        if not query.isActive:
            # Raises the query's StreamingQueryException when it failed.
            query.awaitTermination()
            raise PipelineError(f"streaming query {query.name} stopped without an error")
        now = time.monotonic()
        for schedule in schedules:
            schedule.maybe_run(now)
    logger.info("stop requested, stopping %s", query.name)


def _stop_gracefully(query: StreamingQuery) -> None:
    """Let a running micro-batch finish (bounded), then stop the query.

    Interrupting a batch is safe (its Delta commits are atomic and replays are skipped) but
    wastes the work; waiting for the trigger to end avoids that in the common case.
    """
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while query.isActive and query.status["isTriggerActive"] and time.monotonic() < deadline:
        time.sleep(0.05)  # Spark exposes no "batch finished" event to Python: poll.
    query.stop()
    logger.info("%s: stopped", query.name)
