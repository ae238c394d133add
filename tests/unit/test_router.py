"""The router alone (issue 10): events in, deliveries out as values; no connection written."""

from __future__ import annotations

from broker_edge.message import Message
from broker_edge.packets import QoS, RetainHandling, Subscription
from broker_edge.router import Router, SessionBounds
from broker_edge.session import Outbound, Session
from broker_edge.states import Flow, FlowEvent

Q0, Q1, Q2 = QoS.AT_MOST_ONCE, QoS.AT_LEAST_ONCE, QoS.EXACTLY_ONCE


def _router() -> Router:
    return Router(SessionBounds(max_queued=10, max_inflight=2, max_queued_bytes=1 << 20))


def _message(topic: str, qos: QoS = Q1, *, retain: bool = False, tenant: str = "t") -> Message:
    return Message(tenant, topic, b"x", qos, retain, "pub", 1)


def _subscribed(
    router: Router, client_id: str, *filters: tuple[str, QoS], sub_id: int | None = None
) -> Session:
    session = router.new_session("t", client_id, True, None)
    subs = []
    for full, qos in filters:
        group = full.split("/")[1] if full.startswith("$share/") else None
        topic_filter = "/".join(full.split("/")[2:]) if group else full
        subs.append((group, topic_filter, Subscription(full, qos)))
    router.subscribe(session, subs, sub_id, 0)
    return session


def test_a_publish_gives_one_delivery_per_matching_session() -> None:
    router = _router()
    a = _subscribed(router, "a", ("x/+", Q1))
    b = _subscribed(router, "b", ("x/#", Q0))
    _subscribed(router, "c", ("y/#", Q1))
    got = router.route(_message("x/1", Q2), "pub")
    assert got is not None
    assert sorted((s.client_id, qos) for s, _, qos, _, _ in got) == [("a", 1), ("b", 0)]
    assert {id(s) for s, *_ in got} == {id(a), id(b)}
    assert router.route(_message("z"), "pub") is None


def test_overlapping_filters_of_one_client_give_one_delivery_at_the_highest_qos() -> None:
    router = _router()
    session = router.new_session("t", "a", True, None)
    router.subscribe(session, [(None, "x/#", Subscription("x/#", Q0))], 1, 0)
    router.subscribe(session, [(None, "x/+", Subscription("x/+", Q2))], 2, 0)
    (delivery,) = router.route(_message("x/1", Q2), None) or []
    assert delivery[2] == Q2  # [MQTT-3.3.5-1]
    assert sorted(delivery[4]) == [1, 2]  # every matching identifier [MQTT-3.3.4-3]


def test_no_local_skips_the_publisher_itself() -> None:
    router = _router()
    session = router.new_session("t", "me", True, None)
    router.subscribe(session, [(None, "x", Subscription("x", Q1, no_local=True))], None, 0)
    assert not router.route(_message("x"), "me")
    assert router.route(_message("x"), "other")


def test_a_shared_group_gives_each_message_to_one_member() -> None:
    router = _router()
    _subscribed(router, "a", ("$share/g/x", Q1))
    _subscribed(router, "b", ("$share/g/x", Q1))
    picked = [d[0].client_id for _ in range(4) for d in router.route(_message("x"), None) or []]
    assert len(picked) == 4
    assert set(picked) == {"a", "b"}


def test_retained_messages_come_back_as_deliveries_of_the_subscribe() -> None:
    router = _router()
    router.route(_message("r/1", Q1, retain=True), None)
    session = router.new_session("t", "late", True, None)
    got = router.subscribe(session, [(None, "r/#", Subscription("r/#", Q0))], None, 0)
    assert [(d[1].topic, d[2], d[3]) for d in got] == [("r/1", 0, True)]  # RETAIN 1 [MQTT-3.3.1-8]
    again = router.subscribe(
        session,
        [
            (
                None,
                "r/#",
                Subscription("r/#", Q0, retain_handling=RetainHandling.SEND_IF_NEW_SUBSCRIPTION),
            )
        ],
        None,
        0,
    )
    assert again == []


def test_tenants_never_see_each_other() -> None:
    router = _router()
    _subscribed(router, "a", ("#", Q1))
    assert router.route(_message("x", tenant="other"), None) is None


def test_unsubscribe_says_what_existed_and_routing_stops() -> None:
    router = _router()
    session = _subscribed(router, "a", ("x", Q1))
    assert router.unsubscribe(session, ("x", "y")) == [True, False]
    assert router.route(_message("x"), None) is None


def test_outbound_acks_step_through_the_table() -> None:
    session = _router().new_session("t", "a", True, None)
    message = _message("x")
    session.inflight[1] = Outbound(message, Q1, False, Flow.OUT_AWAIT_PUBACK)
    session.inflight[2] = Outbound(message, Q2, False, Flow.OUT_AWAIT_PUBREC)
    assert not Router.acked(session, 1, FlowEvent.PUBREC)  # not the ack it waits for
    assert Router.acked(session, 1, FlowEvent.PUBACK)
    assert 1 not in session.inflight
    assert Router.acked(session, 2, FlowEvent.PUBREC)
    assert session.inflight[2].state is Flow.OUT_AWAIT_PUBCOMP
    assert Router.acked(session, 2, FlowEvent.PUBREC)  # repeated: PUBREL again
    assert Router.acked(session, 2, FlowEvent.PUBCOMP)
    assert not session.inflight
    assert not Router.acked(session, 9, FlowEvent.PUBACK)


def test_sessions_expire_after_their_interval_offline_and_drop_cleanly() -> None:
    router = _router()
    session = _subscribed(router, "a", ("x", Q1))
    session.expiry_interval = 30
    session.disconnected_at = 100.0
    assert router.expired_sessions(129.0) == []
    assert router.expired_sessions(130.0) == [session]
    router.drop_session(session)
    assert router.sessions == {}
    assert router.session_counts == {"t": 0}
    assert router.route(_message("x"), None) is None
