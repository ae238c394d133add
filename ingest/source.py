"""The ``edgebus`` Spark streaming source: replays the node journals by offset.

Theory of operation
-------------------
An offset is a JSON dict ``{node: last_seq_included}``; a node missing from a dict counts as 0.
A micro-batch ``(start, end]`` holds, for every node, exactly the journal records with
``start[node] < seq <= end[node]``. Journals are append-only and a seq never changes its record,
so the same ``(start, end)`` always yields the same rows: Spark can replay any batch from its
checkpoint and the sinks can de-duplicate by ``(node, seq)``.

Where the pieces run:

* ``latestOffset`` / ``partitions`` / ``commit`` run in one long-lived Python process next to
  the driver, on one :class:`EdgebusStreamReader` object per query run. ``latestOffset`` reads
  only frame headers (``JournalReader.last_seq``).
* ``read`` runs on the executors, one call per :class:`JournalRange`; it yields the journal's
  Arrow record batches (Spark 4.1 accepts ``pyarrow.RecordBatch`` from a Python stream reader),
  sliced at the range edges, consecutive frames joined into batches of :data:`READ_BATCH_ROWS`
  rows. Heavy imports happen there, not at import time.

Journals over the network (option ``edges``, issue 12): besides the node directories under
``path``, each edge ``HOST:PORT`` serves its node's durable journal over HTTP
(``broker_edge.http_api``, client in ``ingest.remote``). ``latestOffset`` asks every edge for its
node's seq range; a range of a remote node carries the edge's address, and the executor that
reads it fetches it from the edge itself: no journal byte passes through the driver. An edge
that does not answer is left out of that ``latestOffset``: its node's offset stays where it is
(only its records wait) and the other nodes keep flowing; once it answers, its node continues
from that offset, so its records arrive exactly once. A refusal (wrong token, a range retention
removed) stops the query with the edge, node and seqs in the error.

Capping. PySpark 4.1 gives Python sources no admission control (``maxRecordsPerBatch`` is not
passed in by Spark), so the reader caps itself: ``latestOffset`` returns at most
``maxRecordsPerBatch`` records beyond the end offset it planned last, splitting the budget
max-min fairly across the nodes with a backlog. Spark always starts the next batch at the end
offset it got last, so that "last planned end" is the only state the reader needs. It must
never go backwards: an end below Spark's start would make the next batch re-read records. A new
reader object (a query restart) recovers it in two independent ways and takes the larger:

1. the ``checkpointLocation`` option: the query's offset log
   ``{checkpointLocation}/offsets/{highest batch id}`` is ``v1``, a metadata JSON line, then one
   line per source with the source's end offset of that batch; and
2. Spark 4.1's ``PythonMicroBatchStream`` implements ``AcceptsLatestSeenOffset``: on restart it
   calls ``partitions(latest, latest)`` with the checkpointed offset before asking for
   ``latestOffset``; every ``partitions`` call raises the planned end to at least its ``end``.

Both were checked against Spark 4.1.4 (see ``tests/spark/test_source.py``). Capping is only a
batch-size bound; correctness (no gaps, no duplicates) comes from the offsets alone.

With ``trigger(availableNow=True)`` Spark asks for ``latestOffset`` once and stops there, so a
capped source delivers only the first batch; use ``processAllAvailable()`` to drain a backlog.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from ingest.worker_daemon import steady_zip_imports

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

    from ingest.journal import JournalReader
    from ingest.remote import EdgeJournal, EdgeUnavailable

logger = logging.getLogger(__name__)

SOURCE_NAME = "edgebus"
DEFAULT_MAX_RECORDS_PER_BATCH = 500_000  # the pipeline's default too (streaming.settings)
PARTITION_RECORDS = 125_000
"""A node's range is split into read tasks of at most this many records, for parallelism. Each
task routes its range as one table in a Python worker (~260 MiB at its peak for 125,000
records, ~200 for 50,000) and writes its own files; every task costs the same fixed work on
both sides whatever its size, so a backlog's batches go fastest in few big tasks: 125,000
against 50,000, journal → Delta sustained +15 % (BENCHMARKS.md, issue 12, "read tasks")."""

OPTION_PATH = "path"
OPTION_MAX_RECORDS = "maxRecordsPerBatch"
OPTION_CHECKPOINT = "checkpointLocation"
OPTION_EDGES = "edges"
"""Comma-separated ``HOST:PORT`` of edges serving their journal over HTTP."""
OPTION_TOKEN = "operatorToken"  # noqa: S105 (an option's name, not a token)
"""Bearer token for the edges (Spark redacts option values whose key matches "token")."""

Offset = dict[str, int]


class SourceError(Exception):
    """Root of the source's own errors (bad options, an offset that went backwards).

    Not a ``JournalError``: that would import the journal, and with it pyarrow, whenever the
    source is imported; the pyspark-data-sources style keeps heavy imports in the methods that
    run on executors. Errors raised inside Spark reach callers as Spark exceptions anyway, with
    this message (and a ``JournalError``'s, from ``read``) in their text.
    """


class SourceOptionError(SourceError):
    """A source option is missing or bad; the message names the option."""


@cache
def journal_spark_schema() -> StructType:
    """JOURNAL_SCHEMA as a Spark StructType (converted, not re-declared)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from schemas.journal import JOURNAL_SCHEMA

    schema: StructType = from_arrow_schema(JOURNAL_SCHEMA)
    return schema


def register(spark: SparkSession) -> None:
    """Make ``spark.readStream.format("edgebus")`` available in this session."""
    spark.dataSource.register(EdgebusDataSource)


@dataclass(frozen=True, slots=True)
class SourceOptions:
    journal_root: Path
    max_records_per_batch: int
    checkpoint: Path | None
    edges: tuple[str, ...] = ()
    token: str | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        """Validate the reader options; names are case-insensitive, as everywhere in Spark."""
        given = {key.lower(): value for key, value in options.items()}
        known = (OPTION_PATH, OPTION_MAX_RECORDS, OPTION_CHECKPOINT, OPTION_EDGES, OPTION_TOKEN)
        unknown = sorted(set(given) - {name.lower() for name in known})
        if unknown:
            raise SourceOptionError(
                f"edgebus source: unknown option(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(known)}"
            )
        root = given.get(OPTION_PATH.lower())
        if not root:
            raise SourceOptionError(
                f"edgebus source: option {OPTION_PATH!r} (the journal root directory) is required"
            )
        raw_max = given.get(OPTION_MAX_RECORDS.lower(), str(DEFAULT_MAX_RECORDS_PER_BATCH))
        try:
            max_records = int(raw_max)
        except ValueError:
            max_records = 0
        if max_records < 1:
            raise SourceOptionError(
                f"edgebus source: option {OPTION_MAX_RECORDS!r} must be a positive integer, "
                f"got {raw_max!r}"
            )
        checkpoint = _local_path(given.get(OPTION_CHECKPOINT.lower()))
        edges = tuple(
            e.strip() for e in given.get(OPTION_EDGES.lower(), "").split(",") if e.strip()
        )
        for edge in edges:
            parse_edge(edge)
        token = given.get(OPTION_TOKEN.lower()) or None
        return cls(Path(root), max_records, checkpoint, edges, token)


def parse_edge(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) of an edge's HTTP port."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65_535:
        raise SourceOptionError(
            f"edgebus source: option {OPTION_EDGES!r}: an edge is HOST:PORT, got {text!r}"
        )
    return host, int(port)


def _local_path(location: str | None) -> Path | None:
    if not location:
        return None
    url = urlparse(location)
    if url.scheme in ("", "file"):
        return Path(url.path if url.scheme else location)
    raise SourceOptionError(
        f"edgebus source: option {OPTION_CHECKPOINT!r} must be a local path to read the offset "
        f"log from, got {location!r}; leave it out to rely on Spark's restart offset alone"
    )


# How long planning a batch waits for the edge of a node whose records the batch holds, and how
# often it asks again (seconds).
EDGE_WAIT_SECONDS = 60.0
EDGE_RETRY_SECONDS = 1.0


class EdgebusDataSource(DataSource):
    """``spark.readStream.format("edgebus").option("path", journal_root)``."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        # Made in Spark's planner workers (a batch read's schema and partitions), which come
        # from pyspark's own daemon, not ingest.worker_daemon: from their next call on, they
        # too keep their zip directories.
        steady_zip_imports()

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        SourceOptions.parse(self.options)  # fail at load(), not at the first batch
        return journal_spark_schema()

    def streamReader(self, schema: StructType) -> EdgebusStreamReader:  # noqa: N802 (Spark API)
        return EdgebusStreamReader(SourceOptions.parse(self.options))


@dataclass(frozen=True)
class JournalRange(InputPartition):
    """One read task: the records of ``node`` with ``after_seq < seq <= upto_seq``, from the
    journal under the source's path, or from ``edge`` (``HOST:PORT``) over HTTP."""

    node: str
    after_seq: int
    upto_seq: int
    edge: str | None = None


class EdgebusStreamReader(DataSourceStreamReader):
    """Plans journal ranges by offset (driver side) and reads them (executor side)."""

    def __init__(self, options: SourceOptions) -> None:
        self._options = options
        self._planned: Offset | None = None  # end offset of the last batch Spark will start at
        self._journals: dict[str, JournalReader] = {}
        self._edge_of: dict[str, str] = {}  # remote node -> the edge serving it
        self._down: set[str] = set()  # edges that did not answer last time (logged once)

    # --- driver side ----------------------------------------------------------------------------

    def initialOffset(self) -> Offset:  # noqa: N802 (Spark API)
        from ingest.journal import list_nodes

        return dict.fromkeys(list_nodes(self._options.journal_root), 0)

    def latestOffset(self) -> Offset:  # noqa: N802 (Spark API)
        planned = self._planned_end()
        available, oldest, where = self._available()
        for node, seq in available.items():
            if seq < planned.get(node, 0):
                raise SourceError(
                    f"edgebus source: journal of node {node!r} ends at seq {seq} but the query "
                    f"already planned up to seq {planned[node]}: records were lost from "
                    f"{where[node]}"
                )
            if seq > planned.get(node, 0):
                _check_not_removed(node, planned.get(node, 0), oldest[node], where[node])
        end = cap_offsets(planned, available, self._options.max_records_per_batch)
        self._planned = end
        return end

    def available(self) -> Offset:
        """Every node's durable end now (local journals and the edges that answer), without
        planning anything (the quota lane's look ahead of the stream)."""
        return self._available()[0]

    def _available(self) -> tuple[Offset, dict[str, int | None], dict[str, str]]:
        """Each node's durable end, oldest seq still kept, and where its journal is."""
        available = local_ends(self._root, self._journal)
        oldest = {node: self._journal(node).first_seq() for node in available}
        where = {node: str(self._root / node) for node in available}
        for remote in self._edge_ranges(set(available)):
            available[remote.node] = remote.last_seq
            oldest[remote.node] = remote.first_seq
            where[remote.node] = f"edge {remote.edge}"
        return available, oldest, where

    def partitions(self, start: Offset, end: Offset) -> Sequence[JournalRange]:
        start, end = _check_offset(start), _check_offset(end)
        # On restart Spark 4.1 calls partitions(latest, latest) first (AcceptsLatestSeenOffset).
        planned = self._planned_end()
        self._planned = {n: max(planned.get(n, 0), end.get(n, 0)) for n in sorted({*planned, *end})}
        ranges: list[JournalRange] = []
        for node in sorted({*start, *end}):
            after, upto = start.get(node, 0), end.get(node, 0)
            if upto < after:
                # Spark would carry on from `end` and read (upto, after] a second time.
                raise SourceError(
                    f"edgebus source: offset of node {node!r} went backwards in a batch: "
                    f"start {after}, end {upto}"
                )
            edge = self._edge_for(node) if upto > after else None
            ranges.extend(
                JournalRange(node, lo, min(lo + PARTITION_RECORDS, upto), edge)
                for lo in range(after, upto, PARTITION_RECORDS)
            )
        return ranges

    def _edge_ranges(self, local: set[str]) -> list[EdgeJournal]:
        """Every edge's node and seq range, asked all at once (an unreachable edge costs its
        connect timeout once, not once per edge before it); an edge that does not answer is
        left out (its node's offset stays where it is), logged when it goes and comes back."""
        from concurrent.futures import ThreadPoolExecutor

        from ingest.remote import EdgeUnavailable, journal_range

        def ask(edge: str) -> EdgeJournal | EdgeUnavailable:
            try:
                return journal_range(edge, self._options.token)
            except EdgeUnavailable as exc:
                return exc

        edges = self._options.edges
        if not edges:
            return []
        with ThreadPoolExecutor(max_workers=min(len(edges), 16)) as pool:
            answers = list(pool.map(ask, edges))  # a refusal (EdgeRefused) raises here
        found: list[EdgeJournal] = []
        for edge, remote in zip(edges, answers, strict=True):
            if isinstance(remote, EdgeUnavailable):
                exc = remote
                if edge not in self._down:
                    logger.warning("%s; its node's records wait until it answers", exc)
                    self._down.add(edge)
                continue
            if edge in self._down:
                logger.info("edge %s answers again (node %s)", edge, remote.node)
                self._down.discard(edge)
            other = self._edge_of.get(remote.node, edge)
            if remote.node in local or other != edge:
                source = self._root / remote.node if remote.node in local else f"edge {other}"
                raise SourceError(
                    f"edgebus source: node {remote.node!r} of edge {edge} is also served by "
                    f"{source}: two journals under one node name"
                )
            self._edge_of[remote.node] = edge
            found.append(remote)
        return found

    def _edge_for(self, node: str) -> str | None:
        """None for a local node, else the edge serving it (asked again if not known yet: a
        batch replayed after a restart plans before ``latestOffset``).

        The batch holds records of ``node``, so it cannot go on without them: an edge that does
        not answer (restarting, or too busy to answer within the connect timeout) is asked
        again every EDGE_RETRY_SECONDS for EDGE_WAIT_SECONDS before the query fails naming it.
        """
        if not self._options.edges:
            return None
        deadline = time.monotonic() + EDGE_WAIT_SECONDS
        while node not in self._edge_of and not (self._root / node).is_dir():
            if time.monotonic() >= deadline:
                raise SourceError(
                    f"edgebus source: node {node!r} has records in this batch but neither "
                    f"{self._root} nor any edge that answers ({', '.join(self._options.edges)}) "
                    f"has its journal (asked for {EDGE_WAIT_SECONDS:g} s); is its edge down?"
                )
            self._edge_ranges(set())
            if node not in self._edge_of:
                time.sleep(EDGE_RETRY_SECONDS)  # an edge coming back has no event to await
        return self._edge_of.get(node)

    def commit(self, end: Offset) -> None:
        """Nothing to do: retention, not the source, decides when journal records go."""

    def _planned_end(self) -> Offset:
        if self._planned is None:
            checkpoint = self._options.checkpoint
            self._planned = {} if checkpoint is None else checkpointed_offset(checkpoint)
        return self._planned

    @property
    def _root(self) -> Path:
        return self._options.journal_root

    def _journal(self, node: str) -> JournalReader:
        from ingest.journal import JournalReader

        journal = self._journals.get(node)
        if journal is None:
            journal = self._journals[node] = JournalReader(self._root / node)
        return journal

    # --- executor side --------------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, JournalRange)
        if partition.edge is not None:
            from ingest.remote import read_range

            yield from coalesced(
                read_range(
                    partition.edge,
                    self._options.token,
                    partition.node,
                    partition.after_seq,
                    partition.upto_seq,
                )
            )
            return
        journal = worker_journal(self._root / partition.node)
        yield from coalesced(journal.read(partition.after_seq, partition.upto_seq))


# The journal readers of this thread, one per node directory, kept from task to task: Spark runs
# a Python worker's tasks one after another in the same process, and a new reader scans its
# segment's frame headers from the start (50-70 ms of an 8,000-frame segment, every batch), where
# a kept one goes on from where it stopped. Per thread: a reader's index is not shared between
# threads (the driver reads counters in a thread of its own, streaming.quota_lane).
_WORKER = threading.local()


def worker_journal(node_dir: Path) -> JournalReader:
    """This thread's reader of the journal at ``node_dir`` (made on first use)."""
    from ingest.journal import JournalReader

    readers: dict[Path, JournalReader] | None = getattr(_WORKER, "readers", None)
    if readers is None:
        readers = _WORKER.readers = {}
    reader = readers.get(node_dir)
    if reader is None:
        reader = readers[node_dir] = JournalReader(node_dir)
    return reader


# Rows per Arrow batch the source hands Spark. A journal frame holds what one group commit
# took (a median of 11 records at 10,000 msgs/s), and each batch costs Spark and the Python
# worker a fixed amount on its way: a 20,000-row range in 1,000 batches spent most of its
# task's time on that (BENCHMARKS.md, issue 12, 2026-11-28).
READ_BATCH_ROWS = 16_384


def coalesced(
    batches: Iterator[pa.RecordBatch], rows: int = READ_BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    """The rows of ``batches`` in order, consecutive batches joined until they hold ``rows``
    (the last one may hold fewer); batches of different schemas are never joined."""
    pending: list[pa.RecordBatch] = []
    held = 0
    for batch in batches:
        if pending and batch.schema != pending[0].schema:
            yield _joined(pending)
            pending, held = [], 0
        pending.append(batch)
        held += batch.num_rows
        if held >= rows:
            yield _joined(pending)
            pending, held = [], 0
    if pending:
        yield _joined(pending)


def _joined(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    import pyarrow as pa

    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


def local_ends(journal_root: Path, journal: Callable[[str], JournalReader]) -> Offset:
    """The durable end (newest durable seq) of every node's journal under ``journal_root``:
    what ``latestOffset`` plans up to before its cap, and what the pipeline's lag metrics
    measure against. ``journal(node)`` gives the node's reader (kept: it scans frames
    incrementally)."""
    from ingest.journal import list_nodes

    return {node: journal(node).last_seq() for node in list_nodes(journal_root)}


def _check_not_removed(node: str, after: int, oldest: int | None, where: str) -> None:
    """Stop, never skip, when retention already removed records this query has not read
    (retention misconfigured, segments removed by hand): the error names the node and the
    missing seqs."""
    if oldest is not None and after + 1 < oldest:
        raise SourceError(
            f"edgebus source: journal of node {node!r} no longer has seqs "
            f"{after + 1}..{oldest - 1} (its oldest segment starts at seq {oldest}) but "
            f"the query has read only up to seq {after}: they were removed from "
            f"{where} before the lake committed them; refusing to skip them"
        )


def cap_offsets(planned: Offset, available: Offset, budget: int) -> Offset:
    """The end offset at most ``budget`` records past ``planned``, shared max-min fairly.

    Every node with a backlog gets an equal share; what a small backlog leaves unused goes to
    the others. When the budget is smaller than the number of nodes, the largest backlogs go
    first (so no node starves: its backlog only grows while others shrink).
    """
    nodes = sorted({*planned, *available})
    backlog = {n: max(available.get(n, 0) - planned.get(n, 0), 0) for n in nodes}
    grant = dict.fromkeys(nodes, 0)
    left = budget
    active = [n for n in nodes if backlog[n] > 0]
    while left > 0 and active:
        share = left // len(active)
        if share == 0:
            by_need = sorted(active, key=lambda n: (grant[n] - backlog[n], n))
            for n in by_need[:left]:
                grant[n] += 1
            break
        for n in active:
            take = min(share, backlog[n] - grant[n])
            grant[n] += take
            left -= take
        active = [n for n in active if grant[n] < backlog[n]]
    return {n: planned.get(n, 0) + grant[n] for n in nodes}


def checkpointed_offset(checkpoint: Path, batch_id: int | None = None) -> Offset:
    """This source's end offset in entry ``batch_id`` of a query's offset log (default: the
    newest entry; {} when there is none, and for batch id -1: where a query starts).

    Spark writes ``offsets/{batch id}`` as ``v1``, a metadata JSON line, then one line per
    source (``-`` for a source without an offset yet). Our offsets are flat ``{str: int}``
    dicts; if several sources of a query look like that, the per-node maximum is taken: a too
    high start only makes one batch larger than the cap, a too low one would re-read records.
    A named entry that is not there is an error (Spark keeps the last 100).
    """
    log = checkpoint / "offsets"
    if batch_id is None:
        try:
            batch_ids = [int(name) for name in os.listdir(log) if name.isdigit()]
        except FileNotFoundError:
            return {}
        if not batch_ids:
            return {}
        batch_id = max(batch_ids)
    elif batch_id < 0:
        return {}
    entry = log / str(batch_id)
    try:
        lines = entry.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        message = f"edgebus source: the offset log has no batch {batch_id}: {entry}"
        raise SourceError(message) from None
    if not lines or lines[0] != "v1":
        raise SourceError(
            f"edgebus source: unsupported offset log format in {entry} "
            f"(first line {lines[:1]!r}, expected 'v1')"
        )
    merged: Offset = {}
    for line in lines[2:]:
        try:
            value = json.loads(line)
        except ValueError:
            continue  # "-" or another source's non-JSON offset
        if _is_flat_offset(value):
            for node, seq in value.items():
                merged[node] = max(merged.get(node, 0), seq)
    return merged


def _is_flat_offset(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and type(v) is int for k, v in value.items()
    )


def _check_offset(value: object) -> Offset:
    if not _is_flat_offset(value):
        raise SourceError(f"edgebus source: not an offset of this source: {value!r}")
    assert isinstance(value, dict)
    return value
