"""Quota reaction: from the publish that crosses a tenant's daily limit to the edge refusing it.

    python -m bench.quota --rounds 8 --limit 3000 --rate 1000

Starts ``edgebus edge`` and ``edgebus pipeline --tenants --broker`` as processes (what
``edgebus run`` does) with a tenants file of one fresh tenant per round, each with
``messages_per_day = limit``. In each round one MQTT 5 paho client of that round's tenant
publishes QoS 1 at a steady ``rate`` until its publishes are refused (PUBACK 0x97), subscribed
meanwhile to its ``$counters/messages_in`` and ``$quota/#``. Per round:

- crossing: the send time of the ``limit``-th accepted publish (the day total reaches 100 %);
- counter: when the edge published the first counter showing that total;
- decided: ``decided_at`` of the tenant's ``blocked`` row in ``quota_events`` (the pipeline);
- applied: when the edge republished the decision on ``$quota/messages_per_day``;
- refused: the send time of the first refused publish.

Reaction = refused - crossing; overshoot = publishes accepted after the crossing. Each round
starts at a random phase of the counter interval. One clock (``time.time()``) on one machine.
Results: bench/results/{timestamp}-quota.json.

``--edges N`` (issue 14) starts N edges (node ids ``bench-0`` ...) on one data dir, the
pipeline reading all their journals and sending its decisions and confirmed totals to each;
per round one publisher per edge, all of the same tenant, each at ``rate``. The crossing is
then the ``limit``-th accepted publish over all edges (by send time), the overshoot what all of
them accepted past the limit, and the reaction the last edge's first refusal after it. The
edges enforce the limit locally (``broker_edge.localquota``): one edge stops within a message;
with N, the overshoot is what the others accept until the pipeline's confirmed totals tell.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from bench import BenchError
from bench.compare import RESULTS_DIR, machine_info, write_report

QUOTA_EXCEEDED = 0x97
OPERATOR_TOKEN = "bench-operator"
WARMUP = "warmup"
EDGEBUS = [sys.executable, "-m", "edgebus.cli", "--log-level", "INFO"]


@dataclass
class Round:
    """What one tenant's publisher saw; times are ``time.time()``."""

    tenant: str
    limit: int
    sent: list[float] = field(default_factory=list)  # by publish index
    acks: dict[int, tuple[int, float]] = field(default_factory=dict)  # index -> (code, time)
    counter_at: float | None = None
    applied_at: float | None = None
    decided_at: float | None = None

    def summary(self) -> dict[str, Any]:
        codes = [self.acks[i][0] for i in range(len(self.sent)) if i in self.acks]
        accepted = [i for i, code in enumerate(codes) if code < 0x80]
        refused = [i for i, code in enumerate(codes) if code == QUOTA_EXCEEDED]
        if len(accepted) < self.limit or not refused:
            raise BenchError(f"{self.tenant}: not blocked ({len(accepted)} accepted)")
        crossing = self.sent[accepted[self.limit - 1]]
        first_refused = refused[0]
        late = [i for i in accepted if i > first_refused]

        def since(when: float | None) -> float | None:
            return None if when is None else round(when - crossing, 3)

        elapsed = self.sent[first_refused] - self.sent[0]
        return {
            "tenant": self.tenant,
            "rate_msgs_per_s": round(first_refused / elapsed) if elapsed > 0 else None,
            "reaction_s": round(self.sent[first_refused] - crossing, 3),
            "overshoot": len(accepted) - self.limit,
            "accepted_after_first_refusal": len(late),
            "counter_s": since(self.counter_at),
            "decided_s": since(self.decided_at),
            "applied_s": since(self.applied_at),
            "refusal_acked_s": round(self.acks[first_refused][1] - crossing, 3),
        }


