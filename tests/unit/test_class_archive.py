"""The JVM's class archive: which file fits this JDK and class path, when the driver maps it,
and how set-up makes it (the JVM's own writing is exercised by set-up and checked by
tests/spark/test_class_archive_mapped.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from streaming import class_archive, session
from streaming.class_archive import ClassArchiveError


@pytest.fixture
def archives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "spark-cds"
    monkeypatch.setattr(class_archive, "archive_dir", lambda: folder)
    monkeypatch.delenv(class_archive.ENABLE_ENV, raising=False)
    monkeypatch.delenv("SPARK_CONF_DIR", raising=False)
    return folder


def _jar(folder: Path, name: str, body: bytes = b"PK") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(body)
    return str(path)


def test_the_fingerprint_follows_the_jars_and_the_conf_dir(
    archives: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jar = _jar(tmp_path / "jars", "delta.jar")
    first = class_archive.fingerprint([jar])
    assert class_archive.fingerprint([jar]) == first  # nothing changed: the same archive

    Path(jar).write_bytes(b"PK another build")  # another jar under the same name
    rebuilt = class_archive.fingerprint([jar])
    assert rebuilt != first

    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "conf"))  # first on the class path
    assert class_archive.fingerprint([jar]) not in (first, rebuilt)


def test_options_map_the_archive_only_when_it_exists(archives: Path, tmp_path: Path) -> None:
    jars = [_jar(tmp_path / "jars", "delta.jar")]
    assert class_archive.java_options(jars) == []  # none made: the JDK's own archive stays on

    made = class_archive.archive_path(jars)
    made.parent.mkdir(parents=True)
    made.write_bytes(b"archive")
    assert class_archive.java_options(jars) == [
        f"-XX:SharedArchiveFile={made}",
        class_archive.QUIET,
    ]
    # Another set of jars looks for its own archive.
    assert class_archive.java_options([*jars, _jar(tmp_path / "jars", "more.jar")]) == []


def test_archives_can_be_switched_off(
    archives: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jars = [_jar(tmp_path / "jars", "delta.jar")]
    made = class_archive.archive_path(jars)
    made.parent.mkdir(parents=True)
    made.write_bytes(b"archive")
    monkeypatch.setenv(class_archive.ENABLE_ENV, "0")
    assert class_archive.java_options(jars) == []
    assert class_archive.current()  # nothing to make either
    assert class_archive.make(lambda spark, work: None) is None


def test_the_drivers_class_path_and_options_carry_delta_and_the_archive(
    archives: Path,
) -> None:
    jars = session.delta_jars()
    config = session.delta_config()
    assert config[session.DRIVER_CLASS_PATH_KEY].split(os.pathsep) == jars
    assert session.DRIVER_JAVA_OPTIONS_KEY not in config  # no archive in this folder

    made = class_archive.archive_path(jars)
    made.parent.mkdir(parents=True)
    made.write_bytes(b"archive")
    options = session.delta_config()[session.DRIVER_JAVA_OPTIONS_KEY]
    assert f"-XX:SharedArchiveFile={made}" in options.split()
    # The caller's own options (set-up's training run) replace them.
    given = session.delta_config(class_archive_options=["-XX:ArchiveClassesAtExit=/x"])
    assert given[session.DRIVER_JAVA_OPTIONS_KEY] == "-XX:ArchiveClassesAtExit=/x"


class _FakeSession:
    """What make() needs of a session here: the JVM it stands for writes ``dump`` at exit."""

    def __init__(self, dump: Path | None) -> None:
        self.dump = dump


def _fake_jvm(monkeypatch: pytest.MonkeyPatch, writes: bool, seen: list[list[str]]) -> None:
    def build(settings: Any, *, class_archive_options: list[str]) -> _FakeSession:
        seen.append(class_archive_options)
        option = next(o for o in class_archive_options if o.startswith("-XX:ArchiveClassesAt"))
        return _FakeSession(Path(option.split("=", 1)[1]) if writes else None)

    def stop(spark: _FakeSession) -> None:
        if spark.dump is not None:
            spark.dump.write_bytes(b"classes")

    monkeypatch.setattr(session, "build_spark", build)
    monkeypatch.setattr(session, "stop_spark", stop)


def test_make_runs_the_workload_in_a_dumping_jvm_and_keeps_only_the_new_archive(
    archives: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archives.mkdir()
    stale = archives / "another-jdk.jsa"
    stale.write_bytes(b"old")
    seen: list[list[str]] = []
    _fake_jvm(monkeypatch, writes=True, seen=seen)
    worked: list[Path] = []

    made = class_archive.make(lambda spark, work: worked.append(work))

    assert made == class_archive.archive_path(session.delta_jars())
    assert made is not None
    assert made.read_bytes() == b"classes"
    assert sorted(archives.iterdir()) == [made]  # the stale one and the partial file are gone
    assert class_archive.QUIET in seen[0]
    assert worked
    assert not worked[0].exists()
    assert class_archive.current()
    # Made already: nothing runs again unless forced.
    assert class_archive.make(lambda spark, work: worked.append(work)) == made
    assert len(worked) == 1
    class_archive.make(lambda spark, work: worked.append(work), force=True)
    assert len(worked) == 2


def test_make_says_so_when_the_jvm_wrote_nothing(
    archives: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_jvm(monkeypatch, writes=False, seen=[])
    with pytest.raises(ClassArchiveError, match="no class archive"):
        class_archive.make(lambda spark, work: None)
    assert not class_archive.current()
