"""One handler per packet type the machine surfaces, behind one dispatch (Mosquitto's
``handle_*``): what the node does with each event of a :class:`Connection`.

The machine (broker_edge.connection) has already checked the packet against the transition
table and the per-connection rules; a handler applies the node's policy (tenancy), the journal
and the router, then tells the machine what to send. Handlers run inside
:meth:`Broker.receive`'s turn and raise :class:`ProtocolError` for what only the node can see
(a will naming a bad topic, a DISCONNECT that sets an expiry it may not set).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from broker_edge.connection import PAUSED_BY_RATE, Connection
from broker_edge.errors import ProtocolError
from broker_edge.packets import (
    SUBACK_FAILURE_311,
    ConnackCode311,
    Connect,
    Disconnect,
    ProtocolVersion,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    QoS,
    ReasonCode,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
)
from broker_edge.plim import subscribe_details
from broker_edge.session import Outbound, Session
from broker_edge.states import ACK_EVENTS, FlowEvent
from broker_edge.tenants import ALLOW_ALL
from broker_edge.topics import InvalidTopic, parse_subscription_filter, validate_topic_name
from schemas.topics import JOURNAL_CONTROL_TOPIC_PREFIX

if TYPE_CHECKING:
    from broker_edge.broker import Broker

_client_numbers = itertools.count(1)

# The most publishes one run takes (see _publish_run): the turn's clock (Broker.receive) is read
# between events, and a run is one; a run costs well under a microsecond a publish.
RUN_MAX = 1024

_QOS0 = QoS.AT_MOST_ONCE
_QOS2 = QoS.EXACTLY_ONCE
_V5 = ProtocolVersion.MQTT_5
_PUBREC = FlowEvent.PUBREC
_PUBACK = FlowEvent.PUBACK


def handle_connect(broker: Broker, conn: Connection, packet: Connect, now: float) -> None:
    broker.stats.connects += 1
    v5 = packet.protocol_version == _V5
    client_id = packet.client_id
    assigned: str | None = None
    if not client_id:
        if not packet.clean_start and not v5:
            # [MQTT-3.1.3-8] an empty id with CleanSession=0 is rejected.
            conn.connect_received(packet.protocol_version, "", packet.keepalive)
            conn.refuse(ConnackCode311.IDENTIFIER_REJECTED)
            return
        client_id = assigned = f"edgebus-{broker.settings.node_id}-{next(_client_numbers)}"
    server_keepalive = conn.connect_received(packet.protocol_version, client_id, packet.keepalive)
    if v5 and packet.properties.authentication_method is not None:
        # No enhanced authentication method is offered [MQTT-4.12.0-1].
        conn.refuse(ReasonCode.BAD_AUTHENTICATION_METHOD)
        return
    admission = broker.admit(conn, packet)
    if admission.refusal is not None:
        conn.refuse(admission.refusal)
        return
    conn.admit(admission, packet.username)
    if packet.will is not None and not _take_will(broker, conn, packet.will, v5):
        return
    broker.connect(conn, packet, (assigned, server_keepalive), now)


def _take_will(broker: Broker, conn: Connection, will: Will, v5: bool) -> bool:
    """Keep the CONNECT's will, or refuse the connection (False) if this client may not
    publish it."""
    try:
        validate_topic_name(will.topic)  # [MQTT-3.1.3-11]
    except InvalidTopic as exc:
        raise ProtocolError(f"will topic: {exc}", ReasonCode.TOPIC_NAME_INVALID) from exc
    levels = broker.settings.max_topic_levels
    if will.topic.count("/") >= levels:
        raise ProtocolError(
            f"will topic of more than {levels} levels", ReasonCode.TOPIC_NAME_INVALID
        )
    # Will Delay is a property of the will, not of the message it becomes.
    message_props = will.properties
    if message_props.will_delay_interval is not None:
        message_props = dataclasses.replace(message_props, will_delay_interval=None)
    will_publish = Publish(
        topic=will.topic,
        payload=will.payload,
        qos=will.qos,
        retain=will.retain,
        properties=message_props,
    )
    # The will becomes a publish of this client: checked like one, now, while the CONNACK can
    # still refuse it (ACL, "$" topics, payload limit) [MQTT-3.2.2-12].
    refusal, event = broker.tenancy.refuse_publish(conn, will_publish, action="will")
    if event is not None:
        broker.log_events((event,))
    if refusal is not None:
        conn.refuse(refusal if v5 else ConnackCode311.NOT_AUTHORIZED)
        return False
    conn.keep_will(will_publish, will.properties.will_delay_interval or 0)
    return True


def handle_publish(broker: Broker, conn: Connection, packet: Publish, now: float) -> None:
    # The per-publish hot path: keep it flat.
    qos = packet.qos
    pid = packet.packet_id
    if qos == _QOS2 and pid is not None and pid in broker.session_of[conn].awaiting_rel:
        # A resent QoS 2 PUBLISH we already accepted: acknowledge again, deliver once
        # [MQTT-4.3.3-10] (states.Flow.IN_QOS2 on PUBLISH_QOS2).
        conn.ack_again(pid)
        return
    topic = packet.topic
    tenancy = broker.tenancy
    if topic[0] == "$" or conn.acl is not ALLOW_ALL or conn.max_payload or tenancy.blocked:
        refusal, event = tenancy.refuse_publish(conn, packet)
        if event is not None:
            broker.log_events((event,))
        if refusal is not None:
            if (
                refusal == ReasonCode.QUOTA_EXCEEDED
                and qos != _QOS0
                and conn.version != _V5
                and conn.tenant in tenancy.blocked
            ):
                # 3.1.1 cannot refuse a QoS 1/2 publish: leave it unacknowledged and close.
                conn.close(None)
                return
            conn.ack_refused(packet, refusal)
            return
    if broker.journal_refusal and not (
        # The lake's commit notice is not journaled, and it is what lets retention free a
        # full journal: never refuse it.
        conn.operator and topic.startswith(JOURNAL_CONTROL_TOPIC_PREFIX)
    ):
        broker.refuse_for_journal(conn, packet)
        return
    if conn.rate:
        pause = conn.take_token(now)
        if pause:
            # Over its message rate: stop reading from this client for a while (it is slowed,
            # nothing it sent is dropped). Publishes later in the same read overdraw the
            # bucket further; the read after the resume pays for them.
            broker.pause(conn, PAUSED_BY_RATE)
            broker.rate_paused.add(conn)
            broker.wake_at(conn.resume_at)  # broker.tick resumes it then
    stats = broker.stats
    size = len(packet.payload)
    stats.messages_in += 1
    stats.bytes_in += size
    usage = conn.usage
    usage.messages_in += 1
    usage.bytes_in += size
    sent = stats.messages_out
    seq = broker.accept(conn.tenant, conn.client_id, packet, conn.client_id, conn.version)
    if usage.messages_in >= usage.check_messages_in or usage.bytes_in >= usage.check_bytes_in:
        # The local quota: this publish brought the tenant's day to a limit (the next ones are
        # refused like under a blocked decision) or to a report point (its counters go out
        # now, from the broker's tick): broker_edge.localquota.
        broker.log_events(tenancy.restop(conn.tenant))
        if tenancy.report_due:
            broker.wake_at(now)
    if qos == _QOS0:
        if packet.wire is not None:  # no DUP, RETAIN or properties: a run may follow
            _publish_run(broker, conn, packet, stats.messages_out - sent)
        return
    assert pid is not None
    if qos == _QOS2:
        broker.session_of[conn].hold_rel(pid)
    # Acknowledged once the journal has it, with the rest of the turn (Broker.receive).
    acks = conn.durable_acks
    if acks is None:
        conn.durable_acks = [(seq, pid, qos)]
    else:
        acks.append((seq, pid, qos))
    if packet.wire is not None and qos != _QOS2:
        _publish_run(broker, conn, packet, stats.messages_out - sent)


def _publish_run(broker: Broker, conn: Connection, first: Publish, fanout: int) -> None:
    """Take the publishes that follow ``first`` (QoS 0 or 1, no DUP, RETAIN or properties) on
    its topic at its QoS in this read as one run: counted, journaled, routed and (QoS 1)
    acknowledged as handle_publish would take each of them, in one go (``Broker.accept_run``).
    ``fanout``: the deliveries ``first`` made (each of the run makes as many). The run stops
    short of the local quota's next check (that publish goes through handle_publish, which
    looks at the quota), and where the turn would have ended taking them one by one
    (``Broker.receive``: the publish whose deliveries go over the turn's budget is the
    last).

    Only when nothing about the client or the broker looks at each publish: the checks of
    handle_publish's first lines, the rate limit, the operator's control topics and the
    sessions adopted from a peer are all for a publish at a time."""
    if (
        first.topic[0] == "$"
        or conn.acl is not ALLOW_ALL
        or conn.max_payload
        or conn.rate
        or conn.operator
        or broker.tenancy.blocked
        or broker.moves.adopted
    ):
        return
    usage = conn.usage
    max_count = min(usage.check_messages_in - usage.messages_in - 1, RUN_MAX)
    if fanout:
        left = broker.turn_ends - broker.stats.messages_out
        if left < 0:
            return  # the turn ends after ``first``
        max_count = min(max_count, left // fanout + 1)
    max_bytes = usage.check_bytes_in - usage.bytes_in - 1
    if max_count <= 0 or max_bytes < 0:
        return
    run = conn.take_run(first, max_count, max_bytes)
    if run is None:
        return
    payloads, pids, packets = run
    count = len(payloads)
    size = sum(map(len, payloads))
    stats = broker.stats
    stats.messages_in += count
    stats.bytes_in += size
    usage.messages_in += count
    usage.bytes_in += size
    seq = broker.accept_run(
        conn.tenant, conn.client_id, first.topic, first.qos, payloads, size, packets, conn.version
    )
    if pids:
        acks = conn.durable_acks
        assert acks is not None  # first's
        acks += zip(range(seq, seq + count), pids, itertools.repeat(1))


def conn_session(broker: Broker, conn: Connection) -> Session:
    """The session of a connected client (the broker keeps which is whose)."""
    return broker.session_of[conn]


def handle_ack(
    broker: Broker, conn: Connection, packet: Puback | Pubrec | Pubcomp, now: float
) -> None:
    """PUBACK, PUBREC or PUBCOMP: the client acknowledged a delivery (states.Flow.OUT_*)."""
    event = ACK_EVENTS[type(packet)]
    session = broker.session_of[conn]
    pid = packet.packet_id
    out = None if session.clean else session.inflight.get(pid)
    before = out.state if out is not None else None
    done = broker.router.acked(session, pid, event)
    if done:
        ended = pid not in session.inflight
        if out is not None and (ended or out.state is not before) and _crossed(broker, out):
            # broker_edge.receipts: ended (PUBACK, PUBCOMP), or received (PUBREC: its PUBREL
            # waits for the record, so the client never has it released before it is durable)
            broker.log_received_done(session, out, ended=ended)
        if event is _PUBREC:
            conn.send(Pubrel(packet_id=packet.packet_id))  # [MQTT-4.3.3-3]
            return
    if event is _PUBACK and session.clean:
        # The plain PUBACKs behind this one, taken at once (a clean session has no receipts
        # to log); what waits in the queue is drained once, after all of them.
        pids = conn.take_pubacks(RUN_MAX)
        if pids is not None:
            acked = broker.router.acked
            for other in pids:
                done = acked(session, other, event) or done
    if done and session.queue:  # most acks: nothing waits
        broker.outbox.drain(session)


def _crossed(broker: Broker, out: Outbound) -> bool:
    """Whether ``out``'s message came from a peer (broker_edge.mesh)."""
    origin = out.message.origin
    return bool(origin) and origin != broker.node_id


