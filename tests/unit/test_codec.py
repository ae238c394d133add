"""The sans-IO MQTT codec: round trips, golden bytes, and every rule the decoder enforces.

Every valid input is decoded three ways (whole, byte by byte, and followed by half of the next
packet) and must give the same packets each way.
"""

from __future__ import annotations

import pytest

from broker_edge import codec
from broker_edge.codec import DEFAULT_MAX_PACKET_SIZE, Decoder, encode, encode_publish
from broker_edge.errors import (
    LocalProtocolError,
    MalformedPacket,
    PacketTooLarge,
    ProtocolError,
    UnsupportedProtocol,
)
from broker_edge.packets import (
    NO_PROPERTIES,
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
    RetainHandling,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
)

V31 = ProtocolVersion.MQTT_3_1
V3 = ProtocolVersion.MQTT_3_1_1
V5 = ProtocolVersion.MQTT_5

# A packet that is valid in every version, used as "the next packet" after the one under test.
NEXT = Publish("next/topic", b"payload", QoS.AT_LEAST_ONCE, packet_id=9)


def decoder_for(version: ProtocolVersion, packet: Packet | None = None) -> Decoder:
    """A server-side decoder learns the version from CONNECT; anything else needs it set."""
    return Decoder(protocol_version=None if isinstance(packet, Connect) else version)


def decode_whole(data: bytes, decoder: Decoder) -> list[Packet]:
    decoder.feed(data)
    return list(decoder.packets())


def decode_bytewise(data: bytes, decoder: Decoder) -> list[Packet]:
    packets: list[Packet] = []
    for i in range(len(data)):
        decoder.feed(data[i : i + 1])
        packets.extend(decoder.packets())
    return packets


def decode_three_ways(data: bytes, version: ProtocolVersion, first: Packet | None) -> list[Packet]:
    """Decode whole, byte by byte, and with half of a following packet; all must agree."""
    whole = decode_whole(data, decoder_for(version, first))
    assert decode_bytewise(data, decoder_for(version, first)) == whole
    decoder = decoder_for(version, first)
    following = encode(NEXT, version)
    half = len(following) // 2
    assert decode_whole(data + following[:half], decoder) == whole
    assert decoder.buffered == half
    assert decoder.next_packet() is None
    assert decode_whole(following[half:], decoder) == [NEXT]
    assert decoder.buffered == 0
    return whole


def assert_round_trip(packet: Packet, version: ProtocolVersion) -> bytes:
    data = encode(packet, version)
    assert decode_three_ways(data, version, packet) == [packet]
    return data


def assert_rejected(
    data: bytes,
    version: ProtocolVersion | None,
    error: type[ProtocolError],
    reason: ReasonCode,
) -> None:
    """Rejected whole and byte by byte, with the same error class and reason code."""
    for feed in (decode_whole, decode_bytewise):
        with pytest.raises(error) as info:
            feed(data, Decoder(protocol_version=version))
        assert type(info.value) is error
        assert info.value.reason_code == reason


MALFORMED = ReasonCode.MALFORMED_PACKET
PROTOCOL = ReasonCode.PROTOCOL_ERROR
TOPIC_ALIAS = ReasonCode.TOPIC_ALIAS_INVALID


# -- round trips ---------------------------------------------------------------------------------

FULL_PUBLISH_PROPS = Properties(
    payload_format_indicator=1,
    message_expiry_interval=3600,
    content_type="application/json",
    response_topic="reply/here",
    correlation_data=b"\x00\x01corr",
    subscription_identifiers=(1, 268_435_455, 300),
    topic_alias=7,
    user_properties=(("k", "v"), ("k", "v2"), ("ключ", "значение")),
)
CONNECT_PROPS = Properties(
    session_expiry_interval=0xFFFF_FFFF,
    receive_maximum=20,
    maximum_packet_size=1024,
    topic_alias_maximum=10,
    request_response_information=1,
    request_problem_information=0,
    authentication_method="SCRAM-SHA-1",
    authentication_data=b"client-first",
    user_properties=(("a", "b"),),
)
WILL_PROPS = Properties(
    will_delay_interval=30,
    payload_format_indicator=0,
    message_expiry_interval=10,
    content_type="text/plain",
    response_topic="will/reply",
    correlation_data=b"c",
    user_properties=(("w", "1"),),
)
CONNACK_PROPS = Properties(
    session_expiry_interval=60,
    receive_maximum=100,
    maximum_qos=1,
    retain_available=0,
    maximum_packet_size=65536,
    assigned_client_identifier="auto-123",
    topic_alias_maximum=5,
    reason_string="welcome",
    user_properties=(("x", "y"),),
    wildcard_subscription_available=1,
    subscription_identifier_available=1,
    shared_subscription_available=0,
    server_keep_alive=30,
    response_information="resp/",
    server_reference="other:1883",
    authentication_method="SCRAM-SHA-1",
    authentication_data=b"server-final",
)
REASON_PROPS = Properties(reason_string="because", user_properties=(("a", "1"), ("a", "2")))

BOTH_VERSIONS = [
    Connect("client-1"),
    Connect("", clean_start=False, keepalive=0),
    Connect(
        "c2",
        keepalive=65535,
        will=Will("will/topic", b"gone", QoS.EXACTLY_ONCE, retain=True),
        username="user",
        password=b"\x00secret\xff",
    ),
    Connect("c3", username="only-user"),
    Connack(),
    Connack(session_present=True),
    Publish("a/b"),
    Publish("a/b", b"x" * 300, QoS.AT_LEAST_ONCE, retain=True, packet_id=1),
    Publish("a/b", b"\x00\xff", QoS.EXACTLY_ONCE, dup=True, packet_id=65535),
    Publish("ünïcödé/🌍", b"payload"),
    Puback(1),
    Pubrec(2),
    Pubrel(3),
    Pubcomp(65535),
    Subscribe(10, (Subscription("a/+", QoS.AT_LEAST_ONCE), Subscription("#"))),
    Suback(10, (0, 1, 2, 0x80)),
    Unsubscribe(11, ("a/+", "b/#")),
    Pingreq(),
    Pingresp(),
    Disconnect(),
]

