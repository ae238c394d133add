"""Errors of the streaming jobs: one root."""

from __future__ import annotations


class PipelineError(Exception):
    """Root of every error raised by ``streaming``."""


class PipelineConfigError(PipelineError):
    """A pipeline setting is missing or has a bad value; the message names the key."""
