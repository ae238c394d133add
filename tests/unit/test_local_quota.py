"""The local quota (issue 14) as a policy: the edge's own count plus the pipeline's confirmed
totals stop a tenant at its limit, a raised limit and a new UTC day release it, and confirmed
totals of another day, or that fail to parse, change nothing. No broker, no socket."""

from __future__ import annotations

import datetime as dt

import pytest

from broker_edge.localquota import until_midnight
from broker_edge.tenancy import Tenancy
from broker_edge.tenants import TenantsConfig, parse
from schemas.control import ConfirmedUsage, ControlMessageError, usage_control_topic

TODAY = dt.date(2026, 11, 25)
NODE = "edge-a"


def config(messages: int | None = 100, bytes_: int | None = None) -> TenantsConfig:
    limits: dict[str, int] = {}
    if messages is not None:
        limits["messages_per_day"] = messages
    if bytes_ is not None:
        limits["bytes_per_day"] = bytes_
    return parse(
        {
            "operator": {"token": "op"},
            "tenants": {"acme": {"tokens": ["acme-1"], "limits": limits}},
        }
    )


def tenancy(messages: int | None = 100, bytes_: int | None = None) -> Tenancy:
    return Tenancy(config(messages, bytes_), NODE, today=TODAY)


def accept(policy: Tenancy, count: int, size: int = 10) -> list[str]:
    """``count`` publishes the way handlers.handle_publish counts them: the events logged."""
    usage = policy.usage_of("acme")
    events: list[str] = []
    for _ in range(count):
        assert "acme" not in policy.blocked, "a blocked tenant's publish was accepted"
        usage.messages_in += 1
        usage.bytes_in += size
        if usage.messages_in >= usage.check_messages_in or usage.bytes_in >= usage.check_bytes_in:
            events += [e.event for e in policy.restop("acme")]
    return events


def confirm(
    policy: Tenancy,
    nodes: dict[str, int],
    *,
    day: dt.date = TODAY,
    limit: int | None = 100,
    byte_nodes: dict[str, int] | None = None,
) -> list[str]:
    totals: dict[str, tuple[int, dict[str, int]]] = {"messages_in": (sum(nodes.values()), nodes)}
    if byte_nodes is not None:
        totals["bytes_in"] = (sum(byte_nodes.values()), byte_nodes)
    message = ConfirmedUsage(
        "acme", day, totals, {"messages_per_day": limit, "bytes_per_day": None}, "now"
    )
    outcome = policy.control_message("$operator", usage_control_topic("acme"), message.payload())
    return [e.event for e in outcome.events]


def test_a_fresh_edge_stops_the_tenant_on_its_own_count_at_the_limit() -> None:
    policy = tenancy(messages=100)
    assert accept(policy, 99) == []
    assert "acme" not in policy.blocked
    assert accept(policy, 1) == ["quota_reached"]  # the 100th is accepted, the 101st is not
    assert "acme" in policy.blocked
    reached = policy.stopped["acme"]
    assert (reached.metric, reached.limit, reached.value, reached.confirmed) == (
        "messages_per_day",
        100,
        100,
        None,
    )


def reports_due(policy: Tenancy, count: int) -> list[int]:
    """``count`` publishes; the day counts at which the tenant's counters fell due early (each
    taken at once, as the broker's tick does)."""
    usage = policy.usage_of("acme")
    due = []
    for _ in range(count):
        usage.messages_in += 1
        usage.bytes_in += 10
        if usage.messages_in >= usage.check_messages_in or usage.bytes_in >= usage.check_bytes_in:
            policy.restop("acme")
            if "acme" in policy.report_due:
                due.append(usage.messages_in)
                policy.counter_reports(0, 1, NODE, {}, ["acme"])  # what the tick sends
    return due


def test_counters_are_reported_early_at_every_twentieth_of_a_limit() -> None:
    """Issue 14, several edges: the others learn of a fast day sooner than every counter
    interval, so each node reports its count at every 5 % of a limit it passes."""
    policy = tenancy(messages=100)
    assert reports_due(policy, 99) == list(range(5, 100, 5))
    assert "acme" not in policy.blocked
    assert reports_due(policy, 1) == []  # the stop: blocked, not a report
    assert "acme" in policy.blocked
    # After a confirmed total the points stay on this node's own count of the day.
    other = tenancy(messages=1000)
    assert reports_due(other, 120) == [50, 100]
    assert confirm(other, {NODE: 100, "edge-b": 400}, limit=1000) == []
    assert reports_due(other, 40) == [150]
    # No limit, nothing to hurry for.
    assert reports_due(tenancy(messages=None), 500) == []


def test_bytes_limit_stops_too() -> None:
    policy = tenancy(messages=None, bytes_=1000)
    assert accept(policy, 99, size=10) == []
    assert accept(policy, 1, size=10) == ["quota_reached"]
    assert policy.stopped["acme"].metric == "bytes_per_day"


def test_other_edges_confirmed_parts_count_and_its_own_is_not_counted_twice() -> None:
    policy = tenancy(messages=100)
    accept(policy, 30)
    # The lake holds 20 of this edge's 30 and 50 of another edge's: 50 + 30 = 80 so far.
    assert confirm(policy, {NODE: 20, "edge-b": 50}) == []
    assert accept(policy, 19) == []  # 99
    assert accept(policy, 1) == ["quota_reached"]
    assert policy.stopped["acme"].value == 100
    assert policy.stopped["acme"].confirmed == 70


