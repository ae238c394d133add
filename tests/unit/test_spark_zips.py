"""Spark's Python archives get bytecode at set-up (streaming.spark_zips): a process importing
from a compiled archive compiles nothing, a stale ``.pyc`` is never run, another interpreter's
bytecode is replaced, and the set-up left the venv's own pyspark.zip compiled."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from streaming import spark_zips

# Imports ``module`` with ``path`` first on sys.path, as Spark's Python processes do, and
# prints the value of ``attr`` and every file the interpreter compiled from source meanwhile
# (the builtin ``compile`` raises an audit event; zipimport compiles a module it finds no
# usable bytecode for with it).
PROBE = """
import importlib, json, sys
compiled = []
sys.addaudithook(lambda event, args: event == "compile" and compiled.append(str(args[1])))
module = importlib.import_module(sys.argv[1])
print(json.dumps({"value": getattr(module, sys.argv[2], None), "compiled": compiled}))
"""


def probe(path: str, module: str, attr: str = "VALUE") -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, module, attr],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def make_zip(path: Path, files: dict[str, str | bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def rewrite(archive: Path, edit: Callable[[str, bytes], bytes]) -> None:
    """Replace ``archive`` by a copy whose every entry went through ``edit(name, data)``."""
    copy = archive.with_name("copy.zip")
    with zipfile.ZipFile(archive) as old, zipfile.ZipFile(copy, "w") as new:
        for info in old.infolist():
            new.writestr(info, edit(info.filename, old.read(info)))
    copy.replace(archive)


SOURCES: dict[str, str | bytes] = {
    "pkg/__init__.py": "",
    "pkg/mod.py": (
        "from pkg import helper\nVALUE = helper.TWO * 21\nFILE = (lambda: 0).__code__.co_filename\n"
    ),
    "pkg/helper.py": "TWO = 2\n",
    "pkg/broken.py": "def (:\n",
    "pkg/data.txt": b"\x00kept as it was\xff",
}


def test_a_compiled_archive_is_imported_without_compiling(tmp_path: Path) -> None:
    archive = make_zip(tmp_path / "lib.zip", SOURCES)
    before = probe(str(archive), "pkg.mod")
    assert before["value"] == 42
    assert any(str(archive) in name for name in before["compiled"])  # type: ignore[union-attr]

    assert not spark_zips.is_compiled(archive)
    assert spark_zips.compile_zip(archive) == 3  # the broken source is left without bytecode
    assert spark_zips.is_compiled(archive)

    after = probe(str(archive), "pkg.mod")
    assert after == {"value": 42, "compiled": []}
    # Its code names the file as zipimport's own compile does (what tracebacks show).
    named = str(archive / "pkg" / "mod.py")
    assert probe(str(archive), "pkg.mod", "FILE")["value"] == named
    with zipfile.ZipFile(archive) as zf:
        # Every entry it had, unchanged, and a .pyc beside each source that compiles.
        for name, data in SOURCES.items():
            expected = data.encode() if isinstance(data, str) else data
            assert zf.read(name) == expected
        names = set(zf.namelist())
        assert {"pkg/__init__.pyc", "pkg/mod.pyc", "pkg/helper.pyc"} <= names
        assert "pkg/broken.pyc" not in names
        assert zf.read("pkg/mod.pyc")[:4] == importlib.util.MAGIC_NUMBER
    assert not archive.with_name("lib.zip.partial").exists()


def test_a_stale_pyc_is_never_run(tmp_path: Path) -> None:
    archive = make_zip(tmp_path / "lib.zip", SOURCES)
    spark_zips.compile_zip(archive)
    # The source changes and the old bytecode stays beside it (an archive replaced by hand).
    rewrite(archive, lambda name, data: b"TWO = 3\n" if name == "pkg/helper.py" else data)

    result = probe(str(archive), "pkg.mod")
    assert result["value"] == 63  # the new source, not the stale bytecode
    assert any("helper.py" in name for name in result["compiled"])  # type: ignore[union-attr]


def test_another_interpreters_bytecode_is_replaced(tmp_path: Path) -> None:
    archive = make_zip(tmp_path / "lib.zip", SOURCES)
    spark_zips.compile_zip(archive)

    def older(name: str, data: bytes) -> bytes:  # another interpreter's magic number
        if name == spark_zips.MARKER:
            return b"0d0d0d0a"
        return b"\x0d\x0d\x0d\x0a" + data[4:] if name.endswith(".pyc") else data

    rewrite(archive, older)
    assert not spark_zips.is_compiled(archive)

    spark_zips.compile_zip(archive)
    assert spark_zips.is_compiled(archive)
    with zipfile.ZipFile(archive) as zf:
        names = zf.namelist()
        assert len(names) == len(set(names))  # each .pyc once: the old ones were dropped
        assert zf.read("pkg/mod.pyc")[:4] == importlib.util.MAGIC_NUMBER
    assert probe(str(archive), "pkg.mod") == {"value": 42, "compiled": []}


def test_main_compiles_each_archive_once(tmp_path: Path) -> None:
    lib = tmp_path / "spark" / "python" / "lib"
    lib.mkdir(parents=True)
    pyspark_zip = make_zip(lib / "pyspark.zip", SOURCES)
    py4j_zip = make_zip(lib / "py4j-0.10.9.9-src.zip", {"py4j/__init__.py": "VALUE = 'py4j'\n"})

    assert spark_zips.main(["--spark-home", str(tmp_path / "spark")]) == 0
    assert spark_zips.is_compiled(pyspark_zip)
    assert spark_zips.is_compiled(py4j_zip)
    stamps = (pyspark_zip.stat().st_mtime_ns, py4j_zip.stat().st_mtime_ns)
    assert spark_zips.main(["--spark-home", str(tmp_path / "spark")]) == 0
    assert (pyspark_zip.stat().st_mtime_ns, py4j_zip.stat().st_mtime_ns) == stamps


def test_main_says_when_there_is_no_archive(tmp_path: Path) -> None:
    assert spark_zips.main(["--spark-home", str(tmp_path)]) == 1


def test_the_set_up_compiled_the_venvs_spark_archives() -> None:
    # What Spark's planner processes run (pyspark.sql.worker.create_data_source), on the path
    # Spark gives them: nothing of pyspark or py4j is compiled from source.
    archives = spark_zips.spark_zips()
    assert archives[0].name == "pyspark.zip"
    assert archives[1].name.startswith("py4j-")
    assert all(spark_zips.is_compiled(archive) for archive in archives)
    result = probe(os.pathsep.join(map(str, archives)), "pyspark.sql.worker.create_data_source")
    assert [name for name in result["compiled"] if ".zip" in name] == []  # type: ignore[union-attr]
    imported = probe(os.pathsep.join(map(str, archives)), "pyspark", "__file__")
    assert ".zip" in str(imported["value"])  # from the archive, as in Spark's processes
