"""MQTT 3.1.1 load generator for any broker: publisher and subscriber processes, scenarios.

Theory of operation
-------------------
A scenario is a list of publisher clients (client id, topic) and subscriber clients (client
id, filter). The parent spreads them over worker processes (multiprocessing, spawn), each
running its clients on one uvloop event loop, and talks to every worker over a pipe:

1. workers connect (subscribers also subscribe) and answer ("ready",);
2. the parent sends ("go", start_ns, deadline_ns) to all; publishers wait for start_ns and
   send until deadline_ns or their message count, then report ("done", result);
3. the parent works out how many messages each subscriber worker should get (topics matched
   against filters, times what was sent) and sends ("finish", expected, idle_s, max_s);
   subscribers wait until they have that many, or nothing arrived for idle_s, or max_s.

Publishers send pre-encoded batches (`wire.PublishBatch`) stamped with one
`time.monotonic_ns()` per batch. At QoS 0 each connection writes a batch, yields to the loop
and waits whenever the transport pauses writing (TCP backpressure); at QoS 1 a connection has
at most `window` unacknowledged messages. With `rate` set, sends are paced to that total rate.
On top of that, all publishers together keep at most `e2e_window` deliveries in flight end to
end (`_Gate`, through a shared-memory array of sent and received counts), so a broker slower
than the generator is measured at its own pace rather than buried under socket buffers.
Subscribers count publishes with `wire.PublishScanner`, answer QoS 1 with PUBACKs in the same
pass, sample the latency of every k-th message, and record their cumulative count every
TIMELINE_STEP_S (deliveries over time, stalls, and their own loop's lateness).

The `idle` scenario is different: N clients connect and sit idle while the broker's RSS and
CPU are sampled; see `idle()`.

Against the null sink (`Target.null`) nothing is routed: publishers show their maximum send
rate, subscribers the rate at which the sink can flood them; neither "loss" nor latency means
anything there.

Run `python -m bench.loadgen --help`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import logging
import math
import multiprocessing
import os
import resource
import secrets
import ssl
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

from bench import BenchError, wire
from broker_edge.topics import matches as topic_matches

log = logging.getLogger(__name__)

SCENARIOS = ("fanin", "pairs", "fanout", "idle")
# The end-to-end window never holds fewer than this many published messages: with 1,000
# subscribers a window of 20,000 deliveries is 20 messages, too few to keep a broker that
# delivers in batches (edgebus: after each journal group commit) busy.
E2E_MIN_MESSAGES = 300
TIMELINE_STEP_S = 0.25  # subscribers record their cumulative count this often (stall detection)


class LoadgenError(BenchError):
    """A worker failed, or did not answer in time."""


@dataclass(frozen=True)
class Target:
    """Where to send: a broker's address, its pid (for CPU accounting), and whether it is
    the null sink (nothing is delivered, so loss is not measured)."""

    host: str
    port: int
    pid: int | None = None
    null: bool = False


@dataclass(frozen=True)
class LoadOptions:
    qos: int = 0
    duration: float = 10.0  # seconds of publishing (also the cap when `count` is set)
    count: int | None = None  # messages per publisher connection
    rate: float | None = None  # total msgs/s over all publishers; None = as fast as possible
    payload_size: int = 64
    batch: int = 64  # QoS 0 packets per write
    window: int = 32  # QoS 1 in-flight messages per connection
    pub_procs: int | None = None  # default: min(publishers, CPUs)
    sub_procs: int | None = None  # default: min(subscribers, CPUs)
    sample_every: int = 16  # latency sample interval (grows when the sample cap is hit)
    drain_timeout: float = 30.0  # after publishing: max wait for acks and deliveries
    idle_timeout: float = 10.0  # subscribers stop early after this long with nothing new
    connect_timeout: float = 10.0
    worker_cpus: tuple[int, ...] | None = None  # pin the worker processes to these CPUs
    keepalive: int = 0  # CONNECT keepalive in seconds (0 = none); idle clients ping at half
    # End-to-end flow control: at most this many deliveries in flight from publishers to
    # subscribers (sent x fan-out - received, over all processes); None = unbounded.
    e2e_window: int | None = 20_000
    connect_concurrency: int = 64  # idle scenario: handshakes in progress per worker process
    username: str | None = None  # CONNECT user name (an edgebus tenant token), None = none
    # MQTT over TLS: the CA file (PEM) the broker's certificate is verified with; None = TCP.
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        if self.qos not in (0, 1):
            raise ValueError("qos must be 0 or 1")
        if not 0 < self.duration <= 3600:
            raise ValueError("duration must be in (0, 3600] seconds")
        if self.count is not None and self.count < 1:
            raise ValueError("count must be positive")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")
        if self.payload_size < wire.STAMP_SIZE:
            raise ValueError(f"payload_size must be at least {wire.STAMP_SIZE}")
        if self.batch < 1 or not 1 <= self.window <= 65535:
            raise ValueError("batch must be >= 1 and window in 1..65535")
        if not 0 <= self.keepalive <= 65535:
            raise ValueError("keepalive must be in 0..65535")
        if self.connect_concurrency < 1:
            raise ValueError("connect_concurrency must be positive")
        if self.e2e_window is not None and self.e2e_window < 1:
            raise ValueError("e2e_window must be positive (or None)")


# --- worker side -------------------------------------------------------------------------


@dataclass(frozen=True)
class _WorkerSpec:
    role: str  # "pub" or "sub"
    host: str
    port: int
    clients: tuple[tuple[str, str], ...]  # (client id, topic or filter)
    options: LoadOptions
    rate_per_client: float | None = None
    reset_on_go: bool = False
    slot: int = -1  # this worker's counter in the shared array (end-to-end flow control)
    pub_slots: int = 0  # counters[:pub_slots] are messages sent, the rest messages received
    fanout: int = 1  # deliveries per published message
    e2e_window: int = 0  # deliveries in flight allowed by the _Gate (0 = no gate)


class _Gate:
    """End-to-end flow control for the publishers of one worker process.

    Every publisher worker adds what it sends to its counter in a shared array, every
    subscriber worker stores what it has received in its own; before each write a publisher
    checks that sent x fan-out - received (all processes) stays below the window, else it
    waits here and is pumped again, polled every millisecond, when the subscribers catch up.
    Without it, a QoS 0 publisher faster than the broker fills the kernel's socket buffers
    (tens of MB per connection with receive-buffer autotuning), and a 10 s run at 100
    publishers becomes minutes of draining a backlog that says nothing about the broker.
    """

    def __init__(self, counters: Any, spec: _WorkerSpec, window: int) -> None:
        self.counters = counters
        self.slot = spec.slot
        self.pub_slots = spec.pub_slots
        self.fanout = max(1, spec.fanout)
        self.window = window
        self.loop = asyncio.get_running_loop()
        self.blocked: set[_Publisher] = set()
        self.timer: asyncio.TimerHandle | None = None
        self.waits = 0

    def allowed(self) -> int:
        """Messages a publisher may send now."""
        c = self.counters
        p = self.pub_slots
        in_flight: int = self.fanout * sum(c[:p]) - sum(c[p:])
        return (self.window - in_flight) // self.fanout

    def sent(self, n: int) -> None:
        self.counters[self.slot] += n

    def block(self, publisher: _Publisher) -> None:
        if publisher not in self.blocked:
            self.blocked.add(publisher)
            self.waits += 1
        if self.timer is None:
            self.timer = self.loop.call_later(0.001, self._poll)

    def unblock(self, publisher: _Publisher) -> None:
        self.blocked.discard(publisher)

    def _poll(self) -> None:
        self.timer = None
        if not self.blocked:
            return
        now = time.monotonic_ns()
        if self.allowed() >= 1 or any(now >= p.deadline_ns for p in self.blocked):
            publishers = list(self.blocked)
            self.blocked.clear()
            for publisher in publishers:
                publisher._pump()  # sends, stops at the deadline, or blocks again
        if self.blocked and self.timer is None:
            self.timer = self.loop.call_later(0.001, self._poll)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.blocked.clear()


class _Client(asyncio.Protocol):
    """Connection plumbing shared by publishers and subscribers."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.connack: asyncio.Future[int] = self.loop.create_future()
        self.suback: asyncio.Future[list[int]] | None = None  # only while subscribing
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self.resumed: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement, but do not subclass, asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        for done in (self.closed, self.resumed):
            if done is not None and not done.done():
                done.set_result(None)
        self.resumed = None
        for pending in (self.connack, self.suback):  # someone is awaiting these
            if pending is not None and not pending.done():
                pending.set_exception(ConnectionError(f"connection lost: {exc}"))

    def pause_writing(self) -> None:
        self.resumed = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)
        self.resumed = None

    def on_control(self, packet: wire.Packet) -> None:
        if packet.type == wire.PacketType.CONNACK and not self.connack.done():
            self.connack.set_result(wire.parse_connack(packet))
        elif packet.type == wire.PacketType.SUBACK and self.suback and not self.suback.done():
            self.suback.set_result(wire.parse_suback(packet)[1])

    async def handshake(
        self, client_id: str, timeout: float, keepalive: int = 0, username: str | None = None
    ) -> None:
        assert self.transport is not None
        self.transport.write(wire.connect(client_id, keepalive=keepalive, username=username))
        code = await asyncio.wait_for(self.connack, timeout)
        if code:
            raise LoadgenError(f"{client_id}: CONNACK return code {code}")

    async def subscribe(self, topic_filter: str, qos: int, timeout: float) -> None:
        assert self.transport is not None
        self.suback = self.loop.create_future()
        self.transport.write(wire.subscribe(1, [(topic_filter, qos)]))
        codes = await asyncio.wait_for(self.suback, timeout)
        if codes[0] == 0x80:
            raise LoadgenError(f"subscription to {topic_filter!r} refused")

    async def close(self, timeout: float) -> None:
        """DISCONNECT, flush and close; abort if the peer does not take the bytes in time."""
        if self.transport is None or self.closed.done():
            return
        self.transport.write(wire.DISCONNECT)
        self.transport.close()
        try:
            # shield: on timeout wait_for would cancel `closed` itself, and the await below
            # would then raise CancelledError instead of waiting for connection_lost().
            await asyncio.wait_for(asyncio.shield(self.closed), timeout)
        except TimeoutError:
            self.transport.abort()
            await self.closed


