"""The quota step: each tenant's usage of the UTC day against its daily limits, decided per
micro-batch of the journal query, recorded in ``quota_events`` and sent to every edge.

Theory of operation
-------------------
Quota metrics are named after their limits and measured by a counter: ``messages_per_day`` by
``messages_in``, ``bytes_per_day`` by ``bytes_in``, each summed over every edge for the current
UTC day (the clock's, so a backlog from yesterday never blocks anyone today). A metric is
``blocked`` at 100 % of its limit, ``warn`` at 80 %, ``ok`` below; no limit is ``ok``.

The step decides each batch as soon as the stream has read it, ahead of the ``usage`` table
(which is written behind the stream, :mod:`streaming.others`), from the quota lane's thread
(:mod:`streaming.quota_lane`):

1. Day totals are what ``usage`` holds plus what was counted ahead of it. What it holds is
   read for today on start (nothing writes it then), then replaced per group by the day totals
   each usage commit reports (:meth:`QuotaStep.committed`); the lane counts each later batch's
   counter records on the driver (:func:`count_counters`: each node's deltas, what the usage
   step will add), and a batch's counts are dropped once ``usage`` holds it. Both sum the same
   counter records per node, so a decision sees the totals ``usage`` will hold for its batch.
2. Limits come from ``QuotaSettings.load_limits()``, called every batch, so a changed tenants
   file counts from the next batch on. A failing loader keeps the previous limits.
3. The previous state of each tenant and metric is its latest ``quota_events`` row (read once
   on start, then kept in step with what this step decides). A change of state is a new row:
   ``warn``, ``blocked``, or, back under 80 %, ``cleared`` (same day: the limit went up or
   away) or ``ok`` (the day rolled over). The rows carry the batch id as a Delta app
   transaction, in one commit.
4. The decisions are published, for each tenant that changed its decision for every metric
   it has a recorded state for, the most severe last, retained on ``$control/quota/{tenant}``
   (an edge keeps one decision per metric, but after a restart it knows only the retained one:
   that must be the one that blocks, if any), with the confirmed totals (issue 14). They are
   sent *before* their commit (a second or more of Spark job and Delta commit: the reaction
   would wait for it), so first their :class:`Intent` is written and synced in the checkpoint
   directory. A recorder thread commits them (every batch's decisions sent meanwhile in one
   commit, each row with its own batch id), so the next batch is decided meanwhile (a ``warn``
   commit does not hold up the ``blocked`` that follows it); the intent then keeps only what is
   still to commit. A crash in between leaves it, and the next start commits those decisions
   before anything else: what the edges got is what ``quota_events`` says, never a decision
   sent and lost (which a later decision, or none, could contradict).

Replays: a batch whose id ``quota_events`` held at the start decides nothing; it republishes
the decisions recorded for it. A batch that never committed published nothing but its intent's
decisions, committed on start, so deciding it again cannot contradict anything published. The
first batch after a start republishes every tenant's recorded decisions: that also delivers
what a broker that was down missed before the process stopped (within a run,
:class:`~sinks.mqtt.DecisionPublisher` retries on each batch).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from ingest.source import Offset
from schemas import names
from schemas.control import ConfirmedUsage, ControlMessageError, usage_control_topic
from schemas.usage import (
    CONTROL_TOPIC_PREFIX,
    DECISION_FIELDS,
    QUOTA_EVENTS_PARTITION_BY,
    QUOTA_EVENTS_SCHEMA,
)
from sinks.delta import DeltaTableWriter, read_table, spark_schema
from sinks.mqtt import DecisionPublisher
from sinks.storage import LakePath
from sinks.upsert import query_table, sql_string, table_exists
from streaming.checkpoint_files import write_durably
from streaming.errors import PipelineConfigError
from streaming.quota_settings import QuotaSettings, TenantLimits
from streaming.settings import PipelineSettings
from streaming.usage import DayUsage, GroupKey, node_parts

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

TABLE = "quota_events"
USAGE_TABLE = "usage"
APP_ID = "edgebus.quota"

# quota metric (the limit's name in TenantLimits) -> the counter metric that measures it
QUOTA_METRICS = names.QUOTA_METRICS

_SEVERITY = {"ok": 0, "cleared": 0, "warn": 1, "blocked": 2}
_ORDER = {metric: i for i, metric in enumerate(QUOTA_METRICS)}

DayTotals = Mapping[tuple[str, str, date], DayUsage]
"""(tenant, counter metric, UTC date) -> the day's total and each node's part of it, as
reported by the usage writer."""

PendingCounts = dict[tuple[str, int], tuple[GroupKey, int]]
"""(node, seq) of a counter record ``usage`` does not hold yet -> its group (tenant, counter
metric, UTC date) and delta (counted ahead of ``usage``, :func:`count_counters`). Keyed by the
record, so a record counted twice (by the look ahead, then its batch) counts once."""

# The counters that measure a quota metric: the only ones counted ahead of ``usage``.
QUOTA_COUNTERS = frozenset(QUOTA_METRICS.values())
ONE_DAY = timedelta(days=1)
# The look ahead sends a tenant's confirmed totals once its day is past this part of a limit:
# below it no edge is near a stop, and each delivery is a connection the edges log.
AHEAD_RATIO = 0.5


@dataclass(frozen=True, slots=True)
class QuotaEvent:
    """One ``quota_events`` row: a tenant's metric changed state."""

    tenant: str
    metric: str
    limit: int | None
    value: int
    state: str
    decided_at: datetime
    batch_id: int

    @property
    def date(self) -> date:
        return self.decided_at.date()

    @property
    def decision_state(self) -> str:
        """The state the edges get: ``cleared`` and ``ok`` are both ``ok`` to them."""
        return "ok" if self.state == "cleared" else self.state

    @property
    def usage_metric(self) -> str | None:
        """The ``usage`` metric (a counter) that measures this quota metric."""
        return QUOTA_METRICS.get(self.metric)

    def row(self) -> dict[str, object]:
        return {
            "tenant": self.tenant,
            "metric": self.metric,
            "usage_metric": self.usage_metric,
            "limit": self.limit,
            "value": self.value,
            "state": self.state,
            "decided_at": self.decided_at,
            "batch_id": self.batch_id,
            "date": self.date,
        }

    def payload(self) -> bytes:
        """The decision JSON (broker_edge.plim.QuotaDecision) for ``$control/quota/{tenant}``."""
        values = (
            self.decision_state,
            self.metric,
            self.limit,
            self.value,
            self.decided_at.isoformat(timespec="milliseconds"),
        )
        return json.dumps(dict(zip(DECISION_FIELDS, values, strict=True))).encode()


