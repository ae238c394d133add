"""A Delta commit's time against the number of files in the table's ``_delta_log``.

    python -m bench.delta_log --files 0 20000 100000 300000

Every commit adds files to ``_delta_log`` (its JSON and its ``.crc``; a checkpoint every 100
versions), and Delta deletes them only at its log cleanup, which keeps
``delta.logRetentionDuration`` (30 days by default) counted in whole days. Before each commit
Delta lists the directory to find the newest version, and on a local or mounted filesystem that
listing reads every entry. A stream committing twice a second adds about 350,000 files a day.

The bench makes a ``messages`` table with the pipeline's writer and a one-row batch, then for each
``--files`` count fills the log directory up to that many extra files (empty files named after
the versions' JSON, which Delta lists and ignores, as it lists old commits), and times
``--commits`` appends: the median is what every micro-batch pays for the commit alone at that
size. The Spark session is the pipeline's (``streaming.session.build_spark``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.compare import RESULTS_DIR, machine_info, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.delta_log", description=__doc__)
    parser.add_argument("--files", type=int, nargs="+", default=[0, 20_000, 100_000, 300_000])
    parser.add_argument("--commits", type=int, default=20, help="appends timed at each size")
    args = parser.parse_args(argv)
    if sorted(args.files) != args.files or args.files[0] < 0:
        parser.error("--files: counts >= 0, in increasing order")

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from schemas.tables import MESSAGES_PARTITION_BY, MESSAGES_SCHEMA
    from sinks.delta import DeltaTableWriter, spark_schema
    from streaming.session import build_spark, stop_spark
    from streaming.settings import PipelineSettings

    work = Path(tempfile.mkdtemp(prefix="edgebus-bench-delta-log-"))
    spark = build_spark(PipelineSettings(data_dir=work / "data", lake=work / "lake"))
    row: dict[str, Any] = {
        "node": "bench",
        "seq": 1,
        "ts": dt.datetime(2026, 11, 28, tzinfo=dt.UTC),
        "date": dt.date(2026, 11, 28),
        "tenant": "t",
        "client_id": "c",
        "topic": "fleet/c/telemetry",
        "qos": 1,
        "retain": False,
        "payload": b"{}",
        "payload_text": "{}",
        "content_type": None,
        "user_properties": [],
        "size": 2,
    }
    rows = spark.createDataFrame([row], schema=spark_schema(MESSAGES_SCHEMA))
    path = work / "lake" / "messages"
    writer = DeltaTableWriter(path, "bench.delta_log", MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)
    batch = 0

    def median_commit_s(commits: int) -> float:
        nonlocal batch
        took = []
        for _ in range(commits):
            began = time.monotonic()
            writer.append(batch, rows)
            took.append(time.monotonic() - began)
            batch += 1
        return statistics.median(took)

    median_commit_s(30)  # the JVM's warm-up
    log = path / "_delta_log"
    made = 0
    sizes = []
    for extra in args.files:
        for i in range(made, extra):
            (log / f"{i:020d}.json.old").touch()
        made = max(made, extra)
        entries = len(os.listdir(log))
        median = median_commit_s(args.commits)
        sizes.append({"extra_files": extra, "log_entries": entries, "median_append_s": median})
        print(json.dumps(sizes[-1]), flush=True)
    stop_spark(spark)
    now = dt.datetime.now(dt.UTC)
    result = {
        "benchmark": "delta_log",
        "commits_per_size": args.commits,
        "sizes": sizes,
        "date": now.isoformat(timespec="seconds"),
        "timestamp_compact": f"{now:%Y%m%dT%H%M%SZ}",
        "machine": machine_info(),
    }
    print(f"results: {write_report(result, RESULTS_DIR, 'delta-log')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
