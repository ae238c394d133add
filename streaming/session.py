"""The one SparkSession of the pipeline, configured from :class:`PipelineSettings`, with Delta.

Every table is written and read by Spark's own Delta data source (delta-spark). Its JVM half,
and Hadoop's S3A file system for a lake in a bucket (``hadoop-aws`` with the few AWS SDK v2
modules it uses, not the SDK's 600 MB ``bundle``), are fetched once at set-up into
``.venv/delta-jars`` (``scripts/delta-jars.sh``); Spark starts with those files as
``spark.jars`` (shipped to a cluster's executors too) and never resolves anything at start.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import pyspark
from pyspark.sql import SparkSession

from ingest import source, worker_daemon
from sinks.delta import LOG_RETENTION_DEFAULT, log_retention
from sinks.storage import LakePath, hadoop_options
from streaming import class_archive
from streaming.errors import PipelineConfigError
from streaming.settings import PipelineSettings

APP_NAME = "edgebus-pipeline"
# Another folder of Delta jars (the tests and operators who provide the jars by hand).
JARS_ENV = "EDGEBUS_DELTA_JARS"
_COORDINATE_FILE = ".coordinate"
# Delta's log store for tables on a local file system (sinks/jvm, built into this jar at set-up).
LOG_STORE_KEY = "spark.delta.logStore.file.impl"
LOCAL_LOG_STORE = "io.edgebus.delta.LocalListingLogStore"
EDGEBUS_JAR = "edgebus-delta.jar"
# The module Spark starts its Python workers with (ingest.worker_daemon).
PYTHON_DAEMON_KEY = "spark.python.daemon.module"
WORKER_DAEMON = worker_daemon.__name__
DRIVER_JAVA_OPTIONS_KEY = "spark.driver.extraJavaOptions"
DRIVER_CLASS_PATH_KEY = "spark.driver.extraClassPath"
# Parquet's per-column dictionary switch (the column's name follows a "#").
NO_DICTIONARY = "spark.hadoop.parquet.enable.dictionary"
# The columns written PLAIN, without Parquet's dictionary: payloads (messages, quarantine) and
# their text are nearly all distinct, so a dictionary is built and thrown away per page (a fifth
# of a batch's time, BENCHMARKS.md issue 18); a fleet's devices (client_id, topic: thousands a
# file) make each row one more lookup in a hash map of thousands of keys, 6 % of the pipeline's
# CPU for files 3 % smaller (BENCHMARKS.md issue 12, 2026-11-28). Low-cardinality columns
# (node, tenant, content_type, ...) keep theirs.
PLAIN_COLUMNS = ("payload", "payload_text", "client_id", "topic")


def delta_coordinate() -> str:
    """Delta's Maven coordinate for the installed delta-spark and pyspark (what
    ``delta.configure_spark_with_delta_pip`` would resolve)."""
    spark = ".".join(pyspark.__version__.split(".")[:2])
    return f"io.delta:delta-spark_{spark}_2.13:{importlib.metadata.version('delta-spark')}"


# The AWS SDK v2 that each Hadoop release's hadoop-aws is built against (hadoop-project's
# aws-java-sdk-v2.version); its S3A needs these modules of it, not the whole ``bundle``.
_AWS_SDK = {"3.4.2": "2.29.52"}
_AWS_SDK_MODULES = ("s3", "s3-transfer-manager", "sts")


def hadoop_version() -> str:
    """The Hadoop version pyspark ships (from its ``hadoop-client-api`` jar)."""
    jars = Path(pyspark.__file__).parent / "jars"
    found = sorted(jars.glob("hadoop-client-api-*.jar"))
    if not found:
        raise PipelineConfigError(f"no hadoop-client-api jar in {jars}: is pyspark complete?")
    return found[0].stem.removeprefix("hadoop-client-api-")


def s3_coordinates() -> list[str]:
    """Hadoop's S3A for the Hadoop that pyspark ships, with the AWS SDK modules it uses."""
    hadoop = hadoop_version()
    sdk = _AWS_SDK.get(hadoop)
    if sdk is None:
        raise PipelineConfigError(
            f"pyspark ships Hadoop {hadoop}, whose AWS SDK version streaming/session.py does not "
            "know: add it to _AWS_SDK (hadoop-project's aws-java-sdk-v2.version)"
        )
    modules = [f"software.amazon.awssdk:{name}:{sdk}" for name in _AWS_SDK_MODULES]
    return [f"org.apache.hadoop:hadoop-aws:{hadoop}", *modules]