Recorded = dict[tuple[str, str], QuotaEvent]
"""(tenant, quota metric) -> its latest recorded event."""


def classify(value: int, limit: int | None, warn_ratio: float) -> str:
    """``ok``, ``warn`` or ``blocked`` for a day's ``value`` against ``limit``."""
    if limit is None:
        return "ok"
    if value >= limit:
        return "blocked"  # a limit of 0 blocks at once: nothing is allowed
    return "warn" if value >= warn_ratio * limit else "ok"


def decide(
    *,
    totals: Mapping[tuple[str, str], int],
    limits: Mapping[str, TenantLimits],
    recorded: Mapping[tuple[str, str], QuotaEvent],
    now: datetime,
    batch_id: int,
    warn_ratio: float,
) -> list[QuotaEvent]:
    """The state changes: every tenant with limits or a recorded state, every quota metric.

    ``totals``: (tenant, counter metric) -> usage of the UTC day of ``now``.
    """
    tenants = set(limits) | {tenant for tenant, _ in recorded}
    events = []
    for tenant in sorted(tenants):
        tenant_limits = limits.get(tenant, TenantLimits())
        for metric, counter in QUOTA_METRICS.items():
            limit: int | None = getattr(tenant_limits, metric)
            value = totals.get((tenant, counter), 0)
            state = classify(value, limit, warn_ratio)
            previous = recorded.get((tenant, metric))
            was = previous.decision_state if previous is not None else "ok"
            if state == was:
                continue
            if state == "ok":
                assert previous is not None  # "ok" never differs from no record
                state = "ok" if previous.date < now.date() else "cleared"
            events.append(QuotaEvent(tenant, metric, limit, value, state, now, batch_id))
    return events