V3_ONLY = [
    Connack(reason_code=0x05),
    Unsuback(11),
]

V5_ONLY = [
    Connect("c5", properties=CONNECT_PROPS),
    Connect(
        "c6",
        will=Will("w", b"p", QoS.AT_LEAST_ONCE, False, WILL_PROPS),
        password=b"password-without-user-is-fine-in-5",
    ),
    Connack(reason_code=ReasonCode.NOT_AUTHORIZED),
    Connack(session_present=True, properties=CONNACK_PROPS),
    Publish("a/b", b"p", QoS.AT_LEAST_ONCE, packet_id=5, properties=FULL_PUBLISH_PROPS),
    Publish("", b"aliased", properties=Properties(topic_alias=3)),
    Puback(1, ReasonCode.NO_MATCHING_SUBSCRIBERS),
    Puback(1, 0, REASON_PROPS),
    Pubrec(2, ReasonCode.QUOTA_EXCEEDED, REASON_PROPS),
    Pubrel(3, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND),
    Pubcomp(4, 0, REASON_PROPS),
    Subscribe(
        12,
        (
            Subscription("a", QoS.EXACTLY_ONCE, True, True, RetainHandling.DO_NOT_SEND),
            Subscription(
                "b", QoS.AT_MOST_ONCE, False, True, RetainHandling.SEND_IF_NEW_SUBSCRIPTION
            ),
        ),
        Properties(subscription_identifiers=(42,), user_properties=(("u", "v"),)),
    ),
    Suback(12, (0, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2), REASON_PROPS),
    Unsubscribe(13, ("x",), Properties(user_properties=(("u", "v"),))),
    Unsuback(13, (0x00, 0x11, 0x80), REASON_PROPS),
    Disconnect(ReasonCode.DISCONNECT_WITH_WILL),
    Disconnect(
        ReasonCode.SERVER_MOVED,
        Properties(session_expiry_interval=0, reason_string="bye", server_reference="b:1883"),
    ),
    Auth(),
    Auth(ReasonCode.CONTINUE_AUTHENTICATION, Properties(authentication_method="SCRAM-SHA-1")),
    Auth(
        ReasonCode.REAUTHENTICATE,
        Properties(authentication_method="m", authentication_data=b"d", reason_string="r"),
    ),
]


def _name(packet: Packet) -> str:
    return type(packet).__name__


@pytest.mark.parametrize("packet", BOTH_VERSIONS + V3_ONLY, ids=_name)
def test_round_trip_311(packet: Packet) -> None:
    if isinstance(packet, Connect):
        assert_round_trip(packet, V3)
    else:
        assert_round_trip(packet, V3)
        assert_round_trip(packet, V31)  # MQTT 3.1 shares the 3.1.1 formats


@pytest.mark.parametrize("packet", BOTH_VERSIONS + V5_ONLY, ids=_name)
def test_round_trip_5(packet: Packet) -> None:
    if isinstance(packet, Connect):
        packet = Connect(
            packet.client_id,
            V5,
            packet.clean_start,
            packet.keepalive,
            packet.will,
            packet.username,
            packet.password,
            packet.properties,
        )
    elif isinstance(packet, Unsuback) and not packet.reason_codes:
        packet = Unsuback(packet.packet_id, (0,))
    assert_round_trip(packet, V5)


def test_mqtt_31_connect_round_trip() -> None:
    packet = Connect("old-client", V31, username="u", password=b"p")
    data = assert_round_trip(packet, V31)
    assert data[2:11] == b"\x00\x06MQIsdp\x03"


def test_server_decoder_learns_version_from_connect() -> None:
    for version in (V31, V3, V5):
        decoder = Decoder()
        assert decoder.protocol_version is None
        decoder.feed(encode(Connect("c", version), version))
        assert decoder.next_packet() == Connect("c", version)
        assert decoder.protocol_version is version


def test_learned_version_selects_formats_for_later_packets() -> None:
    decoder = Decoder()
    decoder.feed(encode(Connect("c", V5), V5) + b"\x40\x03\x00\x01\x10")
    assert list(decoder.packets()) == [Connect("c", V5), Puback(1, 0x10)]


# -- 3.1.1 drops what its format cannot carry --------------------------------------------------


@pytest.mark.parametrize(
    ("packet", "expected"),
    [
        (Puback(1, ReasonCode.NO_MATCHING_SUBSCRIBERS, REASON_PROPS), b"\x40\x02\x00\x01"),
        (Pubrel(7, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND), b"\x62\x02\x00\x07"),
        (Unsuback(5, (0x11,), REASON_PROPS), b"\xb0\x02\x00\x05"),
        (Disconnect(ReasonCode.SERVER_SHUTTING_DOWN, REASON_PROPS), b"\xe0\x00"),
        (Connack(True, 0, CONNACK_PROPS), b"\x20\x02\x01\x00"),
        (
            Subscribe(1, (Subscription("a", QoS.AT_LEAST_ONCE, True, True, RetainHandling(2)),)),
            b"\x82\x06\x00\x01\x00\x01a\x01",
        ),
        (Publish("t", b"p", properties=FULL_PUBLISH_PROPS), b"\x30\x04\x00\x01tp"),
    ],
    ids=_name,
)
def test_311_drops_properties_and_reason_codes(packet: Packet, expected: bytes) -> None:
    assert encode(packet, V3) == expected


@pytest.mark.parametrize(
    ("packet", "expected"),
    [
        (Puback(1), b"\x40\x02\x00\x01"),  # reason code and properties omitted (3.4.2.1)
        (Puback(1, 0x10), b"\x40\x03\x00\x01\x10"),
        (Disconnect(), b"\xe0\x00"),
        (Disconnect(ReasonCode.DISCONNECT_WITH_WILL), b"\xe0\x01\x04"),
        (Auth(), b"\xf0\x00"),
        (Publish("t"), b"\x30\x04\x00\x01t\x00"),
        (Connack(), b"\x20\x03\x00\x00\x00"),
    ],
    ids=_name,
)
def test_v5_short_forms(packet: Packet, expected: bytes) -> None:
    assert encode(packet, V5) == expected


