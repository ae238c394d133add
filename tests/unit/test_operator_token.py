"""The operator token an edge makes in its data dir when none is configured (issue 9)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from test_connection import FakeJournal

from broker_edge.broker import Broker
from broker_edge.settings import EdgeSettings
from broker_edge.tenants import OPERATOR_TENANT, TenantsConfig
from schemas import operator_token
from schemas.names import DEFAULT_TENANT
from schemas.operator_token import OperatorTokenError


def test_made_once_private_and_kept(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"  # not there yet: made
    token = operator_token.ensure(data_dir)
    path = operator_token.token_path(data_dir)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(token) >= 43  # 32 random bytes, URL-safe base64
    assert operator_token.ensure(data_dir) == token == operator_token.read(data_dir)
    assert [p.name for p in data_dir.iterdir()] == ["operator.token"]  # no temp file left


def test_another_edge_made_it_first(tmp_path: Path) -> None:
    path = operator_token.token_path(tmp_path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"theirs\n")
    os.close(fd)
    assert operator_token.ensure(tmp_path) == "theirs"


def test_no_file_is_none(tmp_path: Path) -> None:
    assert operator_token.read(tmp_path) is None


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_file_others_may_read_or_change_is_refused(tmp_path: Path, mode: int) -> None:
    operator_token.ensure(tmp_path)
    os.chmod(operator_token.token_path(tmp_path), mode)
    with pytest.raises(OperatorTokenError, match=f"mode {mode:04o}"):
        operator_token.ensure(tmp_path)


def test_an_empty_file_or_a_symlink_is_refused(tmp_path: Path) -> None:
    path = operator_token.token_path(tmp_path)
    path.touch(mode=0o600)
    with pytest.raises(OperatorTokenError, match="no usable token"):
        operator_token.read(tmp_path)
    path.unlink()
    (tmp_path / "elsewhere").write_text("x")
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OperatorTokenError, match="cannot read"):
        operator_token.read(tmp_path)


@pytest.mark.parametrize("config", [None, TenantsConfig(None, {})])
def test_the_local_token_is_the_operators_and_nothing_else_changes(
    config: TenantsConfig | None,
) -> None:
    broker = Broker(
        EdgeSettings(node_id="unit"), FakeJournal(), tenants=config, local_operator_token="s3cret"
    )
    grant = broker.tenancy.grant("s3cret")
    assert grant is not None
    assert grant.operator
    assert grant.tenant == OPERATOR_TENANT
    for other in ("s3creT", "", None):
        got = broker.tenancy.grant(other)
        if config is None:  # anonymous: any other name is the anonymous tenant, never operator
            assert got is not None
            assert not got.operator
            assert got.tenant == DEFAULT_TENANT
        else:
            assert got is None
