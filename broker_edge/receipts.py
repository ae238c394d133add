"""What a receiving edge delivered of its peers' QoS 1/2 messages, durable before a subscriber
sees it (issue 11: "once" across a SIGKILL of the receiving edge).

Theory of operation
-------------------
A crossing QoS 1/2 message (broker_edge.mesh) that a persistent session takes is written to the
session log (:mod:`broker_edge.sessionlog`) as one ``{"op": "rx"}`` record: the message, its
origin's seq, and where it went in each persistent session (the packet id of the in-flight
delivery, or the queue). The connections of those sessions are held until the log is synced,
so no subscriber gets a crossing message its edge could forget. A restarted edge applies the
record like any session change: the message is back in each session where it was (in flight
under its packet id, so it is sent again with DUP=1 [MQTT-4.4.0-1]; or queued), and the
receiver's :class:`broker_edge.mesh.Dedup` is past its seq, so the origin's copy sent again (it
was not acknowledged: the link's ACK waits for a snapshot) is dropped, not delivered a second
time.

When the subscriber ends the exchange (PUBACK; PUBCOMP for QoS 2) an ``{"op": "rxdone"}``
record follows (synced with the next batch, nothing held for it): the restore takes the message
out of the session again. A QoS 2 PUBREC is recorded too (``"rec"``), and the PUBREL that answers
it is held until that record is durable: the restore then sends only the PUBREL again, never the
message, so a subscriber that keeps its session state (the QoS 2 packet ids it has not had
released [MQTT-4.3.3-9]) gets a QoS 2 crossing message exactly once across the crash.

So after a crash a QoS 1 crossing message reaches a persistent session again only when its
edge had not made the subscriber's PUBACK durable: the subscriber had not acknowledged it, or
its PUBACK was read at most one loop iteration before the crash. That copy is the MQTT
redelivery of an unacknowledged message, with DUP=1 and its packet id (a packet id a local
delivery took again since the snapshot is the one exception: the copy is queued then, and sent
under a new id). QoS 1 gives no more: a PUBACK lost with the crash is indistinguishable from one
never sent.
"""

from __future__ import annotations

from typing import Any

from broker_edge.message import Message
from broker_edge.packets import QoS
from broker_edge.router import Delivery, Router
from broker_edge.session import Outbound, Pending, Session
from broker_edge.states import Flow
from broker_edge.store import message_doc, message_from

RX = "rx"  # a crossing message delivered to persistent sessions
RX_DONE = "rxdone"  # a persistent session's subscriber ended its exchange of one

_GONE = -1  # not a packet id: a delivery neither sent nor queued
_AWAIT = {QoS.AT_LEAST_ONCE: Flow.OUT_AWAIT_PUBACK, QoS.EXACTLY_ONCE: Flow.OUT_AWAIT_PUBREC}


def received(message: Message, deliveries: list[Delivery]) -> tuple[dict[str, Any], list[Session]]:
    """The ``rx`` record of a crossing ``message`` the outbox just delivered (its fields but
    ``op`` and ``seq``), and the persistent sessions it went to at QoS 1/2 (none: no record)."""
    targets: list[list[Any]] = []
    sessions = []
    for session, delivered, qos, retain, sub_ids in deliveries:
        if not qos or session.clean:
            continue
        pid = _where(session, delivered)
        if pid == _GONE:
            continue  # dropped (a full queue, too big for the client): nothing to keep
        targets.append([session.client_id, pid, int(qos), retain, list(sub_ids)])
        sessions.append(session)
    if not targets:
        return {}, []
    record = {"o": message.origin, "q": message.seq, "m": message_doc(message), "to": targets}
    return record, sessions


def _where(session: Session, message: Message) -> int | None:
    """The packet id ``message`` was just sent under, None if it was queued, _GONE if
    neither (the outbox appends: it is the newest either way)."""
    if session.inflight:
        pid = next(reversed(session.inflight))
        if session.inflight[pid].message is message:
            return pid
    queue = session.queue
    if queue and queue[-1].message is message:
        return None
    return _GONE


def done(session: Session, out: Outbound, *, ended: bool = True) -> dict[str, Any]:
    """The ``rx done`` record of a crossing message ``session``'s subscriber finished, or (not
    ``ended``) received at QoS 2 (its fields but ``op`` and ``seq``)."""
    message = out.message
    record = {"t": session.tenant, "c": session.client_id, "o": message.origin, "q": message.seq}
    if not ended:
        record["rec"] = 1
    return record


def restore_received(router: Router, record: dict[str, Any]) -> None:
    """Put an ``rx`` record's message back into each session it went to (before serving)."""
    message = message_from(record["m"])
    for client_id, pid, qos, retain, sub_ids in record["to"]:
        session = router.sessions.get((message.tenant, client_id))
        if session is None or session.clean:
            continue  # dropped since (a later record of the log said so)
        level = QoS(qos)
        ids = tuple(int(i) for i in sub_ids)
        if pid is not None and pid not in session.inflight:
            session.inflight[pid] = Outbound(message, level, bool(retain), _AWAIT[level], ids)
        else:  # queued then, or its packet id taken again since: sent under a new one
            session.enqueue(Pending(message, level, bool(retain), ids))


def restore_done(router: Router, record: dict[str, Any]) -> None:
    """An ``rx done`` record: the message is no longer the session's (received at QoS 2: only
    its PUBREL is sent again)."""
    session = router.sessions.get((record["t"], record["c"]))
    if session is None:
        return
    origin, seq = str(record["o"]), int(record["q"])
    if not record.get("rec"):
        session.forget(origin, seq)
        return
    for out in session.inflight.values():
        if out.message.seq == seq and out.message.origin == origin:
            out.state = Flow.OUT_AWAIT_PUBCOMP


__all__ = ["RX", "RX_DONE", "done", "received", "restore_done", "restore_received"]
