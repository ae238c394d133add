"""Reading any edgebus table as of a Delta version or a time (``streaming.lake``)."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from lake_fixture import DeltaBatchWriter

from schemas.tables import LOGS_SCHEMA, MESSAGES_SCHEMA, TABLES
from streaming import lake
from streaming.lake import LakeError

UTC = dt.UTC
TS = dt.datetime(2024, 3, 10, 8, tzinfo=UTC)


def message(seq: int, tenant: str = "acme") -> dict[str, Any]:
    return {
        "node": "edge-1",
        "seq": seq,
        "ts": TS,
        "date": TS.date(),
        "tenant": tenant,
        "client_id": "truck-1",
        "topic": "fleet/truck-1/telemetry",
        "qos": 1,
        "retain": False,
        "payload": b"{}",
        "content_type": None,
        "user_properties": [{"key": "k", "value": "v"}],
        "size": 2,
    }


# Wall-clock moments between the commits of the root fixture's messages table: after
# version 1, 2 and 3 were committed (and before the next one).
MOMENTS: dict[int, dt.datetime] = {}
# Delta finds a version by time through its commit file's modification time, which the
# file system's clock may put a few milliseconds off the commit's own timestamp: keep the
# moments this far from every commit.
CLOCK_MARGIN_S = 0.03


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A lake whose messages table holds seqs [1], [1, 2], [1, 2, 3, 4] at versions 1, 2, 3.

    Version 0 is the (empty) table the writer creates before its first append.
    """
    path = tmp_path_factory.mktemp("lake")
    spec = TABLES["messages"]
    writer = DeltaBatchWriter(path / "messages", "test", spec.schema, spec.partition_by)
    for batch_id, seqs in enumerate([[1], [2], [3, 4]]):
        tenants = ["acme", "other"] * 2
        rows = [message(seq, tenants[seq - 1]) for seq in seqs]
        writer.write(batch_id, pa.Table.from_pylist(rows, schema=MESSAGES_SCHEMA))
        # No event says "the clock moved on"; waiting for it is the point here.
        time.sleep(CLOCK_MARGIN_S)
        MOMENTS[batch_id + 1] = dt.datetime.now(UTC)
        time.sleep(CLOCK_MARGIN_S)
    logs_writer = DeltaBatchWriter(path / "logs", "test", LOGS_SCHEMA, TABLES["logs"].partition_by)
    log = {
        "node": "edge-1",
        "seq": 9,
        "ts": TS,
        "date": TS.date(),
        "tenant": "acme",
        "origin": "mqtt",
        "event_type": "connect",
        "client_id": "truck-1",
        "details": "{}",
        "time": TS.isoformat(),
        "payload_valid": True,
        "invalid_reason": None,
        "raw": None,
    }
    logs_writer.write(0, pa.Table.from_pylist([log], schema=LOGS_SCHEMA))
    return path


def seqs(table: pa.Table) -> list[int]:
    return sorted(table.column("seq").to_pylist())


def test_latest_has_the_table_schema(root: Path) -> None:
    table = lake.load_arrow(root, "messages")
    assert table.schema == MESSAGES_SCHEMA
    assert seqs(table) == [1, 2, 3, 4]
    assert table.to_pylist()[0]["user_properties"] == [{"key": "k", "value": "v"}]
    logs = lake.load_arrow(root, "logs")
    assert logs.schema == LOGS_SCHEMA
    assert logs.column("seq").to_pylist() == [9]


@pytest.mark.parametrize(
    ("version", "expected"), [(0, []), (1, [1]), (2, [1, 2]), (3, [1, 2, 3, 4])]
)
def test_by_version(root: Path, version: int, expected: list[int]) -> None:
    assert seqs(lake.load_arrow(root, "messages", version=version)) == expected


def test_by_time(root: Path) -> None:
    at = MOMENTS
    assert seqs(lake.load_arrow(root, "messages", timestamp=at[1])) == [1]
    assert seqs(lake.load_arrow(root, "messages", timestamp=at[2])) == [1, 2]
    assert seqs(lake.load_arrow(root, "messages", timestamp=at[3])) == [1, 2, 3, 4]
    later = at[3] + dt.timedelta(days=1)
    assert seqs(lake.load_arrow(root, "messages", timestamp=later)) == [1, 2, 3, 4]
    # The same instant in another zone.
    berlin = at[2].astimezone(dt.timezone(dt.timedelta(hours=1)))
    assert seqs(lake.load_arrow(root, "messages", timestamp=berlin)) == [1, 2]


def test_before_the_table_was_created_is_an_error(root: Path) -> None:
    created_ms = DeltaTable(str(root / "messages")).metadata().created_time
    created = dt.datetime.fromtimestamp(created_ms / 1000, UTC)
    with pytest.raises(LakeError, match=r"no version at .* the table was created at"):
        lake.load_arrow(root, "messages", timestamp=created - dt.timedelta(seconds=1))


def test_where_prunes_and_filters(root: Path) -> None:
    assert seqs(lake.load_arrow(root, "messages", where="tenant = 'acme'")) == [1, 3]
    assert seqs(lake.load_arrow(root, "messages", version=2, where="tenant = 'other'")) == [2]
    empty = lake.load_arrow(root, "messages", where="seq > 100")
    assert empty.num_rows == 0
    assert empty.schema == MESSAGES_SCHEMA


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"table": "nope"}, LakeError, "unknown table 'nope'; the lake has logs, messages"),
        ({"version": 7}, LakeError, "cannot load the table at version 7"),
        ({"where": "no_such_column = 1"}, LakeError, "query failed"),
        ({"version": 1, "timestamp": TS}, ValueError, "not both"),
        ({"timestamp": dt.datetime(2024, 3, 10)}, ValueError, "time-zone aware"),
    ],
)
def test_bad_requests(root: Path, kwargs: dict[str, Any], error: type, match: str) -> None:
    table = kwargs.pop("table", "messages")
    with pytest.raises(error, match=match):
        lake.load_arrow(root, table, **kwargs)


def test_a_table_not_written_yet(tmp_path: Path) -> None:
    with pytest.raises(LakeError, match="no logs table"):
        lake.load_arrow(tmp_path, "logs")


def test_every_registered_table_is_consistent() -> None:
    assert {"messages", "logs"} <= set(TABLES)
    for spec in TABLES.values():
        assert set(spec.partition_by) <= set(spec.schema.names)
    assert TABLES["messages"].schema is MESSAGES_SCHEMA
    assert TABLES["logs"].schema is LOGS_SCHEMA


def test_latest_date_is_the_last_day_with_rows(tmp_path: Path) -> None:
    spec = TABLES["messages"]
    writer = DeltaBatchWriter(tmp_path / "messages", "test", spec.schema, spec.partition_by)
    days = {1: ("acme", 0), 2: ("acme", 1), 3: ("other", 5)}  # seq -> tenant, days after TS
    rows = [
        message(seq, tenant) | {"date": TS.date() + dt.timedelta(days=after)}
        for seq, (tenant, after) in days.items()
    ]
    writer.write(0, pa.Table.from_pylist(rows, schema=MESSAGES_SCHEMA))

    assert lake.latest_date(tmp_path, "messages") == TS.date() + dt.timedelta(days=5)
    assert lake.latest_date(tmp_path, "messages", where="tenant = 'acme'") == dt.date(2024, 3, 11)
    assert lake.latest_date(tmp_path, "messages", where="tenant = 'nobody'") is None
    with pytest.raises(LakeError, match="no logs table"):
        lake.latest_date(tmp_path, "logs")
