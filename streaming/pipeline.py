"""Run every streaming job on one SparkSession: until told to stop, or once over the backlog."""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from streaming import history, logs, usage
from streaming.errors import PipelineError
from streaming.quota_settings import QuotaSettings
from streaming.session import build_spark
from streaming.settings import PipelineSettings

logger = logging.getLogger(__name__)


class Job(Protocol):
    """A streaming job module: ``start`` returns its running query."""

    def start(self, spark: SparkSession, settings: PipelineSettings) -> StreamingQuery: ...


# Every job the pipeline runs; a new table's job plugs in here.
# The usage job also runs the quota step when given QuotaSettings (see run()).
JOBS: tuple[Job, ...] = (history, logs, usage)

# How often a long run checks whether a query failed (a set stop event is seen at once).
POLL_SECONDS = 0.5
# How long stopping waits for a running micro-batch to finish before interrupting it.
STOP_GRACE_SECONDS = 30.0


def run(
    settings: PipelineSettings,
    *,
    once: bool,
    stop: threading.Event | None = None,
    spark: SparkSession | None = None,
    quota: QuotaSettings | None = None,
) -> None:
    """Run every job in :data:`JOBS` (the usage job with the quota step when ``quota`` is
    given: usage against the tenants' limits, decisions to ``quota_events`` and the edges).

    ``once``: process everything available now, then return. Otherwise run until ``stop`` is
    set (never, without one), re-raising the error of the first query that fails. The
    session is built from ``settings`` and stopped at the end, unless the caller passes its
    own ``spark`` (then the caller owns and stops it).
    """
    session = spark if spark is not None else build_spark(settings)
    queries: list[StreamingQuery] = []
    try:
        # One at a time, so the queries already started are stopped if a later start fails.
        jobs = [usage.UsageJob(quota) if job is usage else job for job in JOBS]
        for job in jobs:
            queries.append(job.start(session, settings))  # noqa: PERF401
        if once:
            for query in queries:
                query.processAllAvailable()
                logger.info("%s: caught up", query.name)
        else:
            _wait(queries, stop if stop is not None else threading.Event())
    finally:
        try:
            for query in queries:
                _stop_gracefully(query)
        finally:
            if spark is None:
                session.stop()


def _wait(queries: list[StreamingQuery], stop: threading.Event) -> None:
    # Watch our own queries, not spark.streams.awaitAnyTermination: that one also reports
    # queries that ended earlier in the same session until someone resets it.
    while not stop.wait(POLL_SECONDS):
        for query in queries:
            if not query.isActive:
                # Raises the query's StreamingQueryException when it failed.
                query.awaitTermination()
                raise PipelineError(f"streaming query {query.name} stopped without an error")
    logger.info("stop requested, stopping %d queries", len(queries))


def _stop_gracefully(query: StreamingQuery) -> None:
    """Let a running micro-batch finish (bounded), then stop the query.

    Interrupting a batch is safe (its Delta commit is atomic and replays are skipped) but
    wastes the work; waiting for the trigger to end avoids that in the common case.
    """
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while query.isActive and query.status["isTriggerActive"] and time.monotonic() < deadline:
        time.sleep(0.05)  # Spark exposes no "batch finished" event to Python: poll.
    query.stop()
    logger.info("%s: stopped", query.name)
