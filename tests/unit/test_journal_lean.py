"""A lean edge (issue 9): the edge writes and reads its journal with arro3, never pyarrow (nor
pandas through it); what it writes stays Arrow IPC that pyarrow readers read, byte for byte the
record batch message they expect, and journals pyarrow wrote before stay readable by the edge."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pyarrow as pa
import pytest

from ingest.journal import (
    FILE_HEADER,
    FRAME_HEADER,
    FRAME_MAGIC,
    WRITER_SCHEMA,
    JournalReader,
    JournalWriter,
    segment_name,
)
from schemas.journal import JOURNAL_SCHEMA

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("pyarrow", "pandas", "numpy", "pyspark")


def test_the_writer_schema_is_the_journal_schema() -> None:
    assert pa.schema(WRITER_SCHEMA).equals(JOURNAL_SCHEMA, check_metadata=True)


def _records(n: int) -> list[dict[str, object]]:
    return [
        {
            "ts_us": 1_700_000_000_000_000 + i,
            "tenant": "acme" if i % 2 else "default",
            "client_id": f"dev-{i % 3}",
            "topic": f"fleet/v{i}/telemetry",
            "qos": i % 3,
            "retain": i % 4 == 0,
            "payload": b'{"speed": %d}' % i,
            "content_type": None if i % 3 else "application/json",
            "user_properties": tuple((f"k{j}", f"v{j}") for j in range(i % 3)),
        }
        for i in range(n)
    ]


def test_frames_written_with_arro3_are_what_pyarrow_reads(tmp_path: Path) -> None:
    records = _records(50)
    with JournalWriter.open(tmp_path, "n1") as w:
        for rec in records:
            w.append(**rec)  # type: ignore[arg-type]
        frame = w.drain()
        assert frame is not None
        w.commit(frame)
    # The frame body, read the way the Spark source reads it: pyarrow's own IPC reader.
    data = (tmp_path / "n1" / segment_name(1)).read_bytes()
    magic, body_len, crc, first, count = FRAME_HEADER.unpack_from(data, len(FILE_HEADER))
    body = data[len(FILE_HEADER) + FRAME_HEADER.size :]
    assert (magic, body_len, crc, first, count) == (FRAME_MAGIC, len(body), zlib.crc32(body), 1, 50)
    batch = pa.ipc.read_record_batch(pa.py_buffer(body), JOURNAL_SCHEMA)
    batch.validate(full=True)
    rows = batch.to_pylist()
    assert [r["seq"] for r in rows] == list(range(1, 51))
    for row, rec in zip(rows, records, strict=True):
        assert row["node"] == "n1"
        assert int(row["ts"].timestamp() * 1_000_000) == rec["ts_us"]
        for key in ("tenant", "client_id", "topic", "qos", "retain", "payload", "content_type"):
            assert row[key] == rec[key], key
        assert [(p["key"], p["value"]) for p in row["user_properties"]] == list(
            rec["user_properties"]  # type: ignore[call-overload]
        )


def test_the_edge_reads_frames_pyarrow_wrote(tmp_path: Path) -> None:
    """Journals written before issue 9 (pyarrow's RecordBatch.serialize) replay on the edge."""
    records = _records(7)
    table = pa.RecordBatch.from_pylist(
        [
            {
                "node": "old",
                "seq": i + 1,
                "ts": pa.scalar(r["ts_us"], JOURNAL_SCHEMA.field("ts").type).as_py(),
                **{k: v for k, v in r.items() if k not in ("ts_us", "user_properties")},
                "user_properties": [{"key": k, "value": v} for k, v in r["user_properties"]],  # type: ignore[attr-defined]
            }
            for i, r in enumerate(records)
        ],
        schema=JOURNAL_SCHEMA,
    )
    body = table.serialize().to_pybytes()
    node_dir = tmp_path / "old"
    node_dir.mkdir()
    header = FRAME_HEADER.pack(FRAME_MAGIC, len(body), zlib.crc32(body), 1, 7)
    (node_dir / segment_name(1)).write_bytes(FILE_HEADER + header + body)
    with JournalWriter.open(tmp_path, "old") as w:  # recovery checks the frame, keeps it
        assert w.next_seq == 8
    got = list(JournalReader(node_dir).read_records(0, 7))
    assert [r["seq"] for r in got] == list(range(1, 8))
    assert [r["ts"] for r in got] == [r["ts_us"] for r in records]
    assert [r["payload"] for r in got] == [r["payload"] for r in records]
    assert got[2]["user_properties"] == [{"key": "k0", "value": "v0"}, {"key": "k1", "value": "v1"}]


def _fresh(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )
    return out.stdout.split()


def test_the_edge_imports_neither_pyarrow_nor_pandas() -> None:
    loaded = _fresh(
        f"""
        import sys
        import broker_edge.node, edgebus.cli
        print(*[m for m in {HEAVY!r} if m in sys.modules])
        """
    )
    assert loaded == []


def test_a_running_edge_process_has_no_pyarrow_or_pandas_mapped(tmp_path: Path) -> None:
    """The real ``edgebus edge`` process, serving MQTT and its journal over HTTP (a range of
    records fetched): no pyarrow or pandas library in memory."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgebus.cli",
            "edge",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path),
            "--node-id",
            "lean",
            "--http",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert " on 127.0.0.1:" in line, line
        http_port = int(proc.stdout.readline().decode().rsplit(":", 1)[1])
        deadline = time.monotonic() + 30
        while JournalReader(tmp_path / "journal" / "lean").last_seq() == 0:  # $SYS is not journaled
            with socket.create_connection(("127.0.0.1", int(line.rsplit(":", 1)[1]))) as mqtt:
                mqtt.sendall(bytes.fromhex("100c00044d5154540402003c0000"))  # CONNECT, then gone
                mqtt.recv(4)  # CONNACK: its connect log event is journaled
            assert time.monotonic() < deadline
            time.sleep(0.05)  # the journal commits on its own thread
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=10)
        token = (tmp_path / "operator.token").read_text().strip()  # the edge's own
        conn.request(
            "GET", "/journal/records?after=0&upto=1", headers={"Authorization": f"Bearer {token}"}
        )
        response = conn.getresponse()
        assert response.status == 200
        assert pa.ipc.open_stream(response.read()).read_all().num_rows == 1
        conn.close()
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    libraries = {line.split()[-1] for line in maps.splitlines() if line.endswith(".so")}
    assert any("/arro3/" in lib for lib in libraries)  # the writer is loaded
    for heavy in HEAVY:
        assert not [lib for lib in libraries if f"/{heavy}/" in lib or f"/{heavy}.libs/" in lib]


@pytest.mark.parametrize("n", [1, 1000])
def test_empty_and_large_user_property_columns(tmp_path: Path, n: int) -> None:
    with JournalWriter.open(tmp_path, "n", fsync=False) as w:
        for i in range(n):
            w.append(
                ts_us=i,
                tenant="t",
                client_id="c",
                topic="x",
                qos=1,
                retain=False,
                payload=b"",
                user_properties=(("a", "b"),) * (i % 2),
            )
        w.flush()
    rows = list(JournalReader(tmp_path / "n").read_records(0, n))
    assert [len(r["user_properties"]) for r in rows] == [i % 2 for i in range(n)]
