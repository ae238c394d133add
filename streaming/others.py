"""Every table but ``messages``, written behind the stream by a thread of their own.

Theory of operation
-------------------
The journal query's ``foreachBatch`` (:class:`streaming.pipeline.TableFanout`) writes a
micro-batch's ``messages`` and returns: what analysts wait for is not held up by the other
tables, whose commits cost a second or more whatever their rows (the usage upsert four,
BENCHMARKS.md issues 12 and 18). It hands the batch to :class:`OtherTables`, whose thread
writes ``logs``, ``quarantine`` and the usage step (``usage``, whose commits tell the quota
step what ``usage`` holds: it decides ahead of it, :mod:`streaming.quota_lane`) behind it,
from a batch read of the journal range
(:func:`streaming.route.read_others`: the route runs again in the read tasks and only the other
destinations' rows cross to the JVM). Every batch handed over while it worked goes in one read
and one commit per table, committed as the newest of those batch ids with each table's Delta
app transaction, as before. A batch whose ``messages`` commit holds all its records has no
other rows and is not read again. A write starts at most every ``others_interval_seconds``
(:class:`~streaming.behind.Behind`'s interval): a write costs seconds of the machine whatever
its rows, and after every batch these tables took more of it than ``messages`` did; it starts
at once when half of :data:`MAX_LAG` batches wait, and for a drain or a stop.

Progress. Each *unit* (``logs``, ``quarantine``, the usage step) is done through a batch id;
once all are, the thread records it in ``{checkpoint}/others`` (written before the query first
starts, as -1). On a restart each unit starts from there, or from its table's own app
transaction where that is newer (a crash between two tables' commits), and works up to the last
batch Spark marked done before the query starts; units at different batch ids read the range
from their own (one read per distinct id), so no table gets a batch twice or misses one. A lake
written before this module has no progress file: every table was then written inside its batch,
so the progress is the last batch Spark marked done. A batch's range comes from Spark's offset
log, which keeps the last 100 batches: the stream waits while the thread is :data:`MAX_LAG`
batches behind.

A batch Spark replays that every table holds already (a crash after the other tables'
commits, before Spark's marker) is not written again here (the quota lane sends the decisions
recorded for it again).

The journal notices (retention) and the pipeline's graceful stop wait for this thread:
:meth:`OtherTables.done_through` is what every table holds, and :meth:`OtherTables.drain`
waits for what was handed over. A failure in the thread fails the stream's next batch with it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 (pyspark's own convention)

from ingest.source import Offset, checkpointed_offset
from sinks.delta import DeltaTableWriter
from streaming import route
from streaming.behind import Behind
from streaming.checkpoint_files import write_durably
from streaming.errors import PipelineError
from streaming.usage import UsageStep

if TYPE_CHECKING:
    from streaming.metrics import PipelineMetrics

logger = logging.getLogger(__name__)

# The units, each done through a batch id: two appends and the usage step.
USAGE = route.COUNTERS
UNITS = (route.LOGS, route.QUARANTINE, USAGE)
# The progress file in the query's checkpoint directory: the batch id every unit is done through.
PROGRESS_FILE = "others"
# How many batches the stream may run ahead of this thread before it waits (Spark's offset log
# keeps the last 100, and a batch's range is read from it).
MAX_LAG = 16


class OtherTables(Behind[tuple[int, bool]]):
    """Writes every table but ``messages`` behind the stream (see the module's docstring);
    handed ``(batch id, whether it may hold other rows)``."""

    what = "writing the other tables"
    thread_name = "other-tables"

    def __init__(
        self,
        checkpoint: Path,
        journals: dict[str, str],
        appends: dict[str, DeltaTableWriter],
        usage: UsageStep,
        metrics: PipelineMetrics | None = None,
        interval_seconds: float = 0.0,
    ) -> None:
        super().__init__(interval_seconds, hurry_at=MAX_LAG // 2)
        self._checkpoint = checkpoint
        self._journals = journals  # the journal source's options, for the batch reads
        self._appends = appends  # logs and quarantine
        self._usage = usage
        self._metrics = metrics
        self._done: dict[str, int] = dict.fromkeys(UNITS, -1)
        # The small tables' appends run beside the usage step: each is its own table's
        # transaction, and most of a small commit's cost is waiting, not the cores.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="append")

    @property
    def writers(self) -> list[DeltaTableWriter]:
        return [*self._appends.values(), *self._usage.writers]

    def start(self, spark: SparkSession) -> None:
        """Take up where the last run left off (written before this returns), then start the
        thread (before the query starts)."""
        progress = self._recorded()
        for unit in UNITS:
            table = self._last_batch(unit)
            self._done[unit] = max(progress, table if table is not None else -1)
        marked = last_marked_done(self._checkpoint)
        if marked is not None and self.done_through() < marked:
            logger.info(
                "other tables: done through %s, catching up to batch %d", self._done, marked
            )
            self._handed.append((marked, True))
        self._start_thread(spark)
        # Caught up before the query starts: its start and this write would start their Python
        # workers side by side, and Spark gives a worker only 10 s to connect back.
        self.drain()

    def hand(self, batch_id: int, others: bool) -> None:
        """Batch ``batch_id`` is in ``messages`` (``others``: it may hold other rows). Waits
        while :data:`MAX_LAG` batches wait already; raises the thread's failure."""
        self._hand((batch_id, others), MAX_LAG)

    def done_through(self) -> int:
        """The last batch id every other table holds (-1: none)."""
        with self._changed:
            return min(self._done.values())

    def usage_end(self) -> Offset:
        """Each node's last seq the usage table holds (its last batch's end offset)."""
        with self._changed:
            through = self._done[USAGE]
        return checkpointed_offset(self._checkpoint, through) if through >= 0 else {}

    def mark_done(self, batch_id: int) -> None:
        """Every unit is done through ``batch_id`` (what the thread does after each write)."""
        with self._changed:
            for unit in UNITS:
                self._done[unit] = max(self._done[unit], batch_id)
            self._changed.notify_all()

    def close(self) -> None:
        """Stop the thread once what was handed over is written (or it failed)."""
        super().close()
        self._pool.shutdown(wait=True)

    def _progress(self) -> str:
        return f" (done through {min(self._done.values())})"

    def _work(self, spark: SparkSession, taken: list[tuple[int, bool]]) -> None:
        self._write_through(spark, taken[-1][0], any(may for _, may in taken))

    def _write_through(self, spark: SparkSession, batch_id: int, others: bool) -> None:
        """Every unit through ``batch_id``: units done through the same id are one group."""
        with self._changed:
            groups = sorted({done for done in self._done.values() if done < batch_id})
        for since in groups:
            with self._changed:
                units = [unit for unit, done in self._done.items() if done == since]
            if others:
                self._write(spark, batch_id, since, units)
            elif USAGE in units:  # nothing to add: the quota step learns so
                self._usage(batch_id, checkpointed_offset(self._checkpoint, batch_id), None, set())
            with self._changed:
                for unit in units:
                    self._done[unit] = batch_id
        self._record(batch_id)

    def _write(self, spark: SparkSession, batch_id: int, since: int, units: list[str]) -> None:
        """The rows of ``units``' tables of the batches after ``since`` through ``batch_id``,
        from one read of that range, committed as batch ``batch_id``."""
        started = time.monotonic()
        start = checkpointed_offset(self._checkpoint, since)
        end = checkpointed_offset(self._checkpoint, batch_id)
        rows = route.read_others(spark, self._journals, start, end)
        rows = rows.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            counts: dict[str, int] = {}
            touched: set[tuple[str, date]] = set()  # the usage partitions of the counters
            grouped = rows.groupBy("dest", "tenant", "date").agg(F.count("*").alias("n"))
            for row in grouped.collect():
                counts[row["dest"]] = counts.get(row["dest"], 0) + row["n"]
                if row["dest"] == route.COUNTERS:
                    touched.add((row["tenant"], row["date"]))
            timings = {"others": time.monotonic() - started}
            pending = {
                dest: self._pool.submit(_timed, writer.append, batch_id, route.share(rows, dest))
                for dest, writer in self._appends.items()
                if dest in units and counts.get(dest)
            }
            try:
                if USAGE in units:
                    began = time.monotonic()
                    counters = route.share(rows, route.COUNTERS) if counts.get(USAGE) else None
                    self._usage(batch_id, end, counters, touched)
                    timings["usage"] = time.monotonic() - began
            finally:
                # Every append ends (or fails) before the rows are unpersisted, whichever fails.
                wait(pending.values())
            for dest, future in pending.items():
                timings[dest] = future.result()[1]  # an append's failure is raised here
        finally:
            rows.unpersist()
        logger.info(
            "other tables: batches %d-%d (%s): %s rows; %s",
            since + 1,
            batch_id,
            ", ".join(units),
            counts,
            ", ".join(f"{step} {seconds:.2f} s" for step, seconds in timings.items()),
        )
        if self._metrics is not None:
            self._metrics.rows_written(counts, timings)

    def _last_batch(self, unit: str) -> int | None:
        if unit == USAGE:
            return self._usage.usage.delta.last_batch_id()
        return self._appends[unit].last_batch_id()

    def _recorded(self) -> int:
        """The progress file's batch id; without one, the last batch Spark marked done (a lake
        the pipeline wrote before this module), or -1 for a new query (then recorded)."""
        try:
            return int((self._checkpoint / PROGRESS_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            pass
        except ValueError as exc:
            raise PipelineError(
                f"{self._checkpoint / PROGRESS_FILE}: not a batch id ({exc}); the other "
                "tables' progress is lost: restore it, or rebuild the lake from the journal"
            ) from exc
        marked = last_marked_done(self._checkpoint)
        progress = -1 if marked is None else marked
        self._record(progress)
        return progress

    def _record(self, batch_id: int) -> None:
        """Write the progress file atomically (a crash leaves the old one or the new one)."""
        write_durably(self._checkpoint / PROGRESS_FILE, str(batch_id))


def last_marked_done(checkpoint: Path) -> int | None:
    """The last batch id Spark marked done in a query's checkpoint (``commits/{id}``)."""
    try:
        ids = [int(name) for name in os.listdir(checkpoint / "commits") if name.isdigit()]
    except FileNotFoundError:
        return None
    return max(ids, default=None)


def _timed(
    append: Callable[[int, DataFrame], int | None], batch_id: int, rows: DataFrame
) -> tuple[int | None, float]:
    """``append(batch_id, rows)`` and how long it took (run in a pool thread)."""
    began = time.monotonic()
    return append(batch_id, rows), time.monotonic() - began