def jar_coordinates() -> list[str]:
    """Every Maven coordinate ``scripts/delta-jars.sh`` resolves (one a line in its marker)."""
    return [delta_coordinate(), *s3_coordinates()]


def delta_jars() -> list[str]:
    """The jar files of Delta's JVM half and S3A, and edgebus's own (``sinks/jvm``, built at
    set-up), or :class:`PipelineConfigError` saying what to do."""
    folder = Path(os.environ.get(JARS_ENV) or Path(sys.prefix) / "delta-jars")
    wanted = "\n".join(jar_coordinates())
    marker = folder / _COORDINATE_FILE
    found = marker.read_text().strip() if marker.is_file() else None
    jars = sorted(str(path) for path in folder.glob("*.jar")) if folder.is_dir() else []
    if found != wanted or not jars:
        raise PipelineConfigError(
            f"the jars of Delta Lake and S3A ({', '.join(jar_coordinates())}) are missing from "
            f"{folder}: run scripts/bootstrap.sh (it fetches them once with Maven), or put the "
            f"jars there by hand and write those coordinates, one a line, into {marker}"
        )
    own = Path(sys.prefix) / "edgebus-jars" / EDGEBUS_JAR
    if not own.is_file():
        raise PipelineConfigError(
            f"edgebus's own JVM classes (sinks/jvm) are missing: {own} is not there; run "
            "scripts/bootstrap.sh (it builds them once with javac)"
        )
    return [*jars, str(own)]


