"""The route: one pass over a micro-batch's journal records, where they are read, that gives
every record its table's row.

Theory of operation
-------------------
The pipeline's one journal query reads each micro-batch from the journals once, through
:class:`RoutedJournal`: the ``edgebus`` source (``ingest.source``) with :func:`route` applied in
the executors' Python workers that read each journal range, never on the driver. For each
range :func:`route`:

1. applies the record contract (``schemas.contracts.RECORD_RULES``: tenant, topic, sane ts);
2. splits the records that keep it by topic: device traffic → ``messages`` rows
   (:func:`streaming.history.split`), ``$log/`` → ``logs`` rows (:func:`streaming.logs.transform`),
   ``$counters/`` → parsed counter records (:func:`streaming.usage.transform`);
3. turns every record a contract rejected into a ``quarantine`` row.

Its output is one table of the union of those shapes (:data:`ROUTED_SCHEMA`) where ``dest``
names the table a row is for; the pipeline persists it on the executors and writes each table
from its share (``streaming.pipeline``). Every step is a pure function of the records, so a
replayed batch routes every record the same way, and each step is unit-tested without Spark.

Why in the source rather than a ``mapInArrow`` after it: the records cross from Python to the
JVM once instead of three times (source → JVM → Python → JVM), which more than halved the
batch's read and route time (BENCHMARKS.md, issue 18). Why one pass rather than one per table:
the message contract parses every JSON payload, and a per-table pass would parse them again
for ``quarantine``.

The wire: ``user_properties`` (a list of structs) crosses from Python to the JVM as JSON text
(:data:`WIRE_COLUMN`; ``from_json`` on the JVM side when a table's share is selected). Spark's
Arrow conversion of a list of structs costs about 100 µs a row (measured: 10 s for 100,000
rows, nearly all of them null) against well under 1 µs for a string.
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from ingest.source import (
    EdgebusDataSource,
    EdgebusStreamReader,
    JournalRange,
    Offset,
    SourceOptionError,
    SourceOptions,
)
from schemas.contracts import RECORD_RULES, first_broken, rows_where
from schemas.journal import JOURNAL_SCHEMA
from schemas.tables import LOGS_SCHEMA, MESSAGES_SCHEMA, QUARANTINE_SCHEMA
from schemas.usage import COUNTER_RECORD_SCHEMA
from sinks.delta import conform, spark_schema
from sinks.quarantine import quarantine_rows
from streaming import history, logs, usage

# The source's name: ``spark.readStream.format(ROUTED_SOURCE)`` (see :func:`register`).
ROUTED_SOURCE = "edgebus_routed"

# The options of a batch read of one range of the journals (see :class:`RoutedRangeReader`).
OPTION_START = "startOffset"
OPTION_END = "endOffset"
OPTION_DESTS = "dests"
OPTION_SUMMARY = "summary"
_RANGE_OPTIONS = (OPTION_START, OPTION_END, OPTION_DESTS, OPTION_SUMMARY)

# The values of ``dest``: the table (or, for counters, the step) a routed row is for.
MESSAGES = "messages"
LOGS = "logs"
COUNTERS = "counters"
QUARANTINE = "quarantine"
# Where a record that breaks the record contract was meant to go when no step takes it.
UNROUTED = "none"

# Each destination's own schema; the routed rows hold the union of their columns.
DESTINATIONS: dict[str, pa.Schema] = {
    MESSAGES: MESSAGES_SCHEMA,
    LOGS: LOGS_SCHEMA,
    COUNTERS: COUNTER_RECORD_SCHEMA,
    QUARANTINE: QUARANTINE_SCHEMA,
}


def _union(schemas: list[pa.Schema]) -> pa.Schema:
    fields: dict[str, pa.Field] = {"dest": pa.field("dest", pa.string())}
    for schema in schemas:
        for field in schema:
            known = fields.get(field.name)
            if known is not None and known.type != field.type:
                raise TypeError(f"column {field.name}: {known.type} and {field.type}")
            # Nullable: a column belongs to some destinations only.
            fields.setdefault(field.name, field.with_nullable(True))
    return pa.schema(list(fields.values()))


ROUTED_SCHEMA = _union(list(DESTINATIONS.values()))

# The column that crosses the JVM/Python boundary as JSON text, and its schemas on the wire.
WIRE_COLUMN = "user_properties"
_PROPERTIES = JOURNAL_SCHEMA.field(WIRE_COLUMN).type


def _wire(schema: pa.Schema) -> pa.Schema:
    index = schema.get_field_index(WIRE_COLUMN)
    return schema.set(index, schema.field(index).with_type(pa.string()))


ROUTED_WIRE_SCHEMA = _wire(ROUTED_SCHEMA)

# A summary read's rows: per destination and node, how many rows and the last seq among them.
SUMMARY_SCHEMA = pa.schema(
    [
        pa.field("dest", pa.string(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
        pa.field("last_seq", pa.int64(), nullable=False),
    ]
)


def route(journal: pa.Table) -> pa.Table:
    """Journal records (any Arrow types equal to the journal's) to routed rows."""
    records = conform(journal, JOURNAL_SCHEMA)
    rules, reasons = first_broken(records, RECORD_RULES)
    kept = pc.is_null(rules)
    broken = pc.invert(kept)
    rejected = rows_where(records, broken)
    parts = [
        (
            QUARANTINE,
            quarantine_rows(
                rejected,
                _meant_for(rejected.column("topic")),
                rules.filter(broken),
                reasons.filter(broken),
            ),
        )
    ]
    good = rows_where(records, kept)
    topics = good.column("topic")
    for dest, accepts, step in (
        (MESSAGES, history.accepts, history.split),
        (LOGS, logs.accepts, logs.transform),
        (COUNTERS, usage.accepts, usage.transform),
    ):
        rows, quarantined = step(rows_where(good, accepts(topics)))
        parts += [(dest, rows), (QUARANTINE, quarantined)]
    routed = [_widen(dest, rows) for dest, rows in parts if rows.num_rows]
    return pa.concat_tables(routed) if routed else ROUTED_SCHEMA.empty_table()


def route_wire(journal: pa.Table) -> pa.Table:
    """:func:`route` on the wire schema (:data:`ROUTED_WIRE_SCHEMA`: ``user_properties`` as
    JSON text), what :class:`RoutedJournal` hands to the JVM."""
    routed = route(journal)
    index = routed.schema.get_field_index(WIRE_COLUMN)
    routed = routed.set_column(index, WIRE_COLUMN, _to_json(routed.column(index)))
    return routed.cast(ROUTED_WIRE_SCHEMA)


def register(spark: SparkSession) -> None:
    """Make ``spark.readStream.format(ROUTED_SOURCE)`` and ``spark.read.format(ROUTED_SOURCE)``
    available in this session."""
    spark.dataSource.register(RoutedJournal)


def read_range(
    spark: SparkSession,
    options: dict[str, str],
    start: Offset,
    end: Offset,
    *,
    dests: tuple[str, ...] = (),
    summary: bool = False,
) -> DataFrame:
    """The routed rows of the records ``start < seq <= end`` (per node) as a batch DataFrame:
    only those for ``dests`` (all when empty), or with ``summary`` one :data:`SUMMARY_SCHEMA`
    row per read task, destination and node. ``options``: the journal source's options.

    Only the rows asked for cross to the JVM; the route runs in the read tasks either way."""
    reader = spark.read.format(ROUTED_SOURCE).options(**options)
    reader = reader.option(OPTION_START, orjson.dumps(start).decode())
    reader = reader.option(OPTION_END, orjson.dumps(end).decode())
    if dests:
        reader = reader.option(OPTION_DESTS, ",".join(dests))
    if summary:
        reader = reader.option(OPTION_SUMMARY, "true")
    return reader.load()


class RoutedJournal(EdgebusDataSource):
    """The ``edgebus`` journal source (same options, offsets and partitions) whose rows are
    the routed rows (:data:`ROUTED_WIRE_SCHEMA`) instead of the raw records.

    As a stream it replays the journals by offset like ``edgebus``. As a batch read it reads
    one range, given by :data:`OPTION_START` and :data:`OPTION_END` (offsets as JSON), and
    can keep only some destinations (:data:`OPTION_DESTS`) or summarise them
    (:data:`OPTION_SUMMARY`): see :func:`read_range`.
    """

    @classmethod
    def name(cls) -> str:
        return ROUTED_SOURCE

    def schema(self) -> StructType:
        journal, wanted = _split_options(self.options)
        SourceOptions.parse(journal)  # the options are checked at load(), not in a task
        summary = _RangeOptions.parse(wanted).summary if wanted else False
        return spark_schema(SUMMARY_SCHEMA if summary else ROUTED_WIRE_SCHEMA)

    def streamReader(self, schema: StructType) -> RoutedJournalReader:  # noqa: N802 (Spark API)
        return RoutedJournalReader(SourceOptions.parse(self.options))

    def reader(self, schema: StructType) -> RoutedRangeReader:
        journal, wanted = _split_options(self.options)
        return RoutedRangeReader(SourceOptions.parse(journal), _RangeOptions.parse(wanted))


class RoutedJournalReader(EdgebusStreamReader):
    """Plans like the journal reader; each read task routes its journal range in one go."""

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        routed = _route_range(self, partition)
        if routed is not None:
            yield from routed.to_batches()


class RoutedRangeReader(DataSourceReader):
    """A batch read of one range of the journals: the same read tasks as the stream's."""

    def __init__(self, journal: SourceOptions, wanted: _RangeOptions) -> None:
        self._journal = EdgebusStreamReader(journal)
        self._wanted = wanted

    def partitions(self) -> list[JournalRange]:
        return list(self._journal.partitions(self._wanted.start, self._wanted.end))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        routed = _route_range(self._journal, partition)
        if routed is None:
            return
        if self._wanted.dests:
            routed = routed.filter(pc.is_in(routed.column("dest"), pa.array(self._wanted.dests)))
        if self._wanted.summary:
            yield from _summary(routed).to_batches()
        else:
            yield from routed.to_batches()


def _route_range(journal: EdgebusStreamReader, partition: InputPartition) -> pa.Table | None:
    # A range is at most ingest.source.PARTITION_RECORDS records, routed as one table: the
    # route's cost per call dwarfs its cost per row for the small frames of an edge's group
    # commits.
    batches = list(EdgebusStreamReader.read(journal, partition))  # the records, not routed
    return route_wire(_table(batches)) if batches else None


def _summary(routed: pa.Table) -> pa.Table:
    counts = routed.group_by(["dest", "node"]).aggregate([("seq", "count"), ("seq", "max")])
    return pa.Table.from_arrays(
        [
            counts.column("dest"),
            counts.column("node"),
            counts.column("seq_count").cast(pa.int64()),
            counts.column("seq_max").cast(pa.int64()),
        ],
        schema=SUMMARY_SCHEMA,
    )


class _RangeOptions:
    """The options of a batch read (:func:`read_range`)."""

    def __init__(self, start: Offset, end: Offset, dests: list[str], summary: bool) -> None:
        self.start, self.end, self.dests, self.summary = start, end, dests, summary

    @classmethod
    def parse(cls, given: dict[str, str]) -> _RangeOptions:
        start, end = (_offset(given, name) for name in (OPTION_START, OPTION_END))
        dests = [d for d in given.get(OPTION_DESTS.lower(), "").split(",") if d]
        unknown = sorted(set(dests) - {*DESTINATIONS})
        if unknown:
            raise SourceOptionError(
                f"{ROUTED_SOURCE}: option {OPTION_DESTS!r} names unknown destinations "
                f"{unknown}; known: {', '.join(DESTINATIONS)}"
            )
        summary = given.get(OPTION_SUMMARY.lower(), "false").lower() == "true"
        return cls(start, end, dests, summary)


def _offset(given: dict[str, str], name: str) -> Offset:
    raw = given.get(name.lower())
    if raw is None:
        raise SourceOptionError(f"{ROUTED_SOURCE}: a batch read needs option {name!r}")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and type(v) is int for k, v in value.items()
    ):
        raise SourceOptionError(f"{ROUTED_SOURCE}: option {name!r} is not an offset: {raw!r}")
    return value


