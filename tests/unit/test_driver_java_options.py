"""The pipeline driver's JVM options, given to this machine's java: accepted and in effect."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from streaming.session import driver_java_options
from streaming.settings import PipelineSettings


def final_flags(options: list[str]) -> dict[str, str]:
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    assert java, "no java on PATH"
    done = subprocess.run(
        [java, *options, "-XX:+PrintFlagsFinal", "-version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    flags = re.findall(r"^\s*\S+\s+(\w+)\s+:?=\s+(\S+)", done.stdout, re.MULTILINE)
    return dict(flags)


def test_the_drivers_heap_collector_jit_and_native_trim_are_what_the_options_say(
    tmp_path: Path,
) -> None:
    settings = PipelineSettings(data_dir=tmp_path, lake=tmp_path / "lake", driver_memory="64m")
    flags = final_flags(driver_java_options(settings))
    assert flags["InitialHeapSize"] == str(64 * 2**20)
    assert flags["AlwaysPreTouch"] == "true"
    assert flags["UseParallelGC"] == "true"
    assert flags["UseG1GC"] == "false"
    assert float(flags["CompileThresholdScaling"]) == 3.0
    assert flags["ReservedCodeCacheSize"] == str(150 * 2**20)
    # JDK 17.0.9+ and 21.0.1+ know it (this machine's 17.0.15 does); older ones ignore it.
    assert flags["TrimNativeHeapInterval"] == "5000"


def test_without_the_options_the_jvm_keeps_its_own_defaults() -> None:
    flags = final_flags([])  # the test above would pass if the options changed nothing
    assert flags["ReservedCodeCacheSize"] != str(150 * 2**20)
    assert flags["AlwaysPreTouch"] == "false"
    assert flags["UseG1GC"] == "true"  # the JVM's own choice here (2 cores, 24 GB)
    assert float(flags["CompileThresholdScaling"]) == 1.0
