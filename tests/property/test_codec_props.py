"""Property tests of the codec: encode/decode round trips and a fuzz invariant.

* Any valid packet, in any version, survives ``encode`` then ``decode`` unchanged, however the
  bytes are chunked on the way in.
* Random bytes, and valid packets with random damage, either decode to packets or raise
  ``ProtocolError``; nothing else escapes and the decoder always terminates. Whatever the
  decoder accepts, the encoder can write back.
* The outcome (packets, then the error class and reason code, if any) does not depend on how
  the bytes are chunked: the decoder's in-place hot path and its general path agree.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_edge.codec import DEFAULT_MAX_PACKET_SIZE, Decoder, encode, encode_publish
from broker_edge.errors import ProtocolError
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
    RetainHandling,
    Suback,
    Subscribe,
    Subscription,
    Unsuback,
    Unsubscribe,
    Will,
)

# Sized so the module runs in a few seconds; raise max_examples locally when changing the codec.
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

V5 = ProtocolVersion.MQTT_5
VERSIONS = st.sampled_from(list(ProtocolVersion))

# -- value strategies ----------------------------------------------------------------------------

text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
binary = st.binary(max_size=24)
packet_ids = st.integers(1, 0xFFFF)
qos = st.sampled_from(list(QoS))
flag = st.integers(0, 1)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)

PROPERTY_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "payload_format_indicator": flag,
    "message_expiry_interval": u32,
    "content_type": text,
    "response_topic": text,
    "correlation_data": binary,
    "session_expiry_interval": u32,
    "assigned_client_identifier": text,
    "server_keep_alive": u16,
    "authentication_method": text,
    "authentication_data": binary,
    "request_problem_information": flag,
    "will_delay_interval": u32,
    "request_response_information": flag,
    "response_information": text,
    "server_reference": text,
    "reason_string": text,
    "receive_maximum": st.integers(1, 0xFFFF),
    "topic_alias_maximum": u16,
    "topic_alias": st.integers(1, 0xFFFF),
    "maximum_qos": flag,
    "retain_available": flag,
    "user_properties": st.lists(st.tuples(text, text), max_size=3).map(tuple),
    "maximum_packet_size": st.integers(1, 0xFFFF_FFFF),
    "wildcard_subscription_available": flag,
    "subscription_identifier_available": flag,
    "shared_subscription_available": flag,
}
SUBSCRIPTION_IDS = st.integers(1, 268_435_455)

# Where each property may appear (MQTT 5.0 section 2.2.2.2), written out independently of the
# codec's own table.
PUBLISH_FIELDS = (
    "payload_format_indicator",
    "message_expiry_interval",
    "content_type",
    "response_topic",
    "correlation_data",
    "topic_alias",
    "user_properties",
)
WILL_FIELDS = (*PUBLISH_FIELDS[:5], "will_delay_interval", "user_properties")
CONNECT_FIELDS = (
    "session_expiry_interval",
    "receive_maximum",
    "maximum_packet_size",
    "topic_alias_maximum",
    "request_response_information",
    "request_problem_information",
    "user_properties",
    "authentication_method",
    "authentication_data",
)
CONNACK_FIELDS = (
    "session_expiry_interval",
    "receive_maximum",
    "maximum_qos",
    "retain_available",
    "maximum_packet_size",
    "assigned_client_identifier",
    "topic_alias_maximum",
    "reason_string",
    "user_properties",
    "wildcard_subscription_available",
    "subscription_identifier_available",
    "shared_subscription_available",
    "server_keep_alive",
    "response_information",
    "server_reference",
    "authentication_method",
    "authentication_data",
)
REASON_FIELDS = ("reason_string", "user_properties")
DISCONNECT_FIELDS = (*REASON_FIELDS, "session_expiry_interval", "server_reference")
AUTH_FIELDS = (*REASON_FIELDS, "authentication_method", "authentication_data")


def properties(fields: tuple[str, ...], subscription_ids: int = 0) -> st.SearchStrategy[Any]:
    optional = {name: PROPERTY_VALUES[name] for name in fields}
    if subscription_ids:
        optional["subscription_identifiers"] = st.lists(
            SUBSCRIPTION_IDS, min_size=1, max_size=subscription_ids
        ).map(tuple)
    return st.fixed_dictionaries({}, optional=optional).map(lambda kw: Properties(**kw))


def connect_properties() -> st.SearchStrategy[Properties]:
    def fix(props: Properties) -> Properties:
        # Authentication data without a method is a protocol error (3.1.2.11.10).
        if props.authentication_data is not None and props.authentication_method is None:
            return Properties(**{**_as_dict(props), "authentication_data": None})
        return props

    return properties(CONNECT_FIELDS).map(fix)


def _as_dict(props: Properties) -> dict[str, Any]:
    return {name: getattr(props, name) for name in Properties.__dataclass_fields__}


CONNACK_CODES_5 = [0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C]
CONNACK_CODES_5 += [0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F]
PUBACK_CODES = [0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99]
PUBREL_CODES = [0x00, 0x92]
SUBACK_CODES_5 = [0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2]
UNSUBACK_CODES = [0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91]
DISCONNECT_CODES = [0x00, 0x04, *range(0x80, 0x84), 0x87, 0x89, *range(0x8B, 0x91)]
DISCONNECT_CODES += [*range(0x93, 0xA3)]
AUTH_CODES = [0x00, 0x18, 0x19]


# -- packet strategies ---------------------------------------------------------------------------


@st.composite
def connects(draw: st.DrawFn, version: ProtocolVersion) -> Connect:
    v5 = version is V5
    will = None
    if draw(st.booleans()):
        will_props = draw(properties(WILL_FIELDS)) if v5 else Properties()
        will = Will(draw(text), draw(binary), draw(qos), draw(st.booleans()), will_props)
    username = draw(st.none() | text)
    password = draw(st.none() | binary) if v5 or username is not None else None
    return Connect(
        client_id=draw(text),
        protocol_version=version,
        clean_start=draw(st.booleans()),
        keepalive=draw(u16),
        will=will,
        username=username,
        password=password,
        properties=draw(connect_properties()) if v5 else Properties(),
    )


@st.composite
def connacks(draw: st.DrawFn, v5: bool) -> Connack:
    code = draw(st.sampled_from(CONNACK_CODES_5 if v5 else range(6)))
    session_present = draw(st.booleans()) if code == 0 else False
    props = draw(properties(CONNACK_FIELDS)) if v5 else Properties()
    return Connack(session_present, code, props)


@st.composite
def publishes(draw: st.DrawFn, v5: bool) -> Publish:
    level = draw(qos)
    return Publish(
        topic=draw(text),
        payload=draw(st.binary(max_size=300)),
        qos=level,
        retain=draw(st.booleans()),
        dup=draw(st.booleans()) if level else False,
        packet_id=draw(packet_ids) if level else None,
        properties=draw(properties(PUBLISH_FIELDS, subscription_ids=3)) if v5 else Properties(),
    )


def acks(v5: bool) -> st.SearchStrategy[Packet]:
    def one(cls: Any, codes: list[int]) -> st.SearchStrategy[Packet]:
        if not v5:
            return st.builds(cls, packet_ids)
        return st.builds(cls, packet_ids, st.sampled_from(codes), properties(REASON_FIELDS))

    return st.one_of(
        one(Puback, PUBACK_CODES),
        one(Pubrec, PUBACK_CODES),
        one(Pubrel, PUBREL_CODES),
        one(Pubcomp, PUBREL_CODES),
    )


def subscriptions(v5: bool) -> st.SearchStrategy[Subscription]:
    if not v5:
        return st.builds(Subscription, text, qos)
    return st.builds(
        Subscription,
        text,
        qos,
        st.booleans(),
        st.booleans(),
        st.sampled_from(list(RetainHandling)),
    )


def packets(version: ProtocolVersion) -> st.SearchStrategy[Packet]:
    v5 = version is V5
    none = st.just(Properties())

    def props(fields: tuple[str, ...], subscription_ids: int = 0) -> st.SearchStrategy[Any]:
        return properties(fields, subscription_ids) if v5 else none

    def codes(values: list[int]) -> st.SearchStrategy[tuple[int, ...]]:
        return st.lists(st.sampled_from(values), min_size=1, max_size=4).map(tuple)

    choices: list[st.SearchStrategy[Packet]] = [
        connects(version),
        connacks(v5),
        publishes(v5),
        acks(v5),
        st.builds(
            Subscribe,
            packet_ids,
            st.lists(subscriptions(v5), min_size=1, max_size=4).map(tuple),
            props(("user_properties",), subscription_ids=1),
        ),
        st.builds(
            Suback,
            packet_ids,
            codes(SUBACK_CODES_5 if v5 else [0, 1, 2, 0x80]),
            props(REASON_FIELDS),
        ),
        st.builds(
            Unsubscribe,
            packet_ids,
            st.lists(text, min_size=1, max_size=4).map(tuple),
            props(("user_properties",)),
        ),
        st.builds(Unsuback, packet_ids, codes(UNSUBACK_CODES), props(REASON_FIELDS))
        if v5
        else st.builds(Unsuback, packet_ids),
        st.just(Pingreq()),
        st.just(Pingresp()),
        st.builds(Disconnect, st.sampled_from(DISCONNECT_CODES), props(DISCONNECT_FIELDS))
        if v5
        else st.just(Disconnect()),
    ]
    if v5:
        choices.append(st.builds(Auth, st.sampled_from(AUTH_CODES), props(AUTH_FIELDS)))
    return st.one_of(choices)


@st.composite
def versioned_packets(draw: st.DrawFn, max_size: int = 4) -> tuple[ProtocolVersion, list[Packet]]:
    version = draw(VERSIONS)
    return version, draw(st.lists(packets(version), min_size=1, max_size=max_size))


def chunked(data: st.DataObject, wire: bytes) -> list[bytes]:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=8)))
    bounds = [0, *cuts, len(wire)]
    return [wire[a:b] for a, b in pairwise(bounds)]


def decode_all(chunks: list[bytes], version: ProtocolVersion | None) -> list[Packet]:
    decoder = Decoder(protocol_version=version)
    out: list[Packet] = []
    for chunk in chunks:
        decoder.feed(chunk)
        out.extend(decoder.packets())
    assert decoder.buffered == 0
    return out


# -- round trips ---------------------------------------------------------------------------------


@SETTINGS
@given(versioned_packets(), st.data())
def test_round_trip_in_random_chunks(
    case: tuple[ProtocolVersion, list[Packet]], data: st.DataObject
) -> None:
    version, expected = case
    wire = b"".join(encode(packet, version) for packet in expected)
    assert decode_all([wire], version) == expected
    assert decode_all(chunked(data, wire), version) == expected


@SETTINGS
@given(versioned_packets(), st.data())
def test_a_publishs_wire_is_its_delivery_but_for_the_packet_id(
    case: tuple[ProtocolVersion, list[Packet]], data: st.DataObject
) -> None:
    """``Publish.wire`` (the bytes a subscriber of the same version and QoS gets as they came,
    but for the packet id) is what the encoder makes of that delivery; a whole buffer sets it
    on every publish it can."""
    version, packets = case
    wire = b"".join(encode(packet, version) for packet in packets)
    for whole, chunks in ((True, [wire]), (False, chunked(data, wire))):
        for packet in decode_all(chunks, version):
            if not isinstance(packet, Publish):
                continue
            plain = not packet.dup and not packet.retain and packet.properties == NO_PROPERTIES
            if packet.wire is not None:
                assert plain
                pid = packet.packet_id
                delivery = encode_publish(
                    packet.topic, packet.payload, packet.qos, False, False, pid, version
                )
                assert packet.wire == delivery
            else:
                assert not (whole and plain)


@settings(SETTINGS, max_examples=50)
@given(VERSIONS.flatmap(connects), st.data())
def test_server_decoder_learns_the_version(connect: Connect, data: st.DataObject) -> None:
    version = connect.protocol_version
    follow = Publish("t", b"p", QoS.AT_LEAST_ONCE, packet_id=1)
    wire = encode(connect, version) + encode(follow, version)
    assert decode_all(chunked(data, wire), None) == [connect, follow]


# -- fuzz ------------------------------------------------------------------------------------------


def decode_or_reject(
    data: bytes, version: ProtocolVersion | None
) -> tuple[list[Packet], ProtocolVersion | None]:
    """Packets decoded before the first error, and the version the decoder ended up with.

    Only ProtocolError may stop the decoder; it terminates because each packet consumes at
    least two bytes and an incomplete one makes ``packets()`` stop.
    """
    decoder = Decoder(protocol_version=version)
    decoder.feed(data)
    out: list[Packet] = []
    try:
        out.extend(decoder.packets())
    except ProtocolError:
        pass
    else:
        assert decoder.next_packet() is None
    return out, decoder.protocol_version


def assert_reencodes(packets_: list[Packet], version: ProtocolVersion | None) -> None:
    """Whatever the decoder accepted, the encoder can write and the decoder reads back."""
    for packet in packets_:
        wire_version = packet.protocol_version if isinstance(packet, Connect) else version
        assert wire_version is not None
        decoder = Decoder(protocol_version=None if isinstance(packet, Connect) else wire_version)
        decoder.feed(encode(packet, wire_version))
        assert decoder.next_packet() == packet


@FUZZ_SETTINGS
@given(st.binary(max_size=256), st.none() | VERSIONS)
def test_random_bytes_decode_or_raise_protocol_error(
    data: bytes, version: ProtocolVersion | None
) -> None:
    assert_reencodes(*decode_or_reject(data, version))


@st.composite
def mutated(draw: st.DrawFn) -> tuple[ProtocolVersion, bytes]:
    version, packets_ = draw(versioned_packets(max_size=2))
    wire = bytearray(b"".join(encode(packet, version) for packet in packets_))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(len(wire) - 1, 0)))
        if op == "flip" and wire:
            wire[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and wire:
            wire[at] = draw(st.integers(0, 255))
        elif op == "insert":
            wire[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del wire[at : at + draw(st.integers(1, 4))]
        else:
            del wire[at:]
    return version, bytes(wire)


@SETTINGS
@given(mutated())
def test_mutated_packets_decode_or_raise_protocol_error(
    case: tuple[ProtocolVersion, bytes],
) -> None:
    version, wire = case
    assert_reencodes(*decode_or_reject(wire, version))


Outcome = tuple[list[Packet], tuple[type[ProtocolError], int] | None]


def outcome(chunks: list[bytes], version: ProtocolVersion | None, max_size: int) -> Outcome:
    """Packets decoded before the first error, and that error's class and reason code."""
    decoder = Decoder(protocol_version=version, max_packet_size=max_size)
    out: list[Packet] = []
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            out.extend(decoder.packets())
    except ProtocolError as exc:
        return out, (type(exc), exc.reason_code)
    return out, None


def assert_chunking_does_not_matter(
    wire: bytes, version: ProtocolVersion | None, data: st.DataObject
) -> None:
    max_size = data.draw(st.sampled_from([DEFAULT_MAX_PACKET_SIZE, 2, 16, 64]))
    whole = outcome([wire], version, max_size)
    bytewise = [wire[i : i + 1] for i in range(len(wire))]
    assert outcome(bytewise, version, max_size) == whole
    assert outcome(chunked(data, wire), version, max_size) == whole


@FUZZ_SETTINGS
@given(st.binary(max_size=256), st.none() | VERSIONS, st.data())
def test_random_bytes_same_outcome_however_chunked(
    wire: bytes, version: ProtocolVersion | None, data: st.DataObject
) -> None:
    assert_chunking_does_not_matter(wire, version, data)


@SETTINGS
@given(mutated(), st.data())
def test_mutated_packets_same_outcome_however_chunked(
    case: tuple[ProtocolVersion, bytes], data: st.DataObject
) -> None:
    version, wire = case
    assert_chunking_does_not_matter(wire, version, data)
