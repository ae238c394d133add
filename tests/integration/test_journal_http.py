"""The edge's journal over HTTP (issue 12): a real edge with ``http_listen`` on port 0, real paho
publishers, and plain HTTP clients: only the operator token reads it, only durable records,
exactly the range asked for, as an Arrow IPC stream; clear refusals otherwise."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from conftest import RunningEdge

from bench.brokers import free_port
from broker_edge.errors import ConfigError
from broker_edge.settings import EdgeSettings
from ingest import source
from ingest.journal import JournalReader, list_segments
from ingest.remote import EdgeRefused, EdgeUnavailable, journal_range, read_range
from ingest.source import EdgebusStreamReader, JournalRange, SourceError, SourceOptions
from schemas import operator_token
from schemas.journal import JOURNAL_SCHEMA

BEARER = {"Authorization": "Bearer op-token"}


def get(port: int, target: str, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", target, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def published(make_client: Any, edge: RunningEdge, count: int) -> int:
    """Publish ``count`` QoS 1 messages (each acked once durable); the node's durable seq."""
    client = make_client(port=edge.port, username="acme-1")
    for i in range(count):
        client.publish(f"fleet/truck-{i % 7}/telemetry", b'{"speed": %d}' % i, qos=1)
    client.close()
    return JournalReader(edge.settings.journal_root / edge.settings.node_id).last_seq()


def journal_table(edge: RunningEdge, after: int, upto: int) -> pa.Table:
    reader = JournalReader(edge.settings.journal_root / edge.settings.node_id)
    return pa.Table.from_batches(list(reader.read(after, upto)), schema=JOURNAL_SCHEMA)


@pytest.fixture
def http_edge(make_edge: Any, tenants_file: Path) -> RunningEdge:
    edge: RunningEdge = make_edge(tenants_file, http_listen="127.0.0.1:0", journal_fsync=False)
    return edge


def http_port(edge: RunningEdge) -> int:
    assert edge.node.http is not None
    return edge.node.http.port


def test_a_batch_waits_for_its_nodes_edge_to_answer(
    make_edge: Any, tenants_file: Path, edge_settings: EdgeSettings, tmp_path: Path
) -> None:
    """Planning a batch that holds a node's records (a replay after a restart) waits for the
    node's edge, restarting or too busy to answer, instead of failing the query at once."""
    port = free_port()
    reader = EdgebusStreamReader(
        SourceOptions(tmp_path / "journal", 100, None, (f"127.0.0.1:{port}",), "op-token")
    )
    late = threading.Timer(1.5, make_edge, (tenants_file,), {"http_listen": f"127.0.0.1:{port}"})
    late.start()
    try:
        node = edge_settings.node_id
        ranges = reader.partitions({node: 0}, {node: 3})
    finally:
        late.join()
    assert ranges == [JournalRange(node, 0, 3, f"127.0.0.1:{port}")]


def test_a_batch_whose_edge_never_answers_fails_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(source, "EDGE_WAIT_SECONDS", 1.0)
    edge = f"127.0.0.1:{free_port()}"  # nothing listens there
    reader = EdgebusStreamReader(SourceOptions(tmp_path / "journal", 100, None, (edge,), None))
    began = time.monotonic()
    with pytest.raises(SourceError, match=rf"node 'edge-x' .*\({edge}\) .*asked for 1 s"):
        reader.partitions({"edge-x": 0}, {"edge-x": 3})
    assert time.monotonic() - began >= 1.0


def test_healthz_is_open_and_the_journal_needs_the_operator_token(
    http_edge: RunningEdge, make_client: Any
) -> None:
    port = http_port(http_edge)
    last = published(make_client, http_edge, 5)
    assert get(port, "/healthz")[::2] == (200, b'{"status": "ok"}')
    status, headers, body = get(port, "/journal")
    assert (status, headers["WWW-Authenticate"]) == (401, 'Bearer realm="edgebus"')
    assert "operator token" in json.loads(body)["error"]
    status, _, body = get(port, "/journal", {"Authorization": "Bearer acme-1"})  # a tenant's
    assert status == 403
    assert get(port, "/journal/records?after=0&upto=1", {"Authorization": "Basic x"})[0] == 401
    status, _, body = get(port, "/journal", BEARER)
    assert status == 200
    answer = json.loads(body)
    assert (answer["node"], answer["first_seq"]) == ("test", 1)
    assert answer["last_seq"] >= last >= 5  # the publishes and the edge's own log events


def test_a_range_is_exactly_its_records_as_an_arrow_stream(
    http_edge: RunningEdge, make_client: Any
) -> None:
    port = http_port(http_edge)
    last = published(make_client, http_edge, 120)  # one frame per acked publish at least
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:  # several requests on one keep-alive connection
        for after, upto in [(0, last), (5, 17), (last - 1, last), (3, 3)]:
            conn.request("GET", f"/journal/records?after={after}&upto={upto}", headers=BEARER)
            response = conn.getresponse()
            assert response.status == 200
            assert response.headers["Content-Type"] == "application/vnd.apache.arrow.stream"
            assert response.headers["Transfer-Encoding"] == "chunked"  # streamed, not buffered
            table = pa.ipc.open_stream(response).read_all()
            assert response.read() == b""
            assert table.equals(journal_table(http_edge, after, upto)), (after, upto)
            assert table.column("seq").to_pylist() == list(range(after + 1, upto + 1))
    finally:
        conn.close()
    got = pa.Table.from_batches(list(read_range(f"127.0.0.1:{port}", "op-token", "test", 2, last)))
    assert got.equals(journal_table(http_edge, 2, last))


