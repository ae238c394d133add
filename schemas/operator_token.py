"""The operator token an edge makes for itself when none is configured (issue 9's retention).

The pipeline tells the edges how far the lake holds their journals with retained notices on
``$control/journal/{node}``, and only the operator may publish ``$control/...``. Without a
tenants file (the embedded default: every client anonymous) nobody held the operator token, so
no notice could be sent and journals were never trimmed. Now an edge with no ``[operator]``
token makes one, once: 32 random bytes (``secrets.token_urlsafe``), in ``DATA_DIR/operator.token``
with mode 0600. The pipeline reads the local journals from that same data dir and reads the
token from it too. Whoever can read the file could read the journals anyway; anonymous
clients cannot guess it, so they still may not publish ``$control/...``.

The file is kept across restarts (a running pipeline keeps working when its edge restarts),
created atomically (several edges sharing a data dir agree on one token), and refused when
others than its owner may read or write it, as ssh does with a private key. Delete it, with
the edges and the pipeline stopped, to make a new one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

TOKEN_FILE = "operator.token"  # noqa: S105 (the file's name, not a secret)


class OperatorTokenError(Exception):
    """The token file cannot be used (unsafe permissions, empty, unreadable)."""


def token_path(data_dir: Path) -> Path:
    return data_dir / TOKEN_FILE


def read(data_dir: Path) -> str | None:
    """The token in ``data_dir``; None when there is no token file."""
    path = token_path(data_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OperatorTokenError(f"{path}: cannot read the operator token: {exc}") from exc
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OperatorTokenError(f"{path}: not a regular file")
        if info.st_mode & 0o077:
            raise OperatorTokenError(
                f"{path}: mode {stat.S_IMODE(info.st_mode):04o} lets others read or change the "
                "operator token: chmod 600 it (or delete it to make a new one)"
            )
        if info.st_uid != os.geteuid():
            raise OperatorTokenError(f"{path}: owned by uid {info.st_uid}, not by this user")
        token = fh.read().decode("ascii", errors="replace").strip()
    if not token or not token.isprintable():
        raise OperatorTokenError(f"{path}: no usable token in it (delete it to make a new one)")
    return token


def ensure(data_dir: Path) -> str:
    """The token in ``data_dir``, made there first if there is none."""
    token = read(data_dir)
    if token is not None:
        return token
    data_dir.mkdir(parents=True, exist_ok=True)
    path = token_path(data_dir)
    temp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_urlsafe(32).encode("ascii") + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        # link() never replaces: if another edge on this data dir made one first, use its.
        with contextlib.suppress(FileExistsError):
            os.link(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    token = read(data_dir)
    if token is None:
        raise OperatorTokenError(f"{path}: made, then gone")
    return token
