"""The class archive set-up made (scripts/bootstrap.sh → edgebus.spark_setup) is the one a Delta
session's driver maps: the suite's own session is built with the pipeline's class path."""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import SparkSession

from streaming import class_archive
from streaming.session import delta_jars


def _jvm_maps(spark: SparkSession) -> str:
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()  # type: ignore[union-attr]
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_drivers_jvm_maps_the_archive_set_up_made(spark: SparkSession) -> None:
    archive = class_archive.archive_path(delta_jars())
    assert archive.is_file(), f"set-up made no class archive for this JDK and class path: {archive}"
    assert str(archive) in _jvm_maps(spark)


def test_delta_classes_come_from_the_drivers_own_class_path(spark: SparkSession) -> None:
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    delta_log = jvm.java.lang.Class.forName("org.apache.spark.sql.delta.DeltaLog")
    system = jvm.java.lang.ClassLoader.getSystemClassLoader()
    # The application class loader: the one whose classes the archive holds.
    assert delta_log.getClassLoader().equals(system)
