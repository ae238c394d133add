"""The logs job: every log event publish (``$log/{origin}/{event}``), into the Delta ``logs`` table.

Theory of operation: the ``edgebus`` source replays journal ranges by offset, exactly as for the
history job (each job has its own checkpoint and Delta app id). ``transform`` keeps the records
on log topics and parses each payload with ``from_json`` against ``LOG_EVENT_SCHEMA``. The row's
identity, time, date and tenant come from the journal record, never from the payload: a
payload cannot move a row to another tenant's or day's partition. A payload that breaks the
contract is kept with ``payload_valid = false``, the first rule it failed and its raw bytes
(ARCHITECTURE rule 5); whatever did parse is filled in, and ``origin``/``event_type`` fall back
to the topic's levels. Micro-batches go to an idempotent :class:`DeltaBatchWriter` as in
:mod:`streaming.history`, so a replayed batch is skipped.
"""

from __future__ import annotations

import logging

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 (the idiomatic Spark alias)
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import MapType, StringType, StructField, StructType

from schemas.payloads import LOG_EVENT_SCHEMA, LOG_TOPIC_PREFIX
from schemas.tables import LOGS_PARTITION_BY, LOGS_SCHEMA
from sinks.delta import DeltaBatchWriter
from streaming.job import DeltaSink, check_checkpoint, journal_stream, start_query
from streaming.settings import PipelineSettings

logger = logging.getLogger(__name__)

JOB = "logs"
TABLE = "logs"
# The Delta app id of this job's commits. Stable across restarts from the same checkpoint.
APP_ID = "edgebus.logs"

# Spark types of the table and of the payload, derived from the Arrow definitions in schemas.
LOGS_SPARK_SCHEMA = from_arrow_schema(LOGS_SCHEMA)
LOG_EVENT_SPARK_SCHEMA = from_arrow_schema(LOG_EVENT_SCHEMA)

# Fields whose absence makes a payload invalid, in the order the first missing one is reported.
# ``details`` is checked separately: it must be an object, not any JSON value.
REQUIRED_FIELDS = ("time", "ts_us", "node", "tenant", "client_id", "origin", "event")

# Not a second schema of the payload but a check: parsing ``details`` as a map succeeds only
# for a JSON object. The string parse in LOG_EVENT_SCHEMA gives an object's JSON text, but it
# also gives a plain string's contents, so it cannot tell ``{"a":1}`` from ``"{\"a\":1}"``.
_DETAILS_AS_MAP = StructType([StructField("details", MapType(StringType(), StringType()))])

_SECONDS_PER_DAY = 86_400


def transform(df: DataFrame) -> DataFrame:
    """Journal rows (``JOURNAL_SCHEMA``) on ``$log/`` topics to ``logs`` rows, in table order."""
    text = F.col("payload").cast("string")
    # Parse once here; the select below reads the results many times. Spark does not merge
    # the two projections, because that would repeat the (not cheap) JSON parses.
    parsed = df.where(F.col("topic").startswith(LOG_TOPIC_PREFIX)).select(
        "*",
        F.from_json(text, LOG_EVENT_SPARK_SCHEMA).alias("_event"),
        # json_object_keys is null for anything but a JSON object (bad JSON, arrays, scalars).
        F.json_object_keys(text).isNotNull().alias("_is_object"),
        F.from_json(text, _DETAILS_AS_MAP)["details"].isNotNull().alias("_details_is_object"),
    )
    event = F.col("_event")
    levels = F.split(F.col("topic"), "/")
    origin = F.coalesce(event["origin"], F.get(levels, 1))
    event_type = F.coalesce(event["event"], F.get(levels, 2))
    reason = invalid_reason(event)
    # date from epoch seconds, not to_date(ts): partitions are UTC days whatever the session
    # time zone says (as in the history job).
    utc_day = F.floor(F.unix_seconds(F.col("ts")) / _SECONDS_PER_DAY).cast("int")
    derived: dict[str, Column] = {
        "date": F.date_from_unix_date(utc_day),
        "origin": origin,
        "event_type": event_type,
        "client_id": event["client_id"],
        "details": F.when(F.col("_details_is_object"), event["details"]),
        "time": event["time"],
        "payload_valid": reason.isNull(),
        "invalid_reason": reason,
        "raw": F.when(reason.isNotNull(), F.col("payload")),
    }
    columns = [
        derived.get(field.name, F.col(field.name)).cast(field.dataType).alias(field.name)
        for field in LOGS_SPARK_SCHEMA.fields
    ]
    return parsed.select(*columns)


def invalid_reason(event: Column) -> Column:
    """The first contract rule the parsed payload breaks, or null when it keeps them all."""
    rules: list[tuple[Column, Column]] = [
        (~F.col("_is_object"), F.lit("payload is not a JSON object")),
        *(
            (event[name].isNull(), F.lit(f"field {name!r} is missing, null or of the wrong type"))
            for name in REQUIRED_FIELDS
        ),
        (~F.col("_details_is_object"), F.lit("field 'details' is not a JSON object")),
        # Tenants are isolated by construction: the namespace decides, a payload cannot.
        (
            event["tenant"] != F.col("tenant"),
            F.format_string(
                "field 'tenant' is '%s' but the event was published in tenant '%s'",
                event["tenant"],
                F.col("tenant"),
            ),
        ),
        (
            F.col("topic")
            != F.concat(F.lit(LOG_TOPIC_PREFIX), event["origin"], F.lit("/"), event["event"]),
            F.format_string(
                "topic %s does not match origin %s and event %s",
                F.col("topic"),
                event["origin"],
                event["event"],
            ),
        ),
    ]
    first, *rest = rules
    reason = F.when(*first)
    for condition, message in rest:
        reason = reason.when(condition, message)
    return reason


def logs_writer(settings: PipelineSettings) -> DeltaBatchWriter:
    return DeltaBatchWriter(settings.table_path(TABLE), APP_ID, LOGS_SCHEMA, LOGS_PARTITION_BY)


def start(spark: SparkSession, settings: PipelineSettings) -> StreamingQuery:
    """Start the logs query on ``spark``; it runs until stopped."""
    checkpoint = settings.checkpoint_path(JOB)
    writer = logs_writer(settings)
    check_checkpoint(checkpoint, writer)
    rows = transform(journal_stream(spark, settings, checkpoint))
    query = start_query(
        rows, job=JOB, sink=DeltaSink(writer), checkpoint=checkpoint, settings=settings
    )
    logger.info("started %s: %s -> %s", JOB, settings.journal_root, writer.path)
    return query
