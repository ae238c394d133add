"""The lake's commit notice on ``$control/journal/{node}`` (schemas/control.py): one format,
built by the pipeline's publisher and parsed by the edge."""

from __future__ import annotations

import json

import pytest

from schemas.control import (
    JOURNAL_CONTROL_PREFIX,
    ControlMessageError,
    JournalCommitted,
    journal_control_topic,
)


def test_round_trip_and_topic() -> None:
    notice = JournalCommitted.now("edge-1", 42)
    doc = json.loads(notice.payload())
    assert set(doc) == {"node", "committed_seq", "decided_at"}
    assert (doc["node"], doc["committed_seq"]) == ("edge-1", 42)
    assert doc["decided_at"].endswith("+00:00")
    assert JournalCommitted.parse(notice.payload()) == notice
    assert journal_control_topic("edge-1") == JOURNAL_CONTROL_PREFIX + "edge-1"
    assert journal_control_topic("edge-1") == "$control/journal/edge-1"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"node": "a", "decided_at": "t"}', "missing field"),
        (b'{"node": "a", "committed_seq": -1, "decided_at": "t"}', "integer >= 0"),
        (b'{"node": "a", "committed_seq": 1.5, "decided_at": "t"}', "integer >= 0"),
        (b'{"node": "a", "committed_seq": true, "decided_at": "t"}', "integer >= 0"),
        (b'{"node": "a/b", "committed_seq": 1, "decided_at": "t"}', "without '/'"),
        (b'{"node": 1, "committed_seq": 1, "decided_at": "t"}', "must be strings"),
    ],
)
def test_bad_notices_are_refused_with_a_reason(payload: bytes, message: str) -> None:
    with pytest.raises(ControlMessageError, match=message):
        JournalCommitted.parse(payload)