def handle_pubrel(broker: Broker, conn: Connection, packet: Pubrel, now: float) -> None:
    """The inbound QoS 2 exchange ends (states.Flow.IN_QOS2 on PUBREL) [MQTT-4.3.3-11]."""
    session = conn_session(broker, conn)
    conn.released(packet.packet_id, session.release_rel(packet.packet_id))


def handle_subscribe(broker: Broker, conn: Connection, packet: Subscribe, now: float) -> None:
    v5 = conn.version == _V5
    codes: list[int] = []
    accepted: list[tuple[str | None, str, Subscription]] = []
    ids = packet.properties.subscription_identifiers
    session = conn_session(broker, conn)
    held = set(session.subscriptions)
    capped = False  # a filter refused for max_subscriptions_per_client
    settings = broker.settings
    for sub in packet.subscriptions:
        try:
            group, topic_filter = parse_subscription_filter(sub.topic_filter)
        except InvalidTopic:
            codes.append(ReasonCode.TOPIC_FILTER_INVALID if v5 else SUBACK_FAILURE_311)
            continue
        refusal: int | None = None
        if topic_filter.count("/") >= settings.max_topic_levels:
            refusal = ReasonCode.TOPIC_FILTER_INVALID
        elif sub.topic_filter not in held and len(held) >= settings.max_subscriptions_per_client:
            # Each filter costs every publish in the namespace a walk of its levels.
            refusal = ReasonCode.QUOTA_EXCEEDED
            capped = True
        if refusal is not None:
            codes.append(refusal if v5 else SUBACK_FAILURE_311)
            continue
        if group is not None and sub.no_local:
            # No Local on a shared subscription is a protocol error [MQTT-3.8.3-4].
            raise ProtocolError("no-local on a shared subscription", ReasonCode.PROTOCOL_ERROR)
        if not conn.acl.may_subscribe(topic_filter):
            broker.log(
                conn.tenant,
                "acl_denied",
                conn.client_id,
                {"action": "subscribe", "topic_filter": sub.topic_filter},
            )
            codes.append(ReasonCode.NOT_AUTHORIZED if v5 else SUBACK_FAILURE_311)
            continue
        codes.append(int(sub.qos))
        accepted.append((group, topic_filter, sub))
        held.add(sub.topic_filter)
    # SUBACK before the retained messages the subscriptions bring [MQTT-3.8.4-1].
    conn.send(Suback(packet_id=packet.packet_id, reason_codes=tuple(codes)))
    broker.subscribe(conn, session, accepted, ids[0] if ids else None)
    if capped:
        # One event per SUBSCRIBE, not per filter refused: the log costs the journal too.
        broker.log(
            conn.tenant,
            "limit_exceeded",
            conn.client_id,
            {
                "limit": "max_subscriptions_per_client",
                "value": settings.max_subscriptions_per_client,
            },
        )
    filters = [s.topic_filter for s in packet.subscriptions]
    details = subscribe_details(filters, [int(c) for c in codes])
    broker.log(conn.tenant, "subscribe", conn.client_id, details)


