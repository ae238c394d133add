"""Data quality on a schedule: every table's great-expectations suite over its recent rows.

Theory of operation
-------------------
:func:`run_quality` is one run. For each table with a suite (``schemas.expectations``) that the
lake has, it reads the rows of the last ``days`` UTC dates (today and yesterday by default)
with Spark's Delta reader and a condition on the ``date`` partition column, so only those
partitions' files are opened, and only the columns the suite looks at (never a payload), at
most ``max_rows`` of them. The Spark DataFrame is validated where it lives, through a GX Spark
datasource of an ephemeral context (nothing on disk, nothing collected to the driver but the
expectations' metrics). Every expectation result becomes one row of ``quality_results``
(``schemas.quality``); a table that cannot be read or validated becomes one failed row saying
why, so a broken table is visible, not silent.

A per-row expectation that failed also names the rows that broke it by the table's row key
(``schemas.expectations.ROW_KEYS``: ``(node, seq)`` for the record tables), at most
``UNEXPECTED_ROWS_KEPT`` of them. GX finds them (``unexpected_index_column_names``), in a
second validation of only the failed expectations: asked of every expectation, it would cost a
filtered Spark job each (measured here: a table's validation took 1.4 to 2 times as long), and a
run that finds nothing wrong, the usual one, costs what it did. A run that finds broken rows
pays for the second validation (tests/helpers/quality_lake.py's broken lake, 6 failed
expectations in 4 tables, on a loaded 2-core machine: 18 s without naming the rows, 34 s with).

All rows of a run are appended in one Delta commit by :class:`~sinks.delta.DeltaTableWriter`,
with the run's number as the batch id of app ``edgebus.quality``: the number comes from the
table's own log (the last committed run plus one), readers never see half a run, and runs are
numbered without any state outside the lake. Runs do not overlap (one schedule, one thread), so
two runs never take the same number; a second pipeline on the same lake would see its
colliding commit skipped as a replay, not duplicated.

:class:`QualitySchedule` runs it from the pipeline's loop (:mod:`streaming.schedule`):
``maybe_run`` is cheap, starts a run in a background thread when one is due, and never raises
into the stream; a failed run is logged and the schedule carries on. great-expectations is
imported by the first run, in that thread (it takes seconds), so the pipeline starts as fast as
before.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

from schemas.quality import (
    QUALITY_APP_ID,
    QUALITY_RESULTS_PARTITION_BY,
    QUALITY_RESULTS_SCHEMA,
    QUALITY_RESULTS_TABLE,
    UNEXPECTED_ROWS_KEPT,
    VALIDATION_ERROR,
)
from sinks.delta import DeltaTableWriter, spark_schema
from sinks.storage import LakePath, is_delta_table, spark_uri
from streaming.schedule import IntervalSchedule
from streaming.settings import PipelineSettings

if TYPE_CHECKING:
    from great_expectations.datasource.fluent import SparkDatasource
    from pyspark.sql import DataFrame, SparkSession

logger = logging.getLogger(__name__)

DEFAULT_DAYS = 2
# Enough to catch what a day's batches get wrong and bound a run's cost: the suites read a
# handful of narrow columns.
DEFAULT_MAX_ROWS = 1_000_000
# How much of an exception a result row keeps.
_ERROR_CHARS = 2_000


@dataclass(frozen=True, slots=True)
class QualityResult:
    """One expectation's outcome on one table in one run: a ``quality_results`` row."""

    run: int
    run_at: datetime
    table: str
    suite: str
    expectation: str
    columns: str | None
    kwargs: str | None
    success: bool
    observed: str | None
    unexpected_count: int | None
    element_count: int | None
    error: str | None
    unexpected_rows: str | None  # JSON: the rows that broke it, by the table's row key

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "date": self.run_at.astimezone(UTC).date()}


