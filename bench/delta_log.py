"""A Delta commit's time against the number of files in the table's ``_delta_log``, with
Delta's own log store for local tables and with edgebus's, side by side.

    python -m bench.delta_log --files 0 20000 100000 300000

Every commit adds files to ``_delta_log`` (its JSON and its ``.crc``; a checkpoint every 100
versions), and Delta deletes them only at its log cleanup, which keeps
``delta.logRetentionDuration`` (30 days by default) counted in whole days. Before each commit
Delta lists the directory from its newest checkpoint. Delta's ``HDFSLogStore`` (what it uses
for ``file:`` paths) asks Hadoop for the status of every entry in the directory and then keeps
those at or after the checkpoint; edgebus's ``LocalListingLogStore`` (``sinks/jvm``) reads the
names and asks the status of those it keeps. A stream committing twice a second adds about
350,000 files a day.

The bench makes two ``messages`` tables with the pipeline's writer and a one-row batch, one per
log store (``spark.delta.logStore.file.impl``). For each ``--files`` count it fills both log
directories up to that many extra files (empty files named to sort before every version, as the
commits older than the newest checkpoint do, and listed by Hadoop as they are), then times
``--commits`` appends to each table in turn: the median is what every micro-batch pays for the
commit alone at that size. The Spark session is the pipeline's
(``streaming.session.build_spark``).
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
    from streaming.session import LOCAL_LOG_STORE, LOG_STORE_KEY, build_spark, stop_spark
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
    stores = {
        "delta": "io.delta.storage.HDFSLogStore",
        "edgebus": LOCAL_LOG_STORE,
    }
    # Delta reads the log store of a scheme from the SparkContext's conf when a table's log is
    # first opened (DelegatingLogStore); the bench changes it between its two tables.
    conf = spark.sparkContext._jvm.org.apache.spark.SparkEnv.get().conf()
    logs = {name: work / "lake" / f"messages_{name}" / "_delta_log" for name in stores}
    writers = {}
    for name, store in stores.items():
        conf.set(LOG_STORE_KEY, store)
        writers[name] = DeltaTableWriter(
            work / "lake" / f"messages_{name}",
            f"bench.delta_log.{name}",
            MESSAGES_SCHEMA,
            MESSAGES_PARTITION_BY,
        )
        writers[name].append(0, rows)  # opens the table's log with this store
    conf.set(LOG_STORE_KEY, LOCAL_LOG_STORE)
    batches = dict.fromkeys(stores, 1)

    def median_commit_s(name: str, commits: int) -> float:
        took = []
        for _ in range(commits):
            began = time.monotonic()
            writers[name].append(batches[name], rows)
            took.append(time.monotonic() - began)
            batches[name] += 1
        return statistics.median(took)

    for name in stores:
        median_commit_s(name, 30)  # the JVM's warm-up
    made = 0
    sizes = []
    for extra in args.files:
        for log in logs.values():
            for i in range(made, extra):
                (log / f".old-{i:020d}.json").touch()
        made = max(made, extra)
        size: dict[str, Any] = {"extra_files": extra}
        for name, log in logs.items():
            size[f"{name}_log_entries"] = len(os.listdir(log))
            size[f"{name}_median_append_s"] = median_commit_s(name, args.commits)
        size["ratio"] = size["delta_median_append_s"] / size["edgebus_median_append_s"]
        sizes.append(size)
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
