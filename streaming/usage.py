"""The usage step: the edges' ``$counters/{metric}`` records into the Delta ``usage`` table;
each commit tells the quota step (:mod:`streaming.quota`, when configured) what it holds.

Theory of operation
-------------------
Every edge publishes, per tenant and metric, one counter record per counter interval (default
2 s); they are journaled like any publish. ``transform`` (run on the executors by the
pipeline's route, ``streaming.route``) keeps those records, parses their JSON payload and
assigns it its one-minute window; :func:`partials` (a Spark aggregation) reduces each
micro-batch (no streaming state) to one row per tenant, metric, window and node: a counter's
deltas summed, a gauge's value reported last. A counter interval belongs to the window its
``interval_end`` falls in (the moment it was reported).

A minute spans micro-batches (intervals from several edges, journals read at different
paces, a node catching up late), so the sink *upserts*: the batch's partials are cogrouped by
partition ``(tenant, date)`` with the partition's stored rows, and :func:`combine_partition`
(on the executors, one partition at a time) adds the partials node by node, per metric (each
row keeps its per-node parts in ``nodes``: without them a gauge could not be combined across
batches), recomputes ``value`` and the running ``day_value`` of every later window of the same
tenant, metric and day, and says which data files hold a row that changed. One Delta commit
(:meth:`~sinks.delta.DeltaTableWriter.replace`) removes those files and adds the changed rows
and the other rows of those files: a merge's copy-on-write, planned in the one pass that
combines. Only each group's day total and the replaced files' names reach the driver.

Why not Delta's MERGE: it joins the batch with the table again to find the files to rewrite,
then rewrites them, and checks the app transaction by rebuilding the table's state, though the
cogroup already knows the answer: the step took 6.0 s a batch with MERGE against 3.9 s now
(``bench.usage_step``, BENCHMARKS.md, issues 18 and 12). The changed rows and the kept rows
go to files of their own: the next batch most likely changes the same windows (the current
minute) again, and then replaces only the small file that holds them.

Exactly once: the commit carries the Delta app transaction ``(edgebus.usage, batch_id)``. A
batch replayed after a crash is skipped before anything is read, so its deltas are never added
twice; a crash before the commit leaves the table as it was, and the replay computes the same
rows again. The commit declares the partitions it read: a compaction that replaced their files
first makes it fail, and it is planned again on the new snapshot. The stored rows a batch
builds on were written by earlier batches of this same query only.

The rejected alternative, appending per-batch partials and aggregating when reading, keeps
writes cheap but leaves every reader (notebooks, the quota step) to redo the aggregation, and a
table whose rows are not the usage. Cost of the choice: every batch adds a small file per
partition it touches; compact the table periodically (the pipeline's maintenance does).

Spark's own streaming aggregation was rejected too: it needs a watermark to bound its state,
and a watermark drops the counters of a node whose journal is read late.

Counter records whose topic or payload breaks the counter contract (:func:`parse`) go to
``quarantine`` with the reason; so does any counter record not published by the edge itself
(client ``$edge``) and any counter with a negative delta: no client can move its tenant's usage.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from schemas.usage import (
    COUNTER_KINDS,
    COUNTER_RECORD_SCHEMA,
    COUNTERS_TOPIC_PREFIX,
    EDGE_CLIENT_ID,
    QUOTA_METRIC_SQL,
    USAGE_PARTITION_BY,
    USAGE_SCHEMA,
)
from sinks.delta import FILE_COLUMN, DeltaTableWriter, Replacement, spark_schema
from sinks.quarantine import quarantine_rows
from sinks.upsert import sql_string
from streaming.quota_settings import QuotaSettings
from streaming.settings import PipelineSettings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from ingest.source import Offset
    from sinks.mqtt import DecisionPublisher
    from streaming.quota import QuotaStep

logger = logging.getLogger(__name__)

TABLE = "usage"
APP_ID = "edgebus.usage"
# The rule name quarantined counter records carry; the reason says which part of it broke.
RULE = "counter_record"

WINDOW = timedelta(minutes=1)
_WINDOW_US = 60_000_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

GroupKey = tuple[str, str, date]
"""(tenant, metric, date): one day of one metric of one tenant."""
WindowKey = tuple[str, str, date, datetime]
Row = dict[str, Any]


def accepts(topics: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """True for the records this step takes: topics under ``$counters/``."""
    return pc.starts_with(topics, COUNTERS_TOPIC_PREFIX)


def parse(
    topic: str, payload: bytes, client_id: str = EDGE_CLIENT_ID
) -> tuple[dict[str, Any] | None, str | None]:
    """One ``$counters/{metric}`` payload to its parsed fields, or None and the rule it broke.

    The tenant and node come from the journal record, not the payload: the edge wrote those.
    ``client_id`` is the record's publisher: only the edge's own counters count.
    """
    if client_id != EDGE_CLIENT_ID:
        return None, f"published by client {client_id!r}, not by the edge ({EDGE_CLIENT_ID})"
    metric = topic[len(COUNTERS_TOPIC_PREFIX) :]
    if not metric or "/" in metric:
        return None, f"topic {topic} does not name one metric"
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        return None, "payload is not a JSON object"
    if doc.get("kind") not in COUNTER_KINDS:
        return None, f"field 'kind' is not one of {', '.join(COUNTER_KINDS)}"
    for name in ("delta", "total"):
        if not isinstance(doc.get(name), int) or isinstance(doc.get(name), bool):
            return None, f"field {name!r} is missing, null or not an integer"
    if doc["kind"] == "counter" and doc["delta"] < 0:
        return None, "field 'delta' is negative: a counter only grows"
    end = _timestamp(doc.get("interval_end"))
    if end is None:
        return None, "field 'interval_end' is missing or not an ISO 8601 time"
    return {
        "metric": metric,
        "kind": doc["kind"],
        "delta": doc["delta"],
        "total": doc["total"],
        "interval_end": end,
    }, None


def transform(records: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Journal rows on counter topics to parsed counter records (``COUNTER_RECORD_SCHEMA``),
    and the records that broke the counter contract as ``quarantine`` rows."""
    counters: list[Row] = []
    reasons: list[str | None] = []
    for tenant, node, seq, client_id, topic, payload in zip(
        *(
            records.column(name).to_pylist()
            for name in ("tenant", "node", "seq", "client_id", "topic", "payload")
        ),
        strict=True,
    ):
        fields, reason = parse(topic, payload, client_id)
        reasons.append(reason)
        if fields is None:
            continue
        end_us = _micros(fields["interval_end"])
        window_us = end_us - end_us % _WINDOW_US
        window_start = _EPOCH + timedelta(microseconds=window_us)
        counters.append(
            {
                "tenant": tenant,
                "node": node,
                "seq": seq,
                "window_start": window_start,
                "date": window_start.date(),
                **fields,
            }
        )
    broken = pc.is_valid(pa.array(reasons, pa.string()))
    quarantined = quarantine_rows(
        records.filter(broken),
        TABLE,
        RULE,
        pa.array([r for r in reasons if r is not None], pa.string()),
    )
    return pa.Table.from_pylist(counters, schema=COUNTER_RECORD_SCHEMA), quarantined


