"""Sans-IO MQTT 3.1.1 / 5.0 codec: bytes in, packets out; packets in, bytes out.

Theory of operation
-------------------
Nothing here touches a socket, a clock or a logger. The listener hands received bytes to
``Decoder.feed`` and asks ``Decoder.next_packet`` for whole packets; the protocol layer turns
packets into bytes with ``encode`` (or ``encode_publish`` on the delivery hot path).

Every MQTT packet is a one-byte header (type and flags), a *remaining length* encoded as a
variable byte integer of one to four bytes, and that many bytes of body. The decoder keeps the
received bytes as immutable ``bytes`` with a read offset and reads fields straight out of them;
``next_packet`` returns ``None``, consuming nothing, until a whole packet is there. Bytes fed
while a packet is incomplete are held back as they came and joined once, when they complete it
(see ``Decoder``), so a feed holding thousands of small packets and a large packet arriving in
thousands of pieces both cost linear time, not quadratic. A PUBLISH that arrives whole on an
established connection, the per-message case, takes a hot path with the same checks in the
same order; property tests hold the two paths to the same outcome however the bytes are cut.

Checks that need only the header run before the body is buffered: packet type, the reserved
flag bits, PUBLISH QoS and DUP, "CONNECT first" and the maximum packet size, so an oversized
packet is refused (``PacketTooLarge``) without waiting for, or storing, its body.

The body format depends on the protocol version. A server-side decoder starts with
``protocol_version=None`` and learns the version from the first CONNECT (the only packet it
accepts before that); a client-side decoder is given the version it asked for. MQTT 3.1
("MQIsdp", level 3) uses the 3.1.1 formats throughout.

Errors: the decoder raises only ``ProtocolError`` (``MalformedPacket`` for bytes that do not
parse, ``PacketTooLarge`` for an oversized packet, plain ``ProtocolError`` with a reason code
for a well-formed packet that breaks a rule). After an error the connection is finished and the
decoder must not be used again. The encoder raises ``LocalProtocolError``: asking it to write an
illegal packet is a bug in our own code, never the peer's fault.

Topic names and filters are decoded as strict UTF-8 only; wildcard and level rules belong to the
broker layer, which knows whether a string is a name or a filter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Final

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
    PacketType,
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

__all__ = [
    "DEFAULT_MAX_PACKET_SIZE",
    "MAX_REMAINING_LENGTH",
    "Decoder",
    "encode",
    "encode_publish",
]

MAX_REMAINING_LENGTH: Final = 268_435_455  # largest four-byte variable byte integer
DEFAULT_MAX_PACKET_SIZE: Final = MAX_REMAINING_LENGTH + 5  # plus fixed header

_QOS: Final = (QoS.AT_MOST_ONCE, QoS.AT_LEAST_ONCE, QoS.EXACTLY_ONCE)
_RETAIN_HANDLING: Final = (
    RetainHandling.SEND_ON_SUBSCRIBE,
    RetainHandling.SEND_IF_NEW_SUBSCRIPTION,
    RetainHandling.DO_NOT_SEND,
)
_V5: Final = 5  # compared with ==, so a plain int level works as well as the enum
# Per first byte: a PUBLISH whose flags _check_first_byte accepts (QoS 0-2, DUP only with QoS
# 1/2), looked up by the decoder's fast path in one step.
_VALID_PUBLISH_FIRST: Final = tuple(
    b >> 4 == 3 and b & 0x06 != 0x06 and b & 0x0E != 0x08 for b in range(256)
)
_CONNECT: Final = 1
_PUBLISH: Final = 3
_AUTH: Final = 15

# Required low nibble of the fixed header per packet type, indexed by type; None for PUBLISH
# (its flags carry DUP/QoS/RETAIN) and for the forbidden type 0.
# [MQTT-2.2.2-1] [MQTT-2.2.2-2] (3.1.1), [MQTT-2.1.3-1] (5.0); PUBREL, SUBSCRIBE and UNSUBSCRIBE
# are 0b0010 [MQTT-3.6.1-1] [MQTT-3.8.1-1] [MQTT-3.10.1-1].
_FIXED_FLAGS: Final[tuple[int | None, ...]] = (
    None, 0, 0, None, 0, 0, 0b0010, 0, 0b0010, 0, 0b0010, 0, 0, 0, 0, 0,
)  # fmt: skip

# Reason codes each MQTT 5.0 packet may carry (section 2.4 table 2-6).
_CONNACK_CODES_5: Final = frozenset(
    {0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95,
     0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F}
)  # fmt: skip
_CONNACK_CODES_311: Final = frozenset(range(6))  # 6-255 reserved (3.1.1 table 3.1)
_PUBACK_CODES: Final = frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99})
_PUBREL_CODES: Final = frozenset({0x00, 0x92})  # PUBREL and PUBCOMP
_SUBACK_CODES_5: Final = frozenset(
    {0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2}
)
_SUBACK_CODES_311: Final = frozenset({0x00, 0x01, 0x02, 0x80})  # [MQTT-3.9.3-2]
_UNSUBACK_CODES: Final = frozenset({0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91})
_DISCONNECT_CODES: Final = frozenset(
    {0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8C, 0x8D, 0x8E, 0x8F, 0x90, 0x93,
     0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2}
)  # fmt: skip
_AUTH_CODES: Final = frozenset({0x00, 0x18, 0x19})


# -- primitive readers: (buffer, position, end) -> (value, new position) ------------------------


def _utf8(raw: bytes) -> str:
    """Strict UTF-8 without U+0000 [MQTT-1.5.3-1] [MQTT-1.5.3-2] (3.1.1 numbering).

    Python's decoder already rejects overlong forms and encoded surrogates U+D800..U+DFFF.
    """
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise MalformedPacket(f"ill-formed UTF-8 string: {exc.reason}") from exc
    if "\x00" in text:
        raise MalformedPacket("UTF-8 string contains U+0000")
    return text


def _read_bytes(buf: bytes, pos: int, end: int) -> tuple[bytes, int]:
    """A two-byte length followed by that many bytes (binary data, or a string's encoding)."""
    if pos + 2 > end:
        raise MalformedPacket("truncated length prefix")
    stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise MalformedPacket("length prefix runs past the end of the packet")
    return buf[pos + 2 : stop], stop


def _read_str(buf: bytes, pos: int, end: int) -> tuple[str, int]:
    raw, pos = _read_bytes(buf, pos, end)
    return _utf8(raw), pos


def _read_u16(buf: bytes, pos: int, end: int) -> int:
    if pos + 2 > end:
        raise MalformedPacket("truncated two byte integer")
    return (buf[pos] << 8) | buf[pos + 1]


def _read_u32(buf: bytes, pos: int, end: int) -> int:
    if pos + 4 > end:
        raise MalformedPacket("truncated four byte integer")
    return int.from_bytes(buf[pos : pos + 4], "big")


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Variable byte integer: at most four bytes, minimally encoded [MQTT-1.5.5-1]."""
    value = 0
    for shift in (0, 7, 14, 21):
        if pos >= end:
            raise MalformedPacket("truncated variable byte integer")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and shift:
                raise MalformedPacket("variable byte integer not minimally encoded")
            return value, pos
    raise MalformedPacket("variable byte integer longer than four bytes")


def _read_remaining_length(buf: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """``_read_varint`` for the fixed header: None while its last byte has not arrived."""
    for stop in range(pos, min(end, pos + 4)):
        if not buf[stop] & 0x80:
            return _read_varint(buf, pos, stop + 1)
    if end - pos >= 4:
        raise MalformedPacket("variable byte integer longer than four bytes")  # 1.5.5
    return None


def _read_packet_id(buf: bytes, pos: int, end: int) -> int:
    packet_id = _read_u16(buf, pos, end)
    if packet_id == 0:
        raise ProtocolError("packet identifier 0")  # [MQTT-2.3.1-1]
    return packet_id


def _reason_code(code: int, allowed: frozenset[int], packet: str) -> int:
    if code not in allowed:
        raise ProtocolError(f"reason code 0x{code:02X} is not valid in {packet}")
    return code


# -- primitive writers ---------------------------------------------------------------------------

_SMALL_VARINTS: Final = tuple(bytes((n,)) for n in range(128))


def _varint(value: int) -> bytes:
    if 0 <= value < 128:
        return _SMALL_VARINTS[value]
    if not 0 <= value <= MAX_REMAINING_LENGTH:
        raise LocalProtocolError(f"{value} does not fit a variable byte integer")
    out = bytearray()
    while value:
        value, digit = divmod(value, 128)
        out.append(digit | 0x80 if value else digit)
    return bytes(out)


def _u16(value: int, what: str) -> bytes:
    if not 0 <= value <= 0xFFFF:
        raise LocalProtocolError(f"{what} {value} does not fit two bytes")
    return value.to_bytes(2, "big")


def _u32(value: int, what: str) -> bytes:
    if not 0 <= value <= 0xFFFF_FFFF:
        raise LocalProtocolError(f"{what} {value} does not fit four bytes")
    return value.to_bytes(4, "big")


def _bin(data: bytes) -> bytes:
    if len(data) > 0xFFFF:
        raise LocalProtocolError(f"binary data of {len(data)} bytes is longer than 65535")
    return len(data).to_bytes(2, "big") + data


def _utf8_bytes(text: str) -> bytes:
    """Encode a string for the wire, refusing what a peer would have to reject."""
    if "\x00" in text:
        raise LocalProtocolError(f"string {text!r} contains U+0000")
    try:
        return text.encode()
    except UnicodeEncodeError as exc:  # lone surrogates
        raise LocalProtocolError(f"string {text!r} is not valid Unicode") from exc


def _str(text: str) -> bytes:
    return _bin(_utf8_bytes(text))


def _packet_id(packet_id: int) -> bytes:
    if not 1 <= packet_id <= 0xFFFF:
        raise LocalProtocolError(f"packet identifier {packet_id} is not in 1..65535")
    return packet_id.to_bytes(2, "big")


def _check_code(code: int, allowed: frozenset[int], packet: str) -> int:
    if code not in allowed:
        raise LocalProtocolError(f"reason code {code:#x} is not valid in {packet}")
    return code


def _has_properties(props: Properties) -> bool:
    return props is not NO_PROPERTIES and props != NO_PROPERTIES


def _frame(first: int, body: bytes) -> bytes:
    return b"".join((bytes((first,)), _varint(len(body)), body))


# -- MQTT 5.0 properties (section 2.2.2) --------------------------------------------------------

_BYTE, _U16, _U32, _VARINT, _UTF8, _BINARY, _PAIR = range(7)
_WILL: Final = 0  # property context of the will in CONNECT (no packet type is 0)

_P = PacketType
_PUBLISH_AND_WILL = (_P.PUBLISH, _WILL)
_ACKS = (_P.PUBACK, _P.PUBREC, _P.PUBREL, _P.PUBCOMP)
_REASON_STRING = (_P.CONNACK, *_ACKS, _P.SUBACK, _P.UNSUBACK, _P.DISCONNECT, _P.AUTH)

# (identifier, Properties field, value type, contexts where it may appear), by identifier.
_PROPERTY_TABLE: Final[tuple[tuple[int, str, int, tuple[int, ...]], ...]] = (
    (0x01, "payload_format_indicator", _BYTE, _PUBLISH_AND_WILL),
    (0x02, "message_expiry_interval", _U32, _PUBLISH_AND_WILL),
    (0x03, "content_type", _UTF8, _PUBLISH_AND_WILL),
    (0x08, "response_topic", _UTF8, _PUBLISH_AND_WILL),
    (0x09, "correlation_data", _BINARY, _PUBLISH_AND_WILL),
    (0x0B, "subscription_identifiers", _VARINT, (_P.PUBLISH, _P.SUBSCRIBE)),
    (0x11, "session_expiry_interval", _U32, (_P.CONNECT, _P.CONNACK, _P.DISCONNECT)),
    (0x12, "assigned_client_identifier", _UTF8, (_P.CONNACK,)),
    (0x13, "server_keep_alive", _U16, (_P.CONNACK,)),
    (0x15, "authentication_method", _UTF8, (_P.CONNECT, _P.CONNACK, _P.AUTH)),
    (0x16, "authentication_data", _BINARY, (_P.CONNECT, _P.CONNACK, _P.AUTH)),
    (0x17, "request_problem_information", _BYTE, (_P.CONNECT,)),
    (0x18, "will_delay_interval", _U32, (_WILL,)),
    (0x19, "request_response_information", _BYTE, (_P.CONNECT,)),
    (0x1A, "response_information", _UTF8, (_P.CONNACK,)),
    (0x1C, "server_reference", _UTF8, (_P.CONNACK, _P.DISCONNECT)),
    (0x1F, "reason_string", _UTF8, _REASON_STRING),
    (0x21, "receive_maximum", _U16, (_P.CONNECT, _P.CONNACK)),
    (0x22, "topic_alias_maximum", _U16, (_P.CONNECT, _P.CONNACK)),
    (0x23, "topic_alias", _U16, (_P.PUBLISH,)),
    (0x24, "maximum_qos", _BYTE, (_P.CONNACK,)),
    (0x25, "retain_available", _BYTE, (_P.CONNACK,)),
    (0x26, "user_properties", _PAIR, (_WILL, *_P)),
    (0x27, "maximum_packet_size", _U32, (_P.CONNECT, _P.CONNACK)),
    (0x28, "wildcard_subscription_available", _BYTE, (_P.CONNACK,)),
    (0x29, "subscription_identifier_available", _BYTE, (_P.CONNACK,)),
    (0x2A, "shared_subscription_available", _BYTE, (_P.CONNACK,)),
)
_PROPERTY_BY_ID: Final = {row[0]: row for row in _PROPERTY_TABLE}
_SUBSCRIPTION_IDENTIFIER: Final = 0x0B
# Properties for which 0 is a protocol error: receive maximum, topic alias, maximum packet size,
# subscription identifier (3.1.2.11.3, [MQTT-3.3.2-8], 3.1.2.11.4, 3.8.2.1.2).
_NONZERO: Final = frozenset({0x21, 0x23, 0x27, _SUBSCRIPTION_IDENTIFIER})
_CONTEXT_NAMES: Final[dict[int, str]] = {
    _WILL: "will properties",
    **{t: t.name for t in PacketType},
}


def _value_error_code(ident: int) -> ReasonCode:
    # "A Topic Alias value of 0 ... is a Protocol Error, ... Reason Code of 0x94" (3.3.4).
    return ReasonCode.TOPIC_ALIAS_INVALID if ident == 0x23 else ReasonCode.PROTOCOL_ERROR


def _property_value_error(ident: int, kind: int, value: int) -> str | None:
    """Why an integer property value is illegal, or None. Every byte property is 0 or 1."""
    if kind == _BYTE and value not in (0, 1):
        return f"property 0x{ident:02X} must be 0 or 1, got {value}"
    if value == 0 and ident in _NONZERO:
        return f"property 0x{ident:02X} must not be 0"
    return None


def _read_property_value(buf: bytes, pos: int, stop: int, kind: int) -> tuple[Any, int]:
    if kind == _BYTE:
        if pos >= stop:
            raise MalformedPacket("truncated byte property")
        return buf[pos], pos + 1
    if kind == _U16:
        return _read_u16(buf, pos, stop), pos + 2
    if kind == _U32:
        return _read_u32(buf, pos, stop), pos + 4
    if kind == _VARINT:
        return _read_varint(buf, pos, stop)
    if kind == _UTF8:
        return _read_str(buf, pos, stop)
    if kind == _BINARY:
        return _read_bytes(buf, pos, stop)
    key, pos = _read_str(buf, pos, stop)
    value, pos = _read_str(buf, pos, stop)
    return (key, value), pos


def _decode_properties(buf: bytes, pos: int, end: int, context: int) -> tuple[Properties, int]:
    length, pos = _read_varint(buf, pos, end)
    if length == 0:
        return NO_PROPERTIES, pos
    stop = pos + length
    if stop > end:
        raise MalformedPacket("property length runs past the end of the packet")
    values: dict[str, Any] = {}
    user_properties: list[tuple[str, str]] = []
    subscription_ids: list[int] = []
    while pos < stop:
        ident = buf[pos]
        row = _PROPERTY_BY_ID.get(ident)
        if row is None:
            raise MalformedPacket(f"unknown property identifier 0x{ident:02X}")
        _, name, kind, contexts = row
        if context not in contexts:
            # An identifier not valid for the packet type makes it malformed (2.2.2.2).
            raise MalformedPacket(f"property {name} is not allowed in {_CONTEXT_NAMES[context]}")
        value, pos = _read_property_value(buf, pos + 1, stop, kind)
        if kind == _PAIR:
            user_properties.append(value)  # may repeat, order kept [MQTT-3.3.2-18]
            continue
        if kind <= _VARINT and (error := _property_value_error(ident, kind, value)):
            raise ProtocolError(error, _value_error_code(ident))
        if ident == _SUBSCRIPTION_IDENTIFIER:
            # Several in a PUBLISH (one per matching subscription), one in a SUBSCRIBE.
            if subscription_ids and context != _PUBLISH:
                raise ProtocolError("subscription identifier included more than once")
            subscription_ids.append(value)
            continue
        if name in values:  # each property "more than once is a Protocol Error" (2.2.2.2)
            raise ProtocolError(f"property {name} included more than once")
        values[name] = value
    if user_properties:
        values["user_properties"] = tuple(user_properties)
    if subscription_ids:
        values["subscription_identifiers"] = tuple(subscription_ids)
    return Properties(**values), stop


def _encode_properties(props: Properties, context: int) -> bytes:
    """Property length plus properties, in identifier order."""
    if props is NO_PROPERTIES:
        return b"\x00"
    out = bytearray()
    for ident, name, kind, contexts in _PROPERTY_TABLE:
        value = getattr(props, name)
        if value is None or value == ():
            continue
        if context not in contexts:
            raise LocalProtocolError(f"property {name} is not allowed in {_CONTEXT_NAMES[context]}")
        if kind == _PAIR:
            for key, val in value:
                out.append(ident)
                out += _str(key)
                out += _str(val)
            continue
        if kind == _VARINT:
            if len(value) > 1 and context != _PUBLISH:
                raise LocalProtocolError("only one subscription identifier is allowed here")
            for sub_id in value:
                if error := _property_value_error(ident, kind, sub_id):
                    raise LocalProtocolError(error)
                out.append(ident)
                out += _varint(sub_id)
            continue
        out.append(ident)
        if kind == _UTF8:
            out += _str(value)
        elif kind == _BINARY:
            out += _bin(value)
        else:
            if error := _property_value_error(ident, kind, value):
                raise LocalProtocolError(error)
            if kind == _BYTE:
                out.append(value)
            elif kind == _U16:
                out += _u16(value, name)
            else:
                out += _u32(value, name)
    return _varint(len(out)) + bytes(out)


# -- decoding packet bodies -----------------------------------------------------------------------
# Each decoder takes (fixed header flags, body, is MQTT 5.0) and consumes the body exactly: bytes
# left over after the last field make the packet malformed.


def _no_trailing(pos: int, end: int, packet: str) -> None:
    if pos != end:
        raise MalformedPacket(f"{end - pos} unexpected trailing bytes in {packet}")


def _decode_connect(flags: int, body: bytes, v5: bool) -> Connect:
    # The version the decoder expects does not matter: CONNECT names its own.
    end = len(body)
    name, pos = _read_str(body, 0, end)
    if pos + 4 > end:
        raise MalformedPacket("truncated CONNECT variable header")
    level = body[pos]
    if not ((name == "MQTT" and level in (4, 5)) or (name == "MQIsdp" and level == 3)):
        # [MQTT-3.1.2-1] [MQTT-3.1.2-2]; the broker answers CONNACK 0x01 (3.1.1) or 0x84.
        raise UnsupportedProtocol(
            f"unsupported protocol {name!r} level {level}",
            known_name=name in ("MQTT", "MQIsdp"),
        )
    version = ProtocolVersion(level)
    v5 = version == _V5
    connect_flags = body[pos + 1]
    keepalive = (body[pos + 2] << 8) | body[pos + 3]
    pos += 4
    if connect_flags & 0x01:
        raise MalformedPacket("CONNECT reserved flag is set")  # [MQTT-3.1.2-3]
    will_flag = connect_flags & 0x04
    will_qos = (connect_flags >> 3) & 0x03
    will_retain = bool(connect_flags & 0x20)
    if will_flag:
        if will_qos == 3:
            raise MalformedPacket("will QoS 3")  # [MQTT-3.1.2-14] (3.1.1), [MQTT-3.1.2-12] (5.0)
    elif will_qos or will_retain:
        # [MQTT-3.1.2-13] [MQTT-3.1.2-15] (3.1.1), [MQTT-3.1.2-11] [MQTT-3.1.2-13] (5.0)
        raise MalformedPacket("will QoS or will retain set without the will flag")
    has_username = connect_flags & 0x80
    has_password = connect_flags & 0x40
    if has_password and not has_username and not v5:
        raise MalformedPacket("password flag without user name flag")  # [MQTT-3.1.2-22]
    properties = NO_PROPERTIES
    if v5:
        properties, pos = _decode_properties(body, pos, end, PacketType.CONNECT)
        if properties.authentication_data is not None and properties.authentication_method is None:
            raise ProtocolError("authentication data without authentication method")
    client_id, pos = _read_str(body, pos, end)
    will = None
    if will_flag:
        will_properties = NO_PROPERTIES
        if v5:
            will_properties, pos = _decode_properties(body, pos, end, _WILL)
        will_topic, pos = _read_str(body, pos, end)
        will_payload, pos = _read_bytes(body, pos, end)
        will = Will(will_topic, will_payload, _QOS[will_qos], will_retain, will_properties)
    username = password = None
    if has_username:
        username, pos = _read_str(body, pos, end)
    if has_password:
        password, pos = _read_bytes(body, pos, end)
    _no_trailing(pos, end, "CONNECT")
    return Connect(
        client_id=client_id,
        protocol_version=version,
        clean_start=bool(connect_flags & 0x02),
        keepalive=keepalive,
        will=will,
        username=username,
        password=password,
        properties=properties,
    )


def _decode_connack(flags: int, body: bytes, v5: bool) -> Connack:
    end = len(body)
    if end < 2:
        raise MalformedPacket("truncated CONNACK")
    ack_flags, code = body[0], body[1]
    if ack_flags & 0xFE:
        raise MalformedPacket("CONNACK reserved flags are set")  # [MQTT-3.2.2-1]
    session_present = bool(ack_flags)
    if v5:
        _reason_code(code, _CONNACK_CODES_5, "CONNACK")
        properties, pos = _decode_properties(body, 2, end, PacketType.CONNACK)
    else:
        _reason_code(code, _CONNACK_CODES_311, "CONNACK")
        properties, pos = NO_PROPERTIES, 2
    _no_trailing(pos, end, "CONNACK")
    if session_present and code:
        # [MQTT-3.2.2-4] (3.1.1), [MQTT-3.2.2-6] (5.0)
        raise ProtocolError("CONNACK refuses the connection but reports a session")
    return Connack(session_present, code, properties)


def _decode_publish(first: int, buf: bytes, pos: int, end: int, v5: bool, head: int = 0) -> Publish:
    """PUBLISH from ``buf[pos:end]``, read in place: the hot path, so no field helpers and one
    slice per field. QoS 3 and DUP were checked with the fixed header: ``first`` is its first
    byte, starting at ``head`` in ``buf`` (for ``Publish.wire``), or only its flag bits."""
    if pos + 2 > end:
        raise MalformedPacket("truncated PUBLISH topic")
    topic_end = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if topic_end > end:
        raise MalformedPacket("PUBLISH topic runs past the end of the packet")
    try:
        topic = buf[pos + 2 : topic_end].decode()
    except UnicodeDecodeError as exc:
        raise MalformedPacket(f"ill-formed UTF-8 string: {exc.reason}") from exc
    if "\x00" in topic:
        raise MalformedPacket("UTF-8 string contains U+0000")  # as _utf8 [MQTT-1.5.3-2]
    pos = topic_end
    qos = (first >> 1) & 0x03
    packet_id = None
    if qos:
        if pos + 2 > end:
            raise MalformedPacket("truncated PUBLISH packet identifier")
        packet_id = (buf[pos] << 8) | buf[pos + 1]
        if not packet_id:
            raise ProtocolError("PUBLISH packet identifier 0")  # [MQTT-2.3.1-1]
        pos += 2
    properties = NO_PROPERTIES
    if v5:
        if pos >= end:
            raise MalformedPacket("PUBLISH without property length")
        if buf[pos] == 0:  # fast path: no properties
            pos += 1
        else:
            properties, pos = _decode_properties(buf, pos, end, PacketType.PUBLISH)
    packet = Publish(
        topic,
        buf[pos:end],
        _QOS[qos],
        first & 0x01 != 0,
        first & 0x08 != 0,
        packet_id,
        properties,
    )
    if first & 0xF9 == 0x30 and properties is NO_PROPERTIES:
        # A whole fixed header (flag bits alone are below 0x10) without DUP or RETAIN: what
        # encode_publish makes of it for this protocol version, but for the packet id
        # (next_packet's fast path took only a minimal remaining length).
        packet.wire = buf[head:end]
    return packet


def _decode_publish_body(flags: int, body: bytes, v5: bool) -> Publish:
    # _decode_publish reads only the flag bits of its ``first`` argument.
    return _decode_publish(flags, body, 0, len(body), v5)


def _decode_ack_fields(
    body: bytes, v5: bool, packet_type: PacketType, codes: frozenset[int]
) -> tuple[int, int, Properties]:
    """PUBACK, PUBREC, PUBREL, PUBCOMP: packet id [, reason code [, properties]]."""
    end = len(body)
    packet_id = _read_packet_id(body, 0, end)
    if end == 2:
        return packet_id, 0, NO_PROPERTIES
    if not v5:
        raise MalformedPacket(f"{packet_type.name} longer than 2 bytes")
    code = _reason_code(body[2], codes, packet_type.name)
    if end == 3:  # reason code without property length (3.4.2.2)
        return packet_id, code, NO_PROPERTIES
    properties, pos = _decode_properties(body, 3, end, packet_type)
    _no_trailing(pos, end, packet_type.name)
    return packet_id, code, properties


def _decode_puback(flags: int, body: bytes, v5: bool) -> Puback:
    return Puback(*_decode_ack_fields(body, v5, PacketType.PUBACK, _PUBACK_CODES))


def _decode_pubrec(flags: int, body: bytes, v5: bool) -> Pubrec:
    return Pubrec(*_decode_ack_fields(body, v5, PacketType.PUBREC, _PUBACK_CODES))


def _decode_pubrel(flags: int, body: bytes, v5: bool) -> Pubrel:
    return Pubrel(*_decode_ack_fields(body, v5, PacketType.PUBREL, _PUBREL_CODES))


def _decode_pubcomp(flags: int, body: bytes, v5: bool) -> Pubcomp:
    return Pubcomp(*_decode_ack_fields(body, v5, PacketType.PUBCOMP, _PUBREL_CODES))


def _decode_subscription(body: bytes, pos: int, end: int, v5: bool) -> tuple[Subscription, int]:
    topic_filter, pos = _read_str(body, pos, end)
    if pos >= end:
        raise MalformedPacket("SUBSCRIBE topic filter without options")
    options = body[pos]
    qos = options & 0x03
    if not v5:
        if options & 0xFC or qos == 3:
            raise MalformedPacket("SUBSCRIBE reserved bits set or QoS 3")  # [MQTT-3-8.3-4]
        return Subscription(topic_filter, _QOS[qos]), pos + 1
    if options & 0xC0:
        raise MalformedPacket("subscription options reserved bits set")  # [MQTT-3.8.3-5]
    if qos == 3:
        raise ProtocolError("subscription maximum QoS 3")  # 3.8.3.1
    retain_handling = (options >> 4) & 0x03
    if retain_handling == 3:
        raise ProtocolError("subscription retain handling 3")  # 3.8.3.1
    subscription = Subscription(
        topic_filter,
        _QOS[qos],
        no_local=bool(options & 0x04),
        retain_as_published=bool(options & 0x08),
        retain_handling=_RETAIN_HANDLING[retain_handling],
    )
    return subscription, pos + 1


def _decode_subscribe(flags: int, body: bytes, v5: bool) -> Subscribe:
    end = len(body)
    packet_id = _read_packet_id(body, 0, end)
    properties, pos = NO_PROPERTIES, 2
    if v5:
        properties, pos = _decode_properties(body, pos, end, PacketType.SUBSCRIBE)
    subscriptions = []
    while pos < end:
        subscription, pos = _decode_subscription(body, pos, end, v5)
        subscriptions.append(subscription)
    if not subscriptions:
        raise ProtocolError("SUBSCRIBE without subscriptions")  # [MQTT-3.8.3-3]
    return Subscribe(packet_id, tuple(subscriptions), properties)


def _decode_codes(body: bytes, pos: int, allowed: frozenset[int], packet: str) -> tuple[int, ...]:
    codes = tuple(body[pos:])
    if not codes:
        raise ProtocolError(f"{packet} without reason codes")
    for code in codes:
        _reason_code(code, allowed, packet)
    return codes


def _decode_suback(flags: int, body: bytes, v5: bool) -> Suback:
    end = len(body)
    packet_id = _read_packet_id(body, 0, end)
    if not v5:
        return Suback(packet_id, _decode_codes(body, 2, _SUBACK_CODES_311, "SUBACK"))
    properties, pos = _decode_properties(body, 2, end, PacketType.SUBACK)
    return Suback(packet_id, _decode_codes(body, pos, _SUBACK_CODES_5, "SUBACK"), properties)


def _decode_unsubscribe(flags: int, body: bytes, v5: bool) -> Unsubscribe:
    end = len(body)
    packet_id = _read_packet_id(body, 0, end)
    properties, pos = NO_PROPERTIES, 2
    if v5:
        properties, pos = _decode_properties(body, pos, end, PacketType.UNSUBSCRIBE)
    topic_filters = []
    while pos < end:
        topic_filter, pos = _read_str(body, pos, end)
        topic_filters.append(topic_filter)
    if not topic_filters:
        raise ProtocolError("UNSUBSCRIBE without topic filters")  # [MQTT-3.10.3-2]
    return Unsubscribe(packet_id, tuple(topic_filters), properties)


def _decode_unsuback(flags: int, body: bytes, v5: bool) -> Unsuback:
    end = len(body)
    packet_id = _read_packet_id(body, 0, end)
    if not v5:
        _no_trailing(2, end, "UNSUBACK")
        return Unsuback(packet_id)
    properties, pos = _decode_properties(body, 2, end, PacketType.UNSUBACK)
    return Unsuback(packet_id, _decode_codes(body, pos, _UNSUBACK_CODES, "UNSUBACK"), properties)


def _decode_pingreq(flags: int, body: bytes, v5: bool) -> Pingreq:
    _no_trailing(0, len(body), "PINGREQ")
    return Pingreq()


def _decode_pingresp(flags: int, body: bytes, v5: bool) -> Pingresp:
    _no_trailing(0, len(body), "PINGRESP")
    return Pingresp()


def _decode_disconnect(flags: int, body: bytes, v5: bool) -> Disconnect:
    end = len(body)
    if not v5:
        _no_trailing(0, end, "DISCONNECT")
        return Disconnect()
    if end == 0:  # 3.14.2.1: no reason code means 0x00
        return Disconnect()
    code = _reason_code(body[0], _DISCONNECT_CODES, "DISCONNECT")
    if end == 1:  # 3.14.2.2.1: no property length means none
        return Disconnect(code)
    properties, pos = _decode_properties(body, 1, end, PacketType.DISCONNECT)
    _no_trailing(pos, end, "DISCONNECT")
    return Disconnect(code, properties)


def _decode_auth(flags: int, body: bytes, v5: bool) -> Auth:
    end = len(body)
    if end == 0:  # 3.15.2.1: success without properties may be sent as an empty body
        return Auth()
    code = _reason_code(body[0], _AUTH_CODES, "AUTH")
    properties, pos = _decode_properties(body, 1, end, PacketType.AUTH)
    _no_trailing(pos, end, "AUTH")
    return Auth(code, properties)


_BodyDecoder = Callable[[int, bytes, bool], Packet]
_DECODERS: Final[tuple[_BodyDecoder, ...]] = (
    _decode_connect,  # index 0 is never used: type 0 is rejected with the header
    _decode_connect,
    _decode_connack,
    _decode_publish_body,
    _decode_puback,
    _decode_pubrec,
    _decode_pubrel,
    _decode_pubcomp,
    _decode_subscribe,
    _decode_suback,
    _decode_unsubscribe,
    _decode_unsuback,
    _decode_pingreq,
    _decode_pingresp,
    _decode_disconnect,
    _decode_auth,
)


# -- the decoder ----------------------------------------------------------------------------------


_NO_CHUNKS: list[bytes] = []


class Decoder:
    """Incremental MQTT packet decoder: ``feed`` bytes, then take packets from ``next_packet``.

    ``max_packet_size`` bounds the whole packet (fixed header included, as the MQTT 5.0 Maximum
    Packet Size does); it may be lowered later, e.g. once the broker settings are known.

    Buffering: ``_data[_pos:]`` is what has not been returned yet. ``_data`` is immutable
    ``bytes``, so a field is one slice of it (no bytearray-to-bytes copy) and a feed that finds
    everything consumed is kept as it is, uncopied. A feed that arrives while bytes are left
    over waits in ``_chunks`` and is joined to them only when the packet at ``_pos`` needs it:
    a fixed header still incomplete, or a body that the chunks complete. So a large packet that
    trickles in is copied once when it is whole, not once per feed, and a buffer holding
    thousands of small packets is walked, never copied. A packet is consumed by moving ``_pos``
    past it; nothing is read tentatively, so there is nothing to roll back.
    """

    __slots__ = (
        "_chunked", "_chunks", "_data", "_pos", "decoded", "max_packet_size", "protocol_version",
    )  # fmt: skip

    def __init__(
        self,
        *,
        max_packet_size: int = DEFAULT_MAX_PACKET_SIZE,
        protocol_version: ProtocolVersion | None = None,
    ) -> None:
        if max_packet_size < 2:
            raise LocalProtocolError(f"max_packet_size {max_packet_size} is below 2")
        self._data = b""
        self._pos = 0
        # Shared and never appended to while empty (feed replaces it): an idle connection's
        # decoder holds no list of its own.
        self._chunks: list[bytes] = _NO_CHUNKS
        self._chunked = 0  # bytes in _chunks
        self.max_packet_size = max_packet_size
        self.protocol_version = protocol_version
        # Packets returned so far, for $SYS (the owner may reset it): counting here costs one
        # increment a packet, against a second walk of every read's framing.
        self.decoded = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as part of a packet."""
        return len(self._data) - self._pos + self._chunked

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._pos == len(self._data) and not self._chunks:
            self._data = bytes(data)  # the same object when it is bytes already
            self._pos = 0
        elif data:
            if self._chunks:
                self._chunks.append(bytes(data))
            else:
                self._chunks = [bytes(data)]
            self._chunked += len(data)

    def packets(self) -> Iterator[Packet]:
        """Every complete packet buffered so far."""
        while (packet := self.next_packet()) is not None:
            yield packet

    def next_packet(self) -> Packet | None:
        """The next complete packet, or None until more bytes arrive."""
        # The hot path reads a whole packet with a one- or two-byte remaining length straight
        # from _data; everything else (a header or body not all in _data, a longer or malformed
        # remaining length, an oversized packet) goes to _next_packet_slow, which checks in the
        # same order as this path does: fixed header, remaining length, size, body.
        data = self._data
        pos = self._pos
        end = len(data)
        if pos + 2 <= end:
            first = data[pos]
            stop = data[pos + 1]
            start = pos + 2
            if stop & 0x80:
                if start == end or not 0 < data[start] < 0x80:
                    return self._next_packet_slow()
                stop = (stop & 0x7F) | (data[start] << 7)
                start += 1
            stop += start
            if stop <= end and stop - pos <= self.max_packet_size:
                version = self.protocol_version
                # A valid PUBLISH on an established connection skips the header checks.
                if _VALID_PUBLISH_FIRST[first] and version:
                    self._pos = stop
                    self.decoded += 1
                    return _decode_publish(first, data, start, stop, version == _V5, pos)
                if first == 0x40 and stop - start == 2 and version:
                    # A plain PUBACK (a subscriber's, once per QoS 1 delivery): its packet id,
                    # which may not be 0 [MQTT-2.3.1-1] (then the general path raises).
                    packet_id = (data[start] << 8) | data[start + 1]
                    if packet_id:
                        self._pos = stop
                        self.decoded += 1
                        return Puback(packet_id)
                self._check_first_byte(first >> 4, first & 0x0F)
                self._pos = stop
                return self._decode(first, data[start:stop])
        return self._next_packet_slow()

    def same_publishes(
        self, qos: int, topic: bytes, max_count: int, max_bytes: int
    ) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """The PUBLISH packets at ``qos`` (0 or 1) without DUP, RETAIN or properties that
        follow the packet returned last and whose topic name is ``topic`` (as on the wire,
        with its length): their payloads, packet ids and bytes, at most ``max_count`` of them
        and ``max_bytes`` of payload; None when the next packet is not one. QoS 0: no ids,
        and the bytes of all of them in one piece (what a subscriber of this protocol
        version gets); QoS 1: each packet's own.

        The scan stops at the first packet it does not take whole from ``_data`` in the
        hot path's form (a one- or two-byte remaining length), or with a packet id 0:
        ``next_packet`` reads that one, and raises for it if it is malformed or too large.
        """
        data = self._data
        pos = begin = self._pos
        end = len(data)
        limit = self.max_packet_size
        first = 0x32 if qos else 0x30
        at = len(topic)  # where the packet id is, after the fixed header
        size = at + (2 if qos else 0)
        if self.protocol_version == _V5:
            size += 1  # the property length, 0
        payloads: list[bytes] = []
        pids: list[int] = []
        packets: list[bytes] = []
        taken = 0
        while pos + 2 <= end and data[pos] == first and len(payloads) < max_count:
            length = data[pos + 1]
            body = pos + 2
            if length & 0x80:
                if body == end or not 0 < data[body] < 0x80:
                    break
                length = (length & 0x7F) | (data[body] << 7)
                body += 1
            stop = body + length
            if (
                stop > end
                or stop - pos > limit
                or length < size
                or not data.startswith(topic, body)
                or (size > at + 2 * qos and data[body + size - 1])  # v5 properties
                or taken + length - size > max_bytes
            ):
                break
            if qos:
                pid = (data[body + at] << 8) | data[body + at + 1]
                if not pid:
                    break
                pids.append(pid)
                packets.append(data[pos:stop])
            taken += length - size
            payloads.append(data[body + size : stop])
            pos = stop
        if not payloads:
            return None
        self._pos = pos
        self.decoded += len(payloads)
        if not qos:
            packets.append(data[begin:pos])
        return payloads, pids, packets

    def same_pubacks(self, max_count: int) -> list[int] | None:
        """The packet ids of the plain PUBACK packets (no reason code, no properties) that
        follow the packet returned last, at most ``max_count`` of them; None when the next
        packet is not one. A packet id 0 ends them (next_packet refuses it)."""
        data = self._data
        pos = self._pos
        end = min(len(data), pos + 4 * max_count)
        pids: list[int] = []
        while pos + 4 <= end and data[pos] == 0x40 and data[pos + 1] == 2:
            pid = (data[pos + 2] << 8) | data[pos + 3]
            if not pid:
                break
            pids.append(pid)
            pos += 4
        if not pids:
            return None
        self._pos = pos
        self.decoded += len(pids)
        return pids

    def _next_packet_slow(self) -> Packet | None:
        data = self._data
        pos = self._pos
        end = len(data)
        if pos == end:
            if self._chunks:
                return self._join_and_retry()
            self._data = b""  # do not keep the last feed alive
            self._pos = 0
            return None
        first = data[pos]
        self._check_first_byte(first >> 4, first & 0x0F)
        header = _read_remaining_length(data, pos + 1, end)
        if header is None:
            if self._chunks:
                return self._join_and_retry()
            self._keep_unread()
            return None
        remaining, start = header
        size = start - pos + remaining
        if size > self.max_packet_size:
            # [MQTT-3.2.2-15]: refused from the header, before the body is buffered.
            raise PacketTooLarge(
                f"packet of {size} bytes exceeds the maximum of {self.max_packet_size}"
            )
        stop = start + remaining
        if stop > end:
            if stop - end <= self._chunked:
                return self._join_and_retry()
            if not self._chunks:
                self._keep_unread()
            return None
        self._pos = stop
        return self._decode(first, data[start:stop])

    def _keep_unread(self) -> None:
        """Drop the consumed prefix of ``_data`` while waiting for the rest of a packet."""
        if self._pos:
            self._data = self._data[self._pos :]
            self._pos = 0

    def _join_and_retry(self) -> Packet | None:
        self._data = b"".join((memoryview(self._data)[self._pos :], *self._chunks))
        self._pos = 0
        self._chunks = _NO_CHUNKS
        self._chunked = 0
        return self.next_packet()

    def _decode(self, first: int, body: bytes) -> Packet:
        """A packet whose fixed header passed the checks, from its body."""
        version = self.protocol_version
        packet = _DECODERS[first >> 4](first & 0x0F, body, version == _V5)
        if version is None and isinstance(packet, Connect):
            # Only a CONNECT gets here (see _check_first_byte); the server learns the version.
            self.protocol_version = packet.protocol_version
        self.decoded += 1
        return packet

    def _check_first_byte(self, packet_type: int, flags: int) -> None:
        if packet_type == _PUBLISH:
            if flags & 0x06 == 0x06:
                raise MalformedPacket("PUBLISH with QoS 3")  # [MQTT-3.3.1-4]
            if flags & 0x08 and not flags & 0x06:
                raise MalformedPacket("PUBLISH QoS 0 with DUP set")  # [MQTT-3.3.1-2]
        elif packet_type == 0:
            raise MalformedPacket("reserved packet type 0")
        elif flags != _FIXED_FLAGS[packet_type]:
            name = PacketType(packet_type).name
            raise MalformedPacket(f"invalid fixed header flags {flags:#06b} for {name}")
        version = self.protocol_version
        if version is None:
            if packet_type != _CONNECT:
                raise ProtocolError("the first packet must be CONNECT")  # [MQTT-3.1.0-1]
        elif packet_type == _AUTH and version != _V5:
            raise MalformedPacket("packet type 15 is reserved before MQTT 5.0")


# -- encoding -------------------------------------------------------------------------------------

_NO_PROPERTIES_BYTES: Final = b"\x00"
# Every fixed header of a PUBLISH whose remaining length fits one byte, by flags << 7 | length.
_SHORT_PUBLISH_HEADERS: Final = tuple(
    bytes((0x30 | flags, length)) for flags in range(16) for length in range(128)
)
# Topic names as they go on the wire (length prefix + UTF-8), memoised: fan-out encodes the same
# few topics over and over. A pure function's cache, bounded by clearing it when full.
_TOPIC_WIRE_CACHE: Final[dict[str, bytes]] = {}
_TOPIC_WIRE_CACHE_SIZE: Final = 4096


def _topic_wire(topic: str | bytes) -> bytes:
    """Length prefix + UTF-8 of a topic name (bytes are trusted to be UTF-8 already); a str is
    remembered in ``_TOPIC_WIRE_CACHE``, where ``encode_publish`` looks first."""
    raw = _utf8_bytes(topic) if isinstance(topic, str) else topic
    if len(raw) > 0xFFFF:
        raise LocalProtocolError(f"topic of {len(raw)} bytes is longer than 65535")
    wire = len(raw).to_bytes(2, "big") + raw
    if isinstance(topic, str):
        if len(_TOPIC_WIRE_CACHE) >= _TOPIC_WIRE_CACHE_SIZE:
            _TOPIC_WIRE_CACHE.clear()
        _TOPIC_WIRE_CACHE[topic] = wire
    return wire


def encode_publish(  # positional on purpose: the delivery hot path
    topic: str | bytes,
    payload: bytes,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int | None,
    protocol_version: ProtocolVersion,
    properties: Properties | None = None,
) -> bytes:
    """One PUBLISH packet, built with a single join.

    ``topic`` may be given already UTF-8 encoded (no length prefix) so a fan-out encodes it
    once for all subscribers; such bytes are trusted to be valid.
    """
    topic_wire = _TOPIC_WIRE_CACHE.get(topic) if isinstance(topic, str) else None
    if topic_wire is None:
        topic_wire = _topic_wire(topic)
    if qos == 0:
        if packet_id is not None:
            raise LocalProtocolError("QoS 0 PUBLISH with a packet identifier")  # [MQTT-2.3.1-5]
        if dup:
            raise LocalProtocolError("QoS 0 PUBLISH with DUP set")  # [MQTT-3.3.1-2]
        id_bytes = b""
    elif qos in (1, 2):
        if packet_id is None:
            raise LocalProtocolError(f"QoS {qos} PUBLISH without a packet identifier")
        id_bytes = _packet_id(packet_id)
    else:
        raise LocalProtocolError(f"PUBLISH QoS {qos}")
    if protocol_version != _V5:
        props = b""
    elif properties is None or properties is NO_PROPERTIES:
        props = _NO_PROPERTIES_BYTES
    else:
        props = _encode_properties(properties, _PUBLISH)
    flags = (qos << 1) | (0x08 if dup else 0) | (0x01 if retain else 0)
    remaining = len(topic_wire) + len(id_bytes) + len(props) + len(payload)
    if remaining < 128:
        header = _SHORT_PUBLISH_HEADERS[flags << 7 | remaining]
    else:
        header = bytes((0x30 | flags,)) + _varint(remaining)
    return b"".join((header, topic_wire, id_bytes, props, payload))


def _encode_connect(packet: Connect, version: ProtocolVersion) -> bytes:
    if packet.protocol_version != version:
        raise LocalProtocolError(
            f"CONNECT for {packet.protocol_version.name} encoded as {version.name}"
        )
    v5 = version == _V5
    name = b"\x00\x06MQIsdp" if version == ProtocolVersion.MQTT_3_1 else b"\x00\x04MQTT"
    flags = 0x02 if packet.clean_start else 0
    will = packet.will
    if will is not None:
        if will.qos not in (0, 1, 2):
            raise LocalProtocolError(f"will QoS {will.qos}")
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
    if packet.username is not None:
        flags |= 0x80
    if packet.password is not None:
        if packet.username is None and not v5:
            raise LocalProtocolError("password without user name")  # [MQTT-3.1.2-22]
        flags |= 0x40
    parts = [name, bytes((version, flags)), _u16(packet.keepalive, "keepalive")]
    if v5:
        parts.append(_encode_properties(packet.properties, PacketType.CONNECT))
    parts.append(_str(packet.client_id))
    if will is not None:
        if v5:
            parts.append(_encode_properties(will.properties, _WILL))
        parts += (_str(will.topic), _bin(will.payload))
    if packet.username is not None:
        parts.append(_str(packet.username))
    if packet.password is not None:
        parts.append(_bin(packet.password))
    return _frame(0x10, b"".join(parts))


def _encode_connack(packet: Connack, v5: bool) -> bytes:
    code = packet.reason_code
    _check_code(code, _CONNACK_CODES_5 if v5 else _CONNACK_CODES_311, "CONNACK")
    if packet.session_present and code:
        raise LocalProtocolError("refused CONNACK with session present")  # [MQTT-3.2.2-6]
    body = bytes((0x01 if packet.session_present else 0, code))
    if v5:
        body += _encode_properties(packet.properties, PacketType.CONNACK)
    return _frame(0x20, body)


def _encode_ack(
    packet: Puback | Pubrec | Pubrel | Pubcomp, v5: bool, first: int, codes: frozenset[int]
) -> bytes:
    packet_type = packet.packet_type
    body = _packet_id(packet.packet_id)
    if v5:
        code = _check_code(packet.reason_code, codes, packet_type.name)
        if _has_properties(packet.properties):
            body += bytes((code,)) + _encode_properties(packet.properties, packet_type)
        elif code:  # 3.4.2.1: the reason code may be omitted when it is 0x00
            body += bytes((code,))
    return bytes((first, len(body))) + body if len(body) < 128 else _frame(first, body)


def _encode_subscribe(packet: Subscribe, v5: bool) -> bytes:
    if not packet.subscriptions:
        raise LocalProtocolError("SUBSCRIBE without subscriptions")  # [MQTT-3.8.3-3]
    parts = [_packet_id(packet.packet_id)]
    if v5:
        parts.append(_encode_properties(packet.properties, PacketType.SUBSCRIBE))
    for sub in packet.subscriptions:
        if sub.qos not in (0, 1, 2):
            raise LocalProtocolError(f"subscription QoS {sub.qos}")
        options = int(sub.qos)
        if v5:
            if sub.retain_handling not in (0, 1, 2):
                raise LocalProtocolError(f"retain handling {sub.retain_handling}")
            options |= (
                (0x04 if sub.no_local else 0)
                | (0x08 if sub.retain_as_published else 0)
                | (sub.retain_handling << 4)
            )
        parts += (_str(sub.topic_filter), bytes((options,)))
    return _frame(0x82, b"".join(parts))


def _encode_suback(packet: Suback, v5: bool) -> bytes:
    if not packet.reason_codes:
        raise LocalProtocolError("SUBACK without reason codes")
    allowed = _SUBACK_CODES_5 if v5 else _SUBACK_CODES_311
    for code in packet.reason_codes:
        _check_code(code, allowed, "SUBACK")
    props = _encode_properties(packet.properties, PacketType.SUBACK) if v5 else b""
    return _frame(0x90, _packet_id(packet.packet_id) + props + bytes(packet.reason_codes))


def _encode_unsubscribe(packet: Unsubscribe, v5: bool) -> bytes:
    if not packet.topic_filters:
        raise LocalProtocolError("UNSUBSCRIBE without topic filters")  # [MQTT-3.10.3-2]
    parts = [_packet_id(packet.packet_id)]
    if v5:
        parts.append(_encode_properties(packet.properties, PacketType.UNSUBSCRIBE))
    parts += (_str(topic_filter) for topic_filter in packet.topic_filters)
    return _frame(0xA2, b"".join(parts))


def _encode_unsuback(packet: Unsuback, v5: bool) -> bytes:
    body = _packet_id(packet.packet_id)
    if v5:
        if not packet.reason_codes:
            raise LocalProtocolError("MQTT 5.0 UNSUBACK without reason codes")
        for code in packet.reason_codes:
            _check_code(code, _UNSUBACK_CODES, "UNSUBACK")
        props = _encode_properties(packet.properties, PacketType.UNSUBACK)
        body += props + bytes(packet.reason_codes)
    return _frame(0xB0, body)


def _encode_disconnect(packet: Disconnect, v5: bool) -> bytes:
    if not v5:
        return b"\xe0\x00"
    code = _check_code(packet.reason_code, _DISCONNECT_CODES, "DISCONNECT")
    if _has_properties(packet.properties):
        props = _encode_properties(packet.properties, PacketType.DISCONNECT)
        return _frame(0xE0, bytes((code,)) + props)
    return bytes((0xE0, 1, code)) if code else b"\xe0\x00"


def _encode_auth(packet: Auth, v5: bool) -> bytes:
    if not v5:
        raise LocalProtocolError("AUTH does not exist before MQTT 5.0")
    code = _check_code(packet.reason_code, _AUTH_CODES, "AUTH")
    if not code and not _has_properties(packet.properties):
        return b"\xf0\x00"
    return _frame(0xF0, bytes((code,)) + _encode_properties(packet.properties, PacketType.AUTH))


def encode(packet: Packet, protocol_version: ProtocolVersion) -> bytes:
    """The wire form of ``packet`` in ``protocol_version``.

    For 3.1 and 3.1.1, fields that format has no room for (properties, reason codes on acks and
    UNSUBACK, subscription options other than QoS) are dropped.
    """
    v5 = protocol_version == _V5
    match packet:
        case Publish():
            return encode_publish(
                packet.topic,
                packet.payload,
                packet.qos,
                packet.retain,
                packet.dup,
                packet.packet_id,
                protocol_version,
                packet.properties,
            )
        case Puback():
            return _encode_ack(packet, v5, 0x40, _PUBACK_CODES)
        case Pubrec():
            return _encode_ack(packet, v5, 0x50, _PUBACK_CODES)
        case Pubrel():
            return _encode_ack(packet, v5, 0x62, _PUBREL_CODES)
        case Pubcomp():
            return _encode_ack(packet, v5, 0x70, _PUBREL_CODES)
        case Pingreq():
            return b"\xc0\x00"
        case Pingresp():
            return b"\xd0\x00"
        case Connect():
            return _encode_connect(packet, protocol_version)
        case Connack():
            return _encode_connack(packet, v5)
        case Subscribe():
            return _encode_subscribe(packet, v5)
        case Suback():
            return _encode_suback(packet, v5)
        case Unsubscribe():
            return _encode_unsubscribe(packet, v5)
        case Unsuback():
            return _encode_unsuback(packet, v5)
        case Disconnect():
            return _encode_disconnect(packet, v5)
        case Auth():
            return _encode_auth(packet, v5)
    raise LocalProtocolError(f"not an MQTT packet: {packet!r}")
