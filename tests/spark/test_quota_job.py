"""The quota step end to end: counters -> usage -> quota_events -> a retained decision that a
real edge applies (its tenant gets PUBACK 0x97), limits re-read every batch, replays."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from counter_records import Counter, write_counters
from deltalake import DeltaTable
from paho.mqtt.enums import CallbackAPIVersion
from pyspark.sql import SparkSession

from bench.brokers import free_port
from broker_edge.plim import QuotaDecision
from broker_edge.settings import EdgeSettings
from sinks.delta import read_table
from sinks.upsert import table_exists
from streaming import pipeline, quota, quota_lane
from streaming.quota_settings import QuotaSettings, TenantLimits
from streaming.settings import PipelineSettings
from streaming.usage import UsageStep

pytestmark = pytest.mark.spark

TIMEOUT = 10.0
NOW = dt.datetime(2024, 3, 10, 12, 0, tzinfo=dt.UTC)  # counter_records' day, at noon
QUOTA_EXCEEDED = 0x97

TENANTS = """
[operator]
token = "op-token"

[tenants.acme]
tokens = ["acme-1"]

[tenants.globex]
tokens = ["globex-1"]
"""


def _running_edge_class() -> Any:
    # The integration tests' RunningEdge (a real edge on port 0 in a thread); tests/ is not a
    # package, so load that conftest by path under a name of its own.
    path = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"
    spec = importlib.util.spec_from_file_location("edgebus_integration_conftest", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.RunningEdge


RunningEdge = _running_edge_class()


@pytest.fixture
def settings(make_settings: Callable[..., PipelineSettings]) -> PipelineSettings:
    return make_settings()


@pytest.fixture
def edge(tmp_path: Path) -> Iterator[Any]:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    edge_settings = EdgeSettings(
        host="127.0.0.1", port=0, data_dir=tmp_path / "edge", node_id="edge-q"
    )
    running = RunningEdge(edge_settings, "asyncio", tenants).start()
    yield running
    running.stop()


class V5:
    """A paho MQTT 5 client recording what it receives and the reason codes of its acks."""

    def __init__(self, port: int, token: str, client_id: str) -> None:
        self.inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.acks: queue.Queue[Any] = queue.Queue()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        self.client.username_pw_set(token)
        connected: queue.Queue[Any] = queue.Queue()
        subscribed: queue.Queue[Any] = queue.Queue()
        self._subscribed = subscribed
        self.client.on_connect = lambda c, u, f, rc, p: connected.put(rc)
        self.client.on_message = lambda c, u, m: self.inbox.put(m)
        self.client.on_publish = lambda c, u, mid, rc, p: self.acks.put(rc)
        self.client.on_subscribe = lambda c, u, mid, codes, p: subscribed.put(codes)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.rc = connected.get(timeout=TIMEOUT)
        if self.rc.is_failure:  # refused: paho would keep trying
            self.close()

    def subscribe(self, topic_filter: str) -> None:
        self.client.subscribe(topic_filter, qos=1)
        codes = self._subscribed.get(timeout=TIMEOUT)
        assert not codes[0].is_failure, codes

    def publish_qos1(self, topic: str, payload: bytes) -> int:
        self.client.publish(topic, payload, qos=1)
        code: int = self.acks.get(timeout=TIMEOUT).value
        return code

    def next_message(self, timeout: float = TIMEOUT) -> mqtt.MQTTMessage:
        return self.inbox.get(timeout=timeout)

    def nothing_more(self, wait: float = 0.5) -> None:
        try:
            extra = self.inbox.get(timeout=wait)
        except queue.Empty:
            return
        pytest.fail(f"unexpected message on {extra.topic}: {extra.payload!r}")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def clients(edge: Any) -> Iterator[Any]:
    made: list[V5] = []

    def _make(token: str, client_id: str) -> V5:
        client = V5(edge.port, token, client_id)
        made.append(client)
        return client

    yield _make
    for client in made:
        client.close()


class Limits:
    """The tenants file as the quota step sees it: read afresh on every call."""

    def __init__(self, limits: dict[str, TenantLimits]) -> None:
        self.current = limits
        self.calls = 0

    def __call__(self) -> dict[str, TenantLimits]:
        self.calls += 1
        return dict(self.current)


def run_once(spark: SparkSession, settings: PipelineSettings, quotas: QuotaSettings) -> None:
    query = pipeline.start(spark, settings, quotas)
    try:
        query.processAllAvailable()
    finally:
        query.stop()


def events(settings: PipelineSettings) -> list[dict[str, Any]]:
    rows = read_table(settings.table_path(quota.TABLE)).to_pylist()
    return sorted(rows, key=lambda r: (r["batch_id"], r["tenant"], r["metric"]))


def states(settings: PipelineSettings) -> list[tuple[Any, ...]]:
    return [
        (r["tenant"], r["metric"], r["state"], r["value"], r["limit"]) for r in events(settings)
    ]


def quota_state(client: V5) -> dict[str, Any]:
    message = client.next_message()
    assert message.topic == "$quota/messages_per_day"
    doc: dict[str, Any] = json.loads(message.payload)
    return doc


def test_warn_block_raise_and_replay_against_a_real_edge(
    edgebus_spark: SparkSession, settings: PipelineSettings, edge: Any, clients: Any
) -> None:
    journal = settings.journal_root
    limits = Limits(
        {
            "acme": TenantLimits(messages_per_day=100),
            "globex": TenantLimits(messages_per_day=1000, bytes_per_day=1_000_000),
        }
    )
    quota_settings = QuotaSettings(
        load_limits=limits,
        operator_token="op-token",
        # A broker that is down as well: its deliveries fail, the batches still succeed.
        brokers=(("127.0.0.1", edge.port), ("127.0.0.1", free_port())),
        publish_timeout_seconds=5.0,
        clock=lambda: NOW,
    )
    acme = clients("acme-1", "acme-dev")
    acme.subscribe("$quota/#")
    globex = clients("globex-1", "globex-dev")

    # 85 of 100 messages across two edges: warn.
    write_counters(journal, "edge-a", [Counter("acme", "messages_in", 10, 50)])
    write_counters(
        journal,
        "edge-b",
        [Counter("acme", "messages_in", 20, 35), Counter("globex", "messages_in", 20, 20)],
    )
    run_once(edgebus_spark, settings, quota_settings)
    assert states(settings) == [("acme", "messages_per_day", "warn", 85, 100)]
    row = events(settings)[0]
    assert (row["decided_at"], row["date"]) == (NOW, NOW.date())
    warn = quota_state(acme)
    assert (warn["state"], warn["value"], warn["limit"]) == ("warn", 85, 100)
    assert acme.publish_qos1("fleet/truck-1/telemetry", b"still fine") == 0

    # 115 of 100: blocked; the edge refuses the tenant, and only that tenant.
    write_counters(journal, "edge-a", [Counter("acme", "messages_in", 70, 30)])
    run_once(edgebus_spark, settings, quota_settings)
    assert [s[2] for s in states(settings)] == ["warn", "blocked"]
    assert states(settings)[-1] == ("acme", "messages_per_day", "blocked", 115, 100)
    assert quota_state(acme)["state"] == "blocked"
    assert acme.publish_qos1("fleet/truck-1/telemetry", b"over quota") == QUOTA_EXCEEDED
    late = clients("acme-1", "acme-late")  # a blocked tenant may connect and look (issue 13)
    assert late.rc.value == 0
    assert late.publish_qos1("fleet/truck-1/telemetry", b"over quota too") == QUOTA_EXCEEDED
    assert globex.publish_qos1("fleet/truck-9/telemetry", b"unaffected") == 0

    # The tenants file raises the limit: the next batch clears the block.
    limits.current = {**limits.current, "acme": TenantLimits(messages_per_day=1000)}
    write_counters(journal, "edge-b", [Counter("globex", "messages_in", 80, 1)])
    run_once(edgebus_spark, settings, quota_settings)
    assert [s[2] for s in states(settings)] == ["warn", "blocked", "cleared"]
    assert states(settings)[-1] == ("acme", "messages_per_day", "cleared", 115, 1000)
    cleared = quota_state(acme)
    assert (cleared["state"], cleared["limit"]) == ("ok", 1000)
    assert acme.publish_qos1("fleet/truck-1/telemetry", b"accepted again") == 0
    assert limits.calls >= 3

    # What the edges were sent is the decision as the edge parses it.
    operator = clients("op-token", "operator-watch")
    operator.subscribe("$control/quota/#")
    retained = operator.next_message()
    assert retained.topic == "$control/quota/acme"
    last = QuotaDecision.parse(retained.payload)
    assert (last.state, last.metric, last.value) == ("ok", "messages_per_day", 115)

    # A crash after the quota commit, before Spark's: the replayed batch decides nothing new
    # and sends the recorded decision again, never a contradicting one.
    events_table = DeltaTable(str(settings.table_path(quota.TABLE)))
    version = events_table.version()
    commits = settings.checkpoint_path(pipeline.JOB) / "commits"
    last_batch = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    assert events_table.transaction_version(quota.APP_ID) == last_batch
    (commits / str(last_batch)).unlink()
    limits.current = {**limits.current, "acme": TenantLimits(messages_per_day=10)}  # ignored
    run_once(edgebus_spark, settings, quota_settings)
    assert (commits / str(last_batch)).exists()
    assert DeltaTable(str(settings.table_path(quota.TABLE))).version() == version
    again = operator.next_message()
    assert (again.topic, again.payload) == (retained.topic, retained.payload)
    operator.nothing_more()
    assert acme.publish_qos1("fleet/truck-1/telemetry", b"still accepted") == 0


class Clock:
    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


def test_two_metrics_the_day_rolling_over_and_a_broken_tenants_file(
    edgebus_spark: SparkSession, tmp_path: Path, edge: Any, clients: Any
) -> None:
    settings = PipelineSettings(
        data_dir=tmp_path / "data",
        lake=tmp_path / "lake",
        master="local[2]",
        max_records_per_batch=1,  # one counter record per batch
        trigger_interval_seconds=0.1,
        shuffle_partitions=2,
    )
    journal = settings.journal_root
    clock = Clock(NOW)
    limits = FailingLimits({"globex": TenantLimits(messages_per_day=100, bytes_per_day=1000)})
    quota_settings = QuotaSettings(
        load_limits=limits,
        operator_token="op-token",
        brokers=(("127.0.0.1", edge.port),),
        clock=clock,
    )
    globex = clients("globex-1", "globex-dev")
    write_counters(
        journal,
        "edge-a",
        [Counter("globex", "messages_in", 10, 90), Counter("globex", "bytes_in", 10, 600)],
    )
    write_counters(journal, "edge-b", [Counter("globex", "bytes_in", 20, 500)])
    run_once(edgebus_spark, settings, quota_settings)
    assert sorted(states(settings)) == [
        ("globex", "bytes_per_day", "blocked", 1100, 1000),
        ("globex", "messages_per_day", "warn", 90, 100),
    ]
    # The edge got both; the blocking one is the one it keeps retained (and restarts with).
    assert globex.publish_qos1("fleet/truck-9/telemetry", b"over") == QUOTA_EXCEEDED
    operator = clients("op-token", "operator-watch")
    operator.subscribe("$control/quota/#")
    retained = QuotaDecision.parse(operator.next_message().payload)
    assert (retained.metric, retained.state) == ("bytes_per_day", "blocked")

    # The next UTC day; the tenants file breaks after the first batch (being edited, say).
    clock.now = NOW + dt.timedelta(days=1)
    limits.fail_after = limits.calls + 1
    day_2 = 86_400
    write_counters(journal, "edge-a", [Counter("globex", "messages_in", day_2 + 10, 5)])
    write_counters(journal, "edge-b", [Counter("globex", "bytes_in", day_2 + 10, 5)])
    run_once(edgebus_spark, settings, quota_settings)
    assert limits.failures >= 1  # and the batches after it went on with the last limits
    new_day = [r for r in events(settings) if r["date"] == clock.now.date()]
    assert sorted((r["metric"], r["state"]) for r in new_day) == [
        ("bytes_per_day", "ok"),
        ("messages_per_day", "ok"),
    ]
    assert len({r["batch_id"] for r in new_day}) == 1
    assert globex.publish_qos1("fleet/truck-9/telemetry", b"a new day") == 0


class FailingLimits(Limits):
    """Limits whose loader raises from call number ``fail_after`` on."""

    def __init__(self, limits: dict[str, TenantLimits]) -> None:
        super().__init__(limits)
        self.fail_after: int | None = None
        self.failures = 0

    def __call__(self) -> dict[str, TenantLimits]:
        if self.fail_after is not None and self.calls >= self.fail_after:
            self.failures += 1
            raise ValueError("tenants.toml: not valid TOML")
        return super().__call__()


def acme_limited_to_100(edge: Any) -> QuotaSettings:
    """Quota settings: acme may publish 100 messages a day, decisions go to ``edge``."""
    return QuotaSettings(
        load_limits=Limits({"acme": TenantLimits(messages_per_day=100)}),
        operator_token="op-token",
        brokers=(("127.0.0.1", edge.port),),
        clock=lambda: NOW,
    )


def usage_messages_in(settings: PipelineSettings, tenant: str) -> int:
    rows = read_table(settings.table_path("usage")).to_pylist()
    return sum(r["value"] for r in rows if r["tenant"] == tenant and r["metric"] == "messages_in")


def test_the_decision_waits_for_no_other_table(
    edgebus_spark: SparkSession,
    settings: PipelineSettings,
    edge: Any,
    clients: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 14: the quota step decides ahead of ``usage`` (streaming.quota_lane), on what
    ``usage`` holds plus what the batches after it counted: a usage step that is stuck delays
    no decision, and nothing is counted twice once it commits."""
    gate = threading.Event()
    gate.set()
    step = UsageStep.__call__

    def gated(self: UsageStep, *args: Any) -> Any:
        assert gate.wait(120), "the test never opened the gate"
        return step(self, *args)

    monkeypatch.setattr(UsageStep, "__call__", gated)
    journal = settings.journal_root
    quota_settings = acme_limited_to_100(edge)
    acme = clients("acme-1", "acme-dev")
    write_counters(journal, "edge-a", [Counter("acme", "messages_in", 10, 60)])
    query = pipeline.start(edgebus_spark, settings, quota_settings)
    try:
        query.processAllAvailable()  # every table: 60 in usage, under the limit
        assert usage_messages_in(settings, "acme") == 60
        assert not table_exists(settings.table_path(quota.TABLE))
        assert acme.publish_qos1("fleet/truck-1/telemetry", b"fine") == 0

        gate.clear()  # the usage step sticks: the next commit waits
        write_counters(journal, "edge-b", [Counter("acme", "messages_in", 20, 50)])
        query.query.processAllAvailable()  # the stream has the batch...
        assert query.fanout.quota is not None
        query.fanout.quota.drain(60)  # ...and the quota step decided it
        assert states(settings) == [("acme", "messages_per_day", "blocked", 110, 100)]
        assert usage_messages_in(settings, "acme") == 60  # not in usage yet
        refused = acme.publish_qos1("fleet/truck-1/telemetry", b"over")
        assert refused == QUOTA_EXCEEDED

        gate.set()
        query.processAllAvailable()
    finally:
        gate.set()
        query.stop()
    assert usage_messages_in(settings, "acme") == 110
    assert states(settings) == [("acme", "messages_per_day", "blocked", 110, 100)]


