"""The issue-3 matrix in one go: every scenario against Mosquitto, edgebus and the null sink.

    python -m bench.suite                      # the whole matrix, ~10 minutes
    python -m bench.suite --cases pairs-q0,idle --duration 5
    python -m bench.suite --cases tls-pairs-q0,tls-pairs-q1 --rounds 5   # median of 5 pairs

Cases (64-byte payloads, journal on with edgebus's default fsync group commit):

- `pairs-q0`, `pairs-q1`: 4 publisher/subscriber pairs, each pair on its own topic;
- `fanin-q0`, `fanin-q1`: 100 publishers → one subscriber on `#`;
- `fanout-q0`: 1 publisher → 1,000 subscribers of its topic (msgs/s counts deliveries);
- `idle`: `--connections` clients connect and sit idle; resident memory per connection (see
  `loadgen.idle`); the null sink's row is the floor of a minimal Python/uvloop server;
- `tls-pairs-q0`, `tls-pairs-q1`: the pairs over MQTT over TLS, both brokers serving one
  certificate made for the run (ECDSA P-256, `bench.certs`) that the generator verifies; no
  null-sink row (it does not speak TLS).

Each throughput case runs at max rate against mosquitto, edgebus and null (the generator's
ceiling) — "max rate" within the generator's end-to-end window (`loadgen._Gate`: at most
20,000 deliveries, or 300 messages, in flight from publishers to subscribers, so QoS 0
publishers cannot bury the broker under tens of MB of socket buffers) — then at a fixed
`--latency-rate` (delivered msgs/s; for fan-out the publisher sends rate/1000) against
mosquitto and edgebus for latency. Brokers run one at a time, pinned to CPU 0 with the
generator on the others (see `bench.compare`), with the settings `compare.broker_settings()`
reports. Before each run the suite waits for the machine to be quiet (background below
`--quiet-cores`), at most `--max-wait` seconds over the whole suite; a throughput run during
which other programs used more than `--retry-above` cores is run again (`--retries`), the
disturbed result kept under "discarded". The table's `oth` columns show that load.

Prints one summary table with ratios and writes one JSON to bench/results/{time}-suite.json.
With `--rounds N` every case runs N times, every other round with the brokers' max-rate runs in
reverse order (edgebus before Mosquitto), and a second table gives edgebus's ratio to Mosquitto
in each round and their median: on a host whose speed moves by ±15 % between minutes, one pair
of runs decides nothing.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import BenchError, compare, loadgen

log = logging.getLogger(__name__)

THROUGHPUT_BROKERS = ("mosquitto", "edgebus", "null")
LATENCY_BROKERS = ("mosquitto", "edgebus")


@dataclass(frozen=True)
class Case:
    id: str
    scenario: str
    qos: int = 0
    publishers: int = 4
    subscribers: int = 4
    tls: bool = False  # MQTT over TLS (mosquitto and edgebus only)


CASES = (
    Case("pairs-q0", "pairs", 0, publishers=4),
    Case("pairs-q1", "pairs", 1, publishers=4),
    Case("fanin-q0", "fanin", 0, publishers=100),
    Case("fanin-q1", "fanin", 1, publishers=100),
    Case("fanout-q0", "fanout", 0, publishers=1, subscribers=1000),
    Case("idle", "idle"),
    Case("tls-pairs-q0", "pairs", 0, publishers=4, tls=True),
    Case("tls-pairs-q1", "pairs", 1, publishers=4, tls=True),
)


class Quiet:
    """Wait for a quiet machine before each run, within one budget for the whole suite."""

    def __init__(self, threshold: float, budget_s: float, *, sample_s: float = 2.0) -> None:
        self.threshold = threshold
        self.budget_s = budget_s
        self.sample_s = sample_s
        self.waited_s = 0.0
        self.log: list[dict[str, Any]] = []

    def wait(self, label: str) -> float:
        """Sample the background load until it is below the threshold or the budget is gone;
        return the last sample (busy cores)."""
        while True:
            load = compare.background_cores(self.sample_s)
            if load <= self.threshold or self.waited_s >= self.budget_s:
                self.log.append(
                    {"run": label, "background_cores": load, "waited_total_s": self.waited_s}
                )
                if load > self.threshold:
                    log.warning("%s: machine busy (%.2f cores), wait budget spent", label, load)
                return load
            pause = min(10.0, self.budget_s - self.waited_s)
            log.info("%s: machine busy (%.2f cores); waiting %.0fs", label, load, pause)
            time.sleep(pause)
            self.waited_s += pause + self.sample_s


def case_options(case: Case, args: argparse.Namespace, *, latency: bool) -> Any:
    options = loadgen.LoadOptions(
        qos=case.qos,
        duration=args.idle_hold if case.scenario == "idle" else args.duration,
        payload_size=args.payload,
        drain_timeout=args.drain_timeout,
        keepalive=args.keepalive,
        e2e_window=args.e2e_window or None,
    )
    if latency:
        rate = args.latency_rate / (case.subscribers if case.scenario == "fanout" else 1)
        return replace(options, rate=rate, duration=args.latency_duration)
    return options


def run_case(
    case: Case, args: argparse.Namespace, quiet: Quiet, *, reverse: bool = False
) -> dict[str, Any]:
    """One round of ``case``: each broker's max-rate run (in ``args.brokers``' order, or the
    reverse), then the latency runs."""
    runs: dict[str, dict[str, Any]] = {}
    discarded: list[dict[str, Any]] = []
    brokers = list(reversed(args.brokers)) if reverse else args.brokers
    plan = [(b, False) for b in brokers if case.scenario == "idle" or b in THROUGHPUT_BROKERS]
    if case.tls:
        plan = [(b, latency) for b, latency in plan if b != "null"]  # it does not speak TLS
    if case.scenario != "idle" and args.latency_rate:
        plan += [(b, True) for b in args.brokers if b in LATENCY_BROKERS]
    for broker, latency in plan:
        key = f"{broker}@rate" if latency else broker
        label = f"{case.id}/{key}"
        for attempt in range(1 + args.retries):
            quiet.wait(label)
            log.info("running %s", label)
            try:
                runs[key] = compare.run_one(
                    broker,
                    case.scenario,
                    case_options(case, args, latency=latency),
                    publishers=case.publishers,
                    subscribers=case.subscribers,
                    connections=args.connections,
                    edgebus_config=args.edgebus_config,
                    tls=case.tls,
                )
            except (BenchError, OSError) as exc:
                log.exception("%s failed", label)
                runs[key] = {"error": f"{type(exc).__name__}: {exc}"}
            others = other_cores(runs[key])
            if others is None or others <= args.retry_above or attempt == args.retries:
                break
            # Other programs took CPU during the run: keep it in the results, run it again.
            log.warning("%s: other programs used %.2f cores during the run; again", label, others)
            discarded.append({"run": key, "other_cores": others, "result": runs[key]})
    return {
        "case": case.__dict__,
        "runs": runs,
        "rows": summary_rows(case, runs),
        "discarded": discarded,
    }


def _get(run: dict[str, Any] | None, *path: str) -> Any:
    value: Any = run
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def summary_rows(case: Case, runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per broker with the figures of the summary table (None where not meaningful)."""
    rows = []
    if case.scenario == "idle":
        mosq = _get(runs.get("mosquitto"), "kib_per_connection")
        for broker, run in runs.items():
            per = _get(run, "kib_per_connection")
            rows.append(
                {
                    "case": case.id,
                    "broker": broker,
                    "error": _get(run, "error"),
                    "connected": _get(run, "connected"),
                    "failed": _get(run, "failed"),
                    "lost": _get(run, "lost_during_hold"),
                    "kib_per_connection": per,
                    "ratio": per / mosq if per and mosq and broker != "mosquitto" else None,
                    "rss_before_kib": _get(run, "rss_kib", "before"),
                    "rss_end_kib": _get(run, "rss_kib", "end_of_hold"),
                    "rss_after_close_kib": _get(run, "rss_kib", "after_close"),
                    "broker_idle_cores": _get(run, "cpu", "broker_cores"),
                    "broker_us_per_connect": _get(run, "cpu", "broker_us_per_connect"),
                    "background_cores": _get(run, "background_cores_before"),
                    "log_problems": _get(run, "broker_log", "problem_lines"),
                }
            )
        return rows
    null = runs.get("null")
    ceiling = None
    if null and "error" not in null:
        ceiling = {"publishers": null["send_rate"], "subscribers": null["msgs_per_s"]}
    mosq_rate = _get(runs.get("mosquitto"), "msgs_per_s")
    for broker in (b for b in runs if "@" not in b):
        run = runs[broker]
        at_rate = runs.get(f"{broker}@rate")
        rate = _get(run, "msgs_per_s")
        headroom = None
        if ceiling and broker != "null" and rate and _get(run, "send_rate"):
            headroom = min(ceiling["publishers"] / run["send_rate"], ceiling["subscribers"] / rate)
        rows.append(
            {
                "case": case.id,
                "broker": broker,
                "error": _get(run, "error") or _get(at_rate, "error"),
                "msgs_per_s": rate,
                "send_rate": _get(run, "send_rate"),
                "ratio": rate / mosq_rate
                if rate and mosq_rate and broker not in ("mosquitto", "null")
                else None,
                "loss": _get(run, "loss"),
                "expected": _get(run, "expected"),
                "stall_max_s": _get(run, "timeline", "stall_max_s"),
                "tail_s": _get(run, "timeline", "tail_s"),
                "broker_cores": _get(run, "cpu", "broker_cores"),
                "generator_cores": _sum(
                    _get(run, "cpu", "publishers_cores"), _get(run, "cpu", "subscribers_cores")
                ),
                "cpu1_busy": _cpu1(run),
                "broker_peak_rss_kib": _get(run, "broker_rss_kib", "peak"),
                "latency_rate": _get(at_rate, "options", "rate"),
                "latency_msgs_per_s": _get(at_rate, "msgs_per_s"),
                "p50_ms": _get(at_rate, "latency_ms", "p50"),
                "p99_ms": _get(at_rate, "latency_ms", "p99"),
                "max_ms": _get(at_rate, "latency_ms", "max"),
                "loss_at_rate": _get(at_rate, "loss"),
                "ceiling": ceiling if broker == "null" else None,
                "headroom": headroom,
                "other_cores": other_cores(run),
                "other_cores_at_rate": other_cores(at_rate),
                "log_problems": _sum(
                    _get(run, "broker_log", "problem_lines"),
                    _get(at_rate, "broker_log", "problem_lines"),
                ),
            }
        )
    return rows


