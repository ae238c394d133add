"""The command line refuses bad input with a clear message and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgebus import cli

EDGEBUS = [sys.executable, "-m", "edgebus.cli"]


def edgebus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EDGEBUS, *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("command", ["edge", "pipeline"])
def test_bad_tenants_file_is_refused(tmp_path: Path, command: str) -> None:
    bad = tmp_path / "tenants.toml"
    bad.write_text("[tenants.acme]\ntokens = []\n")
    args = [command, "--data-dir", str(tmp_path), "--tenants", str(bad)]
    if command == "edge":
        args += ["--listen", "127.0.0.1:0"]
    else:
        args += ["--lake", str(tmp_path / "lake"), "--once"]
    result = edgebus(*args)
    assert result.returncode == 2
    assert "tenants.acme.tokens: must be a non-empty list" in result.stderr


def test_bad_settings_name_the_key(tmp_path: Path) -> None:
    config = tmp_path / "edge.toml"
    config.write_text("[edge]\nport = 'x'\n")
    result = edgebus("edge", "--config", str(config))
    assert result.returncode == 2
    assert "edge.port: must be an integer" in result.stderr


def test_peers_are_named_and_need_a_token(tmp_path: Path) -> None:
    result = edgebus("edge", "--listen", "127.0.0.1:0", "--peer", "10.0.0.7:0")
    assert result.returncode == 2
    assert "expected HOST:PORT" in result.stderr
    result = edgebus(
        *("edge", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path)),
        *("--peer", "127.0.0.1:1"),
    )
    assert result.returncode == 2
    assert "edge.peers: links authenticate with the tenants file's operator token" in (
        result.stderr
    )
    assert not (tmp_path / "journal").exists()  # refused before the journal was opened
    result = edgebus(  # `edgebus run` gives its edge the peers
        *("run", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path)),
        *("--lake", str(tmp_path / "lake"), "--peer", "127.0.0.1:1"),
    )
    assert result.returncode != 0
    assert "edge.peers: links authenticate" in result.stderr


def test_the_journal_over_http_without_a_token_is_refused_off_loopback(tmp_path: Path) -> None:
    result = edgebus(
        *("edge", "--listen", "127.0.0.1:0", "--http", "0.0.0.0:0", "--data-dir", str(tmp_path))
    )
    assert result.returncode == 2
    assert "edge.http_listen: serving the journal on 0.0.0.0 needs an operator token" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "journal").exists()  # refused before the journal was opened


def test_a_bad_edge_address_is_named(tmp_path: Path) -> None:
    result = edgebus(
        *("pipeline", "--data-dir", str(tmp_path), "--lake", str(tmp_path / "lake")),
        *("--edge", "10.0.0.7:0", "--once"),
    )
    assert result.returncode == 2
    assert '--edge: pipeline.edges: each edge is "HOST:PORT" (port 1..65535)' in result.stderr


@pytest.mark.parametrize("brokers", [[], ["--broker", "127.0.0.1:1883"]])
def test_pipeline_tenants_without_operator_token_is_refused(
    tmp_path: Path, brokers: list[str]
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.acme]\ntokens = ["acme-1"]\n')
    result = edgebus(
        *("pipeline", "--data-dir", str(tmp_path), "--lake", str(tmp_path / "lake")),
        *("--tenants", str(tenants), "--once", *brokers),
    )
    assert result.returncode == 2
    assert "the quota step needs an [operator] token" in result.stderr
    assert "Traceback" not in result.stderr


def test_pipeline_without_delta_jars_says_what_is_missing(tmp_path: Path) -> None:
    empty = tmp_path / "no-jars"
    empty.mkdir()
    result = subprocess.run(
        [*EDGEBUS, "pipeline", "--data-dir", str(tmp_path), "--lake", str(tmp_path / "lake")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "EDGEBUS_DELTA_JARS": str(empty)},
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "io.delta:delta-spark_" in lines[0]
    assert "scripts/bootstrap.sh" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["logs", "--lake", "x", "--tenant", "t"], "logs"),
        (["--log-level", "DEBUG", "sql", "SELECT 1"], "sql"),
        (["--log-level=DEBUG", "usage"], "usage"),
        (["edge", "--listen", "127.0.0.1:0"], "edge"),
        (["-h", "logs"], None),  # an option before the command: the whole parser
        ([], None),
    ],
)
def test_the_command_word_is_found_before_parsing(argv: list[str], command: str | None) -> None:
    assert cli._command_in(argv) == command


def test_a_lake_command_parses_alone_and_help_still_lists_every_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = cli._parse(["--log-level", "WARNING", "logs", "--tenant", "acme", "--count"])
    assert (args.command, args.tenant, args.count, args.log_level) == (
        "logs",
        "acme",
        True,
        "WARNING",
    )
    with pytest.raises(SystemExit) as exited:
        cli._parse(["--help"])
    assert exited.value.code == 0
    listed = capsys.readouterr().out
    for command in ("edge", "pipeline", "run", "maintain", "api", *cli.LAKE_COMMANDS):
        assert command in listed