def partials(counters: DataFrame) -> DataFrame:
    """Counter records (``COUNTER_RECORD_SCHEMA``) to ``USAGE_PARTIAL_SCHEMA`` rows: one per
    tenant, metric, window and node (a counter's deltas summed, a gauge's value reported last,
    ``seq`` breaking a tie), as a Spark aggregation on the executors."""
    from pyspark.sql import functions as F  # noqa: N812

    keys = ("tenant", "metric", "kind", "window_start", "date", "node")
    grouped = counters.groupBy(*keys).agg(
        F.sum("delta").alias("summed"),
        F.max_by("total", F.struct("interval_end", "seq")).alias("last"),
        F.max("interval_end").alias("reported_at"),
    )
    value = F.when(F.col("kind") == "gauge", F.col("last")).otherwise(F.col("summed"))
    return grouped.select(*keys, value.cast("bigint").alias("value"), "reported_at")


def _timestamp(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    # A time without an offset is UTC, as everywhere in the pipeline.
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _micros(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(microseconds=1)


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


DayUsage = tuple[int, dict[str, int]]
"""A group's day total and each node's part of it."""


def node_parts(rows: Iterable[Row]) -> dict[str, int]:
    """Each node's part of the day over usage ``rows`` (one group's windows): its values
    summed. Meant for counters (a gauge's parts do not add up to anything)."""
    parts: dict[str, int] = defaultdict(int)
    for row in rows:
        for entry in row["nodes"]:
            parts[entry["node"]] += entry["value"]
    return dict(sorted(parts.items()))


# What :func:`combine_partition` hands back: rows of four kinds (column ``entry``), each with
# the columns its kind names and nulls in the others.
ENTRY = "entry"
WRITE = "write"  # a usage row, new or changed (the USAGE_SCHEMA columns)
KEEP = "keep"  # a stored row, unchanged, in a file the batch replaces: written again as it is
FILE = "file"  # a data file the batch replaces: its name (``file``) and how many of its rows
# are kept (``kept``)
TOTAL = "total"  # a group's day total and each node's part of it (the confirmed totals the
# quota step sends the edges, issue 14): ``tenant``, ``metric``, ``date``, ``day_total``,
# ``day_nodes`` (sorted by node)
DAY_NODE = pa.struct(
    [pa.field("node", pa.string(), nullable=False), pa.field("value", pa.int64(), nullable=False)]
)
PLANNED_SCHEMA = pa.schema(
    [
        pa.field(ENTRY, pa.string(), nullable=False),
        *(field.with_nullable(True) for field in USAGE_SCHEMA),
        pa.field("day_total", pa.int64()),
        pa.field("day_nodes", pa.list_(pa.field("element", DAY_NODE, nullable=False))),
        pa.field("file", pa.string()),
        pa.field("kept", pa.int64()),
    ]
)

_PARTITION = ("tenant", "date")


def combine_day(part_rows: list[Row], stored_rows: list[Row]) -> tuple[list[Row], DayUsage]:
    """One group's (tenant, metric, date) partials added to its stored rows of that day: the
    rows that are new or changed, and the group's day total with each node's part of it."""
    first = min(p["window_start"] for p in part_rows)
    bases: dict[GroupKey, int] = {}
    before = [row for row in stored_rows if row["window_start"] < first]
    if before:
        newest = max(before, key=lambda row: row["window_start"])
        bases[_window_key(newest)[:3]] = newest["day_value"]
    later = [row for row in stored_rows if row["window_start"] >= first]
    changed, totals = combine(part_rows, later, bases)
    keys = {_window_key(row) for row in changed}
    day = [*before, *(row for row in later if _window_key(row) not in keys), *changed]
    (total,) = totals.values()  # the one group's
    return changed, (total, node_parts(day))


def combine_partition(parts: pa.Table, stored: pa.Table) -> pa.Table:
    """One partition's (tenant, date) partials (``USAGE_PARTIAL_SCHEMA``) added to its stored
    rows (``USAGE_SCHEMA`` and the data file each is in, ``FILE_COLUMN``): the pure step the
    usage commit runs on the executors, one partition at a time (a Spark cogroup).

    Returns ``PLANNED_SCHEMA`` rows: the new and changed rows, each group's day total, the
    files holding a changed row, and the other rows of those files (a file is replaced
    whole). Rows in other files are left where they are."""
    if parts.num_rows == 0:
        return PLANNED_SCHEMA.empty_table()
    stored_rows = stored.to_pylist()
    files = {_window_key(row): row.pop(FILE_COLUMN) for row in stored_rows}
    part_groups: dict[str, list[Row]] = defaultdict(list)
    for part in parts.to_pylist():
        part_groups[part["metric"]].append(part)
    stored_groups: dict[str, list[Row]] = defaultdict(list)
    for row in stored_rows:
        stored_groups[row["metric"]].append(row)
    planned: list[Row] = []
    rewritten: set[WindowKey] = set()
    for metric, part_rows in sorted(part_groups.items()):
        changed, (total, day_nodes) = combine_day(part_rows, stored_groups[metric])
        planned += [{**row, ENTRY: WRITE} for row in changed]
        rewritten |= {_window_key(row) for row in changed}
        first = part_rows[0]
        planned.append(
            {
                ENTRY: TOTAL,
                "tenant": first["tenant"],
                "metric": metric,
                "date": first["date"],
                "day_total": total,
                "day_nodes": [{"node": n, "value": v} for n, v in day_nodes.items()],
            }
        )
    replaced = {files[key] for key in rewritten if key in files}
    kept = [
        {**row, ENTRY: KEEP}
        for row in stored_rows
        if files[_window_key(row)] in replaced and _window_key(row) not in rewritten
    ]
    planned += kept
    kept_in = Counter(files[_window_key(row)] for row in kept)
    planned += [{ENTRY: FILE, "file": name, "kept": kept_in[name]} for name in sorted(replaced)]
    return pa.Table.from_pylist(planned, schema=PLANNED_SCHEMA)


class UsageWriter:
    """Upserts micro-batches of counter records into ``usage``, exactly once per batch id."""

    def __init__(self, settings: PipelineSettings) -> None:
        self.delta = DeltaTableWriter(
            settings.table_path(TABLE), APP_ID, USAGE_SCHEMA, USAGE_PARTITION_BY
        )

    def write(
        self, batch_id: int, counters: DataFrame, touched: Collection[tuple[str, date]]
    ) -> dict[GroupKey, DayUsage]:
        """Add the counter records of batch ``batch_id``, whose partitions (tenant, date) are
        ``touched``; the day totals of the groups it touched, with each node's part (the only
        rows that reach the driver).

        Empty for a batch without counter records, or a replayed one.
        """
        if not touched:
            return {}
        parts = partials(counters)
        partitions = _partitions(touched)
        totals = self.delta.replace(
            batch_id, counters.sparkSession, partitions, lambda stored: _plan(parts, stored)
        )
        return totals or {}


def _plan(parts: DataFrame, stored: DataFrame) -> Replacement[dict[GroupKey, DayUsage]]:
    """The usage commit's replacement (:meth:`sinks.delta.DeltaTableWriter.replace`): the
    batch's partials combined with the stored rows of their partitions, on the executors; the
    day totals and the names of the replaced files reach the driver."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F  # noqa: N812

    planned = (
        parts.groupBy(*_PARTITION)
        .cogroup(stored.groupBy(*_PARTITION))
        .applyInArrow(combine_partition, spark_schema(PLANNED_SCHEMA))
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    small = (
        planned.where(F.col(ENTRY).isin(TOTAL, FILE))
        .select(ENTRY, "tenant", "metric", "date", "day_total", "day_nodes", "file", "kept")
        .collect()
    )
    totals = {
        (row["tenant"], row["metric"], row["date"]): (
            int(row["day_total"]),
            {entry["node"]: int(entry["value"]) for entry in row["day_nodes"]},
        )
        for row in small
        if row[ENTRY] == TOTAL
    }
    replaced = [row["file"] for row in small if row[ENTRY] == FILE]
    # Changed rows and the rows kept from replaced files go to files of their own: the next
    # batch most likely changes the same rows again, and then their file holds only those.
    kinds = [WRITE, KEEP] if any(row["kept"] for row in small if row[ENTRY] == FILE) else [WRITE]
    # Each row's quota_metric from its metric, the kept rows' too (rows written before the
    # column existed hold null there).
    columns = [
        F.expr(QUOTA_METRIC_SQL).alias(name) if name == "quota_metric" else F.col(name)
        for name in USAGE_SCHEMA.names
    ]
    return Replacement(
        rows=[planned.where(F.col(ENTRY) == kind).select(*columns) for kind in kinds],
        replaced=replaced,
        result=totals,
        release=planned.unpersist,
    )


def _partitions(touched: Iterable[tuple[str, date]]) -> str:
    """The SQL condition selecting the partitions ``touched`` (tenant, date)."""
    return " OR ".join(
        f"(tenant = {sql_string(tenant)} AND date = DATE '{day.isoformat()}')"
        for tenant, day in sorted(set(touched))
    )


class UsageStep:
    """Upserts a micro-batch's counters into ``usage``, then tells the quota step (if any) what
    ``usage`` holds now (the quota step decides ahead of it: :mod:`streaming.quota_lane`)."""

    table = TABLE

    def __init__(
        self,
        settings: PipelineSettings,
        quota: QuotaSettings | None = None,
        publisher: DecisionPublisher | None = None,
    ) -> None:
        self.usage = UsageWriter(settings)
        self.quota: QuotaStep | None = None
        writers: list[DeltaTableWriter] = [self.usage.delta]
        if quota is not None:
            from streaming.quota import QuotaStep  # quota imports this module's names

            self.quota = QuotaStep(settings, quota, publisher)
            writers.append(self.quota.events)
        self.writers = tuple(writers)

    def __call__(
        self,
        batch_id: int,
        end: Offset,
        counters: DataFrame | None,
        touched: Collection[tuple[str, date]],
    ) -> None:
        """Batch ``batch_id``'s counter records (None: the batch has none), of the partitions
        (tenant, date) ``touched``, into ``usage``; the quota step learns the day totals the
        commit reports (every record through each node's seq in ``end`` is in ``usage`` now)."""
        totals = self.usage.write(batch_id, counters, touched) if counters is not None else {}
        if self.quota is not None:
            self.quota.committed(end, totals)
