"""great-expectations suites of the lake's tables, one per table, built from code.

No GX project on disk: :func:`build_suite` gives a fresh ``ExpectationSuite`` that any context
(``streaming.quality`` uses an ephemeral one) can validate a batch with. Each suite is a short
list of what matters about its table beyond its Arrow schema (which already makes the writers
reject nulls in non-nullable columns and wrong types): identities unique, values in their known
sets and ranges, and the relations between columns that the jobs promise. The non-null checks on
key columns hold by construction today; they are kept because a suite is the contract a table is
held to whoever writes it.

Importing this module imports great-expectations (seconds): only the quality run does, in its
own thread. Readers of the results use ``schemas.quality``.

A table added to :data:`schemas.tables.TABLES` gets its suite here, in :data:`SUITES` (a unit
test fails until it does), or is named in :data:`NOT_VALIDATED` with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import great_expectations as gx
import great_expectations.expectations as gxe
from great_expectations.expectations.row_conditions import Column

from schemas.payloads import LOG_EVENTS
from schemas.quality import QUALITY_RESULTS_TABLE
from schemas.usage import COUNTER_KINDS, COUNTER_METRICS, QUOTA_EVENT_STATES, USAGE_KEY

# A publish's payload can be no larger than the largest remaining length, 268,435,455 bytes
# [MQTT-2.2.3] (fixed header's Remaining Length, four bytes of seven bits).
MAX_PAYLOAD_SIZE = 268_435_455
QOS_LEVELS = (0, 1, 2)  # [MQTT-3.3.1.2]

# The tables whose rows the pipeline writes from journal records (and may quarantine).
RECORD_TABLES = ("messages", "logs", "usage", "quota_events")


def _not_null(*columns: str) -> list[gxe.Expectation]:
    return [gxe.ExpectColumnValuesToNotBeNull(column=name) for name in columns]


def _record_identity() -> list[gxe.Expectation]:
    """A journal record's identity ``(node, seq)``: present, seq from 1, each once."""
    return [
        *_not_null("node", "seq", "tenant"),
        gxe.ExpectColumnValuesToBeBetween(column="seq", min_value=1),
        gxe.ExpectCompoundColumnsToBeUnique(column_list=["node", "seq"]),
    ]


def messages_suite() -> gx.ExpectationSuite:
    return gx.ExpectationSuite(
        name="messages",
        expectations=[
            *_record_identity(),
            gxe.ExpectColumnValuesToBeInSet(column="qos", value_set=list(QOS_LEVELS)),
            gxe.ExpectColumnValuesToBeBetween(
                column="size", min_value=0, max_value=MAX_PAYLOAD_SIZE
            ),
            # Log and counter traffic ($log/..., $counters/...) goes to its own tables.
            gxe.ExpectColumnValuesToNotMatchRegex(column="topic", regex=r"^\$"),
        ],
    )


def logs_suite() -> gx.ExpectationSuite:
    valid = Column("payload_valid") == True  # noqa: E712 (a GX row condition, not a comparison)
    invalid = Column("payload_valid") == False  # noqa: E712
    return gx.ExpectationSuite(
        name="logs",
        expectations=[
            *_record_identity(),
            # A valid event is one the edges log; an invalid one's type comes from its topic.
            gxe.ExpectColumnValuesToBeInSet(
                column="event_type", value_set=sorted(LOG_EVENTS), row_condition=valid
            ),
            # A row that broke the payload contract says which rule and keeps the payload.
            gxe.ExpectColumnValuesToNotBeNull(column="invalid_reason", row_condition=invalid),
            gxe.ExpectColumnValuesToNotBeNull(column="raw", row_condition=invalid),
        ],
    )


