"""TLS for the edge's listeners: the server context from the settings, and the handshake gate.

Theory of operation
-------------------
A TLS listener accepts plain TCP sockets with a :class:`TlsGate` protocol, which stops reading
at once and hands the socket to ``loop.start_tls``: the handshake runs in asyncio's (or
uvloop's) own TLS protocol, and its outcome comes back to us as the coroutine's result. On
success the protocol made by the listener's factory (an MQTT or WebSocket protocol) gets the TLS
transport and never sees the handshake; on failure (a plain-TCP client, a bad or missing client
certificate, no common TLS version, a timeout) the socket is closed and ``refused(peer, reason)``
is called, which logs one line and publishes one ``tls_handshake_failed`` log event (within the
limits of :mod:`broker_edge.refusals`: a scanner's thousands are summed up in one).

Accepting with ``create_server(ssl=...)`` would do the handshake too, but its failures are only
visible as the event loop's debug logging: no peer, no reason, no event. Handshake errors never
reach the loop's exception handler here, so no traceback is printed for them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import typing
from collections.abc import Callable
from pathlib import Path

from broker_edge.errors import ConfigError
from broker_edge.listener import peer_name
from broker_edge.settings import EdgeSettings

log = logging.getLogger(__name__)

Refused = Callable[[str, str, str], None]  # (listener kind, peer, reason)


def server_context(settings: EdgeSettings) -> ssl.SSLContext | None:
    """The TLS listeners' context (TLS 1.2+), or None without one; ConfigError naming the
    setting when a file is missing or unusable, or the key does not match the certificate."""
    if not (settings.listen_tls or settings.listen_wss):
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    cert = _readable("edge.tls_cert", settings.tls_cert)
    key = _readable("edge.tls_key", settings.tls_key)
    try:
        # Parsed as a CA bundle first, on a throwaway context: says which file is not PEM.
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
    except ssl.SSLError as exc:
        raise ConfigError(f"edge.tls_cert: {cert} is not a PEM certificate ({exc})") from exc
    try:
        context.load_cert_chain(cert, key, password=_no_password)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            problem = f"{key} is not the private key of the certificate in {cert}"
        else:
            problem = f"{key} is not an unencrypted PEM private key ({exc})"
        raise ConfigError(f"edge.tls_key: {problem}") from exc
    if settings.tls_cafile:
        cafile = _readable("edge.tls_cafile", settings.tls_cafile)
        try:
            context.load_verify_locations(cafile=cafile)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"edge.tls_cafile: {cafile} is not a PEM bundle of CA certificates ({exc})"
            ) from exc
        context.verify_mode = ssl.CERT_REQUIRED  # no certificate, or another CA's: refused
    return context


def _readable(key: str, name: str) -> str:
    path = Path(name)
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {name}: {exc.strerror or exc}") from exc
    return str(path)


def _no_password() -> bytes:
    # An encrypted key would make OpenSSL prompt on the terminal: refuse it instead.
    raise ConfigError("edge.tls_key: an encrypted private key is not supported")


class TlsGate(asyncio.Protocol):
    """The first protocol of a socket on a TLS listener: runs its handshake (see the module)."""

    __slots__ = ("_handshakes", "_transport", "early", "inner", "kind")

    def __init__(
        self, handshakes: Handshakes, inner: Callable[[], asyncio.BaseProtocol], kind: str
    ) -> None:
        self._handshakes = handshakes
        self.inner = inner  # the protocol after the handshake
        self.kind = kind  # the listener's (tls, wss), for the log
        self._transport: asyncio.Transport | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = typing.cast(asyncio.Transport, transport)  # uvloop's do not subclass it
        self._transport = transport
        transport.pause_reading()  # the ClientHello is start_tls's to read
        self._handshakes.start(self, transport)

    def data_received(self, data: bytes) -> None:
        # uvloop starts reading right after connection_made, paused or not: what arrives before
        # start_tls takes the socket is kept for it (Handshakes.start), and reading stops.
        self.early.append(data)
        assert self._transport is not None
        self._transport.pause_reading()


class Handshakes:
    """The handshakes under way on one TLS listener (cancelled when it closes)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        context: ssl.SSLContext,
        refused: Refused,
        timeout: float,
    ) -> None:
        self._loop = loop
        self._context = context
        self._refused = refused
        self._timeout = timeout
        self._tasks: set[asyncio.Task[None]] = set()

    def gate(
        self, inner: Callable[[], asyncio.BaseProtocol], kind: str
    ) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for the ``kind`` listener's ``create_server``: TLS first, then
        ``inner()``."""
        return lambda: TlsGate(self, inner, kind)

    def start(self, gate: TlsGate, transport: asyncio.Transport) -> None:
        """Start the handshake, and hand start_tls's protocol what the gate read before it.

        The order is the point (call_soon runs callbacks first in, first out): the task's first
        step runs start_tls up to its first await, which pauses reading, installs the TLS
        protocol and queues its connection_made and resume_reading; the hop queued here after
        that step queues the hand-over after those two, in the same batch, so the early bytes
        reach the TLS protocol after its connection_made and before any later read.
        """
        task = self._loop.create_task(self._handshake(transport, gate))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._loop.call_soon(self._loop.call_soon, _hand_over, gate, transport)

    async def _handshake(self, transport: asyncio.Transport, gate: TlsGate) -> None:
        peer = peer_name(transport)
        waiting = _Waiting()
        try:
            secure = await self._loop.start_tls(
                transport,
                waiting,
                self._context,
                server_side=True,
                ssl_handshake_timeout=self._timeout,
            )
        except ssl.SSLError as exc:
            transport.abort()
            self._refused(gate.kind, peer, _reason(exc))
        except (TimeoutError, ConnectionAbortedError):  # asyncio and uvloop say it so
            transport.abort()
            self._refused(gate.kind, peer, f"no TLS handshake within {self._timeout:g} s")
        except OSError as exc:
            # The client went away mid-handshake (a port probe, a load balancer's TCP check):
            # nothing to tell the operator.
            transport.abort()
            log.debug("TLS handshake with %s ended: %r", peer, exc)
        except Exception as exc:  # a loop's surprise on a socket already gone: no traceback
            transport.abort()
            log.warning("TLS handshake with %s ended unexpectedly: %r", peer, exc)
        else:
            if secure is None:  # the loop closed it meanwhile
                return
            # A plain or a buffered protocol; either takes data_received (listener's MQTT).
            waiting.hand_over(secure, typing.cast(asyncio.Protocol, gate.inner()))

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class _Waiting(asyncio.Protocol):
    """start_tls's protocol until the handshake's task takes the TLS transport: what the TLS
    protocol delivers before then is kept for the listener's protocol.

    asyncio's TLS protocol reads the application data that came with the client's last
    handshake flight (a TLS 1.3 client sends its CONNECT right behind its Finished) as soon as
    the handshake completes, before start_tls's caller resumes: handed straight to the MQTT
    protocol, it would arrive before that protocol's connection_made.
    """

    __slots__ = ("_data", "_eof", "_lost")

    def __init__(self) -> None:
        self._data: list[bytes] = []
        self._eof = False
        self._lost: tuple[Exception | None] | None = None

    def data_received(self, data: bytes) -> None:
        self._data.append(bytes(data))

    def eof_received(self) -> bool:
        self._eof = True
        return True  # the listener's protocol decides, once it has the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = (exc,)

    def hand_over(self, secure: asyncio.BaseTransport, protocol: asyncio.Protocol) -> None:
        """Make ``protocol`` the TLS transport's, then replay what came before it."""
        transport = typing.cast(asyncio.Transport, secure)  # uvloop's do not subclass it
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self._data:
            protocol.data_received(b"".join(self._data))
            self._data.clear()
        if self._eof and not protocol.eof_received():
            transport.close()
        if self._lost is not None:
            protocol.connection_lost(self._lost[0])


