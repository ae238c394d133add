"""The connection machine alone (issue 10): no broker, no socket, no clock, no sleep.

Bytes go in (whole, byte by byte, with trailing data), events come out; events go in, bytes
come out. The QoS 1 and 2 flows are driven both ways through broker_edge.states' table.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker_edge.codec import Decoder, encode
from broker_edge.connection import Connection, ConnLimits, ConnState, TopicCache
from broker_edge.errors import LocalProtocolError, ProtocolError
from broker_edge.message import Message
from broker_edge.packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Properties,
    ProtocolVersion,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    QoS,
    ReasonCode,
    Subscribe,
    Subscription,
)
from broker_edge.settings import EdgeSettings
from broker_edge.states import (
    FLOW_STEPS,
    RECEIVABLE,
    ConnEvent,
    Flow,
    FlowEvent,
    conn_step,
    local_step,
    peer_ack,
    receivable,
)

V4 = ProtocolVersion.MQTT_3_1_1
V5 = ProtocolVersion.MQTT_5


def machine(**settings: object) -> Connection:
    limits = ConnLimits.of(EdgeSettings(node_id="unit", **settings))  # type: ignore[arg-type]
    return Connection("test:1", 0.0, limits, TopicCache())


def events(conn: Connection, data: bytes, *, split: bool) -> list[Packet]:
    """Feed ``data`` whole or one byte at a time; every event it completes."""
    chunks: Iterator[bytes] = (data[i : i + 1] for i in range(len(data))) if split else iter([data])
    out: list[Packet] = []
    for chunk in chunks:
        conn.receive_data(chunk, 0.0)
        while (event := conn.next_event()) is not None:
            out.append(event)
    return out


def replies(conn: Connection, version: ProtocolVersion) -> list[Packet]:
    decoder = Decoder(protocol_version=version)
    decoder.feed(conn.data_to_send())
    return list(decoder.packets())


def connected(version: ProtocolVersion = V4, **settings: object) -> Connection:
    conn = machine(**settings)
    (connect,) = events(
        conn, encode(Connect(client_id="c", protocol_version=version), version), split=False
    )
    assert isinstance(connect, Connect)
    conn.connect_received(version, "c", connect.keepalive)
    conn.accept(False, None, -1, connect.properties if version == V5 else None)
    assert isinstance(replies(conn, version)[0], Connack)
    return conn


@pytest.mark.parametrize("split", [False, True], ids=["whole", "byte-by-byte"])
@pytest.mark.parametrize("version", [V4, V5])
def test_connect_publish_subscribe_come_out_as_events(
    split: bool, version: ProtocolVersion
) -> None:
    conn = machine()
    packets: list[Packet] = [
        Connect(client_id="c", protocol_version=version, keepalive=30),
        Publish(topic="a/b", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=1),
    ]
    data = b"".join(encode(p, version) for p in packets)
    (connect,) = events(conn, encode(packets[0], version), split=split)
    assert connect == packets[0]
    assert conn.state is ConnState.AWAIT_CONNECT  # until we accept
    conn.connect_received(version, "c", 30)
    conn.accept(False, None, -1, Properties() if version == V5 else None)
    assert conn.state is ConnState.CONNECTED
    rest = data[len(encode(packets[0], version)) :] + encode(
        Subscribe(packet_id=2, subscriptions=(Subscription("a/#", QoS.AT_LEAST_ONCE),)), version
    )
    got = events(conn, rest, split=split)
    assert [type(p) for p in got] == [Publish, Subscribe]
    assert conn.inbound_unacked == 1  # Flow.IN_QOS1 opened


def test_trailing_half_packet_waits_for_its_rest() -> None:
    conn = connected()
    one = encode(Publish(topic="t", payload=b"1"), V4)
    two = encode(Publish(topic="t", payload=b"2"), V4)
    assert [p.payload for p in events(conn, one + two[:3], split=False)] == [b"1"]  # type: ignore[attr-defined]
    assert [p.payload for p in events(conn, two[3:], split=False)] == [b"2"]  # type: ignore[attr-defined]


def test_pingreq_is_answered_by_the_machine_itself() -> None:
    conn = connected()
    assert events(conn, encode(Pingreq(), V4), split=True) == []
    assert replies(conn, V4) == [Pingresp()]


@pytest.mark.parametrize("packet", [Pingreq(), Publish(topic="t", payload=b"")])
def test_anything_but_connect_first_is_the_peers_protocol_error(packet: Packet) -> None:
    conn = machine()
    with pytest.raises(ProtocolError):
        events(conn, encode(packet, V4), split=False)


def test_a_second_connect_is_the_peers_protocol_error() -> None:
    conn = connected()
    with pytest.raises(ProtocolError):
        events(conn, encode(Connect(client_id="c"), V4), split=False)


def test_auth_is_refused_no_method_is_offered() -> None:
    conn = connected(V5)
    with pytest.raises(ProtocolError) as info:
        events(conn, encode(Auth(), V5), split=False)
    assert info.value.reason_code == ReasonCode.PROTOCOL_ERROR


def test_receive_maximum_is_counted_by_the_machine() -> None:
    conn = connected(V5, max_inflight_messages=2)
    data = b"".join(
        encode(Publish(topic="t", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=i), V5)
        for i in (1, 2, 3)
    )
    with pytest.raises(ProtocolError) as info:
        events(conn, data, split=False)
    assert info.value.reason_code == ReasonCode.RECEIVE_MAXIMUM_EXCEEDED


def test_topic_alias_resolved_in_the_event() -> None:
    conn = connected(V5)
    first = Publish(topic="long/topic", payload=b"1", properties=Properties(topic_alias=1))
    second = Publish(topic="", payload=b"2", properties=Properties(topic_alias=1))
    got = events(conn, encode(first, V5) + encode(second, V5), split=True)
    assert [p.topic for p in got] == ["long/topic", "long/topic"]  # type: ignore[attr-defined]


def test_inbound_qos1_flow_puback_once_durable() -> None:
    conn = connected()
    events(
        conn,
        encode(Publish(topic="t", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=7), V4),
        split=False,
    )
    assert conn.data_to_send() == b""  # nothing before the journal says durable
    assert conn.ack_durable(7, 1)  # first output: the wiring has this connection to flush
    assert replies(conn, V4) == [Puback(packet_id=7)]
    assert conn.inbound_unacked == 0


def test_inbound_qos2_flow_pubrec_then_pubrel_pubcomp() -> None:
    conn = connected(V5)
    events(
        conn,
        encode(Publish(topic="t", payload=b"x", qos=QoS.EXACTLY_ONCE, packet_id=9), V5),
        split=False,
    )
    conn.ack_durable(9, 2)
    assert replies(conn, V5) == [Pubrec(packet_id=9)]
    (rel,) = events(conn, encode(Pubrel(packet_id=9), V5), split=True)
    assert rel == Pubrel(packet_id=9)
    conn.released(9, True)
    assert replies(conn, V5) == [Pubcomp(packet_id=9)]
    assert conn.inbound_unacked == 0
    conn.released(10, False)  # a PUBREL for nothing open: v5 says so [MQTT-3.7.2.1]
    assert replies(conn, V5) == [
        Pubcomp(packet_id=10, reason_code=ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)
    ]


def test_inbound_refused_when_the_journal_frame_failed() -> None:
    conn = connected(V5)
    events(
        conn,
        encode(Publish(topic="t", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=3), V5),
        split=False,
    )
    assert conn.refuse_undurable(3, 1)
    assert replies(conn, V5) == [Puback(packet_id=3, reason_code=ReasonCode.UNSPECIFIED_ERROR)]
    old = connected(V4)
    assert old.refuse_undurable(3, 1)  # 3.1.1 has no negative ack: close, the client resends
    assert old.closing


def test_outbound_publish_bytes_and_the_shared_qos0_encoding() -> None:
    conn = connected()
    message = Message("t", "a/b", b"hello", QoS.AT_MOST_ONCE, False, "p", 1)
    assert conn.deliver_qos0(message, False)
    other = connected()
    assert other.deliver_qos0(message, False)
    assert message.enc_key == V4 * 2  # encoded once for both, in the message's own slot
    assert message.encoded is None  # no dict for one encoding
    v5 = connected(V5)
    v5.deliver_qos0(message, False)
    assert message.encoded is not None
    assert list(message.encoded) == [V5 * 2]  # a second version: the dict
    (got,) = replies(conn, V4)
    assert got == Publish(topic="a/b", payload=b"hello")
    data = conn.publish_bytes(message, 1, False, 5, True, (), 1)
    assert data == encode(
        Publish(topic="a/b", payload=b"hello", qos=QoS.AT_LEAST_ONCE, packet_id=5, dup=True), V4
    )


def test_disconnect_drops_the_will_unless_asked_to_keep_it() -> None:
    conn = connected(V5)
    will = Publish(topic="w", payload=b"bye")
    conn.keep_will(will)
    (packet,) = events(
        conn, encode(Disconnect(reason_code=ReasonCode.DISCONNECT_WITH_WILL), V5), split=False
    )
    conn.peer_disconnected(packet.reason_code)  # type: ignore[attr-defined]
    assert conn.will is will
    assert conn.clean_disconnect
    assert conn.closing
    assert conn.next_event() is None  # nothing is read after a DISCONNECT


def test_close_sends_disconnect_then_closes_once_flushed() -> None:
    conn = connected(V5)
    assert conn.close(0x8D)
    assert not conn.close(0x8D)  # once
    assert replies(conn, V5) == [Disconnect(reason_code=0x8D)]
    assert conn.closed()  # the wiring closes the transport now
    assert conn.state is ConnState.CLOSED
    assert not conn.closed()
    assert not conn.emit(b"late")  # nothing is written after the close


def test_deadline_says_when_the_clock_is_needed() -> None:
    conn = machine(connect_timeout=10.0)
    assert conn.deadline() == 10.0  # the CONNECT timeout
    conn = connected()
    assert conn.deadline() == 90.0  # 1.5 x keepalive 60 after the last read [MQTT-3.1.2-24]
    conn.receive_data(b"", 4.0)
    assert conn.deadline() == 4.0 + 90.0
    conn.connect_received(V4, "c", 0)
    assert conn.deadline() == float("inf")  # keepalive 0: never


def test_pause_and_resume_say_when_the_transport_must_act() -> None:
    conn = connected()
    assert conn.pause(1)
    assert not conn.pause(2)  # already paused
    assert not conn.resume(1)  # 2 still holds
    assert conn.resume(2)
    assert not conn.resume(2)


# -- the table -------------------------------------------------------------------------------


def test_the_qos_flows_both_ways_through_the_table() -> None:
    # inbound QoS 1: PUBLISH, durable
    assert (
        local_step(peer_ack(Flow.DONE, FlowEvent.PUBLISH_QOS1) or Flow.DONE, FlowEvent.DURABLE)
        is Flow.DONE
    )
    # inbound QoS 2: PUBLISH, (resent PUBLISH), durable, PUBREL
    flow = FLOW_STEPS[Flow.DONE][FlowEvent.PUBLISH_QOS2]
    assert peer_ack(flow, FlowEvent.PUBLISH_QOS2) is Flow.IN_QOS2  # [MQTT-4.3.3-10]
    flow = local_step(flow, FlowEvent.DURABLE)
    assert peer_ack(flow, FlowEvent.PUBREL) is Flow.DONE
    assert local_step(Flow.IN_QOS2, FlowEvent.REFUSED) is Flow.DONE  # PUBREC >= 0x80 [MQTT-4.3.3-4]
    # outbound QoS 1 and 2
    assert peer_ack(local_step(Flow.DONE, FlowEvent.SENT_QOS1), FlowEvent.PUBACK) is Flow.DONE
    flow = local_step(Flow.DONE, FlowEvent.SENT_QOS2)
    flow = peer_ack(flow, FlowEvent.PUBREC) or Flow.DONE
    assert flow is Flow.OUT_AWAIT_PUBCOMP
    assert peer_ack(flow, FlowEvent.PUBREC) is Flow.OUT_AWAIT_PUBCOMP  # PUBREL again
    assert peer_ack(flow, FlowEvent.PUBCOMP) is Flow.DONE


def test_steps_the_table_lacks_say_who_broke_the_protocol() -> None:
    assert peer_ack(Flow.OUT_AWAIT_PUBACK, FlowEvent.PUBCOMP) is None  # a stray ack: ignored
    with pytest.raises(LocalProtocolError):
        local_step(Flow.OUT_AWAIT_PUBACK, FlowEvent.DURABLE)  # our bug
    with pytest.raises(LocalProtocolError):
        conn_step(ConnState.CONNECTED, ConnEvent.ACCEPTED)  # a second CONNACK: our bug
    with pytest.raises(ProtocolError):
        receivable(ConnState.AWAIT_CONNECT, Publish)  # the peer's
    receivable(ConnState.CONNECTED, Publish)


def test_every_flow_state_has_a_way_out() -> None:
    for flow, steps in FLOW_STEPS.items():
        seen = {flow}
        todo = list(steps.values())
        while todo:
            nxt = todo.pop()
            if nxt not in seen:
                seen.add(nxt)
                todo.extend(FLOW_STEPS[nxt].values())
        assert Flow.DONE in seen or flow is Flow.DONE, flow
    assert RECEIVABLE[ConnState.CLOSED] == frozenset()
