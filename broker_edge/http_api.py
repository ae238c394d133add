"""The edge's HTTP port: its durable journal for remote pipelines, and ``/healthz``.

Theory of operation
-------------------
Two halves, as in the MQTT side. :class:`HttpApi` turns one request (method, target, headers)
into a :class:`Reply`: a status, headers and either a small body or an iterator of body pieces.
It never touches a socket. :class:`HttpServer` is the asyncio part: it feeds the bytes of each
connection to an ``h11.Connection`` (HTTP/1.1 parsing, keep-alive, chunked encoding are
h11's), asks the API for a reply in a worker thread (it reads the journal's files) and writes
the reply, awaiting the transport's drain after every piece: a slow reader pauses the
journal read, so a range of any size is served in bounded memory.

Endpoints:

* ``GET /healthz`` — ``{"status": "ok"}`` while the edge runs; no token needed (it says nothing
  but "up", for load balancers and supervisors).
* ``GET /readyz`` — 200 ``{"status": "ready"}`` while the journal takes publishes, else 503
  ``{"status": "not ready", "reason": ...}`` (the journal is full or failing: publishes are
  refused); no token needed.
* ``GET /metrics`` — the edge's Prometheus metrics (``broker_edge.metrics``): connections,
  sessions, subscriptions, messages and bytes in and out, per-tenant counters, the journal's
  bytes, state and lag behind the lake, quota states.
* ``GET /journal`` — ``{"node", "first_seq", "last_seq"}``: the oldest seq still on disk (null
  before the first segment) and the newest *durable* seq (the ``DURABLE`` watermark).
* ``GET /journal/records?after=A&upto=B`` — the records with ``A < seq <= B`` as one Arrow IPC
  stream (``application/vnd.apache.arrow.stream``, chunked): the frames' bodies as they are on
  disk, CRC-checked, the two cut by the range re-encoded. At most ``max_records`` per request
  (413 beyond); ``B`` past the durable watermark is 416, records retention removed 410: both
  say which seqs in the JSON error body, and nothing is ever served past the watermark.

The journal endpoints and ``/metrics`` need ``Authorization: Bearer <operator token>``: 401
without it, 403 with another token. Without an operator token (no tenants file) they are open,
which the edge allows only on a loopback address (:func:`check_exposure`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http
import ipaddress
import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import h11

from broker_edge.errors import ConfigError
from ingest.journal import JournalError, JournalGapError, JournalReader

log = logging.getLogger(__name__)

ARROW_STREAM = "application/vnd.apache.arrow.stream"
JSON = "application/json"
METRICS_TEXT = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus's text format
# A request line and headers beyond this are refused (h11 answers 431 for us).
MAX_HEADER_BYTES = 16 * 1024
# A connection idle this long between requests is closed.
IDLE_TIMEOUT = 60.0
# Body pieces are gathered in the worker thread up to about this many bytes per write.
WRITE_BYTES = 256 * 1024

Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    content_type: str = JSON
    body: bytes = b""
    pieces: Iterator[bytes] | None = field(default=None, compare=False)
    headers: tuple[tuple[str, str], ...] = ()


def _error(status: int, message: str, **extra: object) -> Reply:
    return Reply(status, body=json.dumps({"error": message, **extra}).encode())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None) -> None:
    """Refuse to serve the journal without a token anywhere but on a loopback address: every
    tenant's payloads are in it."""
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"edge.http_listen: serving the journal on {host} needs an operator token "
            "([operator] token in the --tenants file); without one only a loopback address "
            "(127.0.0.1, ::1, localhost) is allowed"
        )