def decisions(tenant: str, recorded: Mapping[tuple[str, str], QuotaEvent]) -> list[bytes]:
    """The tenant's decision for every metric with a recorded state, the most severe last."""
    latest = [event for (name, _), event in recorded.items() if name == tenant]
    latest.sort(key=lambda e: (_SEVERITY[e.state], _ORDER.get(e.metric, len(_ORDER))))
    return [event.payload() for event in latest]


def control_topic(tenant: str) -> str:
    return CONTROL_TOPIC_PREFIX + tenant


class QuotaStep:
    """Decides, records and publishes quota states: ahead of ``usage``, from what is committed
    there and the counter records of the batches it does not hold yet (see the module's
    docstring). :meth:`committed` is called by the usage step's thread, :meth:`decide_batch` by
    the quota lane's (:class:`streaming.quota_lane.QuotaLane`)."""

    def __init__(
        self,
        settings: PipelineSettings,
        quota: QuotaSettings,
        publisher: DecisionPublisher | None = None,
    ) -> None:
        self.events = DeltaTableWriter(
            settings.table_path(TABLE), APP_ID, QUOTA_EVENTS_SCHEMA, QUOTA_EVENTS_PARTITION_BY
        )
        self._usage_path = settings.table_path(USAGE_TABLE)
        self._quota = quota
        self._publisher = publisher or DecisionPublisher(
            quota.brokers, quota.operator_token, timeout=quota.publish_timeout_seconds
        )
        if not self._publisher.brokers:
            logger.warning("quota: no brokers configured, decisions are recorded only")
        self._recorded: Recorded | None = None
        self._limits: Mapping[str, TenantLimits] | None = None
        # What ``usage`` holds: each group's day total with each node's part, through each
        # node's seq in ``_base_end``; and the counter records after it, counted ahead.
        self._lock = threading.Lock()
        self._base: dict[GroupKey, DayUsage] = {}
        self._base_end: Offset = {}
        self._pending: PendingCounts = {}
        # Decisions sent and not committed yet (in the intent too), committed in order by the
        # recorder's thread; the last batch ``quota_events`` held at the start (a batch up to
        # it is a replay).
        self._intent = Intent(None)
        self._record_lock = threading.Lock()
        self._unrecorded: list[tuple[int, list[QuotaEvent]]] = []
        self._recorder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quota-record")
        self._recordings: list[Future[None]] = []
        self._done_at_start: int | None = None

    def start(self, spark: SparkSession, usage_end: Offset, intent: Path) -> None:
        """Before the query starts (nothing writes ``usage`` meanwhile): what ``usage`` holds
        of today, through each node's seq in ``usage_end``; ``intent``: the decisions sent and not
        committed yet are kept there (:class:`Intent`), committed now if a crash left some."""
        self._intent = Intent(intent)
        left = self._intent.read()
        if left:
            done = self.events.last_batch_id()
            unsent = [(b, events) for b, events in left if done is None or done < b]
            if unsent:
                logger.info(
                    "quota: committing the decisions sent in batches %s", [b for b, _ in unsent]
                )
                self._record(spark, unsent)
            self._intent.write([])
        self._done_at_start = self.events.last_batch_id()
        day = self._quota.clock().date()
        with self._lock:
            loaded = load_day_totals(self._usage_path, day)
            self._base = {
                (tenant, metric, day): usage for (tenant, metric), usage in loaded.items()
            }
            self._base_end = dict(usage_end)
            self._pending = {}

    def committed(self, end: Offset, totals: DayTotals) -> None:
        """``usage`` holds every record through each node's seq in ``end`` now; ``totals``: the
        day totals of the groups its commit touched (the others are as they were)."""
        today = self._quota.clock().date()
        with self._lock:
            for key, usage in totals.items():
                if key[1] in QUOTA_COUNTERS:
                    self._base[key] = usage
            # Older days are never decided on again (a backlog from yesterday blocks nobody).
            self._base = {k: v for k, v in self._base.items() if k[2] >= today - ONE_DAY}
            for node, seq in end.items():
                self._base_end[node] = max(self._base_end.get(node, 0), seq)
            base = self._base_end
            self._pending = {k: v for k, v in self._pending.items() if k[1] > base.get(k[0], 0)}

    def counted(self, counts: PendingCounts) -> set[str]:
        """Counter records counted ahead of ``usage`` (those it holds already are left out);
        the tenants whose day moved (records not counted before)."""
        moved: set[str] = set()
        with self._lock:
            base = self._base_end
            for key, entry in counts.items():
                if key[1] > base.get(key[0], 0) and key not in self._pending:
                    self._pending[key] = entry
                    moved.add(entry[0][0])
        return moved

    def day_totals(self, day: date) -> dict[tuple[str, str], DayUsage]:
        """(tenant, counter) -> the day's total and each node's part: what ``usage`` holds plus
        what was counted ahead of it."""
        with self._lock:
            parts: dict[tuple[str, str], dict[str, int]] = {
                (tenant, metric): dict(nodes)
                for (tenant, metric, when), (_, nodes) in self._base.items()
                if when == day
            }
            for (node, _), ((tenant, metric, when), delta) in self._pending.items():
                if when == day:
                    group = parts.setdefault((tenant, metric), {})
                    group[node] = group.get(node, 0) + delta
        return {
            key: (sum(nodes.values()), dict(sorted(nodes.items()))) for key, nodes in parts.items()
        }

    def confirm_ahead(self, counts: PendingCounts) -> None:
        """Counter records read ahead of the stream (:mod:`streaming.quota_lane`): counted, and
        the confirmed totals of each tenant they moved that is past :data:`AHEAD_RATIO` of a
        limit sent to the edges at once (their local quota, issue 14). Nothing is decided or
        recorded: the batch that holds these records does that."""
        moved = self.counted(counts)
        if not moved or self._limits is None:
            return  # nothing new, or no batch decided yet (the first republishes everything)
        now = self._quota.clock()
        day_usage = self.day_totals(now.date())
        limits = self._limits
        near = {
            tenant
            for tenant in moved
            for metric, counter in QUOTA_METRICS.items()
            if (limit := getattr(limits.get(tenant, TenantLimits()), metric)) is not None
            and day_usage.get((tenant, counter), (0, {}))[0] >= AHEAD_RATIO * limit
        }
        confirmed = confirmed_usage(near, day_usage, limits, now)
        if confirmed:
            self._publisher.publish({usage_control_topic(t): [p] for t, p in confirmed.items()})

    def decide_batch(
        self, spark: SparkSession, batch_id: int, counts: PendingCounts | None
    ) -> list[QuotaEvent]:
        """Decide batch ``batch_id`` (of the stream: every batch through it is read), whose
        quota counters are ``counts`` (None: not counted, ``usage`` brings them later). The
        decisions made (none for a replayed batch: they were made before)."""
        self.check_recorded()
        if counts:
            self.counted(counts)
        first = self._recorded is None
        recorded = self._recorded = load_recorded(self.events.location) if first else self._recorded
        assert recorded is not None
        republish = {tenant for tenant, _ in recorded} if first else set()
        events: list[QuotaEvent] = []
        confirmed: dict[str, bytes] = {}
        done = self._done_at_start
        if done is not None and done >= batch_id:
            # A replay: its decisions are recorded; send those again, decide nothing new.
            logger.info("quota: batch %d already decided, republishing its decisions", batch_id)
            republish |= self._tenants_of_batch(batch_id)
        else:
            now = self._quota.clock()
            day_usage = self.day_totals(now.date())
            limits = self._current_limits()
            events = decide(
                totals={key: total for key, (total, _) in day_usage.items()},
                limits=limits,
                recorded=recorded,
                now=now,
                batch_id=batch_id,
                warn_ratio=self._quota.warn_ratio,
            )
            for event in events:
                logger.info(
                    "quota: tenant %s %s: %s (%d of %s)",
                    event.tenant,
                    event.metric,
                    event.state,
                    event.value,
                    event.limit,
                )
                recorded[(event.tenant, event.metric)] = event
            republish |= {event.tenant for event in events}
            # The confirmed totals go with every decision and after every batch that moved a
            # tenant's day (issue 14): the edges enforce the limits with them.
            moved = {group[0] for group, _ in (counts or {}).values() if group[2] == now.date()}
            if first:  # after a start: every tenant's, as every decision is republished
                moved |= {tenant for tenant, _ in day_usage}
            confirmed = confirmed_usage(moved | republish, day_usage, limits, now)
        messages = {usage_control_topic(t): [p] for t, p in confirmed.items()}
        messages |= {control_topic(t): decisions(t, recorded) for t in sorted(republish)}
        if events:
            # Sent before the (slow) commit, so the intent goes first: a crash before the
            # commit leaves it, and the next start commits what the edges may have had.
            with self._record_lock:
                self._unrecorded.append((batch_id, events))
                self._intent.write(self._unrecorded)
        self._publisher.publish(messages)  # errors are logged and retried next batch
        if events:  # committed by the recorder's thread: the next batch is decided meanwhile
            self._recordings.append(self._recorder.submit(self._record_unrecorded, spark))
        return events

    def wait_recorded(self) -> None:
        """Wait until every decision made is in ``quota_events``; raises the recorder's
        failure."""
        for future in self._recordings:
            future.result()
        self._recordings = [f for f in self._recordings if not f.done()]

    def close(self) -> None:
        """Stop the recorder once what it was given is committed."""
        self._recorder.shutdown(wait=True)

    def check_recorded(self) -> None:
        """Raise the recorder's failure, if a commit failed."""
        done = [f for f in self._recordings if f.done()]
        self._recordings = [f for f in self._recordings if not f.done()]
        for future in done:
            future.result()  # a commit's failure fails this batch's decision

    def _record_unrecorded(self, spark: SparkSession) -> None:
        """Commit every decision sent and not committed yet, in one commit as the newest
        batch among them; then the intent keeps only what came meanwhile."""
        with self._record_lock:
            taken = list(self._unrecorded)
        if not taken:
            return  # an earlier call committed them
        self._record(spark, taken)
        with self._record_lock:
            del self._unrecorded[: len(taken)]
            self._intent.write(self._unrecorded)

    def _record(self, spark: SparkSession, batches: list[tuple[int, list[QuotaEvent]]]) -> None:
        """Commit the decisions of ``batches`` to ``quota_events`` as the newest of those batch
        ids (a handful of decisions made on the driver: the one small write from there)."""
        rows = spark.createDataFrame(
            [e.row() for _, events in batches for e in events],
            schema=spark_schema(QUOTA_EVENTS_SCHEMA),
        )
        self.events.append(max(batch_id for batch_id, _ in batches), rows)

    def _current_limits(self) -> Mapping[str, TenantLimits]:
        try:
            limits = dict(self._quota.load_limits())
        except Exception as exc:  # whatever the loader raises (a file being edited): keep going
            if self._limits is None:
                raise PipelineConfigError(f"quota: cannot load the tenants' limits: {exc}") from exc
            logger.warning("quota: cannot reload the limits, keeping the previous ones: %s", exc)
            return self._limits
        self._limits = limits
        return limits

    def _tenants_of_batch(self, batch_id: int) -> set[str]:
        sql = f"SELECT tenant FROM t WHERE batch_id = {batch_id:d}"  # noqa: S608 (an int)
        rows = query_table(self.events.location, sql)
        return set(rows.column("tenant").to_pylist())


