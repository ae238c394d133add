"""Where the lake lives: a local directory, or a prefix in an S3 bucket (or an S3-compatible one).

A lake location is a :class:`pathlib.Path` or an :class:`ObjectPath` (``s3://bucket/prefix``,
``s3a://`` taken as the same). An ``ObjectPath`` carries its :class:`StorageOptions`, so every
table path made from it (``lake / "logs"``) knows how to reach the bucket, and the two engines
are told the same thing in their own words:

- Spark's Delta writes through Hadoop's S3A file system (``org.apache.hadoop:hadoop-aws``, put
  into ``.venv/delta-jars`` at set-up): :func:`spark_uri` gives the ``s3a://`` URI and
  :meth:`StorageOptions.hadoop` the per-bucket ``fs.s3a.bucket.{bucket}.*`` settings;
- delta-rs reads with :meth:`StorageOptions.delta_rs` (object_store's ``AWS_*`` keys).

The options come from a settings file's ``[lake]`` table, else from the standard AWS
environment variables, else the engines' defaults. Secrets belong in the environment (or a
settings file that is not in ``conf/``); ``repr`` never shows them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from sinks.errors import SinkError

if TYPE_CHECKING:  # the light readers import this module; deltalake waits until it is used
    from deltalake import DeltaTable

# The schemes an object-store lake may have; s3a is Hadoop's name for the same store.
SCHEMES = ("s3", "s3a")


class StorageError(SinkError):
    """A lake location or its storage options are unusable; the message names which and why."""


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """How to reach an S3 (or S3-compatible) bucket. Empty: the engine's own default.

    Each field is a key of the ``[lake]`` settings table; the environment variable in
    :data:`ENVIRONMENT` fills a key the table leaves out.
    """

    endpoint_url: str = ""
    region: str = ""
    access_key_id: str = field(default="", repr=False)
    secret_access_key: str = field(default="", repr=False)
    session_token: str = field(default="", repr=False)
    # Plain http (an S3-compatible server on a private network); https otherwise.
    allow_http: bool = False
    # Path-style requests (http://host/bucket/key): what S3-compatible servers (MinIO, moto,
    # Ceph) answer; AWS itself takes both.
    path_style: bool = True

    def __post_init__(self) -> None:
        if self.endpoint_url:
            url = urlparse(self.endpoint_url)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise StorageError(
                    f"lake.endpoint_url: must be an http:// or https:// URL, "
                    f"got {self.endpoint_url!r}"
                )
            if url.scheme == "http" and not self.allow_http:
                # An http endpoint names plain http: say so to both engines.
                object.__setattr__(self, "allow_http", True)
        if bool(self.access_key_id) != bool(self.secret_access_key):
            given, missing = (
                ("access_key_id", "secret_access_key")
                if self.access_key_id
                else ("secret_access_key", "access_key_id")
            )
            raise StorageError(
                f"lake.{given} (or {ENVIRONMENT[given]}): given without lake.{missing} "
                f"(or {ENVIRONMENT[missing]})"
            )

    @classmethod
    def from_settings(
        cls, table: Mapping[str, object], environ: Mapping[str, str] | None = None
    ) -> StorageOptions:
        """The options of a ``[lake]`` table (already type-checked), the environment filling
        in the keys it leaves out."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for key, variable in ENVIRONMENT.items():
            if key in table:
                values[key] = table[key]
            elif env.get(variable):
                values[key] = _env_value(key, variable, env[variable])
        return cls(**values)  # type: ignore[arg-type]

    def delta_rs(self) -> dict[str, str]:
        """delta-rs ``storage_options`` (object_store's keys). Reads only: delta-rs never
        writes this lake, so no locking or conditional-put choice is made here."""
        options = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": self.region,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_SESSION_TOKEN": self.session_token,
        }
        found = {key: value for key, value in options.items() if value}
        found["AWS_ALLOW_HTTP"] = str(self.allow_http).lower()
        found["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = str(not self.path_style).lower()
        return found

    def hadoop(self, bucket: str) -> dict[str, str]:
        """Hadoop S3A settings for ``bucket`` only (``fs.s3a.bucket.{bucket}.*``), so one
        session can hold lakes in buckets reached in different ways."""
        options = {
            "endpoint": self.endpoint_url,
            "endpoint.region": self.region,
            "access.key": self.access_key_id,
            "secret.key": self.secret_access_key,
            "session.token": self.session_token,
        }
        found = {key: value for key, value in options.items() if value}
        found["path.style.access"] = str(self.path_style).lower()
        found["connection.ssl.enabled"] = str(not self.allow_http).lower()
        if self.access_key_id:
            found["aws.credentials.provider"] = (
                "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
                if self.session_token
                else "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"
            )
        return {f"fs.s3a.bucket.{bucket}.{key}": value for key, value in found.items()}


# Each [lake] key and the standard AWS environment variable that fills it in.
ENVIRONMENT = {
    "endpoint_url": "AWS_ENDPOINT_URL",
    "region": "AWS_REGION",
    "access_key_id": "AWS_ACCESS_KEY_ID",
    "secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "session_token": "AWS_SESSION_TOKEN",
    "allow_http": "AWS_ALLOW_HTTP",
    "path_style": "EDGEBUS_S3_PATH_STYLE",
}
assert set(ENVIRONMENT) == {f.name for f in fields(StorageOptions)}


def _env_value(key: str, variable: str, text: str) -> object:
    if key not in ("allow_http", "path_style"):
        return text
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise StorageError(f"{variable}: must be true or false, got {text!r}")


@dataclass(frozen=True, slots=True)
class ObjectPath:
    """``s3://bucket/key`` with the options that reach its bucket; ``/`` goes down a level."""

    bucket: str
    key: str
    options: StorageOptions = field(default_factory=StorageOptions, compare=False)

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(self.bucket, str(PurePosixPath(self.key, name)), self.options)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}".rstrip("/")

    @property
    def name(self) -> str:
        return PurePosixPath(self.key).name

    @property
    def parent(self) -> ObjectPath:
        parent = str(PurePosixPath(self.key).parent)
        return ObjectPath(self.bucket, "" if parent == "." else parent, self.options)