def run_quality(
    spark: SparkSession,
    lake: LakePath,
    *,
    now: datetime,
    tables: Sequence[str] | None = None,
    days: int = DEFAULT_DAYS,
    max_rows: int = DEFAULT_MAX_ROWS,
) -> list[QualityResult]:
    """Validate ``tables`` (default: every table with a suite) and record the results.

    Tables the lake does not have yet are skipped. Returns the results written (nothing is
    committed when no table was there). ``now`` (time-zone aware) is the run's time and decides
    the dates read: ``now``'s UTC date and the ``days - 1`` before it.
    """
    from schemas.expectations import SUITES

    if now.utcoffset() is None:
        raise ValueError(f"now must be time-zone aware, got {now.isoformat()}")
    if days < 1 or max_rows < 1:
        raise ValueError(f"days and max_rows must be >= 1, got {days} and {max_rows}")
    names = list(SUITES) if tables is None else list(tables)
    unknown = [name for name in names if name not in SUITES]
    if unknown:
        raise ValueError(f"no suite for {unknown}; suites: {', '.join(SUITES)}")
    writer = DeltaTableWriter(
        lake / QUALITY_RESULTS_TABLE,
        QUALITY_APP_ID,
        QUALITY_RESULTS_SCHEMA,
        QUALITY_RESULTS_PARTITION_BY,
    )
    last = writer.last_batch_id()
    run = Run(0 if last is None else last + 1, now, days, max_rows)
    datasource = _datasource()
    results: list[QualityResult] = []
    for table in names:
        path = lake / table
        if not _is_table(path):
            logger.debug("quality run %d: no %s table yet, skipped", run.number, table)
            continue
        results += run.validate(spark, datasource, table, path)
    if results:
        writer.upgrade(spark)  # a table made before a column (unexpected_rows) gets it
        rows = spark.createDataFrame(
            [r.row() for r in results], schema=spark_schema(QUALITY_RESULTS_SCHEMA)
        )
        writer.append(run.number, rows)
    return results


@dataclass(frozen=True, slots=True)
class Run:
    """One quality run: its number, time and what it reads of each table."""

    number: int
    at: datetime
    days: int
    max_rows: int

    @property
    def dates(self) -> tuple[date, date]:
        last = self.at.astimezone(UTC).date()
        return last - timedelta(days=self.days - 1), last

    def validate(
        self, spark: SparkSession, datasource: SparkDatasource, table: str, path: LakePath
    ) -> list[QualityResult]:
        """The results of ``table``'s suite over its recent rows; one failed row if it breaks."""
        from schemas.expectations import ROW_KEYS, build_suite, suite_columns

        suite = build_suite(table)
        key = ROW_KEYS[table]
        try:
            first, last = self.dates
            columns = list(dict.fromkeys([*suite_columns(suite), *key]))
            frame = _recent_rows(spark, path, columns, first, last).limit(self.max_rows)
            batch = (
                datasource.add_dataframe_asset(table)
                .add_batch_definition_whole_dataframe("recent")
                .get_batch(batch_parameters={"dataframe": frame})
            )
            validation = batch.validate(suite, result_format="SUMMARY")
        except Exception as exc:  # GX and Spark raise many types; any of them fails the table
            logger.warning("quality run %d: %s not validated: %s", self.number, table, exc)
            return [self._failed(table, suite.name, exc)]
        rows = self._breaking_rows(batch, table, key, validation.results)
        return [
            self._result(table, suite.name, item, rows.get(_identity(item.expectation_config)))
            for item in validation.results
        ]

    def _breaking_rows(
        self, batch: Any, table: str, key: tuple[str, ...], results: Sequence[Any]
    ) -> dict[str, str]:
        """The rows (by ``key``) that broke each failed per-row expectation, as JSON text by
        :func:`_identity`: the failed ones validated again, asking GX for the rows' keys."""
        import great_expectations as gx

        from schemas.expectations import build_suite

        failed = {
            _identity(item.expectation_config)
            for item in results
            if not item.success and (item.result or {}).get("unexpected_count")
        }
        if not failed:
            return {}
        again = [e for e in build_suite(table).expectations if _identity(e.configuration) in failed]
        result_format = {
            "result_format": "SUMMARY",
            "partial_unexpected_count": UNEXPECTED_ROWS_KEPT,
            "unexpected_index_column_names": list(key),
        }
        try:
            validation = batch.validate(
                gx.ExpectationSuite(name=f"{table}.rows", expectations=again),
                result_format=result_format,
            )
        except Exception as exc:  # the results stand without the rows' names
            logger.warning("quality run %d: %s rows not named: %s", self.number, table, exc)
            return {}
        named = {}
        for item in validation.results:
            found = (item.result or {}).get("partial_unexpected_index_list")
            if found:
                named[_identity(item.expectation_config)] = _row_keys(found, key)
        return named

    def _result(
        self, table: str, suite: str, item: Any, unexpected_rows: str | None
    ) -> QualityResult:
        from schemas.expectations import expectation_columns

        config = item.expectation_config
        kwargs = {k: v for k, v in config.kwargs.items() if k != "batch_id"}
        columns = expectation_columns(kwargs)
        for key in ("column", "column_list", "column_A", "column_B"):
            kwargs.pop(key, None)
        if isinstance(kwargs.get("row_condition"), dict):
            kwargs["row_condition"] = _condition_text(kwargs["row_condition"])
        result: Mapping[str, Any] = item.result or {}
        info: Mapping[str, Any] = item.exception_info or {}
        error = info.get("exception_message") if info.get("raised_exception") else None
        return QualityResult(
            run=self.number,
            run_at=self.at,
            table=table,
            suite=suite,
            expectation=config.type,
            columns=", ".join(columns) or None,
            kwargs=_json(kwargs) if kwargs else None,
            success=bool(item.success) and error is None,
            observed=_observed(result),
            unexpected_count=_int(result.get("unexpected_count")),
            element_count=_int(result.get("element_count")),
            error=error[:_ERROR_CHARS] if error else None,
            unexpected_rows=unexpected_rows,
        )

    def _failed(self, table: str, suite: str, exc: Exception) -> QualityResult:
        return QualityResult(
            run=self.number,
            run_at=self.at,
            table=table,
            suite=suite,
            expectation=VALIDATION_ERROR,
            columns=None,
            kwargs=None,
            success=False,
            observed=None,
            unexpected_count=None,
            element_count=None,
            error=f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS],
            unexpected_rows=None,
        )


