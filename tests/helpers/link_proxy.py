"""A TCP forwarder between two edges that a test can cut and heal: a network partition of one
mesh link while both edges keep serving their clients."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class LinkProxy:
    """Forwards every connection to ``127.0.0.1:port`` from its own ``self.port`` (port 0:
    chosen by the OS). :meth:`cut` closes every connection and refuses new ones (accepted and
    closed at once) until :meth:`heal`."""

    def __init__(self, port: int) -> None:
        self.target = port
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._cut = False
        self._closed = False
        threading.Thread(target=self._accept, name="link proxy", daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            open_now, self._open = self._open, []
        for sock in open_now:
            _close(sock)

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._server)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                refused = self._cut
            if refused:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    _close(src)
    _close(dst)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


@contextlib.contextmanager
def link_proxy(port: int) -> Iterator[LinkProxy]:
    proxy = LinkProxy(port)
    try:
        yield proxy
    finally:
        proxy.close()
