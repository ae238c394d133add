"""A Spark user's aggregate over a 2-million-row ``logs`` table: the driver's memory (issue 16).

    python -m bench.lake_load --rows 2000000

Builds a ``logs`` table as the pipeline leaves it (``bench.logs_query``'s builder: Spark's
Delta, one commit per tenant and day, then maintenance), then, in this process, side by side:

* ``spark``: ``streaming.lake.load(spark, lake, "logs")`` (Spark's Delta reader, distributed)
  grouped by tenant and event type, and the not-clean disconnects counted from ``details``:
  only the small result reaches the Python driver;
* ``collected``: the same aggregate over ``streaming.lake.load_arrow`` (the whole table read
  into this process with delta-rs, then pyarrow's group-by): what a driver that collects a
  table holds.

For each, the growth of this Python process's peak RSS (VmHWM, reset before each) and the
Spark JVM's RSS before and after. Both must give the same counts. Issue 16's target: the Spark
way keeps the driver's RSS growth under 300 MiB on 2M rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.logs_query import ensure_table
from bench.pipeline import peak_rss_mib, reset_peak_rss


def rss_mib(pid: int) -> float:
    """The current RSS of process ``pid``, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def current_rss_mib() -> float:
    return rss_mib(os.getpid())


def spark_counts(spark: Any, lake: Path) -> dict[str, int]:
    from pyspark.sql import functions as F  # noqa: N812 (pyspark's own convention)

    from streaming.lake import load

    logs = load(spark, lake, "logs")
    counts = {
        f"{row['tenant']}/{row['event_type']}": int(row["n"])
        for row in logs.groupBy("tenant", "event_type").agg(F.count("*").alias("n")).collect()
    }
    not_clean = logs.where(
        (F.col("event_type") == "disconnect") & (F.get_json_object("details", "$.clean") == "false")
    ).count()
    counts["disconnect_not_clean"] = int(not_clean)
    return counts


def collected_counts(lake: Path) -> dict[str, int]:
    import pyarrow.compute as pc

    from streaming.lake import load_arrow

    table = load_arrow(lake, "logs")
    grouped = table.group_by(["tenant", "event_type"]).aggregate([([], "count_all")])
    counts = {
        f"{t}/{e}": int(n)
        for t, e, n in zip(
            grouped.column("tenant").to_pylist(),
            grouped.column("event_type").to_pylist(),
            grouped.column("count_all").to_pylist(),
            strict=True,
        )
    }
    disconnects = table.filter(pc.equal(table.column("event_type"), "disconnect"))
    details = disconnects.column("details").to_pylist()
    counts["disconnect_not_clean"] = sum(1 for d in details if json.loads(d)["clean"] is False)
    return counts


def measure(name: str, fn: Any, jvm_pid: int) -> tuple[dict[str, Any], dict[str, int]]:
    before, jvm_before = current_rss_mib(), rss_mib(jvm_pid)
    reset_peak_rss()
    started = time.perf_counter()
    counts = fn()
    seconds = time.perf_counter() - started
    peak = peak_rss_mib()
    result = {
        "way": name,
        "seconds": round(seconds, 2),
        "driver_rss_before_mib": before,
        "driver_peak_rss_mib": peak,
        "driver_rss_growth_mib": round(peak - before, 1),
        "jvm_rss_before_mib": jvm_before,
        "jvm_rss_after_mib": rss_mib(jvm_pid),
    }
    print(json.dumps(result), flush=True)
    return result, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--days", type=int, default=10)
    parser.add_argument("--workdir", type=Path, help="keep the lake here (default: a temp dir)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from streaming.session import build_spark, stop_spark
    from streaming.settings import PipelineSettings

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="edgebus-lake-load-"))
    lake = workdir / "lake"
    try:
        ensure_table(lake, args.rows, args.tenants, args.days)
        spark = build_spark(PipelineSettings(lake=lake, master="local[2]"))
        try:
            jvm_pid = spark.sparkContext._gateway.proc.pid  # the JVM pyspark launched
            spark_result, by_spark = measure("spark", lambda: spark_counts(spark, lake), jvm_pid)
            collected_result, by_arrow = measure(
                "collected", lambda: collected_counts(lake), jvm_pid
            )
        finally:
            stop_spark(spark)
        rows = sum(n for key, n in by_spark.items() if key != "disconnect_not_clean")
        assert rows == args.rows // (args.tenants * args.days) * args.tenants * args.days, rows
        assert by_spark == by_arrow, "the two ways counted differently"
        print(
            json.dumps(
                {
                    "rows": rows,
                    "spark": spark_result,
                    "collected": collected_result,
                    "target_met": spark_result["driver_rss_growth_mib"] < 300,
                }
            )
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
