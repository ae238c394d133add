"""The JVM's class-data-sharing archive of a Delta session's classes, made once at set-up.

Theory of operation
-------------------
A Delta-enabled Spark driver loads some 24,000 classes before its first micro-batch is
written: about 12,000 to start and as many again in the first batch (Delta's transaction,
Spark SQL's analysis and code generation, Parquet's writer). Each is looked up through a class
path of some 300 jars, parsed and verified, single-threaded on the driver where nothing else
can go on. The JDK keeps classes it has already parsed and verified in an archive that a later
JVM maps instead (class-data sharing, JDK 13+: ``-XX:ArchiveClassesAtExit`` writes the classes
a training run loaded when it exits; ``-XX:SharedArchiveFile`` maps them). Measured here
(BENCHMARKS.md, issue 18): a Spark process 2-4 s shorter, the pipeline's first batch about 1 s
shorter.

:func:`make` (``python -m edgebus.spark_setup``, run by ``scripts/bootstrap.sh``) runs a workload
(there: the demo lake, the real pipeline's every table step and the quota step) in a JVM that writes
the archive as it exits; :func:`java_options` gives
every later Delta session (``streaming.session.delta_config``: the pipeline, tests, notebooks)
the option that maps it. An archive only fits the JDK build and the class path it was made with:
its name is a digest of both (:func:`archive_path`), so another JDK, other jars or another
Spark conf dir look for another file, start without one when there is none (as before), and the
next set-up makes it. Delta's jars go on the driver's own class path too
(``spark.driver.extraClassPath``, as well as ``spark.jars``, which ships them to executors), so
its classes come from the application class loader and are archived with Spark's.

An archive is a cache: the JVM checks it (header, JDK build, class path) and starts without it
when it does not fit; only the option is left out where no archive was made, because a missing
file would switch off the JDK's own base archive too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pyspark

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

# Where archives live: inside the venv, like Delta's jars (made by the same set-up).
ARCHIVE_DIR_NAME = "spark-cds"
# Set to "0" to start Spark without an archive (and make none).
ENABLE_ENV = "EDGEBUS_CLASS_ARCHIVE"
# The JDK's warnings about an archive that does not fit (another JDK or class path) stay out of
# the output: the JVM then simply starts without it.
QUIET = "-Xlog:cds=off,cds+dynamic=off"


class ClassArchiveError(RuntimeError):
    """The training run ended without the JVM writing an archive."""


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def java_binary() -> Path:
    """The java Spark's launcher runs: ``$JAVA_HOME/bin/java``, else ``java`` on the PATH."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if found is None:
        raise FileNotFoundError("no java on the PATH and no JAVA_HOME")
    return Path(found).resolve()


def spark_conf_dir() -> Path:
    """The folder Spark's launcher puts first on the driver's class path."""
    conf = os.environ.get("SPARK_CONF_DIR")
    return Path(conf) if conf else Path(pyspark.__file__).parent / "conf"


def _stamp(path: Path) -> str:
    try:
        stat = path.stat()
    except OSError:
        return f"{path}:absent"
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def fingerprint(extra_class_path: Sequence[str]) -> str:
    """A digest of what an archive must match: the JDK build (its ``libjvm.so``) and the
    driver's class path (Spark's conf dir, Spark's jars, ``extra_class_path``), each jar by
    name, size and time."""
    java_home = java_binary().parent.parent
    jvm = sorted(java_home.glob("lib/server/libjvm.so")) or [java_home / "lib"]
    jars = sorted((Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    parts = [
        _stamp(jvm[0]),
        str(spark_conf_dir().resolve()),
        *(_stamp(jar) for jar in jars),
        *(_stamp(Path(jar)) for jar in extra_class_path),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def archive_dir() -> Path:
    return Path(sys.prefix) / ARCHIVE_DIR_NAME


def archive_path(extra_class_path: Sequence[str]) -> Path:
    """The archive for this JDK and class path (it may not exist)."""
    return archive_dir() / f"{fingerprint(extra_class_path)}.jsa"


def java_options(extra_class_path: Sequence[str]) -> list[str]:
    """The driver's options that map the archive made for this JDK and class path; none where
    no such archive exists (or :data:`ENABLE_ENV` is ``0``)."""
    if not enabled():
        return []
    try:
        archive = archive_path(extra_class_path)
    except FileNotFoundError:  # no java: Spark will say so itself
        return []
    if not archive.is_file():
        return []
    return [f"-XX:SharedArchiveFile={archive}", QUIET]


def current() -> bool:
    """Whether this JDK and class path have their archive (or archives are off)."""
    from streaming.session import delta_jars

    return not enabled() or archive_path(delta_jars()).is_file()


def make(workload: Callable[[SparkSession, Path], None], *, force: bool = False) -> Path | None:
    """Make the archive for this JDK and class path unless it exists (``force``: again): run
    ``workload`` (a session built as the pipeline's is, and an empty folder to work in) in a
    JVM that writes the archive as it exits; remove the archives of other JDKs and class paths.
    Returns the archive, or None where :data:`ENABLE_ENV` is ``0``."""
    from streaming.session import build_spark, delta_jars, stop_spark
    from streaming.settings import PipelineSettings

    if not enabled():
        return None
    target = archive_path(delta_jars())
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="edgebus-class-archive-"))
    try:
        settings = PipelineSettings(data_dir=work / "data", lake=work / "lake")
        spark = build_spark(
            settings, class_archive_options=[f"-XX:ArchiveClassesAtExit={partial}", QUIET]
        )
        try:
            workload(spark, work)
        finally:
            stop_spark(spark)  # the JVM exits, and writes the archive as it does
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not partial.is_file() or partial.stat().st_size == 0:
        raise ClassArchiveError(f"the JVM wrote no class archive to {partial}")
    partial.replace(target)
    for stale in target.parent.iterdir():
        if stale != target:
            stale.unlink()
    logger.info(
        "class archive %s: %.0f MiB in %.0f s",
        target,
        target.stat().st_size / 2**20,
        time.monotonic() - started,
    )
    return target
