"""The pipeline: one streaming query over every node's journal, feeding every table.

Theory of operation
-------------------
The ``edgebus`` source replays the journals by offset (``ingest.source``). One query reads them
and, per micro-batch, :class:`TableFanout` collects the batch as Arrow once and hands each table
step the records meant for it:

1. the record contract (``schemas.contracts.RECORD_RULES``: tenant, topic, sane ts) for every
   record; a record that breaks it goes to ``quarantine`` for the table it was meant for;
2. :class:`~streaming.history.HistoryStep` → ``messages`` (device topics, message contract);
3. :class:`~streaming.logs.LogsStep` → ``logs`` (``$log/``);
4. :class:`~streaming.usage.UsageStep` → ``usage`` (``$counters/``), then the quota step →
   ``quota_events`` and the decisions to the edges;
5. every record a step rejected → ``quarantine``, in one commit.

Exactly once: every table's writer commits its rows with the Delta app transaction ``(app_id,
batch_id)`` in the same commit. Spark logs a batch's offsets before running it and marks it done
after ``foreachBatch`` returns, so a crash anywhere in between replays the same batch with the
same records, and each table skips it if it has it already: tables committed before the crash
are left alone, the others are written. The quota step runs after the usage commit, so its
decisions always see the usage that caused them.

Why one query and Arrow steps rather than one Spark query per table: three queries each read
and decode the whole journal to keep a share of it (measured: 17,000 rows/s for three
queries). The Delta writers (delta-rs) take Arrow on the driver anyway, so collecting the batch
once and splitting it with pyarrow compute costs one read per batch, not one per table, and
keeps each table's transform a pure Arrow function (unit-tested without Spark). Spark still owns
what makes the stream exactly once: offsets, the checkpoint, batch planning, parallel reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol, TypeAlias

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from schemas.contracts import RECORD_RULES, first_broken, rows_where
from schemas.journal import JOURNAL_SCHEMA
from sinks.delta import DeltaBatchWriter, conform
from sinks.quarantine import quarantine_rows, quarantine_writer
from streaming.errors import PipelineError
from streaming.history import HistoryStep
from streaming.job import check_checkpoint, journal_stream, start_query
from streaming.logs import LogsStep
from streaming.maintenance import MaintenanceSchedule
from streaming.quality import QualitySchedule
from streaming.quota_settings import QuotaSettings
from streaming.schedule import IntervalSchedule
from streaming.session import build_spark
from streaming.settings import PipelineSettings
from streaming.usage import UsageStep

logger = logging.getLogger(__name__)

# The query's name and checkpoint directory (``{lake}/_checkpoints/journal``).
JOB = "journal"
QUARANTINE_TABLE = "quarantine"
# Where a record that breaks the record contract was meant to go when no step takes it.
UNROUTED = "none"

# How often a long run checks whether the query failed (a set stop event is seen at once).
POLL_SECONDS = 0.5
# How long stopping waits for a running micro-batch to finish before interrupting it.
STOP_GRACE_SECONDS = 30.0

Mask: TypeAlias = pa.Array | pa.ChunkedArray


class Step(Protocol):
    """One table's step: takes the records ``accepts`` selects, writes them exactly once per
    batch id, and returns the ones that broke its contract as ``quarantine`` rows."""

    table: str
    writers: tuple[DeltaBatchWriter, ...]

    def accepts(self, topics: Mask) -> Mask: ...

    def __call__(self, batch_id: int, records: pa.Table) -> pa.Table: ...


def table_steps(settings: PipelineSettings, quota: QuotaSettings | None) -> list[Step]:
    """Every table's step, in the order they run: ``messages`` first (what analysts wait for),
    the usage step last but for quarantine (with the quota step when ``quota`` is given)."""
    return [HistoryStep(settings), LogsStep(settings), UsageStep(settings, quota)]


class TableFanout:
    """The ``foreachBatch`` function: one micro-batch of journal records into every table."""

    def __init__(self, steps: Sequence[Step], quarantine: DeltaBatchWriter) -> None:
        self.steps = list(steps)
        self.quarantine = quarantine

    @property
    def writers(self) -> list[DeltaBatchWriter]:
        return [w for step in self.steps for w in step.writers] + [self.quarantine]

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        self.write(batch_id, batch.toArrow())

    def write(self, batch_id: int, journal: pa.Table) -> None:
        """Write batch ``batch_id`` (journal records, any Arrow types equal to the journal's)."""
        records = conform(journal, JOURNAL_SCHEMA)
        rules, reasons = first_broken(records, RECORD_RULES)
        kept = pc.is_null(rules)
        broken = pc.invert(kept)
        rejected = rows_where(records, broken)
        quarantined = [
            quarantine_rows(
                rejected,
                self._meant_for(rejected.column("topic")),
                rules.filter(broken),
                reasons.filter(broken),
            )
        ]
        good = rows_where(records, kept)
        topics = good.column("topic")
        quarantined += [
            step(batch_id, rows_where(good, step.accepts(topics))) for step in self.steps
        ]
        self.quarantine.write(batch_id, pa.concat_tables(quarantined))

    def _meant_for(self, topics: Mask) -> Mask:
        tables: Mask = pa.array([UNROUTED] * len(topics), pa.string())
        for step in reversed(self.steps):  # the first step that accepts a topic wins
            tables = pc.if_else(step.accepts(topics), pa.scalar(step.table), tables)
        return tables


def start(
    spark: SparkSession, settings: PipelineSettings, quota: QuotaSettings | None = None
) -> StreamingQuery:
    """Start the journal query on ``spark`` (with the quota step when ``quota`` is given).

    With or without ``quota`` it is the same query (name, checkpoint, app ids), so quota
    enforcement can be switched on and off across restarts.
    """
    checkpoint = settings.checkpoint_path(JOB)
    fanout = TableFanout(
        table_steps(settings, quota),
        quarantine_writer(settings.table_path(QUARANTINE_TABLE)),
    )
    for writer in fanout.writers:
        check_checkpoint(checkpoint, writer)
    query = start_query(
        journal_stream(spark, settings, checkpoint),
        job=JOB,
        sink=fanout,
        checkpoint=checkpoint,
        settings=settings,
    )
    logger.info(
        "started %s: %s -> %s (quota %s)",
        JOB,
        settings.journal_root,
        settings.lake,
        "on" if quota is not None else "off",
    )
    return query


def run(
    settings: PipelineSettings,
    *,
    once: bool,
    stop: threading.Event | None = None,
    spark: SparkSession | None = None,
    quota: QuotaSettings | None = None,
) -> None:
    """Run the journal query (with the quota step when ``quota`` is given).

    ``once``: process everything available now, then return. Otherwise run until ``stop`` is
    set (never, without one), re-raising the query's error if it fails; meanwhile the quality
    suites and the table maintenance run on their schedules (``quality_interval_seconds``,
    ``maintenance_interval_seconds``) in background threads. The session is built from
    ``settings`` and stopped at the end, unless the caller passes its own ``spark`` (then the
    caller owns and stops it).
    """
    session = spark if spark is not None else build_spark(settings)
    query: StreamingQuery | None = None
    schedules: list[IntervalSchedule] = []
    try:
        query = start(session, settings, quota)
        if once:
            query.processAllAvailable()
            logger.info("%s: caught up", query.name)
        else:
            schedules = [QualitySchedule.from_settings(settings), MaintenanceSchedule(settings)]
            _wait(query, stop if stop is not None else threading.Event(), schedules)
    finally:
        try:
            if query is not None:
                _stop_gracefully(query)
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
