"""The pipeline's journal notices go to the edges at most every NOTICE_INTERVAL_SECONDS while
the query runs (each delivery is a connection the edge journals: a notice per batch would make
every notice start a batch of its own), and at once when it stops; a node whose notice waited
keeps its seq (issue 12); a batch the other tables (written behind the stream) do not hold yet
waits for them. A real edge and the real publisher; batches stand in by their end offsets,
Spark's commit markers and the other tables' progress."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from schemas.control import JournalCommitted, journal_control_topic
from streaming.pipeline import JOB, NOTICE_INTERVAL_SECONDS, TableFanout
from streaming.quota_settings import QuotaSettings, TenantLimits
from streaming.settings import PipelineSettings


def notices(make_client: Any, port: int, nodes: list[str]) -> dict[str, int]:
    watcher = make_client(port=port, username="op-token")
    for node in nodes:
        watcher.subscribe(journal_control_topic(node), qos=1)
    got = {}
    for _ in nodes:
        notice = JournalCommitted.parse(watcher.get().payload)
        got[notice.node] = notice.committed_seq
    watcher.close()
    return got


def test_notices_wait_for_the_interval_and_keep_every_nodes_seq(
    make_edge: Any, make_client: Any, tenants_file: Path, tmp_path: Path
) -> None:
    edge = make_edge(tenants_file)
    settings = PipelineSettings(data_dir=tmp_path / "data", lake=tmp_path / "lake")
    quota = QuotaSettings(
        load_limits=lambda: {"acme": TenantLimits()},
        operator_token="op-token",
        brokers=(("127.0.0.1", edge.port),),
    )
    fanout = TableFanout(settings, quota)
    commits = settings.checkpoint_path(JOB) / "commits"
    commits.mkdir(parents=True)

    def batch_done(batch_id: int, ends: dict[str, int]) -> None:
        fanout.batch_ended(batch_id, ends)  # what a micro-batch's foreachBatch ends with
        (commits / str(batch_id)).touch()  # Spark marks it done
        fanout.others.mark_done(batch_id)  # and the other tables hold it

    fanout.batch_ended(0, {"a": 5, "b": 3})
    (commits / "0").touch()
    fanout.send_notices(now=1000.0)  # marked done, but not in the other tables yet: waits
    fanout.others.mark_done(0)
    fanout.send_notices(now=1000.0)
    assert notices(make_client, edge.port, ["a", "b"]) == {"a": 5, "b": 3}

    batch_done(1, {"a": 9})
    fanout.send_notices(now=1000.0 + NOTICE_INTERVAL_SECONDS / 2)  # too soon: waits
    batch_done(2, {"b": 4})
    fanout.send_notices(now=1000.0 + NOTICE_INTERVAL_SECONDS / 2 + 1)
    assert notices(make_client, edge.port, ["a", "b"]) == {"a": 5, "b": 3}

    fanout.send_notices()  # the query stops: now, whatever the interval
    assert notices(make_client, edge.port, ["a", "b"]) == {"a": 9, "b": 4}
