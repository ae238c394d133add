"""Counter records as an edge journals them (broker_edge.plim's payload), for the usage tests."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from broker_edge.plim import iso
from ingest.journal import JournalWriter
from schemas.usage import GAUGE_METRICS

BASE_US = 1_710_028_800_000_000  # 2024-03-10T00:00:00Z
SECOND_US = 1_000_000


@dataclass(frozen=True)
class Counter:
    """One ``$counters/{metric}`` publish: the interval ends ``end_s`` seconds after BASE_US."""

    tenant: str
    metric: str
    end_s: float
    delta: int
    total: int | None = None  # defaults to delta (a gauge's value, a counter's running total)
    length_s: float = 10.0

    def payload(self, node: str) -> bytes:
        end_us = BASE_US + int(self.end_s * SECOND_US)
        doc = {
            "node": node,
            "tenant": self.tenant,
            "metric": self.metric,
            "kind": "gauge" if self.metric in GAUGE_METRICS else "counter",
            "delta": self.delta,
            "total": self.delta if self.total is None else self.total,
            "interval_start": iso(end_us - int(self.length_s * SECOND_US)),
            "interval_end": iso(end_us),
        }
        return json.dumps(doc, separators=(",", ":")).encode()


def write_counters(journal_root: Path, node: str, counters: Iterable[Counter]) -> None:
    """Append the records to ``node``'s journal as the edge does (client ``$edge``, QoS 0)."""
    with JournalWriter.open(journal_root, node, fsync=False) as writer:
        for counter in counters:
            writer.append(
                ts_us=BASE_US + int(counter.end_s * SECOND_US),
                tenant=counter.tenant,
                client_id="$edge",
                topic=f"$counters/{counter.metric}",
                qos=0,
                retain=False,
                payload=counter.payload(node),
            )
        writer.flush()


def write_records(journal_root: Path, node: str, records: Iterable[tuple[str, str, bytes]]) -> None:
    """Append other records (tenant, topic, payload): device traffic, log events, garbage."""
    with JournalWriter.open(journal_root, node, fsync=False) as writer:
        for i, (tenant, topic, payload) in enumerate(records):
            writer.append(
                ts_us=BASE_US + i,
                tenant=tenant,
                client_id="dev",
                topic=topic,
                qos=1,
                retain=False,
                payload=payload,
            )
        writer.flush()
