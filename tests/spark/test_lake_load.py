"""``streaming.lake.load``: a lake table as a Spark DataFrame with the table's own schema."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pyarrow as pa
import pytest
from lake_fixture import DeltaBatchWriter
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

from schemas.journal import JOURNAL_SCHEMA
from schemas.tables import (
    LOGS_PARTITION_BY,
    LOGS_SCHEMA,
    MESSAGES_PARTITION_BY,
    MESSAGES_SCHEMA,
)
from streaming import lake, logs

pytestmark = pytest.mark.spark

UTC = dt.UTC
MIDNIGHT = dt.datetime(2024, 3, 10, tzinfo=UTC)


def test_logs_round_trip_through_the_lake(spark: SparkSession, tmp_path: Path) -> None:
    # Rows the logs job made, written as a job would, read back by version into Spark.
    payloads = [b'{"broken": ', b"[]"]
    journal = pa.Table.from_pylist(
        [
            {
                "node": "edge-1",
                "seq": seq,
                "ts": MIDNIGHT + dt.timedelta(hours=seq),
                "tenant": "acme" if seq % 2 else "other",
                "client_id": "$edge",
                "topic": "$log/mqtt/connect",
                "qos": 0,
                "retain": False,
                "payload": payloads[seq % 2],
                "content_type": None,
                "user_properties": None,
            }
            for seq in range(1, 5)
        ],
        schema=JOURNAL_SCHEMA,
    )
    rows, _ = logs.transform(journal)
    writer = DeltaBatchWriter(tmp_path / "logs", logs.APP_ID, LOGS_SCHEMA, LOGS_PARTITION_BY)
    assert writer.write(0, rows.slice(0, 2))
    time.sleep(0.03)  # no event says "the clock moved on" (Delta finds versions by mtime)
    after_first = dt.datetime.now(UTC)
    time.sleep(0.03)
    assert writer.write(1, rows.slice(2))

    df = lake.load(spark, tmp_path, "logs", version=1)  # version 0: the empty new table
    assert df.schema == from_arrow_schema(LOGS_SCHEMA)
    assert sorted(r.seq for r in df.collect()) == [1, 2]

    everything = lake.load(spark, tmp_path, "logs")
    assert everything.count() == 4
    assert everything.where("payload_valid").count() == 0
    first = everything.orderBy("seq").first()
    assert first is not None
    assert (first.ts, first.date, first.raw) == (
        dt.datetime(2024, 3, 10, 1, 0),  # Spark hands back naive datetimes in the session zone
        dt.date(2024, 3, 10),
        bytearray(b"[]"),
    )

    assert lake.load(spark, tmp_path, "logs", timestamp=after_first).count() == 2
    acme = lake.load(spark, tmp_path, "logs", where="tenant = 'acme'")
    assert sorted(r.seq for r in acme.collect()) == [1, 3]


def test_an_empty_result_keeps_the_schema(spark: SparkSession, tmp_path: Path) -> None:
    writer = DeltaBatchWriter(tmp_path / "logs", "test", LOGS_SCHEMA, LOGS_PARTITION_BY)
    row = dict.fromkeys(LOGS_SCHEMA.names)
    row.update(node="e", seq=1, ts=MIDNIGHT, date=MIDNIGHT.date(), tenant="t")
    row.update(payload_valid=False, raw=b"x")
    writer.write(0, pa.Table.from_pylist([row], schema=LOGS_SCHEMA))
    df = lake.load(spark, tmp_path, "logs", where="tenant = 'nobody'")
    assert df.count() == 0
    assert df.schema == from_arrow_schema(LOGS_SCHEMA)


def test_an_empty_version_with_nested_columns(spark: SparkSession, tmp_path: Path) -> None:
    # messages.user_properties is a list of structs; version 0 (the new table) has no files.
    writer = DeltaBatchWriter(tmp_path / "messages", "test", MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)
    row = {"node": "e", "seq": 1, "ts": MIDNIGHT, "date": MIDNIGHT.date(), "tenant": "t"}
    row |= {"client_id": "c", "topic": "a/b", "qos": 1, "retain": False, "payload": b"{}"}
    row |= {"content_type": None, "user_properties": [{"key": "k", "value": "v"}], "size": 2}
    writer.write(0, pa.Table.from_pylist([row], schema=MESSAGES_SCHEMA))
    empty = lake.load(spark, tmp_path, "messages", version=0)
    assert empty.count() == 0
    assert empty.schema == from_arrow_schema(MESSAGES_SCHEMA)
    assert lake.load(spark, tmp_path, "messages", where="tenant = 'nobody'").count() == 0
    [loaded] = lake.load(spark, tmp_path, "messages").collect()
    assert loaded.user_properties[0].asDict() == {"key": "k", "value": "v"}
