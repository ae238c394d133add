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
3. The batch is handed to :class:`streaming.others.OtherTables`, whose thread writes every
   other table behind the stream (``logs``, ``quarantine``, the ``usage`` upsert and the quota
   step): when the ``messages`` commit holds fewer rows than the batch has records (its
   offsets, from the checkpoint, say how many), from a second, batch read of the journal range
   of every batch handed over since its last write. ``foreachBatch`` returns without waiting
   for it: the next batch of messages does not wait for the other tables' commits, which cost
   seconds whatever their rows (BENCHMARKS.md, issues 12 and 18).

Each node's last seq in the batch is its end offset; nothing is counted on the driver.

Exactly once: every table's writer commits its rows with the Delta app transaction ``(app_id,
batch_id)`` in the same commit. Spark logs a batch's offsets before running it and marks it
done after ``foreachBatch`` returns, so a crash before that replays the same batch with the
same records, and ``messages`` skips it if it has it already. The other tables keep their own
progress in the checkpoint directory and take up from there (:mod:`streaming.others`). The
quota step decides each batch as soon as ``messages`` has it, ahead of ``usage``, on what
``usage`` holds plus the batches it does not hold yet, counted on the driver
(:mod:`streaming.quota_lane`): its reaction waits for no other table.

Only small results reach the driver: the per-destination counts of the second read, the usage
step's day totals per tenant and metric, the quota step's decisions. The
driver's memory does not grow with the batch (BENCHMARKS.md, issue 18).

Upgrades in place: when the query starts, each table an older edgebus wrote gets the columns
of ``schemas/`` it lacks (:meth:`~sinks.delta.DeltaTableWriter.upgrade`: Delta's schema
evolution, one metadata commit, the rows written before null in them), before any batch, so
readers see them at once; the app transactions carry on, so the old lake continues exactly
once.

