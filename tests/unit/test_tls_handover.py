"""The TLS gate's hand-over (broker_edge.tls): what the TLS protocol delivered before the
handshake's task took the transport reaches the listener's protocol after its connection_made,
in order (asyncio delivers the data that came with the client's Finished at once)."""

from __future__ import annotations

import asyncio
from typing import Any

from broker_edge.tls import _Waiting


class _Recorder(asyncio.Protocol):
    def __init__(self, keep_open: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.keep_open = keep_open

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.calls.append(("connection_made", transport))

    def data_received(self, data: bytes) -> None:
        self.calls.append(("data_received", data))

    def eof_received(self) -> bool:
        self.calls.append(("eof_received", None))
        return self.keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        self.calls.append(("connection_lost", exc))


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.protocol: asyncio.BaseProtocol | None = None
        self.closed = False

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def close(self) -> None:
        self.closed = True


def test_data_eof_and_loss_before_the_hand_over_follow_connection_made() -> None:
    waiting = _Waiting()
    waiting.data_received(b"\x10\x0c")
    waiting.data_received(bytearray(b"CONNECT"))
    assert waiting.eof_received() is True  # kept open until the protocol decides
    error = ConnectionResetError()
    waiting.connection_lost(error)
    transport, protocol = _Transport(), _Recorder()
    waiting.hand_over(transport, protocol)
    assert transport.protocol is protocol
    assert protocol.calls == [
        ("connection_made", transport),
        ("data_received", b"\x10\x0cCONNECT"),
        ("eof_received", None),
        ("connection_lost", error),
    ]
    assert transport.closed  # eof_received said close


def test_nothing_before_the_hand_over_is_only_connection_made() -> None:
    transport, protocol = _Transport(), _Recorder()
    _Waiting().hand_over(transport, protocol)
    assert protocol.calls == [("connection_made", transport)]
    assert not transport.closed
