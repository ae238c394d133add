"""An edge restarted on the same data dir continues its journal where it stopped."""

from __future__ import annotations

import paho.mqtt.client as mqtt

from ingest.journal import JournalReader


def _publish(port: int, topic: str, count: int) -> None:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="restart-pub")
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        infos = [client.publish(topic, f"{topic}-{i}".encode(), qos=1) for i in range(count)]
        for info in infos:
            info.wait_for_publish(10)
            assert info.is_published()
    finally:
        client.disconnect()
        client.loop_stop()


def test_seq_continues_across_restart(make_edge, edge_settings):
    first = make_edge()
    _publish(first.port, "before", 30)
    first.stop()
    second = make_edge()
    _publish(second.port, "after", 20)
    second.stop()
    reader = JournalReader(edge_settings.journal_root / edge_settings.node_id)
    last = reader.last_seq()
    every = [row for batch in reader.read(0, last) for row in batch.to_pylist()]
    assert [r["seq"] for r in every] == list(range(1, last + 1))  # no gap, no repeat
    rows = [r for r in every if not r["topic"].startswith("$")]  # device traffic
    assert len(rows) == 50
    assert [r["payload"] for r in rows] == [f"before-{i}".encode() for i in range(30)] + [
        f"after-{i}".encode() for i in range(20)
    ]
    assert {r["node"] for r in rows} == {edge_settings.node_id}