def combined_summary(records: list[Round]) -> dict[str, Any]:
    """One round of several publishers (one per edge) of one tenant, as one."""
    if len(records) == 1:
        return records[0].summary()
    limit = records[0].limit
    accepted: list[float] = []
    first_refusals: list[float] = []
    for record in records:
        codes = [(i, record.acks[i][0]) for i in range(len(record.sent)) if i in record.acks]
        accepted += [record.sent[i] for i, code in codes if code < 0x80]
        refused = [record.sent[i] for i, code in codes if code == QUOTA_EXCEEDED]
        if not refused:
            raise BenchError(f"{record.tenant}: an edge never refused")
        first_refusals.append(refused[0])
    accepted.sort()
    if len(accepted) < limit:
        raise BenchError(f"{records[0].tenant}: not blocked ({len(accepted)} accepted)")
    crossing = accepted[limit - 1]
    decided = records[0].decided_at
    return {
        "tenant": records[0].tenant,
        "edges": len(records),
        "reaction_s": round(max(first_refusals) - crossing, 3),
        "first_edge_refused_s": round(min(first_refusals) - crossing, 3),
        "decided_s": None if decided is None else round(decided - crossing, 3),
        "overshoot": len(accepted) - limit,
        "per_edge_accepted": [
            sum(1 for i, (code, _) in r.acks.items() if code < 0x80 and i < len(r.sent))
            for r in records
        ],
    }


class Publisher:
    """A paho MQTT 5 client of one tenant: QoS 1 at a steady rate until refused."""

    def __init__(self, port: int, token: str, record: Round) -> None:
        self.record = record
        self._lock = threading.Lock()
        self._index: dict[int, int] = {}  # mid -> publish index
        self._early: dict[int, tuple[int, float]] = {}  # mid -> (code, time)
        self.refused = threading.Event()
        self._connected = threading.Event()
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"bench-{record.tenant}",
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=False,
        )
        client.username_pw_set(token)
        client.max_inflight_messages_set(100)  # the edge's receive maximum
        client.on_connect = self._on_connect
        client.on_publish = self._on_publish
        client.on_message = self._on_message
        client.connect("127.0.0.1", port)
        client.loop_start()
        self.client = client
        if not self._connected.wait(10):
            raise BenchError(f"{record.tenant}: no CONNACK")

    def _on_connect(self, client: Any, userdata: Any, flags: Any, code: Any, props: Any) -> None:
        client.subscribe([("$counters/messages_in", 0), ("$quota/#", 0)])
        self._connected.set()

    def _on_publish(self, client: Any, userdata: Any, mid: int, code: Any, props: Any) -> None:
        now = time.time()
        with self._lock:
            index = self._index.pop(mid, None)
            if index is None:  # acknowledged before run() recorded its mid
                self._early[mid] = (code.value, now)
                return
        self._ack(index, code.value, now)

    def _ack(self, index: int, code: int, when: float) -> None:
        self.record.acks[index] = (code, when)
        if code == QUOTA_EXCEEDED:
            self.refused.set()

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        now = time.time()
        doc = json.loads(message.payload)
        record = self.record
        if message.topic == "$counters/messages_in":
            if record.counter_at is None and doc["total"] >= record.limit:
                record.counter_at = now
        elif doc.get("state") == "blocked" and record.applied_at is None:
            record.applied_at = now

    def run(self, rate: float, timeout: float) -> None:
        """Publish at ``rate`` until a publish is refused (and 0.5 s more), or ``timeout``."""
        payload = b'{"vehicle":"bench","speed_kmh":42.0}'
        start = time.perf_counter()
        stop_at = start + timeout
        i = 0
        while time.perf_counter() < stop_at:
            if self.refused.is_set():
                stop_at = min(stop_at, time.perf_counter() + 0.5)
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            # Never hold our lock across a paho call: paho calls on_publish holding its own.
            self.record.sent.append(time.time())
            mid = self.client.publish("fleet/bench/telemetry", payload, qos=1).mid
            with self._lock:
                early = self._early.pop(mid, None)
                if early is None:
                    self._index[mid] = i
            if early is not None:
                self._ack(i, *early)
            i += 1
        deadline = time.monotonic() + 10
        while len(self.record.acks) < i and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def tenants_file(tenants: list[str], limit: int) -> str:
    lines = ["[operator]", f'token = "{OPERATOR_TOKEN}"', ""]
    lines += [f"[tenants.{WARMUP}]", f'tokens = ["{WARMUP}-token"]', ""]
    for tenant in tenants:
        lines += [f"[tenants.{tenant}]", f'tokens = ["{tenant}-token"]']
        lines += [f"[tenants.{tenant}.limits]", f"messages_per_day = {limit}", ""]
    return "\n".join(lines)


