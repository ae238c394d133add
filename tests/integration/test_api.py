"""``edgebus api``: a real server process (uvicorn on port 0) over a small real Delta lake,
asked with a real HTTP client (httpx)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
from lake_fixture import DeltaBatchWriter, log_row
from usage_lake import write_lake

from broker_edge.topics import matches
from edgebus import logs_cli, usage_cli
from schemas.tables import (
    LOGS_PARTITION_BY,
    LOGS_SCHEMA,
    MESSAGES_PARTITION_BY,
    MESSAGES_SCHEMA,
)

UTC = dt.UTC
TIMEOUT = 30.0
SAME_TS = dt.datetime(2024, 3, 10, 9, 0, tzinfo=UTC)
TENANTS = """
[operator]
token = "op-token"

[tenants.acme]
tokens = ["acme-1", "acme-dash"]
[tenants.acme.acl."acme-dash"]
publish = []
subscribe = ["fleet/#", "$log/#", "$counters/#", "$quota/#"]

[tenants.other]
tokens = ["other-1"]
"""
ACME = {"Authorization": "Bearer acme-1"}
DASHBOARD = {"Authorization": "Bearer acme-dash"}
OPERATOR = {"Authorization": "Bearer op-token"}
TOPICS = [
    "fleet/v1/telemetry",
    "fleet/v2/telemetry",
    "fleet/v1/status",
    "fleet",
    "fleet/v1",
    "fleetwood/v1/telemetry",
    "a.b/c(d)*/e",
    "a.b/x",
    "/leading",
    "other/thing",
]


# acme: 30 events at one and the same microsecond on two nodes (the paging test's point), and
# some around them on other days; other: a few at the same time.
LOGS = [
    *(
        log_row("acme", SAME_TS, f"edge-{'ab'[i % 2]}", 100 + i, "connect", f"truck-{i % 4}")
        for i in range(30)
    ),
    log_row("acme", SAME_TS - dt.timedelta(days=1), "edge-a", 1, "disconnect", "truck-1"),
    log_row("acme", SAME_TS + dt.timedelta(hours=1), "edge-b", 200, "subscribe", "truck-2"),
    log_row("acme", SAME_TS + dt.timedelta(days=1), "edge-a", 300, "quota_warn", ""),
    *(log_row("other", SAME_TS, "edge-c", i, "connect", "spy") for i in range(1, 4)),
]


def message(tenant: str, topic: str, seq: int, payload: bytes, ts: dt.datetime) -> Any:
    return {
        "node": "edge-a",
        "seq": seq,
        "ts": ts,
        "date": ts.date(),
        "tenant": tenant,
        "client_id": f"client-{seq % 3}",
        "topic": topic,
        "qos": 1,
        "retain": False,
        "payload": payload,
        "content_type": None,
        "user_properties": [{"key": "k", "value": str(seq)}] if seq % 2 else None,
        "size": len(payload),
    }


MESSAGES = [
    *(
        message("acme", topic, 1000 + i, f"reading {i}".encode(), SAME_TS + dt.timedelta(seconds=i))
        for i, topic in enumerate(TOPICS)
    ),
    message("acme", "fleet/v9/raw", 2000, b"\xff\xfe\x00binary", SAME_TS),
    message("other", "fleet/v1/telemetry", 1, b"not yours", SAME_TS),
]


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lake")
    logs = DeltaBatchWriter(root / "logs", "edgebus.logs", LOGS_SCHEMA, LOGS_PARTITION_BY)
    # Two commits, so the events sharing a timestamp are in more than one file.
    logs.write(0, pa.Table.from_pylist(LOGS[::2], schema=LOGS_SCHEMA))
    logs.write(1, pa.Table.from_pylist(LOGS[1::2], schema=LOGS_SCHEMA))
    messages = DeltaBatchWriter(
        root / "messages", "edgebus.messages", MESSAGES_SCHEMA, MESSAGES_PARTITION_BY
    )
    messages.write(0, pa.Table.from_pylist(MESSAGES, schema=MESSAGES_SCHEMA))
    return write_lake(root)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("conf") / "tenants.toml"
    path.write_text(TENANTS)
    return path


class ApiProcess:
    """``edgebus api`` on 127.0.0.1 port 0, as an operator starts it."""

    def __init__(self, lake: Path, tenants: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "edgebus.cli", "--log-level", "WARNING", "api"]
        command += ["--lake", str(lake), "--tenants", str(tenants), "--listen", "127.0.0.1:0"]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # printed once the port is bound
        assert line.startswith("edgebus api listening on http://"), self.stop()
        self.url = line.rsplit(" ", 1)[1].strip()

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        """Stop it with ``sig``: its exit code and what it wrote to stderr."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        _, err = self.process.communicate(timeout=TIMEOUT)
        return self.process.returncode, err


