"""MQTT over WebSocket: the edge's ``ws`` and ``wss`` listeners.

Theory of operation
-------------------
:class:`WebSocketProtocol` is the socket's protocol (plain TCP, or the TLS transport the
:mod:`broker_edge.tls` gate hands it). wsproto (sans-IO, by the h11 authors) does the HTTP
upgrade and the framing; this module only moves bytes and events between it and asyncio.

* The handshake: ``GET /mqtt`` offering the subprotocol ``mqtt`` (or ``mqttv3.1``, MQTT 3.1's
  name, which Mosquitto accepts too) is answered ``101`` with ``Sec-WebSocket-Protocol`` set to
  it [MQTT-6.0.0-4]. Another path is refused with 404; a request that offers neither
  subprotocol with 400 (a client MUST offer ``mqtt`` [MQTT-6.0.0-3]; Mosquitto cannot serve
  such a client either). No extension is accepted (no permessage-deflate: a compressed frame
  could expand past every bound the broker sets). A request not done within the CONNECT
  timeout is dropped. Each refusal is logged through ``refused``, which limits how many lines
  a scanner gets (:mod:`broker_edge.refusals`).
* After it, one :class:`~broker_edge.listener.MqttProtocol` reads the payloads of the binary
  frames as its byte stream: packets may span frames and a frame may hold several packets
  [MQTT-6.0.0-2], so frame boundaries mean nothing to it. The payloads of one read are joined
  and handed over at once, as one TCP read would be. A text frame closes the connection
  [MQTT-6.0.0-1] (close code 1003).
* :class:`FrameTransport` is that MQTT protocol's transport: each write becomes one binary frame;
  reading and writing flow control are the socket's (pause/resume pass through both ways); its
  close sends a WebSocket close frame after what was written (so the client reads its MQTT
  DISCONNECT first), then waits briefly for the client's close frame before closing the socket.
"""

from __future__ import annotations

import asyncio
import logging
import typing
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import RemoteProtocolError

from broker_edge.listener import CLOSE_DRAIN_SECONDS, MqttProtocol, peer_name

log = logging.getLogger(__name__)

PATH = "/mqtt"
# States in which what the client sends is read and dropped.
_DONE = frozenset(
    {ConnectionState.REJECTING, ConnectionState.REMOTE_CLOSING, ConnectionState.CLOSED}
)
# In the order of preference when a client offers both.
SUBPROTOCOLS = ("mqtt", "mqttv3.1")


