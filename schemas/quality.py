"""The ``quality_results`` table: what each scheduled great-expectations run found.

``streaming.quality`` validates the recent rows of every table against its suite
(``schemas.expectations``) and appends one row per expectation result here, all rows of one run
in one commit; ``edgebus quality`` shows them. Kept apart from ``schemas.expectations`` so that
readers of this table never import great-expectations.
"""

from __future__ import annotations

import pyarrow as pa

QUALITY_RESULTS_TABLE = "quality_results"
# The Delta app id of the runs' commits; its transaction version is the latest run's number.
QUALITY_APP_ID = "edgebus.quality"

# What a run records for a table it could not validate at all (reading it failed, or the suite
# raised): one row with ``success`` false and the reason in ``error``.
VALIDATION_ERROR = "validation_error"

# One row per expectation of one table's suite in one run.
#   run               the run's number: 0, 1, 2 ... (the Delta app transaction of its commit)
#   run_at            when the run started; ``date`` is its UTC date
#   table, suite      the table validated and the suite's name
#   expectation       the GX expectation type, e.g. "expect_column_values_to_be_in_set"
#   columns           the column(s) it is about, comma-separated ("node, seq")
#   kwargs            its other arguments as JSON text (value_set, min_value, row_condition ...)
#   observed          what was seen, as JSON text: the most frequent unexpected values with their
#                     counts, or an aggregate's observed value
#   unexpected_count  rows that broke it (null for aggregate expectations)
#   element_count     rows it looked at (the table's rows in the run's window)
#   error             why the expectation (or the whole table, VALIDATION_ERROR) could not run
#   unexpected_rows   the rows that broke it, named by the table's row key
#                     (``schemas.expectations.ROW_KEYS``: ``(node, seq)`` for messages and logs),
#                     as JSON text: a list of objects, at most UNEXPECTED_ROWS_KEPT of them, each
#                     key once; null when it passed or is no per-row expectation. Added after
#                     the first runs: a run adds the column to a table made without it.
QUALITY_RESULTS_SCHEMA = pa.schema(
    [
        pa.field("run", pa.int64(), nullable=False),
        pa.field("run_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("table", pa.string(), nullable=False),
        pa.field("suite", pa.string(), nullable=False),
        pa.field("expectation", pa.string(), nullable=False),
        pa.field("columns", pa.string(), nullable=True),
        pa.field("kwargs", pa.string(), nullable=True),
        pa.field("success", pa.bool_(), nullable=False),
        pa.field("observed", pa.string(), nullable=True),
        pa.field("unexpected_count", pa.int64(), nullable=True),
        pa.field("element_count", pa.int64(), nullable=True),
        pa.field("error", pa.string(), nullable=True),
        pa.field("unexpected_rows", pa.string(), nullable=True),
        pa.field("date", pa.date32(), nullable=False),
    ]
)

# How many breaking rows a result names (GX's partial_unexpected_count: the same cap as the
# unexpected values it counts in ``observed``).
UNEXPECTED_ROWS_KEPT = 20

QUALITY_RESULTS_PARTITION_BY: tuple[str, ...] = ("date",)
