"""The tenancy policy alone (issue 10): no broker, no connection, no socket. Every answer is a
value; the policy's only state is its own (usage totals, quota decisions, counter history)."""

from __future__ import annotations

import json

from policy_client import Client

from broker_edge.packets import ConnackCode311, Publish, ReasonCode
from broker_edge.tenancy import Admission, Tenancy, take_token
from broker_edge.tenants import OPERATOR_TENANT, parse
from schemas.control import JournalCommitted, journal_control_topic

CONFIG = parse(
    {
        "operator": {"token": "op"},
        "tenants": {
            "acme": {
                "tokens": ["acme-1", "acme-ro"],
                "limits": {"sessions": 2, "max_payload_bytes": 10, "messages_per_second": 4},
                "acl": {"acme-ro": {"publish": [], "subscribe": ["#"]}},
            }
        },
    }
)


def admit(
    tenancy: Tenancy, username: str | None, *, known: bool = False, sessions: int = 0
) -> Admission:
    return tenancy.admit(
        client_id="dev-1",
        peer="10.0.0.1:5000",
        v5=True,
        username=username,
        known=lambda tenant: known,
        sessions={"acme": sessions},
    )


def test_admission_is_a_value_with_the_limits_to_apply() -> None:
    tenancy = Tenancy(CONFIG, "n1")
    admission = admit(tenancy, "acme-1")
    assert admission.refusal is None
    assert (admission.tenant, admission.operator) == ("acme", False)
    assert (admission.max_payload, admission.rate) == (10, 4.0)
    assert admission.usage is tenancy.usage_of("acme")  # the tenant's totals, shared
    assert admission.events == ()


def test_a_bad_token_is_refused_with_an_event_in_the_operators_namespace() -> None:
    admission = admit(Tenancy(CONFIG, "n1"), "nope")
    assert admission.refusal == ReasonCode.BAD_USER_NAME_OR_PASSWORD
    [event] = admission.events
    assert (event.tenant, event.event, event.client_id) == (OPERATOR_TENANT, "auth_failed", "dev-1")
    assert event.details == {"peer": "10.0.0.1:5000", "username": True}


def test_the_sessions_limit_counts_unless_the_client_is_known() -> None:
    tenancy = Tenancy(CONFIG, "n1")
    refused = admit(tenancy, "acme-1", sessions=2)
    assert refused.refusal == ReasonCode.QUOTA_EXCEEDED
    assert refused.events[0].details == {"refused": "connect", "limit": "sessions", "value": 2}
    assert admit(tenancy, "acme-1", sessions=2, known=True).refusal is None


def test_publish_checks_answer_with_a_code_and_an_event_and_write_nothing_but_usage() -> None:
    tenancy = Tenancy(CONFIG, "n1")
    ro = Client("acme", "dash", acl=CONFIG.grant("acme-ro").acl)  # type: ignore[union-attr]
    code, event = tenancy.refuse_publish(ro, Publish(topic="fleet/x", payload=b"1"))
    assert code == ReasonCode.NOT_AUTHORIZED
    assert event is not None
    assert event.details == {"action": "publish", "topic": "fleet/x", "qos": 0}
    dev = Client("acme", "dev-1", max_payload=10)
    code, event = tenancy.refuse_publish(
        dev, Publish(topic="$counters/messages_in", payload=b""), action="will"
    )
    assert code == ReasonCode.NOT_AUTHORIZED
    assert event is not None
    assert event.details["action"] == "will"
    code, event = tenancy.refuse_publish(dev, Publish(topic="fleet/x", payload=b"x" * 11))
    assert code == ReasonCode.QUOTA_EXCEEDED
    assert event is not None
    assert event.event == "limit_exceeded"
    assert dev.usage.dropped == 1
    assert tenancy.refuse_publish(dev, Publish(topic="fleet/x", payload=b"ok")) == (None, None)
    op = Client(OPERATOR_TENANT, "pipeline", operator=True)
    assert tenancy.refuse_publish(op, Publish(topic="$control/quota/acme", payload=b"")) == (
        None,
        None,
    )


def test_a_quota_decision_blocks_and_says_what_to_publish() -> None:
    tenancy = Tenancy(CONFIG, "n1")
    decision = json.dumps(
        {"state": "blocked", "metric": "messages", "limit": 10, "value": 12, "decided_at": "t"}
    ).encode()
    outcome = tenancy.control_message(OPERATOR_TENANT, "$control/quota/acme", decision)
    assert "acme" in tenancy.blocked
    [(tenant, topic, _payload)] = outcome.publishes
    assert (tenant, topic) == ("acme", "$quota/messages")
    assert [e.event for e in outcome.events] == ["quota_blocked"]
    # Blocked: the tenant's clients still connect (to read why) and its publishes are refused;
    # a will passes CONNECT and is dropped if the tenant is still blocked when it is due.
    assert admit(tenancy, "acme-1").refusal is None
    dev = Client("acme", "dev-1")
    assert tenancy.refuse_publish(dev, Publish(topic="fleet/x", payload=b"1")) == (
        ReasonCode.QUOTA_EXCEEDED,
        None,
    )
    will = Publish(topic="fleet/x/status", payload=b"gone")
    assert tenancy.refuse_publish(dev, will, action="will") == (None, None)
    assert tenancy.will_refused("acme")
    assert tenancy.usage_of("acme").dropped == 1
    # The same decision again: the state is published again, no new event.
    again = tenancy.control_message(OPERATOR_TENANT, "$control/quota/acme", decision)
    assert again.events == ()
    # A tenant cannot do this for itself, and other operator topics do nothing.
    assert tenancy.control_message("acme", "$control/quota/acme", b"").publishes == ()
    assert tenancy.control_message(OPERATOR_TENANT, "$control/quota/acme", b"").publishes == ()
    assert "acme" not in tenancy.blocked  # a cleared decision forgets the state
    assert not tenancy.will_refused("acme")


def test_the_journal_notice_for_this_node_only() -> None:
    tenancy = Tenancy(None, "n1")
    notice = JournalCommitted.now("n1", 41).payload()
    outcome = tenancy.control_message(OPERATOR_TENANT, journal_control_topic("n1"), notice)
    assert outcome.journal_committed == 41
    other = tenancy.control_message(OPERATOR_TENANT, journal_control_topic("n2"), notice)
    assert other.journal_committed is None
    assert (
        tenancy.control_message(
            OPERATOR_TENANT, journal_control_topic("n1"), b"{"
        ).journal_committed
        is None
    )


def test_the_token_bucket_is_a_pure_function_of_its_state_and_now() -> None:
    level, pause = 2.0, 0.0
    for _ in range(3):
        level, pause = take_token(level, 0.0, 2.0, 0.0)
    assert pause == 0.5  # one message over a 2 msg/s bucket: half a second
    level, pause = take_token(level, 0.0, 2.0, 1.0)  # a second later: two more tokens
    assert (level, pause) == (0.0, 0.0)


def test_no_tenants_file_everyone_is_anonymous_but_the_local_operator() -> None:
    tenancy = Tenancy(None, "n1", local_operator_token="secret")
    assert admit(tenancy, None).tenant == "default"
    assert admit(tenancy, "anything").operator is False
    assert admit(tenancy, "secret").operator is True
    refused = Tenancy(CONFIG, "n1").admit(
        client_id="x", peer="p", v5=False, username=None, known=lambda t: False, sessions={}
    )
    assert refused.refusal == ConnackCode311.NOT_AUTHORIZED
