"""Every reader reads every table of a lake the real pipeline wrote (issues 16 part 1 and 18).

The pipeline (Spark's Delta) writes each table of ``schemas.tables.TABLES``; then, each in a
fresh process that must exit 0, the analysts' readers filter every string column of every
table: pyarrow over the snapshot's files (what broke on ``string_view`` files), polars
``scan_delta``, DuckDB ``delta_scan`` (the delta extension from its PyPI package, offline) and
pandas. Each must count what DataFusion (the light readers' engine) counts.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from counter_records import Counter, write_counters
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from broker_edge.packets import ReasonCode
from broker_edge.plim import disconnect_details, log_event, subscribe_details
from broker_edge.tenancy import LogEvent
from ingest.journal import JournalWriter
from schemas.tables import TABLES
from sinks.delta import read_table
from streaming import pipeline
from streaming.quality import run_quality
from streaming.quota_settings import QuotaSettings, TenantLimits
from streaming.settings import PipelineSettings

pytestmark = pytest.mark.spark

BASE = dt.datetime(2024, 3, 10, tzinfo=dt.UTC)
NOON = BASE + dt.timedelta(hours=12)


# Events as the edge's own code makes them (broker_edge), one of each shape the typed columns of
# ``logs`` read: a reason code, a reason, a topic with its QoS, a limit's name, limit and value.
EVENTS = {
    3: LogEvent(
        "",
        "disconnect",
        "truck-1",
        disconnect_details(
            peer="127.0.0.1:5000", clean=False, reason_code=ReasonCode.KEEP_ALIVE_TIMEOUT
        ),
    ),
    13: LogEvent("", "subscribe", "truck-1", subscribe_details(["fleet/+/telemetry"], [1])),
    23: LogEvent(
        "",
        "malformed_packet",
        "truck-1",
        {"peer": "127.0.0.1:5001", "reason_code": 0x81, "error": "bad remaining length"},
    ),
    33: LogEvent(
        "",
        "limit_exceeded",
        "truck-2",
        {"limit": "max_payload_bytes", "value": 10, "size": 11, "topic": "fleet/x", "qos": 1},
    ),
}
TYPED_COLUMNS = {
    "messages": ("payload_text",),
    "logs": ("reason", "reason_code", "topic", "qos", "metric", "limit", "value"),
    "usage": ("quota_metric",),
    "quota_events": ("usage_metric",),
}
# A payload that is not UTF-8 (no content type: no JSON contract): payload_text is null.
NOT_UTF8 = b"\xff\xfe\x00raw"


def log_record(tenant: str, us: int, event: LogEvent) -> tuple[str, bytes, None]:
    topic, payload = log_event(
        ts_us=us,
        node="edge-a",
        tenant=tenant,
        client_id=event.client_id,
        origin=event.origin,
        event=event.event,
        details=dict(event.details),
    )
    return topic, payload, None


def write_journal(settings: PipelineSettings) -> None:
    base_us = int(BASE.timestamp() * 1e6)
    with JournalWriter.open(settings.journal_root, "edge-a", fsync=False) as writer:
        for i in range(40):
            tenant = "acme" if i % 2 else "globex"
            us = base_us + i * 1_000_000
            topic, payload, ctype = (
                f"fleet/truck-{i % 3}/telemetry",
                b'{"speed": 1}',
                "application/json",
            )
            if i in EVENTS:
                topic, payload, ctype = log_record(tenant, us, EVENTS[i])
            elif i % 10 == 7:
                topic, payload, ctype = "$log/mqtt/connect", b"{not json", None
            elif i % 13 == 5:
                payload = b"{broken"  # breaks the JSON contract: quarantine
            elif i % 10 == 9:
                topic, payload, ctype = f"fleet/truck-{i % 3}/raw", NOT_UTF8, None
            elif i % 10 == 1:
                payload = '{"driver": "Zoë"}'.encode()
            writer.append(
                ts_us=us,
                tenant=tenant,
                client_id="truck-1",
                topic=topic,
                qos=1,
                retain=False,
                payload=payload,
                content_type=ctype,
                user_properties=(("fleet", "north"),) if i % 4 == 0 else (),
            )
        writer.flush()
    write_counters(
        settings.journal_root,
        "edge-b",
        [
            Counter("acme", "messages_in", 10, 8),
            Counter("acme", "messages_in", 70, 5),
            Counter("acme", "sessions", 10, 1, total=2),
        ],
    )


@pytest.fixture(scope="module")
def lake(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ingest import source

    source.register(spark)
    root = tmp_path_factory.mktemp("readers")
    settings = PipelineSettings(
        data_dir=root / "data",
        lake=root / "lake",
        master="local[2]",
        shuffle_partitions=2,
        quality_interval_seconds=0.0,
        maintenance_interval_seconds=0.0,
    )
    write_journal(settings)
    quota = QuotaSettings(
        load_limits=lambda: {"acme": TenantLimits(messages_per_day=10)},
        operator_token="operator",
        clock=lambda: NOON,
    )
    pipeline.run(settings, once=True, spark=spark, quota=quota)
    run_quality(spark, settings.lake, now=NOON)
    return settings.lake


def string_filters(lake: Path) -> dict[str, list[tuple[str, str | int]]]:
    """Per table, (column, a value it holds) for every top-level string or integer column."""
    filters: dict[str, list[tuple[str, str | int]]] = {}
    for table, spec in TABLES.items():
        rows = read_table(lake / table).to_pylist()
        assert rows, f"the pipeline wrote no {table}"
        filters[table] = [
            (field.name, next(r[field.name] for r in rows if r[field.name] is not None))
            for field in spec.schema
            if (field.type == pa.string() or pa.types.is_integer(field.type))
            and any(r[field.name] is not None for r in rows)
        ]
    # The columns an analyst reads without parsing (issue 16 part 4) are filtered on too.
    for table, names in TYPED_COLUMNS.items():
        assert set(names) <= {column for column, _ in filters[table]}, table
    return filters


def sql_literal(value: str | int) -> str:
    return str(value) if isinstance(value, int) else "'" + value.replace("'", "''") + "'"


def expected_counts(lake: Path, filters: dict[str, list[tuple[str, str | int]]]) -> dict[str, Any]:
    counts: dict[str, Any] = {}
    for table, pairs in filters.items():
        counts[table] = {"*": read_table(lake / table, columns=["date"]).num_rows}
        for column, value in pairs:
            counts[table][column] = read_table(
                lake / table, f'"{column}" = {sql_literal(value)}', columns=["date"]
            ).num_rows
    return counts


def test_the_typed_columns_an_analyst_reads_without_parsing(lake: Path) -> None:
    messages = read_table(lake / "messages", columns=["payload", "payload_text"]).to_pylist()
    assert {row["payload_text"] for row in messages if row["payload"] == NOT_UTF8} == {None}
    texts = [row for row in messages if row["payload"] != NOT_UTF8]
    assert texts
    assert all(row["payload_text"] == row["payload"].decode() for row in texts)
    assert '{"driver": "Zoë"}' in {row["payload_text"] for row in texts}
    logs = {
        row["event_type"]: row for row in read_table(lake / "logs", "payload_valid").to_pylist()
    }
    typed = ("reason", "reason_code", "topic", "qos", "metric", "limit", "value")
    assert {event: tuple(logs[event][name] for name in typed) for event in logs} == {
        "disconnect": (None, 0x8D, None, None, None, None, None),
        "subscribe": (None, 1, "fleet/+/telemetry", 1, None, None, None),
        "malformed_packet": ("bad remaining length", 0x81, None, None, None, None, None),
        "limit_exceeded": (None, None, "fleet/x", 1, "max_payload_bytes", 10, 11),
    }
    # Invalid payloads still land, typed columns null (nothing parsed).
    invalid = read_table(lake / "logs", "NOT payload_valid").to_pylist()
    assert invalid
    assert all(row[name] is None for row in invalid for name in typed)
    # Usage metrics and quota metrics name each other.
    usage = read_table(lake / "usage", columns=["metric", "quota_metric"]).to_pylist()
    assert {(row["metric"], row["quota_metric"]) for row in usage} == {
        ("messages_in", "messages_per_day"),
        ("sessions", None),
    }
    quota = read_table(lake / "quota_events", columns=["metric", "usage_metric"]).to_pylist()
    assert {(row["metric"], row["usage_metric"]) for row in quota} == {
        ("messages_per_day", "messages_in")
    }


def physical(type_: pa.DataType) -> str:
    """A type's physical shape: no nullability, no list item names (Parquet writers differ)."""
    if pa.types.is_list(type_):
        return f"list<{physical(type_.value_type)}>"
    if pa.types.is_struct(type_):
        fields = (type_.field(i) for i in range(type_.num_fields))
        return "struct<" + ", ".join(f"{f.name}: {physical(f.type)}" for f in fields) + ">"
    return str(type_)


