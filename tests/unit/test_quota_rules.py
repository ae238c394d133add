"""The quota step's pure rules and the usage job's combine step (no Spark, no Delta)."""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

import pyarrow as pa
import pytest

from broker_edge.plim import QuotaDecision
from schemas.usage import (
    DECISION_FIELDS,
    QUOTA_EVENT_STATES,
    USAGE_PARTIAL_SCHEMA,
    USAGE_SCHEMA,
)
from sinks.delta import FILE_COLUMN
from streaming.errors import PipelineConfigError
from streaming.quota import QuotaEvent, classify, decide, decisions
from streaming.quota_settings import QuotaSettings, TenantLimits
from streaming.usage import (
    ENTRY,
    FILE,
    KEEP,
    TOTAL,
    WRITE,
    combine,
    combine_partition,
    node_parts,
)

NOON = dt.datetime(2024, 3, 10, 12, tzinfo=dt.UTC)
DAY = NOON.date()


def event(tenant: str, metric: str, state: str, when: dt.datetime = NOON) -> QuotaEvent:
    return QuotaEvent(tenant, metric, 100, 90, state, when, 3)


def run_decide(
    totals: dict[tuple[str, str], int],
    limits: dict[str, TenantLimits],
    recorded: dict[tuple[str, str], QuotaEvent] | None = None,
    now: dt.datetime = NOON,
) -> list[tuple[str, str, str, int]]:
    found = decide(
        totals=totals,
        limits=limits,
        recorded=recorded or {},
        now=now,
        batch_id=7,
        warn_ratio=0.8,
    )
    assert all(e.batch_id == 7 and e.decided_at == now for e in found)
    assert all(e.state in QUOTA_EVENT_STATES for e in found)
    return [(e.tenant, e.metric, e.state, e.value) for e in found]


@pytest.mark.parametrize(
    ("value", "limit", "state"),
    [
        (0, None, "ok"),
        (10**12, None, "ok"),
        (79, 100, "ok"),
        (80, 100, "warn"),
        (99, 100, "warn"),
        (100, 100, "blocked"),
        (0, 0, "blocked"),
    ],
)
def test_classify(value: int, limit: int | None, state: str) -> None:
    assert classify(value, limit, 0.8) == state


def test_decide_records_only_changes() -> None:
    limits = {
        "acme": TenantLimits(messages_per_day=100, bytes_per_day=1000),
        "globex": TenantLimits(messages_per_day=100),
    }
    totals = {("acme", "messages_in"): 85, ("acme", "bytes_in"): 1000, ("globex", "bytes_in"): 5}
    assert run_decide(totals, limits) == [
        ("acme", "messages_per_day", "warn", 85),
        ("acme", "bytes_per_day", "blocked", 1000),
    ]
    recorded = {
        ("acme", "messages_per_day"): event("acme", "messages_per_day", "warn"),
        ("acme", "bytes_per_day"): event("acme", "bytes_per_day", "blocked"),
    }
    assert run_decide(totals, limits, recorded) == []


def test_back_under_the_limit_is_cleared_the_same_day_and_ok_on_a_new_day() -> None:
    recorded = {("acme", "messages_per_day"): event("acme", "messages_per_day", "blocked")}
    raised = {"acme": TenantLimits(messages_per_day=1000)}
    totals = {("acme", "messages_in"): 150}
    assert run_decide(totals, raised, recorded) == [("acme", "messages_per_day", "cleared", 150)]
    # The limit removed, or the tenant gone from the file: cleared too.
    assert run_decide(totals, {}, recorded) == [("acme", "messages_per_day", "cleared", 150)]
    # Midnight UTC: today's usage starts from zero.
    tomorrow = NOON + dt.timedelta(hours=13)
    same = {"acme": TenantLimits(messages_per_day=100)}
    assert run_decide({}, same, recorded, now=tomorrow) == [("acme", "messages_per_day", "ok", 0)]
    # ... unless it is over again at once.
    over = {("acme", "messages_in"): 90}
    assert run_decide(over, same, recorded, now=tomorrow) == [
        ("acme", "messages_per_day", "warn", 90)
    ]
    # A recorded ok/cleared is ok: nothing to record.
    settled = {("acme", "messages_per_day"): event("acme", "messages_per_day", "cleared")}
    assert run_decide(totals, raised, settled) == []


