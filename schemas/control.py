"""Messages the pipeline sends back to the edges, on ``$control/...`` in the operator's namespace.

The payloads are defined once here and the topics in ``schemas.topics``, both pure Python (the
edge imports them and must stay free of pyarrow):

- ``$control/quota/{tenant}`` (retained): a tenant's quota decision (``broker_edge.plim``).
- ``$control/journal/{node}`` (retained): how far the lake has committed a node's journal, after
  each micro-batch once every table's commit is done. Payload: a JSON object
  ``{"node": str, "committed_seq": int, "decided_at": str}``, where ``committed_seq`` is the
  highest seq of that node committed in every table (inclusive) and ``decided_at`` is ISO 8601
  (UTC). The edge deletes journal segments at or below it (retention, issue 9).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from schemas import topics
from schemas.topics import journal_control_topic as journal_control_topic  # noqa: PLC0414 (re-exported)

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
        try:
            doc = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ControlMessageError(f"not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise ControlMessageError("not a JSON object")
        missing = [f for f in COMMITTED_FIELDS if f not in doc]
        if missing:
            raise ControlMessageError(f"missing field(s) {', '.join(missing)}")
        if not isinstance(doc["node"], str) or not isinstance(doc["decided_at"], str):
            raise ControlMessageError("node and decided_at must be strings")
        return cls(doc["node"], doc["committed_seq"], doc["decided_at"])
