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


def log_payload(node: str, tenant: str, us: int, event: str) -> bytes:
    doc = {
        "time": dt.datetime.fromtimestamp(us / 1e6, dt.UTC).isoformat(),
        "ts_us": us,
        "node": node,
        "tenant": tenant,
        "client_id": "truck-1",
        "origin": "mqtt",
        "event": event,
        "details": {"peer": "127.0.0.1:5000", "clean": False},
    }
    return json.dumps(doc).encode()


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
            if i % 10 == 3:
                topic, payload, ctype = (
                    "$log/mqtt/disconnect",
                    log_payload("edge-a", tenant, us, "disconnect"),
                    None,
                )
            elif i % 10 == 7:
                topic, payload, ctype = "$log/mqtt/connect", b"{not json", None
            elif i % 13 == 5:
                payload = b"{broken"  # breaks the JSON contract: quarantine
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


def string_filters(lake: Path) -> dict[str, list[tuple[str, str]]]:
    """Per table, (column, a value it holds) for every top-level string column."""
    filters: dict[str, list[tuple[str, str]]] = {}
    for table, spec in TABLES.items():
        rows = read_table(lake / table).to_pylist()
        assert rows, f"the pipeline wrote no {table}"
        filters[table] = [
            (field.name, next(r[field.name] for r in rows if r[field.name] is not None))
            for field in spec.schema
            if field.type == pa.string() and any(r[field.name] is not None for r in rows)
        ]
    return filters


def expected_counts(lake: Path, filters: dict[str, list[tuple[str, str]]]) -> dict[str, Any]:
    counts: dict[str, Any] = {}
    for table, pairs in filters.items():
        counts[table] = {"*": read_table(lake / table, columns=["date"]).num_rows}
        for column, value in pairs:
            literal = value.replace("'", "''")
            counts[table][column] = read_table(
                lake / table, f"\"{column}\" = '{literal}'", columns=["date"]
            ).num_rows
    return counts


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
