"""The jars every Spark session of the project starts with: a missing one is one clear line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sinks.delta import log_retention
from streaming.errors import PipelineConfigError
from streaming.session import EDGEBUS_JAR, JARS_ENV, delta_config, delta_jars


def test_the_projects_own_classes_come_with_delta() -> None:
    jars = delta_jars()
    assert Path(jars[-1]).name == EDGEBUS_JAR
    assert any("delta-spark_" in Path(jar).name for jar in jars)
    assert delta_config()["spark.jars"] == ",".join(jars)


def test_without_the_projects_own_classes_it_says_how_to_build_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Delta's jars where they are, edgebus's absent (a venv that never ran the set-up).
    monkeypatch.setenv(JARS_ENV, str(Path(sys.prefix) / "delta-jars"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    with pytest.raises(PipelineConfigError, match=r"sinks/jvm.*scripts/bootstrap\.sh"):
        delta_jars()


@pytest.mark.parametrize(
    ("hours", "value"),
    [(6.0, "interval 360 minutes"), (0.5, "interval 30 minutes"), (1 / 60, "interval 1 minutes")],
)
def test_log_retention_is_in_whole_minutes(hours: float, value: str) -> None:
    assert log_retention(hours) == value
