"""What a receiving edge delivered of its peers' messages (broker_edge.receipts): the session
log's records, and the restore putting each message back where it was, or not at all once its
subscriber finished it."""

from __future__ import annotations

import json

from broker_edge import receipts
from broker_edge.message import Message
from broker_edge.packets import QoS
from broker_edge.router import Router, SessionBounds
from broker_edge.session import Outbound, Pending, Session
from broker_edge.states import Flow

Q1 = QoS.AT_LEAST_ONCE


def _router() -> tuple[Router, Session, Session, Session]:
    router = Router(SessionBounds(max_queued=10, max_inflight=2, max_queued_bytes=1 << 20))
    online = router.new_session("t", "online", False, None)
    offline = router.new_session("t", "offline", False, None)
    clean = router.new_session("t", "clean", True, None)
    return router, online, offline, clean


def _crossing(seq: int) -> Message:
    return Message("t", "x/1", b"%d" % seq, Q1, False, "pub", 1, seq=seq, origin="edge-a")


def _delivered(router: Router, message: Message) -> dict[str, object]:
    """The record of ``message`` sent in flight to "online" (packet id 7) and queued for
    "offline", as the session log holds it (JSON and back)."""
    online = router.sessions[("t", "online")]
    offline = router.sessions[("t", "offline")]
    clean = router.sessions[("t", "clean")]
    online.inflight[7] = Outbound(message, Q1, False, Flow.OUT_AWAIT_PUBACK)
    offline.enqueue(Pending(message, Q1, False))
    clean.enqueue(Pending(message, Q1, False))
    deliveries = [(s, message, Q1, False, ()) for s in (online, offline, clean)]
    record, sessions = receipts.received(message, deliveries)
    assert sessions == [online, offline]  # a clean session does not outlive a restart
    return dict(json.loads(json.dumps(record)))


def test_the_restore_puts_a_crossing_message_back_where_it_was() -> None:
    record = _delivered(_router()[0], _crossing(5))
    router, online, offline, _ = _router()  # restarted: the snapshot had neither
    receipts.restore_received(router, record)
    out = online.inflight[7]  # sent again under its packet id, with DUP (outbox.resume_session)
    assert (out.message.origin, out.message.seq, out.state) == ("edge-a", 5, Flow.OUT_AWAIT_PUBACK)
    assert [(p.message.seq, p.message.payload) for p in offline.queue] == [(5, b"5")]


def test_what_a_subscriber_finished_is_not_given_back() -> None:
    record = _delivered(_router()[0], _crossing(5))
    router, online, offline, _ = _router()
    receipts.restore_received(router, record)
    done = json.loads(json.dumps(receipts.done(online, online.inflight[7])))
    receipts.restore_done(router, done)
    assert not online.inflight
    assert [p.message.seq for p in offline.queue] == [5]
    receipts.restore_done(router, {"t": "t", "c": "offline", "o": "edge-a", "q": 5})
    assert not offline.queue
    assert offline.queued_bytes == 0


def test_a_packet_id_taken_again_queues_the_message() -> None:
    record = _delivered(_router()[0], _crossing(5))
    router, online, _, _ = _router()
    local = Message("t", "x/2", b"local", Q1, False, "pub", 1, seq=9, origin="edge-b")
    online.inflight[7] = Outbound(local, Q1, False, Flow.OUT_AWAIT_PUBACK)
    receipts.restore_received(router, record)
    assert online.inflight[7].message is local
    assert [p.message.seq for p in online.queue] == [5]


def test_a_delivery_dropped_by_a_full_queue_is_not_recorded() -> None:
    _, online, _, _ = _router()
    message = _crossing(5)
    record, sessions = receipts.received(message, [(online, message, Q1, False, ())])
    assert (record, sessions) == ({}, [])


def test_a_qos2_message_its_subscriber_received_gets_only_its_pubrel_again() -> None:
    record = _delivered(_router()[0], _crossing(5))
    router, online, _, _ = _router()
    receipts.restore_received(router, record)
    received = receipts.done(online, online.inflight[7], ended=False)  # PUBREC
    receipts.restore_done(router, json.loads(json.dumps(received)))
    assert online.inflight[7].state is Flow.OUT_AWAIT_PUBCOMP  # outbox.resume_session: PUBREL
