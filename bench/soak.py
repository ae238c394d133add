"""Soak: an edge and the pipeline for minutes at a steady QoS 1 rate, retention at 0 h (issue 9).

    python -m bench.soak --rate 10000 --minutes 10

Starts ``edgebus edge`` (tenants file with an operator token; ``journal_retention_hours = 0``;
``--segment-bytes`` per segment) and ``edgebus pipeline`` (``--tenants``, ``--broker`` that
edge) as processes, then ``bench.loadgen`` publishers send QoS 1 (MQTT 3.1.1, the tenant's
token as user name) at ``--rate`` msgs/s for ``--minutes``. Every ``--sample-interval``
seconds it records: the journal's bytes on disk and segment count, the edge's RSS, the
pipeline's RSS (its Python driver and the JVM it starts, summed), the edge's durable seq, the
seq the lake has committed (the pipeline checkpoint's newest committed batch), and the lag
between the two (records). At the end it waits for the pipeline to catch up and checks that
every acknowledged publish is in ``messages`` exactly once (by ``(node, seq)``).

Retention needs the lake's notice on ``$control/journal/{node}``
(``sinks.mqtt.DecisionPublisher.publish_committed``). ``--notices pipeline`` (the default)
waits for the pipeline to send it (it does after each batch Spark has marked done);
``--notices bench`` has this bench send it instead, with the same publisher and the operator
token, from the same committed offset: the checkpoint's newest committed batch (Spark writes
``commits/N`` once every table of batch N is written). Results: bench/results/{time}-soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import BenchError, brokers, compare, loadgen
from streaming.settings import PipelineSettings

NODE = "soak"
OPERATOR_TOKEN = "soak-operator"
DEVICE_TOKEN = "soak-device"
TOPIC = "fleet/soak-{}/telemetry"
# The steady state's window: the load's last ten minutes, reported for a load of twice that.
STEADY_WINDOW_S = 600.0

TENANTS = f"""
[operator]
token = "{OPERATOR_TOKEN}"

