"""streaming.job.start_query: a query whose source's Python worker missed Spark's 10 s to connect
back while it initialized is started again; any other failure is the caller's to see."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streaming import job
from streaming.settings import PipelineSettings


class FakeQuery:
    def __init__(self, statuses: list[str], failure: str | None) -> None:
        self._statuses = statuses  # what status["message"] says, one poll each, then the last
        self._failure = failure

    @property
    def isActive(self) -> bool:
        return self._failure is None or len(self._statuses) > 1

    @property
    def status(self) -> dict[str, Any]:
        message = self._statuses.pop(0) if len(self._statuses) > 1 else self._statuses[0]
        return {"message": message}

    def exception(self) -> Exception | None:
        return None if self._failure is None else RuntimeError(self._failure)


class FakeRows:
    """``rows.writeStream....start()`` hands out the given queries in turn."""

    def __init__(self, queries: list[FakeQuery]) -> None:
        self.queries = queries
        self.started = 0

    @property
    def writeStream(self) -> FakeRows:
        return self

    def queryName(self, name: str) -> FakeRows:
        return self

    def foreachBatch(self, sink: Any) -> FakeRows:
        return self

    def option(self, key: str, value: str) -> FakeRows:
        return self

    def trigger(self, **kwargs: Any) -> FakeRows:
        return self

    def start(self) -> FakeQuery:
        self.started += 1
        return self.queries.pop(0)


def start(rows: FakeRows, tmp_path: Path) -> Any:
    settings = PipelineSettings(data_dir=tmp_path, lake=tmp_path / "lake")
    return job.start_query(
        rows,  # type: ignore[arg-type]
        job="journal",
        sink=lambda df, batch: None,
        checkpoint=tmp_path / "cp",
        settings=settings,
    )


TIMED_OUT = f"[STREAM_FAILED] terminated with exception: {job.WORKER_TIMEOUT}. SQLSTATE: XXKST"


def test_a_worker_that_missed_its_start_is_started_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = FakeQuery(["Initializing sources", "Waiting for data to arrive"], None)
    rows = FakeRows([FakeQuery(["Initializing sources", "Stopped"], TIMED_OUT), good])
    assert start(rows, tmp_path) is good
    assert rows.started == 2
    assert "did not connect back" in caplog.text


def test_other_failures_are_not_retried_and_the_attempts_are_bounded(tmp_path: Path) -> None:
    other = FakeQuery(["Initializing sources", "Stopped"], "the usage step broke")
    rows = FakeRows([other])
    assert start(rows, tmp_path) is other
    assert rows.started == 1
    failing = [FakeQuery(["Stopped"], TIMED_OUT) for _ in range(job.START_ATTEMPTS + 1)]
    rows = FakeRows(failing)
    assert start(rows, tmp_path).exception() is not None
    assert rows.started == job.START_ATTEMPTS