def test_v5_acks_with_explicit_empty_properties_decode() -> None:
    for data in (b"\x40\x04\x00\x01\x00\x00", b"\xe0\x02\x00\x00", b"\xf0\x02\x00\x00"):
        assert len(decode_three_ways(data, V5, None)) == 1


# -- golden bytes --------------------------------------------------------------------------------

# Captured from paho-mqtt 2.2.0: client_id "paho-test", keepalive 60, user "user" / "pw",
# will "will/t" = b"bye" QoS 1 retained; then publish("a/b", b"hi", qos=1), a subscribe and
# a disconnect.
PAHO_311 = bytes.fromhex(
    "102c00044d51545404ee003c00097061686f2d74657374000677696c6c2f7400036279650004757365720002"
    "7077"
    "32090003612f6200016869"
    "820e00020003782f23010003792f2b02"
    "e000"
)
PAHO_5 = bytes.fromhex(
    "103a00044d51545405ee003c0c110000001e2600016100016200097061686f2d7465737400000677696c6c2f74"
    "000362796500047573657200027077"
    "320a0003612f620001006869"
    "820f0002000003782f23010003792f2b02"
    "e000"
)
SUBS = (Subscription("x/#", QoS.AT_LEAST_ONCE), Subscription("y/+", QoS.EXACTLY_ONCE))
PAHO_WILL = Will("will/t", b"bye", QoS.AT_LEAST_ONCE, retain=True)


def test_golden_paho_311_session() -> None:
    expected: list[Packet] = [
        Connect("paho-test", V3, True, 60, PAHO_WILL, "user", b"pw"),
        Publish("a/b", b"hi", QoS.AT_LEAST_ONCE, packet_id=1),
        Subscribe(2, SUBS),
        Disconnect(),
    ]
    assert decode_three_ways(PAHO_311, V3, expected[0]) == expected
    assert b"".join(encode(p, V3) for p in expected) == PAHO_311


def test_golden_paho_5_session() -> None:
    props = Properties(session_expiry_interval=30, user_properties=(("a", "b"),))
    expected: list[Packet] = [
        Connect("paho-test", V5, True, 60, PAHO_WILL, "user", b"pw", props),
        Publish("a/b", b"hi", QoS.AT_LEAST_ONCE, packet_id=1),
        Subscribe(2, SUBS),
        Disconnect(),
    ]
    assert decode_three_ways(PAHO_5, V5, expected[0]) == expected
    assert b"".join(encode(p, V5) for p in expected) == PAHO_5


def test_golden_minimal_connect() -> None:
    data = b"\x10\x15\x00\x04MQTT\x04\x02\x00\x3c\x00\x09paho-test"
    assert encode(Connect("paho-test"), V3) == data
    assert decode_three_ways(data, V3, Connect("x")) == [Connect("paho-test")]


def test_golden_pings() -> None:
    assert encode(Pingreq(), V3) == b"\xc0\x00"
    assert encode(Pingresp(), V5) == b"\xd0\x00"
    assert decode_three_ways(b"\xc0\x00", V3, None) == [Pingreq()]
    assert decode_three_ways(b"\xd0\x00", V5, None) == [Pingresp()]


def test_golden_qos1_publish() -> None:
    packet = Publish("a/b", b"hi", QoS.AT_LEAST_ONCE, packet_id=10)
    assert encode(packet, V3) == b"\x32\x09\x00\x03a/b\x00\x0ahi"
    assert encode(packet, V5) == b"\x32\x0a\x00\x03a/b\x00\x0a\x00hi"


def test_golden_suback_311_return_codes() -> None:
    assert encode(Suback(1, (0, 1, 2, 0x80)), V3) == b"\x90\x06\x00\x01\x00\x01\x02\x80"


def test_remaining_length_boundaries() -> None:
    boundaries = [(127, b"\x7f"), (128, b"\x80\x01"), (16_383, b"\xff\x7f")]
    boundaries.append((16_384, b"\x80\x80\x01"))
    for size, header in boundaries:
        payload = b"p" * (size - 3)
        data = encode(Publish("t", payload), V3)
        assert data[1 : 1 + len(header)] == header
        assert decode_whole(data, Decoder(protocol_version=V3)) == [Publish("t", payload)]


# -- encode_publish ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [V3, V5])
def test_encode_publish_matches_encode(version: ProtocolVersion) -> None:
    props = Properties(subscription_identifiers=(3,))
    for packet in (
        Publish("a/ü", b"x", QoS.AT_LEAST_ONCE, True, True, 77, props),
        Publish("a/ü", b"", QoS.AT_MOST_ONCE, False, False, None),
    ):
        args = (packet.payload, packet.qos, packet.retain, packet.dup, packet.packet_id, version)
        expected = encode(packet, version)
        assert encode_publish(packet.topic, *args, packet.properties) == expected
        assert encode_publish(packet.topic.encode(), *args, packet.properties) == expected
    assert encode_publish("t", b"", 0, False, False, None, version, None) == encode(
        Publish("t"), version
    )


def test_encode_publish_short_and_long_headers() -> None:
    # The table of two-byte headers ends at remaining length 127.
    for size in (0, 1, 123, 124, 125, 20_000):
        for qos, pid in ((0, None), (1, 9), (2, 9)):
            for retain in (False, True):
                packet = Publish("t/ü", b"p" * size, QoS(qos), retain, qos > 0, pid)
                wire = encode_publish("t/ü", packet.payload, qos, retain, qos > 0, pid, V3)
                assert decode_whole(wire, Decoder(protocol_version=V3)) == [packet]


