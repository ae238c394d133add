"""The history job: every publish on a tenant's own topics, into the Delta ``messages`` table.

Theory of operation: the ``edgebus`` source replays journal ranges by offset; ``transform``
keeps the tenants' own traffic (topics starting with ``$`` are log, counter and control
traffic and go to their own tables), derives ``date`` and ``size``, and casts to the table's
schema. Each micro-batch is collected to Arrow on the driver and appended by a
:class:`DeltaBatchWriter`, which commits the batch id as a Delta app transaction in the same
commit as the rows: a batch replayed after a crash is recognised and skipped.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 (the idiomatic Spark alias)
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.streaming.query import StreamingQuery

from ingest.source import OPTION_CHECKPOINT, OPTION_MAX_RECORDS, OPTION_PATH, SOURCE_NAME
from schemas.tables import MESSAGES_PARTITION_BY, MESSAGES_SCHEMA
from sinks.delta import DeltaBatchWriter
from streaming.errors import PipelineError
from streaming.settings import PipelineSettings

logger = logging.getLogger(__name__)

JOB = "history"
TABLE = "messages"
# The Delta app id of this job's commits. Stable across restarts from the same checkpoint.
APP_ID = "edgebus.history"

# Spark types of the table, derived from the one Arrow definition in schemas.tables.
MESSAGES_SPARK_SCHEMA = from_arrow_schema(MESSAGES_SCHEMA)

_SECONDS_PER_DAY = 86_400


def transform(df: DataFrame) -> DataFrame:
    """Journal rows (``JOURNAL_SCHEMA``) to ``messages`` rows, in table order and types."""
    # date from epoch seconds, not to_date(ts): to_date uses the session time zone, and
    # partitions must be UTC days whatever the session says.
    utc_day = F.floor(F.unix_seconds(F.col("ts")) / _SECONDS_PER_DAY).cast("int")
    derived: dict[str, Column] = {
        "date": F.date_from_unix_date(utc_day),
        "size": F.length(F.col("payload")),
    }
    columns = [
        derived.get(field.name, F.col(field.name)).cast(field.dataType).alias(field.name)
        for field in MESSAGES_SPARK_SCHEMA.fields
    ]
    return df.where(~F.col("topic").startswith("$")).select(*columns)


class _BatchSink:
    """The ``foreachBatch`` function: one micro-batch to Arrow, then to the Delta writer."""

    def __init__(self, writer: DeltaBatchWriter) -> None:
        self._writer = writer

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        self._writer.write(batch_id, batch.toArrow())


def messages_writer(settings: PipelineSettings) -> DeltaBatchWriter:
    return DeltaBatchWriter(
        settings.table_path(TABLE), APP_ID, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY
    )


def start(spark: SparkSession, settings: PipelineSettings) -> StreamingQuery:
    """Start the history query on ``spark``; it runs until stopped."""
    checkpoint = settings.checkpoint_path(JOB)
    writer = messages_writer(settings)
    check_checkpoint(checkpoint, writer)
    journal = (
        spark.readStream.format(SOURCE_NAME)
        .option(OPTION_PATH, str(settings.journal_root))
        .option(OPTION_MAX_RECORDS, str(settings.max_records_per_batch))
        .option(OPTION_CHECKPOINT, str(checkpoint))
        .load()
    )
    query: StreamingQuery = (
        transform(journal)
        .writeStream.queryName(JOB)
        .foreachBatch(_BatchSink(writer))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime=f"{settings.trigger_interval_seconds} seconds")
        .start()
    )
    logger.info("started %s: %s -> %s", JOB, settings.journal_root, writer.path)
    return query


def check_checkpoint(checkpoint: Path, writer: DeltaBatchWriter) -> None:
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
