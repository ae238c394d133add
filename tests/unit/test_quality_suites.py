"""The great-expectations suites of ``schemas.expectations`` fit the tables they check."""

from __future__ import annotations

import pytest

from edgebus import quality_cli
from schemas import quality
from schemas.expectations import NOT_VALIDATED, ROW_KEYS, SUITES, build_suite, suite_columns
from schemas.tables import TABLES


def test_every_table_has_a_suite_or_a_reason_not_to() -> None:
    # A new table in TABLES fails here until schemas.expectations gives it a suite.
    assert set(TABLES) <= set(SUITES) | set(NOT_VALIDATED)
    assert not set(SUITES) & set(NOT_VALIDATED)


@pytest.mark.parametrize("table", sorted(SUITES))
def test_a_suite_reads_only_columns_its_table_has(table: str) -> None:
    if table not in TABLES:
        pytest.skip(f"{table} is not a table of the lake (yet)")
    suite = build_suite(table)

    columns = suite_columns(suite)

    assert suite.name == table
    assert 3 <= len(suite.expectations) <= 10  # a sensible handful
    assert columns
    assert set(columns) <= set(TABLES[table].schema.names)
    # Never a payload: a run reads only narrow columns.
    assert "payload" not in columns


def test_row_conditions_count_as_columns_read() -> None:
    assert "payload_valid" in suite_columns(build_suite("logs"))


def test_record_tables_are_unique_on_their_identity() -> None:
    for table in ("messages", "logs"):
        kinds = {
            (e.expectation_type, tuple(e.configuration.kwargs.get("column_list", ())))
            for e in build_suite(table).expectations
        }
        assert ("expect_compound_columns_to_be_unique", ("node", "seq")) in kinds


def test_the_command_names_the_results_table_and_app_like_the_schema() -> None:
    assert quality_cli.TABLE == quality.QUALITY_RESULTS_TABLE
    assert quality_cli.APP_ID == quality.QUALITY_APP_ID
    assert set(quality_cli.COLUMNS) | {"date"} == set(quality.QUALITY_RESULTS_SCHEMA.names)


@pytest.mark.parametrize("table", sorted(SUITES))
def test_breaking_rows_are_named_by_columns_the_table_has(table: str) -> None:
    # A run names the rows that broke an expectation by ROW_KEYS: (node, seq) for records.
    key = ROW_KEYS[table]
    assert set(key) <= set(TABLES[table].schema.names)
    if {"node", "seq"} <= set(TABLES[table].schema.names):
        assert key[:2] == ("node", "seq")
