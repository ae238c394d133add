"""Settings files: unknown keys and bad values name the key; flags override the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgebus.settings import SettingsError, load_edge, load_pipeline
from ingest.source import DEFAULT_MAX_RECORDS_PER_BATCH
from sinks.storage import ENVIRONMENT, ObjectPath, spark_uri

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_example_files_load() -> None:
    edge = load_edge(CONF / "edge.toml", {})
    assert (edge.node_id, edge.port, edge.journal_fsync) == ("edge-1", 1883, True)
    assert edge.sys_interval == 10.0
    assert (edge.journal_max_bytes, edge.journal_min_free_bytes) == (10 * 2**30, 2**30)
    assert edge.journal_retention_hours == 24.0
    assert edge.peer_expiry_hours == 24.0
    pipe = load_pipeline(CONF / "pipeline.toml", {})
    assert pipe.journal_root == Path("data/journal")
    assert pipe.checkpoint_path("history") == Path("lake/_checkpoints/history")
    assert (pipe.logs_retention_days, pipe.messages_retention_days) == (30, 0)
    # The pipeline's batch cap and the source's own default (used without the option) agree.
    assert pipe.max_records_per_batch == DEFAULT_MAX_RECORDS_PER_BATCH == 500_000


def test_flags_override_file_and_defaults_sit_beneath(tmp_path: Path) -> None:
    edge = load_edge(CONF / "edge.toml", {"port": 0, "node_id": None}, {"node_id": "host"})
    assert (edge.port, edge.node_id) == (0, "edge-1")
    assert load_edge(None, {}, {"node_id": "host"}).node_id == "host"
    never = tmp_path / "never.toml"
    never.write_text("[edge]\npeer_expiry_hours = 0\n")  # an integer is a number of hours
    assert load_edge(never, {}).peer_expiry_hours == 0.0


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
        ("[edge]\npeers = 'h:1'\n", "edge.peers: must be a list of strings"),
        ("[edge]\npeers = ['h']\n", "edge.peers: expected HOST:PORT"),
        ("[edge]\npeers = ['h:0']\n", "edge.peers: expected HOST:PORT (port 1..65535)"),
        ("[edge]\npeers = ['h:1', 'h:1']\n", "edge.peers: lists a peer twice"),
        ("[edge]\nmesh_token = 'short'\n", "edge.mesh_token: must be at least 16"),
        ("[edge]\nmesh_token = 7\n", "edge.mesh_token: must be a string"),
        ("[edge]\npeer_expiry_hours = -1\n", "edge.peer_expiry_hours: must be a number of hours"),
        ("[edge]\npeer_expiry_hours = nan\n", "edge.peer_expiry_hours: must be a number of hours"),
        ("[edge]\npeer_expiry_hours = '24h'\n", "edge.peer_expiry_hours: must be a number"),
        ("[edge]\npeer_expiry_hours = true\n", "edge.peer_expiry_hours: must be a number"),
        (
            "[edge]\nhandshake_refusals_per_source = 0\n",
            "edge.handshake_refusals_per_source: must be >= 1",
        ),
        (
            "[edge]\nhandshake_refusals_per_listener = -1\n",
            "edge.handshake_refusals_per_listener: must be",
        ),
        (
            "[edge]\nhandshake_refusal_interval = 0\n",
            "edge.handshake_refusal_interval: must be a number",
        ),
        (
            "[edge]\nhandshake_refusal_interval = inf\n",
            "edge.handshake_refusal_interval: must be a number",
        ),
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
        ("[pipeline]\nothers_interval_seconds = -1\n", "pipeline.others_interval_seconds: must"),
        (
            "[pipeline]\ndelta_log_retention_hours = 0.01\n",
            "pipeline.delta_log_retention_hours: must be at least a minute",
        ),
        ("[pipeline]\nlake = 3\n", "pipeline.lake: must be a non-empty path"),
        ("[pipeline]\nedges = 'h:1'\n", "pipeline.edges: must be a list of strings"),
        ("[pipeline]\nedges = ['h']\n", 'pipeline.edges: each edge is "HOST:PORT"'),
        ("[pipeline]\nedges = ['h:1', 'h:1']\n", "pipeline.edges: an edge is listed twice"),
        ("[pipeline]\ndriver_memory = '2gb'\n", "pipeline.driver_memory: must be a whole number"),
        (
            "[pipeline]\nlogs_retention_days = -1\n",
            r"pipeline.logs_retention_days: must be a whole",
        ),
        ("[pipeline]\nmessages_retention_days = 1.5\n", "pipeline.messages_retention_days: must "),
        ("[pipeline]\nlake = 'gs://b/lake'\n", "lake: 'gs://b/lake': unsupported scheme 'gs'"),
        ("[pipeline]\nlake = 's3:///lake'\n", "lake: 's3:///lake': no bucket"),
        ("[lake]\nendpoint = 'http://127.0.0.1:9000'\n", r"lake.endpoint: unknown key \(known:"),
        ("[lake]\nallow_http = 'yes'\n", "lake.allow_http: must be true or false"),
        (
            "[pipeline]\nlake = 's3://b/lake'\n[lake]\nendpoint_url = '127.0.0.1:9000'\n",
            "lake.endpoint_url: must be an http:// or https:// URL",
        ),
        (
            "[pipeline]\nlake = 's3://b/lake'\n[lake]\naccess_key_id = 'AKIA'\n",
            r"lake.access_key_id \(or AWS_ACCESS_KEY_ID\): given without "
            r"lake.secret_access_key \(or AWS_SECRET_ACCESS_KEY\)",
        ),
    ],
)
def test_bad_pipeline_settings_name_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, message: str
) -> None:
    for variable in ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_pipeline(path, {})


def test_edges_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[pipeline]\nedges = ['10.0.0.7:8080', 'edge-b.local:8080']\n")
    assert load_pipeline(path, {}).edges == ("10.0.0.7:8080", "edge-b.local:8080")


def test_a_lake_in_a_bucket_takes_the_lake_table_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-env")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-from-env")
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    path = tmp_path / "pipeline.toml"
    path.write_text(
        "[pipeline]\ndata_dir = 'data'\n[lake]\nendpoint_url = 'http://127.0.0.1:9000'\n"
        "region = 'eu-central-1'\n"
    )
    settings = load_pipeline(path, {"lake": "s3a://lake-bucket/prod/lake/"})
    lake = settings.lake
    assert isinstance(lake, ObjectPath)
    assert str(lake) == "s3://lake-bucket/prod/lake"
    assert str(settings.table_path("logs")) == "s3://lake-bucket/prod/lake/logs"
    assert spark_uri(settings.table_path("logs")) == "s3a://lake-bucket/prod/lake/logs"
    assert lake.options.delta_rs() == {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_REGION": "eu-central-1",  # the file's, over the environment's
        "AWS_ACCESS_KEY_ID": "from-env",
        "AWS_SECRET_ACCESS_KEY": "secret-from-env",
        "AWS_ALLOW_HTTP": "true",  # an http:// endpoint
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
    }
    hadoop = lake.options.hadoop("lake-bucket")
    assert hadoop["fs.s3a.bucket.lake-bucket.endpoint"] == "http://127.0.0.1:9000"
    assert hadoop["fs.s3a.bucket.lake-bucket.path.style.access"] == "true"
    assert hadoop["fs.s3a.bucket.lake-bucket.connection.ssl.enabled"] == "false"
    assert "secret-from-env" not in repr(settings)
    # The checkpoint stays on this machine, one directory per bucket and prefix.
    assert settings.checkpoint_path("journal") == Path(
        "data/checkpoints/lake-bucket/prod/lake/journal"
    )


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="settings file not found"):
        load_edge(tmp_path / "nope.toml", {})
