"""The data contracts of schemas.contracts and the route that applies them (streaming.route)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pyarrow as pa
import pytest

from schemas.contracts import (
    MESSAGE_RULES,
    RECORD_RULES,
    first_broken,
    is_json_content_type,
    rows_where,
)
from schemas.journal import JOURNAL_SCHEMA
from streaming.route import ROUTED_SCHEMA, route

UTC = dt.UTC
NOON = dt.datetime(2024, 3, 10, 12, tzinfo=UTC)


def record(seq: int, **overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "node": "edge-1",
        "seq": seq,
        "ts": NOON,
        "tenant": "acme",
        "client_id": "truck-7",
        "topic": "fleet/truck-7/telemetry",
        "qos": 1,
        "retain": False,
        "payload": b'{"speed": 42}',
        "content_type": "application/json",
        "user_properties": None,
    }
    row.update(overrides)
    return row


def table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA)


@pytest.mark.parametrize(
    ("content_type", "json"),
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/vnd.fleet+json", True),
        ("text/plain", False),
        ("application/jsonl", False),
        ("json", False),
        (None, False),
    ],
)
def test_json_content_types(content_type: str | None, json: bool) -> None:
    assert is_json_content_type(pa.array([content_type], pa.string())).to_pylist() == [json]


RECORD_CASES = [
    pytest.param(record(1), None, id="fine"),
    pytest.param(record(1, tenant=""), "tenant_present", id="no-tenant"),
    pytest.param(record(1, topic=""), "topic_present", id="no-topic"),
    pytest.param(record(1, ts=dt.datetime(1970, 1, 1, tzinfo=UTC)), "ts_sane", id="1970"),
    pytest.param(record(1, ts=dt.datetime(2100, 1, 1, tzinfo=UTC)), "ts_sane", id="2100"),
    pytest.param(record(1, tenant="", topic=""), "tenant_present", id="first-rule-wins"),
]


@pytest.mark.parametrize(("row", "rule"), RECORD_CASES)
def test_record_rules(row: dict[str, Any], rule: str | None) -> None:
    rules, reasons = first_broken(table([row]), RECORD_RULES)
    assert rules.to_pylist() == [rule]
    assert (reasons.to_pylist()[0] is None) == (rule is None)


@pytest.mark.parametrize(
    ("payload", "content_type", "broken"),
    [
        (b'{"speed": 42}', "application/json", False),
        (b"[1, 2]", "application/json", False),  # any JSON text, not only objects
        (b"42", "application/json", False),
        (b"{speed: 42}", "application/json", True),
        (b'{"speed": 42', "application/json", True),
        (b"", "application/json", True),
        (b"\xff\xfe", "application/json", True),
        (b"not json at all", "text/plain", False),  # no promise, no check
        (b"not json at all", None, False),
    ],
)
def test_json_payload_rule(payload: bytes, content_type: str | None, broken: bool) -> None:
    rules, _ = first_broken(
        table([record(1, payload=payload, content_type=content_type)]), MESSAGE_RULES
    )
    assert rules.to_pylist() == (["json_payload"] if broken else [None])


def test_rows_where_keeps_whole_tables_without_a_copy() -> None:
    records = table([record(1), record(2)])
    assert rows_where(records, pa.array([True, True])) is records
    assert rows_where(records, pa.array([False, False])).num_rows == 0
    assert rows_where(records, pa.array([False, True])).column("seq").to_pylist() == [2]


def test_the_route_sends_broken_records_to_quarantine_once() -> None:
    rows = [
        record(1),
        record(2, payload=b"{broken", content_type="application/json"),
        record(3, tenant=""),
        record(4, topic="$counters/messages_in", payload=b"garbage", content_type=None),
        record(5, topic="$log/mqtt/connect", payload=b"garbage", content_type=None),
        record(6, topic="$log/mqtt/connect", ts=dt.datetime(1999, 12, 31, tzinfo=UTC)),
        record(7, payload=b"plain", content_type="text/plain"),
    ]
    routed = route(table(rows))
    assert routed.schema == ROUTED_SCHEMA

    def share(dest: str, *columns: str) -> list[tuple[Any, ...]]:
        picked = [r for r in routed.to_pylist() if r["dest"] == dest]
        return sorted(tuple(r[c] for c in columns) for r in picked)

    assert share("messages", "seq") == [(1,), (7,)]
    assert share("logs", "seq", "payload_valid") == [(5, False)]
    assert share("counters", "seq") == []
    assert share("quarantine", "seq", "table", "rule") == [
        (2, "messages", "json_payload"),
        (3, "messages", "tenant_present"),
        (4, "usage", "counter_record"),
        (5, "logs", "log_event"),
        (6, "logs", "ts_sane"),
    ]
    quarantined = sorted(
        (r for r in routed.to_pylist() if r["dest"] == "quarantine"), key=lambda r: r["seq"]
    )
    # Kept raw: the payload as published; a record without a tenant is filed under "$none".
    assert quarantined[0]["payload"] == b"{broken"
    assert [r["tenant"] for r in quarantined] == ["acme", "$none", "acme", "acme", "acme"]
    # Pure: the same records route the same way (a replayed batch).
    assert route(table(rows)).equals(routed)


def test_the_route_of_nothing_is_empty() -> None:
    assert route(table([])).num_rows == 0
