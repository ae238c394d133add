"""The MQTT listener's protocol: with the TLS gate (:mod:`broker_edge.tls`) and the WebSocket
framing (:mod:`broker_edge.websocket`) that wrap it, the only code that touches asyncio
networking.

One :class:`MqttProtocol` per connection (plain TCP, TLS or WebSocket: it only sees a
transport; on the TLS listener its buffered subclass, :class:`BufferedMqttProtocol`) feeds
bytes to the broker, which runs them through the connection's sans-IO
:class:`~broker_edge.connection.Connection`, and after each read flushes every connection that
got output (one ``transport.write`` each). This is also the one place where an exception
becomes a DISCONNECT reason code: a :class:`ProtocolError` closes only that connection.
Transport flow control maps onto the session: while a subscriber's socket buffer is over the
high-water mark its deliveries wait in its bounded session queue.

What crosses the wire is counted for ``$SYS``: sockets accepted, bytes read and written, and
packets received (by the connection's decoder).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import typing

from broker_edge.broker import Broker
from broker_edge.connection import PAUSED_BY_ROUTING, Connection, ConnState
from broker_edge.errors import ProtocolError
from broker_edge.mesh import MAGIC
from broker_edge.packets import ReasonCode

log = logging.getLogger(__name__)

# After the edge closes a connection (its last packet, often a DISCONNECT, written), the socket is
# half-closed and what the client still sends is read and discarded for at most this long:
# closing at once, with the client's late writes unread, makes the kernel reset the connection,
# and a reset can destroy the DISCONNECT before the client reads its reason code.
CLOSE_DRAIN_SECONDS = 1.0
# The first byte of a link from a peer edge: MQTT's reserved packet type 0, which no client sends.
LINK_FIRST = MAGIC[:1]


class MqttProtocol(asyncio.BaseProtocol):
    """One TCP connection's wiring; also its Connection's transport (``ConnectionIO``).

    A plain protocol (``data_received``) as it stands: ``asyncio.Protocol`` is not among its
    bases only so that :class:`BufferedMqttProtocol` can be a buffered one (uvloop takes any
    ``asyncio.Protocol`` for a plain protocol, whatever else it is).
    """

    # One per client: slots keep an idle connection small (issue 9: ≤ 3 KiB per connection).
    __slots__ = (
        "_broker", "_conn", "_draining", "_ended", "_first", "_loop", "_lost", "_transport",
    )  # fmt: skip

    def __init__(self, broker: Broker, loop: asyncio.AbstractEventLoop) -> None:
        self._broker = broker
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._conn: Connection | None = None
        self._draining = False  # half-closed by us: reads are discarded until the close
        self._lost = False  # the broker was told the connection is gone
        self._ended = False  # the transport is gone: nothing more can be written
        self._first = True  # no byte read yet (a link to a peer edge opens with LINK_FIRST)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        transport = typing.cast(asyncio.Transport, transport)
        self._transport = transport
        name = peer_name(transport)
        high = self._broker.settings.write_buffer_high_water
        transport.set_write_buffer_limits(high=high, low=high // 4)
        self._conn = self._broker.open_connection(name, self._loop.time(), self)

    # -- ConnectionIO: what the broker asks of this connection's transport ----------------------

    def write(self, data: bytes) -> None:
        if self._ended:
            return  # answers to the last packets of a client already gone (_finish_turns)
        transport = self._transport
        assert transport is not None
        transport.write(data)

    def pause_reading(self) -> None:
        transport = self._transport
        assert transport is not None
        if not self._ended:
            transport.pause_reading()

    def resume_reading(self) -> None:
        transport = self._transport
        assert transport is not None
        if not self._ended:
            transport.resume_reading()

    def close(self) -> None:
        """Half-close, drain briefly, then close (see CLOSE_DRAIN_SECONDS). The broker is done
        with the connection at once: its session and will do not wait for the drain."""
        transport = self._transport
        assert transport is not None
        self._gone()
        if self._draining or transport.is_closing():
            return
        if not transport.can_write_eof():  # TLS: no half-close
            transport.close()
            return
        self._draining = True
        transport.write_eof()  # after the buffered output: the client reads it, then EOF
        transport.resume_reading()  # reads paused for back-pressure: drain them too
        self._loop.call_later(CLOSE_DRAIN_SECONDS, self._drained)

    def _drained(self) -> None:
        transport = self._transport
        assert transport is not None
        if transport.get_write_buffer_size():
            transport.abort()  # a client that does not read for that long gets nothing more
        else:
            transport.close()

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._draining:
            return  # late writes of a client we closed: read only to avoid a reset
        if self._first:
            self._first = False
            if data[:1] == LINK_FIRST:
                self._become_link(data)
                return
        self._handle(data)

    def _become_link(self, data: bytes) -> None:
        """A peer edge's link (broker_edge.mesh): no MQTT client at all; the mesh takes the
        transport, or it is closed when this edge takes no links."""
        conn = self._conn
        transport = self._transport
        assert conn is not None
        assert transport is not None
        self._gone()  # the broker forgets the MQTT machine it made for the socket
        acceptor = self._broker.link_acceptor
        if acceptor is None:
            transport.close()
        else:
            acceptor(transport, conn.peer, data)

    def _handle(self, data: bytes) -> None:
        """Handle one turn of packets, write what it produced, and come back for the rest of
        a big fan-out on a later loop iteration (reading paused meanwhile)."""
        conn = self._conn
        assert conn is not None
        broker = self._broker
        more = False
        try:
            more = broker.receive(conn, data, self._loop.time())
        except ProtocolError as exc:
            broker.protocol_failure(conn, exc)
        except Exception as exc:
            # Our bug, not the peer's: close this one connection, keep serving everyone else.
            log.exception("internal error on connection %s", conn.peer)
            broker.protocol_failure(
                conn, ProtocolError(repr(exc), ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)
            )
        broker.flush_dirty()
        if more:  # reading is paused meanwhile (PAUSED_BY_ROUTING)
            self._loop.call_soon(self._next_turn)

    def _next_turn(self) -> bool:
        """Handle the next turn of a read cut short, if one is still due; whether it was."""
        conn = self._conn
        due = (
            conn is not None
            and bool(conn.paused_for & PAUSED_BY_ROUTING)
            and conn.state is not ConnState.CLOSED
            and not conn.closing
        )
        if due:
            self._handle(b"")
        return due

    def _finish_turns(self) -> None:
        """Handle now what a read cut short left: the client sent it before its stream ended,
        so it counts (QoS 0 publishes followed by DISCONNECT, say). Over TCP a paused
        transport reports no EOF before its data, but over TLS and WebSocket the end comes with
        the last read, paused or not."""
        while self._next_turn():
            pass

    def eof_received(self) -> bool | None:
        self._finish_turns()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = True
        self._finish_turns()
        self._gone()

    def _gone(self) -> None:
        """Tell the broker once that this connection is over (will, session detach)."""
        conn = self._conn
        if conn is None or self._lost:
            return
        self._lost = True
        self._broker.connection_gone(conn, self._loop.time())

    def pause_writing(self) -> None:
        if self._conn is not None:
            self._broker.writing_paused(self._conn, True)

    def resume_writing(self) -> None:
        if self._conn is not None:
            self._broker.writing_paused(self._conn, False)


def peer_name(transport: asyncio.BaseTransport) -> str:
    """``HOST:PORT`` of the socket's other end, as logs and log events name it."""
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if peer else "?"