class _Publisher(_Client):
    """One publishing connection, driven by callbacks rather than a coroutine per batch.

    `_pump()` writes the next batch whenever sending is allowed and is called again from
    wherever the reason to wait goes away: the next loop iteration (QoS 0 at full speed),
    `data_received` (QoS 1 acks freed the window), `resume_writing` (TCP backpressure ended)
    or a timer (rate pacing). At QoS 1 the window is refilled only once a quarter of it is
    free, so one write carries several messages even when the broker acks one at a time.
    """

    def __init__(self) -> None:
        super().__init__()
        self.acked = 0
        self.ack_waiter: asyncio.Future[None] | None = None
        self.seq = 0
        self.first_ns = 0
        self.last_ns = 0
        self.sending = False
        self.send_done: asyncio.Future[None] = self.loop.create_future()
        self._timer: asyncio.Handle | None = None
        self.gate: _Gate | None = None

    def data_received(self, data: bytes) -> None:
        if not self.buf:
            # The usual chunk is nothing but PUBACKs: count them without copying.
            n, used = wire.count_pubacks(data)
            if used == len(data):
                self._on_acks(n)
                return
        buf = self.buf
        buf += data
        acked = 0
        while buf:
            n, used = wire.count_pubacks(buf)
            if used:
                acked += n
                del buf[:used]
                continue
            header = wire.read_header(buf, 0)
            if header is None or header[0] + header[1] > len(buf):
                break
            end = header[0] + header[1]
            packet = wire.Packet(buf[0] >> 4, buf[0] & 0x0F, bytes(buf[header[0] : end]))
            del buf[:end]
            self.on_control(packet)
        if acked:
            self._on_acks(acked)

    def _on_acks(self, n: int) -> None:
        self.acked += n
        if self.ack_waiter is not None and not self.ack_waiter.done():
            self.ack_waiter.set_result(None)
        if self.sending:
            self._pump()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.sending:
            self._pump()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._stop_sending()

    async def wait_acks(self, timeout: float) -> None:
        self.ack_waiter = self.loop.create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ack_waiter, timeout)
        self.ack_waiter = None

    async def run(
        self, topic: str, spec: _WorkerSpec, start_ns: int, deadline_ns: int
    ) -> dict[str, int]:
        """Publish until the deadline or the count; return sent/acked and send times."""
        opts = spec.options
        self.qos = opts.qos
        self.size = opts.window if opts.qos else opts.batch
        self.batch = wire.PublishBatch(topic, opts.payload_size, qos=opts.qos, size=self.size)
        self.window = opts.window
        self.refill = max(1, opts.window // 4)
        self.limit = opts.count if opts.count is not None else 1 << 62
        self.rate = spec.rate_per_client
        self.start_ns = start_ns
        self.deadline_ns = deadline_ns
        await asyncio.sleep(max(0.0, (start_ns - time.monotonic_ns()) / 1e9))
        self.sending = not self.closed.done()
        self._pump()
        with contextlib.suppress(TimeoutError):
            timeout = (deadline_ns - time.monotonic_ns()) / 1e9 + 0.05
            await asyncio.wait_for(self.send_done, max(timeout, 0.0))
        self._stop_sending()
        if self.qos:
            drain_end = time.monotonic() + opts.drain_timeout
            while self.acked < self.seq and not self.closed.done():
                left = drain_end - time.monotonic()
                if left <= 0:
                    break
                await self.wait_acks(left)
        return {
            "sent": self.seq,
            "acked": self.acked,
            "first_ns": self.first_ns,
            "last_ns": self.last_ns,
        }

    def _pump(self) -> None:
        if not self.sending:
            return
        now = time.monotonic_ns()
        seq = self.seq
        if now >= self.deadline_ns or seq >= self.limit:
            self._stop_sending()
            return
        if self.resumed is not None:
            return  # resume_writing() pumps again
        n = min(self.size, self.limit - seq)
        if self.qos:
            in_flight = seq - self.acked
            free = self.window - in_flight
            if in_flight and free < self.refill:
                return  # data_received() pumps again
            n = min(n, free)
        if self.rate is not None:
            due = int((now - self.start_ns) * self.rate / 1e9) + 1 - seq
            if due <= 0:
                next_ns = self.start_ns + int((seq + 1) * 1e9 / self.rate)
                # Event-loop timers are only millisecond-accurate (libuv): sleep at least 1 ms
                # and send what fell due meanwhile as one batch, rather than spin.
                self._schedule(max(0.001, (min(next_ns, self.deadline_ns) - now) / 1e9))
                return
            n = min(n, due)
        if self.gate is not None:
            allowed = self.gate.allowed()
            if allowed < 1:
                self.gate.block(self)  # the gate pumps again
                return
            n = min(n, allowed)
            self.gate.sent(n)
        assert self.transport is not None
        self.transport.write(self.batch.fill(n, now, seq))
        self.seq = seq + n
        self.first_ns = self.first_ns or now
        self.last_ns = now
        if not self.qos or self.rate is not None:
            self._schedule(0.0)

    def _schedule(self, delay: float) -> None:
        if self._timer is None:
            self._timer = (
                self.loop.call_soon(self._on_timer)
                if delay <= 0
                else self.loop.call_later(delay, self._on_timer)
            )

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()

    def _stop_sending(self) -> None:
        self.sending = False
        if self.gate is not None:
            self.gate.unblock(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.send_done.done():
            self.send_done.set_result(None)


class _Subscriber(_Client):
    def __init__(
        self,
        scanner: wire.PublishScanner,
        progress: asyncio.Event,
        counters: Any = None,
        slot: int = -1,
    ) -> None:
        super().__init__()
        self.scanner = scanner
        self.progress = progress
        self.counters = counters  # shared with the publishers' _Gate, or None
        self.slot = slot

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        acks = bytearray()
        others: list[wire.Packet] = []
        if self.scanner.scan(buf, time.monotonic_ns(), acks, others):
            self.progress.set()
            if self.counters is not None:
                self.counters[self.slot] = self.scanner.count
        if acks:
            assert self.transport is not None
            self.transport.write(bytes(acks))
        for packet in others:
            self.on_control(packet)


class _Pipe:
    """The worker's end of the parent pipe, readable from the event loop."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        asyncio.get_running_loop().add_reader(conn.fileno(), self._readable)

    def _readable(self) -> None:
        while self.conn.poll():
            try:
                self.queue.put_nowait(self.conn.recv())
            except EOFError:
                self.queue.put_nowait(("eof",))
                asyncio.get_running_loop().remove_reader(self.conn.fileno())
                return

    async def get(self, expect: str, timeout: float) -> tuple[Any, ...]:
        msg = await asyncio.wait_for(self.queue.get(), timeout)
        if msg[0] != expect:
            raise LoadgenError(f"worker expected {expect!r} from the parent, got {msg[0]!r}")
        return msg

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.conn.fileno())


def _cpu_now() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _connect(spec: _WorkerSpec, factory: Any, client_id: str) -> Any:
    loop = asyncio.get_running_loop()
    timeout = spec.options.connect_timeout
    tls = _client_tls(spec.options.tls_ca) if spec.options.tls_ca else None
    _, proto = await asyncio.wait_for(
        loop.create_connection(factory, spec.host, spec.port, ssl=tls), timeout
    )
    try:
        await proto.handshake(client_id, timeout, spec.options.keepalive, spec.options.username)
    except BaseException:
        if proto.transport is not None:
            proto.transport.abort()
        raise
    return proto


@functools.cache
def _client_tls(cafile: str) -> ssl.SSLContext:
    """One client context per worker process: verifies the broker against ``cafile`` (its
    certificate names the host the generator connects to), TLS 1.2 at least."""
    context = ssl.create_default_context(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


async def _publisher_worker(
    spec: _WorkerSpec, conn: Connection, counters: Any = None
) -> dict[str, Any]:
    pipe = _Pipe(conn)
    clients: list[_Publisher] = []
    window = spec.e2e_window
    gate = _Gate(counters, spec, window) if counters is not None and window else None
    try:
        for client_id, _ in spec.clients:
            clients.append(await _connect(spec, _Publisher, client_id))
            clients[-1].gate = gate
        conn.send(("ready",))
        _, start_ns, deadline_ns = await pipe.get("go", spec.options.connect_timeout + 60)
        cpu0 = _cpu_now()
        results = await asyncio.gather(
            *(
                client.run(topic, spec, start_ns, deadline_ns)
                for client, (_, topic) in zip(clients, spec.clients, strict=True)
            )
        )
        cpu = _cpu_now() - cpu0
    finally:
        if gate is not None:
            gate.close()
        await asyncio.gather(*(client.close(spec.options.drain_timeout) for client in clients))
        pipe.close()
    sent = {topic: r["sent"] for (_, topic), r in zip(spec.clients, results, strict=True)}
    starts = [r["first_ns"] for r in results if r["first_ns"]]
    return {
        "sent_by_topic": sent,
        "acked": sum(r["acked"] for r in results),
        "first_ns": min(starts, default=0),
        "last_ns": max((r["last_ns"] for r in results), default=0),
        "gate_waits": gate.waits if gate is not None else None,
        "cpu_s": cpu,
    }


async def _subscriber_worker(
    spec: _WorkerSpec, conn: Connection, counters: Any = None
) -> dict[str, Any]:
    pipe = _Pipe(conn)
    opts = spec.options
    scanner = wire.PublishScanner(sample_every=opts.sample_every)
    progress = asyncio.Event()
    clients: list[_Subscriber] = []
    timeline: list[tuple[int, int]] = []
    recorder: asyncio.Task[None] | None = None
    try:
        for client_id, topic_filter in spec.clients:
            client = await _connect(
                spec, lambda: _Subscriber(scanner, progress, counters, spec.slot), client_id
            )
            clients.append(client)
            await client.subscribe(topic_filter, opts.qos, opts.connect_timeout)
        conn.send(("ready",))
        _, start_ns, _ = await pipe.get("go", opts.connect_timeout + 60)
        cpu0 = _cpu_now()
        if spec.reset_on_go:
            scanner.reset()
            for client in clients:  # the null sink starts flooding on this PINGREQ
                assert client.transport is not None
                client.transport.write(wire.PINGREQ)
        steps = int((opts.duration + opts.drain_timeout + 60) / TIMELINE_STEP_S)
        recorder = asyncio.create_task(_record_timeline(scanner, start_ns, timeline, steps))
        _, expected, idle_s, max_s = await pipe.get("finish", opts.duration + 3600)
        end = time.monotonic() + max_s
        while expected is not None and scanner.count < expected:
            left = end - time.monotonic()
            if left <= 0:
                break
            progress.clear()
            try:
                await asyncio.wait_for(progress.wait(), min(idle_s, left))
            except TimeoutError:
                break  # idle: nothing arrived for idle_s
        cpu = _cpu_now() - cpu0
    finally:
        if recorder is not None:
            recorder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await recorder
        await asyncio.gather(*(client.close(opts.drain_timeout) for client in clients))
        pipe.close()
    return {
        "received": scanner.count,
        "first_ns": scanner.first_ns,
        "last_ns": scanner.last_ns,
        "samples": scanner.samples,
        "timeline": [count for _, count in timeline],
        "stall_max_s": _longest_stall(timeline),
        "loop_lag_max_s": max(
            (at - k * TIMELINE_STEP_S * 1e9 for k, (at, _) in enumerate(timeline)), default=0
        )
        / 1e9,
        "cpu_s": cpu,
    }


async def _record_timeline(
    scanner: wire.PublishScanner, start_ns: int, out: list[tuple[int, int]], steps: int
) -> None:
    """Append (ns since start_ns, cumulative receive count), due at k * TIMELINE_STEP_S.

    The due times are the same in every worker, so the parent can add the counts up; the
    actual times show how late this worker's loop was (a busy generator, not the broker)."""
    step_ns = int(TIMELINE_STEP_S * 1e9)
    for k in range(steps):
        await asyncio.sleep(max(0.0, (start_ns + k * step_ns - time.monotonic_ns()) / 1e9))
        out.append((time.monotonic_ns() - start_ns, scanner.count))


def _longest_stall(timeline: list[tuple[int, int]]) -> float:
    """Longest time (s, by the actual sample times) the count stood still between the first
    and the last delivery."""
    longest = 0
    since: int | None = None  # time of the first sample of the current flat stretch
    previous: tuple[int, int] | None = None
    final = timeline[-1][1] if timeline else 0
    for at, count in timeline:
        if previous is not None and count == previous[1] and 0 < count < final:
            since = previous[0] if since is None else since
            longest = max(longest, at - since)
        else:
            since = None
        previous = (at, count)
    return longest / 1e9


class _IdleClient(_Client):
    """A connection that only answers the handshake and, with a keepalive, pings."""

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while buf:
            header = wire.read_header(buf, 0)
            if header is None or header[0] + header[1] > len(buf):
                break
            end = header[0] + header[1]
            packet = wire.Packet(buf[0] >> 4, buf[0] & 0x0F, bytes(buf[header[0] : end]))
            del buf[:end]
            self.on_control(packet)  # CONNACK; PINGRESP and anything else are ignored


async def _idle_worker(spec: _WorkerSpec, conn: Connection, counters: Any = None) -> dict[str, Any]:
    """Open the clients (`connect_concurrency` handshakes at a time), report, hold them idle
    until the parent says "finish", then close them; see `idle()`."""
    pipe = _Pipe(conn)
    opts = spec.options
    clients: list[_IdleClient] = []
    errors: dict[str, int] = {}
    pinger: asyncio.Task[None] | None = None
    try:
        conn.send(("ready",))
        await pipe.get("go", opts.connect_timeout + 60)
        cpu0 = _cpu_now()
        gate = asyncio.Semaphore(opts.connect_concurrency)

        async def open_one(client_id: str) -> None:
            async with gate:
                try:
                    clients.append(await _connect(spec, _IdleClient, client_id))
                except (OSError, TimeoutError, LoadgenError) as exc:
                    key = f"{type(exc).__name__}: {exc}"[:200]
                    errors[key] = errors.get(key, 0) + 1

        t0 = time.monotonic()
        await asyncio.gather(*(open_one(client_id) for client_id, _ in spec.clients))
        connect_s = time.monotonic() - t0
        conn.send(("connected", {"connected": len(clients), "connect_s": connect_s}))
        if opts.keepalive:
            pinger = asyncio.create_task(_ping(clients, opts.keepalive / 2))
        await pipe.get("finish", opts.duration + 3600)
        lost = sum(1 for client in clients if client.closed.done())
        cpu = _cpu_now() - cpu0
    finally:
        if pinger is not None:
            pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pinger
        await asyncio.gather(*(client.close(opts.drain_timeout) for client in clients))
        pipe.close()
    return {
        "connected": len(clients),
        "failed": sum(errors.values()),
        "errors": errors,
        "lost": lost,
        "connect_s": connect_s,
        "cpu_s": cpu,
    }


async def _ping(clients: list[_IdleClient], interval: float) -> None:
    """PINGREQ on every open client each `interval` seconds; cancelled by the worker."""
    while True:
        await asyncio.sleep(interval)
        for client in clients:
            if client.transport is not None and not client.closed.done():
                client.transport.write(wire.PINGREQ)


def raise_nofile() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


_WORKERS = {"pub": _publisher_worker, "sub": _subscriber_worker, "idle": _idle_worker}


def _worker_main(spec: _WorkerSpec, conn: Connection, counters: Any = None) -> None:
    """Entry point of a spawned worker process."""
    worker = _WORKERS[spec.role]
    raise_nofile()
    if spec.options.worker_cpus:
        os.sched_setaffinity(0, spec.options.worker_cpus)
    try:
        try:
            reply: tuple[Any, ...] = ("done", _run_loop(worker(spec, conn, counters)))
        except Exception as exc:  # report every failure to the parent, then exit
            reply = ("error", f"{spec.role} worker: {type(exc).__name__}: {exc}")
        # The event loop made the pipe non-blocking; a big result must not hit EAGAIN.
        os.set_blocking(conn.fileno(), True)
        conn.send(reply)
    finally:
        conn.close()


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop  # optional, about twice as fast as the default loop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


# --- parent side -------------------------------------------------------------------------


def _split(items: list[tuple[str, str]], procs: int) -> list[tuple[tuple[str, str], ...]]:
    procs = max(1, min(procs, len(items)))
    return [tuple(items[i::procs]) for i in range(procs)]


def _split_by_target(
    clients: list[tuple[str, str]], procs: int, default: Target, where: Mapping[str, Target]
) -> list[tuple[Target, tuple[tuple[str, str], ...]]]:
    """`_split` the clients of each broker (default, or as `where` says by client id) over
    `procs` processes in all, at least one per broker."""
    by_target: dict[Target, list[tuple[str, str]]] = {}
    for client in clients:
        by_target.setdefault(where.get(client[0], default), []).append(client)
    per_target = max(1, procs // max(1, len(by_target)))
    return [(at, group) for at, items in by_target.items() for group in _split(items, per_target)]


def _percentiles(samples: list[int]) -> dict[str, float | int | None]:
    if not samples:
        return {"p50": None, "p90": None, "p99": None, "max": None, "samples": 0}
    ordered = sorted(samples)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] / 1e6

    return {
        "p50": rank(0.50),
        "p90": rank(0.90),
        "p99": rank(0.99),
        "max": ordered[-1] / 1e6,
        "samples": len(ordered),
    }


@dataclass
class _Workers:
    """Spawned worker processes with their pipes; always cleaned up by `close()`."""

    procs: list[multiprocessing.process.BaseProcess] = field(default_factory=list)
    pipes: list[Connection] = field(default_factory=list)
    specs: list[_WorkerSpec] = field(default_factory=list)

    def start(self, spec: _WorkerSpec, counters: Any = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(spec, child, counters), daemon=True)
        proc.start()
        child.close()
        self.procs.append(proc)
        self.pipes.append(parent)
        self.specs.append(spec)

    def expect(self, indexes: list[int], kind: str, timeout: float) -> list[Any]:
        """Wait for one message of `kind` from each worker in `indexes`."""
        deadline = time.monotonic() + timeout
        out = []
        for i in indexes:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pipes[i].poll(left):
                raise LoadgenError(f"{self.specs[i].role} worker {i} did not report {kind!r}")
            try:
                msg = self.pipes[i].recv()
            except EOFError:
                self.procs[i].join(1)
                code = self.procs[i].exitcode
                raise LoadgenError(f"{self.specs[i].role} worker {i} died (exit {code})") from None
            if msg[0] == "error":
                raise LoadgenError(msg[1])
            if msg[0] != kind:
                raise LoadgenError(f"worker {i} sent {msg[0]!r}, expected {kind!r}")
            out.append(msg[1] if len(msg) > 1 else None)
        return out

    def close(self) -> None:
        # Closing our ends first makes any worker still waiting for the parent see EOF and exit.
        for pipe in self.pipes:
            pipe.close()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for proc in self.procs:
            proc.close()


def run_clients(
    target: Target,
    options: LoadOptions,
    publishers: list[tuple[str, str]],
    subscribers: list[tuple[str, str]],
    *,
    where: Mapping[str, Target] | None = None,
) -> dict[str, Any]:
    """Run publishers (client id, topic) and subscribers (client id, filter); see the module
    docstring for the protocol. Returns the aggregated result.

    Every client connects to `target` unless `where` names another broker for its client id
    (brokers joined into one bus: a worker process serves the clients of one broker); the
    broker CPU is then that of every broker with a pid."""
    from bench.brokers import cpu_seconds, per_cpu_busy  # parent-only import

    cpus = os.cpu_count() or 1
    where = where or {}
    pub_groups = _split_by_target(publishers, options.pub_procs or cpus, target, where)
    sub_groups = _split_by_target(subscribers, options.sub_procs or cpus, target, where)
    pids = {t.pid for t in (target, *where.values()) if t.pid}

    def broker_cpu() -> float | None:
        spent = [cpu_seconds(pid) for pid in pids]
        return None if not spent or None in spent else sum(s or 0.0 for s in spent)

    rate_per_client = options.rate / len(publishers) if options.rate else None
    # End-to-end flow control (see _Gate); not against the null sink, which routes nothing.
    # Deliveries per message: the most subscriptions any publisher's topic matches.
    fanout = max(
        (sum(topic_matches(f, topic) for _, f in subscribers) for _, topic in publishers),
        default=1,
    )
    counters = None
    window = max(options.e2e_window or 0, E2E_MIN_MESSAGES * fanout)
    if options.e2e_window and not target.null and fanout:
        counters = multiprocessing.get_context("spawn").RawArray(
            "q", len(pub_groups) + len(sub_groups)
        )
    workers = _Workers()
    try:
        for i, (at, group) in enumerate(sub_groups):
            spec = _WorkerSpec(
                "sub",
                at.host,
                at.port,
                group,
                options,
                None,
                target.null,
                slot=len(pub_groups) + i,
            )
            workers.start(spec, counters)
        for i, (at, group) in enumerate(pub_groups):
            spec = _WorkerSpec(
                "pub",
                at.host,
                at.port,
                group,
                options,
                rate_per_client,
                slot=i,
                pub_slots=len(pub_groups),
                fanout=fanout,
                e2e_window=window if counters is not None else 0,
            )
            workers.start(spec, counters)
        subs = list(range(len(sub_groups)))
        pubs = list(range(len(sub_groups), len(workers.procs)))
        workers.expect(subs + pubs, "ready", options.connect_timeout + 60)

        broker_cpu0 = broker_cpu()
        machine0 = per_cpu_busy()
        wall0 = time.monotonic()
        start_ns = time.monotonic_ns() + 100_000_000  # every worker gets "go" before this
        deadline_ns = start_ns + int(options.duration * 1e9)
        for pipe in workers.pipes:
            pipe.send(("go", start_ns, deadline_ns))
        pub_results = workers.expect(pubs, "done", options.duration + options.drain_timeout + 30)

        sent_by_topic: dict[str, int] = {}
        for result in pub_results:
            sent_by_topic.update(result["sent_by_topic"])
        expectations = []
        for _, group in sub_groups:
            expected = sum(
                sent
                for _, topic_filter in group
                for topic, sent in sent_by_topic.items()
                if topic_matches(topic_filter, topic)
            )
            expectations.append(None if target.null else expected)
        for i, expectation in zip(subs, expectations, strict=True):
            workers.pipes[i].send(
                ("finish", expectation, options.idle_timeout, options.drain_timeout)
            )
        sub_results = workers.expect(subs, "done", options.drain_timeout + 30)
        wall = time.monotonic() - wall0
        broker_cpu1 = broker_cpu()
        machine1 = per_cpu_busy()
    finally:
        workers.close()

    result = _aggregate(
        target,
        options,
        pub_results,
        sub_results,
        expectations,
        wall,
        None if broker_cpu0 is None or broker_cpu1 is None else broker_cpu1 - broker_cpu0,
        {name: machine1[name][0] - busy for name, (busy, _) in machine0.items()},
        len(publishers),
        len(subscribers),
    )
    result["e2e_window"] = window if counters is not None else None
    return result


def _aggregate(
    target: Target,
    options: LoadOptions,
    pub_results: list[dict[str, Any]],
    sub_results: list[dict[str, Any]],
    expectations: list[int | None],
    wall: float,
    broker_cpu: float | None,
    machine_busy: dict[str, float],
    n_pubs: int,
    n_subs: int,
) -> dict[str, Any]:
    sent = sum(sum(r["sent_by_topic"].values()) for r in pub_results)
    send_first = min((r["first_ns"] for r in pub_results if r["first_ns"]), default=0)
    send_last = max((r["last_ns"] for r in pub_results), default=0)
    send_s = (send_last - send_first) / 1e9
    received = sum(r["received"] for r in sub_results)
    rx_first = min((r["first_ns"] for r in sub_results if r["first_ns"]), default=0)
    rx_last = max((r["last_ns"] for r in sub_results), default=0)
    rx_s = (rx_last - rx_first) / 1e9
    expected = None if target.null else sum(e or 0 for e in expectations)
    samples: list[int] = []
    for r in sub_results:
        samples.extend(r["samples"])
    pub_cpu = sum(r["cpu_s"] for r in pub_results)
    sub_cpu = sum(r["cpu_s"] for r in sub_results)
    return {
        "target": {"host": target.host, "port": target.port, "null": target.null},
        "options": asdict(options),
        "publishers": n_pubs,
        "subscribers": n_subs,
        "pub_procs": len(pub_results),
        "sub_procs": len(sub_results),
        "sent": sent,
        "acked": sum(r["acked"] for r in pub_results) if options.qos else None,
        "e2e_gate_waits": _sum_or_none(r.get("gate_waits") for r in pub_results),
        "send_duration_s": send_s,
        "send_rate": sent / send_s if send_s > 0 else 0.0,
        "received": received,
        "expected": expected,
        "loss": None if expected is None else expected - received,
        "duration_s": rx_s,
        "msgs_per_s": received / rx_s if rx_s > 0 else 0.0,
        "latency_ms": _percentiles(samples),
        # stall: the longest stretch in which a subscriber process got nothing between its
        # first and last delivery (a broker pausing); lag: how late that process's own loop
        # ran (a busy generator; stalls shorter than the lag may be the generator's).
        "timeline": timeline_stats(_sum_timelines(sub_results), send_s)
        | {
            "tail_s": (rx_last - send_last) / 1e9 if rx_last and send_last else None,
            "stall_max_s": max((r["stall_max_s"] for r in sub_results), default=None),
            "generator_loop_lag_max_s": max(
                (r["loop_lag_max_s"] for r in sub_results), default=None
            ),
        },
        "cpu": {
            "wall_s": wall,
            "publishers_s": pub_cpu,
            "subscribers_s": sub_cpu,
            "broker_s": broker_cpu,
            "publishers_cores": pub_cpu / wall if wall else None,
            "subscribers_cores": sub_cpu / wall if wall else None,
            "broker_cores": broker_cpu / wall if wall and broker_cpu is not None else None,
            # Everything busy on the machine; what the three above do not explain is other
            # programs (and the parent), which a shared 2-core machine makes worth knowing.
            "machine_busy_cores": machine_busy["cpu"] / wall if wall else None,
            "per_cpu_busy": {
                name: busy / wall for name, busy in machine_busy.items() if name != "cpu"
            }
            if wall
            else None,
            "cpus": os.cpu_count(),
        },
    }


def _sum_or_none(values: Any) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _sum_timelines(sub_results: list[dict[str, Any]]) -> list[int]:
    """Add up the workers' cumulative counts (same sample times; a short list holds its last)."""
    lists = [r["timeline"] for r in sub_results if r.get("timeline")]
    steps = max((len(x) for x in lists), default=0)
    return [sum(x[min(k, len(x) - 1)] for x in lists) for k in range(steps)]


def timeline_stats(cumulative: list[int], send_s: float) -> dict[str, Any]:
    """Deliveries per TIMELINE_STEP_S (all subscribers) from the summed cumulative counts, and
    the slowest and fastest whole second of delivery while publishing (`send_s` seconds from
    the start), the first second left out (ramp-up)."""
    step = TIMELINE_STEP_S
    per_step = [b - a for a, b in itertools.pairwise(cumulative)]
    last = max((i for i, n in enumerate(per_step) if n), default=-1)
    per_s = round(1 / step)
    seconds = [
        sum(per_step[i : i + per_s]) for i in range(per_s, int(send_s / step) - per_s + 1, per_s)
    ]
    return {
        "step_s": step,
        "per_step": per_step[: last + 1],
        "min_rate_1s": min(seconds, default=None),
        "max_rate_1s": max(seconds, default=None),
    }


def _run_id() -> str:
    return secrets.token_hex(4)


def fanin(target: Target, options: LoadOptions, publishers: int = 4) -> dict[str, Any]:
    """P publishers on bench/{run}/{pub} → one subscriber on bench/{run}/#."""
    run = _run_id()
    pubs = [(f"p{run}-{i}", f"bench/{run}/{i:05d}") for i in range(publishers)]
    result = run_clients(target, options, pubs, [(f"s{run}-0", f"bench/{run}/#")])
    return {"scenario": "fanin", **result}


def pairs(target: Target, options: LoadOptions, pairs: int = 4) -> dict[str, Any]:
    """N publisher/subscriber pairs, each pair on its own topic bench/{run}/{i}."""
    run = _run_id()
    topics = [f"bench/{run}/{i:05d}" for i in range(pairs)]
    pubs = [(f"p{run}-{i}", topic) for i, topic in enumerate(topics)]
    subs = [(f"s{run}-{i}", topic) for i, topic in enumerate(topics)]
    return {"scenario": "pairs", **run_clients(target, options, pubs, subs)}


def fanout(target: Target, options: LoadOptions, subscribers: int = 4) -> dict[str, Any]:
    """One publisher on bench/{run}/0 → S subscribers on that same topic."""
    run = _run_id()
    topic = f"bench/{run}/00000"
    subs = [(f"s{run}-{i}", topic) for i in range(subscribers)]
    return {"scenario": "fanout", **run_clients(target, options, [(f"p{run}-0", topic)], subs)}


def idle(
    target: Target, options: LoadOptions, connections: int = 10_000, *, settle_s: float = 2.0
) -> dict[str, Any]:
    """N clients connect (clean session, `options.keepalive`) and sit idle; the broker's RSS
    per connection is (RSS at the end of the hold - RSS before connecting) / connected.

    The clients are spread over `options.sub_procs` processes (default: one per CPU), each
    running `options.connect_concurrency` handshakes at a time. After every client has its
    CONNACK (or failed), the parent waits `settle_s`, then holds the connections for
    `options.duration` seconds sampling the broker's RSS twice a second and its CPU (a broker
    doing work per idle connection shows here), then the clients disconnect and the RSS is
    sampled once more. Needs `target.pid` for the memory figures.
    """
    from bench.brokers import cpu_seconds, rss_kib  # parent-only import

    if connections < 1:
        raise ValueError("connections must be positive")
    nofile = raise_nofile()
    pid = target.pid

    def rss() -> int | None:
        return rss_kib(pid) if pid else None

    def cpu() -> float | None:
        return cpu_seconds(pid) if pid else None

    run = _run_id()
    groups = _split(
        [(f"i{run}-{i}", "") for i in range(connections)],
        options.sub_procs or max(2, os.cpu_count() or 1),
    )
    workers = _Workers()
    indexes = list(range(len(groups)))
    samples: list[tuple[float, int | None]] = []
    try:
        for group in groups:
            workers.start(_WorkerSpec("idle", target.host, target.port, group, options))
        workers.expect(indexes, "ready", options.connect_timeout + 60)
        time.sleep(settle_s / 2)
        rss_before = rss()
        cpu0 = cpu()
        t0 = time.monotonic()
        for pipe in workers.pipes:
            pipe.send(("go", 0, 0))
        # Generous: the handshakes are bounded by connect_timeout each in the workers.
        limit = options.connect_timeout * 3 + connections / 100 + 60
        reports = workers.expect(indexes, "connected", limit)
        connect_wall = time.monotonic() - t0
        cpu_connected = cpu()
        time.sleep(settle_s)
        rss_connected = rss()
        hold0 = time.monotonic()
        cpu_hold0 = cpu()
        end = hold0 + options.duration
        while (now := time.monotonic()) < end:
            samples.append((round(now - t0, 2), rss()))
            time.sleep(min(0.5, max(0.0, end - now)))
        rss_end = rss()
        cpu_hold1 = cpu()
        hold_s = time.monotonic() - hold0
        for pipe in workers.pipes:
            pipe.send(("finish",))
        done = workers.expect(indexes, "done", options.drain_timeout + 60)
        time.sleep(settle_s / 2)
        rss_closed = rss()
    finally:
        workers.close()

    connected: int = sum(r["connected"] for r in reports)
    errors: dict[str, int] = {}
    for r in done:
        for key, n in r["errors"].items():
            errors[key] = errors.get(key, 0) + n

    def per_conn(after: int | None) -> float | None:
        if after is None or rss_before is None or not connected:
            return None
        return (after - rss_before) / connected

    def spent(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    cpu_connect = spent(cpu0, cpu_connected)
    cpu_hold = spent(cpu_hold0, cpu_hold1)
    gen_cpu = sum(r["cpu_s"] for r in done)
    return {
        "scenario": "idle",
        "target": {"host": target.host, "port": target.port, "null": target.null},
        "options": asdict(options),
        "connections": connections,
        "procs": len(groups),
        "nofile_limit": nofile,
        "connected": connected,
        "failed": sum(r["failed"] for r in done),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "lost_during_hold": sum(r["lost"] for r in done),
        "connect_s": connect_wall,
        "connects_per_s": connected / connect_wall if connect_wall > 0 else None,
        "hold_s": hold_s,
        "rss_kib": {
            "before": rss_before,
            "connected": rss_connected,
            "end_of_hold": rss_end,
            "peak_during_hold": max((kib for _, kib in samples if kib), default=None),
            "after_close": rss_closed,
        },
        "kib_per_connection": per_conn(rss_end),
        "kib_per_connection_at_connect": per_conn(rss_connected),
        "rss_samples": samples,
        "cpu": {
            "broker_connect_s": cpu_connect,
            "broker_us_per_connect": cpu_connect / connected * 1e6
            if cpu_connect is not None and connected
            else None,
            "broker_hold_s": cpu_hold,
            "broker_cores": cpu_hold / hold_s if cpu_hold is not None and hold_s else None,
            "generator_s": gen_cpu,
        },
    }


def run_scenario(
    name: str,
    target: Target,
    options: LoadOptions,
    *,
    publishers: int = 4,
    subscribers: int = 4,
    connections: int = 10_000,
) -> dict[str, Any]:
    if name == "fanin":
        return fanin(target, options, publishers)
    if name == "pairs":
        return pairs(target, options, publishers)
    if name == "fanout":
        return fanout(target, options, subscribers)
    if name == "idle":
        return idle(target, options, connections)
    raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")


# --- CLI -------------------------------------------------------------------------------------


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The options shared by `bench.loadgen` and `bench.compare`."""
    parser.add_argument("--scenario", choices=SCENARIOS, default="fanin")
    parser.add_argument("--qos", type=int, choices=(0, 1), default=0)
    parser.add_argument(
        "--publishers", type=int, default=4, help="fanin publishers / pairs count (default 4)"
    )
    parser.add_argument("--subscribers", type=int, default=4, help="fanout subscribers")
    parser.add_argument(
        "--connections", type=int, default=10_000, help="idle connections (default 10000)"
    )
    parser.add_argument(
        "--keepalive", type=int, default=0, help="CONNECT keepalive seconds (default 0 = none)"
    )
    parser.add_argument(
        "--connect-concurrency",
        type=int,
        default=64,
        help="idle: handshakes in progress per process (default 64)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=10.0,
        help="seconds of publishing; idle: seconds the connections are held (default 10)",
    )
    parser.add_argument("--count", type=int, help="messages per publisher (ends early)")
    parser.add_argument("--rate", type=float, help="total msgs/s target (default: max)")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes (default 64)")
    parser.add_argument("--batch", type=int, default=64, help="QoS 0 packets per write")
    parser.add_argument("--window", type=int, default=32, help="QoS 1 in-flight per connection")
    parser.add_argument(
        "--e2e-window",
        type=int,
        default=20_000,
        help="max deliveries in flight from all publishers to all subscribers (default 20000; "
        "0 = unbounded, QoS 0 publishers then fill the kernel's socket buffers)",
    )
    parser.add_argument("--pub-procs", type=int, help="publisher processes (default: CPUs)")
    parser.add_argument(
        "--sub-procs", type=int, help="subscriber (idle: client) processes (default: CPUs)"
    )
    parser.add_argument("--sample-every", type=int, default=16, help="latency sample interval")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="max wait for the backlog after publishing",
    )
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="speak MQTT over TLS, verifying the broker's certificate with this CA (PEM)",
    )


def options_from_args(args: argparse.Namespace) -> LoadOptions:
    return LoadOptions(
        qos=args.qos,
        duration=args.duration,
        count=args.count,
        rate=args.rate,
        payload_size=args.payload,
        batch=args.batch,
        window=args.window,
        pub_procs=args.pub_procs,
        sub_procs=args.sub_procs,
        sample_every=args.sample_every,
        drain_timeout=args.drain_timeout,
        keepalive=args.keepalive,
        connect_concurrency=args.connect_concurrency,
        e2e_window=args.e2e_window or None,
        tls_ca=args.tls_ca,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.loadgen",
        description="Drive one MQTT 3.1.1 broker with one scenario and print the result as "
        "JSON. Use --null to measure the generator's own ceiling against the built-in sink.",
    )
    add_load_arguments(parser)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int, help="broker port on --host")
    where.add_argument("--null", action="store_true", help="start and use the null sink")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--broker-pid", type=int, help="pid of the broker, for CPU accounting")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    options = options_from_args(args)
    if args.null:
        from bench.brokers import start_null_sink

        with start_null_sink() as sink:
            target = Target(sink.host, sink.port, sink.pid, null=True)
            result = run_scenario(
                args.scenario,
                target,
                options,
                publishers=args.publishers,
                subscribers=args.subscribers,
                connections=args.connections,
            )
    else:
        target = Target(args.host, args.port, args.broker_pid)
        result = run_scenario(
            args.scenario,
            target,
            options,
            publishers=args.publishers,
            subscribers=args.subscribers,
            connections=args.connections,
        )
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
