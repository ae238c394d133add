"""What one misbehaving client costs the edge and everyone else (issue 10), over real sockets.

    python -m bench.abuse [--seconds 3] [--scenarios big_header,deep_filter,...]

Each scenario starts a fresh ``edgebus edge`` process (shipped defaults, anonymous tenant) and a
*victim*: a well-behaved MQTT 3.1.1 client that publishes QoS 0 to its own topic and waits for
the message to come back, over and over (a round trip every ~5 ms). The victim's round trips are
measured for ``--seconds`` alone (the baseline), then while one *attacker* misbehaves, and the
edge's RSS is sampled all along. Reported per scenario: the edge's RSS before, its peak while
the attacker ran, and after the attacker left (1 s later); the victim's round trip p50 / p99 /
max alone and under attack. The targets (issue 10): RSS peak - before <= 16 MiB, victim p99
under attack - alone <= 10 ms.

Scenarios (the holes the outside probe found):

- ``big_header``: a PUBLISH whose fixed header declares 100 MB, then its body at 64 KiB every
  10 ms.
- ``deep_filter``: one SUBSCRIBE of a 65 KB filter of 32,701 levels, then as many subscriptions
  of 128-level filters as the edge accepts (the most a client's filters may cost).
- ``long_topics``: 3,000 publishes to distinct 60 KB topics, then the client leaves.
- ``overlap``: 8,192 distinct filters that all match one 13-level topic (the edge accepts what
  its per-client cap allows), then QoS 0 publishes to that topic as fast as the socket takes.
- ``flood``: QoS 0 publishes to a topic nobody reads, as fast as the socket takes.
- ``no_reader``: subscribes to its own topic, never reads, and publishes 64 KiB QoS 0 messages
  to it as fast as the socket takes (what waits for it: the transport's buffer up to
  ``write_buffer_high_water``, then its session queue up to ``max_queued_bytes``).

Results: bench/results/{timestamp}-abuse.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import itertools
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import wire
from bench.brokers import RssSampler, rss_kib, start_edgebus
from bench.compare import write_report

RESULTS = Path(__file__).resolve().parent / "results"
TIMEOUT = 10.0


def _connect(port: int, client_id: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(wire.connect(client_id))
    reader = wire.PacketReader()
    while (packet := reader.next_packet()) is None:
        reader.feed(sock.recv(4096))
    if wire.parse_connack(packet) != 0:
        raise RuntimeError(f"{client_id}: CONNACK refused")
    return sock


class Victim(threading.Thread):
    """Round trips publish → delivery on its own topic, stamped with monotonic time."""

    def __init__(self, port: int) -> None:
        super().__init__(name="victim", daemon=True)
        self.sock = _connect(port, "victim")
        self.sock.sendall(wire.subscribe(1, [("victim/rtt", 0)]))
        self.reader = wire.PacketReader()
        self._wait(wire.PacketType.SUBACK)
        self.samples: list[tuple[float, float]] = []  # (time, round trip in ms)
        self.stopping = threading.Event()

    def _wait(self, kind: int) -> wire.Packet:
        while True:
            packet = self.reader.next_packet()
            if packet is not None and packet.type == kind:
                return packet
            if packet is None:
                data = self.sock.recv(65536)
                if not data:
                    raise RuntimeError("victim: the edge closed the connection")
                self.reader.feed(data)

    def run(self) -> None:
        for n in itertools.count():
            if self.stopping.is_set():
                return
            started = time.monotonic()
            self.sock.sendall(wire.publish("victim/rtt", n.to_bytes(8, "big")))
            self._wait(wire.PacketType.PUBLISH)
            ended = time.monotonic()
            self.samples.append((ended, (ended - started) * 1000))
            time.sleep(0.005)

    def between(self, start: float, end: float) -> list[float]:
        return [rtt for at, rtt in self.samples if start <= at < end]


def _big_header(port: int, seconds: float) -> None:
    sock = _connect(port, "big-header")
    sock.sendall(b"\x30" + wire.encode_remaining_length(100_000_000) + wire.encode_string("t"))
    chunk = b"\x00" * 65536
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            sock.sendall(chunk)
            time.sleep(0.01)
    except OSError:
        pass  # refused and closed: what the fix does
    sock.close()


def _deep_filter(port: int, seconds: float) -> None:
    sock = _connect(port, "deep-filter")
    sock.sendall(wire.subscribe(1, [("a/" * 32_700 + "a", 0)]))
    for n in range(2, 1002):  # 1,000 distinct 128-level filters, one SUBSCRIBE each
        sock.sendall(wire.subscribe(n, [(f"{n}/" + "/".join(["+"] * 127), 0)]))
    time.sleep(seconds)
    sock.close()


def _long_topics(port: int, seconds: float) -> None:
    del seconds  # as fast as the edge reads them
    sock = _connect(port, "long-topics")
    pad = "x" * 60_000
    for n in range(3000):
        sock.sendall(wire.publish(f"{n}/{pad}", b"p"))
    sock.close()


def _overlap(port: int, seconds: float) -> None:
    levels = 13
    sock = _connect(port, "overlap")
    filters = [
        "/".join("+" if bits >> i & 1 else f"l{i}" for i in range(levels))
        for bits in range(2**levels)
    ]
    for n in range(0, len(filters), 64):
        sock.sendall(wire.subscribe(1 + n // 64, [(f, 0) for f in filters[n : n + 64]]))
    _flood(sock, "/".join(f"l{i}" for i in range(levels)), seconds)


def _no_reader(port: int, seconds: float) -> None:
    sock = _connect(port, "no-reader")
    sock.sendall(wire.subscribe(1, [("self/#", 0)]))
    _send_flat_out(sock, wire.publish("self/x", b"x" * 65536), seconds)
    time.sleep(0.5)  # still connected and not reading while the RSS is sampled
    sock.close()


def _flood_only(port: int, seconds: float) -> None:
    _flood(_connect(port, "flood"), "nobody/reads/this", seconds)


def _flood(sock: socket.socket, topic: str, seconds: float) -> None:
    _send_flat_out(sock, wire.publish(topic, b"x" * 16) * 256, seconds)
    sock.close()


def _send_flat_out(sock: socket.socket, data: bytes, seconds: float) -> None:
    """Send ``data`` again and again for ``seconds``, as fast as the socket takes it (whole
    packets only: a partial send is completed before the next)."""
    deadline = time.monotonic() + seconds
    sock.setblocking(False)
    pending = memoryview(data)
    try:
        while time.monotonic() < deadline:
            try:
                pending = pending[sock.send(pending) :]
            except BlockingIOError:
                time.sleep(0.001)
            if not pending:
                pending = memoryview(data)
    except OSError:
        pass  # the edge closed the connection


SCENARIOS: dict[str, Callable[[int, float], None]] = {
    "big_header": _big_header,
    "deep_filter": _deep_filter,
    "long_topics": _long_topics,
    "overlap": _overlap,
    "flood": _flood_only,
    "no_reader": _no_reader,
}


def _stats(rtts: list[float]) -> dict[str, float | int]:
    if not rtts:
        return {"n": 0}
    ordered = sorted(rtts)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered), 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 2),
        "max_ms": round(ordered[-1], 2),
    }


def run_scenario(name: str, seconds: float, config: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-abuse-") as data_dir:
        extra = ["--config", config] if config else []
        edge = start_edgebus(data_dir, node_id="abuse", extra_args=extra)
        try:
            victim = Victim(edge.port)
            victim.start()
            sampler = RssSampler(edge.pid)
            alone_start = time.monotonic()
            time.sleep(seconds)
            before = rss_kib(edge.pid) or 0
            attack_start = time.monotonic()
            attacker = threading.Thread(target=SCENARIOS[name], args=(edge.port, seconds))
            attacker.start()
            while attacker.is_alive():
                sampler.sample()
                attacker.join(0.05)
            attack_end = time.monotonic()
            settle = attack_end + 1.0
            while time.monotonic() < settle:
                sampler.sample()
                time.sleep(0.05)
            after = rss_kib(edge.pid) or 0
            victim.stopping.set()
            victim.join(TIMEOUT)
            peak = max(sampler.peak or 0, before)
            alone = _stats(victim.between(alone_start, attack_start))
            attacked = _stats(victim.between(attack_start, attack_end))
            return {
                "scenario": name,
                "attack_seconds": round(attack_end - attack_start, 2),
                "rss_before_mib": round(before / 1024, 1),
                "rss_peak_delta_mib": round((peak - before) / 1024, 1),
                "rss_after_delta_mib": round((after - before) / 1024, 1),
                "victim_alone": alone,
                "victim_attacked": attacked,
            }
        finally:
            edge.stop()
            edge.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.abuse", description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--config", help="an edge settings file (default: shipped defaults)")
    args = parser.parse_args(argv)
    started = datetime.now(UTC)
    names = args.scenarios.split(",")
    results = [run_scenario(name, args.seconds, args.config) for name in names]
    print(
        f"{'scenario':<12} {'rss +peak':>10} {'rss +after':>11} "
        f"{'victim p50/p99/max alone (ms)':>30} {'under attack (ms)':>24}"
    )
    for r in results:
        a, b = r["victim_alone"], r["victim_attacked"]
        alone = f"{a.get('p50_ms')}/{a.get('p99_ms')}/{a.get('max_ms')}"
        attacked = f"{b.get('p50_ms')}/{b.get('p99_ms')}/{b.get('max_ms')} (n={b['n']})"
        rss = f"{r['rss_peak_delta_mib']:>8} MiB {r['rss_after_delta_mib']:>8} MiB"
        print(f"{r['scenario']:<12} {rss} {alone:>30} {attacked:>24}")
    report = {
        "timestamp": started.isoformat(),
        "timestamp_compact": started.strftime("%Y%m%dT%H%M%SZ"),
        "seconds": args.seconds,
        "config": args.config,
        "results": results,
    }
    out = write_report(report, RESULTS, "abuse")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
