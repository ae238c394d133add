"""bench.usage_step's journals: counter records the usage step takes, every one of them."""

from __future__ import annotations

from pathlib import Path

from bench import usage_step
from ingest.journal import JournalReader
from streaming.usage import parse


def test_the_journals_hold_one_valid_counter_record_per_tenant_metric_node_and_interval(
    tmp_path: Path,
) -> None:
    written = usage_step.write_journals(tmp_path, tenants=2, metrics=3, minutes=1, interval=2)
    assert written == 2 * 3 * 30 * len(usage_step.NODES)
    seen = set()
    for node in usage_step.NODES:
        reader = JournalReader(tmp_path / node)
        records = list(reader.read_records(0, reader.last_seq()))
        assert len(records) == written // len(usage_step.NODES)
        for record in records:
            fields, broken = parse(record["topic"], record["payload"], record["client_id"])
            assert broken is None, broken
            assert fields is not None
            seen.add((record["tenant"], fields["metric"], node, fields["interval_end"]))
    assert len(seen) == written  # no interval twice
