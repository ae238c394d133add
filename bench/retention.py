"""Retention of history on a ``logs`` table of many small partitions: seconds per maintenance.

    python -m bench.retention --days 60 --tenants 5 --rows-per-partition 100 --repeat 3

Builds a ``logs`` table as the pipeline writes it (Spark's Delta, the logs step's writer): every
tenant has ``rows-per-partition`` events on each of the ``days`` UTC days up to today, in one
commit (one small file per partition), checkpointed. Then, each ``--repeat`` times on a fresh
copy of that table, times in one Spark session (started once, warmed by the build):

* ``maintain_with_retention``: :func:`sinks.maintenance.maintain_table` with the default
  retention (30 days: the partitions older than today - 30 go, every tenant's), i.e. the
  decision (delta-rs, no Spark job), the one ``DELETE`` commit, and the checkpoint after it;
* ``delete_execution``: the ``DELETE`` commit's own ``executionTimeMs``;
* ``maintain_again``: the next run, with nothing left to delete (no commit).

Each run must delete exactly the expected rows and files, add none and write no deletion vector.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench.compare import report
from bench.logs_query import log_rows, summary

KEEP_DAYS = 30


def build_table(spark: Any, lake: Path, days: int, tenants: int, rows: int) -> Path:
    """The logs table: ``days`` x ``tenants`` partitions of ``rows`` rows, one commit."""
    from sinks.maintenance import maintain_table
    from streaming.logs import logs_writer
    from streaming.settings import PipelineSettings

    today = datetime.now(UTC).date()
    rng = np.random.default_rng(16)
    table = pa.concat_tables(
        log_rows(f"tenant-{t:02d}", today - timedelta(days=age), rows, rng)
        for age in range(days)
        for t in range(tenants)
    )
    writer = logs_writer(PipelineSettings(lake=lake, master="local[2]"))
    # One Spark partition per tenant-day: one file per Delta partition, as small as the
    # pipeline's micro-batches leave them before compaction.
    frame = spark.createDataFrame(table).repartition(days * tenants, "tenant", "date")
    writer.append(0, frame)
    maintain_table(spark, writer.path, vacuum_retention_hours=168)
    return Path(writer.path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--days", type=int, default=60)
    parser.add_argument("--tenants", type=int, default=5)
    parser.add_argument("--rows-per-partition", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    from deltalake import DeltaTable

    from sinks.maintenance import maintain_table
    from sinks.retention import Retention
    from streaming.session import build_spark, stop_spark
    from streaming.settings import PipelineSettings

    work = Path(tempfile.mkdtemp(prefix="edgebus-bench-retention-"))
    spark = build_spark(PipelineSettings(lake=work / "lake", master="local[2]"))
    try:
        started = time.perf_counter()
        pristine = build_table(
            spark, work / "lake", args.days, args.tenants, args.rows_per_partition
        )
        build_s = time.perf_counter() - started
        partitions = len(DeltaTable(str(pristine)).file_uris())
        today = datetime.now(UTC).date()
        retention = Retention(today - timedelta(days=KEEP_DAYS))
        expired_days = max(0, args.days - KEEP_DAYS - 1)  # ages 31 .. days-1
        load_before = os.getloadavg()
        runs: dict[str, list[float]] = {"maintain_with_retention": [], "maintain_again": []}
        executions = []
        for i in range(args.repeat):
            copy = work / f"run-{i}" / "logs"
            shutil.copytree(pristine, copy)
            started = time.perf_counter()
            done = maintain_table(spark, copy, vacuum_retention_hours=168, retention=retention)
            runs["maintain_with_retention"].append(time.perf_counter() - started)
            assert done.rows_expired == expired_days * args.tenants * args.rows_per_partition
            history = spark.sql(f"DESCRIBE HISTORY delta.`{copy}`")
            metrics = history.where("operation = 'DELETE'").first()["operationMetrics"]
            assert int(metrics["numRemovedFiles"]) == expired_days * args.tenants, metrics
            assert int(metrics["numAddedFiles"]) == 0, metrics
            assert int(metrics["numDeletionVectorsAdded"]) == 0, metrics
            executions.append(int(metrics["executionTimeMs"]) / 1000)
            version = DeltaTable(str(copy)).version()
            started = time.perf_counter()
            again = maintain_table(spark, copy, vacuum_retention_hours=168, retention=retention)
            runs["maintain_again"].append(time.perf_counter() - started)
            assert (again.rows_expired, DeltaTable(str(copy)).version()) == (0, version)
        result: dict[str, Any] = {
            "benchmark": "retention of history: maintenance deleting expired logs partitions",
            "days": args.days,
            "tenants": args.tenants,
            "rows_per_partition": args.rows_per_partition,
            "partitions": partitions,
            "partitions_deleted": expired_days * args.tenants,
            "build_s": round(build_s, 1),
            **{name: summary(seconds) for name, seconds in runs.items()},
            "delete_execution": summary(executions),
            "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        }
    finally:
        stop_spark(spark)
        shutil.rmtree(work, ignore_errors=True)
    report(result, "retention")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
