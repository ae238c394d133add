"""The "null" broker: the cheapest server that speaks enough MQTT to measure the generator.

Theory of operation
-------------------
Every connection gets CONNACK, SUBACK (granting what was asked), PUBACK for QoS 1 publishes
and PINGRESP; publishes are counted and discarded, never routed. With `--blast`, the first
PINGREQ after a SUBSCRIBE starts a writer that floods that connection with pre-encoded
benchmark PUBLISH packets (QoS as granted) for as long as it stays connected; the generator's
subscribers send that PINGREQ on "go", so a worker opening 500 connections is not flooded by
the first ones while it opens the rest. Run against this sink,
the publishers show their maximum send rate and the subscribers their maximum receive rate
under the same CPU split as a real run (sink on one core, generator on the other), which is
the generator's ceiling: a broker result below it was not limited by the generator.

Run as `python -m bench.sink --listen 127.0.0.1:PORT [--blast]`; it stops on SIGTERM or
SIGINT, and by itself after `--max-seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from typing import cast

from bench import wire

log = logging.getLogger(__name__)

BLAST_BATCH = 256  # packets per write; big writes keep the sink's cost per message tiny


class _Sink:
    def __init__(self, *, blast: bool, blast_payload: int, max_seconds: float) -> None:
        self.blast = blast
        self.blast_payload = blast_payload
        self.deadline = time.monotonic() + max_seconds
        self.received = 0
        self.blasted = 0
        self.tasks: set[asyncio.Task[None]] = set()


class _SinkConnection(asyncio.Protocol):
    def __init__(self, sink: _Sink) -> None:
        self.sink = sink
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.scanner = wire.PublishScanner(sample_every=0)
        self.resumed: asyncio.Future[None] | None = None
        self.closed = False
        self.subscribed: tuple[str, int] | None = None  # (first filter, granted QoS)
        self.blasting = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement, but do not subclass, asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)

    def pause_writing(self) -> None:
        self.resumed = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)
        self.resumed = None

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if not self.buf:
            # A flooded QoS 1 subscriber sends nothing but PUBACKs: drop them in bulk.
            _, used = wire.count_pubacks(data)
            if used == len(data):
                return
        self.buf += data
        _, used = wire.count_pubacks(self.buf)
        if used:
            del self.buf[:used]
        acks = bytearray()
        others: list[wire.Packet] = []
        try:
            self.sink.received += self.scanner.scan(self.buf, 0, acks, others)
        except wire.ProtocolError as exc:
            log.warning("closing connection: %s", exc)
            self.transport.abort()
            return
        out = bytearray(acks)
        for packet in others:
            if packet.type == wire.PacketType.CONNECT:
                out += wire.connack(0)
            elif packet.type == wire.PacketType.SUBSCRIBE:
                pid, filters = wire.parse_subscribe(packet)
                granted = [min(qos, 1) for _, qos in filters]
                out += wire.suback(pid, granted)
                self.subscribed = (filters[0][0], granted[0])
            elif packet.type == wire.PacketType.PINGREQ:
                out += wire.PINGRESP
                if self.sink.blast and self.subscribed and not self.blasting:
                    self.blasting = True
                    self._start_blast(*self.subscribed)
            elif packet.type == wire.PacketType.DISCONNECT:
                self.transport.close()
                return
        if out:
            self.transport.write(bytes(out))

    def _start_blast(self, topic_filter: str, qos: int) -> None:
        topic = topic_filter.replace("#", "sink").replace("+", "sink")
        task = asyncio.get_running_loop().create_task(self._blast(topic, qos))
        self.sink.tasks.add(task)
        task.add_done_callback(self.sink.tasks.discard)

    async def _blast(self, topic: str, qos: int) -> None:
        batch = wire.PublishBatch(topic, self.sink.blast_payload, qos=qos, size=BLAST_BATCH)
        seq = 0
        # Bounded by the sink's lifetime; ends as soon as the subscriber disconnects.
        while not self.closed and time.monotonic() < self.sink.deadline:
            assert self.transport is not None
            self.transport.write(batch.fill(BLAST_BATCH, time.monotonic_ns(), seq))
            seq += BLAST_BATCH
            self.sink.blasted += BLAST_BATCH
            if self.resumed is not None:
                await self.resumed
            else:
                await asyncio.sleep(0)


async def serve(
    host: str, port: int, *, blast: bool, blast_payload: int = 64, max_seconds: float = 3600.0
) -> None:
    sink = _Sink(blast=blast, blast_payload=blast_payload, max_seconds=max_seconds)
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[None] = loop.create_future()

    def on_signal() -> None:
        if not stop.done():
            stop.set_result(None)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    server = await loop.create_server(lambda: _SinkConnection(sink), host, port)
    log.info("null sink listening on %s:%d (blast=%s)", host, port, blast)
    async with server:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop, max_seconds)
        for task in list(sink.tasks):
            task.cancel()
        await asyncio.gather(*sink.tasks, return_exceptions=True)
    log.info("null sink stopped: received %d, blasted %d", sink.received, sink.blasted)


def _run(coro: object) -> None:
    try:
        import uvloop  # optional speed-up, same as the workers use
    except ImportError:  # pragma: no cover
        asyncio.run(coro)  # type: ignore[arg-type]
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sink", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (default %(default)s)")
    parser.add_argument("--blast", action="store_true", help="flood every subscriber")
    parser.add_argument("--blast-payload", type=int, default=64, help="payload bytes")
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="lifetime cap")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _run(
        serve(
            host,
            int(port),
            blast=args.blast,
            blast_payload=args.blast_payload,
            max_seconds=args.max_seconds,
        )
    )


if __name__ == "__main__":
    main()
