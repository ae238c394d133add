"""The tables behind the stream (``streaming.others``): ``messages`` is committed batch after
batch while the other tables are still writing, they catch up in a few commits, and a failure
between two of their tables' commits is taken up from each table's own progress: no row lost,
none twice (issues 12 and 18)."""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from counter_records import Counter, write_counters
from deltalake import DeltaTable
from pyspark.sql import SparkSession
from test_logs_job import write_journal

from sinks.delta import read_table
from streaming import history, logs, others, pipeline, usage
from streaming.settings import PipelineSettings
from streaming.usage import UsageStep

pytestmark = pytest.mark.spark

COUNTERS = [Counter("acme", "messages_in", 10 * i, i) for i in range(1, 31)]


def write_journals(settings: PipelineSettings) -> set[tuple[str, int]]:
    """Log events, device traffic and counters on two nodes; the ids that belong in ``logs``."""
    logged = write_journal(settings, "edge-a", 24) | write_journal(settings, "edge-b", 24)
    write_counters(settings.journal_root, "edge-a", COUNTERS)
    return logged


def ids(settings: PipelineSettings, table: str) -> Tally[tuple[str, int]]:
    return Tally(
        (row["node"], row["seq"])
        for row in read_table(settings.table_path(table), columns=["node", "seq"]).to_pylist()
    )


def messages_in_usage(settings: PipelineSettings) -> int:
    rows = read_table(settings.table_path(usage.TABLE)).to_pylist()
    return sum(row["value"] for row in rows if row["metric"] == "messages_in")


def usage_is_empty(settings: PipelineSettings) -> bool:
    """No usage row yet: the table is not there, or only created (version 0)."""
    table = str(settings.table_path(usage.TABLE))
    return not DeltaTable.is_deltatable(table) or DeltaTable(table).version() == 0


@pytest.fixture
def gated_usage(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The usage step waits for the event (set at the end whatever happens)."""
    gate = threading.Event()
    step = UsageStep.__call__

    def gated(self: UsageStep, *args: Any) -> Any:
        assert gate.wait(120), "the test never opened the gate"
        return step(self, *args)

    monkeypatch.setattr(UsageStep, "__call__", gated)
    yield gate
    gate.set()


def test_messages_are_committed_while_the_other_tables_are_still_writing(
    edgebus_spark: SparkSession,
    make_settings: Callable[..., PipelineSettings],
    gated_usage: threading.Event,
) -> None:
    settings = make_settings(max_records_per_batch=8)
    logged = write_journals(settings)
    query = pipeline.start(edgebus_spark, settings)
    try:
        query.query.processAllAvailable()  # the stream alone: every batch of messages
        devices = ids(settings, history.TABLE)
        assert len(devices) == 12
        assert set(devices.values()) == {1}
        batches = DeltaTable(str(settings.table_path(history.TABLE))).version()
        assert batches >= 5  # 78 records in batches of at most 8: the stream went on
        # ...while the usage step of the first batch with counters still waits.
        assert usage_is_empty(settings)
        gated_usage.set()
        query.processAllAvailable()  # now every table
    finally:
        query.stop()
    assert ids(settings, logs.TABLE) == Tally(dict.fromkeys(logged, 1))
    assert messages_in_usage(settings) == sum(c.delta for c in COUNTERS)
    # Behind the stream the batches went in a few commits, not one per batch.
    assert DeltaTable(str(settings.table_path(usage.TABLE))).version() < batches
    recorded = settings.checkpoint_path(pipeline.JOB) / others.PROGRESS_FILE
    assert int(recorded.read_text()) == others.last_marked_done(
        settings.checkpoint_path(pipeline.JOB)
    )


def test_a_failure_between_two_tables_is_taken_up_from_each_tables_own_progress(
    edgebus_spark: SparkSession,
    make_settings: Callable[..., PipelineSettings],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings(max_records_per_batch=8)
    logged = write_journals(settings)

    def broken(self: UsageStep, *args: Any) -> Any:
        raise RuntimeError("the usage step broke")

    with monkeypatch.context() as patch:
        patch.setattr(UsageStep, "__call__", broken)
        query = pipeline.start(edgebus_spark, settings)
        try:
            with pytest.raises(Exception, match="the usage step broke"):
                query.processAllAvailable()
        finally:
            query.stop()
    # The logs of the batches it was handed are in; usage has nothing.
    first = ids(settings, logs.TABLE)
    assert first
    assert set(first.values()) == {1}
    assert usage_is_empty(settings)
    checkpoint = settings.checkpoint_path(pipeline.JOB)
    progress = int((checkpoint / others.PROGRESS_FILE).read_text())
    marked = others.last_marked_done(checkpoint)
    assert marked is not None
    assert progress < marked

    query = pipeline.start(edgebus_spark, settings)  # the same checkpoint and lake
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    assert ids(settings, logs.TABLE) == Tally(dict.fromkeys(logged, 1))
    assert messages_in_usage(settings) == sum(c.delta for c in COUNTERS)
    assert set(ids(settings, history.TABLE).values()) == {1}