class Intent:
    """The decisions sent to the edges and not committed yet, per batch: a small JSON file in
    the query's checkpoint directory, written atomically and synced before they are sent,
    rewritten as they are committed (None: kept nowhere, the tests' steps)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def write(self, batches: list[tuple[int, list[QuotaEvent]]]) -> None:
        """Keep ``batches`` (none: remove the file)."""
        if self.path is None:
            return
        if not batches:
            self.path.unlink(missing_ok=True)
            return
        doc = [
            {
                "batch_id": batch_id,
                "events": [
                    {**e.row(), "decided_at": e.decided_at.isoformat(), "date": None}
                    for e in events
                ],
            }
            for batch_id, events in batches
        ]
        write_durably(self.path, json.dumps(doc))

    def read(self) -> list[tuple[int, list[QuotaEvent]]]:
        if self.path is None:
            return []
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
            return [(int(entry["batch_id"]), _intended(entry["events"])) for entry in doc]
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError) as exc:
            raise PipelineConfigError(
                f"{self.path}: not the quota decisions this pipeline wrote ({exc}); they were "
                "sent to the edges but not committed: remove the file to go on without them"
            ) from exc


def _intended(rows: list[dict[str, Any]]) -> list[QuotaEvent]:
    """An intent's events (``decided_at`` as ISO text in the JSON)."""
    return list(
        _events({**row, "decided_at": datetime.fromisoformat(row["decided_at"])} for row in rows)
    )


