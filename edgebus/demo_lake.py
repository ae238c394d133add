"""A small demo lake, made by the real pipeline, for the analyst notebooks and their test.

    python -m edgebus.demo_lake --data-dir demo/data --lake demo/lake
    EDGEBUS_LAKE=demo/lake jupyter-execute notebooks/fleet_history.ipynb --output=/tmp/fleet.ipynb
    edgebus quality --lake demo/lake

Fifteen minutes of one edge node's journal, ending now or at ``--end TIME`` (before midnight
UTC, so it is one day): two tenants' vehicles publishing telemetry and status, dashboards
subscribed, and the edge's own log events (``broker_edge.plim.log_event``) and counters
(``broker_edge.plim.counter_messages``), journaled as an edge does. Then :func:`build` runs the
pipeline (every job and the quota step) once per five-minute phase, so the tables have several
versions and tenant ``acme``'s quota goes ``warn`` (run 1: 80 % of its limit), ``blocked``
(run 2: past it; the edge refuses acme from then on) and ``cleared`` (run 3, after its limit
was raised). The quota step's clock is the end of each phase. Last, one quality run (what the
pipeline's quality schedule runs, ``streaming.quality.run_quality``) over the tables, so
``edgebus quality`` and the notebooks have a result to show.

The events are made by the edge's own code, so their shapes are a real edge's: the details of
``connect``, ``disconnect`` and ``subscribe`` by the builders the broker uses
(``broker_edge.plim``), and the quota events by the edge's policy
(``broker_edge.tenancy.Tenancy.apply_quota``) applying the decisions the pipeline recorded in
``quota_events``, as an edge applies them from ``$control/quota/{tenant}``.

:class:`DemoLake` says what was written, so a test can compare what the notebooks read with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker_edge.packets import ReasonCode
from broker_edge.plim import (
    connect_details,
    counter_messages,
    disconnect_details,
    log_event,
    subscribe_details,
)
from broker_edge.tenancy import LogEvent, Tenancy

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from ingest.journal import JournalWriter
    from sinks.storage import LakePath

NODE = "edge-demo"
DASHBOARD = "dashboard"
FLEETS: Mapping[str, tuple[str, ...]] = {
    "acme": ("veh-01", "veh-02", "veh-03", "veh-04"),
    "globex": ("veh-11", "veh-12"),
}
LIMITED = "acme"
# acme's messages_per_day: a phase is 4 vehicles x (20 telemetry + 5 status) = 100 messages,
# 83 % of 120 after run 1 (warn), 167 % after run 2 (blocked); 20 % of 1000 (cleared).
FIRST_LIMIT = 120
RAISED_LIMIT = 1000
PHASES = 3
PHASE = timedelta(minutes=5)
TICK = timedelta(seconds=5)
TELEMETRY_EVERY = 3  # ticks
STATUS_EVERY = 12
COUNTERS_EVERY = 2


@dataclass(frozen=True, slots=True)
class DemoLake:
    """What :func:`build` journaled, and the ``messages`` table's version after each run."""

    lake: Path
    day: date  # the UTC day of every record
    messages_versions: tuple[int, ...]
    messages_per_run: Mapping[str, tuple[int, ...]]  # tenant -> device publishes of each run
    messages_per_vehicle: Mapping[str, Mapping[str, int]]  # tenant -> vehicle -> publishes
    log_events: Mapping[str, Mapping[str, int]]  # tenant -> event type -> events
    quality: Mapping[str, bool]  # table -> whether the quality run found it good

    def summary(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["lake"] = str(self.lake)
        doc["day"] = self.day.isoformat()
        doc["quality"] = dict(self.quality)
        return doc


@dataclass
class _Edge:
    """Journals what one edge node would: device publishes, log events and counters."""

    writer: JournalWriter
    # The edge's policy: it turns the pipeline's quota decisions into the edge's log events.
    tenancy: Tenancy = field(default_factory=lambda: Tenancy(None, NODE))
    # Demo values, the same in every build; nothing secret.
    rng: random.Random = field(default_factory=lambda: random.Random(7))  # noqa: S311
    totals: dict[str, dict[str, int]] = field(default_factory=dict)
    previous: dict[str, dict[str, int]] = field(default_factory=dict)
    published: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    logged: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    def usage(self, tenant: str) -> dict[str, int]:
        # Every metric the edge reports starts at 0, whichever counter_messages asks for.
        return self.totals.setdefault(tenant, defaultdict(int))

    def publish(self, at: datetime, tenant: str, vehicle: str, kind: str) -> None:
        doc: dict[str, Any] = {"vehicle": vehicle, "ts": at.isoformat(timespec="seconds")}
        if kind == "telemetry":
            doc |= {
                "speed_kmh": round(self.rng.uniform(0, 110), 1),
                "lat": round(48.1 + self.rng.uniform(-0.05, 0.05), 5),
                "lon": round(11.5 + self.rng.uniform(-0.05, 0.05), 5),
                "fuel_pct": round(self.rng.uniform(10, 100), 1),
            }
        else:
            doc |= {"engine": self.rng.choice(["on", "idle"]), "doors": "locked"}
        payload = json.dumps(doc, separators=(",", ":")).encode()
        self.writer.append(
            ts_us=_us(at),
            tenant=tenant,
            client_id=vehicle,
            topic=f"fleet/{vehicle}/{kind}",
            qos=1,
            retain=False,
            payload=payload,
            content_type="application/json",
        )
        self.published[tenant][vehicle] += 1
        usage = self.usage(tenant)
        usage["messages_in"] += 1
        usage["bytes_in"] += len(payload)
        if kind == "telemetry":  # the tenant's dashboard subscribes to fleet/+/telemetry
            usage["messages_out"] += 1
            usage["bytes_out"] += len(payload)

    def log(self, at: datetime, event: LogEvent) -> None:
        """Journal ``event`` as the broker does (``Broker.log_events``)."""
        topic, payload = log_event(
            ts_us=_us(at),
            node=NODE,
            tenant=event.tenant,
            client_id=event.client_id,
            origin=event.origin,
            event=event.event,
            details=dict(event.details),
        )
        self._internal(at, event.tenant, topic, payload)
        self.logged[event.tenant][event.event] += 1

    def connect(self, at: datetime, tenant: str, client_id: str) -> None:
        self.usage(tenant)["sessions"] += 1
        details = connect_details(
            peer=_peer(client_id),
            protocol=5,
            clean_start=True,
            keepalive=60,
            session_present=False,
        )
        self.log(at, LogEvent(tenant, "connect", client_id, details))

    def subscribe(self, at: datetime, tenant: str, client_id: str, topic_filter: str) -> None:
        self.usage(tenant)["subscriptions"] += 1
        details = subscribe_details([topic_filter], [1])  # QoS 1 asked, and granted
        self.log(at, LogEvent(tenant, "subscribe", client_id, details))

    def disconnect(
        self, at: datetime, tenant: str, client_id: str, *, clean: bool, reason_code: int | None
    ) -> None:
        self.usage(tenant)["sessions"] -= 1
        details = disconnect_details(peer=_peer(client_id), clean=clean, reason_code=reason_code)
        self.log(at, LogEvent(tenant, "disconnect", client_id, details))

    def apply_decisions(self, at: datetime, decisions: list[bytes]) -> None:
        """The pipeline's quota decisions for the limited tenant (``$control/quota/...``
        payloads), applied by the edge's policy: the log events it makes for them."""
        for payload in decisions:
            for event in self.tenancy.apply_quota(LIMITED, payload).events:
                self.log(at, event)

    def counters(self, start: datetime, end: datetime) -> None:
        for tenant in sorted(self.totals):
            totals = defaultdict(int, self.totals[tenant])
            for topic, payload in counter_messages(
                node=NODE,
                tenant=tenant,
                totals=totals,
                previous=self.previous.get(tenant, {}),
                start_us=_us(start),
                end_us=_us(end),
            ):
                self._internal(end, tenant, topic, payload)
            self.previous[tenant] = totals

    def _internal(self, at: datetime, tenant: str, topic: str, payload: bytes) -> None:
        self.writer.append(
            ts_us=_us(at),
            tenant=tenant,
            client_id="$edge",  # broker_edge.tenancy.EDGE_CLIENT_ID
            topic=topic,
            qos=0,
            retain=False,
            payload=payload,
        )


def _us(at: datetime) -> int:
    return int(at.timestamp() * 1_000_000)


def _peer(client_id: str) -> str:
    """A client's address as the edge writes it (host:port), the same in every build."""
    return f"127.0.0.1:{50_000 + sum(client_id.encode())}"


def _journal_phase(
    edge: _Edge, phase: int, start: datetime, decisions: list[bytes]
) -> dict[str, int]:
    """One phase of traffic from ``start``, after the edge applied the pipeline's
    ``decisions``; each tenant's device publishes journaled."""
    before = {tenant: edge.published[tenant].total() for tenant in FLEETS}
    edge.apply_decisions(start, decisions)  # run 1's warns acme, run 2's blocks it
    if phase == 0:
        for tenant, vehicles in FLEETS.items():
            for client in (DASHBOARD, *vehicles):
                edge.connect(start, tenant, client)
            edge.subscribe(start, tenant, DASHBOARD, "fleet/+/telemetry")
    elif phase == 2:  # acme is refused from now on: two of its vehicles go
        first, second = FLEETS[LIMITED][2:4]
        edge.disconnect(start, LIMITED, first, clean=True, reason_code=None)  # DISCONNECT
        # Gone silent: the edge closes it when its keepalive runs out.
        edge.disconnect(
            start, LIMITED, second, clean=False, reason_code=ReasonCode.KEEP_ALIVE_TIMEOUT
        )
    ticks = PHASE // TICK
    for tick in range(ticks):
        at = start + tick * TICK
        for tenant, vehicles in FLEETS.items():
            if phase == 2 and tenant == LIMITED:
                continue  # blocked
            for vehicle in vehicles:
                if tick % TELEMETRY_EVERY == 0:
                    edge.publish(at, tenant, vehicle, "telemetry")
                if tick % STATUS_EVERY == 0:
                    edge.publish(at, tenant, vehicle, "status")
        if tick % COUNTERS_EVERY == COUNTERS_EVERY - 1:
            edge.counters(at - (COUNTERS_EVERY - 1) * TICK, at + TICK)
    edge.writer.flush()
    return {tenant: edge.published[tenant].total() - before[tenant] for tenant in FLEETS}


def span_end(now: datetime) -> datetime:
    """When the demo's records end: ``now``, or just before midnight if they would straddle it."""
    if (now - PHASES * PHASE).date() != now.date():
        return datetime.combine(now.date(), time(), UTC) - timedelta(seconds=1)
    return now


def build(
    data_dir: Path,
    lake: Path,
    *,
    now: datetime | None = None,
    spark: SparkSession | None = None,
    quality: bool = True,
) -> DemoLake:
    """Journal the demo under ``data_dir`` and run the pipeline into ``lake``, once per phase,
    then the quality suites (unless ``quality`` is false).

    ``spark``: a session to use (the caller stops it); by default one is built and stopped.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from deltalake import DeltaTable

    from ingest import source
    from ingest.journal import JournalWriter
    from streaming import pipeline
    from streaming.quality import run_quality
    from streaming.quota_settings import QuotaSettings, TenantLimits
    from streaming.session import build_spark
    from streaming.settings import PipelineSettings

    settings = PipelineSettings(
        data_dir=data_dir, lake=lake, master="local[2]", shuffle_partitions=2, driver_memory="1g"
    )
    end = span_end(now if now is not None else datetime.now(UTC))
    start = end - PHASES * PHASE
    limits = {LIMITED: TenantLimits(messages_per_day=FIRST_LIMIT), "globex": TenantLimits()}
    decided_at = [start]
    quota = QuotaSettings(
        load_limits=lambda: dict(limits),
        operator_token="demo",  # noqa: S106 (no broker: decisions are only recorded)
        clock=lambda: decided_at[0],
    )
    if spark is None:
        session = build_spark(settings)  # registers the edgebus source
    else:
        session = spark
        source.register(session)
    per_run: list[dict[str, int]] = []
    versions: list[int] = []
    try:
        with JournalWriter.open(settings.journal_root, NODE, fsync=False) as writer:
            edge = _Edge(writer)
            decisions: list[bytes] = []
            for phase in range(PHASES):
                if phase == PHASES - 1:
                    limits[LIMITED] = TenantLimits(messages_per_day=RAISED_LIMIT)
                per_run.append(_journal_phase(edge, phase, start + phase * PHASE, decisions))
                decided_at[0] = start + (phase + 1) * PHASE
                pipeline.run(settings, once=True, spark=session, quota=quota)
                versions.append(DeltaTable(str(settings.table_path("messages"))).version())
                # What the pipeline sends the edges on $control/quota/{tenant} (retained).
                decisions = quota_decisions(settings.table_path("quota_events"), LIMITED)
        checked = run_quality(session, settings.lake, now=end) if quality else []
    finally:
        if spark is None:
            session.stop()
    return DemoLake(
        lake=lake,
        day=start.date(),
        messages_versions=tuple(versions),
        messages_per_run={tenant: tuple(run[tenant] for run in per_run) for tenant in FLEETS},
        messages_per_vehicle=_plain(edge.published),
        log_events=_plain(edge.logged),
        quality={
            table: all(r.success for r in checked if r.table == table)
            for table in sorted({r.table for r in checked})
        },
    )


def quota_decisions(path: LakePath, tenant: str) -> list[bytes]:
    """The tenant's quota decisions as the pipeline publishes them to the edges (the most
    severe last), from the states it recorded in ``quota_events``."""
    from streaming.quota import decisions, load_recorded

    return decisions(tenant, load_recorded(path, f"tenant = '{tenant}'"))


def _plain(counts: Mapping[str, Counter[str]]) -> dict[str, dict[str, int]]:
    return {tenant: dict(sorted(counts[tenant].items())) for tenant in sorted(counts)}


def _utc_time(text: str) -> datetime:
    try:
        at = datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from exc
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgebus.demo_lake``: build it; the summary as JSON on stdout."""
    parser = argparse.ArgumentParser(
        prog="python -m edgebus.demo_lake",
        description="Build a small demo lake with the real pipeline, for the notebooks.",
    )
    parser.add_argument("--data-dir", type=Path, required=True, help="where the journal goes")
    parser.add_argument("--lake", type=Path, required=True, help="where the Delta tables go")
    parser.add_argument(
        "--end",
        type=_utc_time,
        metavar="TIME",
        help="when the records end, ISO 8601 (UTC unless a zone is given; default now)",
    )
    args = parser.parse_args(argv)
    for path in (args.data_dir, args.lake):
        if path.exists() and any(path.iterdir()):
            parser.error(f"{path} is not empty: the demo starts from nothing")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    demo = build(args.data_dir, args.lake, now=args.end)
    print(json.dumps(demo.summary()))
    print(f"demo lake ready: EDGEBUS_LAKE={args.lake} for the notebooks", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
