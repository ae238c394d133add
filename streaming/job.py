"""The journal query's parts: the journal stream, starting the query, and the checkpoint check
that keeps batch ids from restarting below a table's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from ingest.source import (
    OPTION_CHECKPOINT,
    OPTION_EDGES,
    OPTION_MAX_RECORDS,
    OPTION_PATH,
    OPTION_TOKEN,
)
from sinks.delta import DeltaTableWriter
from streaming import route
from streaming.errors import PipelineError
from streaming.settings import PipelineSettings

logger = logging.getLogger(__name__)

# Spark gives the Python process of a streaming source 10 s to start and connect back
# (PythonWorkerFactory's constant, no setting); on a machine busy with other JVMs it can miss
# that while the query initializes its sources, before it has planned, read or written anything.
# Such a query is started again, at most this many times in all.
START_ATTEMPTS = 3
WORKER_TIMEOUT = "Python worker failed to connect back"
_INITIALIZING = frozenset({"Initializing StreamExecution", "Initializing sources"})


def journal_stream(
    spark: SparkSession,
    settings: PipelineSettings,
    checkpoint: Path,
    edge_token: str | None = None,
) -> DataFrame:
    """Every node's journal as a stream of routed rows (``streaming.route``, registered on
    ``spark`` by the caller: the other tables read through it too), capped per micro-batch
    (see ``ingest.source``)."""
    return (
        spark.readStream.format(route.ROUTED_SOURCE)
        .options(**journal_options(settings, edge_token))
        .option(OPTION_MAX_RECORDS, str(settings.max_records_per_batch))
        .option(OPTION_CHECKPOINT, str(checkpoint))
        .load()
    )


def journal_options(settings: PipelineSettings, edge_token: str | None = None) -> dict[str, str]:
    """Where the journals are, as the source's options: the journals under ``data_dir`` and
    those of ``settings.edges`` over HTTP (``edge_token``: the operator token they want as
    bearer)."""
    options = {OPTION_PATH: str(settings.journal_root)}
    if settings.edges:
        options[OPTION_EDGES] = ",".join(settings.edges)
    if edge_token:
        options[OPTION_TOKEN] = edge_token
    return options


def start_query(
    rows: DataFrame,
    *,
    job: str,
    sink: Callable[[DataFrame, int], None],
    checkpoint: Path,
    settings: PipelineSettings,
) -> StreamingQuery:
    """Start the query, and again (up to START_ATTEMPTS in all) when its source's Python worker
    missed Spark's 10 s to connect back while the query initialized (see WORKER_TIMEOUT); each
    attempt but the last is waited on until it has initialized its sources. Any other failure
    is the caller's to see as it waits on the query."""

    def start() -> StreamingQuery:
        query: StreamingQuery = (
            rows.writeStream.queryName(job)
            .foreachBatch(sink)
            .option("checkpointLocation", str(checkpoint))
            .trigger(processingTime=f"{settings.trigger_interval_seconds} seconds")
            .start()
        )
        return query

    query = start()
    for attempt in range(2, START_ATTEMPTS + 1):
        if not _worker_missed_its_start(query):
            break
        logger.warning(
            "%s: its source's Python worker did not connect back within Spark's 10 s while the "
            "query started (a busy machine); starting it again (attempt %d of %d)",
            job,
            attempt,
            START_ATTEMPTS,
        )
        query = start()
    return query


def _worker_missed_its_start(query: StreamingQuery) -> bool:
    """Wait until ``query`` has initialized its sources; whether it failed doing so because
    a Python worker did not connect back in time."""
    while query.isActive and query.status["message"] in _INITIALIZING:
        time.sleep(0.05)
    if query.isActive:
        return False
    failure = query.exception()
    return failure is not None and WORKER_TIMEOUT in str(failure)


def check_checkpoint(checkpoint: Path, writer: DeltaTableWriter) -> None:
    """Refuse to start when the table holds batches the checkpoint never planned.

    Spark logs a batch's offsets before running it, so a table's last batch id can never be
    ahead of the checkpoint's last offsets entry. If it is, the checkpoint was deleted or
    restored from an older copy: batch ids would restart below the table's and every new
    batch up to there would be skipped as a "replay", silently losing its rows.
    """
    committed = writer.last_batch_id()
    if committed is None:
        return
    planned = _last_planned_batch(checkpoint)
    if planned is None or planned < committed:
        raise PipelineError(
            f"{writer.path} holds batch {committed} of {writer.app_id} but the checkpoint "
            f"{checkpoint} plans only up to {planned}: the checkpoint was deleted or replaced. "
            "Restore it, or move the table away to rebuild it from the journal."
        )


def _last_planned_batch(checkpoint: Path) -> int | None:
    offsets = checkpoint / "offsets"
    if not offsets.is_dir():
        return None
    ids = [int(entry.name) for entry in offsets.iterdir() if entry.name.isdigit()]
    return max(ids, default=None)