Retention (issue 9): once a batch is in every table *and* Spark has marked it done in the
checkpoint (``commits/{batch_id}``), each node's last seq in it is what the lake holds of that
node's journal for good: no replay will ask for those records again. With edges to tell
(``--broker`` and the operator token: the quota settings', or without a tenants file the
edge's own from the data dir, ``schemas.operator_token``) it goes to them retained on
``$control/journal/{node}``, and each edge deletes the journal segments the lake has. Spark
marks a batch done after ``foreachBatch`` returns, so notices go out when a later batch starts
(or when the query stops), never from inside the batch's own ``foreachBatch``: a crash between
the two would replay a batch whose records an edge had already deleted.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from ingest.source import checkpointed_offset
from sinks.delta import DeltaTableWriter
from sinks.mqtt import DecisionPublisher
from sinks.quarantine import quarantine_writer
from streaming import route
from streaming.errors import PipelineError
from streaming.history import messages_writer
from streaming.job import check_checkpoint, journal_options, journal_stream, start_query
from streaming.logs import logs_writer
from streaming.maintenance import MaintenanceSchedule, RetentionLoader, spark_maintainer
from streaming.metrics import PipelineMetrics
from streaming.others import OtherTables
from streaming.quality import QualitySchedule
from streaming.quota_lane import QuotaLane
from streaming.quota_settings import NoticeSettings, QuotaSettings
from streaming.schedule import IntervalSchedule
from streaming.session import build_spark, use_lake
from streaming.settings import PipelineSettings
from streaming.usage import UsageStep

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
    """The ``foreachBatch`` function: one micro-batch of journal records into ``messages``, then
    handed to :class:`OtherTables` for every other table."""

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
        # Batches in ``messages`` whose notices wait: (batch id, each node's last seq in it).
        self._pending: list[tuple[int, dict[str, int]]] = []
        self._noticed_at = -NOTICE_INTERVAL_SECONDS  # monotonic time of the last notices
        self._notices = threading.Lock()  # sent from the stream's thread and at the stop
        self.messages = messages_writer(settings)
        # One connection per edge for the quota decisions and the journal notices.
        edges = quota if quota is not None else notices
        self.publisher = (
            DecisionPublisher(
                edges.brokers, edges.operator_token, timeout=edges.publish_timeout_seconds
            )
            if edges is not None
            else None
        )
        journals = journal_options(settings, edge_token)
        usage = UsageStep(settings, quota, self.publisher)
        self.others = OtherTables(
            self._checkpoint,
            journals,
            {
                route.LOGS: logs_writer(settings),
                route.QUARANTINE: quarantine_writer(settings.table_path(QUARANTINE_TABLE)),
            },
            usage,
            metrics,
            settings.others_interval_seconds,
        )
        # The quota step decides ahead of the other tables (streaming.quota_lane).
        self.quota = (
            QuotaLane(usage.quota, self._checkpoint, journals, metrics) if usage.quota else None
        )

    @property
    def writers(self) -> list[DeltaTableWriter]:
        return [self.messages, *self.others.writers]

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        self.send_notices(now=time.monotonic())  # earlier batches may be done everywhere now
        started = time.monotonic()
        # The range Spark logged for this batch before running it: a replay reads the same.
        start = checkpointed_offset(self._checkpoint, batch_id - 1)
        end = checkpointed_offset(self._checkpoint, batch_id)
        ends = {node: seq for node, seq in end.items() if seq > start.get(node, 0)}
        records = sum(seq - start.get(node, 0) for node, seq in ends.items())  # at most
        if self.quota is not None:  # counted and decided beside the messages' write
            self.quota.hand(batch_id, start, end, records > 0)
        # The messages straight from the read: the batch's one pass.
        written = self.messages.append(batch_id, route.share(batch, route.MESSAGES))
        elapsed = time.monotonic() - started
        # Fewer rows than records (or a replay, None): other rows, for the tables behind.
        self.others.hand(batch_id, written is None or written < records)
        logger.info("batch %d: %s messages in %.2f s", batch_id, written, elapsed)
        if self.metrics is not None:
            self.metrics.batch_done(
                {route.MESSAGES: written}, {route.MESSAGES: elapsed}, ends, elapsed
            )
        self.batch_ended(batch_id, ends)

    def start(self, spark: SparkSession) -> None:
        """Before the query starts: the other tables take up where the last run left off,
        then the quota step from what ``usage`` holds."""
        self.others.start(spark)
        if self.quota is not None:
            self.quota.start(spark, self.others.usage_end())

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every batch the stream wrote is decided and in every other table."""
        if self.quota is not None:
            self.quota.drain(timeout)
        self.others.drain(timeout)

    def check(self) -> None:
        """Raise the quota step's or the other tables' failure, while no batch comes."""
        if self.quota is not None:
            self.quota.check()
        self.others.check()

    def close(self) -> None:
        """The query has stopped: the quota step and the other tables finish what they were
        handed, then the last notices go out."""
        try:
            if self.quota is not None:
                self.quota.close()
        finally:
            self.others.close()
        self.send_notices()

    def batch_ended(self, batch_id: int, ends: dict[str, int]) -> None:
        """Batch ``batch_id`` is in ``messages``, with each node's last seq in ``ends``: its
        notices go out once Spark marks it done and every other table holds it (kept only
        when there are edges to tell)."""
        if self.publisher is None or not self.publisher.brokers:
            return
        with self._notices:
            self._pending.append((batch_id, ends))

    def send_notices(self, *, now: float | None = None) -> None:
        """Tell the edges how far the lake holds each node's journal, for the last batch that
        Spark has marked done and every table holds (``$control/journal/{node}``, retained);
        nothing without edges.

        At most once every NOTICE_INTERVAL_SECONDS (``now=None``: now, whatever the interval,
        when the query stops): each delivery's connect and disconnect are log events the edge
        journals, so a notice per batch would make every notice start a batch of its own.
        Nodes of earlier batches keep their seq until a notice goes out.
        """
        if self.publisher is None or not self.publisher.brokers:
            return
        with self._notices:
            if now is not None and now - self._noticed_at < NOTICE_INTERVAL_SECONDS:
                return
            held = self.others.done_through()
            # Spark marks batches done in order: the newest marked one that every table holds.
            done = next(
                (
                    batch_id
                    for batch_id, _ in reversed(self._pending)
                    if batch_id <= held and (self._commits / str(batch_id)).exists()
                ),
                None,
            )
            if done is None:
                return  # not marked done yet, or not in every table: a replay could need them
            ends: dict[str, int] = {}
            for batch_id, batch_ends in self._pending:
                if batch_id <= done:
                    ends |= batch_ends
            self._pending = [entry for entry in self._pending if entry[0] > done]
            self._noticed_at = time.monotonic() if now is None else now
            for node, seq in sorted(ends.items()):
                # Errors are logged; the next notice (a higher seq) supersedes this one.
                self.publisher.publish_committed(node, seq)


class PipelineQuery:
    """The journal query and the tables written behind it, as a caller drives them: what
    Spark's ``StreamingQuery`` offers, where "processed" means in every table."""

    def __init__(self, query: StreamingQuery, fanout: TableFanout) -> None:
        self.query = query
        self.fanout = fanout

    @property
    def name(self) -> str:
        return str(self.query.name)

    @property
    def isActive(self) -> bool:  # noqa: N802 (StreamingQuery's name)
        return bool(self.query.isActive)

    @property
    def status(self) -> dict[str, Any]:
        return dict(self.query.status)

    @property
    def recentProgress(self) -> list[dict[str, Any]]:  # noqa: N802 (StreamingQuery's name)
        return list(self.query.recentProgress)

    def exception(self) -> Exception | None:
        return self.query.exception()

    def awaitTermination(self, timeout: int | None = None) -> bool | None:  # noqa: N802
        return self.query.awaitTermination(timeout)

    def processAllAvailable(self) -> None:  # noqa: N802 (StreamingQuery's name)
        """Everything available now is in ``messages`` and in every other table."""
        self.query.processAllAvailable()
        self.fanout.drain()

    def stop(self) -> None:
        """Stop the query (a running batch is interrupted); the other tables finish what the
        stream handed them."""
        try:
            self.query.stop()
        finally:
            self.fanout.close()


def start(
    spark: SparkSession,
    settings: PipelineSettings,
    quota: QuotaSettings | None = None,
    edge_token: str | None = None,
) -> PipelineQuery:
    """Start the journal query on ``spark`` (with the quota step when ``quota`` is given).

    With or without ``quota`` it is the same query (name, checkpoint, app ids), so quota
    enforcement can be switched on and off across restarts. ``edge_token`` is the bearer
    token for ``settings.edges`` (the operator token).
    """
    return _start(spark, settings, quota, edge_token=edge_token)


def _start(
    spark: SparkSession,
    settings: PipelineSettings,
    quota: QuotaSettings | None,
    notices: NoticeSettings | None = None,
    edge_token: str | None = None,
    metrics: PipelineMetrics | None = None,
) -> PipelineQuery:
    use_lake(spark, settings.lake)  # a caller's own session too
    checkpoint = settings.checkpoint_path(JOB)
    fanout = TableFanout(settings, quota, notices, edge_token, metrics)
    for writer in fanout.writers:
        check_checkpoint(checkpoint, writer)
        # A table an older edgebus wrote gets the columns it lacks now, before any batch: its
        # readers see them at once (null in the rows written before).
        writer.upgrade(spark)
    # The journal query and the other tables read through it; their catch-up comes first.
    route.register(spark)
    fanout.start(spark)
    try:
        query = start_query(
            journal_stream(spark, settings, checkpoint, edge_token),
            job=JOB,
            sink=fanout,
            checkpoint=checkpoint,
            settings=settings,
        )
    except BaseException:
        fanout.close()
        raise
    logger.info(
        "started %s: %s%s -> %s (quota %s)",
        JOB,
        settings.journal_root,
        "".join(f", edge {edge}" for edge in settings.edges),
        settings.lake,
        "on" if quota is not None else "off",
    )
    return PipelineQuery(query, fanout)


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
    retention: RetentionLoader | None = None,
) -> None:
    """Run the journal query (with the quota step when ``quota`` is given).

    The journal notices go to the edges of ``quota``, or without it to those of ``notices``.

    ``once``: process everything available now (in every table), then return. Otherwise run
    until ``stop`` is set (never, without one), re-raising the query's error (or the other
    tables') if it fails; meanwhile the quality suites and the table maintenance run on their
    schedules (``quality_interval_seconds``, ``maintenance_interval_seconds``) in background
    threads. The session is built from ``settings`` and stopped at the end, unless the caller
    passes its own ``spark`` (then the caller owns and stops it). ``edge_token``: the bearer
    token for ``settings.edges``. ``metrics``: counted once per batch and per quality run
    (:mod:`streaming.metrics`; the caller serves them). ``retention``: the tenants' own days
    of history (the tenants file's; :mod:`streaming.maintenance`), else the settings' for all.
    """
    session = spark if spark is not None else build_spark(settings)
    running: PipelineQuery | None = None
    schedules: list[IntervalSchedule] = []
    try:
        running = _start(session, settings, quota, notices, edge_token, metrics)
        if once:
            running.processAllAvailable()
            logger.info("%s: caught up", running.name)
        else:
            schedules = [
                QualitySchedule.from_settings(
                    session, settings, on_results=metrics.quality_ran if metrics else None
                ),
                MaintenanceSchedule(settings, spark_maintainer(session), tenants=retention),
            ]
            _wait(running, stop if stop is not None else threading.Event(), schedules)
    finally:
        try:
            if running is not None:
                _stop_gracefully(running.query)
                running.fanout.close()  # the other tables catch up, then the last notices
            for schedule in schedules:
                # A run in flight finishes its Delta commit before the process goes on.
                schedule.close(timeout=STOP_GRACE_SECONDS)
        finally:
            if spark is None:
                session.stop()


def _wait(running: PipelineQuery, stop: threading.Event, schedules: list[IntervalSchedule]) -> None:
    query = running.query
    while not stop.wait(POLL_SECONDS):
        running.fanout.check()  # the quota step's or the other tables' failure
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
