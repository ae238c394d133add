"""The set-up script refuses a machine without Java 17+, or, for the tests, without Node.js 18+
and npm (the MQTT.js tests), with a clear message, before installing; running the platform
needs no Node.js."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bootstrap(
    java: str = "java", node: str = "node", setup_for: str = "tests"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EDGEBUS_JAVA": java, "EDGEBUS_NODE": node, "EDGEBUS_SETUP_FOR": setup_for}
    return subprocess.run(
        ["bash", "-c", f"source {ROOT / 'scripts' / 'bootstrap.sh'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_missing_java_is_named(tmp_path: Path) -> None:
    result = _bootstrap(str(tmp_path / "no-java-here"))
    assert result.returncode == 1
    assert "Java 17+ is required for Spark: no" in result.stderr


@pytest.mark.parametrize("version", ['openjdk version "11.0.22" 2024-01-16', "garbage"])
def test_old_java_is_refused(tmp_path: Path, version: str) -> None:
    fake = tmp_path / "java"
    fake.write_text(f"#!/bin/sh\necho '{version}' >&2\n")
    fake.chmod(0o755)
    result = _bootstrap(str(fake))
    assert result.returncode == 1
    assert "Java 17+ is required for Spark; found:" in result.stderr


def test_missing_node_is_named(tmp_path: Path) -> None:
    result = _bootstrap(node=str(tmp_path / "no-node-here"))
    assert result.returncode == 1
    assert "Node.js 18+ and npm are required for the MQTT.js tests: no" in result.stderr


def test_old_node_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "node"
    fake.write_text("#!/bin/sh\necho v16.20.2\n")
    fake.chmod(0o755)
    result = _bootstrap(node=str(fake))
    assert result.returncode == 1
    assert "Node.js 18+ is required for the MQTT.js tests; found: v16.20.2" in result.stderr


def test_running_the_platform_needs_no_node(tmp_path: Path) -> None:
    # scripts/run.sh: Node.js is the tests' (MQTT.js), not the platform's.
    result = _bootstrap(node=str(tmp_path / "no-node-here"), setup_for="")
    assert result.returncode == 0, result.stderr
    assert "Node.js" not in result.stderr
