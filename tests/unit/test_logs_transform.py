"""The logs step's pure Arrow transform: journal rows on ``$log/`` topics in, ``logs`` rows out."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pyarrow as pa
import pytest
from policy_client import Client

from broker_edge.packets import Publish, QoS, ReasonCode
from broker_edge.plim import (
    connect_details,
    disconnect_details,
    log_event,
    subscribe_details,
)
from broker_edge.tenancy import LogEvent, Tenancy
from broker_edge.tenants import Acl, parse
from schemas.contracts import rows_where
from schemas.journal import JOURNAL_SCHEMA
from schemas.tables import LOGS_SCHEMA, QUARANTINE_SCHEMA
from streaming.logs import TYPED, accepts, transform

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
        # The typed columns: 950.5 is no integer, so value stays null.
        "reason": None,
        "reason_code": None,
        "topic": None,
        "qos": None,
        "metric": "messages",
        "limit": 1000,
        "value": None,
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


# --- the typed columns ------------------------------------------------------------------------


def edge_event(event: LogEvent, seq: int = 1) -> dict[str, Any]:
    """The ``logs`` row of an event the edge's own code made, journaled as the broker does."""
    topic, payload = log_event(
        ts_us=int(MIDNIGHT.timestamp() * 1_000_000),
        node="edge-1",
        tenant=event.tenant,
        client_id=event.client_id,
        origin=event.origin,
        event=event.event,
        details=dict(event.details),
    )
    [row] = run_transform([journal_row(seq, topic, payload, tenant=event.tenant)])
    assert row["payload_valid"], row["invalid_reason"]
    return row


def typed(row: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in TYPED if row[name] is not None}


def test_typed_columns_of_the_events_a_session_makes() -> None:
    def mqtt(event: str, details: dict[str, Any]) -> LogEvent:
        return LogEvent("acme", event, "truck-7", details)

    connect = connect_details(
        peer="127.0.0.1:5000", protocol=5, clean_start=True, keepalive=60, session_present=False
    )
    assert typed(edge_event(mqtt("connect", connect))) == {}
    closed = disconnect_details(
        peer="127.0.0.1:5000", clean=False, reason_code=ReasonCode.KEEP_ALIVE_TIMEOUT
    )
    assert typed(edge_event(mqtt("disconnect", closed))) == {"reason_code": 0x8D}
    sent = disconnect_details(peer="127.0.0.1:5000", clean=True, reason_code=None)
    assert typed(edge_event(mqtt("disconnect", sent))) == {}
    # One filter (nearly every SUBSCRIBE): the filter, its SUBACK code and the QoS granted.
    one = subscribe_details(["fleet/+/telemetry"], [1])
    assert typed(edge_event(mqtt("subscribe", one))) == {
        "topic": "fleet/+/telemetry",
        "reason_code": 1,
        "qos": 1,
    }
    refused = subscribe_details(["other/#"], [ReasonCode.NOT_AUTHORIZED])
    assert typed(edge_event(mqtt("subscribe", refused))) == {
        "topic": "other/#",
        "reason_code": 0x87,
    }
    # Several: which one would it be? details has the lists.
    assert typed(edge_event(mqtt("subscribe", subscribe_details(["a", "b"], [0, 1])))) == {}
    malformed = {"peer": "127.0.0.1:5000", "reason_code": 0x81, "error": "bad varint"}
    assert typed(edge_event(mqtt("malformed_packet", malformed))) == {
        "reason": "bad varint",
        "reason_code": 0x81,
    }


def test_typed_columns_of_the_policys_refusals_and_quota_events() -> None:
    tenancy = Tenancy(
        parse({"tenants": {"acme": {"tokens": ["t"], "limits": {"max_payload_bytes": 10}}}}),
        "edge-1",
    )
    ro = Client("acme", "dash", acl=Acl(publish=(), subscribe=("#",)))
    _, denied = tenancy.refuse_publish(ro, Publish(topic="fleet/x", payload=b"1", qos=QoS(1)))
    assert denied is not None
    assert typed(edge_event(denied)) == {"topic": "fleet/x", "qos": 1}
    dev = Client("acme", "dev-1", max_payload=10)
    _, big = tenancy.refuse_publish(dev, Publish(topic="fleet/y", payload=b"x" * 11))
    assert big is not None
    # limit_exceeded names the limit "limit" and its value "value": read as quota_events does.
    assert typed(edge_event(big)) == {
        "topic": "fleet/y",
        "qos": 0,
        "metric": "max_payload_bytes",
        "limit": 10,
        "value": 11,
    }
    decision = {
        "state": "blocked",
        "metric": "messages_per_day",
        "limit": 120,
        "value": 130,
        "decided_at": "2024-03-10T00:00:00.000+00:00",
    }
    [blocked] = tenancy.apply_quota("acme", json.dumps(decision).encode()).events
    row = edge_event(blocked)
    assert row["event_type"] == "quota_blocked"
    assert typed(row) == {"metric": "messages_per_day", "limit": 120, "value": 130}


def test_typed_columns_of_the_operators_events() -> None:
    def operator(event: str, origin: str, details: dict[str, Any]) -> LogEvent:
        return LogEvent("$operator", event, "", details, origin)

    full = operator("journal_full", "journal", {"state": "full", "reason": "disk budget"})
    assert typed(edge_event(full)) == {"reason": "disk budget"}
    tls = {"listener": "mqtts", "peer": "127.0.0.1:6000", "reason": "no shared cipher"}
    assert typed(edge_event(operator("tls_handshake_failed", "tls", tls))) == {
        "reason": "no shared cipher"
    }


@pytest.mark.parametrize(
    "details",
    [
        {"reason": 5, "reason_code": "0x8D", "qos": 3, "limit": True, "value": "12"},
        {"topic": ["a"], "metric": None, "limit": 2**63, "value": 1.5, "qos": -1},
        {"reason_code": 2**31},
    ],
)
def test_a_field_of_another_type_is_null_in_its_column(details: dict[str, Any]) -> None:
    [row] = run_transform([log_row(1, event_doc(details=details))])
    assert row["payload_valid"]
    assert typed(row) == {}
    assert json.loads(row["details"]) == details


def test_an_invalid_payload_keeps_its_typed_columns() -> None:
    doc = event_doc(event="disconnect", details={"reason_code": 0x8E, "clean": False})
    del doc["time"]
    [row] = run_transform([log_row(1, doc, topic="$log/mqtt/disconnect")])
    assert not row["payload_valid"]
    assert typed(row) == {"reason_code": 0x8E}
