"""The usage step's time per micro-batch: edges' counter records through the real pipeline.

    python -m bench.usage_step --tenants 5 --metrics 4 --minutes 20 --records-per-batch 2000

Writes two nodes' journals of ``$counters/{metric}`` records as edges journal them (one record
per tenant, metric and node every ``--interval`` seconds of a day, client ``$edge``), then runs
``streaming.pipeline`` on a local Spark session (``local[2]``, quality and maintenance off)
until the journals are in the lake, in batches of ``--records-per-batch`` records. Every batch
holds only counter records, so each runs the ``usage`` upsert (:mod:`streaming.usage`) and
nothing else but the empty ``messages`` write and the second read of the range.

Reported: each write's step times from the other tables' log (``usage`` is the upsert: the
touched partitions' files, the cogroup, the writes and the commit; since the other tables are
written behind the stream, one write takes every batch that ended while the last one ran), and
the median, min and max of ``usage`` over the writes after the first two batches (a cold JVM),
and the whole run. Run it from two trees
in turn (``PYTHONPATH=TREE``) to compare two versions of the step. Results:
``bench/results/{timestamp}-usage_step.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.compare import RESULTS_DIR, machine_info, write_report

NODES = ("edge-a", "edge-b")
METRICS = ("messages_in", "bytes_in", "messages_out", "bytes_out", "sessions", "subscriptions")
DAY = datetime(2024, 3, 10, tzinfo=UTC)
# The other tables' log line (streaming.others): the batches one write took, and its steps.
_BATCH_LINE = re.compile(r"^other tables: batches \d+-(\d+) \(.*?\): .*?; (.*)$")


def write_journals(root: Path, tenants: int, metrics: int, minutes: float, interval: float) -> int:
    """Both nodes' counter records; how many were written."""
    from broker_edge.plim import iso
    from ingest.journal import JournalWriter
    from schemas.usage import GAUGE_METRICS

    written = 0
    steps = int(minutes * 60 / interval)
    for node in NODES:
        with JournalWriter.open(root, node, fsync=False) as writer:
            for step in range(1, steps + 1):
                end = DAY + timedelta(seconds=step * interval)
                end_us = int(end.timestamp() * 1_000_000)
                for tenant in (f"t{i}" for i in range(tenants)):
                    for metric in METRICS[:metrics]:
                        kind = "gauge" if metric in GAUGE_METRICS else "counter"
                        doc = {
                            "node": node,
                            "tenant": tenant,
                            "metric": metric,
                            "kind": kind,
                            "delta": 3,
                            "total": 3 * step,
                            "interval_start": iso(end_us - int(interval * 1_000_000)),
                            "interval_end": iso(end_us),
                        }
                        writer.append(
                            ts_us=end_us,
                            tenant=tenant,
                            client_id="$edge",
                            topic=f"$counters/{metric}",
                            qos=0,
                            retain=False,
                            payload=json.dumps(doc, separators=(",", ":")).encode(),
                        )
                        written += 1
            writer.flush()
    return written


class _BatchLog(logging.Handler):
    """Keeps the other tables' log lines: ``{step: seconds}`` per write, by its last batch id
    (behind the stream, one write takes every batch handed over while the last one ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: dict[int, dict[str, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        found = _BATCH_LINE.match(record.getMessage())
        if found is None:
            return
        steps = dict(re.findall(r"(\w+) ([0-9.]+) s", found.group(2)))
        self.batches[int(found.group(1))] = {step: float(s) for step, s in steps.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.usage_step", description=__doc__)
    parser.add_argument("--tenants", type=int, default=5)
    parser.add_argument("--metrics", type=int, default=4, choices=range(1, len(METRICS) + 1))
    parser.add_argument("--minutes", type=float, default=20.0, help="of counters per node")
    parser.add_argument("--interval", type=float, default=2.0, help="counter interval, seconds")
    parser.add_argument("--records-per-batch", type=int, default=2000)
    parser.add_argument("--workdir", type=Path, help="keep the journals and lake here")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from streaming import others, pipeline
    from streaming.session import build_spark, stop_spark
    from streaming.settings import PipelineSettings

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="usage-step-"))
    settings = PipelineSettings(
        max_records_per_batch=args.records_per_batch,
        data_dir=workdir / "data",
        lake=workdir / "lake",
        quality_interval_seconds=0,  # nothing but the batches
        maintenance_interval_seconds=0,
        master="local[2]",
        shuffle_partitions=2,
        trigger_interval_seconds=0.1,
    )
    records = write_journals(
        settings.journal_root, args.tenants, args.metrics, args.minutes, args.interval
    )
    print(f"journals: {records} counter records", flush=True)
    log = _BatchLog()
    pipeline_logger = logging.getLogger(others.__name__)
    pipeline_logger.setLevel(logging.INFO)
    pipeline_logger.addHandler(log)
    spark = build_spark(settings)
    started = time.monotonic()
    try:
        pipeline.run(settings, once=True, spark=spark)
    finally:
        stop_spark(spark)
    elapsed = time.monotonic() - started
    for batch_id, steps in sorted(log.batches.items()):
        print(f"batch {batch_id}: " + ", ".join(f"{k} {v:.2f} s" for k, v in steps.items()))
    warm = [steps["usage"] for batch_id, steps in log.batches.items() if batch_id >= 2]
    if not warm:
        print("fewer than three batches: nothing to report", file=sys.stderr)
        return 1
    summary = {
        "median_s": round(statistics.median(warm), 3),
        "min_s": round(min(warm), 3),
        "max_s": round(max(warm), 3),
        "batches": len(warm),
    }
    print(f"usage step per write (after batch 1): {summary}; whole run {elapsed:.1f} s")
    now = datetime.now(UTC)
    report: dict[str, Any] = {
        "benchmark": "usage step per micro-batch",
        "args": {k: str(v) for k, v in vars(args).items()},
        "records": records,
        "usage_step": summary,
        "per_batch": {str(k): v for k, v in sorted(log.batches.items())},
        "whole_run_s": round(elapsed, 1),
        "loadavg": os.getloadavg(),
        "machine": machine_info(),
        "date": now.isoformat(timespec="seconds"),
        "timestamp_compact": now.strftime("%Y%m%dT%H%M%SZ"),
    }
    print(f"results: {write_report(report, RESULTS_DIR, 'usage_step')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
