"""The history job's pure transform: journal rows in, messages rows out."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from schemas.journal import JOURNAL_SCHEMA
from schemas.tables import MESSAGES_PARTITION_BY, MESSAGES_SCHEMA
from sinks.delta import DeltaBatchWriter, conform, read_table
from streaming.history import MESSAGES_SPARK_SCHEMA, transform

pytestmark = pytest.mark.spark

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


def run_transform(spark: SparkSession, rows: list[dict[str, Any]]) -> pa.Table:
    journal = spark.createDataFrame(pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA))
    return conform(transform(journal).toArrow(), MESSAGES_SCHEMA).sort_by("seq")


def test_columns_and_types_follow_the_table_schema(spark: SparkSession) -> None:
    journal = spark.createDataFrame(pa.Table.from_pylist(ROWS, schema=JOURNAL_SCHEMA))
    out = transform(journal)
    assert out.columns == MESSAGES_SCHEMA.names
    assert [f.dataType for f in out.schema.fields] == [
        f.dataType for f in MESSAGES_SPARK_SCHEMA.fields
    ]


def test_rows_are_mapped_and_dollar_topics_dropped(spark: SparkSession) -> None:
    out = run_transform(spark, ROWS)
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


def test_only_dollar_traffic_gives_no_rows(spark: SparkSession) -> None:
    out = run_transform(spark, [r for r in ROWS if r["topic"].startswith("$")])
    assert out.num_rows == 0


@pytest.fixture
def pacific_session(spark: SparkSession) -> Iterator[SparkSession]:
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/Los_Angeles")
    try:
        yield spark
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)


@pytest.mark.parametrize("session", ["spark", "pacific_session"])
def test_date_is_the_utc_day_across_midnight(session: str, request: pytest.FixtureRequest) -> None:
    spark = request.getfixturevalue(session)
    rows = [
        journal_row(1, "a", JUST_BEFORE_MIDNIGHT),
        journal_row(2, "a", MIDNIGHT),
        journal_row(3, "a", dt.datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)),
        journal_row(4, "a", dt.datetime(1970, 1, 1, tzinfo=UTC)),
    ]
    out = run_transform(spark, rows)
    assert out.column("date").to_pylist() == [
        dt.date(2024, 3, 9),
        dt.date(2024, 3, 10),
        dt.date(1969, 12, 31),
        dt.date(1970, 1, 1),
    ]
    assert out.column("ts").to_pylist() == [r["ts"] for r in rows]


def test_spark_batches_of_empty_lists_reach_delta(spark: SparkSession, tmp_path: Path) -> None:
    # Regression: Spark's Arrow output for all-empty lists once made delta-rs panic.
    rows = [journal_row(i, "a/b", MIDNIGHT, user_properties=[]) for i in range(1, 6)]
    journal = spark.createDataFrame(pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA))
    writer = DeltaBatchWriter(tmp_path / "messages", "test", MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)
    assert writer.write(0, transform(journal.repartition(3)).toArrow())
    back = read_table(writer.path, columns=["seq", "user_properties"]).sort_by("seq")
    assert back.column("user_properties").to_pylist() == [[]] * 5