def test_encode_publish_topic_cache_is_bounded_and_skips_bad_topics() -> None:
    for i in range(codec._TOPIC_WIRE_CACHE_SIZE + 10):
        assert encode_publish(f"t/{i}", b"", 0, False, False, None, V3)[4:] == f"t/{i}".encode()
        assert len(codec._TOPIC_WIRE_CACHE) <= codec._TOPIC_WIRE_CACHE_SIZE
    for bad in ("a\x00b", "\ud800", "x" * 65_536):
        for _ in range(2):  # refused every time, never served from the cache
            with pytest.raises(LocalProtocolError):
                encode_publish(bad, b"", 0, False, False, None, V3)
        assert bad not in codec._TOPIC_WIRE_CACHE
    with pytest.raises(LocalProtocolError):
        encode_publish(b"x" * 65_536, b"", 0, False, False, None, V3)


# -- decoder buffering ---------------------------------------------------------------------------


def test_many_packets_in_one_feed() -> None:
    packets = [
        Publish(f"t/{i}", bytes([i % 256]) * (i % 50), QoS.AT_MOST_ONCE) for i in range(5000)
    ]
    data = b"".join(encode(p, V3) for p in packets)
    decoder = Decoder(protocol_version=V3)
    decoder.feed(data + b"\x30")  # and the first byte of one more
    assert list(decoder.packets()) == packets
    assert decoder.buffered == 1


def test_large_feed_with_partial_tail() -> None:
    # Many packets consumed while a partial one stays buffered, then completed by the next feed.
    packet = Publish("t", b"x" * 1000)
    wire = encode(packet, V3)
    decoder = Decoder(protocol_version=V3)
    for _ in range(3):
        decoder.feed(wire * 100 + wire[:10])
        assert list(decoder.packets()) == [packet] * 100
        decoder.feed(wire[10:])
        assert list(decoder.packets()) == [packet]
    assert decoder.buffered == 0


def test_next_packet_on_empty_decoder() -> None:
    decoder = Decoder(protocol_version=V5)
    assert decoder.next_packet() is None
    decoder.feed(b"")
    assert decoder.next_packet() is None


# The hot path reads a PUBLISH in place when the whole packet is in one buffer; the others
# (split packets, longer remaining lengths, errors) take the general path. Both must agree.
HOT_PATH_PUBLISHES = [
    (V3, Publish("a/b", b"x" * 64)),
    (V3, Publish("a/b", b"x" * 64, QoS.AT_LEAST_ONCE, retain=True, dup=True, packet_id=7)),
    (V3, Publish("ü/€", b"x" * 200, QoS.EXACTLY_ONCE, packet_id=0xFFFF)),  # 2-byte length
    (V3, Publish("t", b"x" * 20_000)),  # 3-byte remaining length: general path
    (V5, Publish("a/b", b"x" * 64)),
    (V5, Publish("a/b", b"p", QoS.AT_LEAST_ONCE, packet_id=1, properties=FULL_PUBLISH_PROPS)),
]


@pytest.mark.parametrize(("version", "packet"), HOT_PATH_PUBLISHES)
def test_publish_split_at_every_offset(version: ProtocolVersion, packet: Publish) -> None:
    wire = encode(packet, version)
    stream = wire + encode(NEXT, version) + wire
    step = 1 if len(wire) < 300 else 97
    for cut in [*range(0, len(stream), step), len(stream)]:
        decoder = Decoder(protocol_version=version)
        decoder.feed(stream[:cut])
        got = list(decoder.packets())
        decoder.feed(stream[cut:])
        got.extend(decoder.packets())
        assert got == [packet, NEXT, packet], cut
        assert decoder.buffered == 0


@pytest.mark.parametrize(("version", "packet"), HOT_PATH_PUBLISHES[:3] + HOT_PATH_PUBLISHES[4:])
def test_publish_byte_by_byte_then_whole(version: ProtocolVersion, packet: Publish) -> None:
    wire = encode(packet, version)
    decoder = Decoder(protocol_version=version)
    for i in range(len(wire)):
        assert decoder.next_packet() is None
        assert decoder.buffered == i
        decoder.feed(wire[i : i + 1])
    decoder.feed(wire * 3)  # the first packet completes from held-back bytes, then in place
    assert list(decoder.packets()) == [packet] * 4
    assert decoder.buffered == 0


