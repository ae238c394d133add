"""Typed settings of the quota step: tenants' daily limits, the operator token, the edges.

The pipeline does not read the tenants file itself (that format belongs to the edge); the
command line builds :class:`QuotaSettings` with a loader that re-reads the file, and the quota
step calls it once per micro-batch, so a changed file takes effect within one batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from streaming.errors import PipelineConfigError


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's daily limits; None: no limit."""

    messages_per_day: int | None = None
    bytes_per_day: int | None = None

    def __post_init__(self) -> None:
        for name in ("messages_per_day", "bytes_per_day"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise PipelineConfigError(f"limits.{name}: must be an integer >= 0, got {value!r}")


LimitsLoader = Callable[[], Mapping[str, TenantLimits]]
"""Returns tenant -> limits, read afresh (e.g. from the tenants file) on every call."""

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class QuotaSettings:
    """What the quota step needs besides :class:`~streaming.settings.PipelineSettings`.

    ``brokers``: every edge as ``(host, port)``; each gets every decision, retained. Empty:
    decisions are recorded in ``quota_events`` but published nowhere. ``clock`` gives the
    current time (aware); it decides the UTC day whose usage counts and ``decided_at``.
    """

    load_limits: LimitsLoader
    operator_token: str
    brokers: tuple[tuple[str, int], ...] = ()
    warn_ratio: float = 0.8
    publish_timeout_seconds: float = 10.0
    clock: Clock = field(default=utc_now)

    def __post_init__(self) -> None:
        if not callable(self.load_limits):
            raise PipelineConfigError("quota.load_limits: must be a callable")
        _check_edges("quota", self.operator_token, self.brokers, self.publish_timeout_seconds)
        if not (0 < self.warn_ratio <= 1 and math.isfinite(self.warn_ratio)):
            raise PipelineConfigError(f"quota.warn_ratio: must be in (0, 1], got {self.warn_ratio}")


@dataclass(frozen=True, slots=True)
class NoticeSettings:
    """The edges to send the journal notices to without the quota step (no tenants file): the
    operator token is the edge's own, read from the data dir (``schemas.operator_token``)."""

    operator_token: str
    brokers: tuple[tuple[str, int], ...] = ()
    publish_timeout_seconds: float = 10.0

    def __post_init__(self) -> None:
        _check_edges("notices", self.operator_token, self.brokers, self.publish_timeout_seconds)


def _check_edges(
    where: str, token: str, brokers: tuple[tuple[str, int], ...], timeout: float
) -> None:
    if not token:
        raise PipelineConfigError(f"{where}.operator_token: must not be empty")
    for host, port in brokers:
        if not host:
            raise PipelineConfigError(f"{where}.brokers: empty host in {host}:{port}")
        if not 0 < port < 65536:
            raise PipelineConfigError(f"{where}.brokers: port must be 1..65535, got {port}")
    if not timeout > 0:
        raise PipelineConfigError(f"{where}.publish_timeout_seconds: must be > 0, got {timeout}")
