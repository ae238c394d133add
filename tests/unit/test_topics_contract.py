"""The edge/pipeline contract is declared once (schemas.topics): the edge's topics and the
decision payload come from it, and the pipeline's modules name the same objects."""

from __future__ import annotations

import json

from broker_edge import plim
from broker_edge.tenancy import EDGE_CLIENT_ID
from schemas import payloads, topics, usage


def test_the_edge_publishes_on_the_declared_topics() -> None:
    topic, _ = plim.log_event(
        ts_us=1, node="n", tenant="t", client_id="c", origin="mqtt", event="connect", details={}
    )
    assert topic == topics.log_topic("mqtt", "connect")
    assert topic.startswith(topics.LOG_TOPIC_PREFIX)
    counters = plim.counter_messages(
        node="n",
        tenant="t",
        totals=dict.fromkeys(usage.COUNTER_METRICS, 0),
        previous={},
        start_us=0,
        end_us=1,
    )
    assert all(t.startswith(topics.COUNTERS_TOPIC_PREFIX) for t, _ in counters)
    assert EDGE_CLIENT_ID == topics.EDGE_CLIENT_ID
    assert topics.control_topic("") == plim.CONTROL_PREFIX


def test_the_decision_payload_has_the_declared_fields() -> None:
    decision = plim.QuotaDecision("blocked", "messages_per_day", 10, 11, "2026-01-01T00:00:00Z")
    assert tuple(json.loads(decision.payload())) == topics.DECISION_FIELDS
    assert plim.QUOTA_STATES == topics.DECISION_STATES
    assert plim.QuotaDecision.parse(decision.payload()) == decision


def test_the_pipeline_modules_name_the_same_declarations() -> None:
    assert payloads.LOG_TOPIC_PREFIX is topics.LOG_TOPIC_PREFIX
    assert usage.COUNTERS_TOPIC_PREFIX is topics.COUNTERS_TOPIC_PREFIX
    assert usage.CONTROL_TOPIC_PREFIX is topics.CONTROL_TOPIC_PREFIX
    assert usage.DECISION_FIELDS is topics.DECISION_FIELDS