@pytest.fixture(scope="module")
def server(lake: Path, tenants: Path) -> Iterator[ApiProcess]:
    api = ApiProcess(lake, tenants)
    yield api
    code, err = api.stop()
    assert code == 0, err
    assert "Traceback" not in err


@pytest.fixture
def client(server: ApiProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        yield http


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    return response.json()


def error(response: httpx.Response, status: int, code: str) -> str:
    """The detail of a JSON error answer with this status and code."""
    assert response.status_code == status, response.text
    doc = response.json()
    assert set(doc) == {"error", "detail"}
    assert doc["error"] == code
    detail: str = doc["detail"]
    return detail


def ids(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(row["node"], row["seq"]) for row in rows]


def expected_order(tenant: str, *, oldest_first: bool = False) -> list[tuple[str, int]]:
    rows = sorted(
        (r for r in LOGS if r["tenant"] == tenant),
        key=lambda r: (r["ts"], r["node"], r["seq"]),
        reverse=not oldest_first,
    )
    return ids(rows)


def all_pages(client: httpx.Client, path: str, **params: Any) -> list[list[dict[str, Any]]]:
    pages = []
    cursor = None
    while True:
        doc = ok(client.get(path, params={**params, "cursor": cursor}, headers=ACME))
        pages.append(doc["rows"])
        cursor = doc["next_cursor"]
        if cursor is None:
            return pages


def test_logs_newest_first_of_the_tokens_tenant_only(client: httpx.Client) -> None:
    doc = ok(client.get("/logs", headers=ACME))
    assert doc["tenant"] == "acme"
    assert ids(doc["rows"]) == expected_order("acme")
    assert doc["next_cursor"] is None  # not a full page
    first = doc["rows"][0]
    assert first["event_type"] == "quota_warn"
    assert first["ts"] == "2024-03-11T09:00:00.000000Z"
    assert first["details"] == {"clean": True}  # the object, not its text


@pytest.mark.parametrize("order", ["newest", "oldest"])
@pytest.mark.parametrize("limit", [1, 3, 7, 30])
def test_cursor_paging_never_loses_or_repeats_a_row(
    client: httpx.Client, order: str, limit: int
) -> None:
    pages = all_pages(client, "/logs", order=order, limit=limit)
    rows = [row for page in pages for row in page]
    assert ids(rows) == expected_order("acme", oldest_first=order == "oldest")
    assert all(len(page) == limit for page in pages[:-1])


def test_a_rows_cursor_is_the_cli_after(
    client: httpx.Client, lake: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The API and ``edgebus logs`` share their query: a row's cursor continues either."""
    first = ok(client.get("/logs", params={"limit": 5}, headers=ACME))
    second = ok(
        client.get("/logs", params={"limit": 5, "cursor": first["next_cursor"]}, headers=ACME)
    )
    argv = ["--lake", str(lake), "--tenant", "acme", "--format", "json", "--limit", "5"]
    assert logs_cli.main([*argv, "--after", first["rows"][-1]["cursor"]]) == 0
    cli_rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert cli_rows == second["rows"]


def test_log_filters(client: httpx.Client) -> None:
    def found(**params: Any) -> list[tuple[str, int]]:
        return ids(ok(client.get("/logs", params=params, headers=ACME))["rows"])

    assert found(event_type=["disconnect", "subscribe"]) == [("edge-b", 200), ("edge-a", 1)]
    assert found(origin="quota") == [("edge-a", 300)]
    assert len(found(node="edge-a", event_type="connect")) == 15
    assert len(found(client_id=["truck-0", "truck-1"], event_type="connect")) == 16
    day = found(since="2024-03-10T00:00:00Z", until="2024-03-11")
    assert len(day) == 31
    assert ("edge-a", 300) not in day
    assert ("edge-a", 1) not in day
    assert found(where="clean=true", node="edge-b", event_type="subscribe") == [("edge-b", 200)]
    everything = found(since="3650d", limit=100)  # a duration back from now
    assert len(everything) == 33


def test_messages_by_topic_filter(client: httpx.Client) -> None:
    def topics(topic: str) -> list[str]:
        rows = ok(client.get("/messages", params={"topic": topic}, headers=ACME))["rows"]
        return sorted(row["topic"] for row in rows)

    acme_topics = [*TOPICS, "fleet/v9/raw"]
    for topic_filter in ("#", "fleet/#", "fleet/+", "fleet/+/telemetry", "+/v1/+", "+", "+/+"):
        assert topics(topic_filter) == sorted(t for t in acme_topics if matches(topic_filter, t))
    for topic_filter in ("a.b/c(d)*/e", "a.b/+/e", "/#", "+/leading", "fleet/v1"):
        assert topics(topic_filter) == sorted(t for t in acme_topics if matches(topic_filter, t))
    assert topics("nothing/#") == []


def test_message_payloads_and_paging(client: httpx.Client) -> None:
    rows = ok(client.get("/messages", params={"topic": "fleet/v9/raw"}, headers=ACME))["rows"]
    [raw] = rows
    assert raw["payload_encoding"] == "base64"
    assert raw["payload"] == "//4AYmluYXJ5"  # b"\xff\xfe\x00binary"
    [text] = ok(client.get("/messages", params={"topic": "fleet/v1/status"}, headers=ACME))["rows"]
    assert (text["payload"], text["payload_encoding"]) == ("reading 2", "utf-8")
    assert text["user_properties"] is None
    pages = all_pages(client, "/messages", limit=4, order="oldest")
    seqs = [row["seq"] for page in pages for row in page]
    # 1000 and 2000 share a timestamp and a node: the seq orders them.
    assert seqs == [1000, 2000, *range(1001, 1000 + len(TOPICS))]
    assert [len(page) for page in pages] == [4, 4, 3]


def test_usage_is_what_edgebus_usage_shows(
    client: httpx.Client, lake: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = ok(client.get("/usage", params={"date": "2024-03-10"}, headers=ACME))
    assert (
        usage_cli.main(
            ["--lake", str(lake), "--tenant", "acme", "--date", "2024-03-10", "--format", "json"]
        )
        == 0
    )
    assert doc == json.loads(capsys.readouterr().out)
    assert {row["metric"]: row["day_total"] for row in doc["counters"]} == {
        "bytes_in": 9000,
        "messages_in": 200,
        "sessions": 5,
    }


def test_quota_state_and_history(client: httpx.Client) -> None:
    doc = ok(client.get("/quota", params={"date": "2024-03-10"}, headers=ACME))
    assert doc["tenant"] == "acme"
    assert [(q["metric"], q["state"], q["usage"]) for q in doc["state"]] == [
        ("messages_per_day", "warn", 200),
        ("bytes_per_day", "cleared", 9000),
    ]
    # Each quota metric names the usage counter that measures it, in the state and the history.
    named = {(q["metric"], q["usage_metric"]) for q in [*doc["state"], *doc["history"]]}
    assert named == {("messages_per_day", "messages_in"), ("bytes_per_day", "bytes_in")}
    history = [(h["decided_at"], h["state"]) for h in doc["history"]]
    assert history == sorted(history, reverse=True)
    assert len(history) == 7  # every change of acme's, none of other's
    window = ok(
        client.get("/quota", params={"since": "2024-03-10", "until": "2024-03-11"}, headers=ACME)
    )
    assert [h["batch_id"] for h in window["history"]] == [7, 5, 4]


def test_missing_or_bad_token_is_401(client: httpx.Client) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic YTpi"}):
        for path in ("/logs", "/messages", "/usage", "/quota"):
            response = client.get(path, headers=headers)
            assert "token" in error(response, 401, "unauthorized")
            assert response.headers["www-authenticate"].startswith("Bearer")


def test_a_tenant_token_reads_its_tenant_only(client: httpx.Client) -> None:
    for path in ("/logs", "/messages", "/usage", "/quota"):
        response = client.get(path, params={"tenant": "other"}, headers=ACME)
        assert "'acme'" in error(response, 403, "forbidden")
    assert ok(client.get("/logs", params={"tenant": "acme"}, headers=ACME))["tenant"] == "acme"
    other = ok(client.get("/messages", headers={"Authorization": "Bearer other-1"}))
    assert [row["payload"] for row in other["rows"]] == ["not yours"]


def test_the_operator_names_the_tenant(client: httpx.Client) -> None:
    detail = error(client.get("/logs", headers=OPERATOR), 400, "invalid_parameter")
    assert detail.startswith("tenant:")
    doc = ok(client.get("/logs", params={"tenant": "other"}, headers=OPERATOR))
    assert ids(doc["rows"]) == expected_order("other")
    unknown = ok(client.get("/logs", params={"tenant": "nobody"}, headers=OPERATOR))
    assert unknown["rows"] == []


def test_access_rules_apply(client: httpx.Client) -> None:
    """The dashboard token may subscribe to fleet/# and the edge's topics only."""
    assert "'#'" in error(client.get("/messages", headers=DASHBOARD), 403, "forbidden")
    rows = ok(client.get("/messages", params={"topic": "fleet/+/telemetry"}, headers=DASHBOARD))
    assert len(rows["rows"]) == 2
    assert ok(client.get("/logs", headers=DASHBOARD))["rows"]


@pytest.mark.parametrize(
    ("path", "params", "status", "name"),
    [
        ("/logs", {"limit": "0"}, 422, "limit"),
        ("/logs", {"limit": "abc"}, 422, "limit"),
        ("/logs", {"limit": str(2**64)}, 422, "limit"),
        ("/logs", {"order": "sideways"}, 422, "order"),
        ("/logs", {"since": "yesterday"}, 400, "since"),
        ("/logs", {"until": "99999999d"}, 400, "until"),
        ("/logs", {"since": "2024-03-11", "until": "2024-03-10"}, 400, "since"),
        ("/logs", {"cursor": "not-a-cursor"}, 400, "cursor"),
        ("/logs", {"event_type": "teleport"}, 400, "event_type"),
        ("/logs", {"where": "novalue"}, 400, "where"),
        ("/messages", {"topic": "fleet/#/x"}, 400, "topic"),
        ("/messages", {"topic": "fleet/v+"}, 400, "topic"),
        ("/usage", {"date": "2024-13-01"}, 422, "date"),
        ("/quota", {"limit": "-1"}, 422, "limit"),
    ],
)
def test_bad_parameters_are_named(
    client: httpx.Client, path: str, params: dict[str, str], status: int, name: str
) -> None:
    detail = error(client.get(path, params=params, headers=ACME), status, "invalid_parameter")
    assert detail.startswith(f"{name}:"), detail


def test_unknown_paths_answer_json(client: httpx.Client) -> None:
    error(client.get("/nothing", headers=ACME), 404, "not_found")
    error(client.post("/logs", headers=ACME), 405, "method_not_allowed")


def test_openapi(client: httpx.Client) -> None:
    doc = ok(client.get("/openapi.json"))
    assert doc["openapi"].startswith("3.")
    assert {"/logs", "/messages", "/usage", "/quota"} <= set(doc["paths"])
    names = {p["name"] for p in doc["paths"]["/logs"]["get"]["parameters"]}
    assert {"since", "until", "event_type", "client_id", "limit", "cursor", "tenant"} <= names
    assert any(s.get("scheme") == "bearer" for s in doc["components"]["securitySchemes"].values())


def test_tables_not_there_yet_answer_empty(tmp_path: Path, tenants: Path) -> None:
    """A lake the pipeline has not written to: empty answers, never a 500; SIGINT stops it."""
    (tmp_path / "lake").mkdir()
    api = ApiProcess(tmp_path / "lake", tenants)
    try:
        with httpx.Client(base_url=api.url, timeout=TIMEOUT) as http:
            assert ok(http.get("/logs", headers=ACME)) == {
                "tenant": "acme",
                "rows": [],
                "next_cursor": None,
            }
            assert ok(http.get("/messages", headers=ACME))["rows"] == []
            assert ok(http.get("/usage", params={"date": "2024-03-10"}, headers=ACME)) == {
                "tenant": "acme",
                "date": "2024-03-10",
                "counters": [],
                "quota": [],
            }
            quota = ok(http.get("/quota", headers=ACME))
            assert (quota["state"], quota["history"]) == ([], [])
            # The pipeline creates a table while the server runs: the next request sees it.
            write_lake(tmp_path / "lake", quota=False)
            usage = ok(http.get("/usage", params={"date": "2024-03-10"}, headers=ACME))
            assert usage["counters"]
    finally:
        code, err = api.stop(signal.SIGINT)
    assert code == 0, err
    assert "Traceback" not in err


def test_refuses_a_directory_that_is_no_lake(tmp_path: Path, tenants: Path) -> None:
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("hi")
    command = [sys.executable, "-m", "edgebus.cli", "api", "--tenants", str(tenants)]
    for lake in (tmp_path / "missing", tmp_path / "stuff"):
        done = subprocess.run(
            [*command, "--lake", str(lake), "--listen", "127.0.0.1:0"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert str(lake) in done.stderr
    (tmp_path / "lake").mkdir()
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants.x]\ntokens = 3\n")
    done = subprocess.run(
        [*command[:-1], str(bad), "--lake", str(tmp_path / "lake"), "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 2
    assert "bad tenants file" in done.stderr, done.stderr


def test_the_server_exits_0_every_time(lake: Path, tenants: Path) -> None:
    """delta-rs can abort an interpreter at exit, and only sometimes: after reading every table,
    each stop (SIGTERM and SIGINT in turn) must still exit 0 with no traceback."""
    for i in range(6):
        api = ApiProcess(lake, tenants)
        try:
            with httpx.Client(base_url=api.url, timeout=TIMEOUT) as http:
                for path in ("/logs", "/messages", "/usage", "/quota"):
                    ok(http.get(path, params={"date": "2024-03-10"}, headers=ACME))
        finally:
            code, err = api.stop(signal.SIGINT if i % 2 else signal.SIGTERM)
        assert code == 0, (i, err)
        assert "Traceback" not in err


def test_a_changed_tenants_file_counts_from_the_next_request(lake: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    api = ApiProcess(lake, tenants)
    try:
        with httpx.Client(base_url=api.url, timeout=TIMEOUT) as http:
            late = {"Authorization": "Bearer acme-late"}
            error(http.get("/logs", headers=late), 401, "unauthorized")
            tenants.write_text(TENANTS.replace('"acme-dash"]', '"acme-dash", "acme-late"]', 1))
            assert ok(http.get("/logs", headers=late))["tenant"] == "acme"
            tenants.write_text("[tenants.acme]\ntokens = 3\n")  # broken: the old file holds
            assert ok(http.get("/logs", headers=late))["tenant"] == "acme"
    finally:
        code, err = api.stop()
    assert code == 0, err


def test_requests_while_the_pipeline_commits(tmp_path: Path, tenants: Path) -> None:
    """Readers in parallel with commits (the tables stay open and catch up per request): every
    answer is 200, and the newest commit is seen once it is made."""
    root = tmp_path / "lake"
    writer = DeltaBatchWriter(root / "logs", "edgebus.logs", LOGS_SCHEMA, LOGS_PARTITION_BY)
    writer.write(0, pa.Table.from_pylist(LOGS, schema=LOGS_SCHEMA))
    api = ApiProcess(root, tenants)
    failures: list[str] = []
    stop = threading.Event()

    def read() -> None:
        with httpx.Client(base_url=api.url, timeout=TIMEOUT, headers=ACME) as http:
            while not stop.is_set():
                response = http.get("/logs", params={"limit": 3})
                if response.status_code != 200:
                    failures.append(response.text)

    readers = [threading.Thread(target=read) for _ in range(4)]
    try:
        for thread in readers:
            thread.start()
        later = SAME_TS + dt.timedelta(days=3)
        for batch in range(1, 16):
            event = log_row("acme", later + dt.timedelta(seconds=batch), "edge-z", batch)
            writer.write(batch, pa.Table.from_pylist([event], schema=LOGS_SCHEMA))
        stop.set()
        for thread in readers:
            thread.join(TIMEOUT)
        with httpx.Client(base_url=api.url, timeout=TIMEOUT, headers=ACME) as http:
            newest = ok(http.get("/logs", params={"limit": 1}))["rows"][0]
        assert (newest["node"], newest["seq"]) == ("edge-z", 15)
    finally:
        stop.set()
        code, err = api.stop()
    assert not failures, failures[:3]
    assert code == 0, err
