"""``python -m edgebus.spark_setup``: the set-up's last step, the JVM's class archive
(:mod:`streaming.class_archive`), made from a run of the demo lake.

The demo lake (:mod:`edgebus.demo_lake`) is the real pipeline over a small journal: every table's
step and the quota step, three runs. The classes its JVM loads are the ones every later Delta
session would load again from some 300 jars; from now on they are mapped from the archive. The
demo's quality run is left out: great-expectations' classes are off the pipeline's streaming
path, and it made set-up ~10 s longer (67 s against 58 s here; every CI run makes the archive
afresh).
``scripts/bootstrap.sh`` runs this after fetching Delta's jars when ``--check`` says the archive
for this JDK and class path is missing (``--force``: make it again).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def demo_workload(spark: SparkSession, work: Path) -> None:
    """The demo lake, built in ``work`` with ``spark`` (without its quality run)."""
    from edgebus import demo_lake

    demo_lake.build(work / "data", work / "lake", spark=spark, quality=False)


def main(argv: Sequence[str] | None = None) -> int:
    from streaming import class_archive

    parser = argparse.ArgumentParser(
        prog="python -m edgebus.spark_setup",
        description="Make the JVM's class archive for this JDK and Spark's class path.",
    )
    parser.add_argument("--force", action="store_true", help="make it again even if it exists")
    parser.add_argument(
        "--check",
        action="store_true",
        help="make nothing: exit 0 when the archive exists (or archives are off), 1 when not",
    )
    args = parser.parse_args(argv)
    if args.check:
        return 0 if class_archive.current() else 1
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    made = class_archive.make(demo_workload, force=args.force)
    if made is None:
        print(f"class archive: off ({class_archive.ENABLE_ENV}=0)", file=sys.stderr)
    else:
        print(f"class archive: {made}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
