"""The TLS and WebSocket listener settings (issue 13): a bad one names the key and the problem,
from a settings file and from the command line, before any port opens."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from bench.certs import Certs, make_certs
from broker_edge.errors import ConfigError
from broker_edge.settings import EdgeSettings
from broker_edge.tls import server_context
from edgebus import cli
from edgebus.settings import SettingsError, load_edge


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _tls(certs: Certs, **more: str) -> EdgeSettings:
    values = {
        "listen_tls": "127.0.0.1:8883",
        "tls_cert": str(certs.server_cert),
        "tls_key": str(certs.server_key),
        **more,
    }
    return EdgeSettings(**values)  # type: ignore[arg-type]


def test_listeners_by_kind() -> None:
    settings = EdgeSettings(
        listen_ws="0.0.0.0:8080", listen_tls="[::1]:0", tls_cert="c", tls_key="k"
    )
    assert settings.listeners == {
        "mqtt": ("127.0.0.1", 1883),
        "tls": ("::1", 0),
        "ws": ("0.0.0.0", 8080),
    }
    assert server_context(EdgeSettings(listen_ws="127.0.0.1:0")) is None  # no TLS listener


def test_a_good_context_is_tls_1_2_and_up_and_verifies_clients_with_a_cafile(
    certs: Certs,
) -> None:
    context = server_context(_tls(certs))
    assert context is not None
    assert context.minimum_version is ssl.TLSVersion.TLSv1_2
    assert context.verify_mode is ssl.CERT_NONE
    strict = server_context(_tls(certs, tls_cafile=str(certs.ca)))
    assert strict is not None
    assert strict.verify_mode is ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"listen_tls": "8883"}, "edge.listen_tls: expected HOST:PORT"),
        ({"listen_ws": "host:99999"}, "edge.listen_ws: expected HOST:PORT"),
        ({"listen_wss": "127.0.0.1:0"}, "edge.tls_cert: needed by listen_tls and listen_wss"),
        ({"listen_tls": "127.0.0.1:0", "tls_cert": "c"}, "edge.tls_key: needed by"),
        ({"tls_cafile": "ca.pem"}, "edge.tls_cafile: set but no TLS listener uses it"),
    ],
)
def test_bad_listener_settings_name_the_key(values: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EdgeSettings(**values)  # type: ignore[arg-type]


def test_bad_files_name_the_key_and_the_problem(certs: Certs, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    cases = {
        "edge.tls_cert: cannot read .*nope.pem: No such file": {"tls_cert": missing},
        "edge.tls_key: cannot read": {"tls_key": missing},
        "edge.tls_cafile: cannot read": {"tls_cafile": missing},
        "edge.tls_cert: .* is not a PEM certificate": {"tls_cert": str(certs.server_key)},
        "edge.tls_key: .*client_key.pem is not the private key of the certificate": {
            "tls_key": str(certs.client_key)
        },
        "edge.tls_key: .* is not an unencrypted PEM private key": {
            "tls_key": str(certs.server_cert)
        },
        "edge.tls_cafile: .* is not a PEM bundle": {"tls_cafile": str(certs.server_key)},
    }
    for message, values in cases.items():
        with pytest.raises(ConfigError, match=message):
            server_context(_tls(certs, **values))


def test_keys_from_a_settings_file(certs: Certs, tmp_path: Path) -> None:
    config = tmp_path / "edge.toml"
    config.write_text(
        f'[edge]\nlisten_wss = "127.0.0.1:0"\ntls_cert = "{certs.server_cert}"\n'
        f'tls_key = "{certs.server_key}"\ntls_cafile = "{certs.ca}"\n'
    )
    settings = load_edge(config, {})
    assert settings.listeners["wss"] == ("127.0.0.1", 0)
    assert settings.tls_cafile == str(certs.ca)
    config.write_text("[edge]\nlisten_ws = 8080\n")
    with pytest.raises(SettingsError, match=r"edge\.listen_ws: must be a string"):
        load_edge(config, {})


def test_the_edge_command_refuses_a_key_that_does_not_match(
    certs: Certs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "edge",
        *("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--loop", "asyncio"),
        *("--listen-tls", "127.0.0.1:0", "--cert", str(certs.server_cert)),
        *("--key", str(certs.rogue_key)),
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "edgebus: bad settings: edge.tls_key: " in err
    assert "is not the private key of the certificate" in err
    assert not (tmp_path / "data").exists()  # refused before anything opened
    assert cli.main(argv[:-4]) == 2  # --listen-tls without --cert and --key
    assert "edge.tls_cert: needed by listen_tls and listen_wss" in capsys.readouterr().err
