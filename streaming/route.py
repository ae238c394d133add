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
JVM once instead of three times (source → JVM → Python → JVM): the read and route of a
200,000-row batch went from 3.9 s to 1.6 s (BENCHMARKS.md, issue 18). Persisting the routed
batch and filtering it per table beat counting it by a separate summary read and reading the
few non-message rows again (45k against 40k rows/s with logs and bad payloads mixed in, 110k
against 92k without). Why one pass rather than one per table:
the message contract parses every JSON payload, and a per-table pass would parse them again
for ``quarantine``.

The wire: ``user_properties`` (a list of structs) crosses from Python to the JVM as JSON text
(:data:`WIRE_COLUMN`; :func:`from_wire` on the JVM side when a table's share is selected), an
empty list as ``""``, so the JVM parses JSON only for the records that have properties. Spark's
Arrow conversion of a list of structs costs about 100 µs a row (measured: 10 s for 100,000
rows, nearly all of them null) against well under 1 µs for a string.
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, SparkSession
from pyspark.sql.datasource import InputPartition
from pyspark.sql.types import ArrayType, StructType

from ingest.source import EdgebusDataSource, EdgebusStreamReader, SourceOptions
from schemas.contracts import RECORD_RULES, first_broken, rows_where
from schemas.journal import JOURNAL_SCHEMA
from schemas.tables import LOGS_SCHEMA, MESSAGES_SCHEMA, QUARANTINE_SCHEMA
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
    """Make ``spark.readStream.format(ROUTED_SOURCE)`` available in this session."""
    spark.dataSource.register(RoutedJournal)


class RoutedJournal(EdgebusDataSource):
    """The ``edgebus`` journal source (same options, offsets and partitions) whose rows are
    the routed rows (:data:`ROUTED_WIRE_SCHEMA`) instead of the raw records."""

    @classmethod
    def name(cls) -> str:
        return ROUTED_SOURCE

    def schema(self) -> StructType:
        super().schema()  # the options are checked at load(), not at the first batch
        return spark_schema(ROUTED_WIRE_SCHEMA)

    def streamReader(self, schema: StructType) -> RoutedJournalReader:  # noqa: N802 (Spark API)
        return RoutedJournalReader(SourceOptions.parse(self.options))


class RoutedJournalReader(EdgebusStreamReader):
    """Plans like the journal reader; each read task routes its journal range in one go."""

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # A range is at most ingest.source.PARTITION_RECORDS records, routed as one table:
        # the route's cost per call dwarfs its cost per row for the small frames of an edge's
        # group commits.
        batches = list(super().read(partition))  # the journal's records
        if batches:
            yield from route_wire(_table(batches)).to_batches()


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


def from_wire(text: Column, data_type: ArrayType) -> Column:
    """The JVM side of :func:`_to_json`: the wire's text back to ``user_properties``."""
    from pyspark.sql import functions as F  # noqa: N812 (pyspark's own convention)

    return F.when(text == "", F.array().cast(data_type)).otherwise(F.from_json(text, data_type))


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