def count_counters(counters: pa.Table) -> PendingCounts:
    """Counter records (``COUNTER_RECORD_SCHEMA``, the route's) to what the usage step will add
    for the quota counters: each record's group (tenant, counter, date) and delta."""
    kept = counters.filter(
        pc.and_(
            pc.equal(counters.column("kind"), "counter"),
            pc.is_in(counters.column("metric"), pa.array(sorted(QUOTA_COUNTERS))),
        )
    )
    columns = ("node", "seq", "tenant", "metric", "date", "delta")
    rows = zip(*(kept.column(name).to_pylist() for name in columns), strict=True)
    return {
        (node, seq): ((tenant, metric, day), delta)
        for node, seq, tenant, metric, day, delta in rows
    }


def load_recorded(path: LakePath | str, where: str | None = None) -> Recorded:
    """The latest ``quota_events`` row of every tenant and metric ({} without a table).

    ``where``, a SQL condition, limits the rows considered; on the partition columns
    (``tenant``, ``date``) it also limits the files read (``edgebus usage``).
    """
    if not table_exists(path):
        return {}
    condition = f" WHERE {where}" if where else ""
    rows = query_table(
        path,
        # Read-only, over one table; the condition is SQL by contract.
        'SELECT tenant, metric, "limit", value, state, decided_at, batch_id FROM ('  # noqa: S608
        " SELECT *, row_number() OVER (PARTITION BY tenant, metric ORDER BY batch_id DESC)"
        f" AS newest FROM t{condition}"
        ") WHERE newest = 1",
    )
    return {(e.tenant, e.metric): e for e in _events(rows.to_pylist())}


