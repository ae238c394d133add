"""The one SparkSession of the pipeline, configured from :class:`PipelineSettings`."""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

from ingest import source
from streaming.settings import PipelineSettings

APP_NAME = "edgebus-pipeline"


def build_spark(settings: PipelineSettings) -> SparkSession:
    """Start (or join) the SparkSession and register the ``edgebus`` streaming source.

    Python workers run in this interpreter unless the environment says otherwise, so the
    executors see the same packages as the driver. Time is UTC everywhere: ``date``
    partitions and timestamps must not depend on the machine's zone.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master(settings.master)
        .appName(APP_NAME)
        .config("spark.driver.memory", settings.driver_memory)
        .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        # The driver talks to its executors on loopback only: nothing listens on the network.
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        # Each micro-batch is collected as Arrow (streaming.pipeline): 100,000-row record
        # batches collect 200,000 journal records in about half the time of the default 10,000.
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "100000")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    source.register(spark)
    return spark


def stop_spark(spark: SparkSession) -> None:
    """Stop ``spark`` and end the JVM that pyspark started for it.

    ``spark.stop()`` keeps the JVM for a next session; a script that exits ends it anyway (the
    JVM exits when its stdin closes), but a Jupyter kernel does not exit while it runs: a
    notebook ending with a plain ``stop()`` takes its kernel a SIGTERM to shut down. Closing
    the JVM's stdin is pyspark's own way of telling it to go. A later session starts a new one.
    """
    from pyspark import SparkContext

    spark.stop()
    gateway = SparkContext._gateway
    process = getattr(gateway, "proc", None)  # None: a JVM pyspark did not launch
    if process is None:
        return
    process.stdin.close()
    process.wait(timeout=60)
    SparkContext._gateway = None
    SparkContext._jvm = None
