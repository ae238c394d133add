"""Edges meshed into one bus against Mosquitto instances joined by bridges, side by side (#11).

    python -m bench.mesh --rounds 2 --duration 10
    python -m bench.mesh --cases max-q0,fanout --rounds 1 --duration 5

Theory of operation
-------------------
Each case needs a *bus* of two or three brokers of one kind on 127.0.0.1:

- edgebus: ``edgebus edge`` processes meshed (every edge lists the others with ``peers``, one
  ``mesh_token``), each with the queue limits of ``compare.EDGEBUS_BENCH_CONFIG`` (journal on,
  fsync group commit);
- Mosquitto: instances with ``brokers.MOSQUITTO_CONFIG``, joined as a *star* around node 0 (the
  publishers' broker): each other node runs a bridge ``connection`` to node 0 with
  ``topic # both 1``. A star has no loop, and every publish made on node 0 crosses each bridge
  once (Mosquitto's ``try_private`` keeps a bridge from getting its own messages back); a chain
  would make node 2's messages cross two bridges, which is not what a one-hop mesh does.

Publishers connect to node 0, subscribers to the nodes the case says (``loadgen.run_clients``
with ``where``). Before the clients start, a probe published on node 0 must reach every other
node (bridges and links up, the probe's filter told). The cases:

- ``max-q0`` / ``max-q1``: 4 publisher/subscriber pairs, publishers on A, subscribers on B, as
  fast as the generator's end-to-end window lets them (cross-edge msgs/s, QoS 0 and 1);
- ``lat-cross`` / ``lat-same``: one publisher on A at 10,000 msgs/s, its subscriber on B
  (cross-edge) or on A (same edge): latency p50/p99;
- ``fanout``: one publisher on A, two subscribers on each of A, B and C on its topic, at a fixed
  rate; each node's ``$SYS`` counters before and after say how many publishes came in over its
  links (edgebus: ``mesh/publish/received``; Mosquitto: ``publish/messages/received`` on a
  bridged node, whose only publisher is its bridge) and how many the origin's links sent
  (edgebus: ``mesh/publish/forwarded``). Each publish should cross each link once: B and C each
  take in as many as were published, not one per subscriber, and nothing goes back to A.

All brokers are pinned to the first CPU and the generator to the others (as in
``bench.compare``); each run starts a fresh bus, and the two kinds alternate which goes first
from round to round. The ratios are edgebus ÷ Mosquitto of the medians over the rounds.
Results go to bench/results/{timestamp}-mesh.json; the Markdown table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from bench import BenchError, brokers, compare, loadgen, wire

log = logging.getLogger(__name__)

KINDS = ("mosquitto", "edgebus")
SYS_INTERVAL_S = 1.0  # $SYS refresh on every broker of the bus (the fan-out's counters)
PROBE_TOPIC = "bench-probe/up"


class MeshBenchError(BenchError):
    """A bus did not come up, or a broker's $SYS did not answer."""


@dataclass(frozen=True)
class Case:
    """Who connects where: ``publishers`` on node 0; ``subscribers[i]`` on node i. With
    ``one_topic`` every subscriber takes the one topic (fan-out), else subscriber k takes
    publisher k's topic (pairs; as many subscribers as publishers)."""

    name: str
    qos: int
    rate: float | None  # total msgs/s; None = max
    publishers: int
    subscribers: tuple[int, ...]
    one_topic: bool = False

    @property
    def nodes(self) -> int:
        return len(self.subscribers)


def cases(latency_rate: float, fanout_rate: float) -> dict[str, Case]:
    return {
        "max-q0": Case("max-q0", 0, None, 4, (0, 4)),
        "max-q1": Case("max-q1", 1, None, 4, (0, 4)),
        "lat-cross": Case("lat-cross", 0, latency_rate, 1, (0, 1)),
        "lat-same": Case("lat-same", 0, latency_rate, 1, (1, 0)),
        "fanout": Case("fanout", 0, fanout_rate, 1, (2, 2, 2), one_topic=True),
    }


