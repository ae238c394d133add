"""The command line refuses bad input with a clear message and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EDGEBUS = [sys.executable, "-m", "edgebus.cli"]


@pytest.mark.parametrize("command", ["edge", "pipeline"])
def test_bad_tenants_file_is_refused(tmp_path: Path, command: str) -> None:
    bad = tmp_path / "tenants.toml"
    bad.write_text("[tenants.acme]\ntokens = []\n")
    args = [*EDGEBUS, command, "--data-dir", str(tmp_path), "--tenants", str(bad)]
    if command == "edge":
        args += ["--listen", "127.0.0.1:0"]
    else:
        args += ["--lake", str(tmp_path / "lake"), "--once"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "tenants.acme.tokens: must be a non-empty list" in result.stderr


def test_bad_settings_name_the_key(tmp_path: Path) -> None:
    config = tmp_path / "edge.toml"
    config.write_text("[edge]\nport = 'x'\n")
    result = subprocess.run(
        [*EDGEBUS, "edge", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "edge.port: must be an integer" in result.stderr