class HttpApi:
    """Requests in, :class:`Reply` out, for one node's journal (runs in a worker thread)."""

    def __init__(
        self,
        node_dir: Path,
        token: str | None,
        *,
        max_records: int,
        metrics: Callable[[], bytes] | None = None,
        unready: Callable[[], str | None] | None = None,
    ) -> None:
        """``metrics``: the exposition text; ``unready``: why publishes are refused now (None:
        ready). Both are called from a worker thread (the edge hops to its loop for them)."""
        self.node = node_dir.name
        self.token = token  # replaced on SIGHUP when the tenants file changes
        self._node_dir = node_dir
        self._max_records = max_records
        self._journal = JournalReader(node_dir)
        self._metrics = metrics
        self._unready = unready

    def handle(self, method: str, target: str, headers: Headers) -> Reply:
        url = urlsplit(target)
        if url.path == "/healthz":
            return self._only_get(method) or Reply(200, body=b'{"status": "ok"}')
        if url.path == "/readyz" and self._unready is not None:
            return self._only_get(method) or self._readiness(self._unready())
        if url.path == "/metrics" and self._metrics is not None:
            refused = self._only_get(method) or self._authorize(headers)
            return refused or Reply(200, body=self._metrics(), content_type=METRICS_TEXT)
        if url.path not in ("/journal", "/journal/records"):
            return _error(404, f"no such resource {url.path!r}")
        refused = self._only_get(method) or self._authorize(headers)
        if refused is not None:
            return refused
        if url.path == "/journal":
            body = {
                "node": self.node,
                "first_seq": self._journal.first_seq(),
                "last_seq": self._journal.last_seq(),
            }
            return Reply(200, body=json.dumps(body).encode())
        return self._records(parse_qs(url.query))

    @staticmethod
    def _readiness(reason: str | None) -> Reply:
        if reason is None:
            return Reply(200, body=b'{"status": "ready"}')
        return Reply(503, body=json.dumps({"status": "not ready", "reason": reason}).encode())

    @staticmethod
    def _only_get(method: str) -> Reply | None:
        if method in ("GET", "HEAD"):
            return None
        return Reply(405, body=b'{"error": "only GET"}', headers=(("Allow", "GET, HEAD"),))

    def _authorize(self, headers: Headers) -> Reply | None:
        if self.token is None:
            return None
        given = next((v for k, v in headers if k == b"authorization"), None)
        scheme, _, credential = (given or b"").partition(b" ")
        if given is None or scheme.lower() != b"bearer":
            return Reply(
                401,
                body=b'{"error": "needs Authorization: Bearer <operator token>"}',
                headers=(("WWW-Authenticate", 'Bearer realm="edgebus"'),),
            )
        if not hmac.compare_digest(credential.strip(), self.token.encode()):
            return _error(403, "the bearer token is not this edge's operator token")
        return None

    def _records(self, query: dict[str, list[str]]) -> Reply:
        try:
            after, upto = (int(query[name][0]) for name in ("after", "upto"))
        except (KeyError, ValueError):
            return _error(400, "needs ?after=SEQ&upto=SEQ (integers): records after < seq <= upto")
        if not 0 <= after <= upto:
            return _error(400, f"needs 0 <= after <= upto, got after={after} upto={upto}")
        if upto - after > self._max_records:
            return _error(
                413,
                f"at most {self._max_records} records per request, asked for {upto - after}",
                max_records=self._max_records,
            )
        durable = self._journal.last_seq()
        if upto > durable:
            return _error(
                416,
                f"node {self.node}: seqs {max(after, durable) + 1}..{upto} are not durable yet "
                f"(durable up to seq {durable})",
                last_seq=durable,
            )
        try:
            self._journal.check_available(after)
        except JournalGapError as exc:
            return _error(410, f"node {self.node}: {exc}", first_seq=exc.oldest)
        return Reply(200, ARROW_STREAM, pieces=_gathered(self._journal.read_ipc(after, upto)))


def _gathered(pieces: Iterator[bytes]) -> Iterator[bytes]:
    """Pieces joined up to about WRITE_BYTES: fewer thread hops and writes for small frames."""
    buffer: list[bytes] = []
    size = 0
    for piece in pieces:
        buffer.append(piece)
        size += len(piece)
        if size >= WRITE_BYTES:
            yield b"".join(buffer)
            buffer, size = [], 0
    if buffer:
        yield b"".join(buffer)


class HttpServer:
    """``await HttpServer(api).start(host, port)``; ``close()`` stops it."""

    def __init__(self, api: HttpApi, *, threads: int = 2) -> None:
        self.api = api
        self.port = 0
        # Journal reads run on threads of their own: remote readers never hold up the threads
        # the edge's own work runs on (journal open, snapshots).
        self._reads = ThreadPoolExecutor(threads, thread_name_prefix="http-journal")
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        self._reads.shutdown(wait=False, cancel_futures=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        try:
            while await self._one_cycle(conn, reader, writer):
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                status = exc.error_status_hint
                reply = _error(status, f"bad request: {exc}")
                with contextlib.suppress(h11.LocalProtocolError, OSError):
                    await self._send(conn, writer, reply, head_only=False)
        except (OSError, TimeoutError, JournalError) as exc:
            # A client gone, an idle one, or a journal that failed mid-stream (the client sees
            # a truncated chunked body, never a wrong one).
            log.debug("http connection closed: %s", exc)
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _one_cycle(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Serve one request; False when the connection is done."""
        request = await self._next_event(conn, reader)
        if not isinstance(request, h11.Request):
            return False  # ConnectionClosed: the client is done
        event: h11.Event = request
        while not isinstance(event, h11.EndOfMessage):  # a GET has no body; drop one
            event = await self._next_event(conn, reader)
            if isinstance(event, h11.ConnectionClosed):
                return False
        method, target = request.method.decode(), request.target.decode("ascii", "replace")
        reply = await asyncio.get_running_loop().run_in_executor(
            self._reads, self.api.handle, method, target, list(request.headers)
        )
        await self._send(conn, writer, reply, head_only=method == "HEAD")
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE

    @staticmethod
    async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Event:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                assert not isinstance(event, type)  # PAUSED only after start_next_cycle
                return event
            data = await asyncio.wait_for(reader.read(65_536), IDLE_TIMEOUT)
            conn.receive_data(data)

    async def _send(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, reply: Reply, *, head_only: bool
    ) -> None:
        headers = [("Content-Type", reply.content_type), *reply.headers]
        if reply.pieces is None:
            headers.append(("Content-Length", str(len(reply.body))))
        writer.write(
            conn.send(
                h11.Response(
                    status_code=reply.status,
                    headers=headers,
                    reason=http.HTTPStatus(reply.status).phrase,
                )
            )
            or b""
        )
        if reply.pieces is not None and not head_only:
            loop = asyncio.get_running_loop()
            while (
                piece := await loop.run_in_executor(self._reads, next, reply.pieces, None)
            ) is not None:
                writer.write(conn.send(h11.Data(data=piece)) or b"")
                await writer.drain()  # a slow reader pauses the journal read
        elif reply.body and not head_only:
            writer.write(conn.send(h11.Data(data=reply.body)) or b"")
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