def test_large_packet_trickling_in_is_joined_once_whole() -> None:
    packet = Publish("big", b"\x01" * 1_000_000, QoS.AT_LEAST_ONCE, packet_id=3)
    wire = encode(packet, V3)
    decoder = Decoder(protocol_version=V3)
    for at in range(0, len(wire) - 1000, 1000):
        decoder.feed(wire[at : at + 1000])
        assert decoder.next_packet() is None
        # Held back as fed, not copied into one growing buffer on every feed.
        assert len(decoder._data) <= 1000
    decoder.feed(wire[len(wire) // 1000 * 1000 :] + encode(NEXT, V3))
    assert list(decoder.packets()) == [packet, NEXT]
    assert decoder.buffered == 0


def test_consumed_bytes_are_not_kept() -> None:
    wire = encode(Publish("t", b"x" * 100), V3)
    decoder = Decoder(protocol_version=V3)
    decoder.feed(wire * 50 + wire[:30])
    assert len(list(decoder.packets())) == 50
    assert len(decoder._data) == decoder.buffered == 30  # only the partial packet
    decoder.feed(wire[30:])
    assert len(list(decoder.packets())) == 1
    assert decoder._data == b""


def test_feed_copies_a_mutable_buffer() -> None:
    data = bytearray(encode(Publish("t", b"abc"), V3))
    decoder = Decoder(protocol_version=V3)
    decoder.feed(data)
    data[-3:] = b"xyz"
    assert decoder.next_packet() == Publish("t", b"abc")


@pytest.mark.parametrize("first", [0x30, 0x32, 0x3D])
def test_publish_two_byte_remaining_length_not_minimal(first: int) -> None:
    # 0x80 0x00 encodes 0 in two bytes [MQTT-1.5.5-1], whatever follows it.
    assert_rejected(bytes([first]) + b"\x80\x00" + b"\x00" * 20, V3, MalformedPacket, MALFORMED)


def test_publish_hot_path_keeps_every_check() -> None:
    cases: list[tuple[bytes, ProtocolVersion | None, type[ProtocolError], ReasonCode]] = [
        (b"\x30\x01\x00", V3, MalformedPacket, MALFORMED),  # truncated topic length
        (b"\x30\x03\x00\x05a", V3, MalformedPacket, MALFORMED),  # topic past the end
        (b"\x32\x03\x00\x01a", V3, MalformedPacket, MALFORMED),  # no packet identifier
        (b"\x32\x05\x00\x01a\x00\x00", V3, ProtocolError, PROTOCOL),  # packet id 0
        (b"\x30\x03\x00\x01a", V5, MalformedPacket, MALFORMED),  # no property length
        (b"\x30\x04\x00\x01\xff\x00", V5, MalformedPacket, MALFORMED),  # bad UTF-8
        (b"\x30\x04\x00\x01\x00\x00", V5, MalformedPacket, MALFORMED),  # U+0000
        (b"\x36\x03\x00\x01a", V3, MalformedPacket, MALFORMED),  # QoS 3
        (b"\x38\x03\x00\x01a", V3, MalformedPacket, MALFORMED),  # DUP on QoS 0
        (b"\x30\x03\x00\x01a", None, ProtocolError, PROTOCOL),  # before CONNECT
    ]
    for data, version, error, reason in cases:
        assert_rejected(data, version, error, reason)
        assert_rejected(data + encode(NEXT, V3), version, error, reason)


def test_max_packet_size_below_two_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        Decoder(max_packet_size=1)


# -- packet too large ----------------------------------------------------------------------------


def test_packet_too_large_from_the_header_alone() -> None:
    decoder = Decoder(max_packet_size=100, protocol_version=V5)
    decoder.feed(b"\x30\xff\x01")  # remaining length 255, no body yet
    with pytest.raises(PacketTooLarge) as info:
        decoder.next_packet()
    assert info.value.reason_code == ReasonCode.PACKET_TOO_LARGE


def test_packet_too_large_counts_the_fixed_header() -> None:
    body = b"\x00\x01t" + b"p" * 95  # 98 bytes of body + 2 bytes of header = 100
    ok = Decoder(max_packet_size=100, protocol_version=V3)
    ok.feed(b"\x30\x62" + body)
    assert ok.next_packet() == Publish("t", b"p" * 95)
    decoder = Decoder(max_packet_size=99, protocol_version=V3)
    decoder.feed(b"\x30\x62")
    with pytest.raises(PacketTooLarge):
        decoder.next_packet()


@pytest.mark.parametrize("payload_size", [95, 1000])
def test_packet_too_large_with_the_whole_packet_buffered(payload_size: int) -> None:
    wire = encode(Publish("t", b"p" * payload_size), V3)
    decoder = Decoder(max_packet_size=len(wire) - 1, protocol_version=V3)
    decoder.feed(wire)
    with pytest.raises(PacketTooLarge):
        decoder.next_packet()
    ok = Decoder(max_packet_size=len(wire), protocol_version=V3)
    ok.feed(wire)
    assert ok.next_packet() == Publish("t", b"p" * payload_size)


def test_packet_too_large_before_connect() -> None:
    decoder = Decoder(max_packet_size=1000)
    decoder.feed(b"\x10\xff\xff\x03")
    with pytest.raises(PacketTooLarge):
        decoder.next_packet()


def test_largest_remaining_length_waits_for_the_body() -> None:
    decoder = Decoder(protocol_version=V3)
    assert DEFAULT_MAX_PACKET_SIZE == 268_435_460
    decoder.feed(b"\x30\xff\xff\xff\x7f\x00\x01t")
    assert decoder.next_packet() is None


# -- fixed header --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"\x60\x02\x00\x01",  # PUBREL flags must be 0b0010 [MQTT-3.6.1-1]
        b"\x80\x06\x00\x01\x00\x01a\x00",  # SUBSCRIBE flags must be 0b0010 [MQTT-3.8.1-1]
        b"\xa0\x05\x00\x01\x00\x01a",  # UNSUBSCRIBE flags must be 0b0010 [MQTT-3.10.1-1]
        b"\x42\x02\x00\x01",  # PUBACK flags must be 0
        b"\xc1\x00",  # PINGREQ flags must be 0
        b"\xe8\x00",  # DISCONNECT flags must be 0
        b"\x36\x05\x00\x01t\x00\x01",  # PUBLISH QoS 3 [MQTT-3.3.1-4]
        b"\x38\x03\x00\x01t",  # PUBLISH DUP with QoS 0 [MQTT-3.3.1-2]
        b"\x00\x00",  # reserved packet type 0
        b"\xf0\x00",  # AUTH does not exist in 3.1.1
        b"\xc0\xff\xff\xff\xff\x01",  # remaining length longer than four bytes
        b"\xc0\x80\x00",  # remaining length not minimally encoded [MQTT-1.5.5-1]
    ],
)
def test_bad_fixed_header_is_malformed(data: bytes) -> None:
    assert_rejected(data, V3, MalformedPacket, MALFORMED)


def test_bad_flags_rejected_before_the_body_arrives() -> None:
    decoder = Decoder(protocol_version=V5)
    decoder.feed(b"\x36")
    with pytest.raises(MalformedPacket):
        decoder.next_packet()


@pytest.mark.parametrize("data", [b"\xc0\x00", b"\x30\x03\x00\x01t", b"\x20\x02\x00\x00"])
def test_first_packet_must_be_connect(data: bytes) -> None:
    assert_rejected(data, None, ProtocolError, PROTOCOL)


# -- strings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc3\x28",  # invalid continuation
        b"\xed\xa0\x80",  # encoded surrogate U+D800 [MQTT-1.5.3-1]
        b"\xc0\xaf",  # overlong "/"
        b"\xff",
        b"a\x00b",  # U+0000 [MQTT-1.5.3-2]
    ],
)
def test_bad_utf8_topic_is_malformed(raw: bytes) -> None:
    body = len(raw).to_bytes(2, "big") + raw
    assert_rejected(b"\x30" + bytes([len(body)]) + body, V3, MalformedPacket, MALFORMED)
    data5 = b"\x30" + bytes([len(body) + 1]) + body + b"\x00"
    assert_rejected(data5, V5, MalformedPacket, MALFORMED)