def test_decisions_sent_before_a_crash_are_committed_at_the_next_start(
    edgebus_spark: SparkSession,
    settings: PipelineSettings,
    edge: Any,
    clients: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decisions go to the edges before their (slow) commit, so their intent is written
    first: a crash between the two leaves it, and the next start commits what was sent."""
    quota_settings = acme_limited_to_100(edge)
    acme = clients("acme-1", "acme-dev")
    write_counters(settings.journal_root, "edge-a", [Counter("acme", "messages_in", 10, 150)])
    intent = settings.checkpoint_path(pipeline.JOB) / quota_lane.INTENT_FILE

    def crash(*args: Any) -> None:
        raise RuntimeError("the process died before the commit")

    with monkeypatch.context() as patch:
        patch.setattr(quota.QuotaStep, "_record", crash)
        query = pipeline.start(edgebus_spark, settings, quota_settings)
        try:
            with pytest.raises(Exception, match="died before the commit"):
                query.processAllAvailable()
        finally:
            query.stop()
    assert intent.exists()
    assert not table_exists(settings.table_path(quota.TABLE))
    assert acme.publish_qos1("fleet/truck-1/telemetry", b"over") == QUOTA_EXCEEDED  # sent

    run_once(edgebus_spark, settings, quota_settings)
    assert states(settings) == [("acme", "messages_per_day", "blocked", 150, 100)]
    assert not intent.exists()


def test_between_batches_the_edges_get_the_totals_of_a_tenant_near_its_limit(
    edgebus_spark: SparkSession,
    make_settings: Callable[..., PipelineSettings],
    edge: Any,
    clients: Any,
) -> None:
    """Issue 14, several edges: while no batch comes, the quota lane reads the journals ahead
    of the stream and sends the confirmed totals of a tenant past half a limit at once (the
    other edges' parts reach each edge sooner); it decides and records nothing without its
    batch."""
    # One batch at the start, the next at the top of the hour (Spark aligns processing-time
    # triggers to their interval): keep clear of it.
    time.sleep(max(0.0, 120 - (3600 - time.time() % 3600)))
    settings = make_settings(trigger_interval_seconds=3600.0)
    operator = clients("op-token", "usage-watch")
    operator.subscribe("$control/usage/acme")
    write_counters(settings.journal_root, "edge-a", [Counter("acme", "messages_in", 10, 10)])
    query = pipeline.start(edgebus_spark, settings, acme_limited_to_100(edge))
    try:
        first = json.loads(operator.next_message(timeout=60).payload)  # the first batch's
        assert first["totals"]["messages_in"] == {"total": 10, "nodes": {"edge-a": 10}}
        write_counters(settings.journal_root, "edge-b", [Counter("acme", "messages_in", 20, 50)])
        ahead = json.loads(operator.next_message(timeout=30).payload)
        assert ahead["totals"]["messages_in"] == {
            "total": 60,
            "nodes": {"edge-a": 10, "edge-b": 50},
        }
        assert not table_exists(settings.table_path(quota.TABLE))  # nothing decided
        offsets = settings.checkpoint_path(pipeline.JOB) / "offsets"
        planned = [name for name in os.listdir(offsets) if name.isdigit()]
        assert planned == ["0"]  # no batch but the first was planned: none read those records
        deadline = time.monotonic() + 60
        while not query.recentProgress:  # batch 0 ends (its decision came before its end)
            assert time.monotonic() < deadline, "the first batch did not end"
            time.sleep(0.1)
    finally:
        query.stop()