def delta_config(
    partitions: int = 4, *, class_archive_options: list[str] | None = None
) -> Mapping[str, str]:
    """The Spark settings every Delta-enabled session here gets (the pipeline's, the tests',
    the notebooks'). ``partitions``: how many tasks list a table's files for VACUUM.
    ``class_archive_options``: the driver's class-data-sharing options (by default, those that
    map the archive set-up made, if it fits: :mod:`streaming.class_archive`)."""
    jars = delta_jars()
    archive = (
        class_archive.java_options(jars) if class_archive_options is None else class_archive_options
    )
    return {
        # One task rebuilds a table's state from its log after each commit: the log is a
        # checkpoint plus about a hundred JSON commits at most (the writer's and maintenance's
        # checkpoints, sinks.delta.CHECKPOINT_EVERY), and Delta's default of 50 tasks cost a
        # second per commit here (0.2 s for 4, measured with ten JSON commits).
        "spark.databricks.delta.snapshotPartitions": "1",
        # Room for every query's generated code: a pipeline's batch runs more than the 100
        # distinct plans Spark's default keeps (the tables' writes, Delta's log replays and
        # statistics, the usage and quota steps), so with the default each batch evicted what
        # the next needed and compiled it again: ~20 Janino compiles a second in issue 9's
        # soak, each a new class in metaspace and the JIT's code cache (the JVM's growth), and
        # 4-6 a minute once they all fit (BENCHMARKS.md, issue 9, 2026-11-27 23:00).
        "spark.sql.codegen.cache.maxEntries": "1000",
        # The pools that run query stages start a thread per stage until they hold this many
        # (Spark's default: 1,024 each), and each idle one lives for a minute: a pipeline that
        # plans a few stages a second kept 150 threads in each, more as the rate rose. The
        # pipeline runs a handful of queries at a time, each with a few stages.
        "spark.sql.shuffleExchange.maxThreadThreshold": "64",
        "spark.sql.resultQueryStage.maxThreadThreshold": "64",
        # VACUUM lists a table's directories with this many tasks (Spark's default: 10,000).
        "spark.sql.sources.parallelPartitionDiscovery.parallelism": str(partitions),
        "spark.jars": ",".join(jars),
        # The same jars on the driver's own class path: its classes then come from the
        # application class loader, which the class archive serves (streaming.class_archive).
        DRIVER_CLASS_PATH_KEY: os.pathsep.join(jars),
        **({DRIVER_JAVA_OPTIONS_KEY: " ".join(archive)} if archive else {}),
        # A commit lists _delta_log from its newest checkpoint; Delta's own store for file:
        # paths asks the status of every entry in the directory to do so, a cost that grew
        # with the whole log (bench.delta_log, BENCHMARKS.md). This one reads names first.
        LOG_STORE_KEY: LOCAL_LOG_STORE,
        # Delta's log (its commits, checksums and _last_checkpoint) and the query's checkpoint
        # are written through Hadoop's FileContext; for local paths, without Hadoop's checksum
        # files. Its default local file system writes a hidden .crc beside every file, which
        # doubled the entries of each _delta_log that every commit lists, and cost a tenth of
        # a small commit (bench.delta_log, BENCHMARKS.md). Delta's own checksums (the N.crc
        # beside each commit) are unaffected; the FileSystem API (Parquet files, S3A's
        # buffers) keeps Hadoop's checksummed local file system.
        "spark.hadoop.fs.AbstractFileSystem.file.impl": "org.apache.hadoop.fs.local.RawLocalFs",
        # In a bucket, the same listing from the newest checkpoint as one S3 LIST starting
        # after it (Delta's S3 log store, with S3A), not pages of the whole log.
        "spark.hadoop.delta.enableFastS3AListFrom": "true",
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        # Every data file carries the physical types its Delta schema declares, so every
        # reader reads it: timestamps as INT64 microseconds, not Spark's legacy INT96.
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        # Vacuum obeys pipeline.vacuum_retention_hours, also below Delta's 7-day default.
        "spark.databricks.delta.retentionDurationCheck.enabled": "false",
        # The log may keep less than the removed files' 7 days (pipeline.
        # delta_log_retention_hours): Delta refuses that only for VACUUM LITE, which finds the
        # files to delete in the log; maintenance's VACUUM is the full one, which lists them.
        "spark.databricks.delta.vacuum.enforceDeletedFileAndLogRetentionDurationCompatibility": (
            "false"
        ),
        # The declared schemas keep NOT NULL inside lists (user_properties' key and value,
        # usage's nodes), as the tables made before had them; Delta enforces NOT NULL only at
        # the top level and refuses nested ones unless told they go unenforced.
        "spark.databricks.delta.constraints.allowUnenforcedNotNull.enabled": "true",
        # A commit's checksum (N.crc) without the table's whole file list. Delta keeps that list
        # in the .crc of a table of few files, and for a table's first commit builds the empty
        # list it starts from with a Spark job over the log: the slowest part of a new lake's
        # first batch here (encoders and analysis, cold, on the stream's thread: ~1.5 s on 2
        # cores, BENCHMARKS.md, issue 18). Nothing here reads the list from a .crc: the light
        # readers read the log, and the usage step builds its snapshot's files ahead
        # (sinks.delta). Protocol, metadata and counts stay in the .crc.
        "spark.databricks.delta.allFilesInCrc.enabled": "false",
        # No table feature the light readers (delta-rs, polars, DuckDB) lack.
        "spark.databricks.delta.properties.defaults.enableDeletionVectors": "false",
        "spark.sql.session.timeZone": "UTC",
        # Payloads and device ids without Parquet's dictionary (PLAIN_COLUMNS says why).
        **{f"{NO_DICTIONARY}#{column}": "false" for column in PLAIN_COLUMNS},
        # Python workers from edgebus's daemon: pyspark's, but a reused worker no longer reads
        # pyspark.zip's and spark-core's zip directories again at every task (~120 ms a task
        # here, every micro-batch's read among them; see ingest.worker_daemon).
        PYTHON_DAEMON_KEY: WORKER_DAEMON,
    }


