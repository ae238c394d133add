"""Settings files: unknown keys and bad values name the key; flags override the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgebus.settings import SettingsError, load_edge, load_pipeline

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_example_files_load() -> None:
    edge = load_edge(CONF / "edge.toml", {})
    assert (edge.node_id, edge.port, edge.journal_fsync) == ("edge-1", 1883, True)
    assert edge.sys_interval == 10.0
    assert (edge.journal_max_bytes, edge.journal_min_free_bytes) == (10 * 2**30, 2**30)
    assert edge.journal_retention_hours == 24.0
    pipe = load_pipeline(CONF / "pipeline.toml", {})
    assert pipe.journal_root == Path("data/journal")
    assert pipe.checkpoint_path("history") == Path("lake/_checkpoints/history")


def test_flags_override_file_and_defaults_sit_beneath(tmp_path: Path) -> None:
    edge = load_edge(CONF / "edge.toml", {"port": 0, "node_id": None}, {"node_id": "host"})
    assert (edge.port, edge.node_id) == (0, "edge-1")
    assert load_edge(None, {}, {"node_id": "host"}).node_id == "host"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[edge]\nprot = 1\n", "edge.prot: unknown key"),
        ("[edge]\nport = 'x'\n", "edge.port: must be an integer"),
        ("[edge]\nport = 70000\n", "edge.port: must be 0..65535"),
        ("[edge]\njournal_fsync = 1\n", "edge.journal_fsync: must be true or false"),
        ("[edge]\nnode_id = 'a/b'\n", "edge.node_id"),
        ("[edge]\nsys_interval = -1\n", "edge.sys_interval: must be a number of seconds >= 0"),
        ("[edge]\nsys_interval = nan\n", "edge.sys_interval: must be a number of seconds >= 0"),
        ("[edge]\nsys_interval = '10'\n", "edge.sys_interval: must be a number"),
        ("[edge]\njournal_max_bytes = -1\n", "edge.journal_max_bytes: must be >= 0"),
        ("[edge]\njournal_min_free_bytes = 1.5\n", "edge.journal_min_free_bytes: must be an"),
        (
            "[edge]\njournal_retention_hours = -2\n",
            "edge.journal_retention_hours: must be a number of hours >= 0",
        ),
        ("[edge]\nhttp_listen = '8080'\n", "edge.http_listen: expected HOST:PORT"),
        ("[edge]\nhttp_listen = 'h:70000'\n", "edge.http_listen: expected HOST:PORT"),
        ("[edge]\nhttp_max_records = 0\n", "edge.http_max_records: must be >= 1"),
        ("[edges]\n", "unknown table(s) edges"),
        ("[edge\n", "not valid TOML"),
    ],
)
def test_bad_edge_settings_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_edge(path, {})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[pipeline]\nmax_records_per_batch = 0\n", "pipeline.max_records_per_batch"),
        ("[pipeline]\ntrigger_interval_seconds = -1\n", "pipeline.trigger_interval_seconds"),
        ("[pipeline]\nlake = 3\n", "pipeline.lake: must be a non-empty path"),
        ("[pipeline]\nedges = 'h:1'\n", "pipeline.edges: must be a list of strings"),
        ("[pipeline]\nedges = ['h']\n", 'pipeline.edges: each edge is "HOST:PORT"'),
        ("[pipeline]\nedges = ['h:1', 'h:1']\n", "pipeline.edges: an edge is listed twice"),
    ],
)
def test_bad_pipeline_settings_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_pipeline(path, {})


def test_edges_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[pipeline]\nedges = ['10.0.0.7:8080', 'edge-b.local:8080']\n")
    assert load_pipeline(path, {}).edges == ("10.0.0.7:8080", "edge-b.local:8080")


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="settings file not found"):
        load_edge(tmp_path / "nope.toml", {})