def _recent_rows(
    spark: SparkSession, path: LakePath, columns: list[str], first: date, last: date
) -> DataFrame:
    """The ``columns`` of the table at ``path`` on the dates from ``first`` to ``last``,
    partition-pruned; :class:`LookupError` naming the columns the table lacks."""
    rows = spark.read.format("delta").load(spark_uri(path))
    missing = [name for name in columns if name not in rows.columns]
    if missing:
        raise LookupError(f"{path}: no such columns {missing}")
    return rows.where(
        f"date BETWEEN DATE '{first.isoformat()}' AND DATE '{last.isoformat()}'"
    ).select(*[f"`{name}`" for name in columns])


def _identity(config: Any) -> str:
    """An expectation's type and arguments (not the batch's id): the same for the suite's
    expectation and its result in any validation."""
    kwargs = {k: v for k, v in config.kwargs.items() if k != "batch_id"}
    return f"{config.type} {_json(kwargs)}"


def _row_keys(found: Sequence[Mapping[str, Any]], key: tuple[str, ...]) -> str:
    """GX's unexpected index list (the key columns and the values checked) as JSON text: the
    rows' keys, each once, in GX's order."""
    keys = list(dict.fromkeys(_json({name: row[name] for name in key}) for row in found))
    return "[" + ",".join(keys[:UNEXPECTED_ROWS_KEPT]) + "]"


def _datasource() -> SparkDatasource:
    """A Spark datasource of a new ephemeral GX context (in memory), no progress bars."""
    # GX logs its own housekeeping at INFO on every import and context; only its warnings
    # are ours to see.
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    import great_expectations as gx
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(),
        progress_bars=ProgressBarsConfig(globally=False),
        analytics_enabled=False,
    )
    context = gx.get_context(mode="ephemeral", project_config=config)
    datasource: SparkDatasource = context.data_sources.add_spark("edgebus")
    return datasource


