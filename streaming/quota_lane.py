"""The quota step ahead of the ``usage`` table: each batch's quota counters counted on the
driver as the stream hands the batch over, so a decision waits for no table but its own.

Theory of operation
-------------------
The other tables are written behind the stream (:mod:`streaming.others`); a ``usage`` commit
costs seconds and a write of the other tables catches up several batches at once, so a quota
step that ran after it reacted 10-47 s after a tenant crossed its limit (BENCHMARKS.md, issue
14). The lane takes each batch from the stream's ``foreachBatch`` as it begins (its journal
range, from the checkpoint's offset log: the counter records are durable in the journals, so
they need not wait for the ``messages`` commit) and, in a thread of its own, beside that write:

1. reads the range's counter records here, on the driver (:func:`streaming.route.read_counters`:
   the journal read of the source, only the records meant for the usage step routed, so the
   same counter records the executors' route gives the usage step), and sums each node's
   deltas of the quota counters (:func:`streaming.quota.count_counters`): a few rows per
   tenant and counter interval, however many messages the batch holds;
2. hands them to :meth:`streaming.quota.QuotaStep.decide_batch`, which decides on what
   ``usage`` holds plus what was counted ahead of it, publishes the decisions and the
   confirmed totals, and records the decisions in ``quota_events`` (batch id: the stream's;
   sent first, with an intent written before, :class:`streaming.quota.Intent`, and committed
   by a recorder thread while the lane goes on).

When the usage step commits batches, :meth:`~streaming.quota.QuotaStep.committed` replaces
the counts ahead of it by the day totals ``usage`` reports: the totals the lane decides on are
those the usage table will hold, never counted twice or missed (both sum the same counter
records per node, and a batch's counts are dropped once ``usage`` holds it).

Batches that queue up while the lane works are read in one range and decided once, as the
newest of them. Every batch is decided, with or without counter records (a changed limit
counts from the next batch). When the range cannot be read (an edge that served it is gone
meanwhile) the lane logs it and decides without those counts: the usage commit brings them,
and the next batch decides on them.
A replayed batch that ``quota_events`` holds is not decided again: its decisions are sent again.
A batch whose ``messages`` write fails stops the query: the run's counts go with it, and the
next run starts from what ``usage`` holds.

Between batches (nothing handed over for :data:`AHEAD_SECONDS`) the lane looks ahead of the
stream: it reads the counter records the journals hold beyond what it counted (a node at most
:data:`AHEAD_MAX_RECORDS` ahead: not a backlog the stream is catching up), counts them (a
record is counted once, by ``(node, seq)``, whether the look ahead or its batch sees it first)
and sends the confirmed totals of each tenant they moved past half a limit
(:meth:`streaming.quota.QuotaStep.confirm_ahead`): the edges' local quota learns of the other
edges' traffic a batch sooner. It decides nothing: decisions are recorded with their batch.

The lane's failure (or its recorder's) fails the stream's next batch, like the other tables';
``drain`` waits for what was handed over to be decided and committed (``processAllAvailable``
means decided too).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ingest.source import (
    EdgebusStreamReader,
    Offset,
    SourceError,
    SourceOptions,
    checkpointed_offset,
)
from streaming import route
from streaming.behind import Behind
from streaming.quota import PendingCounts, QuotaStep, count_counters

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from streaming.metrics import PipelineMetrics

logger = logging.getLogger(__name__)

# The decisions sent and not committed yet, in the query's checkpoint directory
# (:class:`streaming.quota.Intent`).
INTENT_FILE = "quota_intent"
# While no batch comes, the lane looks ahead of the stream this often.
AHEAD_SECONDS = 0.25
# A node further ahead of the stream than this many records is not looked ahead at: the stream
# is catching up a backlog, and reading it twice here would only slow it down.
AHEAD_MAX_RECORDS = 50_000


class QuotaLane(Behind[tuple[int, Offset, Offset, bool]]):
    """Decides quota states batch by batch, ahead of ``usage`` (see the module's docstring);
    handed ``(batch id, its range's start and end, whether it may hold counter records)``."""

    what = "the quota step"
    thread_name = "quota-lane"
    idle_seconds = AHEAD_SECONDS

    def __init__(
        self,
        step: QuotaStep,
        checkpoint: Path,
        journals: dict[str, str],
        metrics: PipelineMetrics | None = None,
    ) -> None:
        super().__init__()
        self._step = step
        self._intent = checkpoint / INTENT_FILE
        self._journals = journals  # the journal source's options, for the reads here
        self._metrics = metrics
        self._checkpoint = checkpoint
        self._reader: EdgebusStreamReader | None = None
        self._ahead: Offset = {}  # how far each node's records were counted here

    def start(self, spark: SparkSession, usage_end: Offset) -> None:
        """Before the query starts: ``usage`` holds every record through each node's seq in
        ``usage_end``."""
        self._step.start(spark, usage_end, self._intent)
        self._ahead = checkpointed_offset(self._checkpoint)  # where the stream goes on from
        self._start_thread(spark)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every batch handed over is decided and its decisions committed."""
        super().drain(timeout)
        self._step.wait_recorded()

    def check(self) -> None:
        """Raise the lane's failure, or a failed commit of its decisions."""
        super().check()
        self._step.check_recorded()

    def close(self) -> None:
        """Stop once what was handed over is decided and committed."""
        try:
            super().close()
        finally:
            self._step.close()

    def hand(self, batch_id: int, start: Offset, end: Offset, records: bool) -> None:
        """Batch ``batch_id`` (records ``start < seq <= end``) is read; ``records``: it has
        any. Raises the lane's failure."""
        self._hand((batch_id, start, end, records))

    def _work(self, spark: SparkSession, taken: list[tuple[int, Offset, Offset, bool]]) -> None:
        """The batches ``taken`` (in order, consecutive) as one: one read, one decision."""
        batch_id = taken[-1][0]
        start, end = taken[0][1], taken[-1][2]
        counts = self._count(start, end) if any(may for *_, may in taken) else {}
        events = self._step.decide_batch(spark, batch_id, counts)
        for node, seq in end.items():
            self._ahead[node] = max(self._ahead.get(node, 0), seq)
        if self._metrics is not None:
            self._metrics.quota_decided(events)

    def _idle(self, spark: SparkSession) -> None:
        """No batch for a while: count what the journals hold beyond the stream, and send the
        confirmed totals of the tenants near a limit (decisions wait for their batch)."""
        try:
            if self._reader is None:
                self._reader = EdgebusStreamReader(SourceOptions.parse(self._journals))
            available = self._reader.available()
        except (SourceError, OSError) as exc:
            logger.debug("quota: no look ahead: %s", exc)
            return
        start = {node: self._ahead.get(node, 0) for node in available}
        end = {
            node: seq
            for node, seq in available.items()
            if 0 < seq - start[node] <= AHEAD_MAX_RECORDS
        }
        if not end:
            return
        start = {node: start[node] for node in end}
        counts = self._count(start, end)
        if counts is None:
            return
        self._ahead.update(end)
        if counts:
            self._step.confirm_ahead(counts)

    def _count(self, start: Offset, end: Offset) -> PendingCounts | None:
        try:
            return count_counters(route.read_counters(self._journals, start, end))
        except (SourceError, OSError) as exc:
            logger.warning("quota: cannot count ahead of usage (%s); usage brings them", exc)
            return None
