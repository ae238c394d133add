"""Run one load scenario against several brokers in turn, with identical parameters.

    python -m bench.compare --scenario fanin --qos 0 --publishers 4 --duration 10 \\
        --brokers mosquitto,edgebus,null

Each broker is started on a free port of 127.0.0.1, driven by `bench.loadgen`, and stopped
before the next one starts, so they never compete for the CPU. The table shows the delivered
rate (msgs/s received over the receive window), latency percentiles, loss, and the CPU each
party used; `null` is the built-in sink, whose row is the generator's own ceiling (publisher
send rate, subscriber receive rate). Before each run the machine's background load is sampled
for a second: on a shared machine, other programs' CPU use skews every figure.

The full results, with machine information, go to bench/results/{timestamp}-{scenario}.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import BenchError, brokers, loadgen

log = logging.getLogger(__name__)

BROKERS = ("mosquitto", "edgebus", "null")
RESULTS_DIR = brokers.REPO_ROOT / "bench" / "results"


def machine_info() -> dict[str, Any]:
    model = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        import uvloop  # optional; the workers use it when present

        uvloop_version: str | None = getattr(uvloop, "__version__", None)
    except ImportError:  # pragma: no cover
        uvloop_version = None
    return {
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "uvloop": uvloop_version,
        "mosquitto": brokers.mosquitto_version(),
    }


def background_cores(seconds: float = 1.0) -> float:
    """CPU cores busy on the machine over `seconds` while nothing of ours runs."""
    busy0, _ = brokers.machine_cpu()
    time.sleep(seconds)
    busy1, _ = brokers.machine_cpu()
    return (busy1 - busy0) / seconds


@contextlib.contextmanager
def started(
    name: str,
    edgebus_data_dir: str | None,
    cpus: set[int] | None = None,
    edgebus_args: list[str] | None = None,
) -> Iterator[brokers.BrokerProcess]:
    if name == "mosquitto":
        with brokers.start_mosquitto(cpus=cpus) as broker:
            yield broker
    elif name == "null":
        with brokers.start_null_sink(blast=True, cpus=cpus) as broker:
            yield broker
    elif name == "edgebus":
        data_dir = edgebus_data_dir or tempfile.mkdtemp(prefix="bench-edgebus-data-")
        try:
            with brokers.start_edgebus(data_dir, cpus=cpus, extra_args=edgebus_args) as broker:
                yield broker
        finally:
            if edgebus_data_dir is None:
                shutil.rmtree(data_dir, ignore_errors=True)
    else:
        raise ValueError(f"unknown broker {name!r}; choose from {', '.join(BROKERS)}")


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    options = loadgen.options_from_args(args)
    cpus = sorted(os.sched_getaffinity(0))
    broker_cpus: set[int] | None = None
    if args.pin and len(cpus) >= 2:
        # The broker gets the first CPU to itself, the generator the rest, so neither can
        # take the other's core (on 2 CPUs: one core each).
        broker_cpus = {cpus[0]}
        options = replace(options, worker_cpus=tuple(cpus[1:]))
    background = background_cores()
    with started(name, args.edgebus_data_dir, broker_cpus, args.edgebus_arg) as broker:
        target = loadgen.Target(broker.host, broker.port, broker.pid, null=name == "null")
        result = loadgen.run_scenario(
            args.scenario,
            target,
            options,
            publishers=args.publishers,
            subscribers=args.subscribers,
        )
        result["broker_peak_rss_kib"] = brokers.peak_rss_kib(broker.pid)
    result["background_cores_before"] = background
    result["pinning"] = (
        None
        if broker_cpus is None
        else {"broker": sorted(broker_cpus), "workers": list(options.worker_cpus or ())}
    )
    return result


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(results: dict[str, dict[str, Any]]) -> str:
    header = (
        f"{'broker':<10} {'sent/s':>10} {'msgs/s':>10} {'p50 ms':>9} {'p99 ms':>9} "
        f"{'loss':>8} {'broker':>7} {'pubs':>6} {'subs':>6} {'machine':>8} {'bg':>5}  per-cpu"
    )
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:<10} ERROR: {r['error']}")
            continue
        cpu = r["cpu"]
        loss = "-" if r["loss"] is None else str(r["loss"])
        lines.append(
            f"{name:<10} {r['send_rate']:>10.0f} {r['msgs_per_s']:>10.0f} "
            f"{_ms(r['latency_ms']['p50']):>9} {_ms(r['latency_ms']['p99']):>9} {loss:>8} "
            f"{_cores(cpu['broker_cores']):>7} {_cores(cpu['publishers_cores']):>6} "
            f"{_cores(cpu['subscribers_cores']):>6} {_cores(cpu['machine_busy_cores']):>8} "
            f"{r['background_cores_before']:>5.2f}  "
            + "/".join(f"{v:.2f}" for v in (cpu["per_cpu_busy"] or {}).values())
        )
    lines.append(
        "sent/s: publishers' send rate; msgs/s: delivered over the receive window; "
        "broker/pubs/subs/machine: CPU cores used during the run; bg: busy cores before it; "
        "per-cpu: each CPU's busy share during the run."
    )
    return "\n".join(lines)


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ok = {name: r for name, r in results.items() if "error" not in r}
    summary: dict[str, Any] = {}
    if "edgebus" in ok and "mosquitto" in ok and ok["mosquitto"]["msgs_per_s"]:
        summary["edgebus_over_mosquitto_msgs_per_s"] = (
            ok["edgebus"]["msgs_per_s"] / ok["mosquitto"]["msgs_per_s"]
        )
    if "null" in ok:
        null = ok["null"]
        ceiling = {"publishers_send_rate": null["send_rate"], "subscribers_rx": null["msgs_per_s"]}
        summary["generator_ceiling"] = ceiling
        for name, r in ok.items():
            if name != "null" and r["msgs_per_s"]:
                summary[f"headroom_over_{name}"] = min(ceiling.values()) / r["msgs_per_s"]
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    if "edgebus_over_mosquitto_msgs_per_s" in summary:
        lines.append(
            f"edgebus/mosquitto msgs/s: {summary['edgebus_over_mosquitto_msgs_per_s']:.2f}"
        )
    if "generator_ceiling" in summary:
        c = summary["generator_ceiling"]
        lines.append(
            f"generator ceiling (null sink): publishers {c['publishers_send_rate']:.0f} msgs/s, "
            f"subscribers {c['subscribers_rx']:.0f} msgs/s"
        )
        for key, value in summary.items():
            if key.startswith("headroom_over_"):
                name = key.removeprefix("headroom_over_")
                lines.append(f"  {value:.1f}x the {name} rate")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description="Run one scenario against several brokers in turn and compare them.",
    )
    loadgen.add_load_arguments(parser)
    parser.add_argument(
        "--brokers", default="mosquitto,edgebus,null", help="comma-separated, run in this order"
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin the broker to the first CPU and the generator to the others (default: on)",
    )
    parser.add_argument("--edgebus-data-dir", help="default: a temporary directory")
    parser.add_argument(
        "--edgebus-arg",
        action="append",
        default=[],
        help="extra argument for `edgebus.cli edge`, repeatable (e.g. --edgebus-arg=--config "
        "--edgebus-arg=FILE to lift its per-session queue limits as Mosquitto's are)",
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    names = [n.strip() for n in args.brokers.split(",") if n.strip()]
    unknown = set(names) - set(BROKERS)
    if unknown:
        parser.error(f"unknown broker(s) {sorted(unknown)}; choose from {', '.join(BROKERS)}")

    results: dict[str, dict[str, Any]] = {}
    for name in names:
        log.info("running %s against %s", args.scenario, name)
        try:
            results[name] = run_one(name, args)
        except (BenchError, OSError) as exc:
            log.exception("%s failed", name)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    summary = summarize(results)

    now = datetime.now(UTC)
    report = {
        "timestamp": now.isoformat(),
        "argv": sys.argv if argv is None else argv,
        "scenario": args.scenario,
        "params": vars(args) | {"output_dir": str(args.output_dir)},
        "machine": machine_info(),
        "results": results,
        "summary": summary,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    out = args.output_dir / f"{now.strftime('%Y%m%dT%H%M%SZ')}-{args.scenario}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(
        f"\n{args.scenario} qos={args.qos} publishers={args.publishers} "
        f"duration={args.duration}s payload={args.payload}B rate={args.rate or 'max'}"
    )
    print(format_table(results))
    if args.qos == 0 and args.rate is None:
        print(
            "note: at QoS 0 and max rate, latency is mostly time queued in TCP buffers; "
            "use --rate for latency at a given load."
        )
    text = format_summary(summary)
    if text:
        print(text)
    print(f"results: {out}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
