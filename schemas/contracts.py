"""Data contracts: the rules a journal record must keep to land in its table.

The pipeline applies them in the stream, on every micro-batch (``streaming.router``). A record
that breaks one is never dropped: it goes to the ``quarantine`` table, raw, with the table it was
meant for, the rule's name and a reason a person can act on (ARCHITECTURE rule 5).

Rules are vectorised (pyarrow compute) where they can be, so they cost little on the hot path;
the JSON rule parses each JSON-typed payload once with orjson (about 1.5 µs for 200 bytes).

Every rule is a function of the record alone, never of the clock or of other records: a
replayed micro-batch must quarantine exactly the same records, or a replay could put a record
in two tables. That is why "timestamp sane" is a fixed window, not "not in the future".

The payload contracts of reserved topics (log events, counters) live with their parsers in
``streaming.logs`` and ``streaming.usage``: their reasons come out of parsing the payload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import orjson
import pyarrow as pa
import pyarrow.compute as pc

# The sane window for a record's ``ts`` (the edge's clock when it accepted the publish): an
# edge whose clock fell back to 1970 or jumped ahead by decades must not create partitions there.
TS_MIN = datetime(2000, 1, 1, tzinfo=UTC)
TS_MAX = datetime(2100, 1, 1, tzinfo=UTC)

# Content types that promise a JSON payload: application/json and any "+json" suffix type
# (RFC 6839), case-insensitive, parameters (";charset=utf-8") ignored.
_JSON_CONTENT_TYPE = r"(?i)^\s*[a-z0-9!#$&^_.+-]+/([a-z0-9!#$&^_.+-]+\+)?json\s*(;.*)?$"


@dataclass(frozen=True, slots=True)
class Rule:
    """One contract rule: ``broken(records)`` is True where a record breaks it."""

    name: str
    reason: str
    broken: Callable[[pa.Table], pa.Array | pa.ChunkedArray]


def _empty(column: str) -> Callable[[pa.Table], pa.Array | pa.ChunkedArray]:
    def broken(records: pa.Table) -> pa.Array | pa.ChunkedArray:
        values = records.column(column)
        return pc.or_kleene(pc.is_null(values), pc.equal(pc.utf8_length(values), 0))

    return broken


def _ts_insane(records: pa.Table) -> pa.Array | pa.ChunkedArray:
    ts = records.column("ts")
    return pc.or_kleene(
        pc.is_null(ts),
        pc.or_(pc.less(ts, pa.scalar(TS_MIN, ts.type)), pc.greater_equal(ts, TS_MAX)),
    )


def is_json_content_type(content_type: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """True where ``content_type`` says the payload is JSON (null: no content type)."""
    return pc.fill_null(pc.match_substring_regex(content_type, _JSON_CONTENT_TYPE), False)


def _json_invalid(records: pa.Table) -> pa.Array | pa.ChunkedArray:
    typed = is_json_content_type(records.column("content_type"))
    if not pc.any(typed).as_py():
        return typed  # all False
    flags = [False] * records.num_rows
    indices = pc.indices_nonzero(typed).to_pylist()
    payloads = records.column("payload").filter(typed).to_pylist()
    loads, invalid = orjson.loads, orjson.JSONDecodeError  # the hot loop: no lookups, no calls
    for index, payload in zip(indices, payloads, strict=True):
        try:
            loads(payload)
        except invalid:
            flags[index] = True
    return pa.array(flags, pa.bool_())


# Every journal record, whatever table it is meant for.
RECORD_RULES: tuple[Rule, ...] = (
    Rule("tenant_present", "the record has no tenant", _empty("tenant")),
    Rule("topic_present", "the record has no topic", _empty("topic")),
    Rule(
        "ts_sane",
        f"the record's ts is outside [{TS_MIN:%Y-%m-%d}, {TS_MAX:%Y-%m-%d}) (edge clock?)",
        _ts_insane,
    ),
)

# Device publishes, for ``messages``.
MESSAGE_RULES: tuple[Rule, ...] = (
    Rule(
        "json_payload",
        "the content type says JSON but the payload is not valid JSON",
        _json_invalid,
    ),
)


def first_broken(records: pa.Table, rules: tuple[Rule, ...]) -> tuple[pa.Array, pa.Array]:
    """Per record, the name and reason of the first rule it breaks (both null: none)."""
    names: pa.Array = pa.nulls(records.num_rows, pa.string())
    reasons: pa.Array = pa.nulls(records.num_rows, pa.string())
    if records.num_rows == 0:
        return names, reasons
    # Last rule first, so an earlier rule overwrites: the first broken rule wins.
    for rule in reversed(rules):
        broken = rule.broken(records)
        if not pc.any(broken).as_py():
            continue
        names = pc.if_else(broken, pa.scalar(rule.name), names)
        reasons = pc.if_else(broken, pa.scalar(rule.reason), reasons)
    return _one_chunk(names), _one_chunk(reasons)


def rows_where(records: pa.Table, mask: pa.Array | pa.ChunkedArray) -> pa.Table:
    """The rows of ``records`` where ``mask`` is true, without a copy when that is all of them
    (the common case on the hot path: most batches break no rule)."""
    if records.num_rows == 0 or pc.all(mask).as_py():
        return records
    if not pc.any(mask).as_py():
        return records.schema.empty_table()
    return records.filter(mask)


def _one_chunk(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks()
    return values