def test_never_past_the_durable_watermark_and_requests_are_bounded(
    make_edge: Any, tenants_file: Path, make_client: Any
) -> None:
    edge = make_edge(tenants_file, http_listen="127.0.0.1:0", http_max_records=10)
    port = http_port(edge)
    last = published(make_client, edge, 3)
    status, _, body = get(port, f"/journal/records?after={last - 1}&upto={last + 9}", BEARER)
    assert status == 416
    durable = json.loads(body)["last_seq"]  # the client's disconnect event may be in by now
    assert durable in (last, last + 1)
    assert json.loads(body)["error"] == (
        f"node test: seqs {durable + 1}..{last + 9} are not durable yet "
        f"(durable up to seq {durable})"
    )
    status, _, body = get(port, "/journal/records?after=0&upto=11", BEARER)
    assert (status, json.loads(body)["max_records"]) == (413, 10)
    for query in ("after=1", "after=x&upto=2", "after=5&upto=2"):
        assert get(port, f"/journal/records?{query}", BEARER)[0] == 400
    assert get(port, "/nothing", BEARER)[0] == 404
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/journal", body=b"{}", headers=BEARER)
    assert conn.getresponse().status == 405
    conn.close()


def test_a_removed_range_is_refused_naming_node_and_seqs(
    make_edge: Any, tenants_file: Path, make_client: Any
) -> None:
    edge = make_edge(
        tenants_file, http_listen="127.0.0.1:0", journal_segment_bytes=4096, journal_fsync=False
    )
    port = http_port(edge)
    published(make_client, edge, 60)
    node_dir = edge.settings.journal_root / "test"
    segments = list_segments(node_dir)
    assert len(segments) >= 3
    segments[0][1].unlink()  # what retention does once the lake has a segment
    oldest = segments[1][0]
    status, _, body = get(port, "/journal/records?after=0&upto=2", BEARER)
    assert status == 410
    error = json.loads(body)
    assert error["first_seq"] == oldest
    assert f"seqs 1..{oldest - 1}" in error["error"]
    assert "test" in error["error"]
    with pytest.raises(EdgeRefused, match=rf"410 Gone.*seqs 1\.\.{oldest - 1}"):
        list(read_range(f"127.0.0.1:{port}", "op-token", "test", 0, 2))
    with pytest.raises(EdgeRefused, match=r"403 Forbidden.*operator token"):
        journal_range(f"127.0.0.1:{port}", "acme-1")
    edge.stop()
    with pytest.raises(EdgeUnavailable, match=f"edge 127.0.0.1:{port}"):
        journal_range(f"127.0.0.1:{port}", "op-token")


def test_without_an_operator_token_only_loopback_is_served_with_the_edges_own(
    tmp_path: Path,
) -> None:
    settings = EdgeSettings(
        port=0, data_dir=tmp_path, node_id="open", http_listen="0.0.0.0:0", journal_fsync=False
    )
    with pytest.raises(ConfigError, match=r"edge.http_listen: serving the journal on 0\.0\.0\.0"):
        RunningEdge(settings).start()
    loopback = RunningEdge(
        EdgeSettings(
            port=0,
            data_dir=tmp_path,
            node_id="open",
            http_listen="127.0.0.1:0",
            journal_fsync=False,
        )
    ).start()
    try:
        assert get(http_port(loopback), "/journal")[0] == 401  # never without a token
        own = {"Authorization": f"Bearer {operator_token.read(tmp_path)}"}
        status, _, body = get(http_port(loopback), "/journal", own)
        assert (status, json.loads(body)["node"]) == (200, "open")
    finally:
        loopback.stop()


def test_sighup_swaps_the_operator_token(
    make_edge: Any, tenants_file: Path, make_client: Any
) -> None:
    edge = make_edge(tenants_file, http_listen="127.0.0.1:0", journal_fsync=False)
    port = http_port(edge)
    tenants_file.write_text(tenants_file.read_text().replace('"op-token"', '"op-token-2"'))
    edge.call(edge.node.reload_tenants)
    assert get(port, "/journal", BEARER)[0] == 403
    assert get(port, "/journal", {"Authorization": "Bearer op-token-2"})[0] == 200


def test_a_malformed_request_gets_400_and_the_edge_keeps_serving(http_edge: RunningEdge) -> None:
    port = http_port(http_edge)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n")  # a header without a colon
        answer = b""
        while chunk := raw.recv(4096):  # until the edge closes the connection
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 ")
        assert b'"error": "bad request' in answer
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(b"GET /" + b"x" * 20_000 + b" HTTP/1.1\r\n")  # over the header limit
        assert raw.recv(4096).startswith(b"HTTP/1.1 431 ")
    assert get(port, "/healthz")[0] == 200
