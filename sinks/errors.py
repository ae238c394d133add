"""Errors of the sinks: one root."""

from __future__ import annotations


class SinkError(Exception):
    """Root of every error raised by ``sinks``."""


class SinkSchemaError(SinkError):
    """A batch does not fit the target table's schema; the message names the column."""


class DeltaSinkError(SinkError):
    """Creating, writing or reading a Delta table failed; chained from the delta-rs error."""
