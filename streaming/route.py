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

The stream carries the ``messages`` rows only (:data:`MESSAGES_WIRE_SCHEMA`): nearly every
record is device traffic, and the pipeline writes them with Delta straight from the read, in
one pass, with nothing persisted. The other destinations' rows (``logs``, counter records,
``quarantine``: :data:`OTHERS_WIRE_SCHEMA`, with ``dest`` naming the table) come from a batch
read of the same journal range (:func:`read_others`), which the pipeline makes only when the
``messages`` commit holds fewer rows than the batch has records. Every step is a pure function
of the records, so both reads route every record the same way (and a replayed batch too), and
each step is unit-tested without Spark.

Why in the source rather than a ``mapInArrow`` after it: the records cross from Python to the
JVM once instead of three times (source → JVM → Python → JVM): the read and route of a
200,000-row batch went from 3.9 s to 1.6 s (BENCHMARKS.md, issue 18). Why messages straight
from the read and the rest by a second read, rather than the routed batch persisted and filtered
per table: building Spark's cache of the routed rows cost about as much as the read itself
(BENCHMARKS.md, issue 18), and the second read is made only when the batch has other rows,
and only those rows cross to the JVM. Why one route rather than one per table: the message
contract parses every JSON payload, and a per-table pass would parse them again for
``quarantine``.

