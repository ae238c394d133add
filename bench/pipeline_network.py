"""Journal → Delta throughput with the journals local versus over the network, side by side.

    python -m bench.pipeline_network --records 400000 --nodes 2 --rounds 2

Writes the journals once (``bench.pipeline.write_journals``: ~200-byte telematics JSON), starts
one ``edgebus edge --http 127.0.0.1:0`` process per node on them (loopback: the pipeline shows
the edges the operator token they made in their data dir, as ``edgebus pipeline`` does), one
Spark session, and then per round runs the pipeline's journal query to caught-up twice, into a
fresh lake each time: reading the journal directories (``local``) and reading only the edges'
HTTP ports (``http``: the executors fetch Arrow IPC ranges from the edges). One uncounted run
warms the JVM first, and the order alternates between rounds. Figures as ``bench.pipeline``
(whole run and sustained rows/s); the ratio http/local is the result that travels (the machine is
shared: absolute numbers move with its load, which is reported before and after).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.compare import report
from bench.pipeline import timed_run, write_journals
from schemas import operator_token

Edge = tuple[subprocess.Popen[bytes], str]  # the process and its HTTP address


def start_edges(data_dir: Path, nodes: int, logs: Path) -> list[Edge]:
    edges = []
    for n in range(nodes):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edgebus.cli",
                "edge",
                *("--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"),
                *("--data-dir", str(data_dir), "--node-id", f"node-{n}"),
            ],
            stdout=subprocess.PIPE,
            stderr=(logs / f"edge-{n}.log").open("wb"),
        )
        assert proc.stdout is not None
        proc.stdout.readline()  # MQTT listening
        http = proc.stdout.readline().decode()
        assert " http on " in http, http
        edges.append((proc, http.rsplit(" ", 1)[1].strip()))
    return edges


def stop_edges(edges: list[Edge]) -> None:
    for proc, _ in edges:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=400_000)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--warmup", action=argparse.BooleanOptionalAction, default=True, help="one run first"
    )
    parser.add_argument("--max-records-per-batch", type=int, default=200_000)
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from streaming.session import build_spark
    from streaming.settings import PipelineSettings

    work = Path(tempfile.mkdtemp(prefix="edgebus-bench-network-"))
    edges: list[Edge] = []
    try:
        data = work / "data"
        write_journals(data / "journal", args.records, args.nodes)
        written = args.records // args.nodes * args.nodes
        edges = start_edges(data, args.nodes, work)
        token = operator_token.read(data)  # the edges made it before they answered
        addresses = tuple(address for _, address in edges)
        modes = {
            "local": {"data_dir": data},
            "http": {"data_dir": work / "no-local-journals", "edges": addresses},
        }
        load_before = os.getloadavg()
        spark = build_spark(PipelineSettings(lake=work / "lake"))
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        try:
            if args.warmup:  # the JVM's first query (code paths, JIT) counted in neither mode
                warm = PipelineSettings(lake=work / "lake-warmup", data_dir=data)
                print(f"warm-up (not counted): {timed_run(spark, warm, written)['seconds']} s")
            for round_ in range(args.rounds):
                order = list(modes) if round_ % 2 == 0 else list(reversed(modes))
                for mode in order:
                    settings = PipelineSettings(
                        lake=work / f"lake-{mode}-{round_}",
                        max_records_per_batch=args.max_records_per_batch,
                        **modes[mode],  # type: ignore[arg-type]
                    )
                    run = timed_run(spark, settings, written, edge_token=token)
                    runs[mode].append(run)
                    del run["batches"]
                    print(f"round {round_} {mode}: {run}", flush=True)
        finally:
            spark.stop()
        load_after = os.getloadavg()

        def median(mode: str, key: str) -> float:
            return float(statistics.median(r[key] for r in runs[mode] if r[key] is not None))

        summary = {
            mode: {key: median(mode, key) for key in ("rows_per_s", "sustained_rows_per_s")}
            for mode in modes
        }
        result: dict[str, Any] = {
            "benchmark": "pipeline journal->delta, local vs http",
            "records": written,
            "nodes": args.nodes,
            "payload_bytes": 200,
            "max_records_per_batch": args.max_records_per_batch,
            "warmup": args.warmup,
            "runs": runs,
            "median": summary,
            "http_over_local": {
                key: round(summary["http"][key] / summary["local"][key], 2)
                for key in ("rows_per_s", "sustained_rows_per_s")
            },
            "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in load_after],
        }
        report(result, "pipeline-network")
    finally:
        stop_edges(edges)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
