"""The quota step: each tenant's usage of the UTC day against its daily limits, decided per
micro-batch of the usage job, recorded in ``quota_events`` and sent to every edge.

Theory of operation
-------------------
Quota metrics are named after their limits and measured by a counter: ``messages_per_day`` by
``messages_in``, ``bytes_per_day`` by ``bytes_in``, each summed over every edge for the current
UTC day (the clock's, so a backlog from yesterday never blocks anyone today). A metric is
``blocked`` at 100 % of its limit, ``warn`` at 80 %, ``ok`` below; no limit is ``ok``.

The step runs inside the usage job's ``foreachBatch``, after the batch's usage commit, so the
usage it reads already holds the batch and cannot lag behind it (a separate query reading
``usage`` would decide on whatever the usage query had committed by then):

1. Day totals come from ``usage`` (durable): read for the whole day once per day and on
   start, then replaced per tenant by the day totals each usage commit reports.
2. Limits come from ``QuotaSettings.load_limits()``, called every batch, so a changed tenants
   file counts from the next batch on. A failing loader keeps the previous limits.
3. The previous state of each tenant and metric is its latest ``quota_events`` row (read once
   on start, then kept in step with what this step commits). A change of state is a new row:
   ``warn``, ``blocked``, or, back under 80 %, ``cleared`` (same day: the limit went up or
   away) or ``ok`` (the day rolled over). The rows carry the batch id as a Delta app
   transaction, in one commit.
4. Only after that commit are the decisions published: for each tenant that changed, its
   decision for every metric it has a recorded state for, the most severe last, retained on
   ``$control/quota/{tenant}`` (an edge keeps one decision per metric, but after a restart it
   knows only the retained one: that must be the one that blocks, if any).

Replays: a batch whose id ``quota_events`` already committed decides nothing; it republishes
the decisions recorded for it. A batch that never committed published nothing, so deciding it
again cannot contradict anything published. The first batch after a start republishes every
tenant's recorded decisions: that also delivers what a broker that was down missed before the
process stopped (within a run, :class:`~sinks.mqtt.DecisionPublisher` retries on each batch).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime
from typing import TYPE_CHECKING, Any

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
from streaming.errors import PipelineConfigError
from streaming.quota_settings import QuotaSettings, TenantLimits
from streaming.settings import PipelineSettings
from streaming.usage import DayUsage, node_parts

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
    """Decides, records and publishes quota states once per usage micro-batch."""

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
        self._day: date | None = None
        self._totals: dict[tuple[str, str], DayUsage] = {}

    def run(self, spark: SparkSession, batch_id: int, committed: DayTotals) -> list[QuotaEvent]:
        """Decide batch ``batch_id``; ``committed``: the day totals its usage commit reported.
        The decisions made (none for a replayed batch: they were made before)."""
        first = self._recorded is None
        recorded = self._recorded = load_recorded(self.events.location) if first else self._recorded
        assert recorded is not None
        republish = {tenant for tenant, _ in recorded} if first else set()
        events: list[QuotaEvent] = []
        confirmed: dict[str, bytes] = {}
        done = self.events.last_batch_id()
        if done is not None and done >= batch_id:
            # A replay: its decisions are recorded; send those again, decide nothing new.
            logger.info("quota: batch %d already decided, republishing its decisions", batch_id)
            republish |= self._tenants_of_batch(batch_id)
        else:
            now = self._quota.clock()
            day_usage = self._day_totals(now.date(), committed)
            limits = self._current_limits()
            events = decide(
                totals={key: total for key, (total, _) in day_usage.items()},
                limits=limits,
                recorded=recorded,
                now=now,
                batch_id=batch_id,
                warn_ratio=self._quota.warn_ratio,
            )
            if events:
                # A handful of decisions made on the driver: the one small write from there.
                rows = spark.createDataFrame(
                    [e.row() for e in events], schema=spark_schema(QUOTA_EVENTS_SCHEMA)
                )
                self.events.append(batch_id, rows)
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
            # The confirmed totals go with every decision and after every usage commit that
            # moved a tenant's day (issue 14): the edges enforce the limits with them.
            moved = {tenant for tenant, _, day in committed if day == now.date()}
            if first:  # after a start: every tenant's, as every decision is republished
                moved |= {tenant for tenant, _ in day_usage}
            confirmed = confirmed_usage(moved | republish, day_usage, limits, now)
        messages = {usage_control_topic(t): [p] for t, p in confirmed.items()}
        messages |= {control_topic(t): decisions(t, recorded) for t in sorted(republish)}
        self._publisher.publish(messages)  # errors are logged and retried next batch
        return events

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

    def _day_totals(self, day: date, committed: DayTotals) -> Mapping[tuple[str, str], DayUsage]:
        if self._day != day:
            self._totals = load_day_totals(self._usage_path, day)
            self._day = day
        else:
            for (tenant, metric, when), total in committed.items():
                if when == day:
                    self._totals[(tenant, metric)] = total
        return self._totals

    def _tenants_of_batch(self, batch_id: int) -> set[str]:
        sql = f"SELECT tenant FROM t WHERE batch_id = {batch_id:d}"  # noqa: S608 (an int)
        rows = query_table(self.events.location, sql)
        return set(rows.column("tenant").to_pylist())


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
