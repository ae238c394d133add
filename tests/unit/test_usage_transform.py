"""The usage step's parsing of counter records and its per-batch partials."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pyarrow as pa
import pytest

from schemas.journal import JOURNAL_SCHEMA
from schemas.usage import USAGE_PARTIAL_SCHEMA
from streaming.usage import parse, partials, transform

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


def test_partials_sum_counters_and_keep_a_gauges_last_value() -> None:
    rows = [
        record(1, counter(delta=5)),
        record(2, counter(delta=7, interval_end="2024-03-10T00:00:59.000+00:00")),
        record(3, counter(delta=1, interval_end="2024-03-10T00:01:00.000+00:00")),  # next minute
        record(4, counter(kind="gauge", total=9), metric="sessions"),
        record(
            5,
            counter(kind="gauge", total=4, interval_end="2024-03-10T00:00:55+00:00"),
            metric="sessions",
        ),
        record(6, counter(kind="gauge", total=2), metric="sessions"),  # same time: seq decides
        record(7, b"garbage"),
    ]
    counters, quarantined = transform(pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA))
    assert quarantined.column("seq").to_pylist() == [7]
    assert quarantined.column("rule").to_pylist() == ["counter_record"]
    parts = partials(counters)
    assert parts.schema == USAGE_PARTIAL_SCHEMA
    got = {
        (r["metric"], r["window_start"].minute): (r["value"], r["reported_at"].second)
        for r in parts.to_pylist()
    }
    assert got == {
        ("messages_in", 0): (12, 59),
        ("messages_in", 1): (1, 0),
        ("sessions", 0): (4, 55),
    }