def usage_suite() -> gx.ExpectationSuite:
    return gx.ExpectationSuite(
        name="usage",
        expectations=[
            *_not_null("tenant", "metric", "window_start"),
            gxe.ExpectCompoundColumnsToBeUnique(column_list=list(USAGE_KEY)),
            gxe.ExpectColumnValuesToBeInSet(column="metric", value_set=list(COUNTER_METRICS)),
            gxe.ExpectColumnValuesToBeInSet(column="kind", value_set=list(COUNTER_KINDS)),
            gxe.ExpectColumnValuesToBeBetween(column="value", min_value=0),
            # The day so far includes this window: a running total (counters) or a running
            # maximum (gauges) is never below the window's own value.
            gxe.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="day_value", column_B="value", or_equal=True
            ),
            gxe.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="window_end", column_B="window_start"
            ),
        ],
    )


def quota_events_suite() -> gx.ExpectationSuite:
    return gx.ExpectationSuite(
        name="quota_events",
        expectations=[
            *_not_null("tenant", "metric", "decided_at"),
            gxe.ExpectColumnValuesToBeInSet(column="state", value_set=list(QUOTA_EVENT_STATES)),
            gxe.ExpectColumnValuesToBeBetween(column="value", min_value=0),
            gxe.ExpectColumnValuesToBeBetween(column="limit", min_value=0),  # null: no limit
            # A batch decides each tenant's metric once: a second row would be a replay.
            gxe.ExpectCompoundColumnsToBeUnique(column_list=["tenant", "metric", "batch_id"]),
        ],
    )


def quarantine_suite() -> gx.ExpectationSuite:
    return gx.ExpectationSuite(
        name="quarantine",
        expectations=[
            *_not_null("node", "seq", "tenant"),
            # A record is quarantined at most once for each table it was meant for.
            gxe.ExpectCompoundColumnsToBeUnique(column_list=["node", "seq", "table"]),
            gxe.ExpectColumnValuesToBeInSet(column="table", value_set=list(RECORD_TABLES)),
            # Kept so a person can act on it: which rule, and why.
            gxe.ExpectColumnValueLengthsToBeBetween(column="rule", min_value=1),
            gxe.ExpectColumnValueLengthsToBeBetween(column="reason", min_value=1),
        ],
    )


SUITES: Mapping[str, Callable[[], gx.ExpectationSuite]] = MappingProxyType(
    {
        "messages": messages_suite,
        "logs": logs_suite,
        "usage": usage_suite,
        "quota_events": quota_events_suite,
        "quarantine": quarantine_suite,
    }
)

# How a run names the rows that broke an expectation: by the table's row identity, a journal
# record's ``(node, seq)`` where the table has one. Every suite reads these columns.
ROW_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "messages": ("node", "seq"),
        "logs": ("node", "seq"),
        "usage": tuple(USAGE_KEY),
        "quota_events": ("tenant", "metric", "batch_id"),
        "quarantine": ("node", "seq", "table"),
    }
)

# Tables of the lake that have no suite, and why.
NOT_VALIDATED: Mapping[str, str] = MappingProxyType(
    {QUALITY_RESULTS_TABLE: "the quality runs' own results"}
)


def build_suite(table: str) -> gx.ExpectationSuite:
    """A fresh suite for ``table`` (KeyError for a table without one)."""
    return SUITES[table]()


def suite_columns(suite: gx.ExpectationSuite) -> list[str]:
    """Every column ``suite``'s expectations read, in first-use order: what a run must load."""
    seen: dict[str, None] = {}
    for expectation in suite.expectations:
        for name in expectation_columns(expectation.configuration.kwargs):
            seen.setdefault(name, None)
        # The condition object (the configuration holds it as a plain dict); only the
        # expectation types that take one have the attribute.
        for name in _condition_columns(getattr(expectation, "row_condition", None)):
            seen.setdefault(name, None)
    return list(seen)


def expectation_columns(kwargs: Mapping[str, Any]) -> list[str]:
    """The column(s) an expectation is about, from its kwargs (not its row condition's)."""
    if "column" in kwargs:
        return [kwargs["column"]]
    if "column_list" in kwargs:
        return list(kwargs["column_list"])
    return [kwargs[key] for key in ("column_A", "column_B") if key in kwargs]


def _condition_columns(condition: Any) -> Iterator[str]:
    if condition is None:
        return
    column = getattr(condition, "column", None)
    if column is not None:
        yield column.name
    for part in getattr(condition, "conditions", ()):
        yield from _condition_columns(part)