# What a TLS protocol decrypts into before BufferedMqttProtocol copies it out: one buffer for
# the event loop's thread, filled and emptied within one read callback (see the class).
_TLS_READ_SIZE = 256 * 1024 + 256


@functools.cache
def _tls_read_buffer() -> memoryview:
    # Made at the first TLS read: a zero-filled bytearray touches every page, and an edge
    # without a TLS listener has no use for them (issue 9: its RSS at start).
    return memoryview(bytearray(_TLS_READ_SIZE))


class BufferedMqttProtocol(MqttProtocol, asyncio.BufferedProtocol):
    """MqttProtocol for TLS connections: the TLS protocol (uvloop's, asyncio's) decrypts into
    a buffer it is given rather than into a new 256 KiB bytes object per read.

    That allocation is above malloc's mmap threshold: each read mapped it, shrank it with
    ``mremap`` and unmapped it, and with the journal's thread on the other core each unmap
    interrupted that core to flush its TLB (issue 13: 15,000 ``mremap`` in 240,000 QoS 1
    messages). The buffer is shared: the TLS protocol fills it and calls ``buffer_updated``
    in the same callback, which copies what was read out before anything else runs.
    """

    __slots__ = ()

    def get_buffer(self, sizehint: int) -> memoryview:
        return _tls_read_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(_tls_read_buffer()[:nbytes]))
