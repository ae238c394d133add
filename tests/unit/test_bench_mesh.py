"""bench.mesh's pure parts: who connects where, the brokers' configurations, the link counters'
arithmetic, the summary; and the generator's split of clients over brokers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import loadgen, mesh
from edgebus.settings import load_edge


def test_pairs_put_publishers_on_node_0_and_each_subscriber_on_its_publishers_topic() -> None:
    pubs, subs, node_of = mesh.clients(mesh.cases(10_000, 5_000)["max-q1"], "r1")
    assert [topic for _, topic in pubs] == [topic for _, topic in subs]
    assert len({topic for _, topic in pubs}) == 4
    assert set(node_of.values()) == {1}
    assert set(node_of) == {client_id for client_id, _ in subs}


def test_fanout_puts_two_subscribers_on_every_node_on_the_one_topic() -> None:
    case = mesh.cases(10_000, 5_000)["fanout"]
    pubs, subs, node_of = mesh.clients(case, "r1")
    assert case.nodes == 3
    assert len(pubs) == 1
    assert {topic for _, topic in subs} == {pubs[0][1]}
    assert sorted(node_of.values()) == [0, 0, 1, 1, 2, 2]


def test_same_edge_latency_subscribes_on_the_publishers_node() -> None:
    _, _, node_of = mesh.clients(mesh.cases(10_000, 5_000)["lat-same"], "r1")
    assert list(node_of.values()) == [0]


def test_pairs_need_as_many_subscribers_as_publishers() -> None:
    with pytest.raises(ValueError, match="as many subscribers"):
        mesh.clients(mesh.Case("bad", 0, None, 2, (0, 3)), "r1")


def test_bridge_is_every_topic_both_ways_at_qos_1_to_the_hub() -> None:
    config = mesh.bridge_config("bridge-1", 1883).splitlines()
    assert config[1:4] == ["connection bridge-1", "address 127.0.0.1:1883", "topic # both 1"]
    assert config[0] == "sys_interval 1"  # before `connection`: a general option


def test_edge_config_is_valid_edge_settings(tmp_path: Path) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(mesh.edge_config(["127.0.0.1:1", "127.0.0.1:2"], "t" * 32))
    settings = load_edge(path, {})
    assert settings.peers == ("127.0.0.1:1", "127.0.0.1:2")
    assert settings.mesh_token == "t" * 32
    assert settings.sys_interval == mesh.SYS_INTERVAL_S
    assert settings.max_queued_messages == 1_000_000  # compare's bench limits kept


def test_edgebus_crossings_come_from_the_link_counters() -> None:
    before = [{"links_in": 5, "links_out": 10}, {"links_in": 7}, {"links_in": 0}]
    after = [{"links_in": 5, "links_out": 210}, {"links_in": 107}, {"links_in": 100}]
    got = mesh.crossings("edgebus", before, after, 100)
    assert got["links_in_per_node"] == [0, 100, 100]
    assert got["per_publish_in"] == [0.0, 1.0, 1.0]
    assert got["links_out_node0"] == 200


def test_mosquitto_crossings_take_the_publishers_out_of_the_hubs_count() -> None:
    before = [{"received": 3}, {"received": 1}, {}]
    after = [{"received": 103}, {"received": 101}, {"received": 200}]
    got = mesh.crossings("mosquitto", before, after, 100)
    assert got["links_in_per_node"] == [0, 100, 200]  # node 2: a publish came twice
    assert got["per_publish_in"] == [0.0, 1.0, 2.0]
    assert got["links_out_node0"] is None


def a_run(kind: str, case: str, rate: float, p50: float, loss: int = 0) -> dict[str, Any]:
    return {
        "broker": kind,
        "case": case,
        "msgs_per_s": rate,
        "latency_ms": {"p50": p50, "p99": p50 * 4},
        "loss": loss,
        "received": 1000,
        "cpu": {"broker_cores": 0.9, "broker_s": rate / 1000},
    }


def test_summary_is_medians_over_rounds_and_edgebus_over_mosquitto() -> None:
    runs = [
        a_run("mosquitto", "max-q0", 30_000, 1.0),
        a_run("edgebus", "max-q0", 24_000, 2.0, loss=3),
        a_run("edgebus", "max-q0", 36_000, 3.0),
        a_run("mosquitto", "max-q0", 50_000, 3.0),
    ]
    row = mesh.summarize(runs)["max-q0"]
    assert row["mosquitto"]["msgs_per_s"] == 40_000
    assert row["edgebus"]["msgs_per_s"] == 30_000
    assert row["ratio_msgs_per_s"] == 0.75
    assert row["ratio_p50"] == 2.5 / 2.0
    assert row["edgebus"]["loss"] == 3
    assert row["edgebus"]["broker_us_per_msg"] == 30_000.0  # 30 s of CPU for 1,000 messages
    table = mesh.format_table(mesh.summarize(runs))
    assert "| max-q0 | 40,000 | 30,000 | 0.75x |" in table


def test_clients_of_each_broker_get_their_own_processes() -> None:
    a, b = loadgen.Target("127.0.0.1", 1), loadgen.Target("127.0.0.1", 2)
    clients = [("s0", "t"), ("s1", "t"), ("s2", "t"), ("s3", "t")]
    groups = loadgen._split_by_target(clients, 2, a, {"s1": b, "s3": b})
    assert groups == [(a, (("s0", "t"), ("s2", "t"))), (b, (("s1", "t"), ("s3", "t")))]
    # One broker: as before, the clients spread over the processes.
    assert loadgen._split_by_target(clients, 2, a, {}) == [
        (a, (("s0", "t"), ("s2", "t"))),
        (a, (("s1", "t"), ("s3", "t"))),
    ]


def test_help_works(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        mesh.main(["--help"])
    assert exited.value.code == 0
    assert "bridged" in capsys.readouterr().out


def test_an_unknown_case_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        mesh.main(["--cases", "max-q0,max-q2"])
    assert exited.value.code == 2
    assert "max-q2" in capsys.readouterr().err
