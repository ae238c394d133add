"""The history step's pure Arrow transform: journal rows in, messages rows out."""

from __future__ import annotations

import datetime as dt
from typing import Any

import orjson
import pyarrow as pa

from schemas.contracts import rows_where
from schemas.journal import JOURNAL_SCHEMA
from schemas.tables import MESSAGES_DERIVED, MESSAGES_ROUTED_SCHEMA, MESSAGES_SCHEMA
from streaming.history import accepts, transform
from streaming.route import (
    MESSAGES_WIRE_SCHEMA,
    OTHERS_WIRE_SCHEMA,
    messages_wire,
    others_wire,
    route,
)

UTC = dt.UTC


def journal_row(seq: int, topic: str, ts: dt.datetime, **overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "node": "edge-1",
        "seq": seq,
        "ts": ts,
        "tenant": "acme",
        "client_id": "truck-7",
        "topic": topic,
        "qos": 1,
        "retain": False,
        "payload": b"{}",
        "content_type": None,
        "user_properties": None,
    }
    row.update(overrides)
    return row


JUST_BEFORE_MIDNIGHT = dt.datetime(2024, 3, 9, 23, 59, 59, 999_999, tzinfo=UTC)
MIDNIGHT = dt.datetime(2024, 3, 10, 0, 0, tzinfo=UTC)

ROWS = [
    journal_row(
        1,
        "fleet/truck-7/telemetry",
        JUST_BEFORE_MIDNIGHT,
        payload=b'{"speed": 42}',
        content_type="application/json",
        user_properties=[{"key": "unit", "value": "kmh"}],
    ),
    journal_row(2, "$log/edge/connect", MIDNIGHT, client_id="edge"),
    journal_row(3, "$counters/messages", MIDNIGHT, client_id="edge"),
    journal_row(4, "fleet/truck-7/status", MIDNIGHT, qos=0, retain=True, payload=b""),
    journal_row(5, "fleet/$odd/but/own", MIDNIGHT, tenant="other", payload=b"\x00\xff"),
]


def run_transform(rows: list[dict[str, Any]]) -> pa.Table:
    journal = pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA)
    return transform(rows_where(journal, accepts(journal.column("topic")))).sort_by("seq")


def test_columns_and_types_follow_the_table_schema() -> None:
    out = transform(pa.Table.from_pylist(ROWS, schema=JOURNAL_SCHEMA))
    assert out.schema == MESSAGES_ROUTED_SCHEMA
    # Every column of the table but those the JVM derives as it writes (payload_text).
    assert set(MESSAGES_SCHEMA.names) - set(out.schema.names) == set(MESSAGES_DERIVED)
    assert all(MESSAGES_SCHEMA.field(f.name) == f for f in out.schema)


def test_rows_are_mapped_and_dollar_topics_dropped() -> None:
    out = run_transform(ROWS)
    assert out.column("seq").to_pylist() == [1, 4, 5]
    first = out.slice(0, 1).to_pylist()[0]
    assert first == {
        "node": "edge-1",
        "seq": 1,
        "ts": JUST_BEFORE_MIDNIGHT,
        "date": dt.date(2024, 3, 9),
        "tenant": "acme",
        "client_id": "truck-7",
        "topic": "fleet/truck-7/telemetry",
        "qos": 1,
        "retain": False,
        "payload": b'{"speed": 42}',
        "content_type": "application/json",
        "user_properties": [{"key": "unit", "value": "kmh"}],
        "size": 13,
    }
    assert out.column("size").to_pylist() == [13, 0, 2]
    assert out.column("retain").to_pylist() == [False, True, False]
    assert out.column("tenant").to_pylist() == ["acme", "acme", "other"]


def test_only_dollar_traffic_gives_no_rows() -> None:
    out = run_transform([r for r in ROWS if r["topic"].startswith("$")])
    assert out.num_rows == 0


def test_date_is_the_utc_day_across_midnight() -> None:
    rows = [
        journal_row(1, "a", JUST_BEFORE_MIDNIGHT),
        journal_row(2, "a", MIDNIGHT),
        journal_row(3, "a", dt.datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)),
        journal_row(4, "a", dt.datetime(1970, 1, 1, tzinfo=UTC)),
    ]
    out = run_transform(rows)
    assert out.column("date").to_pylist() == [
        dt.date(2024, 3, 9),
        dt.date(2024, 3, 10),
        dt.date(1969, 12, 31),
        dt.date(1970, 1, 1),
    ]
    assert out.column("ts").to_pylist() == [r["ts"] for r in rows]


def test_a_zoned_ts_column_still_gives_utc_days() -> None:
    # Spark hands Arrow timestamps in the session's zone; the partition is the UTC day anyway.
    zoned = pa.timestamp("us", tz="America/Los_Angeles")
    journal = pa.Table.from_pylist([journal_row(1, "a", JUST_BEFORE_MIDNIGHT)], JOURNAL_SCHEMA)
    journal = journal.set_column(2, "ts", journal.column("ts").cast(zoned))
    assert transform(journal).column("date").to_pylist() == [dt.date(2024, 3, 9)]


def test_batches_of_empty_lists_are_routed_whole() -> None:
    rows = [journal_row(i, "a/b", MIDNIGHT, user_properties=[]) for i in range(1, 6)]
    journal = pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA)
    routed = route(journal.filter(pa.array([True, False, True, True, True])))
    assert routed.column("seq").to_pylist() == [1, 3, 4, 5]
    assert routed.column("user_properties").to_pylist() == [[]] * 4


def test_the_wire_carries_properties_as_json_and_empty_lists_as_empty_text() -> None:
    props = [{"key": "unit", "value": "kmh"}, {"key": "k", "value": '"quoted"'}]
    rows = [
        journal_row(1, "a/b", MIDNIGHT, user_properties=[]),
        journal_row(2, "a/b", MIDNIGHT, user_properties=props),
        journal_row(3, "a/b", MIDNIGHT, user_properties=None),
    ]
    wire = messages_wire(pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA))
    assert wire.schema == MESSAGES_WIRE_SCHEMA
    assert wire.column("user_properties").to_pylist() == ["", orjson.dumps(props).decode(), None]
    only_empty = messages_wire(pa.Table.from_pylist(rows[:1] + rows[2:], schema=JOURNAL_SCHEMA))
    assert only_empty.column("user_properties").to_pylist() == ["", None]


def test_the_stream_carries_messages_and_the_second_read_everything_else() -> None:
    rows = [
        journal_row(1, "a/b", MIDNIGHT),
        journal_row(2, "$log/mqtt/connect", MIDNIGHT, payload=b"not json"),
        journal_row(3, "a/c", MIDNIGHT, content_type="application/json", payload=b"{bad"),
        journal_row(4, "$counters/messages_in", MIDNIGHT, payload=b"[]"),
        journal_row(5, "a/d", MIDNIGHT),
    ]
    journal = pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA)
    messages = messages_wire(journal)
    assert messages.column("seq").to_pylist() == [1, 5]
    others = others_wire(journal)
    assert others.schema == OTHERS_WIRE_SCHEMA
    by_dest = sorted(
        zip(others.column("dest").to_pylist(), others.column("seq").to_pylist(), strict=True)
    )
    # The bad log event is kept in logs and quarantined; the bad JSON message and the bad
    # counter record are quarantined. Every record is in exactly one of the two reads.
    assert by_dest == [("logs", 2), ("quarantine", 2), ("quarantine", 3), ("quarantine", 4)]
    empty = others_wire(journal.filter(pa.array([True, False, False, False, True])))
    assert empty.num_rows == 0
    assert empty.schema == OTHERS_WIRE_SCHEMA
