"""A publisher that outruns the journal is slowed by paused reads, never acked-then-dropped."""

from __future__ import annotations


def test_publisher_outrunning_the_journal_is_paused_and_loses_nothing(make_edge, make_client):
    edge = make_edge(max_journal_backlog=8)
    sub = make_client("bp-sub", port=edge.port)
    sub.subscribe("bp/#", qos=1)
    pub = make_client("bp-pub", port=edge.port)
    infos = [pub.paho.publish("bp/x", str(i).encode(), qos=1) for i in range(300)]
    infos += [pub.paho.publish("bp/y", str(i).encode(), qos=0) for i in range(300)]
    for info in infos:
        info.wait_for_publish(20)
    got = [sub.get() for _ in range(600)]
    assert sorted(m.payload for m in got if m.topic == "bp/x") == sorted(
        str(i).encode() for i in range(300)
    )
    assert len([m for m in got if m.topic == "bp/y"]) == 300
    paused = edge.call(lambda: edge.node.broker.stats.reads_paused)
    assert paused > 0, "the journal never fell behind: the test did not exercise pausing"
    assert edge.call(lambda: len(edge.node.broker.paused_readers)) == 0
