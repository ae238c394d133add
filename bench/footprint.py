"""Start-up footprint of an edge, side by side with Mosquitto and the null sink (issue 9).

    python -m bench.footprint --runs 5

For each broker, ``--runs`` times: start the process, poll its port every 2 ms until it
accepts a TCP connection (**start → listening**, wall time from ``Popen``), then read its
resident memory (VmRSS) at once and after ``--settle`` seconds idle (**RSS at start**).
edgebus runs as ``python -m edgebus.cli edge`` with its shipped defaults (journal on, fsync);
the null sink (``bench.sink``) is the floor: a bare Python + uvloop server. Prints a table of
medians and writes one JSON to bench/results/{time}-footprint.json. Per idle connection: see
``python -m bench.suite --cases idle``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import brokers, compare

TARGETS = {"start_s": 0.3, "rss_mib": 40.0}


def _argv(name: str, port: int, data_dir: Path, conf: Path) -> list[str]:
    host = brokers.HOST
    if name == "mosquitto":
        conf.write_text(brokers.MOSQUITTO_CONFIG.format(port=port, host=host))
        return [brokers.MOSQUITTO, "-c", str(conf)]
    if name == "edgebus":
        return [sys.executable, "-m", "edgebus.cli", "edge", "--listen", f"{host}:{port}"] + [
            "--data-dir",
            str(data_dir),
            "--node-id",
            "footprint",
        ]
    return [sys.executable, "-m", "bench.sink", "--listen", f"{host}:{port}"]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((brokers.HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def measure(name: str, settle: float) -> dict[str, Any]:
    """One start of ``name``: seconds to listening, RSS (KiB) then and after ``settle``."""
    with tempfile.TemporaryDirectory(prefix=f"footprint-{name}-") as tmp:
        workdir = Path(tmp)
        port = brokers.free_port()
        argv = _argv(name, port, workdir / "data", workdir / "mosquitto.conf")
        started = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=brokers.REPO_ROOT,
        )
        try:
            while not _accepts(port):
                if proc.poll() is not None or time.monotonic() - started > 30:
                    raise brokers.BrokerError(f"{name} did not start ({proc.returncode})")
                time.sleep(0.002)
            start_s = time.monotonic() - started
            rss_listening = brokers.rss_kib(proc.pid)
            time.sleep(settle)
            rss_settled = brokers.rss_kib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
    return {"start_s": start_s, "rss_listening_kib": rss_listening, "rss_kib": rss_settled}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds idle before RSS")
    parser.add_argument("--brokers", default="mosquitto,edgebus,null")
    parser.add_argument("--output-dir", type=Path, default=compare.RESULTS_DIR)
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {}
    for name in args.brokers.split(","):
        results[name] = [measure(name, args.settle) for _ in range(args.runs)]
    rows = ["| broker | start → listening (median, max) | RSS at start (median, max) |"]
    rows.append("| --- | ---: | ---: |")
    summary: dict[str, dict[str, float]] = {}
    for name, runs in results.items():
        starts = [r["start_s"] for r in runs]
        rss = [r["rss_kib"] / 1024 for r in runs if r["rss_kib"] is not None]
        summary[name] = {
            "start_s_median": statistics.median(starts),
            "start_s_max": max(starts),
            "rss_mib_median": statistics.median(rss),
            "rss_mib_max": max(rss),
        }
        s = summary[name]
        rows.append(
            f"| {name} | {s['start_s_median']:.3f} s, {s['start_s_max']:.3f} s "
            f"| {s['rss_mib_median']:.1f} MiB, {s['rss_mib_max']:.1f} MiB |"
        )
    print("\n".join(rows))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.output_dir / f"{stamp}-footprint.json"
    doc = {"targets": TARGETS, "summary": summary, "runs": results, "args": vars(args)}
    out.write_text(json.dumps(doc, indent=2, default=str))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