def test_confirmed_totals_that_reach_the_limit_stop_the_tenant_at_once() -> None:
    policy = tenancy(messages=100)
    accept(policy, 10)
    assert confirm(policy, {NODE: 10, "edge-b": 90}) == ["quota_reached"]
    assert "acme" in policy.blocked


def test_after_a_restart_the_lakes_part_of_this_node_counts() -> None:
    # This node accepted 60 before it restarted (the lake holds them); the new process has 0.
    policy = tenancy(messages=100)
    assert confirm(policy, {NODE: 60, "edge-b": 30}) == []
    assert accept(policy, 9) == []  # max(9, 60) + 30 = 90: not more than the truth
    # Once the new process's own count passes the lake's part, it rules: 70 + 30 = 100.
    assert accept(policy, 61) == ["quota_reached"]


def test_a_raised_limit_releases_at_once_by_reload_or_by_the_pipeline() -> None:
    policy = tenancy(messages=10)
    accept(policy, 10)
    assert "acme" in policy.blocked
    policy.config = config(messages=20)  # SIGHUP on the edge
    assert policy.restop_all() == ()
    assert "acme" not in policy.blocked
    assert accept(policy, 10) == ["quota_reached"]
    # The pipeline's limit is raised before this edge's file: the larger one counts.
    assert confirm(policy, {NODE: 20}, limit=50) == []
    assert "acme" not in policy.blocked
    # A lowered limit counts locally once both have it; the pipeline blocks meanwhile.
    policy.config = config(messages=5)
    policy.restop_all()
    assert "acme" not in policy.blocked
    assert confirm(policy, {NODE: 20}, limit=5) == ["quota_reached"]


def test_a_blocked_decision_rules_whatever_the_local_count_and_outlives_a_release() -> None:
    policy = tenancy(messages=10)
    decision = b'{"state":"blocked","metric":"messages_per_day","limit":10,"value":12}'
    policy.control_message("$operator", "$control/quota/acme", decision)
    assert "acme" in policy.blocked
    policy.config = config(messages=1000)
    policy.restop_all()
    assert "acme" in policy.blocked  # only the pipeline's own decision lifts its block
    ok = b'{"state":"ok","metric":"messages_per_day","limit":1000,"value":12}'
    policy.control_message("$operator", "$control/quota/acme", ok)
    assert "acme" not in policy.blocked


def test_a_new_utc_day_starts_the_count_again_and_forgets_the_old_confirmed_totals() -> None:
    policy = tenancy(messages=10)
    confirm(policy, {"edge-b": 5}, limit=10)
    accept(policy, 5)
    assert "acme" in policy.blocked
    policy.roll_day(TODAY + dt.timedelta(days=1))
    assert "acme" not in policy.blocked
    assert accept(policy, 9) == []  # yesterday's 5 of edge-b no longer count
    # Yesterday's confirmed totals arriving late (retained, or a slow pipeline) are ignored.
    assert confirm(policy, {"edge-b": 50}, day=TODAY, limit=10) == []
    assert accept(policy, 1) == ["quota_reached"]


def test_a_broken_confirmed_message_changes_nothing() -> None:
    policy = tenancy(messages=10)
    accept(policy, 5)
    for payload in (b"nope", b"[]", b'{"tenant":"acme"}'):
        outcome = policy.control_message("$operator", usage_control_topic("acme"), payload)
        assert outcome.events == ()
    assert accept(policy, 5) == ["quota_reached"]


@pytest.mark.parametrize(
    ("totals", "limits", "message"),
    [
        ({"messages_in": (3, {"a": 1})}, {}, "totals.messages_in: the nodes' parts do not add up"),
        ({"messages_in": (-1, {})}, {}, "totals.messages_in: counts must be integers >= 0"),
        ({"sessions": (0, {})}, {}, "totals.sessions: not a quota counter"),
        ({}, {"sessions": 3}, "limits.sessions: not a quota metric"),
        ({}, {"messages_per_day": -3}, "limits.messages_per_day: must be an integer >= 0"),
    ],
)
def test_confirmed_usage_refuses_bad_values(
    totals: dict[str, tuple[int, dict[str, int]]], limits: dict[str, int], message: str
) -> None:
    with pytest.raises(ControlMessageError, match=message):
        ConfirmedUsage("acme", TODAY, totals, limits, "now")


def test_confirmed_usage_round_trips() -> None:
    message = ConfirmedUsage(
        "acme",
        TODAY,
        {"messages_in": (7, {"a": 3, "b": 4}), "bytes_in": (70, {"a": 30, "b": 40})},
        {"messages_per_day": 10, "bytes_per_day": None},
        "2026-11-25T10:00:00.000+00:00",
    )
    assert ConfirmedUsage.parse(message.payload()) == message
    assert message.own_and_others("messages_in", "a") == (3, 4)
    assert message.own_and_others("bytes_in", "c") == (0, 70)


def test_until_midnight_is_utc() -> None:
    at = dt.datetime(2026, 11, 25, 23, 59, 30, tzinfo=dt.UTC)
    assert until_midnight(int(at.timestamp() * 1e6)) == pytest.approx(30.0)