def test_wildcards_in_topic_names_are_left_to_the_broker() -> None:
    decoder = Decoder(protocol_version=V3)
    decoder.feed(encode(Publish("a/+/#"), V3))
    assert decoder.next_packet() == Publish("a/+/#")


def test_string_running_past_the_packet_is_malformed() -> None:
    assert_rejected(b"\x30\x03\x00\x05a", V3, MalformedPacket, MALFORMED)
    assert_rejected(b"\x30\x01\x00", V3, MalformedPacket, MALFORMED)


# -- CONNECT -------------------------------------------------------------------------------------


def connect_bytes(
    name: bytes = b"MQTT", level: int = 4, flags: int = 0x02, rest: bytes = b"\x00\x01c"
) -> bytes:
    props = b"\x00" if level == 5 else b""
    body = len(name).to_bytes(2, "big") + name + bytes([level, flags, 0, 60]) + props + rest
    return b"\x10" + bytes([len(body)]) + body


@pytest.mark.parametrize(
    ("name", "level"),
    [(b"MQTT", 3), (b"MQTT", 6), (b"MQIsdp", 4), (b"MQTX", 4), (b"mqtt", 5), (b"", 4)],
)
def test_connect_unsupported_protocol(name: bytes, level: int) -> None:
    data = connect_bytes(name, level)
    assert_rejected(data, None, UnsupportedProtocol, ReasonCode.UNSUPPORTED_PROTOCOL_VERSION)


def test_unsupported_protocol_says_whether_the_name_was_known() -> None:
    for name, level, known in ((b"MQTT", 6, True), (b"MQTX", 5, False), (b"MQIsdp", 4, True)):
        decoder = Decoder()
        decoder.feed(connect_bytes(name, level))
        with pytest.raises(UnsupportedProtocol) as info:
            decoder.next_packet()
        assert info.value.known_name is known


def test_connect_valid_names_and_levels() -> None:
    decoder = Decoder()
    decoder.feed(connect_bytes(b"MQIsdp", 3))
    assert decoder.next_packet() == Connect("c", V31)


@pytest.mark.parametrize("level", [4, 5])
@pytest.mark.parametrize(
    "flags",
    [
        0x03,  # reserved bit [MQTT-3.1.2-3]
        0x0A,  # will QoS 1 without will flag
        0x12,  # will QoS 2 without will flag
        0x22,  # will retain without will flag
        0x1E,  # will flag with will QoS 3
    ],
)
def test_connect_bad_flags_are_malformed(level: int, flags: int) -> None:
    rest = b"\x00\x01c" + (b"\x00" if level == 5 else b"") + b"\x00\x01w\x00\x00"
    data = connect_bytes(level=level, flags=flags, rest=rest)
    assert_rejected(data, None, MalformedPacket, MALFORMED)


def test_password_without_username() -> None:
    rest = b"\x00\x01c\x00\x02pw"
    # [MQTT-3.1.2-22]: malformed in 3.1.1 ...
    assert_rejected(connect_bytes(flags=0x42, rest=rest), None, MalformedPacket, MALFORMED)
    # ... allowed in 5.0.
    decoder = Decoder()
    decoder.feed(connect_bytes(level=5, flags=0x42, rest=rest))
    assert decoder.next_packet() == Connect("c", V5, password=b"pw")


def test_connect_truncated_and_trailing() -> None:
    assert_rejected(connect_bytes(rest=b"\x00\x01"), None, MalformedPacket, MALFORMED)
    assert_rejected(connect_bytes(rest=b"\x00\x01cX"), None, MalformedPacket, MALFORMED)
    assert_rejected(b"\x10\x06\x00\x04MQTT", None, MalformedPacket, MALFORMED)
    # user name flag set, user name missing
    assert_rejected(connect_bytes(flags=0x82), None, MalformedPacket, MALFORMED)


def test_connect_auth_data_without_method() -> None:
    body = b"\x00\x04MQTT\x05\x02\x00\x3c\x03\x16\x00\x00\x00\x01c"
    assert_rejected(b"\x10" + bytes([len(body)]) + body, None, ProtocolError, PROTOCOL)


# -- CONNACK -------------------------------------------------------------------------------------


def test_connack_rules() -> None:
    assert_rejected(b"\x20\x02\x02\x00", V3, MalformedPacket, MALFORMED)  # [MQTT-3.2.2-1]
    assert_rejected(b"\x20\x02\x01\x05", V3, ProtocolError, PROTOCOL)  # session + refusal
    assert_rejected(b"\x20\x02\x00\x06", V3, ProtocolError, PROTOCOL)  # reserved return code
    assert_rejected(b"\x20\x03\x00\x00\x00", V3, MalformedPacket, MALFORMED)  # trailing
    assert_rejected(b"\x20\x02\x00\x00", V5, MalformedPacket, MALFORMED)  # no property length
    assert_rejected(b"\x20\x03\x00\x10\x00", V5, ProtocolError, PROTOCOL)  # not a CONNACK code


# -- PUBLISH and acks ----------------------------------------------------------------------------


def test_packet_id_zero_is_a_protocol_error() -> None:
    # [MQTT-2.3.1-1]
    for version in (V3, V5):
        for first in (0x40, 0x50, 0x62, 0x70):
            assert_rejected(bytes([first, 2, 0, 0]), version, ProtocolError, PROTOCOL)
    assert_rejected(b"\x32\x05\x00\x01t\x00\x00", V3, ProtocolError, PROTOCOL)
    assert_rejected(b"\x34\x06\x00\x01t\x00\x00\x00", V5, ProtocolError, PROTOCOL)
    assert_rejected(b"\x82\x06\x00\x00\x00\x01a\x00", V3, ProtocolError, PROTOCOL)
    assert_rejected(b"\xa2\x05\x00\x00\x00\x01a", V3, ProtocolError, PROTOCOL)