def clients(
    case: Case, run: str
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict[str, int]]:
    """(publishers, subscribers, node of each subscriber by client id) for ``run``."""
    if not case.one_topic and sum(case.subscribers) != case.publishers:
        raise ValueError(f"{case.name}: pairs need as many subscribers as publishers")
    topics = [f"bench/{run}/{i:05d}" for i in range(case.publishers)]
    pubs = [(f"p{run}-{i}", topic) for i, topic in enumerate(topics)]
    subs: list[tuple[str, str]] = []
    node_of: dict[str, int] = {}
    for node, count in enumerate(case.subscribers):
        for _ in range(count):
            client_id = f"s{run}-{len(subs)}"
            subs.append((client_id, topics[0 if case.one_topic else len(subs)]))
            node_of[client_id] = node
    return pubs, subs, node_of


# --- configurations ------------------------------------------------------------------------


def bridge_config(name: str, hub_port: int, host: str = brokers.HOST) -> str:
    """A Mosquitto bridge to the hub, every topic both ways at QoS 1 (the issue's setup); no
    notifications, so only the bench's publishes cross."""
    return (
        f"sys_interval {SYS_INTERVAL_S:g}\n"  # after the base config's 0: the last one counts
        f"connection {name}\n"
        f"address {host}:{hub_port}\n"
        "topic # both 1\n"
        "cleansession true\n"
        "notifications false\n"
    )


def edge_config(peers: list[str], token: str) -> str:
    """compare's bench settings (the [edge] table, last in it) with the mesh's."""
    listed = ", ".join(f'"{peer}"' for peer in peers)
    return (
        compare.EDGEBUS_BENCH_CONFIG
        + f'sys_interval = {SYS_INTERVAL_S}\npeers = [{listed}]\nmesh_token = "{token}"\n'
    )


# --- buses -----------------------------------------------------------------------------------


@contextlib.contextmanager
def mosquitto_bus(nodes: int, cpus: set[int] | None) -> Iterator[list[brokers.BrokerProcess]]:
    """A star: node 0 plain, every other node bridged to it."""
    sys_on = f"sys_interval {SYS_INTERVAL_S:g}\n"
    with contextlib.ExitStack() as stack:
        hub = stack.enter_context(brokers.start_mosquitto(cpus=cpus, extra_config=sys_on))
        bus = [hub]
        for i in range(1, nodes):
            config = bridge_config(f"bridge-{i}", hub.port)
            bus.append(stack.enter_context(brokers.start_mosquitto(cpus=cpus, extra_config=config)))
        yield bus