def _events(rows: Iterable[dict[str, Any]]) -> Iterable[QuotaEvent]:
    for row in rows:
        yield QuotaEvent(
            tenant=row["tenant"],
            metric=row["metric"],
            limit=row["limit"],
            value=row["value"],
            state=row["state"],
            decided_at=row["decided_at"],
            batch_id=row["batch_id"],
        )


def load_day_totals(usage_path: LakePath | str, day: date) -> dict[tuple[str, str], DayUsage]:
    """(tenant, counter metric) -> the day's total in ``usage`` and each node's part of it,
    for the quota metrics (read once a day and on start: a day's windows of every tenant)."""
    if not table_exists(usage_path):
        return {}
    metrics = ", ".join(sql_string(m) for m in QUOTA_METRICS.values())
    rows = read_table(
        usage_path,
        # Every literal is a date or quoted by sql_string.
        f"date = DATE '{day.isoformat()}' AND metric IN ({metrics})",
        ["tenant", "metric", "nodes"],
    )
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows.to_pylist():
        groups[(row["tenant"], row["metric"])].append(row)
    totals: dict[tuple[str, str], DayUsage] = {}
    for key, windows in groups.items():
        parts = node_parts(windows)
        totals[key] = (sum(parts.values()), parts)
    return totals


def confirmed_usage(
    tenants: Iterable[str],
    totals: Mapping[tuple[str, str], DayUsage],
    limits: Mapping[str, TenantLimits],
    now: datetime,
) -> dict[str, bytes]:
    """tenant -> its ``$control/usage/{tenant}`` payload (``schemas.control.ConfirmedUsage``)
    for the tenants in ``tenants`` with a quota counter today; ``totals`` are of ``now``'s day."""
    out: dict[str, bytes] = {}
    decided_at = now.isoformat(timespec="milliseconds")
    for tenant in sorted(set(tenants)):
        counts = {
            counter: totals[(tenant, counter)]
            for counter in QUOTA_METRICS.values()
            if (tenant, counter) in totals
        }
        if not counts:
            continue
        tenant_limits = limits.get(tenant, TenantLimits())
        try:
            message = ConfirmedUsage(
                tenant,
                now.date(),
                counts,
                {metric: getattr(tenant_limits, metric) for metric in QUOTA_METRICS},
                decided_at,
            )
        except ControlMessageError as exc:  # our bug: keep deciding, the edges count alone
            logger.warning("quota: no confirmed usage for tenant %s: %s", tenant, exc)
            continue
        out[tenant] = message.payload()
    return out