def other_cores(run: dict[str, Any] | None) -> float | None:
    """CPU cores busy during a throughput run beyond the broker and the generator's workers:
    other programs on the machine (plus the parent process and kernel threads, ~0.05)."""
    cpu = _get(run, "cpu")
    if not cpu or cpu.get("machine_busy_cores") is None:
        return None
    ours = sum(cpu.get(k) or 0.0 for k in ("broker_cores", "publishers_cores", "subscribers_cores"))
    return float(cpu["machine_busy_cores"] - ours)


def _sum(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _cpu1(run: dict[str, Any] | None) -> float | None:
    """The busy share of the generator's CPU (the second listed), when pinned."""
    per_cpu = _get(run, "cpu", "per_cpu_busy") or {}
    values = list(per_cpu.values())
    return values[1] if len(values) > 1 else None


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_summary(cases: list[dict[str, Any]]) -> str:
    rows = [row for case in cases for row in case["rows"]]
    throughput = [r for r in rows if r["case"] != "idle"]
    idle = [r for r in rows if r["case"] == "idle"]
    lines = []
    if throughput:
        header = (
            f"{'case':<10} {'broker':<10} {'msgs/s':>10} {'e/m':>5} {'loss':>7} {'stall s':>7} "
            f"{'broker':>6} {'gen':>5} {'cpu1':>5} {'p50 ms':>7} {'p99 ms':>7} {'loss@r':>6} "
            f"{'headroom':>8} {'oth':>5} {'oth@r':>5}"
        )
        lines += [header, "-" * len(header)]
        for r in throughput:
            if r["error"]:
                lines.append(f"{r['case']:<10} {r['broker']:<10} ERROR: {r['error']}")
                continue
            rate = r["msgs_per_s"]
            if r["broker"] == "null" and r["ceiling"]:
                pub, sub = r["ceiling"]["publishers"], r["ceiling"]["subscribers"]
                lines.append(
                    f"{r['case']:<10} {'null':<10} ceiling: publishers {pub:,.0f} msgs/s, "
                    f"subscribers {sub:,.0f} msgs/s"
                )
                continue
            lines.append(
                f"{r['case']:<10} {r['broker']:<10} {_f(rate, ',.0f'):>10} "
                f"{_f(r['ratio'], '.2f'):>5} {_f(r['loss'], 'd'):>7} "
                f"{_f(r['stall_max_s'], '.2f'):>7} {_f(r['broker_cores'], '.2f'):>6} "
                f"{_f(r['generator_cores'], '.2f'):>5} {_f(r['cpu1_busy'], '.2f'):>5} "
                f"{_f(r['p50_ms'], '.2f'):>7} {_f(r['p99_ms'], '.2f'):>7} "
                f"{_f(r['loss_at_rate'], 'd'):>6} {_f(r['headroom'], '.1f'):>8} "
                f"{_f(r['other_cores'], '.2f'):>5} {_f(r['other_cores_at_rate'], '.2f'):>5}"
            )
        lines.append(
            "msgs/s: delivered at max rate; e/m: edgebus/mosquitto; stall: longest time a "
            "subscriber process got nothing mid-run; broker/gen: CPU cores of the broker and of "
            "the generator's processes; cpu1: busy share of the generator's CPU; p50/p99/loss@r: "
            "at the fixed latency rate; headroom: null-sink ceiling / this rate (lower of "
            "publisher and subscriber side); oth/oth@r: cores used by other programs during the "
            "max-rate / latency run (above ~0.2 the figure is disturbed)."
        )
    if idle:
        if lines:
            lines.append("")
        header = (
            f"{'case':<10} {'broker':<10} {'connected':>9} {'failed':>6} {'lost':>5} "
            f"{'KiB/conn':>8} {'e/m':>5} {'RSS0 MiB':>8} {'RSS MiB':>8} {'closed':>7} "
            f"{'us/conn':>7} {'idle cores':>10} {'bg':>5}"
        )
        lines += [header, "-" * len(header)]
        for r in idle:
            if r["error"]:
                lines.append(f"{r['case']:<10} {r['broker']:<10} ERROR: {r['error']}")
                continue
            lines.append(
                f"{r['case']:<10} {r['broker']:<10} {r['connected']:>9} {r['failed']:>6} "
                f"{r['lost']:>5} {_f(r['kib_per_connection'], '.2f'):>8} "
                f"{_f(r['ratio'], '.2f'):>5} {_mib(r['rss_before_kib']):>8} "
                f"{_mib(r['rss_end_kib']):>8} {_mib(r['rss_after_close_kib']):>7} "
                f"{_f(r['broker_us_per_connect'], '.0f'):>7} "
                f"{_f(r['broker_idle_cores'], '.3f'):>10} {_f(r['background_cores'], '.2f'):>5}"
            )
        lines.append(
            "KiB/conn: (RSS at the end of the hold - RSS before connecting) / connected; "
            "closed: RSS after the clients left; us/conn: broker CPU per accepted connection."
        )
    return "\n".join(lines)


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"


def rounds_summary(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per case, edgebus's ratio to Mosquitto in every round, and their median."""
    out = []
    for i, first in enumerate(rounds[0]):
        ratios = []
        for cases in rounds:
            row = next((r for r in cases[i]["rows"] if r["broker"] == "edgebus"), None)
            if row is not None and row["ratio"] is not None:
                ratios.append(float(row["ratio"]))
        out.append(
            {
                "case": first["case"]["id"],
                "ratios": ratios,
                "median": statistics.median(ratios) if ratios else None,
                "min": min(ratios, default=None),
                "max": max(ratios, default=None),
                "rounds_at_or_above_1": sum(r >= 1.0 for r in ratios),
            }
        )
    return out


def format_rounds(summary: list[dict[str, Any]]) -> str:
    lines = [f"{'case':<14} {'median e/m':>10} {'min':>5} {'max':>5}  every round"]
    for r in summary:
        every = " ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(
            f"{r['case']:<14} {_f(r['median'], '.2f'):>10} {_f(r['min'], '.2f'):>5} "
            f"{_f(r['max'], '.2f'):>5}  {every}"
        )
    return "\n".join(lines)


def format_findings(cases: list[dict[str, Any]]) -> str:
    lines = []
    for case in cases:
        text = compare.format_log_findings(case["runs"])
        if text:
            lines += [f"[{case['case']['id']}] {line}" for line in text.splitlines()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.suite",
        description="Run the issue-3 benchmark matrix (Mosquitto, edgebus, null) in one go.",
    )
    parser.add_argument(
        "--cases",
        default=",".join(c.id for c in CASES),
        help="comma-separated subset of: " + ", ".join(c.id for c in CASES),
    )
    parser.add_argument("--brokers", default="mosquitto,edgebus,null")
    parser.add_argument("--duration", type=float, default=10.0, help="max-rate run seconds")
    parser.add_argument(
        "--latency-rate",
        type=float,
        default=10_000.0,
        help="delivered msgs/s of the latency runs (0 = skip them; default 10000)",
    )
    parser.add_argument("--latency-duration", type=float, default=5.0)
    parser.add_argument(
        "--e2e-window", type=int, default=20_000, help="see bench.loadgen (0 = unbounded)"
    )
    parser.add_argument("--connections", type=int, default=10_000, help="idle connections")
    parser.add_argument("--idle-hold", type=float, default=5.0, help="idle: seconds held")
    parser.add_argument("--keepalive", type=int, default=0, help="CONNECT keepalive (0 = none)")
    parser.add_argument("--payload", type=int, default=64)
    parser.add_argument("--drain-timeout", type=float, default=60.0)
    parser.add_argument("--edgebus-config", default=compare.BENCH, help="see bench.compare")
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=0.15,
        help="wait before a run while other programs use more cores than this",
    )
    parser.add_argument(
        "--max-wait", type=float, default=600.0, help="total seconds to wait for quiet"
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="run a throughput run again (this often) when other programs used more than "
        "--retry-above cores during it; the disturbed result is kept under 'discarded'",
    )
    parser.add_argument("--retry-above", type=float, default=0.25)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the cases this many times (every other round with the brokers in reverse "
        "order) and report edgebus's median ratio to Mosquitto per case: one pair of runs "
        "moves by ±15 %% on a noisy host",
    )
    parser.add_argument("--output-dir", type=Path, default=compare.RESULTS_DIR)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    by_id = {c.id: c for c in CASES}
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in by_id]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(by_id)}")
    args.brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    bad = set(args.brokers) - set(compare.BROKERS)
    if bad:
        parser.error(f"unknown broker(s) {sorted(bad)}")

    started = datetime.now(UTC)
    t0 = time.monotonic()
    quiet = Quiet(args.quiet_cores, args.max_wait)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    rounds = []
    for number in range(args.rounds):
        if args.rounds > 1:
            log.info("round %d of %d", number + 1, args.rounds)
        rounds.append([run_case(by_id[c], args, quiet, reverse=number % 2 == 1) for c in wanted])
    cases = [case | {"round": number + 1} for number, r in enumerate(rounds) for case in r]
    by_round = rounds_summary(rounds) if args.rounds > 1 else None
    report = {
        "timestamp": started.isoformat(),
        "timestamp_compact": started.strftime("%Y%m%dT%H%M%SZ"),
        "argv": sys.argv if argv is None else argv,
        "params": vars(args) | {"output_dir": str(args.output_dir)},
        "machine": compare.machine_info(),
        "broker_settings": {
            b: compare.broker_settings(b, args.edgebus_config) for b in args.brokers
        },
        "quiet": {"waited_s": quiet.waited_s, "samples": quiet.log},
        "elapsed_s": time.monotonic() - t0,
        "summary": [row | {"round": case["round"]} for case in cases for row in case["rows"]],
        "rounds": by_round,
        "cases": cases,
    }
    out = compare.write_report(report, args.output_dir, "suite")
    print(
        f"\nedgebus suite {started:%Y-%m-%d %H:%M}Z, payload {args.payload} B, max-rate runs "
        f"{args.duration:g}s, latency at "
        f"{args.latency_rate:,.0f} msgs/s for {args.latency_duration:g}s, idle "
        f"{args.connections} connections held {args.idle_hold:g}s; waited {quiet.waited_s:.0f}s "
        "for quiet"
    )
    print(format_summary(cases))
    if by_round is not None:
        print(f"\nedgebus ÷ Mosquitto over {args.rounds} rounds (msgs/s at max rate):")
        print(format_rounds(by_round))
    findings = format_findings(cases)
    if findings:
        print(findings)
    print(f"results: {out}")
    return 1 if any(row["error"] for case in cases for row in case["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
