"""The Python workers' daemon keeps the zip directories it read: a task's
``importlib.invalidate_caches()`` no longer reads them again, and zips added later still import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Run in a process of its own: it changes the interpreter's import machinery.
SCRIPT = """
import importlib, json, sys, zipfile, zipimport
from pathlib import Path

from ingest.worker_daemon import SteadyZipImporter, steady_zip_imports

root = Path(sys.argv[1])


def archive(name):
    path = root / f"{name}.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}.py", f"VALUE = {name!r}")
        zf.writestr(f"{name}_pkg/__init__.py", "")
        zf.writestr(f"{name}_pkg/inner.py", "VALUE = 'inner'")
    return str(path)


reads = []
real = zipimport._read_directory


def counting(path):
    reads.append(path)
    return real(path)


zipimport._read_directory = counting
early = archive("early")
sys.path.insert(0, early)
import early as early_module  # noqa: E402

reads.clear()
importlib.invalidate_caches()
before = reads.count(early)
steady_zip_imports()
reads.clear()
importlib.invalidate_caches()
importlib.invalidate_caches()
after = reads.count(early)
import early_pkg.inner  # a package inside the archive, imported after the change  # noqa: E402

late = archive("late")
sys.path.insert(0, late)
import late as late_module  # noqa: E402

late_reads = reads.count(late)
importlib.invalidate_caches()
print(json.dumps({
    "before": before,
    "after": after,
    "early_reads_after_package": reads.count(early),
    "late_reads": late_reads,
    "late_reads_after_invalidate": reads.count(late),
    "values": [early_module.VALUE, early_pkg.inner.VALUE, late_module.VALUE],
    "finders": sorted({type(sys.path_importer_cache[p]).__name__ for p in (early, late)}),
}))
"""


def test_zip_directories_are_read_once_and_later_zips_still_import(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    found = json.loads(done.stdout)
    assert found["before"] == 1  # Python 3.11's zipimporter reads it again at each invalidation
    assert found["after"] == 0
    assert found["early_reads_after_package"] == 0
    assert found["late_reads"] == 1  # a new archive is read when first used, once
    assert found["late_reads_after_invalidate"] == 1
    assert found["values"] == ["early", "inner", "late"]
    assert found["finders"] == ["SteadyZipImporter"]


def _daemon_exit(module: str) -> int:
    """Start ``python -m module pyspark.worker`` as Spark does, read the port it reports, close
    its stdin (Spark's way of stopping it) and return its exit code."""
    daemon = subprocess.Popen(
        [sys.executable, "-m", module, "pyspark.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert daemon.stdout is not None
    assert daemon.stdin is not None
    port = int.from_bytes(daemon.stdout.read(4), "big", signed=True)
    assert 0 < port < 65536
    daemon.stdin.close()
    return daemon.wait(timeout=30)


def test_the_daemon_is_pysparks_with_the_worker_module_spark_names() -> None:
    """It starts, reports its port and stops as pyspark's own daemon does."""
    assert _daemon_exit("ingest.worker_daemon") == _daemon_exit("pyspark.daemon")
