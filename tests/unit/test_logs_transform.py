"""The logs step's pure Arrow transform: journal rows on ``$log/`` topics in, ``logs`` rows out."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pyarrow as pa
import pytest

from broker_edge.plim import log_event
from schemas.contracts import rows_where
from schemas.journal import JOURNAL_SCHEMA
from schemas.tables import LOGS_SCHEMA, QUARANTINE_SCHEMA
from streaming.logs import accepts, transform

UTC = dt.UTC
JUST_BEFORE_MIDNIGHT = dt.datetime(2024, 3, 9, 23, 59, 59, 999_999, tzinfo=UTC)
MIDNIGHT = dt.datetime(2024, 3, 10, 0, 0, tzinfo=UTC)
DETAILS = {"peer": "127.0.0.1:5000", "clean_start": True, "props": {"n": [1, 2.5, None]}}


def event_doc(**overrides: Any) -> dict[str, Any]:
    """A log event as the edge writes it (``broker_edge.plim.log_event``), then edited."""
    _, payload = log_event(
        ts_us=int(MIDNIGHT.timestamp() * 1_000_000),
        node="edge-1",
        tenant="acme",
        client_id="truck-7",
        origin="mqtt",
        event="connect",
        details=DETAILS,
    )
    doc: dict[str, Any] = json.loads(payload)
    doc.update(overrides)
    return doc


def journal_row(seq: int, topic: str, payload: bytes, **overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "node": "edge-1",
        "seq": seq,
        "ts": MIDNIGHT,
        "tenant": "acme",
        "client_id": "$edge",
        "topic": topic,
        "qos": 0,
        "retain": False,
        "payload": payload,
        "content_type": None,
        "user_properties": None,
    }
    row.update(overrides)
    return row


def log_row(seq: int, doc: dict[str, Any], topic: str = "$log/mqtt/connect") -> dict[str, Any]:
    return journal_row(seq, topic, json.dumps(doc).encode())


def run_transform(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    journal = pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA)
    out, _ = transform(rows_where(journal, accepts(journal.column("topic"))))
    result: list[dict[str, Any]] = out.sort_by("seq").to_pylist()
    return result


def test_columns_and_types_follow_the_table_schema() -> None:
    out, quarantined = transform(
        pa.Table.from_pylist([log_row(1, event_doc())], schema=JOURNAL_SCHEMA)
    )
    assert out.schema == LOGS_SCHEMA
    assert quarantined.schema == QUARANTINE_SCHEMA
    assert quarantined.num_rows == 0


def test_an_edge_log_event_becomes_one_valid_row() -> None:
    topic, payload = log_event(
        ts_us=int(JUST_BEFORE_MIDNIGHT.timestamp() * 1_000_000),
        node="edge-1",
        tenant="acme",
        client_id="",
        origin="quota",
        event="quota_warn",
        details={"metric": "messages", "limit": 1000, "value": 950.5},
    )
    [row] = run_transform([journal_row(7, topic, payload, ts=JUST_BEFORE_MIDNIGHT)])
    assert row == {
        "node": "edge-1",
        "seq": 7,
        "ts": JUST_BEFORE_MIDNIGHT,
        "date": dt.date(2024, 3, 9),
        "tenant": "acme",
        "origin": "quota",
        "event_type": "quota_warn",
        "client_id": "",
        "details": '{"metric":"messages","limit":1000,"value":950.5}',
        "time": "2024-03-09T23:59:59.999+00:00",
        "payload_valid": True,
        "invalid_reason": None,
        "raw": None,
    }


def test_details_keep_nested_json() -> None:
    [row] = run_transform([log_row(1, event_doc())])
    assert json.loads(row["details"]) == DETAILS
    assert row["payload_valid"]


def test_only_log_topics_are_kept() -> None:
    payload = json.dumps(event_doc()).encode()
    rows = [
        journal_row(1, "fleet/truck-7/telemetry", b'{"speed": 1}'),
        journal_row(2, "$counters/messages_in", b"{}"),
        journal_row(3, "$logs/mqtt/connect", payload),
        journal_row(4, "$log", payload),
        journal_row(5, "log/mqtt/connect", payload),
        log_row(6, event_doc()),
    ]
    assert [row["seq"] for row in run_transform(rows)] == [6]


INVALID = [
    pytest.param(b"not json", "payload is not a JSON object", id="not-json"),
    pytest.param(b"", "payload is not a JSON object", id="empty"),
    pytest.param(b"\xff\xfe\x00", "payload is not a JSON object", id="not-utf8"),
    pytest.param(b"[1, 2]", "payload is not a JSON object", id="array"),
    pytest.param(b"42", "payload is not a JSON object", id="scalar"),
    pytest.param(
        {k: v for k, v in event_doc().items() if k != "ts_us"},
        "field 'ts_us' is missing, null or of the wrong type",
        id="missing-field",
    ),
    pytest.param(
        event_doc(ts_us="1710028800000000"),
        "field 'ts_us' is missing, null or of the wrong type",
        id="mistyped-field",
    ),
    pytest.param(
        event_doc(client_id=None),
        "field 'client_id' is missing, null or of the wrong type",
        id="null-field",
    ),
    pytest.param(
        event_doc(details='{"peer": "x"}'),
        "field 'details' is not a JSON object",
        id="details-a-string",
    ),
    pytest.param(event_doc(details=[1]), "field 'details' is not a JSON object", id="details-list"),
    pytest.param(
        {k: v for k, v in event_doc().items() if k != "details"},
        "field 'details' is not a JSON object",
        id="details-missing",
    ),
    pytest.param(
        event_doc(tenant="other"),
        "field 'tenant' is 'other' but the event was published in tenant 'acme'",
        id="other-tenant",
    ),
    pytest.param(
        event_doc(event="disconnect"),
        "topic $log/mqtt/connect does not match origin mqtt and event disconnect",
        id="topic-mismatch",
    ),
]


@pytest.mark.parametrize(("payload", "reason"), INVALID)
def test_an_invalid_payload_is_kept_raw_with_its_reason(
    payload: bytes | dict[str, Any], reason: str
) -> None:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    [row] = run_transform([journal_row(3, "$log/mqtt/connect", raw)])
    assert row["payload_valid"] is False
    assert row["invalid_reason"] == reason
    assert row["raw"] == raw
    # Identity, time and tenant come from the journal record whatever the payload says.
    assert (row["node"], row["seq"], row["ts"], row["tenant"]) == ("edge-1", 3, MIDNIGHT, "acme")
    assert row["date"] == dt.date(2024, 3, 10)


def test_what_parsed_is_kept_and_the_topic_fills_in() -> None:
    missing = {k: v for k, v in event_doc().items() if k not in ("origin", "event", "ts_us")}
    rows = [
        log_row(1, missing, topic="$log/quota/quota_blocked"),
        journal_row(2, "$log/mqtt/acl_denied", b"garbage"),
        journal_row(3, "$log/lonely", b"garbage"),
    ]
    first, second, third = run_transform(rows)
    assert (first["origin"], first["event_type"]) == ("quota", "quota_blocked")
    assert first["client_id"] == "truck-7"
    assert json.loads(first["details"]) == DETAILS
    assert first["time"] == "2024-03-10T00:00:00.000+00:00"
    assert not first["payload_valid"]
    assert (second["origin"], second["event_type"], second["client_id"]) == (
        "mqtt",
        "acl_denied",
        None,
    )
    assert (third["origin"], third["event_type"]) == ("lonely", None)


def test_date_is_the_utc_day_of_the_record() -> None:
    # The payload's own time says otherwise: the record's ts decides the partition.
    doc = event_doc(time="2030-01-01T00:00:00.000+00:00", ts_us=1_893_456_000_000_000)
    rows = [
        journal_row(1, "$log/mqtt/connect", json.dumps(doc).encode(), ts=JUST_BEFORE_MIDNIGHT),
        journal_row(2, "$log/mqtt/connect", json.dumps(doc).encode(), ts=MIDNIGHT),
    ]
    out = run_transform(rows)
    assert [row["date"] for row in out] == [dt.date(2024, 3, 9), dt.date(2024, 3, 10)]
    assert [row["ts"] for row in out] == [JUST_BEFORE_MIDNIGHT, MIDNIGHT]
    assert all(row["payload_valid"] for row in out)


def test_invalid_events_are_also_quarantined_raw_with_their_reason() -> None:
    rows = [
        log_row(1, event_doc()),
        journal_row(2, "$log/mqtt/connect", b"not json"),
        log_row(3, event_doc(tenant="other")),
    ]
    out, quarantined = transform(pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA))
    assert out.column("seq").to_pylist() == [1, 2, 3]  # logs keep every event
    assert quarantined.column("seq").to_pylist() == [2, 3]
    assert set(quarantined.column("table").to_pylist()) == {"logs"}
    assert set(quarantined.column("rule").to_pylist()) == {"log_event"}
    assert quarantined.column("reason").to_pylist() == [
        "payload is not a JSON object",
        "field 'tenant' is 'other' but the event was published in tenant 'acme'",
    ]
    assert quarantined.column("payload").to_pylist()[0] == b"not json"
    assert quarantined.column("date").to_pylist() == [dt.date(2024, 3, 10)] * 2
