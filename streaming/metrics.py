"""The pipeline's Prometheus metrics (``edgebus pipeline --metrics HOST:PORT``).

Theory of operation
-------------------
The hot path pays for nothing it does not already compute: :class:`TableFanout` calls
:meth:`PipelineMetrics.batch_done` once per micro-batch with what it has anyway (the rows the
``messages`` commit holds, the batch's end offset per node, its time), the other tables' thread
(:mod:`streaming.others`) :meth:`PipelineMetrics.rows_written` with theirs; the quota step hands
over its decisions, the quality schedule its results. Each is a handful of counter increments.

Lag is measured when Prometheus scrapes, not per batch: the collector reads each node's durable
end the way the source's ``latestOffset`` does (the ``DURABLE`` watermark and the newest
segment's frame headers of every local journal, ``GET /journal`` of every edge read over HTTP;
an edge that does not answer within a second is left out of that scrape) and compares it with
what the lake holds: the last seq of each node in the last batch ``messages`` committed (what
analysts wait for; :meth:`batch_done`; at start, the offsets of the checkpoint's last committed
batch).

- ``edgebus_pipeline_lag_records{node}``: durable records of the node not in the lake yet;
- ``edgebus_pipeline_lag_seconds{node}``: how long the oldest of them has waited (now minus its
  ``ts``, read from the journal or the edge: one record, once per node and lake end); 0 when
  none waits.

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
            "how long a micro-batch took, from its start to its messages commit",
            buckets=BATCH_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.step_seconds = Counter(
            f"{PREFIX}_step_seconds",
            "time per step of the micro-batches (messages, the second read, each other table)",
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
        counts: Mapping[str, int | None],
        timings: Mapping[str, float],
        ends: Mapping[str, int],
        elapsed: float,
    ) -> None:
        """A micro-batch is in ``messages``: its rows (None: not known), its step timings,
        each node's last seq in it, and its wall time."""
        self.batches.inc()
        self.rows_written(counts, timings)
        self.batch_seconds.observe(elapsed)
        self.last_batch.set(self._clock())
        self.lag.committed(ends)

    def rows_written(self, counts: Mapping[str, int | None], timings: Mapping[str, float]) -> None:
        """Rows written per destination (None: not known) and the time their steps took: a
        batch's ``messages``, or a write of the other tables (:mod:`streaming.others`)."""
        for dest, n in counts.items():
            if n:
                self.rows.labels(DESTINATION_TABLES.get(dest, dest)).inc(n)
        for step, seconds in timings.items():
            self.step_seconds.labels(step).inc(seconds)

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
        self._lock = threading.Lock()
        self._journals: dict[str, JournalReader] = {}
        self._edge_of: dict[str, str] = {}  # remote node -> its edge
        self._waiting: dict[str, tuple[int, float]] = {}  # node -> (lake end, next record's ts)
        # node -> the last seq of it the lake holds
        self._lake: dict[str, int] = _committed_offset(settings.checkpoint_path(job))

    def committed(self, ends: Mapping[str, int]) -> None:
        with self._lock:
            self._lake.update(ends)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:  # one scrape at a time: they share the journal readers
            durable = self._durable_ends()
            lake = dict(self._lake)
            now = self._clock()
            waited = {
                node: self._waited(node, lake.get(node, 0), now)
                for node, end in durable.items()
                if end > lake.get(node, 0)
            }
        families = [
            GaugeMetricFamily(
                f"{PREFIX}_durable_seq",
                "the newest durable seq of each node's journal",
                labels=["node"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_committed_seq",
                "the last seq of each node the lake holds",
                labels=["node"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_lag_records",
                "durable journal records of each node not in the lake yet",
                labels=["node"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_lag_seconds",
                "how long the oldest durable record of each node not in the lake yet has waited",
                labels=["node"],
            ),
        ]
        durable_seq, committed_seq, records, seconds = families
        for node in sorted({*durable, *lake}):
            seq = lake.get(node, 0)
            committed_seq.add_metric([node], seq)
            if node not in durable:
                continue  # an edge that did not answer this time: its lag is unknown
            durable_seq.add_metric([node], durable[node])
            records.add_metric([node], max(durable[node] - seq, 0))
            age = waited.get(node, 0.0)
            if age is not None:  # None: the waiting record could not be read just now
                seconds.add_metric([node], age)
        yield from families

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # collected at scrape time only: nothing to describe up front

    def _durable_ends(self) -> Offset:
        from ingest.journal import JournalError
        from ingest.remote import journal_range
        from ingest.source import SourceError

        ends: Offset = {}
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
            self._edge_of[remote.node] = edge
        return ends

    def _waited(self, node: str, lake_end: int, now: float) -> float | None:
        """How long the node's first record the lake does not hold has waited (its ``ts``,
        read once per lake end); None when it cannot be read now."""
        known = self._waiting.get(node)
        if known is None or known[0] != lake_end:
            ts = self._record_ts(node, lake_end + 1)
            if ts is None:
                return None
            known = self._waiting[node] = (lake_end, ts)
        return max(now - known[1], 0.0)

    def _record_ts(self, node: str, seq: int) -> float | None:
        """The ``ts`` (Unix seconds) of ``node``'s record ``seq``, from its journal here or
        from its edge (one request, no retry); None when it cannot be read."""
        from ingest.journal import JournalError
        from ingest.remote import read_range
        from ingest.source import SourceError

        edge = self._edge_of.get(node)
        try:
            if edge is None:
                for record in self._journal(node).read_records(seq - 1, seq):
                    return float(record["ts"]) / 1_000_000
                return None
            for batch in read_range(edge, self._token, node, seq - 1, seq, retry_seconds=0):
                when: datetime = batch.column("ts")[0].as_py()
                return when.timestamp()
        except (JournalError, SourceError, OSError) as exc:  # removed, down: next scrape
            logger.debug("metrics: node %s seq %d: %s", node, seq, exc)
        return None

    def _journal(self, node: str) -> JournalReader:
        from ingest.journal import JournalReader

        journal = self._journals.get(node)
        if journal is None:
            journal = self._journals[node] = JournalReader(self._root / node)
        return journal


def _committed_offset(checkpoint: Path) -> Offset:
    """The end offset of the last batch the checkpoint marks done ({} before the first)."""
    from ingest.source import SourceError

    try:
        commits = (checkpoint / "commits").iterdir()
        done = [int(name.name) for name in commits if name.name.isdigit()]
        return checkpointed_offset(checkpoint, max(done)) if done else {}
    except (OSError, SourceError) as exc:  # a checkpoint not there yet: from zero
        logger.debug("metrics: no committed offset in %s: %s", checkpoint, exc)
        return {}