LakePath = Path | ObjectPath


def lake_path(text: str | Path, options: StorageOptions | None = None) -> LakePath:
    """The lake location ``text`` names: an ``s3://bucket/prefix`` URI (reached with
    ``options``, by default the environment's) or a local directory."""
    if isinstance(text, Path) or "://" not in text:
        return Path(text)
    url = urlparse(text)
    if url.scheme not in SCHEMES:
        raise StorageError(
            f"lake: {text!r}: unsupported scheme {url.scheme!r} "
            f"(a local directory, or s3://bucket/prefix)"
        )
    if not url.netloc:
        raise StorageError(f"lake: {text!r}: no bucket (s3://bucket/prefix)")
    if url.query or url.fragment:
        raise StorageError(f"lake: {text!r}: a lake URI has no ?query or #fragment")
    found = options if options is not None else StorageOptions.from_settings({})
    return ObjectPath(url.netloc, url.path.strip("/"), found)


def spark_uri(path: LakePath | str) -> str:
    """``path`` as Spark's file systems name it (``s3a://`` for an object store)."""
    if isinstance(path, ObjectPath):
        return f"s3a://{path.bucket}/{path.key}".rstrip("/")
    return str(path)


def delta_rs_options(path: LakePath | str) -> dict[str, str] | None:
    """delta-rs ``storage_options`` for ``path`` (None: a local path)."""
    return path.options.delta_rs() if isinstance(path, ObjectPath) else None


def hadoop_options(path: LakePath) -> dict[str, str]:
    """The Hadoop settings Spark needs to reach ``path`` (none for a local path)."""
    return path.options.hadoop(path.bucket) if isinstance(path, ObjectPath) else {}


def open_delta(path: LakePath | str, version: int | None = None) -> DeltaTable:
    """The Delta table at ``path`` through delta-rs, with the storage options it needs."""
    from deltalake import DeltaTable

    return DeltaTable(str(path), version=version, storage_options=delta_rs_options(path))


def is_delta_table(path: LakePath | str) -> bool:
    """Whether ``path`` holds a Delta table. An unreachable bucket raises ``OSError``."""
    from deltalake import DeltaTable

    found: bool = DeltaTable.is_deltatable(str(path), storage_options=delta_rs_options(path))
    return found


def one_line(exc: BaseException) -> str:
    """An object store's error (object_store's indented chain of causes) on one line."""
    text = str(exc)
    # The server's XML error body: its code and message say it, the rest is request ids.
    body = _XML_ERROR.search(text)
    if body is not None:
        text = text[: body.start()] + f"{body['code']}: {body['message']}"
    parts = [_ANSI.sub("", part).strip().lstrip("↳").strip() for part in text.splitlines()]
    return "; ".join(part for part in parts if part)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_XML_ERROR = re.compile(
    r"<\?xml.*?<Code>(?P<code>[^<]*)</Code>\s*<Message>(?P<message>[^<]*)</Message>.*", re.DOTALL
)


def check_reachable(lake: LakePath) -> None:
    """For a lake in a bucket: :class:`StorageError` (one line) unless the bucket answers
    (it exists, and the credentials may list it). A local lake is not checked here."""
    if not isinstance(lake, ObjectPath):
        return
    try:
        is_delta_table(lake / "_delta_log_probe")
    except OSError as exc:
        raise StorageError(f"cannot reach the lake {lake}: {one_line(exc)}") from exc