def start_edge(
    work: Path, config: Path, tenants: Path, node: str = "bench"
) -> tuple[subprocess.Popen[bytes], int]:
    log = work / f"edge-{node}.log"
    proc = subprocess.Popen(
        [*EDGEBUS, "edge", "--listen", "127.0.0.1:0", "--node-id", node]
        + ["--data-dir", str(work / "data"), "--config", str(config), "--tenants", str(tenants)],
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if " listening on " not in line:
        proc.kill()
        raise BenchError(f"the edge did not start: {log.read_text()[-2000:]}")
    return proc, int(line.rsplit(":", 1)[1])


def wait_until_processed(lake: Path, tenant: str, timeout: float) -> None:
    """Until the usage table holds the tenant's counters: the pipeline runs every job."""
    from sinks.delta import read_table
    from sinks.errors import DeltaSinkError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if read_table(lake / "usage", f"tenant = '{tenant}'").num_rows:
                return
        except DeltaSinkError:
            pass  # no table yet, or its first commit is being written
        time.sleep(0.5)
    raise BenchError(f"the pipeline did not process {tenant}'s counters in {timeout:g} s")


def decided_at(lake: Path, tenant: str) -> float | None:
    """When the pipeline decided ``blocked`` for ``tenant``; None: not yet (or no decision at
    all yet: no ``quota_events`` table)."""
    from sinks.delta import read_table
    from sinks.errors import DeltaSinkError

    try:
        rows = read_table(
            lake / "quota_events", f"tenant = '{tenant}' AND state = 'blocked'", ["decided_at"]
        ).to_pylist()
    except DeltaSinkError:
        return None
    return rows[0]["decided_at"].timestamp() if rows else None


def wait_for_decisions(lake: Path, rounds: list[list[Round]], timeout: float) -> None:
    """Each round's ``decided_at`` (the pipeline's ``blocked`` decision), waiting for those the
    pipeline has not committed yet (the rounds outrun it: a round ends when the edges refuse)."""
    deadline = time.monotonic() + timeout
    pending = rounds
    while True:
        for records in pending:
            records[0].decided_at = decided_at(lake, records[0].tenant)
        pending = [records for records in pending if records[0].decided_at is None]
        if not pending or time.monotonic() > deadline:
            return
        time.sleep(1.0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--limit", type=int, default=3000, help="messages_per_day of a tenant")
    parser.add_argument("--rate", type=float, default=1000.0, help="publishes per second")
    parser.add_argument("--counter-interval", type=float, default=None, help="edge setting")
    parser.add_argument("--trigger-interval", type=float, default=None, help="pipeline setting")
    parser.add_argument("--timeout", type=float, default=60.0, help="per round, after crossing")
    parser.add_argument("--workdir", type=Path, help="keep data and logs here (default: temp)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--edges", type=int, default=1, help="edges, one publisher on each")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="edgebus-bench-quota-"))
    work.mkdir(parents=True, exist_ok=True)
    tenants = [f"q{i}" for i in range(args.rounds)]
    (work / "tenants.toml").write_text(tenants_file(tenants, args.limit))
    config = ["[edge]", "sys_interval = 0"]
    if args.counter_interval is not None:
        config.append(f"counter_interval = {args.counter_interval}")
    config.append("[pipeline]")
    if args.trigger_interval is not None:
        config.append(f"trigger_interval_seconds = {args.trigger_interval}")
    (work / "edgebus.toml").write_text("\n".join(config) + "\n")

    from broker_edge.settings import EdgeSettings
    from streaming.settings import PipelineSettings

    counter_interval = args.counter_interval or EdgeSettings().counter_interval
    trigger_interval = args.trigger_interval or PipelineSettings().trigger_interval_seconds
    lake = work / "lake"
    rng = random.Random(args.seed)
    edges = [
        start_edge(work, work / "edgebus.toml", work / "tenants.toml", f"bench-{i}")
        for i in range(args.edges)
    ]
    ports = [port for _, port in edges]
    pipeline = subprocess.Popen(
        [*EDGEBUS, "pipeline", "--data-dir", str(work / "data"), "--lake", str(lake)]
        + ["--config", str(work / "edgebus.toml"), "--tenants", str(work / "tenants.toml")]
        + [arg for port in ports for arg in ("--broker", f"127.0.0.1:{port}")],
        stderr=(work / "pipeline.log").open("wb"),
    )
    rounds: list[list[Round]] = []
    try:
        warm = Publisher(ports[0], f"{WARMUP}-token", Round(WARMUP, 1))
        warm.client.publish("fleet/warmup", b"{}", qos=1)
        wait_until_processed(lake, WARMUP, 300 + counter_interval)
        warm.close()
        print(f"pipeline up; {args.rounds} rounds of {args.limit} at {args.rate:g}/s", flush=True)
        for tenant in tenants:
            # A random phase of the counter interval and the trigger.
            time.sleep(rng.uniform(0, max(counter_interval, trigger_interval)))
            records = [Round(tenant, args.limit) for _ in ports]
            publishers = [
                Publisher(port, f"{tenant}-token", record)
                for port, record in zip(ports, records, strict=True)
            ]
            duration = args.limit / args.rate / len(ports) + args.timeout
            threads = [
                threading.Thread(target=p.run, args=(args.rate, duration)) for p in publishers
            ]
            try:
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            finally:
                for publisher in publishers:
                    publisher.close()
            rounds.append(records)
            if pipeline.poll() is not None or any(edge.poll() is not None for edge, _ in edges):
                raise BenchError("an edge or the pipeline exited during the run")
        wait_for_decisions(lake, rounds, args.timeout + 120)
    finally:
        procs = [pipeline, *(edge for edge, _ in edges)]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    summaries = [combined_summary(records) for records in rounds]
    now = datetime.now(UTC)
    reactions = [s["reaction_s"] for s in summaries]
    overshoots = [s["overshoot"] for s in summaries]
    decisions = [s["decided_s"] for s in summaries if s["decided_s"] is not None]
    for summary in summaries:
        # Issue 14's bound with N edges: the other edges' rate times the pipeline's reaction.
        if args.edges > 1 and summary["decided_s"] is not None:
            bound = (args.edges - 1) * args.rate * summary["decided_s"]
            summary["overshoot_bound"] = round(bound)
            summary["overshoot_within_bound"] = summary["overshoot"] <= bound
    result: dict[str, Any] = {
        "benchmark": "quota reaction",
        "rounds": args.rounds,
        "limit": args.limit,
        "rate_msgs_per_s": args.rate,
        "edges": args.edges,
        "qos": 1,
        "protocol": "MQTT 5",
        "edge_counter_interval_s": counter_interval,
        "pipeline_trigger_interval_s": trigger_interval,
        "reaction_s": {
            "p50": round(statistics.median(reactions), 3),
            "p90": round(percentile(reactions, 0.9), 3),
            "max": round(max(reactions), 3),
        },
        "pipeline_decided_s": {
            "rounds_decided": len(decisions),
            "p50": round(statistics.median(decisions), 3) if decisions else None,
            "max": round(max(decisions), 3) if decisions else None,
        },
        "overshoot": {
            "p50": statistics.median(overshoots),
            "max": max(overshoots),
            "p50_pct_of_limit": round(100 * statistics.median(overshoots) / args.limit, 1),
        },
        "per_round": summaries,
        "loadavg": os.getloadavg(),
        "date": now.isoformat(timespec="seconds"),
        "timestamp_compact": f"{now:%Y%m%dT%H%M%SZ}",
        "machine": machine_info(),
    }
    print(json.dumps(result, indent=2))
    print(f"results: {write_report(result, RESULTS_DIR, 'quota')}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
