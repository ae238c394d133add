"""Journal → Delta throughput of the pipeline (every table step), rows per second.

    python -m bench.pipeline --records 1000000 --nodes 2

Writes ``records`` journal records of ~200-byte telematics JSON payloads (content type
application/json, so the JSON contract checks every one) across ``nodes`` nodes, as edges
would, and syncs them to disk (an edge fsyncs its journal; unsynced, the kernel wrote them back
during the timed run), starts the Spark session (not timed: ~7 s here), then starts the pipeline's
journal query and times it to caught-up. Two figures: ``rows_per_s`` over the whole run (query
start and the first batch's warm-up included) and ``sustained_rows_per_s``, the batches after the
first (rows over their trigger execution time, from Spark's progress reports): the rate of a
running pipeline working off a backlog. The Delta row count is checked against the journal
afterwards.

``--lake s3`` writes the lake into a bucket of an S3-compatible server started for the run
(moto's, ``bench.s3_server``: a Python process on this machine, so the figure is Delta over S3A
plus moto's own cost, not AWS's); ``--lake both`` runs the same journals into a local lake and
then into the bucket, in one session, side by side (``--repeat 2``: twice each, alternating, so
the JVM's warm-up does not favour the second).

``driver_peak_rss_mib`` is the peak resident memory of this (the pipeline driver's Python)
process while the query runs: the kernel's high-water mark (``VmHWM``), reset just before the
query starts (``/proc/self/clear_refs``), so writing the journals does not count. The JVM is
another process and is not included.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.compare import report
from bench.s3_server import s3_server
from sinks.storage import LakePath, ObjectPath, open_delta

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from streaming.settings import PipelineSettings

BUCKET = "edgebus-bench"


def telematics_payload(rng: random.Random, vehicle: int, i: int) -> bytes:
    doc = {
        "vehicle": f"veh-{vehicle:05d}",
        "seq": i,
        "ts": 1_790_000_000 + i,
        "lat": round(rng.uniform(-90, 90), 6),
        "lon": round(rng.uniform(-180, 180), 6),
        "speed_kmh": round(rng.uniform(0, 130), 1),
        "heading": rng.randrange(360),
        "fuel_pct": round(rng.uniform(0, 100), 1),
        "engine": rng.choice(["on", "off", "idle"]),
        "odometer_km": rng.randrange(1_000_000),
    }
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return raw.ljust(200, b" ")


def write_journals(root: Path, records: int, nodes: int) -> None:
    from ingest.journal import JournalWriter

    rng = random.Random(7)
    per_node = records // nodes
    now_us = time.time_ns() // 1000
    for n in range(nodes):
        with JournalWriter.open(root, f"node-{n}", fsync=False) as writer:
            for i in range(per_node):
                vehicle = rng.randrange(10_000)
                writer.append(
                    ts_us=now_us + i,
                    tenant="default",
                    client_id=f"veh-{vehicle:05d}",
                    topic=f"fleet/veh-{vehicle:05d}/telemetry",
                    qos=1,
                    retain=False,
                    payload=telematics_payload(rng, vehicle, i),
                    content_type="application/json",
                )
                if i % 2000 == 1999:
                    writer.flush()
            writer.flush()


def count_rows(table: LakePath) -> int:
    from deltalake import QueryBuilder

    result = QueryBuilder().register("t", open_delta(table)).execute("select count(*) AS n from t")
    return int(result.read_all().column("n")[0].as_py())


def reset_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mib() -> float:
    """This process's peak RSS since the last reset, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM in /proc/self/status")


