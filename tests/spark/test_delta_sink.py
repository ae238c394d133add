"""The idempotent Delta batch writer and the safe reader (delta-rs, no Spark needed)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from schemas.tables import MESSAGES_PARTITION_BY, MESSAGES_SCHEMA
from sinks.delta import DeltaBatchWriter, read_table
from sinks.errors import DeltaSinkError, SinkSchemaError

APP = "test.history"


def message(seq: int, *, tenant: str = "acme", day: int = 9, **overrides: Any) -> dict[str, Any]:
    ts = dt.datetime(2024, 3, day, 12, 0, seq % 60, tzinfo=dt.UTC)
    row: dict[str, Any] = {
        "node": "edge-1",
        "seq": seq,
        "ts": ts,
        "date": ts.date(),
        "tenant": tenant,
        "client_id": "truck-7",
        "topic": "fleet/truck-7/telemetry",
        "qos": 1,
        "retain": False,
        "payload": b"abc",
        "content_type": None,
        "user_properties": [{"key": "k", "value": str(seq)}],
        "size": 3,
    }
    row.update(overrides)
    return row


def batch(*rows: dict[str, Any]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=MESSAGES_SCHEMA)


@pytest.fixture
def writer(tmp_path: Path) -> DeltaBatchWriter:
    return DeltaBatchWriter(tmp_path / "messages", APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)


def test_replayed_batch_is_skipped(writer: DeltaBatchWriter) -> None:
    assert writer.last_batch_id() is None
    assert writer.write(0, batch(message(1), message(2, tenant="other")))
    assert writer.write(1, batch(message(3, day=10)))
    version = DeltaTable(writer.path).version()

    assert not writer.write(1, batch(message(3, day=10)))  # the replay after a crash
    assert not writer.write(0, batch(message(1)))

    assert DeltaTable(writer.path).version() == version
    assert writer.last_batch_id() == 1
    seqs = read_table(writer.path, columns=["seq"]).column("seq").to_pylist()
    assert sorted(seqs) == [1, 2, 3]


def test_table_is_partitioned_by_tenant_and_date(writer: DeltaBatchWriter) -> None:
    writer.write(0, batch(message(1), message(2, tenant="other", day=10)))
    delta = DeltaTable(writer.path)
    assert delta.metadata().partition_columns == list(MESSAGES_PARTITION_BY)
    assert (Path(writer.path) / "tenant=other" / "date=2024-03-10").is_dir()


def test_read_table_gives_rows_back_with_the_table_types(writer: DeltaBatchWriter) -> None:
    rows = [message(1), message(2, tenant="other", content_type="text/plain")]
    writer.write(0, batch(*rows))
    back = read_table(writer.path, schema=MESSAGES_SCHEMA).sort_by("seq")
    assert back.schema == MESSAGES_SCHEMA
    assert back.to_pylist() == rows

    some = read_table(writer.path, "tenant = 'other' AND seq >= 2", columns=["seq", "tenant"])
    assert some.to_pylist() == [{"seq": 2, "tenant": "other"}]
    assert read_table(writer.path, "seq > 100").num_rows == 0


def test_empty_batch_commits_nothing(writer: DeltaBatchWriter) -> None:
    writer.write(0, batch(message(1)))
    version = DeltaTable(writer.path).version()
    assert not writer.write(1, batch())
    assert DeltaTable(writer.path).version() == version
    assert writer.last_batch_id() == 0
    # A later batch still lands: the skipped empty batch id leaves no gap that matters.
    assert writer.write(2, batch(message(2)))
    assert writer.last_batch_id() == 2


def test_batches_from_other_engines_are_cast(writer: DeltaBatchWriter) -> None:
    loose = batch(message(1)).cast(
        pa.schema(
            [
                field.with_type(pa.large_string()) if field.type == pa.string() else field
                for field in MESSAGES_SCHEMA
            ]
        )
    )
    assert writer.write(0, loose)
    assert read_table(writer.path, schema=MESSAGES_SCHEMA).to_pylist() == [message(1)]


def test_batches_that_do_not_fit_are_rejected(writer: DeltaBatchWriter) -> None:
    with pytest.raises(SinkSchemaError, match="missing \\['size'\\]"):
        writer.write(0, batch(message(1)).drop_columns(["size"]))
    nulls = batch(message(1)).set_column(
        1, pa.field("seq", pa.int64()), pa.array([None], pa.int64())
    )
    with pytest.raises(SinkSchemaError, match="'seq'"):
        writer.write(0, nulls)
    assert writer.last_batch_id() is None


def test_reading_a_missing_table_or_bad_sql_is_a_sink_error(writer: DeltaBatchWriter) -> None:
    with pytest.raises(DeltaSinkError, match="not a Delta table"):
        read_table(writer.path)
    writer.write(0, batch(message(1)))
    with pytest.raises(DeltaSinkError, match="query failed"):
        read_table(writer.path, "no_such_column = 1")
    with pytest.raises(SinkSchemaError):
        read_table(writer.path, columns=["no_such_column"])


def test_a_file_in_the_way_is_a_sink_error(tmp_path: Path) -> None:
    path = tmp_path / "messages"
    path.write_bytes(b"not a table")
    writer = DeltaBatchWriter(path, APP, MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)
    with pytest.raises(DeltaSinkError):
        writer.last_batch_id()
    with pytest.raises(DeltaSinkError):
        writer.write(0, batch(message(1)))
    with pytest.raises(DeltaSinkError):
        read_table(path)


def java_style_empty_strings() -> pa.Array:
    # Spark's Java Arrow writer gives zero-length string arrays an empty offsets buffer. Here it
    # points at non-zero bytes, so reading past it (the bug) gives garbage, not lucky zeros.
    empty = pa.py_buffer(b"\xff" * 64).slice(0, 0)
    return pa.Array.from_buffers(pa.string(), 0, [None, empty, empty])


def test_batches_with_java_style_empty_offsets_are_written(writer: DeltaBatchWriter) -> None:
    # All user_properties lists empty: the key/value arrays under them have no offsets at all,
    # which made delta-rs (arrow-rs) read past the buffer and panic.
    prop_type = MESSAGES_SCHEMA.field("user_properties").type
    props = pa.StructArray.from_arrays(
        [java_style_empty_strings(), java_style_empty_strings()],
        fields=list(prop_type.value_type),
    )
    lists = pa.ListArray.from_arrays(pa.array([0, 0, 0], pa.int32()), props, type=prop_type)
    rows = batch(message(1), message(2))
    rows = rows.set_column(rows.schema.get_field_index("user_properties"), "user_properties", lists)
    assert writer.write(0, rows)
    back = read_table(writer.path, columns=["seq", "user_properties"]).sort_by("seq")
    assert back.to_pylist() == [
        {"seq": 1, "user_properties": []},
        {"seq": 2, "user_properties": []},
    ]


READER = textwrap.dedent(
    """
    import sys
    from sinks.delta import read_table
    table = read_table(sys.argv[1], "seq > 1")
    assert table.num_rows == 2, table.num_rows
    """
)


def test_reader_processes_always_exit_cleanly(writer: DeltaBatchWriter) -> None:
    # delta-rs can abort the interpreter at exit (134) after to_pyarrow_*: read_table must not.
    writer.write(0, batch(message(1), message(2), message(3, tenant="other")))
    for attempt in range(10):
        done = subprocess.run(
            [sys.executable, "-c", READER, writer.path],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, (attempt, done.returncode, done.stderr)


def test_spark_batches_of_empty_lists_reach_every_table(spark: Any, tmp_path: Path) -> None:
    # Regression: Spark's Arrow output for all-empty lists (and empty partitions) has empty
    # offsets buffers, which once made delta-rs panic; the fan-out must repair them.
    from schemas.journal import JOURNAL_SCHEMA
    from sinks.quarantine import quarantine_writer
    from streaming.pipeline import TableFanout, table_steps
    from streaming.settings import PipelineSettings

    settings = PipelineSettings(data_dir=tmp_path / "data", lake=tmp_path / "lake")
    ts = dt.datetime(2024, 3, 10, tzinfo=dt.UTC)
    rows: list[dict[str, Any]] = [
        {
            "node": "edge-1",
            "seq": i,
            "ts": ts,
            "tenant": "acme",
            "client_id": "dev",
            "topic": "a/b" if i % 2 else "$log/mqtt/connect",
            "qos": 1,
            "retain": False,
            "payload": b"x",
            "content_type": None,
            "user_properties": [],
        }
        for i in range(1, 7)
    ]
    journal = spark.createDataFrame(pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA))
    fanout = TableFanout(
        table_steps(settings, None), quarantine_writer(settings.table_path("quarantine"))
    )
    fanout(journal.repartition(4), 0)
    back = read_table(settings.table_path("messages"), columns=["seq", "user_properties"])
    assert sorted(back.column("seq").to_pylist()) == [1, 3, 5]
    assert back.column("user_properties").to_pylist() == [[]] * 3
    quarantined = read_table(settings.table_path("quarantine"), columns=["seq", "user_properties"])
    assert sorted(quarantined.column("seq").to_pylist()) == [2, 4, 6]  # not log events
