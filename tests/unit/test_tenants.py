"""The tenants file: tokens to tenants, ACLs, limits, and clear errors naming the key."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from broker_edge.errors import ConfigError
from broker_edge.tenants import OPERATOR_TENANT, Acl, load, parse

GOOD = """
[operator]
token = "op"

[tenants.acme]
tokens = ["a1", "a2"]
logs_retention_days = 90
messages_retention_days = 0
[tenants.acme.limits]
messages_per_day = 1_000_000
bytes_per_day = 1_000_000_000
sessions = 10
messages_per_second = 2.5
max_payload_bytes = 1024
[tenants.acme.acl.a2]
publish = ["fleet/+/telemetry"]
subscribe = ["fleet/#", "$log/#"]

[tenants.globex]
tokens = ["g1"]
"""


def test_tokens_map_to_tenants_and_acls(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    config = load(path)
    assert config.grant("a1").tenant == "acme"  # type: ignore[union-attr]
    assert config.grant("g1").tenant == "globex"  # type: ignore[union-attr]
    operator = config.grant("op")
    assert operator is not None
    assert (operator.tenant, operator.operator) == (OPERATOR_TENANT, True)
    assert config.grant("nope") is None
    assert config.grant(None) is None
    limits = config.limits("acme")
    assert (limits.sessions, limits.messages_per_second, limits.max_payload_bytes) == (
        10,
        2.5,
        1024,
    )
    assert config.limits("globex").sessions is None
    assert config.tenants["acme"].retention_days == {"logs": 90, "messages": 0}
    assert config.tenants["globex"].retention_days == {}  # the pipeline's defaults
    acl = config.grant("a2").acl  # type: ignore[union-attr]
    assert acl.may_publish("fleet/v1/telemetry")
    assert not acl.may_publish("fleet/v1/status")
    assert acl.may_subscribe("fleet/v1/+")
    assert acl.may_subscribe("$log/mqtt/connect")
    assert not acl.may_subscribe("#")
    assert not acl.may_subscribe("other/#")
    assert config.grant("a1").acl.may_publish("anything/at/all")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("granted", "wanted", "covered"),
    [
        ("fleet/#", "fleet", True),
        ("fleet/#", "fleet/a/b", True),
        ("fleet/+", "fleet/#", False),
        ("fleet/+", "fleet/x", True),
        ("fleet/+", "+/x", False),
        ("#", "$log/#", False),
        ("+/x", "$SYS/x", False),
        ("$log/#", "$log/mqtt/+", True),
        ("a/b", "a/b", True),
        ("a/b", "a/b/c", False),
    ],
)
def test_subscription_coverage(granted: str, wanted: str, covered: bool) -> None:
    assert Acl(subscribe=(granted,)).may_subscribe(wanted) is covered


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tenant.x]\n", "unknown key(s) tenant"),
        ("[tenants.acme]\ntokens = []\n", "tenants.acme.tokens: must be a non-empty list"),
        ("[tenants.acme]\ntokens = ['t']\nlimit = 1\n", "tenants.acme: unknown key(s) limit"),
        (
            "[tenants.acme]\ntokens = ['t']\n[tenants.acme.limits]\nsessions = -1\n",
            "tenants.acme.limits.sessions",
        ),
        (
            "[tenants.acme]\ntokens = ['t']\n[tenants.acme.limits]\nmessages = 1\n",
            "tenants.acme.limits: unknown key(s) messages",
        ),
        (
            "[tenants.acme]\ntokens = ['t']\n[tenants.acme.acl.u]\npublish = ['a']\n",
            "tenants.acme.acl.u: not one of this tenant's tokens",
        ),
        (
            "[tenants.acme]\ntokens = ['t']\n[tenants.acme.acl.t]\npublish = ['a/#/b']\n",
            "tenants.acme.acl.t.publish",
        ),
        (
            "[tenants.a]\ntokens = ['t']\n[tenants.b]\ntokens = ['t']\n",
            "tenants.b.tokens: token also used by tenants.a",
        ),
        ("[tenants.'$x']\ntokens = ['t']\n", "may not be empty, start with '$'"),
        ("[operator]\ntoken = 3\n", "operator.token: a token must be a non-empty string"),
        (
            "[tenants.acme]\ntokens = ['t']\nlogs_retention_days = -3\n",
            "tenants.acme.logs_retention_days: must be a whole number of days >= 0",
        ),
        (
            "[tenants.acme]\ntokens = ['t']\nmessages_retention_days = '30d'\n",
            "tenants.acme.messages_retention_days: must be a whole number of days >= 0",
        ),
    ],
)
def test_bad_files_name_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(tomllib.loads(text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tenants file not found"):
        load(tmp_path / "none.toml")


def test_example_tenants_file_loads() -> None:
    config = load(Path(__file__).resolve().parents[2] / "conf" / "tenants.toml")
    assert set(config.tenants) == {"acme", "globex"}
    dashboard = config.grant("change-me-acme-dashboard")
    assert dashboard is not None
    assert not dashboard.acl.may_publish("fleet/v1/telemetry")
    assert dashboard.acl.may_subscribe("$quota/#")
