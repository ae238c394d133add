"""The pipeline's Prometheus metrics (``edgebus pipeline --metrics HOST:PORT``).

Theory of operation
-------------------
The hot path pays for nothing it does not already compute: :class:`TableFanout` calls
:meth:`PipelineMetrics.batch_done` once per micro-batch with the per-destination row counts,
each node's last seq and newest ``ts`` (one small aggregation it runs anyway), and its step
timings; the quota step hands over its decisions, the quality schedule its results. Each is a
handful of counter increments.

Lag is measured when Prometheus scrapes, not per batch: the collector reads each node's durable
end the way the source's ``latestOffset`` does (the ``DURABLE`` watermark and the newest
segment's frame headers of every local journal, ``GET /journal`` of every edge read over HTTP;
an edge that does not answer within a second is left out of that scrape) and compares it with
what the lake holds: the last seq of each node in the last batch every table committed
(:meth:`batch_done`; at start, the offsets of the checkpoint's last committed batch).

- ``edgebus_pipeline_lag_records{node}``: durable records of the node not in the lake yet;
- ``edgebus_pipeline_lag_seconds{node}``: 0 when that is none, else how old the newest record of
  the node the lake holds is (its ``ts``; before this run committed any of the node's records,
  the time since the run started): the lake is at least that far behind the node.

The scrape runs in the metrics server's thread; no Spark call is made from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ingest.source import Offset, checkpointed_offset, local_ends

if TYPE_CHECKING:
    from ingest.journal import JournalReader
    from streaming.quality import QualityResult
    from streaming.quota import QuotaEvent
    from streaming.settings import PipelineSettings

logger = logging.getLogger(__name__)

PREFIX = "edgebus_pipeline"
# Where a routed row goes -> the table it is written to (counter records are merged into usage).
DESTINATION_TABLES = {
    "messages": "messages",
    "logs": "logs",
    "counters": "usage",
    "quarantine": "quarantine",
}
BATCH_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
EDGE_TIMEOUT_SECONDS = 1.0


class PipelineMetrics:
    """Every metric of one pipeline process, on a registry of its own."""

    def __init__(
        self,
        settings: PipelineSettings,
        *,
        job: str = "journal",
        edge_token: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = CollectorRegistry()
        self.batches = Counter(
            f"{PREFIX}_batches", "micro-batches written to every table", registry=self.registry
        )
        self.rows = Counter(
            f"{PREFIX}_rows",
            "rows written per table (usage: the counter records merged into it)",
            ["table"],
            registry=self.registry,
        )
        self.batch_seconds = Histogram(
            f"{PREFIX}_batch_duration_seconds",
            "how long a micro-batch took, from its start to its last table's commit",
            buckets=BATCH_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.step_seconds = Counter(
            f"{PREFIX}_step_seconds",
            "time spent per step of the micro-batches (route, each table, usage and quota)",
            ["step"],
            registry=self.registry,
        )
        self.last_batch = Gauge(
            f"{PREFIX}_last_batch_timestamp_seconds",
            "when the last micro-batch was written (Unix time)",
            registry=self.registry,
        )
        self.quota_decisions = Counter(
            f"{PREFIX}_quota_decisions",
            "quota state changes decided (each a quota_events row)",
            ["metric", "state"],
            registry=self.registry,
        )
        self.quality_runs = Counter(
            f"{PREFIX}_quality_runs", "data quality runs", registry=self.registry
        )
        self.quality_failures = Counter(
            f"{PREFIX}_quality_failures",
            "expectations that failed, per table (edgebus quality --failed names the rows)",
            ["table"],
            registry=self.registry,
        )
        self.lag = LagCollector(settings, job=job, edge_token=edge_token, clock=clock)
        self.registry.register(self.lag)
        self._clock = clock

    def batch_done(
        self,
        counts: Mapping[str, int],
        timings: Mapping[str, float],
        ends: Mapping[str, tuple[int, datetime | None]],
    ) -> None:
        """A micro-batch is in every table: its rows per destination, its step timings, and
        each node's last seq and newest ``ts`` in it."""
        self.batches.inc()
        for dest, n in counts.items():
            self.rows.labels(DESTINATION_TABLES.get(dest, dest)).inc(n)
        for step, seconds in timings.items():
            self.step_seconds.labels(step).inc(seconds)
        self.batch_seconds.observe(sum(timings.values()))
        self.last_batch.set(self._clock())
        self.lag.committed(ends)

    def quota_decided(self, events: Iterable[QuotaEvent]) -> None:
        for event in events:
            self.quota_decisions.labels(event.metric, event.state).inc()

    def quality_ran(self, results: Iterable[QualityResult]) -> None:
        self.quality_runs.inc()
        for result in results:
            if not result.success:
                self.quality_failures.labels(result.table).inc()


