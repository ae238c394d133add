"""The edge's /metrics and /readyz on its HTTP port (issue 13): scraped with a real HTTP client
from a real edge that paho clients publish to, and parsed as Prometheus's text format."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import RunningEdge
from prometheus_client.parser import text_string_to_metric_families
from test_journal_http import BEARER, get, http_port, published

from broker_edge.http_api import HttpApi


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, headers, body = get(port, "/metrics", BEARER)
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


@pytest.fixture
def http_edge(make_edge: Any, tenants_file: Path) -> RunningEdge:
    edge: RunningEdge = make_edge(tenants_file, http_listen="127.0.0.1:0", journal_fsync=False)
    return edge


def test_metrics_count_what_the_edge_did_and_need_the_operator_token(
    http_edge: RunningEdge, make_client: Any
) -> None:
    port = http_port(http_edge)
    assert get(port, "/metrics")[0] == 401
    assert get(port, "/metrics", {"Authorization": "Bearer acme-1"})[0] == 403  # a tenant's
    durable = published(make_client, http_edge, 5)
    watcher = make_client(port=http_edge.port, username="acme-1")
    watcher.subscribe("fleet/#", qos=1)
    operator = make_client(port=http_edge.port, username="op-token")
    decision = {"state": "blocked", "metric": "messages_per_day", "limit": 1000, "value": 1200}
    operator.publish("$control/quota/acme", json.dumps(decision).encode(), qos=1, retain=True)
    deadline = time.monotonic() + 10
    while ("edgebus_edge_quota_state", _quota("blocked")) not in scrape(port):
        assert time.monotonic() < deadline, "the decision never showed"
        time.sleep(0.05)  # the decision is applied on the edge's loop; no event to await here
    shown = scrape(port)
    assert shown[("edgebus_edge_quota_state", _quota("blocked"))] == 1
    assert shown[("edgebus_edge_quota_state", _quota("ok"))] == 0
    assert (
        shown[("edgebus_edge_quota_limit", (("metric", "messages_per_day"), ("tenant", "acme")))]
        == 1000
    )
    assert shown[("edgebus_edge_messages_received_total", ())] >= 5
    assert shown[("edgebus_edge_tenant_messages_in_total", (("tenant", "acme"),))] >= 5
    assert shown[("edgebus_edge_tenant_bytes_in_total", (("tenant", "acme"),))] >= 5 * 12
    assert shown[("edgebus_edge_connections", ())] == 2  # the watcher and the operator
    assert shown[("edgebus_edge_subscriptions", ())] >= 1
    assert shown[("edgebus_edge_journal_durable_seq", ())] >= durable
    assert shown[("edgebus_edge_journal_state", (("state", "ok"),))] == 1
    assert shown[("edgebus_edge_journal_state", (("state", "full"),))] == 0
    assert shown[("edgebus_edge_journal_lag_records", ())] >= durable  # no lake has committed
    assert shown[("edgebus_edge_journal_bytes", ())] > 0
    # Without fsync there is no sync to complete on the loop: the commit thread writes them all.
    assert shown[("edgebus_edge_journal_frames_synced_in_thread_total", ())] >= 1
    assert shown[("edgebus_edge_journal_frames_synced_on_loop_total", ())] == 0


def _quota(state: str) -> tuple[tuple[str, str], ...]:
    return (("metric", "messages_per_day"), ("state", state), ("tenant", "acme"))


def test_readyz_while_the_journal_takes_publishes(http_edge: RunningEdge) -> None:
    status, _, body = get(http_port(http_edge), "/readyz")  # no token needed
    assert (status, json.loads(body)) == (200, {"status": "ready"})


def test_readyz_says_why_publishes_are_refused(tmp_path: Path) -> None:
    reasons = iter([None, "journal full: journal_max_bytes"])
    api = HttpApi(tmp_path / "node", None, max_records=10, unready=lambda: next(reasons))
    assert api.handle("GET", "/readyz", []).status == 200
    reply = api.handle("GET", "/readyz", [])
    assert (reply.status, json.loads(reply.body)) == (
        503,
        {"status": "not ready", "reason": "journal full: journal_max_bytes"},
    )
    assert api.handle("POST", "/readyz", []).status == 405


def test_an_edge_that_syncs_completes_its_syncs_on_the_loop(
    make_edge: Any, tenants_file: Path, make_client: Any
) -> None:
    # The default: fsync on. On Linux every frame after the first segment's is synced by the
    # kernel and reported on the event loop (Linux AIO); the commit thread writes the frames
    # that start a segment (the first one, and the move onto the spare written ahead).
    edge: RunningEdge = make_edge(tenants_file, http_listen="127.0.0.1:0")
    port = http_port(edge)
    durable = 0
    for _ in range(20):  # QoS 1 publishes, each acknowledged once durable: one frame each
        durable = published(make_client, edge, 5)
    shown = scrape(port)
    assert shown[("edgebus_edge_journal_durable_seq", ())] >= durable >= 100
    on_loop = shown[("edgebus_edge_journal_frames_synced_on_loop_total", ())]
    in_thread = shown[("edgebus_edge_journal_frames_synced_in_thread_total", ())]
    assert on_loop > in_thread >= 1
    segments = list((edge.settings.journal_root / edge.settings.node_id).glob("*.seg"))
    assert in_thread <= len(segments)