class WebSocketProtocol(asyncio.Protocol):
    """One WebSocket connection: the upgrade, then frames in and out of an MQTT protocol."""

    __slots__ = (
        "_closing", "_handshake_timeout", "_loop", "_make_mqtt", "_mqtt", "_peer", "_refused",
        "_timer", "_transport", "_ws",
    )  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        make_mqtt: Callable[[], MqttProtocol],
        handshake_timeout: float,
        refused: Callable[[str, str], None],
    ) -> None:
        self._loop = loop
        self._refused = refused  # (peer, why): a refused upgrade, for the log (rate limited)
        self._make_mqtt = make_mqtt
        self._ws = WSConnection(ConnectionType.SERVER)
        self._transport: asyncio.Transport | None = None
        self._mqtt: MqttProtocol | None = None
        self._closing = False
        self._peer = "?"  # kept: a socket reset by the client no longer knows its peer
        self._handshake_timeout = handshake_timeout
        self._timer: asyncio.TimerHandle | None = None

    @property
    def transport(self) -> asyncio.Transport:
        transport = self._transport
        assert transport is not None
        return transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)  # uvloop's do not subclass
        self._peer = peer_name(transport)
        self._timer = self._loop.call_later(self._handshake_timeout, self._handshake_timed_out)

    def data_received(self, data: bytes) -> None:
        ws = self._ws
        if ws.state in _DONE:
            return  # closed or refused: late bytes are read only to avoid a reset
        try:
            ws.receive_data(data)
        except RemoteProtocolError as exc:  # not an HTTP upgrade request
            hint = exc.event_hint
            self._reject(hint.status_code if isinstance(hint, RejectConnection) else 400, str(exc))
            return
        payloads: list[bytes | bytearray] = []
        for event in ws.events():
            if isinstance(event, BytesMessage):
                payloads.append(event.data)
                continue
            self._deliver(payloads)  # what came before the event, first
            payloads = []
            self._handle(event)
        self._deliver(payloads)

    def _deliver(self, payloads: list[bytes | bytearray]) -> None:
        mqtt = self._mqtt
        if payloads and mqtt is not None and not self._closing:
            mqtt.data_received(b"".join(payloads))

    def _handle(self, event: Event) -> None:
        if isinstance(event, Request):
            self._upgrade(event)
        elif isinstance(event, Ping):
            if self._ws.state is ConnectionState.OPEN:
                self.transport.write(self._ws.send(event.response()))
        elif isinstance(event, CloseConnection):
            self._closed_by_peer(event)
        elif isinstance(event, TextMessage):
            log.info("closing WebSocket %s: text frame [MQTT-6.0.0-1]", self._peer)
            self.close(CloseReason.UNSUPPORTED_DATA, "MQTT needs binary frames")

    def _upgrade(self, request: Request) -> None:
        path = urlsplit(request.target).path
        if path != PATH:
            self._reject(404, f"no WebSocket endpoint at {path}: MQTT is at {PATH}")
            return
        subprotocol = next((p for p in SUBPROTOCOLS if p in request.subprotocols), None)
        if subprotocol is None:
            offered = ", ".join(request.subprotocols) or "none"
            self._reject(400, f"needs the WebSocket subprotocol mqtt (offered: {offered})")
            return
        self._cancel_timer()
        self.transport.write(self._ws.send(AcceptConnection(subprotocol=subprotocol)))
        mqtt = self._make_mqtt()
        self._mqtt = mqtt
        mqtt.connection_made(FrameTransport(self))

    def _reject(self, status: int, why: str) -> None:
        """An HTTP answer instead of the upgrade, then close."""
        self._cancel_timer()
        transport = self.transport
        self._refused(self._peer, f"{status} {why}")
        body = f"{why}\n".encode()
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
        try:
            transport.write(
                self._ws.send(RejectConnection(status_code=status, headers=headers, has_body=True))
                + self._ws.send(RejectData(data=body))
            )
        except Exception:  # wsproto cannot answer a request it could not parse at all
            log.debug("no HTTP answer for %s", self._peer, exc_info=True)
        self._closing = True
        transport.close()

    def _closed_by_peer(self, event: CloseConnection) -> None:
        """The client's close frame (or a framing error wsproto reports as one)."""
        ws = self._ws
        if ws.state is ConnectionState.REMOTE_CLOSING:
            self.transport.write(ws.send(event.response()))  # RFC 6455 5.5.1: echo, then close
        elif ws.state is ConnectionState.OPEN:  # a framing error: our close, with its code
            self.transport.write(ws.send(CloseConnection(event.code, event.reason)))
        self._closing = True
        self.transport.close()  # the server closes the TCP connection first (RFC 6455 7.1.1)

    def close(self, code: int = CloseReason.NORMAL_CLOSURE, reason: str | None = None) -> None:
        """Close frame after what was written, then wait briefly for the client's."""
        if self._closing:
            return
        self._closing = True
        transport = self.transport
        if self._ws.state is ConnectionState.OPEN:
            transport.write(self._ws.send(CloseConnection(code, reason)))
        transport.resume_reading()  # paused for back-pressure: the client's close must arrive
        self._timer = self._loop.call_later(CLOSE_DRAIN_SECONDS, self._drained)

    def _drained(self) -> None:
        self._timer = None
        transport = self.transport
        if transport.get_write_buffer_size():
            transport.abort()  # a client that does not read for that long gets nothing more
        else:
            transport.close()

    def _handshake_timed_out(self) -> None:
        self._timer = None
        if self._transport is not None:
            self._refused(self._peer, "no WebSocket upgrade in time")
            self._transport.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def eof_received(self) -> bool | None:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._mqtt is not None:
            self._mqtt.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._mqtt is not None:
            self._mqtt.pause_writing()

    def resume_writing(self) -> None:
        if self._mqtt is not None:
            self._mqtt.resume_writing()

    def frame(self, data: bytes) -> None:
        """One binary frame of ``data`` (the MQTT protocol's write)."""
        if self._ws.state is ConnectionState.OPEN and not self._closing:
            self.transport.write(self._ws.send(BytesMessage(data=data)))

    @property
    def closing(self) -> bool:
        return self._closing


class FrameTransport(asyncio.Transport):
    """The MQTT protocol's transport on a WebSocket: writes become binary frames."""

    __slots__ = ("_ws",)

    def __init__(self, ws: WebSocketProtocol) -> None:
        super().__init__()
        self._ws = ws

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._ws.frame(data if isinstance(data, bytes) else bytes(data))

    def close(self) -> None:
        self._ws.close()

    def is_closing(self) -> bool:
        return self._ws.closing or self._ws.transport.is_closing()

    def can_write_eof(self) -> bool:
        return False  # a WebSocket has its close frame instead

    def abort(self) -> None:
        self._ws.transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._ws.transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._ws.transport.pause_reading()

    def resume_reading(self) -> None:
        self._ws.transport.resume_reading()

    def is_reading(self) -> bool:
        return self._ws.transport.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._ws.transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._ws.transport.get_write_buffer_size()