def driver_java_options(settings: PipelineSettings) -> list[str]:
    """The pipeline driver's JVM options: its memory bounded and flat for a run of months."""
    return [
        # The whole heap from the start, touched once, instead of a heap growing into its
        # maximum for minutes.
        f"-Xms{settings.driver_memory}",
        "-XX:+AlwaysPreTouch",
        # The throughput collector rather than G1 (the JVM's choice on any machine of 2 cores
        # and 2 GB): the driver's heap is a fixed size and holds little that lives, and G1's
        # concurrent work and barriers cost 5 % of the pipeline's CPU on two cores; its young
        # collections are short (BENCHMARKS.md, issue 12, "Parallel against G1").
        "-XX:+UseParallelGC",
        # The JIT compiles a method after three times the calls and loops it would by default.
        # The per-row code (Parquet's encoders, Spark's generated code) reaches that within a
        # batch's first rows; the code that runs a few times per batch (planning, codegen's
        # cache lookups, closure cleaning, py4j, Hadoop's Configuration: thousands of
        # methods) kept the C2 compiler busy for a third of the JVM's CPU long after the
        # first batch, and mostly no longer gets compiled: CPU -6 %, sustained +7 %
        # (BENCHMARKS.md, issue 12, "the JIT's long tail").
        "-XX:CompileThresholdScaling=3",
        # The JIT's compiled code: at most 150 MiB (the JVM's default reserves 240 and keeps
        # filling it for 20 minutes and more of a warm pipeline; with the thresholds above,
        # ~105 MiB after 20 minutes here: BENCHMARKS.md, issue 9, "a 20-minute soak").
        "-XX:ReservedCodeCacheSize=150m",
        # Memory the JVM's C code (the JIT compilers' arenas above all) freed goes back to the
        # system every 5 s instead of staying in glibc's arenas. A product option since JDK
        # 17.0.9 and 21.0.1; older 17s know it as experimental or not at all (then ignored).
        "-XX:+UnlockExperimentalVMOptions",
        "-XX:+IgnoreUnrecognizedVMOptions",
        "-XX:TrimNativeHeapInterval=5000",
    ]


def build_spark(
    settings: PipelineSettings, *, class_archive_options: list[str] | None = None
) -> SparkSession:
    """Start (or join) the SparkSession and register the ``edgebus`` streaming source.

    Python workers run in this interpreter unless the environment says otherwise, so the
    executors see the same packages as the driver. Time is UTC everywhere: ``date``
    partitions and timestamps must not depend on the machine's zone.
    ``class_archive_options``: see :func:`delta_config`.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(settings.master)
        .appName(APP_NAME)
        .config("spark.driver.memory", settings.driver_memory)
        .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        # The driver talks to its executors on loopback only: nothing listens on the network.
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        # Steps run in Python on the executors (the usage step's applyInArrow): 100,000-row
        # Arrow batches cost a tenth of the per-batch overhead of the default 10,000.
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "100000")
    )
    config = dict(
        delta_config(settings.shuffle_partitions, class_archive_options=class_archive_options)
    )
    # A long-running pipeline's memory is the size it was given, not a curve that climbs
    # (BENCHMARKS.md, issue 9's soak). Spark sets -Xmx from driver_memory.
    java = [*driver_java_options(settings), config.pop(DRIVER_JAVA_OPTIONS_KEY, "")]
    builder = builder.config(DRIVER_JAVA_OPTIONS_KEY, " ".join(java).strip())
    for key, value in config.items():
        builder = builder.config(key, value)
    # Every table's log retention (ensure() gives it to the tables made before as well).
    retention = log_retention(settings.delta_log_retention_hours)
    builder = builder.config(LOG_RETENTION_DEFAULT, retention)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    source.register(spark)
    use_lake(spark, settings.lake)
    return spark


def use_lake(spark: SparkSession, lake: LakePath) -> None:
    """Give ``spark`` what it needs to reach ``lake`` (a bucket's S3A settings; nothing for a
    local lake). Per bucket, on the running session, so a shared session can reach several."""
    options = hadoop_options(lake)
    if not options:
        return
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    for key, value in options.items():
        conf.set(key, value)


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
