"""flespi-style platform limits on the edge: log events, usage counters and quota state.

Everything here is a publish in the tenant's namespace (ARCHITECTURE rule 2):

- **Log events** on ``$log/{origin}/{event_type}``: one JSON object with stable fields
  ``time`` (ISO 8601, UTC), ``ts_us``, ``node``, ``tenant``, ``client_id``, ``origin``, ``event``
  and ``details`` (an object whose keys depend on the event).
- **Counters** on ``$counters/{metric}`` every counter interval: ``node``, ``tenant``,
  ``metric``, ``delta`` (this interval), ``total`` (this node's running total, or the current
  value of a gauge), ``interval_start`` and ``interval_end`` (ISO 8601, UTC), ``kind``.
- **Quota decisions** arrive from the pipeline as retained JSON on ``$control/quota/{tenant}``
  (operator only): ``state`` ("ok" | "warn" | "blocked"), ``metric``, ``limit``, ``value``,
  ``decided_at``. The edge applies them at once and republishes each retained to the tenant
  as ``$quota/{metric}``.

Pure functions and small value objects; the broker does the publishing.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from broker_edge.errors import EdgeError
from schemas.names import COUNTER_METRICS, GAUGE_METRICS, LOG_EVENTS
from schemas.topics import (
    CONTROL_TOPIC_PREFIX,
    DECISION_FIELDS,
    DECISION_STATES,
    counter_topic,
    log_topic,
)

QUOTA_STATES = DECISION_STATES
CONTROL_PREFIX = CONTROL_TOPIC_PREFIX  # $control/quota/{tenant}


class QuotaDecisionError(EdgeError):
    """A ``$control/quota`` payload that is not a valid decision."""


def iso(ts_us: int) -> str:
    return datetime.fromtimestamp(ts_us / 1e6, UTC).isoformat(timespec="milliseconds")


def log_event(
    *,
    ts_us: int,
    node: str,
    tenant: str,
    client_id: str,
    origin: str,
    event: str,
    details: dict[str, Any],
) -> tuple[str, bytes]:
    """(topic, payload) of one log event."""
    assert event in LOG_EVENTS, event
    doc = {
        "time": iso(ts_us),
        "ts_us": ts_us,
        "node": node,
        "tenant": tenant,
        "client_id": client_id,
        "origin": origin,
        "event": event,
        "details": details,
    }
    return log_topic(origin, event), json.dumps(doc, separators=(",", ":")).encode()


# The details of the events every session makes, built here for the broker and for anything that
# journals events as an edge does (edgebus.demo_lake), so their shapes are the edge's.


def connect_details(
    *, peer: str, protocol: int, clean_start: bool, keepalive: int, session_present: bool
) -> dict[str, Any]:
    """``connect``: the client's address, MQTT protocol level (4: 3.1.1, 5) and CONNECT flags,
    and whether a session was resumed."""
    return {
        "peer": peer,
        "protocol": protocol,
        "clean_start": clean_start,
        "keepalive": keepalive,
        "session_present": session_present,
    }


def disconnect_details(*, peer: str, clean: bool, reason_code: int | None) -> dict[str, Any]:
    """``disconnect``: ``clean`` when the client sent DISCONNECT; ``reason_code`` the one the
    edge closed the connection with (null: the client closed it, or the network did)."""
    return {"peer": peer, "clean": clean, "reason_code": reason_code}


def subscribe_details(topic_filters: list[str], reason_codes: list[int]) -> dict[str, Any]:
    """``subscribe``: the SUBSCRIBE's filters and the SUBACK's reason code for each (the
    granted QoS, or a refusal at 0x80 and above)."""
    return {"topic_filters": topic_filters, "reason_codes": reason_codes}


@dataclass(slots=True)
class TenantUsage:
    """Running totals of one tenant on this node, and where the local quota looks again: the
    publish that brings ``messages_in`` or ``bytes_in`` to its check blocks the tenant or
    reports its counters early (``broker_edge.localquota``; ``sys.maxsize``: never)."""

    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    dropped: int = 0
    check_messages_in: int = sys.maxsize
    check_bytes_in: int = sys.maxsize


def counter_messages(
    *,
    node: str,
    tenant: str,
    totals: dict[str, int],
    previous: dict[str, int],
    start_us: int,
    end_us: int,
) -> list[tuple[str, bytes]]:
    """(topic, payload) per metric for one interval."""
    out = []
    for metric in COUNTER_METRICS:
        total = totals[metric]
        doc = {
            "node": node,
            "tenant": tenant,
            "metric": metric,
            "kind": "gauge" if metric in GAUGE_METRICS else "counter",
            "delta": total - previous.get(metric, 0),
            "total": total,
            "interval_start": iso(start_us),
            "interval_end": iso(end_us),
        }
        out.append((counter_topic(metric), json.dumps(doc, separators=(",", ":")).encode()))
    return out


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    state: str
    metric: str
    limit: float | None
    value: float | None
    decided_at: str | None

    @classmethod
    def parse(cls, payload: bytes) -> QuotaDecision:
        try:
            doc = json.loads(payload)
        except ValueError as exc:
            raise QuotaDecisionError(f"not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise QuotaDecisionError("must be a JSON object")
        state = doc.get("state")
        if state not in QUOTA_STATES:
            raise QuotaDecisionError(f"state must be one of {QUOTA_STATES}, got {state!r}")
        metric = doc.get("metric")
        if not isinstance(metric, str) or not metric or "/" in metric or "+" in metric:
            raise QuotaDecisionError(f"metric must be a plain name, got {metric!r}")
        for key in ("limit", "value"):
            value = doc.get(key)
            if value is not None and (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not math.isfinite(value)
            ):
                raise QuotaDecisionError(f"{key} must be a number, got {value!r}")
        decided_at = doc.get("decided_at")
        if decided_at is not None and not isinstance(decided_at, str):
            raise QuotaDecisionError("decided_at must be a string")
        return cls(state, metric, doc.get("limit"), doc.get("value"), decided_at)

    def details(self) -> dict[str, Any]:
        """The details of the quota event applying this decision logs."""
        return {
            "metric": self.metric,
            "limit": self.limit,
            "value": self.value,
            "decided_at": self.decided_at,
        }

    def payload(self) -> bytes:
        values = (self.state, self.metric, self.limit, self.value, self.decided_at)
        doc = dict(zip(DECISION_FIELDS, values, strict=True))
        return json.dumps(doc, separators=(",", ":")).encode()


def quota_event(previous: str | None, state: str) -> str | None:
    """The log event for a change of a metric's quota state, or None when nothing changed."""
    if previous == state or (previous is None and state == "ok"):
        return None
    if state == "blocked":
        return "quota_blocked"
    if state == "warn":
        return "quota_warn" if previous != "blocked" else "quota_cleared"
    return "quota_cleared"
