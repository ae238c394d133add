"""Publish → visible in ``messages``: per-row latency at a steady publish rate.

    python -m bench.latency --rate 10000 --duration 60 --warmup 10 --trigger-interval 0.5

Starts ``edgebus edge`` as a process (shipped defaults: journal fsync group commit, QoS 1
acknowledged once journaled) on a free port with its own data dir, and the pipeline in this
process (``streaming.pipeline.start`` on a local Spark session, one journal query feeding every
table step; the quality and maintenance schedules do not run). A short warm-up publish waits
for Spark's first batch, then ``bench.loadgen`` publishers send QoS 1 at a steady total rate
for ``warmup + duration`` seconds, and the bench waits until ``messages`` holds every
acknowledged publish.

Times, one clock (wall time of this machine):

- published: the journal record's ``ts``, stamped by the edge when it took the PUBLISH (the
  PUBACK follows once the record is durable). The generator's own send time is in each
  payload too (``bench.wire`` stamp, CLOCK_MONOTONIC mapped to wall time), which gives the
  send → edge component separately.
- visible: the ``commitInfo.timestamp`` of the Delta version whose ``add`` action brought the
  row's file into ``messages`` (``_delta_log/{version}.json``); each added parquet file is
  read with pyarrow.parquet. The log file's mtime (when the commit became readable) is
  reported next to it.

Latency per row = visible - published. Rows published in the first ``warmup`` seconds of the
load are left out (the pipeline settling into the rate). Payloads are the generator's
``payload`` bytes (stamp + padding): it pre-encodes its PUBLISH packets, so they are not JSON;
over MQTT 3.1.1 there is no content type, so the pipeline's JSON contract would not look into
a JSON payload either, and a row costs the pipeline the same either way.

Where the time goes is reported per Spark batch (Spark's progress reports joined to the Delta
commits through the history step's app transaction, whose version is the batch id): the wait
from a row's publish to the start of the trigger that took it, and the start of that trigger to
the commit. On a shared 2-core machine every figure moves with the other programs' load, which
is sampled and written into the results. Results: bench/results/{timestamp}-latency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench import BenchError, brokers, loadgen
from bench.compare import RESULTS_DIR, background_cores, machine_info, write_report
from bench.pipeline import count_rows

HISTORY_APP_ID = "edgebus.history"  # streaming.history.APP_ID: its app transaction = batch id
LOAD_TOPIC = "fleet/veh-{:05d}/telemetry"
WARMUP_TOPIC = "fleet/warmup/{:05d}"


@dataclass(frozen=True)
class Commit:
    """One Delta version: when it was committed and the data files it added."""

    version: int
    timestamp_ms: int  # commitInfo.timestamp
    visible_ns: int  # the log file's mtime: when readers could first see the version
    write_ms: int | None  # delta-rs's operationMetrics.execution_time_ms (files + commit)
    added: tuple[str, ...]  # data files added with dataChange, relative to the table
    batch: int | None  # the version of `app_id`'s app transaction in this commit


def read_commits(table: Path, app_id: str = HISTORY_APP_ID) -> list[Commit]:
    """Every JSON commit of the Delta table at ``table``, oldest first.

    ``add`` paths are relative URIs (partition values percent-encoded), so they are unquoted.
    Files added without ``dataChange`` (compaction) bring no new rows and are left out.
    """
    log = table / "_delta_log"
    commits = []
    for path in sorted(log.glob("*.json")):
        if not path.stem.isdigit():
            continue
        timestamp: int | None = None
        write_ms = None
        added: list[str] = []
        batch = None
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            action = json.loads(line)
            if "commitInfo" in action:
                info = action["commitInfo"]
                timestamp = int(info["timestamp"])
                write_ms = info.get("operationMetrics", {}).get("execution_time_ms")
            elif "add" in action and action["add"].get("dataChange", True):
                added.append(unquote(action["add"]["path"]))
            elif "txn" in action and action["txn"]["appId"] == app_id:
                batch = int(action["txn"]["version"])
        if timestamp is None:
            raise BenchError(f"{path}: no commitInfo timestamp")
        commits.append(
            Commit(
                int(path.stem),
                timestamp,
                path.stat().st_mtime_ns,
                write_ms,
                tuple(added),
                batch,
            )
        )
    return commits


def visible_rows(
    table: Path, commits: Iterable[Commit], columns: Iterable[str] = ("ts",)
) -> pa.Table:
    """The rows each commit added (``columns`` of its files) with ``version``, ``batch``,
    ``committed_us`` (commitInfo.timestamp), ``visible_us`` (log mtime) and ``latency_us``
    (committed_us - ts). ``ts`` is always read."""
    names = list(dict.fromkeys(["ts", *columns]))
    parts = []
    for commit in commits:
        for added in commit.added:
            rows = pq.read_table(table / added, columns=names)
            n = rows.num_rows
            rows = rows.append_column("version", pa.array([commit.version] * n, pa.int64()))
            rows = rows.append_column("batch", pa.array([commit.batch] * n, pa.int64()))
            rows = rows.append_column(
                "committed_us", pa.array([commit.timestamp_ms * 1000] * n, pa.int64())
            )
            rows = rows.append_column(
                "visible_us", pa.array([commit.visible_ns // 1000] * n, pa.int64())
            )
            parts.append(rows)
    if not parts:
        raise BenchError(f"{table}: no rows were added")
    rows = pa.concat_tables(parts)
    ts_us = pc.cast(rows.column("ts"), pa.int64())
    return rows.append_column("latency_us", pc.subtract(rows.column("committed_us"), ts_us))


def percentiles_ms(values_us: pa.ChunkedArray | pa.Array) -> dict[str, Any]:
    """p50/p90/p99/max in ms (nearest rank, like the load generator's latency samples)."""
    return loadgen._percentiles([v * 1000 for v in values_us.to_pylist()])


def send_times_us(payloads: pa.ChunkedArray, mono_to_wall_ns: int) -> pa.Array:
    """The generator's send time (wall clock, µs) from each payload's ``bench.wire`` stamp."""
    stamps = pc.binary_slice(payloads.combine_chunks(), 0, 8)
    fixed = stamps.cast(pa.binary(8))
    import numpy as np

    mono = np.frombuffer(fixed.buffers()[1], dtype=">u8", count=len(fixed)).astype(np.int64)
    return pa.array((mono + mono_to_wall_ns) // 1000)


class ProgressLog:
    """Spark's progress reports of a query, kept by batch id (``recentProgress`` only holds the
    last 100), polled from a thread."""

    def __init__(self, query: Any, every_s: float = 2.0) -> None:
        self.query = query
        self.every_s = every_s
        self.batches: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()

    def poll(self) -> None:
        for progress in self.query.recentProgress:
            doc = json.loads(progress.json)
            self.batches[int(doc["batchId"])] = doc

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()


def wait_for_rows(table: Path, rows: int, timeout: float) -> float:
    """Poll until the Delta table at ``table`` holds ``rows`` rows; return the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        # Spark makes the log's directory before its first commit is in it.
        if any((table / "_delta_log").glob("*.json")) and count_rows(table) >= rows:
            return time.monotonic() - started
        time.sleep(0.5)
    raise BenchError(f"{table}: fewer than {rows} rows after {timeout:g} s")


def publish(
    edge: brokers.BrokerProcess, topic: str, options: loadgen.LoadOptions, publishers: int
) -> dict[str, Any]:
    """Publish with ``publishers`` generator connections, connection i on ``topic.format(i)``."""
    pubs = [(f"bench-latency-{i}", topic.format(i)) for i in range(publishers)]
    target = loadgen.Target(edge.host, edge.port, edge.pid)
    return loadgen.run_clients(target, options, pubs, [])


def batch_breakdown(
    rows: pa.Table, commits: Iterable[Commit], progress: dict[int, dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per batch of ``rows``: its rows, Spark's durations, and the three parts of a row's
    latency: waiting for the trigger that took it (mean over its rows), the trigger's start to
    the ``messages`` write (reading the journal, collecting the batch as Arrow, the contracts),
    and the write itself (parquet files and commit, delta-rs's execution time); with medians
    over the batches."""
    by_batch = {commit.batch: commit for commit in commits if commit.batch is not None}
    per_batch = []
    for batch in sorted(set(rows.column("batch").to_pylist()) - {None}):
        mine = rows.filter(pc.equal(rows.column("batch"), batch))
        ts_us = pc.cast(mine.column("ts"), pa.int64())
        commit = by_batch[batch]
        committed_us = commit.timestamp_ms * 1000
        entry: dict[str, Any] = {
            "batch": batch,
            "rows": mine.num_rows,
            "latency_ms_max": (committed_us - pc.min(ts_us).as_py()) / 1000,
            "latency_ms_min": (committed_us - pc.max(ts_us).as_py()) / 1000,
            "write_ms": commit.write_ms,
        }
        report = progress.get(batch)
        if report is not None:
            started = datetime.fromisoformat(report["timestamp"].replace("Z", "+00:00"))
            started_us = int(started.timestamp() * 1_000_000)
            entry |= {
                "input_rows": report["numInputRows"],  # the whole batch, every table's rows
                "wait_ms_mean": (started_us - pc.mean(ts_us).as_py()) / 1000,
                "start_to_commit_ms": (committed_us - started_us) / 1000,
                "duration_ms": report["durationMs"],
            }
            if commit.write_ms is not None:
                entry["start_to_write_ms"] = entry["start_to_commit_ms"] - commit.write_ms
        per_batch.append(entry)

    def median(key: str, sub: str | None = None) -> float | None:
        values = [
            (b[key][sub] if sub else b[key])
            for b in per_batch
            if b.get(key) is not None and (sub is None or sub in b[key])
        ]
        return round(statistics.median(values), 1) if values else None

    summary = {
        "batches": len(per_batch),
        "rows_per_batch_median": median("rows"),
        "wait_for_trigger_ms_median": median("wait_ms_mean"),
        "trigger_start_to_write_ms_median": median("start_to_write_ms"),
        "messages_write_ms_median": median("write_ms"),
        "trigger_start_to_commit_ms_median": median("start_to_commit_ms"),
        "spark_duration_ms_median": {
            key: median("duration_ms", key)
            for key in ("triggerExecution", "latestOffset", "queryPlanning", "addBatch")
        },
    }
    return per_batch, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10_000.0, help="total publishes per second")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load not measured")
    parser.add_argument("--qos", type=int, choices=(0, 1), default=1)
    parser.add_argument("--publishers", type=int, default=4, help="MQTT connections")
    parser.add_argument("--window", type=int, default=64, help="QoS 1 in flight per connection")
    parser.add_argument("--payload", type=int, default=200, help="payload bytes")
    parser.add_argument("--trigger-interval", type=float, default=0.5, help="pipeline setting")
    parser.add_argument("--max-records-per-batch", type=int, default=None, help="pipeline")
    parser.add_argument(
        "--others-interval", type=float, default=None, help="pipeline (default: its default)"
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="wait for the last rows")
    parser.add_argument("--workdir", type=Path, help="keep data and logs here (default: temp)")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from streaming import pipeline
    from streaming.history import APP_ID
    from streaming.session import build_spark
    from streaming.settings import PipelineSettings

    assert APP_ID == HISTORY_APP_ID
    work = args.workdir or Path(tempfile.mkdtemp(prefix="edgebus-bench-latency-"))
    work.mkdir(parents=True, exist_ok=True)
    defaults = PipelineSettings()
    settings = PipelineSettings(
        data_dir=work / "data",
        lake=work / "lake",
        trigger_interval_seconds=args.trigger_interval,
        max_records_per_batch=args.max_records_per_batch or defaults.max_records_per_batch,
        others_interval_seconds=(
            defaults.others_interval_seconds
            if args.others_interval is None
            else args.others_interval
        ),
        quality_interval_seconds=0,
        maintenance_interval_seconds=0,
    )
    messages = settings.table_path("messages")
    background = background_cores()
    load_options = loadgen.LoadOptions(
        qos=args.qos,
        duration=args.warmup + args.duration,
        rate=args.rate,
        payload_size=args.payload,
        window=args.window,
        pub_procs=1,
        e2e_window=None,
    )
    warm_options = loadgen.LoadOptions(
        qos=args.qos, duration=5, count=100, payload_size=args.payload, pub_procs=1
    )
    edge = brokers.start_edgebus(settings.data_dir, node_id="bench")
    try:
        spark = build_spark(settings)
        try:
            query = pipeline.start(spark, settings)
            progress = ProgressLog(query)
            try:
                warm = publish(edge, WARMUP_TOPIC, warm_options, args.publishers)
                warm_s = wait_for_rows(messages, warm["sent"], args.timeout)
                print(f"pipeline warm: {warm['sent']} rows visible in {warm_s:.1f} s", flush=True)
                jvm = getattr(spark.sparkContext._gateway, "proc", None)
                pids = [os.getpid()] + ([jvm.pid] if jvm is not None else [])
                cpu0 = [brokers.cpu_seconds(pid) or 0.0 for pid in pids]
                busy0, _ = brokers.machine_cpu()
                mono_to_wall_ns = time.time_ns() - time.monotonic_ns()
                load = publish(edge, LOAD_TOPIC, load_options, args.publishers)
                print(
                    f"published {load['sent']} at {load['send_rate']:.0f}/s "
                    f"(acked {load['acked']})",
                    flush=True,
                )
                drain_s = wait_for_rows(messages, warm["sent"] + load["sent"], args.timeout)
                busy1, _ = brokers.machine_cpu()
                cpu1 = [brokers.cpu_seconds(pid) or 0.0 for pid in pids]
                if query.exception() is not None:
                    raise BenchError(f"the pipeline failed: {query.exception()}")
            finally:
                progress.stop()
                query.stop()
        finally:
            spark.stop()
    finally:
        edge.stop()
        edge_log = edge.log_summary()
        edge.cleanup()

    commits = read_commits(messages)
    rows = visible_rows(messages, commits, ("node", "seq", "topic", "payload"))
    load_rows = rows.filter(pc.starts_with(rows.column("topic"), "fleet/veh-"))
    ts_us = pc.cast(load_rows.column("ts"), pa.int64())
    measured_from = pc.min(ts_us).as_py() + int(args.warmup * 1e6)
    measured = load_rows.filter(pc.greater_equal(ts_us, measured_from))
    unique = pa.Table.from_arrays(
        [load_rows.column("node"), load_rows.column("seq")], ["node", "seq"]
    ).group_by(["node", "seq"])
    distinct = unique.aggregate([]).num_rows
    sent_us = send_times_us(measured.column("payload"), mono_to_wall_ns)
    measured_ts = pc.cast(measured.column("ts"), pa.int64())
    per_batch, breakdown = batch_breakdown(measured, commits, progress.batches)
    wall = load["cpu"]["wall_s"] + drain_s
    now = datetime.now(UTC)
    result: dict[str, Any] = {
        "benchmark": "publish -> visible in messages",
        "rate_target_msgs_per_s": args.rate,
        "qos": args.qos,
        "publishers": args.publishers,
        "payload_bytes": args.payload,
        "published_at": "edge journal ts (edge wall clock when it took the PUBLISH)",
        "visible_at": "commitInfo.timestamp of the Delta version adding the row's file",
        "warmup_s": args.warmup,
        "measured_s": args.duration,
        "trigger_interval_s": settings.trigger_interval_seconds,
        "max_records_per_batch": settings.max_records_per_batch,
        "others_interval_s": settings.others_interval_seconds,
        "sent": load["sent"],
        "acked": load["acked"],
        "send_rate_msgs_per_s": round(load["send_rate"]),
        "rows_of_load": load_rows.num_rows,
        "distinct_node_seq": distinct,
        "loss": (load["acked"] if args.qos else load["sent"]) - load_rows.num_rows,
        "rows_measured": measured.num_rows,
        "latency_ms": percentiles_ms(measured.column("latency_us")),
        "latency_to_log_mtime_ms": percentiles_ms(
            pc.subtract(measured.column("visible_us"), measured_ts)
        ),
        "send_to_edge_ts_ms": percentiles_ms(pc.subtract(measured_ts, sent_us)),
        "send_to_visible_ms": percentiles_ms(pc.subtract(measured.column("committed_us"), sent_us)),
        "where_time_goes": breakdown,
        "per_batch": per_batch,
        "delta_versions": len(commits),
        "drain_after_publish_s": round(drain_s, 2),
        "cpu": {
            "background_cores_before": round(background, 2),
            "machine_busy_cores": round((busy1 - busy0) / wall, 2),
            "edge_cores": load["cpu"]["broker_cores"],
            # This process (the pipeline's Python driver and the generator's parent) and
            # the Spark JVM it started.
            "pipeline_python_cores": round((cpu1[0] - cpu0[0]) / wall, 2),
            "pipeline_jvm_cores": round((cpu1[1] - cpu0[1]) / wall, 2) if len(pids) > 1 else None,
            "generator_cores": load["cpu"]["publishers_cores"],
        },
        "edge_log_problems": edge_log["problems"],
        "loadavg": os.getloadavg(),
        "date": now.isoformat(timespec="seconds"),
        "timestamp_compact": f"{now:%Y%m%dT%H%M%SZ}",
        "machine": machine_info(),
    }
    summary = {k: v for k, v in result.items() if k not in ("per_batch", "machine")}
    print(json.dumps(summary, indent=2))
    print(f"results: {write_report(result, RESULTS_DIR, 'latency')}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
