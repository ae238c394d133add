"""Messages the pipeline sends back to the edges, on ``$control/...`` in the operator's namespace.

The payloads are defined once here and the topics in ``schemas.topics``, both pure Python (the
edge imports them and must stay free of pyarrow):

- ``$control/quota/{tenant}`` (retained): a tenant's quota decision (``broker_edge.plim``).
- ``$control/journal/{node}`` (retained): how far the lake has committed a node's journal, after
  each micro-batch once every table's commit is done. Payload: a JSON object
  ``{"node": str, "committed_seq": int, "decided_at": str}``, where ``committed_seq`` is the
  highest seq of that node committed in every table (inclusive) and ``decided_at`` is ISO 8601
  (UTC). The edge deletes journal segments at or below it (retention, issue 9).
- ``$control/usage/{tenant}`` (retained): the tenant's confirmed day totals and limits
  (:class:`ConfirmedUsage`), after every batch that moved them, with every decision, and
  between batches once a tenant is past half a limit (``streaming.quota_lane``);
  each edge enforces the limits locally with them (``broker_edge.localquota``, issue 14).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

from schemas import topics
from schemas.names import QUOTA_METRICS
from schemas.topics import journal_control_topic as journal_control_topic  # noqa: PLC0414 (re-exported)
from schemas.topics import usage_control_topic as usage_control_topic  # noqa: PLC0414 (re-exported)

# The topics are declared in schemas.topics; named here too beside their payload.
JOURNAL_CONTROL_PREFIX = topics.JOURNAL_CONTROL_TOPIC_PREFIX

# The fields of a ``$control/journal/{node}`` payload.
COMMITTED_FIELDS = ("node", "committed_seq", "decided_at")


class ControlMessageError(ValueError):
    """A ``$control`` payload that does not hold what its topic promises."""


@dataclass(frozen=True, slots=True)
class JournalCommitted:
    """The lake has every record of ``node`` up to ``committed_seq`` (inclusive)."""

    node: str
    committed_seq: int
    decided_at: str

    def __post_init__(self) -> None:
        if not self.node or "/" in self.node:
            raise ControlMessageError(f"node must be a name without '/', got {self.node!r}")
        seq = self.committed_seq
        if type(seq) is not int or seq < 0:
            raise ControlMessageError(f"committed_seq must be an integer >= 0, got {seq!r}")

    @classmethod
    def now(cls, node: str, committed_seq: int) -> JournalCommitted:
        decided = datetime.now(UTC).isoformat(timespec="milliseconds")
        return cls(node, committed_seq, decided)

    def payload(self) -> bytes:
        doc = {
            "node": self.node,
            "committed_seq": self.committed_seq,
            "decided_at": self.decided_at,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, payload: bytes) -> JournalCommitted:
        doc = _object(payload, COMMITTED_FIELDS)
        if not isinstance(doc["node"], str) or not isinstance(doc["decided_at"], str):
            raise ControlMessageError("node and decided_at must be strings")
        return cls(doc["node"], doc["committed_seq"], doc["decided_at"])


# The fields of a ``$control/usage/{tenant}`` payload.
CONFIRMED_FIELDS = ("tenant", "date", "totals", "limits", "decided_at")


@dataclass(frozen=True, slots=True)
class ConfirmedUsage:
    """A tenant's usage of UTC day ``date`` as the pipeline has counted it (what ``usage``
    holds plus the journaled counter records it does not hold yet, ``streaming.quota``).

    ``totals``: per quota counter (``messages_in``, ``bytes_in``) the day total over every edge
    and each node's part of it, ``{"total": int, "nodes": {node: int}}``; a node's part is the
    sum of the counter deltas of that node counted for the day, so an edge adds to it only
    what it accepted itself and the pipeline has not counted yet. ``limits``: per quota metric
    (``messages_per_day``, ``bytes_per_day``) the limit the pipeline decides with (null: none).
    JSON: ``{"tenant", "date": "YYYY-MM-DD", "totals", "limits", "decided_at"}``.
    """

    tenant: str
    date: date
    totals: Mapping[str, tuple[int, Mapping[str, int]]]
    limits: Mapping[str, int | None]
    decided_at: str

    def __post_init__(self) -> None:
        if not self.tenant or "/" in self.tenant:
            raise ControlMessageError(f"tenant must be a name without '/', got {self.tenant!r}")
        for counter, (total, nodes) in self.totals.items():
            if counter not in QUOTA_METRICS.values():
                raise ControlMessageError(f"totals.{counter}: not a quota counter")
            parts = [total, *nodes.values()]
            if any(type(n) is not int or n < 0 for n in parts):
                raise ControlMessageError(f"totals.{counter}: counts must be integers >= 0")
            if sum(nodes.values()) != total:
                raise ControlMessageError(f"totals.{counter}: the nodes' parts do not add up")
        for metric, limit in self.limits.items():
            if metric not in QUOTA_METRICS:
                raise ControlMessageError(f"limits.{metric}: not a quota metric")
            if limit is not None and (type(limit) is not int or limit < 0):
                raise ControlMessageError(f"limits.{metric}: must be an integer >= 0 or null")

    def own_and_others(self, counter: str, node: str) -> tuple[int, int]:
        """``node``'s part of ``counter``'s day total, and every other node's (0, 0: none)."""
        total, nodes = self.totals.get(counter, (0, {}))
        own = nodes.get(node, 0)
        return own, total - own

    def payload(self) -> bytes:
        doc = {
            "tenant": self.tenant,
            "date": self.date.isoformat(),
            "totals": {
                counter: {"total": total, "nodes": dict(sorted(nodes.items()))}
                for counter, (total, nodes) in self.totals.items()
            },
            "limits": dict(self.limits),
            "decided_at": self.decided_at,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, payload: bytes) -> ConfirmedUsage:
        doc = _object(payload, CONFIRMED_FIELDS)
        try:
            day = date.fromisoformat(doc["date"])
        except (TypeError, ValueError) as exc:
            raise ControlMessageError(f"date must be YYYY-MM-DD, got {doc['date']!r}") from exc
        totals, limits = doc["totals"], doc["limits"]
        if not isinstance(totals, dict) or not isinstance(limits, dict):
            raise ControlMessageError("totals and limits must be objects")
        parsed: dict[str, tuple[int, Mapping[str, int]]] = {}
        for counter, entry in totals.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("nodes"), dict):
                raise ControlMessageError(f"totals.{counter}: must be {{total, nodes}}")
            parsed[counter] = (entry.get("total", -1), entry["nodes"])  # checked below
        if not isinstance(doc["tenant"], str) or not isinstance(doc["decided_at"], str):
            raise ControlMessageError("tenant and decided_at must be strings")
        return cls(doc["tenant"], day, parsed, limits, doc["decided_at"])


def _object(payload: bytes, fields: tuple[str, ...]) -> dict[str, Any]:
    """``payload``'s JSON object, which must hold every one of ``fields``."""
    try:
        doc = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ControlMessageError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ControlMessageError("not a JSON object")
    missing = [f for f in fields if f not in doc]
    if missing:
        raise ControlMessageError(f"missing field(s) {', '.join(missing)}")
    return doc