def timed_run(
    spark: SparkSession, settings: PipelineSettings, written: int, edge_token: str | None = None
) -> dict[str, Any]:
    """The journal query over every journal into ``settings.lake``, timed to caught-up
    (``edge_token``: the operator token ``settings.edges`` want)."""
    from streaming import pipeline

    reset_peak_rss()
    started = time.perf_counter()
    query = pipeline.start(spark, settings, edge_token=edge_token)
    try:
        query.processAllAvailable()
        elapsed = time.perf_counter() - started
        progress = list(query.recentProgress)
        peak_rss = peak_rss_mib()
    finally:
        query.stop()
    batches = [p for p in progress if p["numInputRows"] > 0]
    steady = batches[1:]
    steady_rows = sum(p["numInputRows"] for p in steady)
    steady_s = sum(p["durationMs"]["triggerExecution"] for p in steady) / 1000
    rows = count_rows(settings.table_path("messages"))
    assert rows == written, f"{rows} rows in messages, {written} journaled"
    return {
        "lake": "s3 (moto)" if isinstance(settings.lake, ObjectPath) else "local",
        "seconds": round(elapsed, 2),
        "rows_per_s": round(written / elapsed),
        "batches": [
            {"rows": p["numInputRows"], "ms": p["durationMs"]["triggerExecution"]} for p in batches
        ],
        "sustained_rows_per_s": round(steady_rows / steady_s) if steady_s else None,
        "driver_peak_rss_mib": peak_rss,
        "messages_bytes": data_bytes(settings.table_path("messages")),
    }


def data_bytes(table: LakePath) -> int | None:
    """The bytes of a local table's data files (the bench only appends: every file is live);
    None for a table in a bucket."""
    if not isinstance(table, Path):
        return None
    return sum(f.stat().st_size for f in table.rglob("*.parquet") if "_delta_log" not in f.parts)


def main(argv: list[str] | None = None) -> int:
    from streaming.settings import PipelineSettings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument(
        "--max-records-per-batch",
        type=int,
        default=200_000,
        help="records per micro-batch (default 200,000, this bench's since issue 2, so its "
        f"figures compare across sessions; the pipeline's own default is "
        f"{PipelineSettings().max_records_per_batch:,})",
    )
    parser.add_argument(
        "--lake",
        choices=("local", "s3", "both"),
        default="local",
        help="a local lake, one in a bucket of a moto server, or both in turn (default local)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each lake this many times, alternating, each into a new lake (the first "
        "run of a session also warms the JVM up: compare the later ones)",
    )
    parser.add_argument("--workdir", type=Path, help="keep data here (default: a temp dir)")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from streaming.session import build_spark, stop_spark

    work = args.workdir or Path(tempfile.mkdtemp(prefix="edgebus-bench-pipeline-"))
    try:
        settings = PipelineSettings(
            data_dir=work / "data",
            lake=work / "lake",
            max_records_per_batch=args.max_records_per_batch,
        )
        started = time.perf_counter()
        write_journals(settings.journal_root, args.records, args.nodes)
        written = args.records // args.nodes * args.nodes
        print(f"journal: {written} records in {time.perf_counter() - started:.1f} s", flush=True)
        # On disk before the clock starts, as an edge's fsync'd journal is: otherwise the
        # kernel writes the journals back (~1 GB for 4M records) during the timed run, 30 s
        # after they were written, and the figure measures that too.
        synced = time.perf_counter()
        os.sync()
        print(f"journal synced in {time.perf_counter() - synced:.1f} s", flush=True)
        runs: list[dict[str, Any]] = []
        with contextlib.ExitStack() as stack:
            lakes: list[LakePath] = []
            options = stack.enter_context(s3_server(BUCKET)) if args.lake != "local" else None
            for run in range(args.repeat):
                if args.lake != "s3":
                    lakes.append(work / f"lake-{run}")
                if options is not None:
                    lakes.append(ObjectPath(BUCKET, f"lake-{run}", options))
            spark = build_spark(dataclasses.replace(settings, lake=lakes[-1]))
            try:
                for lake in lakes:
                    runs.append(timed_run(spark, dataclasses.replace(settings, lake=lake), written))
                    print(json.dumps(runs[-1]), flush=True)
            finally:
                stop_spark(spark)
        result: dict[str, Any] = {
            "benchmark": "pipeline journal->delta",
            "records": written,
            "nodes": args.nodes,
            "payload_bytes": 200,
            "max_records_per_batch": args.max_records_per_batch,
            **(runs[0] if len(runs) == 1 else {"runs": runs}),
        }
        report(result, "pipeline")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