class LagCollector(Collector):
    """Each node's durable end against what the lake holds, measured at scrape time."""

    def __init__(
        self,
        settings: PipelineSettings,
        *,
        job: str,
        edge_token: str | None,
        clock: Callable[[], float],
    ) -> None:
        self._root = settings.journal_root
        self._edges = settings.edges
        self._token = edge_token
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._journals: dict[str, JournalReader] = {}
        # node -> (last seq in the lake, the newest ts of its records there, if known)
        self._lake: dict[str, tuple[int, float | None]] = {
            node: (seq, None)
            for node, seq in _committed_offset(settings.checkpoint_path(job)).items()
        }

    def committed(self, ends: Mapping[str, tuple[int, datetime | None]]) -> None:
        with self._lock:
            for node, (seq, ts) in ends.items():
                stamp = ts.timestamp() if ts is not None else None
                self._lake[node] = (seq, stamp)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        durable = self._durable_ends()
        now = self._clock()
        with self._lock:
            lake = dict(self._lake)
        families = {
            "durable": GaugeMetricFamily(
                f"{PREFIX}_durable_seq",
                "the newest durable seq of each node's journal",
                labels=["node"],
            ),
            "committed": GaugeMetricFamily(
                f"{PREFIX}_committed_seq",
                "the last seq of each node the lake holds",
                labels=["node"],
            ),
            "records": GaugeMetricFamily(
                f"{PREFIX}_lag_records",
                "durable journal records of each node not in the lake yet",
                labels=["node"],
            ),
            "seconds": GaugeMetricFamily(
                f"{PREFIX}_lag_seconds",
                "0 when the lake holds every durable record of the node, else the age of the "
                "newest record of it the lake holds",
                labels=["node"],
            ),
        }
        for node in sorted({*durable, *lake}):
            seq, ts = lake.get(node, (0, None))
            families["committed"].add_metric([node], seq)
            if node not in durable:
                continue  # an edge that did not answer this time: its lag is unknown
            behind = max(durable[node] - seq, 0)
            families["durable"].add_metric([node], durable[node])
            families["records"].add_metric([node], behind)
            age = now - (ts if ts is not None else self._started)
            families["seconds"].add_metric([node], max(age, 0.0) if behind else 0.0)
        yield from families.values()

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # collected at scrape time only: nothing to describe up front

    def _durable_ends(self) -> Offset:
        from ingest.journal import JournalError
        from ingest.remote import journal_range
        from ingest.source import SourceError

        ends: Offset = {}
        with self._lock:
            try:
                ends.update(local_ends(self._root, self._journal))
            except (JournalError, OSError) as exc:
                logger.warning("metrics: cannot read the journals under %s: %s", self._root, exc)
        for edge in self._edges:
            try:
                remote = journal_range(edge, self._token, timeout=EDGE_TIMEOUT_SECONDS)
            except (SourceError, OSError) as exc:  # down, or refusing: no lag for it now
                logger.debug("metrics: edge %s: %s", edge, exc)
                continue
            ends[remote.node] = remote.last_seq
        return ends

    def _journal(self, node: str) -> JournalReader:
        from ingest.journal import JournalReader

        journal = self._journals.get(node)
        if journal is None:
            journal = self._journals[node] = JournalReader(self._root / node)
        return journal


def _committed_offset(checkpoint: Path) -> Offset:
    """The end offset of the last batch the checkpoint marks done ({} before the first)."""
    try:
        done = [
            int(name.name) for name in (checkpoint / "commits").iterdir() if name.name.isdigit()
        ]
    except OSError:
        return {}
    return checkpointed_offset(checkpoint, max(done)) if done else {}
