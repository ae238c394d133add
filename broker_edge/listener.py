"""The TCP listener: the only module that touches asyncio networking.

One :class:`MqttProtocol` per TCP connection feeds bytes to its sans-IO
:class:`~broker_edge.connection.Connection`, and after each read flushes every connection that
got output (one ``transport.write`` each). This is also the one place where an exception
becomes a DISCONNECT reason code: a :class:`ProtocolError` closes only that connection.
Transport flow control maps onto the session: while a subscriber's socket buffer is over the
high-water mark its deliveries wait in its bounded session queue.

What crosses the wire is counted here for ``$SYS``: sockets accepted, bytes read and written,
and packets received (framed by a :class:`~broker_edge.sysstats.PacketCounter`, without decoding).
"""

from __future__ import annotations

import asyncio
import logging
import typing

from broker_edge.broker import Broker
from broker_edge.connection import PAUSED_BY_ROUTING, Connection, ConnState
from broker_edge.errors import ProtocolError
from broker_edge.packets import ReasonCode
from broker_edge.sysstats import PacketCounter

log = logging.getLogger(__name__)


class MqttProtocol(asyncio.Protocol):
    def __init__(self, broker: Broker, loop: asyncio.AbstractEventLoop) -> None:
        self._broker = broker
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._conn: Connection | None = None
        self._packets = PacketCounter()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        transport = typing.cast(asyncio.Transport, transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        conn = Connection(self._broker, f"{peer[0]}:{peer[1]}" if peer else "?", self._loop.time())
        conn.write = self._write
        conn.close_transport = transport.close
        conn.pause_reading = transport.pause_reading
        conn.resume_reading = transport.resume_reading
        conn.call_later = self._loop.call_later
        high = self._broker.settings.write_buffer_high_water
        transport.set_write_buffer_limits(high=high, low=high // 4)
        self._conn = conn
        self._broker.stats.sockets_opened += 1
        self._broker.awaiting_connect.add(conn)

    def _write(self, data: bytes) -> None:
        self._broker.stats.wire_bytes_out += len(data)
        transport = self._transport
        assert transport is not None
        transport.write(data)

    def data_received(self, data: bytes) -> None:
        stats = self._broker.stats
        stats.wire_bytes_in += len(data)
        stats.packets_in += self._packets.feed(data)
        self._handle(data)

    def _handle(self, data: bytes) -> None:
        """Handle one turn of packets, write what it produced, and come back for the rest of
        a big fan-out on a later loop iteration (reading paused meanwhile)."""
        conn = self._conn
        assert conn is not None
        more = False
        try:
            more = conn.receive(data, self._loop.time())
        except ProtocolError as exc:
            conn.protocol_failure(exc)
        except Exception as exc:
            # Our bug, not the peer's: close this one connection, keep serving everyone else.
            log.exception("internal error on connection %s", conn.peer)
            conn.protocol_failure(
                ProtocolError(repr(exc), ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)
            )
        self._broker.flush_dirty()
        if more:
            conn.pause(PAUSED_BY_ROUTING)
            self._loop.call_soon(self._next_turn)
        else:
            conn.resume(PAUSED_BY_ROUTING)

    def _next_turn(self) -> None:
        conn = self._conn
        if conn is not None and conn.state is not ConnState.CLOSED and not conn.closing:
            self._handle(b"")

    def eof_received(self) -> bool | None:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        conn = self._conn
        if conn is None:
            return
        conn.state = ConnState.CLOSED
        conn.out.clear()
        self._broker.dirty.discard(conn)
        self._broker.awaiting_connect.discard(conn)
        self._broker.paused_readers.discard(conn)
        self._broker.connection_lost(conn, self._loop.time())
        self._broker.flush_dirty()

    def pause_writing(self) -> None:
        if self._conn is not None:
            self._conn.write_paused = True

    def resume_writing(self) -> None:
        conn = self._conn
        if conn is not None:
            conn.write_paused = False
            self._broker.writing_resumed(conn)
            self._broker.flush_dirty()
