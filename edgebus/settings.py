"""Load TOML settings files into the frozen, typed settings objects of each layer.

A file may hold an ``[edge]`` table and a ``[pipeline]`` table (see ``conf/``). Unknown tables,
unknown keys and values of the wrong type are rejected with a message naming the key; the
settings classes themselves reject bad values. Command-line flags override the file.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from broker_edge.errors import ConfigError
from broker_edge.settings import EdgeSettings
from sinks.storage import StorageError, StorageOptions, lake_path
from streaming.errors import PipelineConfigError
from streaming.settings import PipelineSettings


class SettingsError(Exception):
    """A settings file or flag is unreadable, unknown or has a bad value."""


SECTIONS: dict[str, type[Any]] = {
    "edge": EdgeSettings,
    "pipeline": PipelineSettings,
    # How to reach a lake in a bucket (endpoint, region, keys); the environment fills the rest.
    "lake": StorageOptions,
}

T = TypeVar("T")


def read_file(path: Path) -> dict[str, Any]:
    """Parse a settings file and check its top-level tables."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise SettingsError(f"{path}: settings file not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise SettingsError(
            f"{path}: unknown table(s) {', '.join(unknown)} (known: {', '.join(SECTIONS)})"
        )
    return data


def build(cls: type[T], section: str, values: Mapping[str, Any], overrides: Mapping[str, Any]) -> T:
    """Construct ``cls`` from a file's table plus command-line overrides (None = not given)."""
    if not isinstance(values, Mapping):
        raise SettingsError(f"{section}: must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    merged: dict[str, Any] = {}
    for key, value in values.items():
        if key not in fields:
            raise SettingsError(
                f"{section}.{key}: unknown key (known: {', '.join(sorted(fields))})"
            )
        merged[key] = value
    merged.update({k: v for k, v in overrides.items() if v is not None})
    kwargs = {key: _coerce(f"{section}.{key}", hints[key], value) for key, value in merged.items()}
    try:
        return cls(**kwargs)
    except (ConfigError, PipelineConfigError, StorageError) as exc:
        raise SettingsError(str(exc)) from exc


def _coerce(key: str, hint: Any, value: Any) -> Any:
    if hint is Path:
        if isinstance(value, str | Path) and str(value):
            return Path(value)
        raise SettingsError(f"{key}: must be a non-empty path string, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise SettingsError(f"{key}: must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SettingsError(f"{key}: must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise SettingsError(f"{key}: must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise SettingsError(f"{key}: must be a string, got {value!r}")
    if hint == tuple[str, ...]:
        if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
            return tuple(value)
        raise SettingsError(f"{key}: must be a list of strings, got {value!r}")
    if isinstance(hint, types.UnionType):
        return value
    raise SettingsError(f"{key}: unsupported setting type {hint!r}")


def load_edge(
    config: Path | None,
    overrides: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
) -> EdgeSettings:
    """``defaults`` sit beneath the file (e.g. the host name as node id), flags above it."""
    data = read_file(config) if config is not None else {}
    table = data.get("edge", {})
    if not isinstance(table, Mapping):
        raise SettingsError("edge: must be a table")
    return build(EdgeSettings, "edge", {**(defaults or {}), **table}, overrides)


def load_pipeline(config: Path | None, overrides: Mapping[str, Any]) -> PipelineSettings:
    data = read_file(config) if config is not None else {}
    table = data.get("pipeline", {})
    if not isinstance(table, Mapping):
        raise SettingsError("pipeline: must be a table")
    storage = _storage_table(data)  # checked whether or not the lake is in a bucket
    given = overrides.get("lake") or table.get("lake")
    if given is None:
        return build(PipelineSettings, "pipeline", table, overrides)
    if not isinstance(given, str | Path) or not str(given):
        raise SettingsError(
            "pipeline.lake: must be a non-empty path (a directory) or s3://bucket/prefix, "
            f"got {given!r}"
        )
    try:
        lake = lake_path(given, StorageOptions.from_settings(storage))
    except StorageError as exc:
        raise SettingsError(str(exc)) from exc
    return build(PipelineSettings, "pipeline", table, {**overrides, "lake": lake})


def _storage_table(data: Mapping[str, Any]) -> dict[str, Any]:
    """The keys a settings file's ``[lake]`` table gives, checked (the standard AWS environment
    variables fill in the others: :meth:`StorageOptions.from_settings`)."""
    table = data.get("lake", {})
    if not isinstance(table, Mapping):
        raise SettingsError("lake: must be a table")
    hints = typing.get_type_hints(StorageOptions)
    given: dict[str, Any] = {}
    for key, value in table.items():
        if key not in hints:
            raise SettingsError(f"lake.{key}: unknown key (known: {', '.join(sorted(hints))})")
        given[key] = _coerce(f"lake.{key}", hints[key], value)
    return given