def test_publish_truncated() -> None:
    assert_rejected(b"\x32\x04\x00\x01t\x00", V3, MalformedPacket, MALFORMED)  # half packet id
    assert_rejected(b"\x30\x03\x00\x01t", V5, MalformedPacket, MALFORMED)  # no property length
    assert_rejected(b"\x30\x05\x00\x01t\x05\x01", V5, MalformedPacket, MALFORMED)  # props > end


@pytest.mark.parametrize("first", [0x40, 0x50, 0x62, 0x70])
def test_ack_lengths(first: int) -> None:
    assert_rejected(bytes([first, 3, 0, 1, 0]), V3, MalformedPacket, MALFORMED)
    assert_rejected(bytes([first, 1, 0]), V3, MalformedPacket, MALFORMED)
    assert_rejected(bytes([first, 5, 0, 1, 0, 0, 0]), V5, MalformedPacket, MALFORMED)


def test_ack_reason_codes_are_checked() -> None:
    assert_rejected(b"\x40\x03\x00\x01\x92", V5, ProtocolError, PROTOCOL)  # PUBREL's code
    assert_rejected(b"\x62\x03\x00\x01\x10", V5, ProtocolError, PROTOCOL)  # PUBACK's code
    assert_rejected(b"\xe0\x01\x01", V5, ProtocolError, PROTOCOL)
    assert_rejected(b"\xf0\x02\x01\x00", V5, ProtocolError, PROTOCOL)


# -- SUBSCRIBE / SUBACK / UNSUBSCRIBE / UNSUBACK -------------------------------------------------


def test_subscribe_without_subscriptions_is_a_protocol_error() -> None:
    # [MQTT-3.8.3-3]
    assert_rejected(b"\x82\x02\x00\x01", V3, ProtocolError, PROTOCOL)
    assert_rejected(b"\x82\x03\x00\x01\x00", V5, ProtocolError, PROTOCOL)


@pytest.mark.parametrize(
    ("version", "options", "error", "reason"),
    [
        (V3, 0x03, MalformedPacket, MALFORMED),  # QoS 3 [MQTT-3-8.3-4]
        (V3, 0x04, MalformedPacket, MALFORMED),  # 5.0 bits are reserved in 3.1.1
        (V3, 0x80, MalformedPacket, MALFORMED),
        (V5, 0x40, MalformedPacket, MALFORMED),  # reserved bits [MQTT-3.8.3-5]
        (V5, 0x80, MalformedPacket, MALFORMED),
        (V5, 0x03, ProtocolError, PROTOCOL),  # QoS 3
        (V5, 0x30, ProtocolError, PROTOCOL),  # retain handling 3
    ],
)
def test_bad_subscription_options(
    version: ProtocolVersion, options: int, error: type[ProtocolError], reason: ReasonCode
) -> None:
    props = b"\x00" if version is V5 else b""
    body = b"\x00\x01" + props + b"\x00\x01a" + bytes([options])
    assert_rejected(b"\x82" + bytes([len(body)]) + body, version, error, reason)


def test_subscription_missing_options_is_malformed() -> None:
    assert_rejected(b"\x82\x05\x00\x01\x00\x01a", V3, MalformedPacket, MALFORMED)


def test_suback_rules() -> None:
    assert_rejected(b"\x90\x03\x00\x01\x03", V3, ProtocolError, PROTOCOL)
    assert_rejected(b"\x90\x03\x00\x01\x91", V3, ProtocolError, PROTOCOL)  # 5.0-only code
    assert_rejected(b"\x90\x02\x00\x01", V3, ProtocolError, PROTOCOL)  # no codes
    assert_rejected(b"\x90\x04\x00\x01\x00\x11", V5, ProtocolError, PROTOCOL)


def test_unsubscribe_and_unsuback_rules() -> None:
    assert_rejected(b"\xa2\x02\x00\x01", V3, ProtocolError, PROTOCOL)  # [MQTT-3.10.3-2]
    assert_rejected(b"\xb0\x03\x00\x01\x00", V3, MalformedPacket, MALFORMED)  # trailing
    assert_rejected(b"\xb0\x03\x00\x01\x00", V5, ProtocolError, PROTOCOL)  # no codes
    assert_rejected(b"\xb0\x04\x00\x01\x00\x01", V5, ProtocolError, PROTOCOL)  # bad code


def test_ping_and_311_disconnect_have_no_body() -> None:
    for data in (b"\xc0\x01\x00", b"\xd0\x01\x00", b"\xe0\x01\x00"):
        assert_rejected(data, V3, MalformedPacket, MALFORMED)
    assert_rejected(b"\xc0\x01\x00", V5, MalformedPacket, MALFORMED)


def test_disconnect_and_auth_trailing_bytes() -> None:
    assert_rejected(b"\xe0\x03\x00\x00\x00", V5, MalformedPacket, MALFORMED)
    assert_rejected(b"\xf0\x01\x00", V5, MalformedPacket, MALFORMED)  # AUTH needs props length


# -- properties ----------------------------------------------------------------------------------


def publish5(props: bytes) -> bytes:
    body = b"\x00\x01t" + bytes([len(props)]) + props + b"payload"
    return b"\x30" + bytes([len(body)]) + body


@pytest.mark.parametrize(
    ("props", "error", "reason"),
    [
        # An identifier not valid for the packet type: malformed (2.2.2.2).
        (b"\x11\x00\x00\x00\x01", MalformedPacket, MALFORMED),  # session expiry not in PUBLISH
        (b"\x21\x00\x01", MalformedPacket, MALFORMED),  # receive maximum not in PUBLISH
        (b"\x02\x00\x00\x00\x01\x02\x00\x00\x00\x02", ProtocolError, PROTOCOL),  # duplicate
        (b"\x23\x00\x01\x23\x00\x02", ProtocolError, PROTOCOL),  # duplicate topic alias
        (b"\x23\x00\x00", ProtocolError, TOPIC_ALIAS),  # topic alias 0 [MQTT-3.3.2-8], 0x94
        (b"\x0b\x00", ProtocolError, PROTOCOL),  # subscription identifier 0
        (b"\x01\x02", ProtocolError, PROTOCOL),  # payload format indicator 2
        (b"\x7f\x00", MalformedPacket, MALFORMED),  # unknown property
        (b"\x00", MalformedPacket, MALFORMED),  # identifier 0 is not a property
        (b"\x02\x00\x00", MalformedPacket, MALFORMED),  # truncated four byte integer
        (b"\x03\x00\x05ab", MalformedPacket, MALFORMED),  # string past property length
        (b"\x03\x00\x01\xff", MalformedPacket, MALFORMED),  # bad UTF-8
        (b"\x26\x00\x01k", MalformedPacket, MALFORMED),  # user property without value
        (b"\x0b\x80\x00", MalformedPacket, MALFORMED),  # non-minimal varint
        (b"\x0b\xff\xff\xff\xff", MalformedPacket, MALFORMED),  # varint too long
        (b"\x01", MalformedPacket, MALFORMED),  # byte property without its byte
    ],
)
def test_bad_publish_properties(
    props: bytes, error: type[ProtocolError], reason: ReasonCode
) -> None:
    assert_rejected(publish5(props), V5, error, reason)