def test_user_properties_reach_messages_as_written(lake: Path) -> None:
    rows = read_table(lake / "messages", columns=["seq", "user_properties"]).to_pylist()
    with_props = [r for r in rows if r["user_properties"]]
    assert with_props, "the journal had properties on every fourth record"
    assert all(r["user_properties"] == [{"key": "fleet", "value": "north"}] for r in with_props)
    assert all(r["user_properties"] == [] for r in rows if not r["user_properties"])


def test_every_data_file_has_the_physical_types_its_schema_declares(lake: Path) -> None:
    for table, spec in TABLES.items():
        delta = DeltaTable(str(lake / table))
        partitions = set(delta.metadata().partition_columns)
        declared = {f.name: physical(f.type) for f in spec.schema if f.name not in partitions}
        for uri in delta.file_uris():
            schema = pq.read_schema(uri.removeprefix("file://"))
            got = {name: physical(schema.field(name).type) for name in declared}
            assert got == declared, (table, uri)


READERS = {
    "pyarrow": """
        import pyarrow as pa
        import pyarrow.dataset as ds
        from deltalake import DeltaTable
        def count(path, column, value):
            delta = DeltaTable(path)
            schema = pa.schema(delta.schema().to_arrow())
            partitions = pa.schema(
                [schema.field(name) for name in delta.metadata().partition_columns]
            )
            data = ds.dataset(
                delta.file_uris(), schema=schema, format="parquet",
                partitioning=ds.partitioning(partitions, flavor="hive"),
                partition_base_dir=path,
            )
            if column is None:
                return data.count_rows()
            return data.to_table(filter=ds.field(column) == value).num_rows
    """,
    "polars": """
        import polars as pl
        def count(path, column, value):
            frame = pl.scan_delta(path)
            if column is not None:
                frame = frame.filter(pl.col(column) == value)
            return frame.select(pl.len()).collect().item()
    """,
    "duckdb": """
        import glob, os
        import duckdb, duckdb_ext
        (extension,) = glob.glob(os.path.join(
            list(duckdb_ext.__path__)[0], "extensions", "*", "*", "delta.duckdb_extension"))
        con = duckdb.connect()
        con.execute(f"LOAD '{extension}'")
        def count(path, column, value):
            sql = f"SELECT count(*) FROM delta_scan('{path}')"
            if column is None:
                return con.execute(sql).fetchone()[0]
            return con.execute(sql + f' WHERE "{column}" = ?', [value]).fetchone()[0]
    """,
    "pandas": """
        import pyarrow as pa
        from deltalake import DeltaTable, QueryBuilder
        def count(path, column, value):
            reader = QueryBuilder().register("t", DeltaTable(path)).execute("SELECT * FROM t")
            frame = pa.RecordBatchReader.from_stream(reader).read_all().to_pandas()
            if column is None:
                return len(frame)
            return int((frame[column] == value).sum())
    """,
}

DRIVER = """
import json, sys
filters = json.loads(sys.argv[2])
counts = {}
for table, pairs in filters.items():
    path = f"{sys.argv[1]}/{table}"
    counts[table] = {"*": count(path, None, None)}
    for column, value in pairs:
        counts[table][column] = count(path, column, value)
print(json.dumps(counts))
"""


@pytest.mark.parametrize("reader", sorted(READERS))
def test_each_reader_filters_every_string_column_of_every_table(lake: Path, reader: str) -> None:
    filters = string_filters(lake)
    expected = expected_counts(lake, filters)
    script = textwrap.dedent(READERS[reader]) + DRIVER
    for attempt in range(2):  # a reader process must exit 0 every time
        done = subprocess.run(
            [sys.executable, "-c", script, str(lake), json.dumps(filters)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, (reader, attempt, done.stderr[-2000:])
        assert json.loads(done.stdout) == expected, reader
