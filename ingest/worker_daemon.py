"""The executors' Python worker daemon: pyspark's own, with the zip archives on the workers'
path read once per worker instead of once per task.

Theory of operation
-------------------
Spark starts its Python workers from a daemon (``python -m pyspark.daemon``) with
``pyspark.zip``, py4j's zip and the ``spark-core`` jar on their ``PYTHONPATH`` (Spark puts the
jar there for the Python files a jar may carry), and a reused worker runs task after task. At the
start of every task pyspark calls ``importlib.invalidate_caches()`` (``setup_spark_files``: a
task may bring new ``.py``/``.zip`` files), and on Python 3.11 that makes every ``zipimporter``
read its archive's central directory again: about 6,700 entries (the jar's 5,362 and
``pyspark.zip``'s 1,328; 2,499 once set-up adds bytecode, ``streaming.spark_zips``) parsed in
pure Python, **about 120 ms of every task on an idle host**, more under load, whatever the task
does (py-spy on a worker; BENCHMARKS.md, issue 12). The
pipeline's stream runs one small task per micro-batch, so this was a fixed part of every batch.

Those archives do not change while a worker lives (they are Spark's own files, and a task's own
zips are new paths, which get a finder of their own). So this daemon makes every zip finder
(those already made, and through ``sys.path_hooks`` every one made later) keep the directory it
read, then runs pyspark's daemon unchanged (the worker module Spark names stays
``sys.argv[1]``). A path Spark adds later still imports: a new path gets a new finder, which reads
its archive then.

Set by :func:`streaming.session.delta_config` as ``spark.python.daemon.module``, so every
session edgebus builds (the pipeline, tests, notebooks; on a cluster, the executors, which import
this package already for the route) uses it.
"""

from __future__ import annotations

import runpy
import sys
import zipimport


class SteadyZipImporter(zipimport.zipimporter):
    """A zip finder that keeps the central directory it read (the archive does not change)."""

    def invalidate_caches(self) -> None:
        """Nothing to do: see the module's docstring."""


def steady_zip_imports() -> None:
    """Make this process's zip finders, and the ones it makes from now on, keep their
    directories."""
    sys.path_hooks[:] = [
        SteadyZipImporter if hook is zipimport.zipimporter else hook for hook in sys.path_hooks
    ]
    for path, finder in list(sys.path_importer_cache.items()):
        if type(finder) is zipimport.zipimporter:
            # Made from the directory zipimport read already (its module-level cache): no read.
            sys.path_importer_cache[path] = SteadyZipImporter(path)


if __name__ == "__main__":
    steady_zip_imports()
    runpy.run_module("pyspark.daemon", run_name="__main__", alter_sys=True)
