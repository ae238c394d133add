"""The usage job: the edges' ``$counters/{metric}`` records into the Delta ``usage`` table, then
(when configured) the quota step of :mod:`streaming.quota` after every batch.

Theory of operation
-------------------
Every edge publishes, per tenant and metric, one counter record per counter interval (default
10 s); they are journaled like any publish. ``transform`` keeps those records, parses their
JSON payload and assigns it its one-minute window; ``partials`` reduces each micro-batch (a
static DataFrame: no streaming state) to one row per tenant, metric, window and node: a
counter's deltas summed, a gauge's value reported last. A counter interval belongs
to the window its ``interval_end`` falls in (the moment it was reported).

A minute spans micro-batches (ten-second intervals from several edges, journals read at
different paces, a node catching up late), so the sink *upserts*: for the windows a batch
touches it reads the stored rows, adds the batch's partials node by node (each row keeps its
per-node parts in ``nodes``: without them a gauge could not be combined across batches),
recomputes ``value`` and the running ``day_value`` of every later window of the same tenant,
metric and day, and merges the changed rows keyed by ``(tenant, date, metric, window_start)``.

Exactly once: the merge carries the Delta app transaction ``(edgebus.usage, batch_id)`` in the
same commit (:class:`~sinks.upsert.DeltaUpsertWriter`). A batch replayed after a crash is
skipped before anything is read, so its deltas are never added twice; a crash before the commit
leaves the table as it was, and the replay computes the same rows again. The stored rows a batch
builds on were written by earlier batches of this same query only.

The rejected alternative, appending per-batch partials and aggregating when reading, keeps
writes cheap but leaves every reader (notebooks, the quota step) to redo the aggregation, and a
table whose rows are not the usage. Cost of the choice: a merge rewrites the files holding the
rows it updates (the tenant's current day); compact the table periodically.

Spark's own streaming aggregation was rejected too: it needs a watermark to bound its state,
and a watermark drops the counters of a node whose journal is read late.

Counter records whose payload does not parse, or lacks a field, are left out for now; they
belong in the quarantine table once its writer exists.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 (the idiomatic Spark alias)
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.streaming.query import StreamingQuery

from ingest.source import OPTION_CHECKPOINT, OPTION_MAX_RECORDS, OPTION_PATH, SOURCE_NAME
from schemas.usage import (
    COUNTER_KINDS,
    COUNTER_PAYLOAD_SCHEMA,
    COUNTERS_TOPIC_PREFIX,
    USAGE_KEY,
    USAGE_PARTIAL_SCHEMA,
    USAGE_PARTITION_BY,
    USAGE_SCHEMA,
)
from sinks.delta import conform, read_table
from sinks.upsert import DeltaUpsertWriter, query_table, sql_string, table_exists
from streaming.job import check_checkpoint
from streaming.quota_settings import QuotaSettings
from streaming.settings import PipelineSettings

if TYPE_CHECKING:
    from streaming.quota import QuotaStep

logger = logging.getLogger(__name__)

JOB = "usage"
TABLE = "usage"
APP_ID = "edgebus.usage"

WINDOW = timedelta(minutes=1)
_WINDOW_US = 60_000_000
_US_PER_DAY = 86_400_000_000

COUNTER_SPARK_SCHEMA = from_arrow_schema(COUNTER_PAYLOAD_SCHEMA)
PARTIAL_SPARK_SCHEMA = from_arrow_schema(USAGE_PARTIAL_SCHEMA)

GroupKey = tuple[str, str, date]
"""(tenant, metric, date): one day of one metric of one tenant."""
WindowKey = tuple[str, str, date, datetime]
Row = dict[str, Any]


def transform(df: DataFrame) -> DataFrame:
    """Journal rows to parsed counter records, one per valid ``$counters/{metric}`` record.

    Row by row, so it runs on the stream; :func:`partials` reduces each micro-batch.
    """
    doc = F.from_json(F.col("payload").cast("string"), COUNTER_SPARK_SCHEMA)
    records = df.where(F.col("topic").startswith(COUNTERS_TOPIC_PREFIX)).select(
        # The journal's tenant and node columns, not the payload's: the edge wrote those.
        "tenant",
        "node",
        "seq",
        F.expr(f"substr(topic, {len(COUNTERS_TOPIC_PREFIX) + 1})").alias("metric"),
        doc.alias("c"),
    )
    end_us = F.unix_micros(F.col("c.interval_end"))
    window_us = end_us - F.pmod(end_us, F.lit(_WINDOW_US))
    return records.where(
        (F.col("metric") != "")
        & ~F.col("metric").contains("/")
        & F.col("c.kind").isin(*COUNTER_KINDS)
        & F.col("c.delta").isNotNull()
        & F.col("c.total").isNotNull()
        & F.col("c.interval_end").isNotNull()
    ).select(
        "tenant",
        "metric",
        F.col("c.kind").alias("kind"),
        F.timestamp_micros(window_us).alias("window_start"),
        # UTC day from epoch micros, whatever the session time zone (as in streaming.history).
        F.date_from_unix_date(F.floor(window_us / _US_PER_DAY).cast("int")).alias("date"),
        "node",
        "seq",
        F.col("c.delta").alias("delta"),
        F.col("c.total").alias("total"),
        F.col("c.interval_end").alias("interval_end"),
    )


def partials(records: DataFrame) -> DataFrame:
    """One micro-batch of :func:`transform` rows to ``USAGE_PARTIAL_SCHEMA``: one row per
    tenant, metric, window and node (a counter's deltas summed, a gauge's last value)."""
    grouped = records.groupBy("tenant", "metric", "kind", "window_start", "date", "node").agg(
        F.sum("delta").alias("delta_sum"),
        # A gauge's value in the window is the one reported last (seq breaks a tie).
        F.max_by("total", F.struct("interval_end", "seq")).alias("last_total"),
        F.max("interval_end").alias("reported_at"),
    )
    value = F.when(F.col("kind") == "gauge", F.col("last_total")).otherwise(F.col("delta_sum"))
    return grouped.select(
        *[
            (value if field.name == "value" else F.col(field.name))
            .cast(field.dataType)
            .alias(field.name)
            for field in PARTIAL_SPARK_SCHEMA.fields
        ]
    )


def combine(
    parts: Iterable[Row], stored: Iterable[Row], bases: Mapping[GroupKey, int]
) -> tuple[list[Row], dict[GroupKey, int]]:
    """Add a batch's partials to the stored usage rows; the rows to upsert and the day totals.

    ``parts`` are :func:`partials` rows. ``stored`` holds, for every group they touch, each
    stored row from the earliest touched window of that day on (rows of other groups are
    ignored); ``bases`` the ``day_value`` of each group's last stored row before those.
    Returns the rows that are new or changed, and each touched group's ``day_value`` at its
    last window.
    """
    rows: dict[WindowKey, Row] = {}
    before: dict[WindowKey, tuple[Any, ...]] = {}
    for row in stored:
        key = _window_key(row)
        rows[key] = row
        before[key] = _content(row)
    touched: set[GroupKey] = set()
    for part in parts:
        key = _window_key(part)
        touched.add(key[:3])
        if key not in rows:
            rows[key] = {
                "tenant": part["tenant"],
                "metric": part["metric"],
                "kind": part["kind"],
                "window_start": part["window_start"],
                "window_end": part["window_start"] + WINDOW,
                "value": 0,
                "day_value": 0,
                "nodes": [],
                "date": part["date"],
            }
        _add_part(rows[key], part)
    by_group: dict[GroupKey, list[Row]] = defaultdict(list)
    for key, row in rows.items():
        if key[:3] in touched:
            by_group[key[:3]].append(row)
    totals: dict[GroupKey, int] = {}
    for group, group_rows in by_group.items():
        running = bases.get(group)
        for row in sorted(group_rows, key=lambda r: r["window_start"]):
            value = row["value"]
            if running is None:
                running = value
            elif row["kind"] == "gauge":
                running = max(running, value)
            else:
                running += value
            row["day_value"] = running
        assert running is not None
        totals[group] = running
    changed = [
        row
        for key, row in sorted(rows.items())
        if key[:3] in touched and before.get(key) != _content(row)
    ]
    return changed, totals


def _add_part(row: Row, part: Row) -> None:
    nodes = {entry["node"]: entry for entry in row["nodes"]}
    entry = nodes.get(part["node"])
    if entry is None:
        nodes[part["node"]] = {
            "node": part["node"],
            "value": part["value"],
            "reported_at": part["reported_at"],
        }
    elif row["kind"] == "gauge":
        if part["reported_at"] >= entry["reported_at"]:
            entry["value"] = part["value"]
            entry["reported_at"] = part["reported_at"]
    else:
        entry["value"] += part["value"]
        entry["reported_at"] = max(entry["reported_at"], part["reported_at"])
    row["nodes"] = [nodes[name] for name in sorted(nodes)]
    row["value"] = sum(entry["value"] for entry in row["nodes"])


def _window_key(row: Row) -> WindowKey:
    return (row["tenant"], row["metric"], row["date"], row["window_start"])


def _content(row: Row) -> tuple[Any, ...]:
    nodes = tuple((n["node"], n["value"], n["reported_at"]) for n in row["nodes"])
    return (row["value"], row["day_value"], nodes)


class UsageWriter:
    """Upserts micro-batches of partials into ``usage``, exactly once per batch id."""

    def __init__(self, settings: PipelineSettings) -> None:
        self.delta = DeltaUpsertWriter(
            settings.table_path(TABLE), APP_ID, USAGE_SCHEMA, USAGE_PARTITION_BY
        )

    def write(self, batch_id: int, parts: pa.Table) -> dict[GroupKey, int]:
        """Add the partials of batch ``batch_id``; the day totals of the groups it changed.

        Empty when nothing was committed: no counter records, or a replayed batch.
        """
        data = conform(parts, USAGE_PARTIAL_SCHEMA)
        if data.num_rows == 0:
            return {}
        done = self.delta.last_batch_id()
        if done is not None and done >= batch_id:
            logger.info("usage: batch %d already committed, skipping replay", batch_id)
            return {}
        rows = data.to_pylist()
        stored, bases = self._stored(rows)
        changed, totals = combine(rows, stored, bases)
        table = pa.Table.from_pylist(changed, schema=USAGE_SCHEMA)
        self.delta.upsert(batch_id, table, USAGE_KEY)
        return totals

    def _stored(self, parts: list[Row]) -> tuple[list[Row], dict[GroupKey, int]]:
        """The stored rows ``combine`` needs, read per UTC day the partials touch."""
        if not table_exists(self.delta.path):
            return [], {}
        stored: list[Row] = []
        bases: dict[GroupKey, int] = {}
        for day in sorted({p["date"] for p in parts}):
            day_parts = [p for p in parts if p["date"] == day]
            first = min(p["window_start"] for p in day_parts)
            where = (
                f"date = DATE '{day.isoformat()}'"
                f" AND tenant IN ({_sql_list(p['tenant'] for p in day_parts)})"
                f" AND metric IN ({_sql_list(p['metric'] for p in day_parts)})"
            )
            since = f"TIMESTAMP '{first.isoformat()}'"
            stored += read_table(
                self.delta.path, f"{where} AND window_start >= {since}", schema=USAGE_SCHEMA
            ).to_pylist()
            # Each group's running day_value just before the first touched window.
            last_before = query_table(
                self.delta.path,
                # Read-only, over one table; every literal is a date or quoted by sql_string.
                "SELECT tenant, metric, day_value FROM ("  # noqa: S608
                " SELECT tenant, metric, day_value, row_number() OVER"
                "  (PARTITION BY tenant, metric ORDER BY window_start DESC) AS newest"
                f" FROM t WHERE {where} AND window_start < {since}"
                ") WHERE newest = 1",
            )
            for row in last_before.to_pylist():
                bases[(row["tenant"], row["metric"], day)] = row["day_value"]
        return stored, bases


def _sql_list(values: Iterable[str]) -> str:
    return ", ".join(sql_string(v) for v in sorted(set(values)))


class _BatchSink:
    """The ``foreachBatch`` function: usage first, then the quota step (if any)."""

    def __init__(self, writer: UsageWriter, quota: QuotaStep | None) -> None:
        self._writer = writer
        self._quota = quota

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        totals = self._writer.write(batch_id, partials(batch).toArrow())
        if self._quota is not None:
            self._quota.run(batch_id, totals)


def start(
    spark: SparkSession, settings: PipelineSettings, quota: QuotaSettings | None = None
) -> StreamingQuery:
    """Start the usage query (with the quota step when ``quota`` is given); runs until stopped.

    With or without ``quota`` it is the same query (name, checkpoint, Delta app id), so quota
    enforcement can be switched on and off across restarts.
    """
    checkpoint = settings.checkpoint_path(JOB)
    writer = UsageWriter(settings)
    check_checkpoint(checkpoint, writer.delta)
    step = None
    if quota is not None:
        from streaming.quota import QuotaStep  # quota imports this module's names

        step = QuotaStep(settings, quota)
        check_checkpoint(checkpoint, step.events)
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
        .foreachBatch(_BatchSink(writer, step))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime=f"{settings.trigger_interval_seconds} seconds")
        .start()
    )
    logger.info(
        "started %s: %s -> %s (quota %s)",
        JOB,
        settings.journal_root,
        writer.delta.path,
        "on" if step is not None else "off",
    )
    return query


@dataclass(frozen=True, slots=True)
class UsageJob:
    """The usage job bound to its quota settings, as a :class:`streaming.pipeline.Job`."""

    quota: QuotaSettings | None = None

    def start(self, spark: SparkSession, settings: PipelineSettings) -> StreamingQuery:
        return start(spark, settings, self.quota)