def _is_table(path: LakePath) -> bool:
    return is_delta_table(path)


def _condition_text(condition: Mapping[str, Any]) -> str:
    """A GX row condition (as its configuration dict) as text: ``payload_valid == true``."""
    kind = condition.get("type")
    if kind == "comparison":
        value = json.dumps(_plain(condition["parameter"]))
        return f"{condition['column']['name']} {condition['operator']} {value}"
    if kind == "nullity":
        return f"{condition['column']['name']} IS {'' if condition['is_null'] else 'NOT '}NULL"
    if kind in ("and", "or"):
        parts = [_condition_text(part) for part in condition["conditions"]]
        return "(" + f" {kind.upper()} ".join(parts) + ")"
    return _json(condition)


def _observed(result: Mapping[str, Any]) -> str | None:
    """What was seen: an aggregate's value, or the unexpected values (of the first 20) counted."""
    if "observed_value" in result:
        return _json(result["observed_value"])
    counts = result.get("partial_unexpected_counts")
    if counts:
        return _json([{"value": c["value"], "count": c["count"]} for c in counts])
    return None


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _json(value: Any) -> str:
    return json.dumps(_plain(value), separators=(",", ":"), sort_keys=True)


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars, tuples, times and bytes made JSON-friendly."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, datetime | date):
        return value.isoformat()
    if hasattr(value, "item") and callable(value.item):  # a numpy scalar
        return _plain(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


RunQuality = Callable[..., Sequence[QualityResult]]


def _utc_now() -> datetime:
    return datetime.now(UTC)


class QualitySchedule(IntervalSchedule):
    """Runs :func:`run_quality` over ``lake`` every ``interval_seconds`` (0: never), off-thread.

    See :class:`~streaming.schedule.IntervalSchedule` for when; ``run`` is one run over the
    lake (:func:`run_quality` on a session, :meth:`from_settings`; tests inject their own) and
    ``clock`` is injectable. :meth:`close` waits for a run in flight, so the process does not
    exit in the middle of a Delta commit.
    """

    def __init__(
        self,
        lake: LakePath,
        interval_seconds: float,
        *,
        run: RunQuality,
        clock: Callable[[], datetime] = _utc_now,
        on_results: Callable[[Sequence[QualityResult]], None] | None = None,
    ) -> None:
        super().__init__("quality", interval_seconds)
        self._lake = lake
        self._run = run
        self._clock = clock
        self._on_results = on_results

    @classmethod
    def from_settings(
        cls,
        spark: SparkSession,
        settings: PipelineSettings,
        on_results: Callable[[Sequence[QualityResult]], None] | None = None,
    ) -> QualitySchedule:
        """The pipeline's schedule. Runs use a session of their own (same SparkContext), so
        their SQL settings never mix with the stream's. ``on_results`` gets each run's results
        (the metrics count them)."""
        run = functools.partial(run_quality, spark.newSession())
        return cls(settings.lake, settings.quality_interval_seconds, run=run, on_results=on_results)

    def run_once(self) -> Sequence[QualityResult]:
        """One run now, in this thread; its results (logged, and in ``quality_results``)."""
        results = self._run(self._lake, now=self._clock())
        _log_summary(results)
        if self._on_results is not None:
            self._on_results(results)
        return results


def _log_summary(results: Sequence[QualityResult]) -> None:
    if not results:
        logger.info("quality run: no table to validate yet")
        return
    failed = [r for r in results if not r.success]
    tables = sorted({r.table for r in results})
    if not failed:
        logger.info(
            "quality run %d: %d expectations on %s, all met",
            results[0].run,
            len(results),
            ", ".join(tables),
        )
        return
    logger.warning(
        "quality run %d: %d of %d expectations failed: %s (edgebus quality --failed)",
        results[0].run,
        len(failed),
        len(results),
        "; ".join(
            f"{r.table} {r.expectation}({r.columns or ''})"
            + (f" {r.unexpected_count} rows" if r.unexpected_count else "")
            for r in failed
        ),
    )
