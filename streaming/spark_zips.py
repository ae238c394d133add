"""Spark's Python archives with bytecode, made once at set-up.

Theory of operation
-------------------
Every Python process Spark starts (the streaming source's planner and runner beside the driver,
the read planner at a query's first batch, the executors' worker daemon) gets
``$SPARK_HOME/python/lib/pyspark.zip`` and py4j's zip first on its ``PYTHONPATH``, so it
imports pyspark from those archives rather than from the installed package. The archives hold
only ``.py`` sources, and Python does not write bytecode into a zip: each such process compiles
every pyspark module it imports, again, every time. Measured here: a process importing
``pyspark.sql.worker.create_data_source`` takes 1.7 s from the zips against 0.5 s from the
installed package, and a pipeline starts three or four of them before its first batch is
written (BENCHMARKS.md, issue 18).

:func:`compile_zip` adds beside each ``X.py`` of an archive the ``X.pyc`` that ``zipimport``
looks for first (PEP 552 checked-hash bytecode: the importer hashes the ``.py`` next to it and
compiles the source as before when they differ, so a stale ``.pyc`` can never be run). The
archive keeps every entry it had; it is rewritten beside itself and renamed over, so a process
reading it meanwhile sees the old or the new file, never half of one. A marker entry names the
interpreter's bytecode version: another Python (another magic number) rejects these ``.pyc``
and compiles from source as before, and the next set-up compiles the archive for it.

``scripts/bootstrap.sh`` runs ``python -m streaming.spark_zips`` at every set-up (a quick check
when the archives are already compiled). Without it Spark works the same, only slower to start
a Python process.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import marshal
import os
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

# The entry that says which interpreter's bytecode an archive holds (its magic number, in hex).
MARKER = "edgebus-bytecode"
# PEP 552 flags: hash-based (bit 0), checked against the source at import (bit 1).
CHECKED_HASH = 0b11


def spark_zips(spark_home: Path | None = None) -> list[Path]:
    """The archives Spark puts on its Python processes' path (pyspark's and py4j's)."""
    if spark_home is None:  # the installed pyspark's directory, without importing it (~0.5 s)
        spec = importlib.util.find_spec("pyspark")
        if spec is None or not spec.submodule_search_locations:
            return []
        spark_home = Path(next(iter(spec.submodule_search_locations)))
    lib = spark_home / "python" / "lib"
    return sorted(lib.glob("pyspark.zip")) + sorted(lib.glob("py4j-*-src.zip"))


def magic() -> str:
    return importlib.util.MAGIC_NUMBER.hex()


def is_compiled(archive: Path) -> bool:
    """Whether ``archive`` holds this interpreter's bytecode beside its sources."""
    with zipfile.ZipFile(archive) as zf:
        try:
            return zf.read(MARKER).decode() == magic()
        except KeyError:
            return False


def bytecode(source: bytes, name: str) -> bytes:
    """The checked-hash ``.pyc`` of ``source`` (``name``: the file name its code carries, which
    tracebacks show: the one zipimport gives a module it compiles itself)."""
    code = compile(source, name, "exec", dont_inherit=True)
    return (
        importlib.util.MAGIC_NUMBER
        + CHECKED_HASH.to_bytes(4, "little")
        + importlib.util.source_hash(source)
        + marshal.dumps(code)
    )


def compile_zip(archive: Path) -> int:
    """Rewrite ``archive`` with a ``.pyc`` beside each ``.py`` (replacing any older ones);
    returns how many it compiled. A source that does not compile is left without one."""
    partial = archive.with_name(archive.name + ".partial")
    compiled = 0
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(partial, "w") as out:
        for info in src.infolist():
            if info.filename == MARKER or info.filename.endswith(".pyc"):
                continue  # this set-up's own, from an older interpreter: made again below
            data = src.read(info)
            out.writestr(info, data)
            if not info.filename.endswith(".py"):
                continue
            try:
                pyc = bytecode(data, str(archive / info.filename))
            except (SyntaxError, ValueError) as exc:  # imported from source, as before
                logger.warning("%s: %s not compiled: %s", archive, info.filename, exc)
                continue
            entry = zipfile.ZipInfo(info.filename[:-3] + ".pyc", date_time=info.date_time)
            entry.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(entry, pyc)
            compiled += 1
        out.writestr(MARKER, magic())
    os.replace(partial, archive)
    return compiled


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m streaming.spark_zips",
        description="Add bytecode to Spark's Python archives (pyspark.zip, py4j's zip).",
    )
    parser.add_argument("--spark-home", type=Path, help="default: the installed pyspark's")
    parser.add_argument("--force", action="store_true", help="compile even if compiled already")
    args = parser.parse_args(argv)
    archives = spark_zips(args.spark_home)
    if not archives:
        print("spark zips: none found (no python/lib/pyspark.zip)", file=sys.stderr)
        return 1
    for archive in archives:
        if args.force or not is_compiled(archive):
            print(f"spark zips: {archive}: {compile_zip(archive)} modules", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