[tenants.fleet]
tokens = ["{DEVICE_TOKEN}"]
"""


def committed_offsets(checkpoint: Path) -> dict[str, int]:
    """The source offset of the newest batch the pipeline committed ({} before the first)."""
    try:
        ids = [int(n) for n in os.listdir(checkpoint / "commits") if n.isdigit()]
    except FileNotFoundError:
        return {}
    if not ids:
        return {}
    lines = (checkpoint / "offsets" / str(max(ids))).read_text().splitlines()
    merged: dict[str, int] = {}
    for line in lines[2:]:
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            for node, seq in value.items():
                if isinstance(seq, int):
                    merged[node] = max(merged.get(node, 0), seq)
    return merged


def tree_memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` and all its descendants, summed. The RSS sum counts the pages a
    forked process shares with its parent once per process (Spark forks its Python workers
    from a daemon); the PSS sum counts each page once, split between its sharers."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    rss = pss = 0
    todo = [pid]
    while todo:
        current = todo.pop()
        rss += brokers.rss_kib(current) or 0
        pss += pss_kib(current)
        todo.extend(children.get(current, []))
    return rss, pss


def pss_kib(pid: int) -> int:
    """The proportional set size of ``pid`` (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def journal_disk(node_dir: Path) -> tuple[int, int]:
    """(bytes, segments) of the node's segment files."""
    sizes = []
    for path in node_dir.glob("*.seg"):
        try:
            sizes.append(path.stat().st_size)
        except FileNotFoundError:
            continue  # removed by retention since the glob
    return sum(sizes), len(sizes)


class Sampler(threading.Thread):
    def __init__(
        self, args: argparse.Namespace, edge: brokers.BrokerProcess, pipe: subprocess.Popen[bytes]
    ) -> None:
        super().__init__(name="sampler", daemon=True)
        from sinks.mqtt import DecisionPublisher

        self.args = args
        self.edge = edge
        self.pipe = pipe
        self.node_dir = args.work / "data" / "journal" / NODE
        self.checkpoint = args.work / "lake" / "_checkpoints" / "journal"
        self.publisher = DecisionPublisher([(edge.host, edge.port)], OPERATOR_TOKEN)
        self.samples: list[dict[str, Any]] = []
        self.notices = 0
        self.stop = threading.Event()
        self.started = time.monotonic()

    def committed(self) -> int:
        return committed_offsets(self.checkpoint).get(NODE, 0)

    def run(self) -> None:
        from ingest.journal import read_durable_seq

        sent = 0
        next_sample = self.started
        while not self.stop.wait(1.0):
            committed = self.committed()
            notify = self.args.notices == "bench" and committed > sent
            if notify and not self.publisher.publish_committed(NODE, committed):
                sent = committed
                self.notices += 1
            now = time.monotonic()
            if now < next_sample:
                continue
            next_sample += self.args.sample_interval
            disk, segments = journal_disk(self.node_dir)
            durable = read_durable_seq(self.node_dir) or 0
            pipeline_rss, pipeline_pss = tree_memory_kib(self.pipe.pid)
            sample = {
                "t_s": round(now - self.started, 1),
                "journal_bytes": disk,
                "segments": segments,
                "edge_rss_kib": brokers.rss_kib(self.edge.pid),
                "pipeline_rss_kib": pipeline_rss,
                "pipeline_pss_kib": pipeline_pss,
                "durable_seq": durable,
                "committed_seq": committed,
                "lag_records": durable - committed,
                "messages_log_entries": log_entries(self.args.work / "lake" / "messages"),
            }
            self.samples.append(sample)
            print(  # a benchmark's progress line
                f"{sample['t_s']:7.1f}s disk {disk / 2**20:7.1f} MiB in {segments:3d} segments  "
                f"edge {sample['edge_rss_kib'] / 1024:6.1f} MiB  pipeline "
                f"{pipeline_rss / 1024:7.1f} MiB (PSS {pipeline_pss / 1024:7.1f})  "
                f"lag {durable - committed:8d}  messages' log {sample['messages_log_entries']:6d}",
                flush=True,
            )


def log_entries(table: Path) -> int:
    """How many entries the table's ``_delta_log`` holds (0 before the table exists)."""
    try:
        return len(os.listdir(table / "_delta_log"))
    except FileNotFoundError:
        return 0


def lake_check(lake: Path, acked: int) -> dict[str, Any]:
    """Rows of the load in ``messages``: how many, how many distinct (node, seq)."""
    from sinks.delta import read_table  # DataFusion: to_pyarrow_table can abort the exit

    table = read_table(lake / "messages", "topic LIKE 'fleet/soak-%'", ["node", "seq"])
    load = list(zip(table.column("node").to_pylist(), table.column("seq").to_pylist(), strict=True))
    return {
        "acked": acked,
        "rows": len(load),
        "distinct": len(set(load)),
        "ok": len(load) == len(set(load)) == acked,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    work: Path = args.work
    (work / "data").mkdir(parents=True)
    tenants = work / "tenants.toml"
    tenants.write_text(TENANTS)
    config = work / "soak.toml"
    config.write_text(
        "[edge]\n"
        "journal_retention_hours = 0.0\n"
        f"journal_segment_bytes = {args.segment_bytes}\n"
        "[pipeline]\n"
        f"trigger_interval_seconds = {args.trigger_interval}\n"
        "quality_interval_seconds = 0.0\n"
        f"delta_log_retention_hours = {args.delta_log_retention_hours}\n"
    )
    edge = brokers.start_edgebus(
        work / "data", node_id=NODE, extra_args=["--config", str(config), "--tenants", str(tenants)]
    )
    pipe_log = (work / "pipeline.log").open("ab")
    pipe = subprocess.Popen(
        [sys.executable, "-m", "edgebus.cli", "pipeline", "--data-dir", str(work / "data")]
        + ["--lake", str(work / "lake"), "--config", str(config), "--tenants", str(tenants)]
        + ["--broker", f"{edge.host}:{edge.port}"],
        stdout=pipe_log,
        stderr=subprocess.STDOUT,
        cwd=brokers.REPO_ROOT,
    )
    sampler = Sampler(args, edge, pipe)
    result: dict[str, Any] = {}
    try:
        sampler.start()
        options = loadgen.LoadOptions(
            qos=1,
            duration=args.minutes * 60,
            rate=args.rate,
            payload_size=args.payload,
            window=64,
            pub_procs=1,
            e2e_window=None,
            drain_timeout=120,
            username=DEVICE_TOKEN,
        )
        pubs = [(f"soak-{i}", TOPIC.format(i)) for i in range(args.publishers)]
        load = loadgen.run_clients(
            loadgen.Target(edge.host, edge.port, edge.pid), options, pubs, []
        )
        result["load"] = {k: load.get(k) for k in ("sent", "acked", "send_s", "msgs_per_s")}
        print(f"load done: {load.get('acked')} acked of {load.get('sent')} sent", flush=True)
        deadline = time.monotonic() + args.catch_up_timeout
        from ingest.journal import read_durable_seq

        node_dir = work / "data" / "journal" / NODE
        while sampler.committed() < (read_durable_seq(node_dir) or 0) - 50:
            if time.monotonic() > deadline or pipe.poll() is not None:
                raise BenchError("the pipeline did not catch up")
            time.sleep(1.0)
        time.sleep(2 * args.sample_interval)  # retention after the last notice
        result["lake"] = lake_check(work / "lake", int(load.get("acked") or 0))
    finally:
        sampler.stop.set()
        sampler.join(10)
        pipe.send_signal(signal.SIGTERM)
        try:
            pipe.wait(120)
        except subprocess.TimeoutExpired:
            pipe.kill()
        edge.stop()
        edge.cleanup()
    result["samples"] = sampler.samples
    result["notices_sent_by_bench"] = sampler.notices
    return result


def summarize(samples: list[dict[str, Any]], load_s: float) -> dict[str, Any]:
    """Each figure's spread, and the memory's trend: over the second half of the samples, and
    over the load's last :data:`STEADY_WINDOW_S` when the load lasted twice that (the
    pipeline's JVM compiles for its first minutes: the window shows the steady state after
    that warm-up; None for a shorter run)."""

    def stat(key: str) -> dict[str, float]:
        values = [s[key] for s in samples if s.get(key) is not None]
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    keys = (
        "journal_bytes",
        "segments",
        "edge_rss_kib",
        "pipeline_rss_kib",
        "pipeline_pss_kib",
        "messages_log_entries",
    )
    # Only after a warm-up as long as the window: a shorter run's window would hold the start.
    warm = load_s >= 2 * STEADY_WINDOW_S
    steady = [s for s in samples if load_s - STEADY_WINDOW_S <= s["t_s"] <= load_s] if warm else []
    return {k: stat(k) for k in keys} | {
        "lag_records": stat("lag_records"),
        # The trend of the second half of the run (after the start-up catch-up and warm-up).
        "second_half_mib_per_min": {
            k: slope_mib_per_min(samples[len(samples) // 2 :], k)
            for k in ("edge_rss_kib", "pipeline_pss_kib")
        },
        "last_10_minutes_of_load_mib_per_min": {
            k: slope_mib_per_min(steady, k) for k in ("edge_rss_kib", "pipeline_pss_kib")
        },
    }


def slope_mib_per_min(samples: list[dict[str, Any]], key: str) -> float | None:
    """The least-squares slope of ``key`` (KiB) over time, in MiB per minute."""
    points = [(s["t_s"], s[key]) for s in samples if s.get(key) is not None]
    if len(points) < 2:
        return None
    slope = statistics.linear_regression(*zip(*points, strict=True)).slope  # KiB per second
    return round(slope * 60 / 1024, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10_000.0, help="QoS 1 msgs/s in total")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--publishers", type=int, default=4)
    parser.add_argument("--payload", type=int, default=300, help="bytes per publish")
    parser.add_argument("--segment-bytes", type=int, default=16 * 2**20)
    parser.add_argument("--trigger-interval", type=float, default=1.0)
    parser.add_argument("--sample-interval", type=float, default=10.0)
    parser.add_argument(
        "--delta-log-retention-hours",
        type=float,
        default=PipelineSettings().delta_log_retention_hours,
        help="pipeline setting: how long each table's Delta log keeps a commit",
    )
    parser.add_argument("--catch-up-timeout", type=float, default=300.0)
    parser.add_argument("--notices", choices=("bench", "pipeline"), default="pipeline")
    parser.add_argument("--work", type=Path, help="work dir (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    parser.add_argument("--output-dir", type=Path, default=compare.RESULTS_DIR)
    args = parser.parse_args(argv)
    temporary = args.work is None
    if temporary:
        args.work = Path(tempfile.mkdtemp(prefix="soak-"))
    started = datetime.now(UTC)
    try:
        result = run(args)
    finally:
        if temporary and not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    result["summary"] = summarize(result["samples"], args.minutes * 60)
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    result["machine"] = compare.machine_info()
    result["started"] = started.isoformat()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    out = args.output_dir / f"{started.strftime('%Y%m%dT%H%M%SZ')}-soak.json"
    out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({"summary": result["summary"], "lake": result.get("lake")}, indent=2))
    print(f"results: {out}")
    return 0 if result.get("lake", {}).get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