The wire: ``user_properties`` (a list of structs) crosses from Python to the JVM as JSON text
(:data:`WIRE_COLUMN`; :func:`from_wire` on the JVM side when a table's share is selected), an
empty list as ``""``, so the JVM parses JSON only for the records that have properties. Spark's
Arrow conversion of a list of structs costs about 100 µs a row (measured: 10 s for 100,000
rows, nearly all of them null) against well under 1 µs for a string.

Columns derived from others (``payload_text``: ``schemas.tables.MESSAGES_DERIVED``) are not
routed at all: :func:`share` adds them as Spark SQL expressions, evaluated by the executors'
JVM as the rows are written, so neither the route nor the wire carries them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import ArrayType, StructType

from ingest.source import (
    EdgebusDataSource,
    EdgebusStreamReader,
    JournalRange,
    Offset,
    SourceOptionError,
    SourceOptions,
)
from ingest.worker_daemon import steady_zip_imports
from schemas.contracts import RECORD_RULES, first_broken, rows_where
from schemas.journal import JOURNAL_SCHEMA
from schemas.tables import (
    LOGS_SCHEMA,
    MESSAGES_DERIVED,
    MESSAGES_ROUTED_SCHEMA,
    QUARANTINE_SCHEMA,
)
from schemas.usage import COUNTER_RECORD_SCHEMA
from sinks.delta import conform, spark_schema
from sinks.quarantine import quarantine_rows
from streaming import history, logs, usage

# The source's name: ``spark.readStream.format(ROUTED_SOURCE)`` (see :func:`register`).
ROUTED_SOURCE = "edgebus_routed"

# The values of ``dest``: the table (or, for counters, the step) a routed row is for.
MESSAGES = "messages"
LOGS = "logs"
COUNTERS = "counters"
QUARANTINE = "quarantine"
# Where a record that breaks the record contract was meant to go when no step takes it.
UNROUTED = "none"

# Each destination's own schema (for messages, less what the JVM derives: see share); the routed
# rows hold the union of their columns.
DESTINATIONS: dict[str, pa.Schema] = {
    MESSAGES: MESSAGES_ROUTED_SCHEMA,
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
# What the second read of a batch (:func:`read_others`) carries: every destination but messages.
OTHERS = (LOGS, COUNTERS, QUARANTINE)
OTHERS_SCHEMA = _union([DESTINATIONS[dest] for dest in OTHERS])

# The column that crosses the JVM/Python boundary as JSON text, and its schemas on the wire.
WIRE_COLUMN = "user_properties"
_PROPERTIES = JOURNAL_SCHEMA.field(WIRE_COLUMN).type


def _wire(schema: pa.Schema) -> pa.Schema:
    index = schema.get_field_index(WIRE_COLUMN)
    return schema.set(index, schema.field(index).with_type(pa.string()))


MESSAGES_WIRE_SCHEMA = _wire(MESSAGES_ROUTED_SCHEMA)
OTHERS_WIRE_SCHEMA = _wire(OTHERS_SCHEMA)

# The options of a batch read of one journal range (:func:`read_others`): offsets as JSON.
OPTION_START = "startOffset"
OPTION_END = "endOffset"


def route(journal: pa.Table) -> pa.Table:
    """Journal records (any Arrow types equal to the journal's) to routed rows
    (:data:`ROUTED_SCHEMA`: every destination's, ``dest`` naming it)."""
    return _widened(route_parts(journal), ROUTED_SCHEMA)


def route_parts(journal: pa.Table) -> list[tuple[str, pa.Table]]:
    """Journal records to ``(destination, rows)`` pairs, each in its destination's schema
    (:data:`DESTINATIONS`); a destination may come more than once (``quarantine``)."""
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
    return [(dest, rows) for dest, rows in parts if rows.num_rows]


def messages_wire(journal: pa.Table) -> pa.Table:
    """The ``messages`` rows of journal records on the wire (:data:`MESSAGES_WIRE_SCHEMA`):
    what the stream of :class:`RoutedJournal` hands to the JVM."""
    rows = [rows for dest, rows in route_parts(journal) if dest == MESSAGES]
    table = rows[0] if rows else MESSAGES_ROUTED_SCHEMA.empty_table()
    return _on_wire(table, MESSAGES_WIRE_SCHEMA)


def others_wire(journal: pa.Table) -> pa.Table:
    """Every other destination's rows of journal records on the wire
    (:data:`OTHERS_WIRE_SCHEMA`, ``dest`` naming the table): what a batch read of
    :class:`RoutedJournal` (:func:`read_others`) hands to the JVM."""
    parts = [(dest, rows) for dest, rows in route_parts(journal) if dest != MESSAGES]
    return _on_wire(_widened(parts, OTHERS_SCHEMA), OTHERS_WIRE_SCHEMA)


def _on_wire(rows: pa.Table, wire: pa.Schema) -> pa.Table:
    index = rows.schema.get_field_index(WIRE_COLUMN)
    rows = rows.set_column(index, WIRE_COLUMN, _to_json(rows.column(index)))
    return rows.cast(wire)


def register(spark: SparkSession) -> None:
    """Make ``spark.readStream.format(ROUTED_SOURCE)`` (and its batch reads,
    :func:`read_others`) available in this session."""
    spark.dataSource.register(RoutedJournal)


def read_others(
    spark: SparkSession, options: dict[str, str], start: Offset, end: Offset
) -> DataFrame:
    """The rows of every destination but ``messages`` (:data:`OTHERS_WIRE_SCHEMA`) of the
    records ``start < seq <= end`` (per node), as a batch DataFrame; ``options`` are the
    journal source's. The route runs in the read tasks; only these rows cross to the JVM."""
    return (
        spark.read.format(ROUTED_SOURCE)
        .options(**options)
        .option(OPTION_START, orjson.dumps(start).decode())
        .option(OPTION_END, orjson.dumps(end).decode())
        .load()
    )


def read_counters(options: dict[str, str], start: Offset, end: Offset) -> pa.Table:
    """The counter records (:data:`COUNTER_RECORD_SCHEMA`, as the route makes them) of the
    records ``start < seq <= end`` (per node), read here, on the driver, one read task's range
    at a time (the quota lane, :mod:`streaming.quota_lane`). Only the records meant for the
    usage step are routed: the route's steps are per record, so they get the rows the
    executors' route gives them."""
    reader = EdgebusStreamReader(SourceOptions.parse(options))
    found: list[pa.Table] = []
    for partition in reader.partitions(start, end):
        batches = list(reader.read(partition))
        if not batches:
            continue
        records = _table(batches)
        wanted = pc.equal(_meant_for(records.column("topic")), usage.TABLE)
        if not pc.any(wanted).as_py():
            continue
        found += [rows for dest, rows in route_parts(records.filter(wanted)) if dest == COUNTERS]
    return pa.concat_tables(found) if found else COUNTER_RECORD_SCHEMA.empty_table()


class RoutedJournal(EdgebusDataSource):
    """The ``edgebus`` journal source (same options, offsets and partitions) whose rows are
    routed: as a stream, the ``messages`` rows (:data:`MESSAGES_WIRE_SCHEMA`); as a batch read
    of one range (options :data:`OPTION_START` and :data:`OPTION_END`, see
    :func:`read_others`), every other destination's rows (:data:`OTHERS_WIRE_SCHEMA`)."""

    @classmethod
    def name(cls) -> str:
        return ROUTED_SOURCE

    def schema(self) -> StructType:
        journal, bounds = _split_options(self.options)
        SourceOptions.parse(journal)  # the options are checked at load(), not in a task
        if bounds:
            _range(bounds)
            return spark_schema(OTHERS_WIRE_SCHEMA)
        return spark_schema(MESSAGES_WIRE_SCHEMA)

    def streamReader(self, schema: StructType) -> RoutedJournalReader:  # noqa: N802 (Spark API)
        return RoutedJournalReader(SourceOptions.parse(self.options))

    def reader(self, schema: StructType) -> RoutedRangeReader:
        steady_zip_imports()  # in the planner worker that plans the read (as in __init__)
        journal, bounds = _split_options(self.options)
        return RoutedRangeReader(SourceOptions.parse(journal), *_range(bounds))


class RoutedJournalReader(EdgebusStreamReader):
    """Plans like the journal reader; each read task routes its journal range in one go and
    yields its ``messages`` rows."""

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # A range is at most ingest.source.PARTITION_RECORDS records, routed as one table:
        # the route's cost per call dwarfs its cost per row for the small frames of an edge's
        # group commits.
        batches = list(super().read(partition))  # the journal's records
        if batches:
            yield from messages_wire(_table(batches)).to_batches()


class RoutedRangeReader(DataSourceReader):
    """A batch read of one range of the journals, in the stream's read tasks, yielding every
    destination's rows but ``messages``'."""

    def __init__(self, options: SourceOptions, start: Offset, end: Offset) -> None:
        self._journal = EdgebusStreamReader(options)
        self._start, self._end = start, end

    def partitions(self) -> list[JournalRange]:
        return list(self._journal.partitions(self._start, self._end))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        batches = list(self._journal.read(partition))
        if batches:
            yield from others_wire(_table(batches)).to_batches()


def _split_options(options: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The journal source's options and a range read's bounds (lower-cased names: Spark hands
    options over case-insensitively)."""
    bounds = {OPTION_START.lower(), OPTION_END.lower()}
    journal = {k: v for k, v in options.items() if k.lower() not in bounds}
    given = {k.lower(): v for k, v in options.items() if k.lower() in bounds}
    return journal, given


def _range(bounds: dict[str, str]) -> tuple[Offset, Offset]:
    start, end = (_offset(bounds, name) for name in (OPTION_START, OPTION_END))
    return start, end


def _offset(bounds: dict[str, str], name: str) -> Offset:
    raw = bounds.get(name.lower())
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


def _table(batches: list[pa.RecordBatch]) -> pa.Table:
    schema = batches[0].schema
    if all(batch.schema.equals(schema) for batch in batches):
        return pa.Table.from_batches(batches, schema)
    # Segments written by older edges may differ in physical types: each to the journal's.
    return pa.concat_tables(conform(pa.Table.from_batches([b]), JOURNAL_SCHEMA) for b in batches)


def _to_json(lists: pa.ChunkedArray) -> pa.Array:
    """``user_properties`` on the wire: JSON text, with ``""`` for an empty list (what nearly
    every record holds: MQTT 3.1.1 has no properties) so the JVM parses no JSON for it."""
    lengths = pc.list_value_length(lists)
    if pc.max(lengths).as_py() in (None, 0):  # only empty lists and nulls: no JSON at all
        return pc.if_else(pc.is_null(lengths), pa.scalar(None, pa.string()), pa.scalar(""))
    dumps = orjson.dumps
    return pa.array(
        [
            None if value is None else dumps(value).decode() if value else ""
            for value in lists.to_pylist()
        ],
        pa.string(),
    )


def share(routed: DataFrame, dest: str) -> DataFrame:
    """The routed rows for ``dest`` with that destination's columns (``user_properties``
    parsed back from its JSON text on the wire): the stream's rows for ``messages`` (all of
    them, with the columns the JVM derives: ``MESSAGES_DERIVED``), a second read's rows with
    ``dest`` naming the table for the others."""
    from pyspark.sql import functions as F  # noqa: N812 (pyspark's own convention)

    schema = DESTINATIONS[dest]
    columns = [
        from_wire(F.col(name), cast(ArrayType, spark_schema(schema)[name].dataType)).alias(name)
        if name == WIRE_COLUMN
        else F.col(f"`{name}`")
        for name in schema.names
    ]
    if dest == MESSAGES:
        columns += [F.expr(sql).alias(name) for name, sql in MESSAGES_DERIVED.items()]
    else:
        routed = routed.where(F.col("dest") == dest)
    return routed.select(*columns)


def from_wire(text: Column, data_type: ArrayType) -> Column:
    """The JVM side of :func:`_to_json`: the wire's text back to ``user_properties``."""
    from pyspark.sql import functions as F  # noqa: N812 (pyspark's own convention)

    return F.when(text == "", F.array().cast(data_type)).otherwise(F.from_json(text, data_type))


def _widened(parts: list[tuple[str, pa.Table]], schema: pa.Schema) -> pa.Table:
    """``parts`` in one table of ``schema`` (a union of theirs), ``dest`` naming each row's."""
    return pa.concat_tables(
        [_widen(dest, rows, schema) for dest, rows in parts] or [schema.empty_table()]
    )


def _widen(dest: str, rows: pa.Table, schema: pa.Schema) -> pa.Table:
    n = rows.num_rows
    columns = [
        pa.array([dest] * n, pa.string())
        if field.name == "dest"
        else rows.column(field.name)
        if field.name in rows.column_names
        else pa.nulls(n, field.type)
        for field in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _meant_for(topics: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    tables: pa.Array | pa.ChunkedArray = pa.array([UNROUTED] * len(topics), pa.string())
    for table, accepts in (
        (usage.TABLE, usage.accepts),
        (logs.TABLE, logs.accepts),
        (history.TABLE, history.accepts),
    ):  # the first step that accepts a topic wins: history, then logs, then usage
        tables = pc.if_else(accepts(topics), pa.scalar(table), tables)
    return tables
