"""Run one load scenario against several brokers in turn, with identical parameters.

    python -m bench.compare --scenario fanin --qos 0 --publishers 4 --duration 10 \\
        --brokers mosquitto,edgebus,null
    python -m bench.compare --scenario pairs --qos 1 --publishers 4
    python -m bench.compare --scenario fanin --publishers 100
    python -m bench.compare --scenario fanout --subscribers 1000
    python -m bench.compare --scenario idle --connections 10000 --brokers mosquitto,edgebus

Like for like: Mosquitto runs with no per-client queue or in-flight limits
(`brokers.MOSQUITTO_CONFIG`), and edgebus by default with a generated config of equivalent
limits (`EDGEBUS_BENCH_CONFIG`: max_queued_messages = 1000000, max_inflight_messages = 65535,
journal on with fsync group commit); `--edgebus-config FILE` replaces it, `--edgebus-config
shipped` runs edgebus with its shipped defaults (1000 queued, 100 in flight). Both settings go
into the results.

Each broker is started on a free port of 127.0.0.1, driven by `bench.loadgen`, and stopped
before the next one starts, so they never compete for the CPU. The table shows the delivered
rate (msgs/s received over the receive window), latency percentiles, loss, and the CPU each
party used; `null` is the built-in sink, whose row is the generator's own ceiling (publisher
send rate, subscriber receive rate). Before each run the machine's background load is sampled
for a second: on a shared machine, other programs' CPU use skews every figure.

For `idle` the table shows the broker's resident memory per idle connection instead (see
`loadgen.idle`); the null sink's row there is the floor of a minimal Python/uvloop server.
The broker's log is scanned after it stops: lines that look like warnings or errors are
counted and kept in the results, with the log's tail.

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
import subprocess
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
SHIPPED = "shipped"  # --edgebus-config value: no config file, edgebus's own defaults
BENCH = "bench"  # --edgebus-config value: the generated EDGEBUS_BENCH_CONFIG (default)

EDGEBUS_BENCH_CONFIG = """\
# Written by bench.compare: per-session limits equivalent to Mosquitto's in bench/brokers.py
# (max_queued_messages 0 = unlimited, max_inflight_messages 0 = unlimited; max_queued_bytes
# stays at 16 MiB, the default the suite's figures were measured with before issue 10). The
# journal stays on with edgebus's default fsync group commit.
[edge]
journal_fsync = true
max_queued_messages = 1000000
max_queued_bytes = 16777216
max_inflight_messages = 65535
"""


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
        "edgebus_git": git_state(),
    }


def git_state() -> dict[str, Any] | None:
    """The commit the edgebus under test was built from, and whether its code had uncommitted
    changes (the broker code changes often; a figure belongs to a version)."""

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", *argv],
            cwd=brokers.REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--", "broker_edge", "edgebus")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"head": head, "uncommitted_broker_changes": bool(dirty)}


def background_cores(seconds: float = 1.0) -> float:
    """CPU cores busy on the machine over `seconds` while nothing of ours runs."""
    busy0, _ = brokers.machine_cpu()
    time.sleep(seconds)
    busy1, _ = brokers.machine_cpu()
    return (busy1 - busy0) / seconds


def broker_settings(name: str, edgebus_config: str | Path = BENCH) -> str | None:
    """The settings a broker runs with in `started()`, as text for the results."""
    if name == "mosquitto":
        return brokers.MOSQUITTO_CONFIG.split("\n", 1)[1]  # without the listener line
    if name == "edgebus":
        if edgebus_config == SHIPPED:
            return "edgebus shipped defaults (no --config)"
        if edgebus_config == BENCH:
            return EDGEBUS_BENCH_CONFIG
        return Path(edgebus_config).read_text()
    return None


@contextlib.contextmanager
def started(
    name: str,
    edgebus_data_dir: str | None,
    cpus: set[int] | None = None,
    edgebus_args: list[str] | None = None,
    edgebus_config: str | Path = BENCH,
    tls: brokers.TlsFiles | None = None,
) -> Iterator[brokers.BrokerProcess]:
    """Broker ``name`` running; with ``tls`` (certificate, key) its port speaks MQTT over TLS."""
    if tls is not None and name == "null":
        raise ValueError("the null sink does not speak TLS")
    if name == "mosquitto":
        with brokers.start_mosquitto(cpus=cpus, tls=tls) as broker:
            yield broker
    elif name == "null":
        with brokers.start_null_sink(blast=True, cpus=cpus) as broker:
            yield broker
    elif name == "edgebus":
        scratch = Path(tempfile.mkdtemp(prefix="bench-edgebus-data-"))
        data_dir = edgebus_data_dir or str(scratch / "data")
        extra = list(edgebus_args or [])
        if edgebus_config == BENCH:
            config = scratch / "edge.toml"
            config.write_text(EDGEBUS_BENCH_CONFIG)
            extra = ["--config", str(config), *extra]
        elif edgebus_config != SHIPPED:
            extra = ["--config", str(edgebus_config), *extra]
        try:
            with brokers.start_edgebus(data_dir, cpus=cpus, extra_args=extra, tls=tls) as broker:
                yield broker
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            os.sync()  # the removal's writes go now, not during the next broker's run
    else:
        raise ValueError(f"unknown broker {name!r}; choose from {', '.join(BROKERS)}")


def run_one(
    name: str,
    scenario: str,
    options: loadgen.LoadOptions,
    *,
    publishers: int = 4,
    subscribers: int = 4,
    connections: int = 10_000,
    pin: bool = True,
    edgebus_data_dir: str | None = None,
    edgebus_args: list[str] | None = None,
    edgebus_config: str | Path = BENCH,
    tls: bool = False,
) -> dict[str, Any]:
    """Start broker `name`, run the scenario against it, stop it; return the result with the
    broker's settings, memory, exit code and log findings added. With `tls` the broker serves
    MQTT over TLS with a certificate made for the run (bench.certs; every broker the same kind)
    and the generator verifies it."""
    cpus = sorted(os.sched_getaffinity(0))
    broker_cpus: set[int] | None = None
    if pin and len(cpus) >= 2:
        # The broker gets the first CPU to itself, the generator the rest, so neither can
        # take the other's core (on 2 CPUs: one core each).
        broker_cpus = {cpus[0]}
        options = replace(options, worker_cpus=tuple(cpus[1:]))
    background = background_cores()
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        tls_files: brokers.TlsFiles | None = None
        if tls:
            from bench.certs import make_certs  # cryptography: only for the TLS runs

            where = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-certs-"))
            certs = make_certs(Path(where))
            tls_files = (certs.server_cert, certs.server_key)
            options = replace(options, tls_ca=str(certs.ca))
        broker = stack.enter_context(
            started(name, edgebus_data_dir, broker_cpus, edgebus_args, edgebus_config, tls_files)
        )
        target = loadgen.Target(broker.host, broker.port, broker.pid, null=name == "null")
        rss_before = brokers.rss_kib(broker.pid)
        result = loadgen.run_scenario(
            scenario,
            target,
            options,
            publishers=publishers,
            subscribers=subscribers,
            connections=connections,
        )
        result["broker_rss_kib"] = {
            "before": rss_before,
            "after": brokers.rss_kib(broker.pid),
            "peak": brokers.peak_rss_kib(broker.pid),
        }
        result["broker_peak_rss_kib"] = result["broker_rss_kib"]["peak"]
        alive = broker.proc.poll() is None  # still running when the load ended
        result["broker_exit"] = {"alive_at_end": alive, "code": broker.stop()}
        result["broker_log"] = broker.log_summary()
    result["broker"] = name
    result["broker_settings"] = broker_settings(name, edgebus_config)
    result["tls"] = tls
    result["background_cores_before"] = background
    result["elapsed_s"] = time.monotonic() - t0
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


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"


def format_table(results: dict[str, dict[str, Any]]) -> str:
    if any(r.get("scenario") == "idle" for r in results.values()):
        return format_idle_table(results)
    header = (
        f"{'broker':<10} {'sent/s':>10} {'msgs/s':>10} {'p50 ms':>9} {'p99 ms':>9} "
        f"{'loss':>8} {'stall s':>7} {'broker':>7} {'pubs':>6} {'subs':>6} {'machine':>8} "
        f"{'bg':>5}  per-cpu"
    )
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:<10} ERROR: {r['error']}")
            continue
        cpu = r["cpu"]
        loss = "-" if r["loss"] is None else str(r["loss"])
        stall = (r.get("timeline") or {}).get("stall_max_s")
        lines.append(
            f"{name:<10} {r['send_rate']:>10.0f} {r['msgs_per_s']:>10.0f} "
            f"{_ms(r['latency_ms']['p50']):>9} {_ms(r['latency_ms']['p99']):>9} {loss:>8} "
            f"{_ms(stall):>7} "
            f"{_cores(cpu['broker_cores']):>7} {_cores(cpu['publishers_cores']):>6} "
            f"{_cores(cpu['subscribers_cores']):>6} {_cores(cpu['machine_busy_cores']):>8} "
            f"{r['background_cores_before']:>5.2f}  "
            + "/".join(f"{v:.2f}" for v in (cpu["per_cpu_busy"] or {}).values())
        )
    lines.append(
        "sent/s: publishers' send rate; msgs/s: delivered over the receive window; stall: "
        "longest gap with no delivery; broker/pubs/subs/machine: CPU cores used during the "
        "run; bg: busy cores before it; per-cpu: each CPU's busy share during the run."
    )
    return "\n".join(lines)


def format_idle_table(results: dict[str, dict[str, Any]]) -> str:
    header = (
        f"{'broker':<10} {'connected':>9} {'failed':>6} {'lost':>5} {'conn/s':>7} "
        f"{'RSS0 MiB':>8} {'RSS MiB':>8} {'KiB/conn':>8} {'closed':>7} {'us/conn':>7} "
        f"{'idle cores':>10} {'bg':>5}"
    )
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:<10} ERROR: {r['error']}")
            continue
        rss = r["rss_kib"]
        per = r["kib_per_connection"]
        cpu = r["cpu"]
        lines.append(
            f"{name:<10} {r['connected']:>9} {r['failed']:>6} {r['lost_during_hold']:>5} "
            f"{(r['connects_per_s'] or 0):>7.0f} {_mib(rss['before']):>8} "
            f"{_mib(rss['end_of_hold']):>8} {'-' if per is None else f'{per:.2f}':>8} "
            f"{_mib(rss['after_close']):>7} {_us(cpu['broker_us_per_connect']):>7} "
            f"{_cores(cpu['broker_cores']):>10} {r['background_cores_before']:>5.2f}"
        )
    lines.append(
        "KiB/conn: (RSS at the end of the hold - RSS before connecting) / connected; closed: "
        "RSS (MiB) after the clients disconnected; us/conn: broker CPU per accepted "
        "connection; idle cores: broker CPU while the connections sat idle."
    )
    return "\n".join(lines)


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ok = {name: r for name, r in results.items() if "error" not in r}
    summary: dict[str, Any] = {}
    if any(r.get("scenario") == "idle" for r in ok.values()):
        for name, r in ok.items():
            summary[f"kib_per_connection_{name}"] = r["kib_per_connection"]
        e, m = ok.get("edgebus"), ok.get("mosquitto")
        if e and m and e["kib_per_connection"] and m["kib_per_connection"]:
            summary["edgebus_over_mosquitto_kib_per_connection"] = (
                e["kib_per_connection"] / m["kib_per_connection"]
            )
        return summary
    if "edgebus" in ok and "mosquitto" in ok and ok["mosquitto"]["msgs_per_s"]:
        summary["edgebus_over_mosquitto_msgs_per_s"] = (
            ok["edgebus"]["msgs_per_s"] / ok["mosquitto"]["msgs_per_s"]
        )
    if "null" in ok:
        null = ok["null"]
        ceiling = {"publishers_send_rate": null["send_rate"], "subscribers_rx": null["msgs_per_s"]}
        summary["generator_ceiling"] = ceiling
        for name, r in ok.items():
            if name != "null" and r["msgs_per_s"] and r["send_rate"]:
                # Publishers against the sink's intake, subscribers against its flood (they
                # differ by the fan-out factor in `fanout`).
                summary[f"headroom_over_{name}"] = min(
                    ceiling["publishers_send_rate"] / r["send_rate"],
                    ceiling["subscribers_rx"] / r["msgs_per_s"],
                )
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    if "edgebus_over_mosquitto_msgs_per_s" in summary:
        lines.append(
            f"edgebus/mosquitto msgs/s: {summary['edgebus_over_mosquitto_msgs_per_s']:.2f}"
        )
    if "edgebus_over_mosquitto_kib_per_connection" in summary:
        lines.append(
            "edgebus/mosquitto KiB per idle connection: "
            f"{summary['edgebus_over_mosquitto_kib_per_connection']:.2f}"
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
                lines.append(f"  {value:.1f}x the {name} rates")
    return "\n".join(lines)


def format_log_findings(results: dict[str, dict[str, Any]]) -> str:
    """One line per broker whose log has warnings/errors, or that died during the run."""
    lines = []
    for name, r in results.items():
        exit_info = r.get("broker_exit") or {}
        if exit_info and not exit_info.get("alive_at_end", True):
            lines.append(f"{name}: broker had exited before the load ended: {exit_info}")
        found = r.get("broker_log") or {}
        if found.get("problem_lines"):
            lines.append(f"{name}: {found['problem_lines']} warning/error line(s) in its log, e.g.")
            lines.extend(f"    {line[:200]}" for line in found["problems"][:3])
    return "\n".join(lines)


def report(result: dict[str, Any], name: str) -> None:
    """Stamp ``result`` with the date and machine, print it, write it under bench/results."""
    now = datetime.now(UTC)
    result |= {
        "date": now.isoformat(timespec="seconds"),
        "timestamp_compact": f"{now:%Y%m%dT%H%M%SZ}",
        "machine": machine_info(),
    }
    print(json.dumps(result, indent=2))
    print(f"results: {write_report(result, RESULTS_DIR, name)}")


def write_report(report: dict[str, Any], output_dir: Path, name: str) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    out = output_dir / f"{report['timestamp_compact']}-{name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


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
        "--edgebus-config",
        default=BENCH,
        help=f"edgebus TOML config: {BENCH!r} (default) = queue limits equivalent to "
        f"Mosquitto's (max_queued_messages 1000000, max_inflight_messages 65535), "
        f"{SHIPPED!r} = edgebus's own defaults, or a file",
    )
    parser.add_argument(
        "--edgebus-arg",
        action="append",
        default=[],
        help="extra argument for `edgebus.cli edge`, repeatable",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="MQTT over TLS: every broker serves one certificate made for the run (not null)",
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    names = [n.strip() for n in args.brokers.split(",") if n.strip()]
    unknown = set(names) - set(BROKERS)
    if unknown:
        parser.error(f"unknown broker(s) {sorted(unknown)}; choose from {', '.join(BROKERS)}")
    if args.tls_ca:
        parser.error("--tls-ca is for a broker you started: here --tls makes the certificates")
    if args.tls and "null" in names:
        parser.error("the null sink does not speak TLS: leave it out of --brokers with --tls")
    options = loadgen.options_from_args(args)

    results: dict[str, dict[str, Any]] = {}
    for name in names:
        log.info("running %s against %s", args.scenario, name)
        try:
            results[name] = run_one(
                name,
                args.scenario,
                options,
                publishers=args.publishers,
                subscribers=args.subscribers,
                connections=args.connections,
                pin=args.pin,
                edgebus_data_dir=args.edgebus_data_dir,
                edgebus_args=args.edgebus_arg,
                edgebus_config=args.edgebus_config,
                tls=args.tls,
            )
        except (BenchError, OSError) as exc:
            log.exception("%s failed", name)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    summary = summarize(results)

    now = datetime.now(UTC)
    report = {
        "timestamp": now.isoformat(),
        "timestamp_compact": now.strftime("%Y%m%dT%H%M%SZ"),
        "argv": sys.argv if argv is None else argv,
        "scenario": args.scenario,
        "params": vars(args) | {"output_dir": str(args.output_dir)},
        "machine": machine_info(),
        "results": results,
        "summary": summary,
    }
    out = write_report(report, args.output_dir, args.scenario)

    if args.scenario == "idle":
        print(
            f"\nidle connections={args.connections} keepalive={args.keepalive}s "
            f"hold={args.duration}s"
        )
    else:
        print(
            f"\n{args.scenario} qos={args.qos} publishers={args.publishers} "
            f"subscribers={args.subscribers} duration={args.duration}s payload={args.payload}B "
            f"rate={args.rate or 'max'}"
        )
    print(format_table(results))
    if args.scenario != "idle" and args.qos == 0 and args.rate is None:
        print(
            "note: at QoS 0 and max rate, latency is mostly time queued in TCP buffers; "
            "use --rate for latency at a given load."
        )
    for text in (format_summary(summary), format_log_findings(results)):
        if text:
            print(text)
    print(f"results: {out}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
