"""The usage step's parsing of counter records (the per-batch partials are a Spark aggregation:
tests/spark/test_usage_job.py)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pyarrow as pa
import pytest

from schemas.journal import JOURNAL_SCHEMA
from schemas.usage import COUNTER_RECORD_SCHEMA
from streaming.usage import parse, transform

UTC = dt.UTC
T0 = dt.datetime(2024, 3, 10, 0, 0, 50, tzinfo=UTC)


def counter(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "node": "edge-1",
        "tenant": "acme",
        "metric": "messages_in",
        "kind": "counter",
        "delta": 5,
        "total": 105,
        "interval_start": "2024-03-10T00:00:40.000+00:00",
        "interval_end": "2024-03-10T00:00:50.000+00:00",
    }
    doc.update(overrides)
    return doc


def record(seq: int, doc: dict[str, Any] | bytes, metric: str = "messages_in", **kw: Any) -> dict:
    payload = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    row: dict[str, Any] = {
        "node": "edge-1",
        "seq": seq,
        "ts": T0,
        "tenant": "acme",
        "client_id": "$edge",
        "topic": f"$counters/{metric}",
        "qos": 0,
        "retain": False,
        "payload": payload,
        "content_type": None,
        "user_properties": None,
    }
    row.update(kw)
    return row


@pytest.mark.parametrize(
    ("topic", "payload", "reason"),
    [
        ("$counters/", counter(), "does not name one metric"),
        ("$counters/a/b", counter(), "does not name one metric"),
        ("$counters/m", b"nope", "not a JSON object"),
        ("$counters/m", b"[1]", "not a JSON object"),
        ("$counters/m", counter(kind="histogram"), "field 'kind'"),
        ("$counters/m", counter(delta="5"), "field 'delta'"),
        ("$counters/m", counter(total=True), "field 'total'"),
        ("$counters/m", counter(interval_end="yesterday"), "field 'interval_end'"),
        ("$counters/m", counter(interval_end=None), "field 'interval_end'"),
    ],
)
def test_a_broken_counter_names_its_rule(
    topic: str, payload: dict[str, Any] | bytes, reason: str
) -> None:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    fields, why = parse(topic, raw)
    assert fields is None
    assert why is not None
    assert reason in why


def test_a_counter_parses_and_an_offset_free_time_is_utc() -> None:
    fields, why = parse(
        "$counters/m", json.dumps(counter(interval_end="2024-03-10T00:00:50")).encode()
    )
    assert why is None
    assert fields is not None
    assert fields["interval_end"] == T0
    assert (fields["metric"], fields["kind"], fields["delta"], fields["total"]) == (
        "m",
        "counter",
        5,
        105,
    )


def test_transform_gives_counter_records_and_quarantines_the_rest() -> None:
    rows = [
        record(1, counter(delta=5)),
        record(2, counter(delta=1, interval_end="2024-03-10T00:01:00.000+00:00")),  # next minute
        record(3, counter(kind="gauge", total=9, delta=-2), metric="sessions"),  # a gauge falls
        record(4, b"garbage"),
        record(5, counter(delta=-1000)),  # a counter never shrinks
        record(6, counter(delta=10**9), client_id="truck-7"),  # not the edge's
    ]
    counters, quarantined = transform(pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA))
    assert counters.schema == COUNTER_RECORD_SCHEMA
    got = [
        (r["seq"], r["metric"], r["window_start"].minute, r["delta"]) for r in counters.to_pylist()
    ]
    assert got == [(1, "messages_in", 0, 5), (2, "messages_in", 1, 1), (3, "sessions", 0, -2)]
    assert counters.column("date").to_pylist() == [dt.date(2024, 3, 10)] * 3
    assert quarantined.column("seq").to_pylist() == [4, 5, 6]
    assert quarantined.column("rule").to_pylist() == ["counter_record"] * 3
    reasons = quarantined.column("reason").to_pylist()
    assert "not a JSON object" in reasons[0]
    assert "negative" in reasons[1]
    assert "not by the edge" in reasons[2]