def _hand_over(gate: TlsGate, transport: asyncio.Transport) -> None:
    """Feed the bytes the gate read to the protocol start_tls installed (a buffered one)."""
    if not gate.early or transport.is_closing():
        return
    protocol = transport.get_protocol()
    if protocol is gate:  # pragma: no cover (start_tls always runs first: see start)
        return
    data = memoryview(b"".join(gate.early))
    gate.early.clear()
    if not hasattr(protocol, "get_buffer"):
        typing.cast(asyncio.Protocol, protocol).data_received(bytes(data))
        return
    buffered = typing.cast(asyncio.BufferedProtocol, protocol)  # uvloop's does not subclass it
    while data:
        buffer = memoryview(buffered.get_buffer(len(data)))
        size = min(len(buffer), len(data))
        buffer[:size] = data[:size]
        buffered.buffer_updated(size)
        data = data[size:]


def _reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason (``WRONG_VERSION_NUMBER`` for a plain-TCP client, ``HTTP_REQUEST``,
    ``PEER_DID_NOT_RETURN_A_CERTIFICATE``, ``TLSV1_ALERT_UNKNOWN_CA`` ...) and its text,
    without the source line."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    text = str(exc.args[1]) if len(exc.args) > 1 else str(exc)
    return re.sub(r"\s*\(_ssl\.c:\d+\)$", "", text)