@contextlib.contextmanager
def edgebus_bus(nodes: int, cpus: set[int] | None) -> Iterator[list[brokers.BrokerProcess]]:
    """``nodes`` edges, every one a peer of the others."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-mesh-"))
    ports = [brokers.free_port() for _ in range(nodes)]
    token = secrets.token_hex(16)
    try:
        with contextlib.ExitStack() as stack:
            bus = []
            for i, port in enumerate(ports):
                config = scratch / f"edge-{i}.toml"
                peers = [f"{brokers.HOST}:{p}" for p in ports if p != port]
                config.write_text(edge_config(peers, token))
                edge = brokers.start_edgebus(
                    scratch / f"data-{i}",
                    node_id=f"edge-{i}",
                    extra_args=["--config", str(config)],
                    cpus=cpus,
                    port=port,
                )
                bus.append(stack.enter_context(edge))
            yield bus
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def bus(kind: str, nodes: int, cpus: set[int] | None) -> contextlib.AbstractContextManager[Any]:
    if kind == "mosquitto":
        return mosquitto_bus(nodes, cpus)
    if kind == "edgebus":
        return edgebus_bus(nodes, cpus)
    raise ValueError(f"unknown broker {kind!r}; choose from {', '.join(KINDS)}")


# --- a few synchronous MQTT exchanges (probe, $SYS) ----------------------------------------


class _Peek:
    """A blocking MQTT 3.1.1 client for the parent: subscribe, publish, collect publishes."""

    def __init__(self, broker: brokers.BrokerProcess, client_id: str) -> None:
        self.sock = socket.create_connection((broker.host, broker.port), timeout=5)
        self.reader = wire.PacketReader()
        self.sock.sendall(wire.connect(client_id))
        if wire.parse_connack(self._next(5.0) or _missing("CONNACK")):
            raise MeshBenchError(f"{broker}: CONNACK refused")

    def _next(self, timeout: float) -> wire.Packet | None:
        deadline = time.monotonic() + timeout
        while (packet := self.reader.next_packet()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return None
            if not data:
                raise MeshBenchError("broker closed the connection")
            self.reader.feed(data)
        return packet

    def subscribe(self, topic_filter: str) -> None:
        self.sock.sendall(wire.subscribe(1, [(topic_filter, 0)]))
        while (self._next(5.0) or _missing("SUBACK")).type != wire.PacketType.SUBACK:
            pass  # a retained message may come first

    def publish(self, topic: str, payload: bytes) -> None:
        self.sock.sendall(wire.publish(topic, payload))

    def collect(self, quiet_s: float, max_s: float) -> dict[str, bytes]:
        """Topic → latest payload of what arrives until nothing has for ``quiet_s``."""
        out: dict[str, bytes] = {}
        end = time.monotonic() + max_s
        while time.monotonic() < end and (packet := self._next(quiet_s)) is not None:
            if packet.type == wire.PacketType.PUBLISH:
                topic, _, payload = wire.parse_publish(packet)
                out[topic] = payload
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(wire.DISCONNECT)
        self.sock.close()


def _missing(what: str) -> NoReturn:
    raise MeshBenchError(f"no {what} from the broker")


def wait_bus_up(nodes: list[brokers.BrokerProcess], timeout: float = 30.0) -> float:
    """Publish probes on node 0 until one reaches every other node; return the seconds."""
    t0 = time.monotonic()
    peeks = [_Peek(node, f"probe-{i}-{secrets.token_hex(3)}") for i, node in enumerate(nodes)]
    try:
        for peek in peeks[1:]:
            peek.subscribe(PROBE_TOPIC)
        waiting = set(range(1, len(peeks)))
        while waiting:
            if time.monotonic() - t0 > timeout:
                raise MeshBenchError(f"nodes {sorted(waiting)} got no probe in {timeout}s")
            peeks[0].publish(PROBE_TOPIC, b"up")
            waiting = {i for i in waiting if PROBE_TOPIC not in peeks[i].collect(0.2, 0.5)}
        for peek in peeks[1:]:
            peek.collect(0.2, 1.0)  # later probes, so they do not land in the counters
        return time.monotonic() - t0
    finally:
        for peek in peeks:
            peek.close()


SYS_COUNTERS = {
    "edgebus": {
        "links_in": "$SYS/broker/mesh/publish/received",
        "links_out": "$SYS/broker/mesh/publish/forwarded",
        "congested": "$SYS/broker/mesh/publish/congested",
        "received": "$SYS/broker/publish/messages/received",
    },
    "mosquitto": {"received": "$SYS/broker/publish/messages/received"},
}


def sys_counters(kind: str, node: brokers.BrokerProcess) -> dict[str, int]:
    """The node's retained ``$SYS`` counters of ``SYS_COUNTERS[kind]``."""
    peek = _Peek(node, f"sys-{secrets.token_hex(3)}")
    try:
        peek.subscribe("$SYS/broker/#")
        values = peek.collect(0.3, 3.0)
    finally:
        peek.close()
    return {
        name: int(values[topic])
        for name, topic in SYS_COUNTERS[kind].items()
        if topic in values and values[topic].isdigit()
    }


