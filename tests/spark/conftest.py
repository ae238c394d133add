"""One local Delta-enabled SparkSession for every Spark test: starting Spark takes seconds, a
batch does not."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from ingest import source
from streaming.session import delta_config
from streaming.settings import PipelineSettings

# Python workers must run this interpreter (the venv), whatever the environment says.
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    builder = (
        SparkSession.builder.master("local[2]")
        .appName("edgebus-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.memory", "1g")
    )
    for key, value in delta_config(partitions=2).items():  # the pipeline's Delta, as in production
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    yield session
    session.stop()


@pytest.fixture
def edgebus_spark(spark: SparkSession) -> SparkSession:
    """The shared session with the ``edgebus`` streaming source registered."""
    source.register(spark)
    return spark


@pytest.fixture
def make_settings(tmp_path: Path) -> Callable[..., PipelineSettings]:
    """Pipeline settings under ``tmp_path`` for a test run: ``local[2]``, fast triggers, the
    quality and maintenance schedules off; keyword arguments override."""

    def make(**overrides: Any) -> PipelineSettings:
        values: dict[str, Any] = {
            "data_dir": tmp_path / "data",
            "lake": tmp_path / "lake",
            "master": "local[2]",
            "trigger_interval_seconds": 0.1,
            "shuffle_partitions": 2,
            "quality_interval_seconds": 0.0,
            "maintenance_interval_seconds": 0.0,
        }
        values.update(overrides)
        return PipelineSettings(**values)

    return make