def test_repeatable_publish_properties() -> None:
    props = b"\x0b\x01\x0b\x02\x26\x00\x01k\x00\x01a\x26\x00\x01k\x00\x01b"
    decoder = Decoder(protocol_version=V5)
    decoder.feed(publish5(props))
    packet = decoder.next_packet()
    assert isinstance(packet, Publish)
    assert packet.properties == Properties(
        subscription_identifiers=(1, 2), user_properties=(("k", "a"), ("k", "b"))
    )
    assert packet.payload == b"payload"


def connect5(props: bytes) -> bytes:
    body = b"\x00\x04MQTT\x05\x02\x00\x3c" + bytes([len(props)]) + props + b"\x00\x01c"
    return b"\x10" + bytes([len(body)]) + body


@pytest.mark.parametrize(
    "props",
    [
        b"\x21\x00\x00",  # receive maximum 0
        b"\x27\x00\x00\x00\x00",  # maximum packet size 0
        b"\x17\x02",  # request problem information 2
        b"\x11\x00\x00\x00\x01\x11\x00\x00\x00\x01",  # duplicate session expiry
    ],
)
def test_bad_connect_properties(props: bytes) -> None:
    assert_rejected(connect5(props), None, ProtocolError, PROTOCOL)


@pytest.mark.parametrize(
    "props",
    [
        b"\x23\x00\x01",  # topic alias is PUBLISH only
        b"\x18\x00\x00\x00\x01",  # will delay interval belongs to the will properties
    ],
)
def test_connect_properties_of_another_packet_are_malformed(props: bytes) -> None:
    assert_rejected(connect5(props), None, MalformedPacket, MALFORMED)  # 2.2.2.2


def test_subscribe_allows_one_subscription_identifier() -> None:
    body = b"\x00\x01\x04\x0b\x01\x0b\x02\x00\x01a\x00"
    assert_rejected(b"\x82" + bytes([len(body)]) + body, V5, ProtocolError, PROTOCOL)
    body = b"\x00\x01\x02\x0b\x01\x00\x01a\x00"
    decoder = Decoder(protocol_version=V5)
    decoder.feed(b"\x82" + bytes([len(body)]) + body)
    packet = decoder.next_packet()
    assert isinstance(packet, Subscribe)
    assert packet.properties.subscription_identifiers == (1,)


def test_will_properties_are_checked_against_the_will() -> None:
    # CONNECT with a will whose properties carry a topic alias.
    body = b"\x00\x04MQTT\x05\x06\x00\x3c\x00\x00\x01c\x03\x23\x00\x01\x00\x01w\x00\x00"
    assert_rejected(b"\x10" + bytes([len(body)]) + body, None, MalformedPacket, MALFORMED)


def test_decoded_empty_properties_are_the_shared_constant() -> None:
    decoder = Decoder(protocol_version=V5)
    decoder.feed(encode(Publish("t"), V5))
    packet = decoder.next_packet()
    assert isinstance(packet, Publish)
    assert packet.properties is NO_PROPERTIES


# -- the encoder refuses illegal packets ---------------------------------------------------------


@pytest.mark.parametrize(
    ("packet", "version"),
    [
        (Puback(0), V3),
        (Puback(65536), V5),
        (Publish("t", qos=QoS.AT_LEAST_ONCE), V3),  # no packet id
        (Publish("t", packet_id=1), V3),  # QoS 0 with packet id
        (Publish("t", dup=True), V3),  # QoS 0 with DUP
        (Publish("a\x00b"), V3),  # U+0000
        (Publish("\ud800"), V5),  # lone surrogate
        (Publish("t", properties=Properties(session_expiry_interval=1)), V5),
        (Publish("t", properties=Properties(topic_alias=0)), V5),
        (Publish("t", properties=Properties(message_expiry_interval=2**32)), V5),
        (Connect("c", V5), V3),  # version mismatch
        (Connect("c", password=b"p"), V3),  # [MQTT-3.1.2-22]
        (Connect("c", keepalive=65536), V3),
        (Connect("c", V5, properties=Properties(receive_maximum=0)), V5),
        (Connack(True, 1), V3),
        (Connack(reason_code=0x10), V5),
        (Subscribe(1, ()), V3),
        (Subscribe(1, (Subscription("a"),), Properties(subscription_identifiers=(1, 2))), V5),
        (Suback(1, (0x91,)), V3),
        (Suback(1, ()), V5),
        (Unsubscribe(1, ()), V5),
        (Unsuback(1), V5),
        (Disconnect(0x05), V5),
        (Auth(), V3),
        (Auth(0x80), V5),
    ],
    ids=repr,
)
def test_encode_refuses(packet: Packet, version: ProtocolVersion) -> None:
    with pytest.raises(LocalProtocolError):
        encode(packet, version)


def test_encode_publish_refuses_qos_3() -> None:
    with pytest.raises(LocalProtocolError):
        encode_publish("t", b"", 3, False, False, 1, V3)


def test_encode_refuses_non_packets() -> None:
    with pytest.raises(LocalProtocolError):
        encode(object(), V3)  # type: ignore[arg-type]