def crossings(
    kind: str, before: list[dict[str, int]], after: list[dict[str, int]], published: int
) -> dict[str, Any]:
    """Publishes that came in over links per node, and went out from node 0's, during a run.

    Mosquitto has no per-bridge counter: a bridged node's publishes received are its bridge's
    (no client publishes there), node 0's are its publishers' plus anything bridged back."""
    delta = [{k: a[k] - b.get(k, 0) for k in a} for b, a in zip(before, after, strict=True)]
    if kind == "edgebus":
        links_in = [d.get("links_in") for d in delta]
        out = delta[0].get("links_out")
    else:
        links_in = [d.get("received") for d in delta]
        if links_in[0] is not None:
            links_in[0] -= published
        out = None
    return {
        "published": published,
        "links_in_per_node": links_in,
        "links_out_node0": out,
        "per_publish_in": [None if n is None or not published else n / published for n in links_in],
        "counters_delta": delta,
    }


# --- runs --------------------------------------------------------------------------------------


def run_case(
    kind: str, case: Case, options: loadgen.LoadOptions, cpus: set[int] | None
) -> dict[str, Any]:
    """A fresh bus of ``kind``, the case run on it, the bus stopped."""
    options = replace(options, qos=case.qos, rate=case.rate)
    run = secrets.token_hex(4)
    pubs, subs, node_of = clients(case, run)
    background = compare.background_cores()
    with bus(kind, case.nodes, cpus) as nodes:
        up_s = wait_bus_up(nodes)
        targets = [loadgen.Target(n.host, n.port, n.pid) for n in nodes]
        where = {client_id: targets[node] for client_id, node in node_of.items()}
        if case.one_topic:
            time.sleep(SYS_INTERVAL_S * 1.5)  # the probes out of the counters
            before = [sys_counters(kind, n) for n in nodes]
        result = loadgen.run_clients(targets[0], options, pubs, subs, where=where)
        if case.one_topic:
            time.sleep(SYS_INTERVAL_S * 2.5)  # the last refresh after the run
            after = [sys_counters(kind, n) for n in nodes]
            result["crossings"] = crossings(kind, before, after, result["sent"])
        result["broker_logs"] = [n.log_summary(tail=500) for n in nodes]
    result |= {
        "broker": kind,
        "case": case.name,
        "bus_up_s": up_s,
        "background_cores_before": background,
    }
    return result


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _us_per_msg(run: dict[str, Any]) -> float | None:
    """CPU time of all the bus's brokers per message delivered (a figure that other programs'
    load on the machine moves less than a rate does)."""
    spent = run["cpu"].get("broker_s")
    return None if spent is None or not run["received"] else spent / run["received"] * 1e6


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per case: each broker's medians over the rounds, and edgebus ÷ Mosquitto."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["case"] for r in runs):
        row: dict[str, Any] = {}
        for kind in KINDS:
            mine = [r for r in runs if r["case"] == name and r["broker"] == kind]
            lat = [r["latency_ms"] for r in mine]
            row[kind] = {
                "rounds": len(mine),
                "msgs_per_s": median([r["msgs_per_s"] for r in mine]),
                "all_msgs_per_s": [round(r["msgs_per_s"]) for r in mine],
                "p50_ms": median([x["p50"] for x in lat]),
                "p99_ms": median([x["p99"] for x in lat]),
                "loss": sum(r["loss"] or 0 for r in mine),
                "broker_cores": median([r["cpu"]["broker_cores"] for r in mine]),
                "broker_us_per_msg": median([_us_per_msg(r) for r in mine]),
                "crossings": [r["crossings"] for r in mine if "crossings" in r],
            }
        row["ratio_msgs_per_s"] = ratio(
            row["edgebus"]["msgs_per_s"], row["mosquitto"]["msgs_per_s"]
        )
        row["ratio_p50"] = ratio(row["edgebus"]["p50_ms"], row["mosquitto"]["p50_ms"])
        row["ratio_p99"] = ratio(row["edgebus"]["p99_ms"], row["mosquitto"]["p99_ms"])
        out[name] = row
    return out


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| case | Mosquitto msgs/s | edgebus msgs/s | ratio | Mosquitto p50 / p99 ms "
        "| edgebus p50 / p99 ms | loss M / e | broker cores M / e | broker CPU µs/msg M / e |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in summary.items():
        m, e = row["mosquitto"], row["edgebus"]
        lines.append(
            f"| {name} | {_f(m['msgs_per_s'], ',.0f')} | {_f(e['msgs_per_s'], ',.0f')} "
            f"| {_f(row['ratio_msgs_per_s'], '.2f')}x "
            f"| {_f(m['p50_ms'], '.2f')} / {_f(m['p99_ms'], '.2f')} "
            f"| {_f(e['p50_ms'], '.2f')} / {_f(e['p99_ms'], '.2f')} "
            f"| {m['loss']} / {e['loss']} "
            f"| {_f(m['broker_cores'], '.2f')} / {_f(e['broker_cores'], '.2f')} "
            f"| {_f(m['broker_us_per_msg'], '.1f')} / {_f(e['broker_us_per_msg'], '.1f')} |"
        )
    return "\n".join(lines)


