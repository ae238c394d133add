"""MQTT 5.0 behaviour the edge already offers, with real paho v5 clients."""

from __future__ import annotations

import queue
import socket

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

TIMEOUT = 10.0


def _v5(edge, client_id: str = "") -> tuple[mqtt.Client, queue.Queue]:
    inbox: queue.Queue = queue.Queue()
    connected: queue.Queue = queue.Queue()
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
    )
    client.on_connect = lambda c, u, flags, rc, props: connected.put((rc, props))
    client.on_message = lambda c, u, m: inbox.put(m)
    client.connect("127.0.0.1", edge.port)
    client.loop_start()
    rc, props = connected.get(timeout=TIMEOUT)
    assert not rc.is_failure
    client.connack_properties = props
    return client, inbox


def _subscribe(client: mqtt.Client, topic_filter: str, options: SubscribeOptions) -> list:
    granted: queue.Queue = queue.Queue()
    client.on_subscribe = lambda c, u, mid, codes, props: granted.put(codes)
    client.subscribe(topic_filter, options=options)
    return granted.get(timeout=TIMEOUT)


def test_assigned_client_identifier(edge):
    client, _ = _v5(edge, client_id="")
    try:
        assigned = client.connack_properties.AssignedClientIdentifier
        assert assigned.startswith("edgebus-")
    finally:
        client.disconnect()
        client.loop_stop()


def test_properties_are_forwarded_and_no_local_honoured(edge):
    sub, inbox = _v5(edge, "v5-sub")
    pub, _ = _v5(edge, "v5-pub")
    try:
        codes = _subscribe(sub, "v5/#", SubscribeOptions(qos=1, noLocal=True))
        assert codes[0].value == 1
        props = Properties(PacketTypes.PUBLISH)
        props.ContentType = "application/json"
        props.UserProperty = [("vehicle", "v1"), ("fw", "2.1")]
        props.ResponseTopic = "v5/replies"
        props.CorrelationData = b"\x01\x02"
        pub.publish("v5/data", b'{"a":1}', qos=1, properties=props).wait_for_publish(TIMEOUT)
        msg = inbox.get(timeout=TIMEOUT)
        assert msg.payload == b'{"a":1}'
        assert msg.properties.ContentType == "application/json"
        assert msg.properties.UserProperty == [("vehicle", "v1"), ("fw", "2.1")]
        assert msg.properties.ResponseTopic == "v5/replies"
        assert msg.properties.CorrelationData == b"\x01\x02"
        # no-local: the subscriber's own publish does not come back [MQTT-3.8.3-3].
        sub.publish("v5/own", b"mine", qos=1).wait_for_publish(TIMEOUT)
        pub.publish("v5/other", b"theirs", qos=1).wait_for_publish(TIMEOUT)
        assert inbox.get(timeout=TIMEOUT).payload == b"theirs"
        assert inbox.empty()
    finally:
        for client in (sub, pub):
            client.disconnect()
            client.loop_stop()


def test_retain_handling_do_not_send(edge):
    pub, _ = _v5(edge, "rh-pub")
    sub, inbox = _v5(edge, "rh-sub")
    try:
        pub.publish("rh/a", b"kept", qos=1, retain=True).wait_for_publish(TIMEOUT)
        _subscribe(sub, "rh/#", SubscribeOptions(qos=1, retainHandling=2))
        pub.publish("rh/b", b"live", qos=1).wait_for_publish(TIMEOUT)
        assert inbox.get(timeout=TIMEOUT).payload == b"live"
        assert inbox.empty()
    finally:
        for client in (sub, pub):
            client.disconnect()
            client.loop_stop()


def test_malformed_v5_packet_gets_disconnect_with_reason(edge):
    sock = socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT)
    try:
        # v5 CONNECT: "MQTT", level 5, clean start, keepalive 60, no properties, id "m".
        body = b"\x00\x04MQTT\x05\x02\x00\x3c\x00\x00\x01m"
        sock.sendall(bytes([0x10, len(body)]) + body)
        connack = sock.recv(64)
        assert connack[0] == 0x20
        assert connack[3] == 0x00
        sock.sendall(b"\x30\x03\x00\x05a")  # topic length beyond the packet: malformed
        data = b""
        while len(data) < 3:
            chunk = sock.recv(64)
            if not chunk:
                break
            data += chunk
        assert data[0] == 0xE0, data  # DISCONNECT
        assert data[2] == 0x81  # Malformed Packet
        assert sock.recv(64) == b""  # then closed
    finally:
        sock.close()