def handle_unsubscribe(broker: Broker, conn: Connection, packet: Unsubscribe, now: float) -> None:
    found = broker.unsubscribe(conn, conn_session(broker, conn), packet.topic_filters)
    v5 = conn.version == _V5
    codes = tuple(0 if f else ReasonCode.NO_SUBSCRIPTION_EXISTED for f in found) if v5 else ()
    conn.send(Unsuback(packet_id=packet.packet_id, reason_codes=codes))
    broker.log(
        conn.tenant,
        "unsubscribe",
        conn.client_id,
        {"topic_filters": list(packet.topic_filters), "found": found},
    )


def handle_disconnect(broker: Broker, conn: Connection, packet: Disconnect, now: float) -> None:
    expiry = packet.properties.session_expiry_interval
    if expiry is not None and conn.version == _V5:
        # The client may change its session's expiry on the way out [MQTT-3.14.2.2.2], but not
        # make a session persistent that it opened with 0 [MQTT-3.14.2-2]: that is a protocol
        # error, answered with DISCONNECT 0x82, and the will is published.
        broker.set_session_expiry(conn, conn_session(broker, conn), expiry)
    conn.peer_disconnected(packet.reason_code)


HANDLERS: dict[type, Callable[[Broker, Connection, object, float], None]] = {
    Connect: handle_connect,  # type: ignore[dict-item]
    Publish: handle_publish,  # type: ignore[dict-item]
    Puback: handle_ack,  # type: ignore[dict-item]
    Pubrec: handle_ack,  # type: ignore[dict-item]
    Pubcomp: handle_ack,  # type: ignore[dict-item]
    Pubrel: handle_pubrel,  # type: ignore[dict-item]
    Subscribe: handle_subscribe,  # type: ignore[dict-item]
    Unsubscribe: handle_unsubscribe,  # type: ignore[dict-item]
    Disconnect: handle_disconnect,  # type: ignore[dict-item]
}