def format_crossings(summary: dict[str, dict[str, Any]]) -> str:
    return "\n".join(
        f"{name} {kind}: published {c['published']:,} on node 0; came in over links "
        f"per node {c['links_in_per_node']} ({c['per_publish_in']} per publish); "
        f"node 0's links sent {c['links_out_node0']}"
        for name, row in summary.items()
        for kind in KINDS
        for c in row[kind]["crossings"]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.mesh",
        description="edgebus edges meshed vs Mosquitto instances bridged (topic # both 1), "
        "side by side: cross-edge msgs/s at QoS 0 and 1, latency cross-edge vs same-edge, "
        "and a fan-out over three nodes with each node's link counters.",
    )
    names = ",".join(cases(1, 1))
    parser.add_argument("--cases", default=names, help=f"comma-separated (default {names})")
    parser.add_argument("--rounds", type=int, default=2, help="each broker kind per case")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of publishing")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes (default 64)")
    parser.add_argument("--latency-rate", type=float, default=10_000.0, help="lat-* msgs/s")
    parser.add_argument("--fanout-rate", type=float, default=5_000.0, help="fanout msgs/s")
    parser.add_argument("--no-pin", action="store_true", help="do not pin brokers / generator")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    known = cases(args.latency_rate, args.fanout_rate)
    unknown = [name for name in args.cases.split(",") if name not in known]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {names}")
    chosen = [known[name] for name in args.cases.split(",")]
    options = loadgen.LoadOptions(duration=args.duration, payload_size=args.payload)
    cpus = sorted(os.sched_getaffinity(0))
    broker_cpus: set[int] | None = None
    if not args.no_pin and len(cpus) >= 2:
        broker_cpus = {cpus[0]}
        options = replace(options, worker_cpus=tuple(cpus[1:]))
    runs = []
    load_before = os.getloadavg()
    for round_ in range(args.rounds):
        order = KINDS if round_ % 2 == 0 else KINDS[::-1]
        for case in chosen:
            for kind in order:
                log.info("round %d: %s on %s", round_, case.name, kind)
                runs.append(run_case(kind, case, options, broker_cpus) | {"round": round_})
    summary = summarize(runs)
    compare.report(
        {
            "scenario": "mesh",
            "argv": sys.argv[1:] if argv is None else argv,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "pinning": None if broker_cpus is None else {"brokers": sorted(broker_cpus)},
            "broker_settings": {
                "mosquitto": brokers.MOSQUITTO_CONFIG.split("\n", 1)[1]
                + bridge_config("bridge-N", 0),
                "edgebus": edge_config(["..."], "<random>"),
            },
            "summary": summary,
            "runs": runs,
        },
        "mesh",
    )
    print(format_table(summary))
    print(format_crossings(summary))
    print(f"load average before {load_before}, after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
