"""The usage step: the edges' ``$counters/{metric}`` records into the Delta ``usage`` table, then
(when configured) the quota step of :mod:`streaming.quota` after every batch.

Theory of operation
-------------------
Every edge publishes, per tenant and metric, one counter record per counter interval (default
10 s); they are journaled like any publish. ``transform`` keeps those records, parses their
JSON payload and assigns it its one-minute window; ``partials`` reduces each micro-batch (no
streaming state) to one row per tenant, metric, window and node: a
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

Counter records whose topic or payload breaks the counter contract (:func:`parse`) go to
``quarantine`` with the reason.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from schemas.usage import (
    COUNTER_KINDS,
    COUNTERS_TOPIC_PREFIX,
    USAGE_KEY,
    USAGE_PARTIAL_SCHEMA,
    USAGE_PARTITION_BY,
    USAGE_SCHEMA,
)
from sinks.delta import DeltaBatchWriter, conform, read_table
from sinks.quarantine import quarantine_rows
from sinks.upsert import DeltaUpsertWriter, query_table, sql_string, table_exists
from streaming.quota_settings import QuotaSettings
from streaming.settings import PipelineSettings

if TYPE_CHECKING:
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


def parse(topic: str, payload: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One ``$counters/{metric}`` payload to its parsed fields, or None and the rule it broke.

    The tenant and node come from the journal record, not the payload: the edge wrote those.
    """
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


def transform(records: pa.Table) -> tuple[list[Row], pa.Table]:
    """Journal rows on counter topics to parsed counter records (one dict each: tenant,
    metric, kind, window_start, date, node, seq, delta, total, interval_end), and the records
    that broke the counter contract as ``quarantine`` rows."""
    counters: list[Row] = []
    reasons: list[str | None] = []
    for tenant, node, seq, topic, payload in zip(
        *(
            records.column(name).to_pylist()
            for name in ("tenant", "node", "seq", "topic", "payload")
        ),
        strict=True,
    ):
        fields, reason = parse(topic, payload)
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
    return counters, quarantined


def partials(counters: Iterable[Row]) -> pa.Table:
    """One micro-batch of :func:`transform` records to ``USAGE_PARTIAL_SCHEMA``: one row per
    tenant, metric, window and node (a counter's deltas summed, a gauge's last value)."""
    groups: dict[tuple[Any, ...], Row] = {}
    for c in counters:
        key = (c["tenant"], c["metric"], c["kind"], c["window_start"], c["date"], c["node"])
        group = groups.get(key)
        if group is None:
            groups[key] = group = {"delta": 0, "last": None, "reported_at": c["interval_end"]}
        group["delta"] += c["delta"]
        # A gauge's value in the window is the one reported last (seq breaks a tie).
        order = (c["interval_end"], c["seq"])
        if group["last"] is None or order > group["last"][0]:
            group["last"] = (order, c["total"])
        group["reported_at"] = max(group["reported_at"], c["interval_end"])
    rows = [
        {
            "tenant": tenant,
            "metric": metric,
            "kind": kind,
            "window_start": window_start,
            "date": day,
            "node": node,
            "value": group["last"][1] if kind == "gauge" else group["delta"],
            "reported_at": group["reported_at"],
        }
        for (tenant, metric, kind, window_start, day, node), group in groups.items()
    ]
    return pa.Table.from_pylist(rows, schema=USAGE_PARTIAL_SCHEMA)


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


class UsageStep:
    """Upserts a micro-batch's counters into ``usage``, then runs the quota step (if any)."""

    table = TABLE

    def __init__(self, settings: PipelineSettings, quota: QuotaSettings | None = None) -> None:
        self.usage = UsageWriter(settings)
        self.quota: QuotaStep | None = None
        writers: list[DeltaBatchWriter] = [self.usage.delta]
        if quota is not None:
            from streaming.quota import QuotaStep  # quota imports this module's names

            self.quota = QuotaStep(settings, quota)
            writers.append(self.quota.events)
        self.writers = tuple(writers)

    accepts = staticmethod(accepts)

    def __call__(self, batch_id: int, records: pa.Table) -> pa.Table:
        counters, quarantined = transform(records)
        totals = self.usage.write(batch_id, partials(counters))
        if self.quota is not None:
            self.quota.run(batch_id, totals)
        return quarantined