def test_decisions_put_the_most_severe_last_and_parse_on_the_edge() -> None:
    recorded = {
        ("acme", "bytes_per_day"): event("acme", "bytes_per_day", "blocked"),
        ("acme", "messages_per_day"): event("acme", "messages_per_day", "warn"),
        ("globex", "messages_per_day"): event("globex", "messages_per_day", "cleared"),
    }
    acme = [QuotaDecision.parse(p) for p in decisions("acme", recorded)]
    assert [(d.metric, d.state) for d in acme] == [
        ("messages_per_day", "warn"),
        ("bytes_per_day", "blocked"),  # last: the retained one an edge restarts with
    ]
    assert (acme[1].limit, acme[1].value) == (100, 90)
    assert acme[1].decided_at is not None
    assert dt.datetime.fromisoformat(acme[1].decided_at) == NOON
    (globex,) = decisions("globex", recorded)
    assert QuotaDecision.parse(globex).state == "ok"  # the edges know ok, not cleared
    assert tuple(json.loads(globex)) == DECISION_FIELDS
    # Equal severity: a fixed order, so a replay sends the same bytes in the same order.
    both_ok = {
        ("acme", "bytes_per_day"): event("acme", "bytes_per_day", "ok"),
        ("acme", "messages_per_day"): event("acme", "messages_per_day", "cleared"),
    }
    assert [QuotaDecision.parse(p).metric for p in decisions("acme", both_ok)] == [
        "messages_per_day",
        "bytes_per_day",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"operator_token": ""}, "quota.operator_token"),
        ({"brokers": (("", 1883),)}, "quota.brokers"),
        ({"brokers": (("127.0.0.1", 0),)}, "quota.brokers"),
        ({"warn_ratio": 1.5}, "quota.warn_ratio"),
        ({"publish_timeout_seconds": 0}, "quota.publish_timeout_seconds"),
    ],
)
def test_quota_settings_refuse_bad_values(kwargs: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = {"load_limits": dict, "operator_token": "op"} | kwargs
    with pytest.raises(PipelineConfigError, match=re.escape(message)):
        QuotaSettings(**values)


def test_tenant_limits_refuse_bad_values() -> None:
    assert TenantLimits(messages_per_day=0).messages_per_day == 0
    with pytest.raises(PipelineConfigError, match=r"limits\.bytes_per_day"):
        TenantLimits(bytes_per_day=-1)
    with pytest.raises(PipelineConfigError, match=r"limits\.messages_per_day"):
        TenantLimits(messages_per_day=True)


# --- usage: combining a batch's partials with the stored rows ---------------------------------

T0 = dt.datetime(2024, 3, 10, tzinfo=dt.UTC)


def minute(n: int) -> dt.datetime:
    return T0 + dt.timedelta(minutes=n)


def part(metric: str, n: int, node: str, value: int, at_s: int = 0) -> dict[str, Any]:
    return {
        "tenant": "acme",
        "metric": metric,
        "kind": "gauge" if metric == "sessions" else "counter",
        "window_start": minute(n),
        "date": T0.date(),
        "node": node,
        "value": value,
        "reported_at": minute(n) + dt.timedelta(seconds=at_s),
    }


def stored(metric: str, n: int, day_value: int, **nodes: tuple[int, int]) -> dict[str, Any]:
    return {
        "tenant": "acme",
        "metric": metric,
        "kind": "gauge" if metric == "sessions" else "counter",
        "window_start": minute(n),
        "window_end": minute(n + 1),
        "value": sum(v for v, _ in nodes.values()),
        "day_value": day_value,
        "nodes": [
            {"node": k, "value": v, "reported_at": minute(n) + dt.timedelta(seconds=s)}
            for k, (v, s) in sorted(nodes.items())
        ],
        "date": T0.date(),
    }


def summary(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (r["metric"], r["window_start"].minute, r["value"], r["day_value"])
        + tuple((n["node"], n["value"]) for n in r["nodes"])
        for r in rows
    ]


def test_combine_adds_counters_and_replaces_gauges_per_node() -> None:
    rows = [
        stored("messages_in", 5, 30, a=(10, 10)),
        stored("sessions", 5, 7, a=(3, 30), b=(4, 20)),
    ]
    parts = [
        part("messages_in", 5, "a", 2, 40),
        part("messages_in", 5, "b", 5, 40),
        part("sessions", 5, "a", 1, 50),  # newer: replaces a's 3
        part("sessions", 5, "b", 9, 10),  # older than the stored 4: ignored
    ]
    bases = {("acme", "messages_in", T0.date()): 20, ("acme", "sessions", T0.date()): 6}
    changed, totals = combine(parts, rows, bases)
    assert summary(changed) == [
        ("messages_in", 5, 17, 37, ("a", 12), ("b", 5)),
        ("sessions", 5, 5, 6, ("a", 1), ("b", 4)),  # the day's peak so far stays 6
    ]
    assert totals == {("acme", "messages_in", T0.date()): 37, ("acme", "sessions", T0.date()): 6}


def test_combine_recomputes_later_windows_and_skips_unchanged_rows() -> None:
    rows = [
        stored("messages_in", 1, 3, a=(3, 0)),
        stored("messages_in", 2, 4, a=(1, 0)),
        stored("messages_in", 3, 9, a=(5, 0)),
    ]
    changed, totals = combine([part("messages_in", 2, "b", 10)], rows, {})
    assert summary(changed) == [
        ("messages_in", 2, 11, 14, ("a", 1), ("b", 10)),
        ("messages_in", 3, 5, 19, ("a", 5)),
    ]
    assert totals == {("acme", "messages_in", T0.date()): 19}
    new, _ = combine([part("messages_in", 0, "a", 1)], [], {})
    assert summary(new) == [("messages_in", 0, 1, 1, ("a", 1))]
    assert new[0]["window_end"] == minute(1)


STORED_SCHEMA = USAGE_SCHEMA.append(pa.field(FILE_COLUMN, pa.string(), nullable=False))


def planned(
    parts: list[dict[str, Any]], rows: list[dict[str, Any]], files: list[str] | None = None
) -> list[dict[str, Any]]:
    """combine_partition's entries for one partition; ``files``: the data file of each stored
    row (all in one file by default)."""
    named = [
        {**row, FILE_COLUMN: name}
        for row, name in zip(rows, files or ["f1"] * len(rows), strict=True)
    ]
    return combine_partition(
        pa.Table.from_pylist(parts, schema=USAGE_PARTIAL_SCHEMA),
        pa.Table.from_pylist(named, schema=STORED_SCHEMA),
    ).to_pylist()


def day_nodes(
    parts: list[dict[str, Any]], rows: list[dict[str, Any]]
) -> tuple[int, dict[str, int]]:
    """The day total and node parts combine_partition reports for the one group of ``parts``."""
    ((total, nodes),) = [
        (r["day_total"], tuple((e["node"], e["value"]) for e in r["day_nodes"]))
        for r in planned(parts, rows)
        if r[ENTRY] == TOTAL
    ]
    return total, dict(nodes)


def test_combine_partition_replaces_only_the_files_holding_a_changed_row() -> None:
    rows = [
        stored("messages_in", 1, 3, a=(3, 0)),
        stored("bytes_in", 1, 100, a=(100, 0)),
        stored("messages_in", 2, 4, a=(1, 0)),
        stored("bytes_in", 2, 150, a=(50, 0)),
        stored("sessions", 2, 7, a=(7, 0)),
    ]
    parts = [part("messages_in", 2, "b", 10), part("bytes_in", 3, "a", 5)]
    entries = planned(parts, rows, ["f1", "f1", "f2", "f2", "f3"])

    def of(kind: str) -> list[tuple[Any, ...]]:
        return sorted(
            (r["metric"], r["window_start"].minute, r["value"], r["day_value"])
            for r in entries
            if r[ENTRY] == kind
        )

    # messages_in's minute 2 changes: its file f2 is replaced, with bytes_in's minute 2 kept as
    # it was; bytes_in's new minute 3 replaces nothing; f1 and f3 stay.
    assert of(WRITE) == [("bytes_in", 3, 5, 155), ("messages_in", 2, 11, 14)]
    assert of(KEEP) == [("bytes_in", 2, 50, 150)]
    assert [r["file"] for r in entries if r[ENTRY] == FILE] == ["f2"]
    totals = {r["metric"]: r["day_total"] for r in entries if r[ENTRY] == TOTAL}
    assert totals == {"messages_in": 14, "bytes_in": 155}
    # Nothing changes, nothing is replaced: a batch of only new windows is a pure append.
    fresh = planned([part("messages_in", 9, "a", 1)], rows, ["f1", "f1", "f2", "f2", "f3"])
    assert [r[ENTRY] for r in fresh] == [WRITE, TOTAL]
    assert planned([], rows) == []


def test_combine_partition_reports_each_nodes_part_of_the_day_total() -> None:
    # The confirmed totals of issue 14: windows before the batch, untouched later ones and the
    # changed ones all count, once each, and the parts add up to the day total.
    rows = [
        stored("messages_in", 1, 3, a=(3, 0)),
        stored("messages_in", 2, 4, a=(1, 0)),
        stored("messages_in", 4, 11, a=(5, 0), b=(2, 0)),
    ]
    parts = [part("messages_in", 2, "b", 10), part("messages_in", 3, "c", 4)]
    assert day_nodes(parts, rows) == (25, {"a": 9, "b": 12, "c": 4})
    assert day_nodes(parts, []) == (14, {"b": 10, "c": 4})
    assert node_parts(rows) == {"a": 9, "b": 2}
