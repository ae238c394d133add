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

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 (the idiomatic Spark alias)
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.streaming.query import StreamingQuery

from schemas.tables import MESSAGES_PARTITION_BY, MESSAGES_SCHEMA
from sinks.delta import DeltaBatchWriter
from streaming.job import DeltaSink, check_checkpoint, journal_stream, start_query
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


def messages_writer(settings: PipelineSettings) -> DeltaBatchWriter:
    return DeltaBatchWriter(
        settings.table_path(TABLE), APP_ID, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY
    )


def start(spark: SparkSession, settings: PipelineSettings) -> StreamingQuery:
    """Start the history query on ``spark``; it runs until stopped."""
    checkpoint = settings.checkpoint_path(JOB)
    writer = messages_writer(settings)
    check_checkpoint(checkpoint, writer)
    rows = transform(journal_stream(spark, settings, checkpoint))
    query = start_query(
        rows, job=JOB, sink=DeltaSink(writer), checkpoint=checkpoint, settings=settings
    )
    logger.info("started %s: %s -> %s", JOB, settings.journal_root, writer.path)
    return query
