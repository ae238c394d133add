"""The client side of an edge's journal over HTTP (``broker_edge.http_api``).

The Spark source's driver asks each edge for its node's seq range (:func:`journal_range`); its
executors fetch the records of their ranges from the edges directly (:func:`read_range`). A
range is fetched in requests of at most :data:`REQUEST_RECORDS` records, each an Arrow IPC
stream read batch by batch as it arrives (bounded memory), checked seq by seq: a batch that does
not continue the range exactly is an error, never skipped or repeated.

An edge that cannot be reached raises :class:`EdgeUnavailable` (the driver leaves that node's
offset where it is: only its own records wait). A request the edge refuses (a wrong token, a
range retention removed) raises :class:`EdgeRefused` naming the edge, node and seqs: the query
stops, it never skips records.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ingest.source import SourceError, parse_edge

if TYPE_CHECKING:
    import pyarrow as pa

REQUEST_RECORDS = 50_000
"""Records per HTTP request: what one request costs the edge and the reader (the edge's own
cap, ``http_max_records``, is higher)."""
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 60.0
# An executor retries an unreachable edge (or a stream cut short) for about this long.
RETRY_SECONDS = 60.0


class EdgeUnavailable(SourceError):
    """The edge did not answer (down, unreachable, or the connection broke)."""


class EdgeRefused(SourceError):
    """The edge answered with an error: bad token, removed range, bad request."""


@dataclass(frozen=True, slots=True)
class EdgeJournal:
    """What ``GET /journal`` says: the node an edge serves and its seq range."""

    edge: str
    node: str
    first_seq: int | None
    last_seq: int


def _get(edge: str, target: str, token: str | None, timeout: float) -> http.client.HTTPResponse:
    host, port = parse_edge(edge)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        conn.request("GET", target, headers=headers)
        response = conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise EdgeUnavailable(f"edge {edge}: {exc or type(exc).__name__}") from exc
    if response.status != 200:
        try:
            detail = json.loads(response.read()).get("error", "")
        except (ValueError, OSError, http.client.HTTPException, AttributeError):
            detail = ""
        finally:
            conn.close()
        hint = (
            " (the pipeline's operator token, --tenants)" if response.status in (401, 403) else ""
        )
        raise EdgeRefused(
            f"edge {edge} refused GET {target}: {response.status} {response.reason}{hint}: {detail}"
        )
    return response


def journal_range(edge: str, token: str | None, timeout: float = CONNECT_TIMEOUT) -> EdgeJournal:
    """The node ``edge`` serves, its oldest seq on disk and its newest durable seq."""
    response = _get(edge, "/journal", token, timeout)
    try:
        body = json.loads(response.read())
        first = body["first_seq"]
        return EdgeJournal(
            edge, str(body["node"]), None if first is None else int(first), int(body["last_seq"])
        )
    except (OSError, http.client.HTTPException) as exc:
        raise EdgeUnavailable(f"edge {edge}: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise EdgeRefused(f"edge {edge}: GET /journal answered no seq range: {exc}") from exc
    finally:
        response.close()


def read_range(
    edge: str,
    token: str | None,
    node: str,
    after_seq: int,
    upto_seq: int,
    *,
    retry_seconds: float = RETRY_SECONDS,
) -> Iterator[pa.RecordBatch]:
    """Yield exactly ``node``'s records with ``after_seq < seq <= upto_seq`` from ``edge``.

    A failed connection or a stream cut short is retried from the first seq not yet yielded,
    for up to ``retry_seconds`` after the last progress; then :class:`EdgeUnavailable`.
    """
    wanted = after_seq + 1
    deadline = time.monotonic() + retry_seconds
    delay = 0.2
    while wanted <= upto_seq:
        upto = min(upto_seq, wanted - 1 + REQUEST_RECORDS)
        try:
            for batch in _request(edge, token, node, wanted - 1, upto):
                wanted += batch.num_rows
                deadline = time.monotonic() + retry_seconds
                yield batch
        except EdgeUnavailable:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)  # the edge may be restarting; nothing to await across processes
            delay = min(delay * 2, 5.0)


def _request(
    edge: str, token: str | None, node: str, after: int, upto: int
) -> Iterator[pa.RecordBatch]:
    import pyarrow as pa

    response = _get(edge, f"/journal/records?after={after}&upto={upto}", token, READ_TIMEOUT)
    wanted = after + 1
    try:
        reader = pa.ipc.open_stream(response)
        for batch in reader:
            if batch.num_rows == 0:
                continue
            seqs = batch.column(1)
            first, last = seqs[0].as_py(), seqs[-1].as_py()
            if first != wanted or last != wanted + batch.num_rows - 1 or last > upto:
                raise EdgeRefused(
                    f"edge {edge}: node {node!r} sent seqs {first}..{last} where seq {wanted} "
                    f"was next (asked for {after + 1}..{upto})"
                )
            if batch.column(0)[0].as_py() != node:
                raise EdgeRefused(
                    f"edge {edge} now serves node {batch.column(0)[0].as_py()!r}, not {node!r}"
                )
            wanted = last + 1
            yield batch
        if wanted <= upto:
            raise EdgeUnavailable(
                f"edge {edge}: the stream of node {node!r} seqs {after + 1}..{upto} ended "
                f"before seq {wanted}"
            )
    except (OSError, http.client.HTTPException, pa.ArrowException) as exc:
        # A connection broken mid-stream (http.client's IncompleteRead, a reset, a truncated
        # IPC message): the caller retries from the first seq it has not got.
        raise EdgeUnavailable(
            f"edge {edge}: reading node {node!r} seqs {after + 1}..{upto} broke at seq "
            f"{wanted}: {exc}"
        ) from exc
    finally:
        response.close()