def _split_options(options: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The journal source's options and the batch read's own (lower-cased names)."""
    mine = {name.lower() for name in _RANGE_OPTIONS}
    journal = {k: v for k, v in options.items() if k.lower() not in mine}
    wanted = {k.lower(): v for k, v in options.items() if k.lower() in mine}
    return journal, wanted


def _table(batches: list[pa.RecordBatch]) -> pa.Table:
    schema = batches[0].schema
    if all(batch.schema.equals(schema) for batch in batches):
        return pa.Table.from_batches(batches, schema)
    # Segments written by older edges may differ in physical types: each to the journal's.
    return pa.concat_tables(conform(pa.Table.from_batches([b]), JOURNAL_SCHEMA) for b in batches)


def _to_json(lists: pa.ChunkedArray) -> pa.Array:
    if lists.null_count == len(lists):
        return pa.nulls(len(lists), pa.string())
    dumps = orjson.dumps
    return pa.array(
        [None if value is None else dumps(value).decode() for value in lists.to_pylist()],
        pa.string(),
    )


def _widen(dest: str, rows: pa.Table) -> pa.Table:
    n = rows.num_rows
    columns = [
        pa.array([dest] * n, pa.string())
        if field.name == "dest"
        else rows.column(field.name)
        if field.name in rows.column_names
        else pa.nulls(n, field.type)
        for field in ROUTED_SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=ROUTED_SCHEMA)


def _meant_for(topics: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    tables: pa.Array | pa.ChunkedArray = pa.array([UNROUTED] * len(topics), pa.string())
    for table, accepts in (
        (usage.TABLE, usage.accepts),
        (logs.TABLE, logs.accepts),
        (history.TABLE, history.accepts),
    ):  # the first step that accepts a topic wins: history, then logs, then usage
        tables = pc.if_else(accepts(topics), pa.scalar(table), tables)
    return tables
