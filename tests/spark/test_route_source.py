"""The routed journal source (``streaming.route.RoutedJournal``) as a batch read of one range:
what the pipeline uses to count a micro-batch and to read each table's few rows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from ingest.journal import JournalReader, JournalWriter
from streaming import route

pytestmark = pytest.mark.spark

BASE_US = 1_710_028_800_000_000  # 2024-03-10T00:00:00Z
TOPICS = ("fleet/1/pos", "$log/mqtt/connect", "$counters/messages_in", "", "fleet/2/pos")


def write(root: Path, node: str, count: int) -> None:
    """Device traffic, log events, counters and records the contract rejects (empty topic)."""
    with JournalWriter.open(root, node, fsync=False) as writer:
        for i in range(count):
            topic = TOPICS[i % len(TOPICS)]
            writer.append(
                ts_us=BASE_US + i,
                tenant="acme",
                client_id=f"{node}-{i}",
                topic=topic,
                qos=1,
                retain=False,
                payload=b'{"reason": "normal"}' if topic.startswith("$log") else b"{}",
                content_type="application/json",
            )
            if i % 3 == 2:
                writer.flush()
        writer.flush()


def routed_in_python(root: Path, start: dict[str, int], end: dict[str, int]) -> pa.Table:
    parts = [
        route.route(
            pa.Table.from_batches(list(JournalReader(root / node).read(start.get(node, 0), upto)))
        )
        for node, upto in sorted(end.items())
        if upto > start.get(node, 0)
    ]
    return pa.concat_tables(parts)


@pytest.fixture
def journals(tmp_path: Path) -> Path:
    root = tmp_path / "journal"
    write(root, "edge-a", 23)
    write(root, "edge-b", 11)
    return root


def test_a_summary_counts_each_destination_and_node_of_the_range(
    spark: SparkSession, journals: Path
) -> None:
    route.register(spark)
    start, end = {"edge-a": 4, "edge-b": 0}, {"edge-a": 21, "edge-b": 9}
    summary = route.read_range(spark, {"path": str(journals)}, start, end, summary=True)
    got: Counter[tuple[str, str]] = Counter()
    last: dict[str, int] = {}
    for row in summary.collect():
        got[(row["dest"], row["node"])] += row["rows"]
        last[row["node"]] = max(last.get(row["node"], 0), row["last_seq"])
    expected = routed_in_python(journals, start, end)
    assert got == Counter(
        zip(expected.column("dest").to_pylist(), expected.column("node").to_pylist(), strict=True)
    )
    # The counters here are not the edge's own ($edge): quarantined, like the empty topics.
    assert {dest for dest, _ in got} == {"messages", "logs", "quarantine"}
    assert last == {"edge-a": 21, "edge-b": 9}


def test_a_read_of_some_destinations_hands_over_only_their_rows(
    spark: SparkSession, journals: Path
) -> None:
    route.register(spark)
    start, end = {}, {"edge-a": 23, "edge-b": 11}
    rows = route.read_range(
        spark, {"path": str(journals)}, start, end, dests=(route.LOGS, route.QUARANTINE)
    )
    got = sorted(
        (r["dest"], r["node"], r["seq"]) for r in rows.select("dest", "node", "seq").collect()
    )
    expected = routed_in_python(journals, start, end)
    assert got == sorted(
        (d, n, s)
        for d, n, s in zip(
            expected.column("dest").to_pylist(),
            expected.column("node").to_pylist(),
            expected.column("seq").to_pylist(),
            strict=True,
        )
        if d in (route.LOGS, route.QUARANTINE)
    )
    assert got  # the journals hold both


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"endOffset": '{"edge-a": 3}'}, "needs option 'startOffset'"),
        ({"startOffset": "{}", "endOffset": "[1]"}, "'endOffset' is not an offset"),
        ({"startOffset": "{}", "endOffset": "{}", "dests": "messages,bogus"}, "['bogus']"),
    ],
)
def test_bad_range_options_are_named(
    spark: SparkSession, journals: Path, options: dict[str, str], says: str
) -> None:
    route.register(spark)
    with pytest.raises(Exception, match=r".") as raised:
        spark.read.format(route.ROUTED_SOURCE).option("path", str(journals)).options(
            **options
        ).load().collect()
    assert says in str(raised.value)
