"""bench.quota's arithmetic: which publish crossed the limit, the reaction and the overshoot."""

from __future__ import annotations

import tomllib

import pytest

from bench import BenchError
from bench.quota import QUOTA_EXCEEDED, Round, combined_summary, tenants_file


def a_round(codes: list[int], limit: int, period: float = 0.001) -> Round:
    record = Round("q0", limit)
    record.sent = [100.0 + i * period for i in range(len(codes))]
    record.acks = {i: (code, record.sent[i] + 0.002) for i, code in enumerate(codes)}
    return record


def test_reaction_and_overshoot_count_from_the_limit_th_accepted_publish() -> None:
    # Limit 5: publish #4 (index 4) is the 5th accepted; 3 more are accepted, then refusals.
    record = a_round([0] * 8 + [QUOTA_EXCEEDED] * 3, limit=5, period=0.5)
    record.counter_at = 100.0 + 4 * 0.5 + 0.25
    record.applied_at = 100.0 + 7 * 0.5 + 0.1
    summary = record.summary()
    assert summary["reaction_s"] == 2.0  # index 8 sent 4 periods after index 4
    assert summary["overshoot"] == 3
    assert summary["accepted_after_first_refusal"] == 0
    assert summary["counter_s"] == 0.25
    assert summary["applied_s"] == 1.6
    assert summary["decided_s"] is None
    assert summary["refusal_acked_s"] == 2.002


def test_refusals_other_than_quota_do_not_count_as_accepted() -> None:
    record = a_round([0, 0x87, 0, 0, QUOTA_EXCEEDED, 0], limit=3)
    summary = record.summary()
    assert summary["overshoot"] == 1  # accepted: 0, 2, 3, 5 (the 5th after the first refusal)
    assert summary["accepted_after_first_refusal"] == 1


def test_a_round_that_was_never_blocked_is_an_error() -> None:
    with pytest.raises(BenchError, match="not blocked"):
        a_round([0] * 10, limit=5).summary()
    with pytest.raises(BenchError, match="not blocked"):
        a_round([0, 0, QUOTA_EXCEEDED], limit=5).summary()


def test_tenants_file_gives_each_round_its_limit() -> None:
    doc = tomllib.loads(tenants_file(["q0", "q1"], 300))
    assert doc["operator"]["token"]
    assert doc["tenants"]["q1"]["limits"] == {"messages_per_day": 300}
    assert "limits" not in doc["tenants"]["warmup"]


def test_several_edges_count_as_one_round_from_the_limit_th_accepted_publish_overall() -> None:
    # Limit 4 over two edges publishing in turn: b's index 1 (t=100.003) is the 4th accepted.
    a = a_round([0, 0, 0, QUOTA_EXCEEDED], limit=4, period=0.002)
    b = a_round([0, 0, QUOTA_EXCEEDED, QUOTA_EXCEEDED], limit=4, period=0.002)
    b.sent = [t + 0.001 for t in b.sent]
    summary = combined_summary([a, b])
    assert summary["overshoot"] == 1  # 5 accepted in all
    assert summary["per_edge_accepted"] == [3, 2]
    assert summary["reaction_s"] == 0.003  # a's first refusal (t=100.006), the later one
    assert summary["first_edge_refused_s"] == 0.002
    assert summary["decided_s"] is None  # the pipeline's decision not read

    a.decided_at = 100.503  # the pipeline's blocked decision, 0.5 s after the crossing
    assert combined_summary([a, b])["decided_s"] == 0.5
