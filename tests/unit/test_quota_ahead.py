"""The quota step ahead of ``usage`` (issue 14, streaming.quota_lane): the counter records of a
journal range read on the driver and counted as the usage step will add them, and the day
totals the step decides on (what ``usage`` holds plus what was counted ahead of it)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from ingest.journal import JournalWriter
from ingest.source import OPTION_PATH
from streaming import route
from streaming.quota import QuotaStep, count_counters
from streaming.quota_settings import QuotaSettings
from streaming.settings import PipelineSettings

DAY = dt.date(2024, 3, 10)
NOON = dt.datetime(2024, 3, 10, 12, 0, tzinfo=dt.UTC)
BASE_US = 1_710_028_800_000_000  # DAY at midnight
MSGS = "messages_in"


def counter(node: str, tenant: str, metric: str, delta: int, end_s: int = 60) -> bytes:
    end = dt.datetime.fromtimestamp((BASE_US / 1e6) + end_s, dt.UTC)
    doc = {
        "node": node,
        "tenant": tenant,
        "metric": metric,
        "kind": "gauge" if metric == "sessions" else "counter",
        "delta": delta,
        "total": delta,
        "interval_start": (end - dt.timedelta(seconds=2)).isoformat(),
        "interval_end": end.isoformat(),
    }
    return json.dumps(doc).encode()


def append(root: Path, node: str, records: list[tuple[str, str, str, bytes]]) -> None:
    """(tenant, client id, topic, payload) records, in this order."""
    with JournalWriter.open(root, node, fsync=False) as writer:
        for i, (tenant, client_id, topic, payload) in enumerate(records):
            writer.append(BASE_US + i, tenant, client_id, topic, 0, False, payload)
        writer.flush()


def test_the_range_read_here_counts_what_the_usage_step_will_add(tmp_path: Path) -> None:
    root = tmp_path / "journal"
    append(
        root,
        "edge-a",
        [
            ("acme", "$edge", "$counters/messages_in", counter("edge-a", "acme", "messages_in", 5)),
            ("acme", "truck-1", "fleet/truck-1/telemetry", b'{"speed": 50}'),
            ("acme", "$edge", "$counters/bytes_in", counter("edge-a", "acme", "bytes_in", 700)),
            ("acme", "$edge", "$counters/sessions", counter("edge-a", "acme", "sessions", 3)),
            # No client can move its tenant's usage: quarantined, never counted.
            (
                "acme",
                "truck-1",
                "$counters/messages_in",
                counter("edge-a", "acme", "messages_in", 999),
            ),
            (
                "acme",
                "$edge",
                "$counters/messages_in",
                counter("edge-a", "acme", "messages_in", -4),
            ),
            ("acme", "$edge", "$counters/messages_in", b"not json"),
            ("acme", "$edge", "$log/connect", b'{"event_type": "client_connected"}'),
            (
                "globex",
                "$edge",
                "$counters/messages_in",
                counter("edge-a", "globex", "messages_in", 7),
            ),
            (
                "acme",
                "$edge",
                "$counters/messages_in",
                counter("edge-a", "acme", "messages_in", 11),
            ),
        ],
    )
    append(
        root,
        "edge-b",
        [("acme", "$edge", "$counters/messages_in", counter("edge-b", "acme", "messages_in", 2))],
    )
    options = {OPTION_PATH: str(root)}

    everything = count_counters(route.read_counters(options, {}, {"edge-a": 10, "edge-b": 1}))
    msgs, octets, globex = ("acme", MSGS, DAY), ("acme", "bytes_in", DAY), ("globex", MSGS, DAY)
    assert everything == {
        ("edge-a", 1): (msgs, 5),
        ("edge-a", 3): (octets, 700),
        ("edge-a", 9): (globex, 7),
        ("edge-a", 10): (msgs, 11),
        ("edge-b", 1): (msgs, 2),
    }
    # Only the records start < seq <= end of each node.
    later = count_counters(
        route.read_counters(options, {"edge-a": 9, "edge-b": 1}, {"edge-a": 10, "edge-b": 1})
    )
    assert later == {("edge-a", 10): (msgs, 11)}
    assert count_counters(route.read_counters(options, {"edge-a": 2}, {"edge-a": 2})) == {}


@pytest.fixture
def step(tmp_path: Path) -> QuotaStep:
    settings = PipelineSettings(data_dir=tmp_path / "data", lake=tmp_path / "lake")
    quota = QuotaSettings(load_limits=dict, operator_token="op", clock=lambda: NOON)
    return QuotaStep(settings, quota)


def test_day_totals_are_usage_plus_what_was_counted_ahead_never_twice(step: QuotaStep) -> None:
    key = ("acme", "messages_in", DAY)
    yesterday = ("acme", "messages_in", DAY - dt.timedelta(1))
    step.committed({"edge-a": 3}, {key: (10, {"edge-a": 10})})
    assert step.counted({("edge-a", 4): (key, 5), ("edge-b", 1): (key, 1)}) == {"acme"}
    step.counted({("edge-b", 2): (key, 2), ("edge-a", 5): (yesterday, 9)})
    assert step.day_totals(DAY) == {("acme", "messages_in"): (18, {"edge-a": 15, "edge-b": 3})}
    # The same record counted again (the look ahead, then its batch) counts once.
    assert step.counted({("edge-a", 4): (key, 5)}) == set()
    assert step.day_totals(DAY)[("acme", "messages_in")][0] == 18
    # usage commits those records (its totals are the day's): what was counted goes.
    step.committed({"edge-a": 5, "edge-b": 2}, {key: (18, {"edge-a": 15, "edge-b": 3})})
    assert step.day_totals(DAY) == {("acme", "messages_in"): (18, {"edge-a": 15, "edge-b": 3})}
    # A record usage holds already is not counted again (the lane behind the usage step).
    assert step.counted({("edge-a", 5): (key, 100)}) == set()
    step.counted({("edge-a", 6): (key, 1)})
    assert step.day_totals(DAY) == {("acme", "messages_in"): (19, {"edge-a": 16, "edge-b": 3})}
    step.committed({"edge-a": 6}, {key: (19, {"edge-a": 16, "edge-b": 3})})
    # A usage commit that did not touch a group leaves its total as it was.
    step.committed({"edge-a": 7}, {("globex", "bytes_in", DAY): (4, {"edge-a": 4})})
    assert step.day_totals(DAY)[("acme", "messages_in")] == (19, {"edge-a": 16, "edge-b": 3})
    assert step.day_totals(DAY)[("globex", "bytes_in")] == (4, {"edge-a": 4})
