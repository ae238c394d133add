"""What the edge answers to each protocol violation, read off the raw socket.

Every expectation below comes from the MQTT 5.0 (OASIS, 2019) or 3.1.1 (OASIS, 2014) text,
cited per row, not from what the edge happens to do. The rules the tables rest on:

* MQTT 5.0 section 1.2: a *Malformed Packet* "cannot be parsed according to this
  specification"; a *Protocol Error* is "detected after the packet has been parsed and found to
  contain data that is not allowed by the protocol or is inconsistent with the state".
* MQTT 5.0 section 4.13.1: on either, the Server "MUST close the Network Connection"
  [MQTT-4.13.1-1]; for an error in CONNECT it "MAY send a CONNACK packet containing the Reason
  Code"; for any other packet it "SHOULD send a DISCONNECT packet containing the Reason Code
  before closing", using 0x81 or 0x82 "unless a more specific Reason Code has been defined".
  The DISCONNECT is a SHOULD in the text; these tests hold the edge to it.
* MQTT 3.1.1 has no DISCONNECT from the Server (Table 2.1: Client to Server only), so a violation
  simply closes the connection [MQTT-4.8.0-1] with nothing sent first.

Each violation is followed by a PINGREQ: a PINGRESP coming back proves the edge carried on after
the violation, so a failing row fails at once instead of waiting for a timeout.

Raw input bytes are written out in full so a failing row is its own reproduction.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from broker_edge.codec import Decoder
from broker_edge.packets import Connack, ProtocolVersion

TIMEOUT = 10.0
# A compliant edge closes at once; this only bounds how long a failing row waits.
CLOSE_WAIT = 5.0

PINGREQ = b"\xc0\x00"
PINGRESP_TYPE = 0xD
DISCONNECT_TYPE = 0xE
SUBACK_TYPE = 0x9

MALFORMED = 0x81
PROTOCOL_ERROR = 0x82
TOPIC_NAME_INVALID = 0x90
TOPIC_ALIAS_INVALID = 0x94


# -- raw packets ---------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        value, digit = divmod(value, 128)
        out.append(digit | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _frame(first: int, body: bytes) -> bytes:
    return bytes((first,)) + _varint(len(body)) + body


def _str(raw: bytes) -> bytes:
    return len(raw).to_bytes(2, "big") + raw


def connect_v5(
    client_id: bytes = b"rc", *, flags: int = 0x02, props: bytes = b"", tail: bytes = b""
) -> bytes:
    """CONNECT "MQTT" level 5, keepalive 60; ``props`` without their length, ``tail`` after
    the client id (will properties/topic/payload, user name, password)."""
    body = _str(b"MQTT") + bytes((5, flags)) + b"\x00\x3c" + _varint(len(props)) + props
    return _frame(0x10, body + _str(client_id) + tail)


def connect_v311(client_id: bytes = b"rc", *, flags: int = 0x02, tail: bytes = b"") -> bytes:
    body = _str(b"MQTT") + bytes((4, flags)) + b"\x00\x3c" + _str(client_id) + tail
    return _frame(0x10, body)


def publish_v5(topic: bytes, payload: bytes = b"", *, props: bytes = b"") -> bytes:
    return _frame(0x30, _str(topic) + _varint(len(props)) + props + payload)


# -- reading what the edge sends -----------------------------------------------------------------


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    """Split server output into (first byte, body), independently of the codec under test."""
    out = []
    pos = 0
    try:
        while pos < len(data):
            first = data[pos]
            pos += 1
            length = 0
            for shift in (0, 7, 14, 21):
                byte = data[pos]
                pos += 1
                length |= (byte & 0x7F) << shift
                if not byte & 0x80:
                    break
            if pos + length > len(data):
                raise IndexError
            out.append((first, data[pos : pos + length]))
            pos += length
    except IndexError:
        pytest.fail(f"edge sent a partial packet: {data.hex(' ')}")
    return out


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            pytest.fail(f"connection closed after {data.hex(' ')!r}, wanted {count} bytes")
        data += chunk
    return data


def _read_packet(sock: socket.socket) -> bytes:
    """One whole packet, fixed header included."""
    header = _recv_exact(sock, 1)
    length = 0
    for shift in (0, 7, 14, 21):
        byte = _recv_exact(sock, 1)
        header += byte
        length |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            break
    return header + _recv_exact(sock, length)


@dataclass
class Outcome:
    """Everything the edge sent after the violation, and whether it then closed."""

    data: bytes
    closed: bool

    @property
    def frames(self) -> list[tuple[int, bytes]]:
        return _frames(self.data)

    def describe(self) -> str:
        state = "closed" if self.closed else "kept the connection open"
        return f"edge sent [{self.data.hex(' ')}] and {state}"


def _outcome(sock: socket.socket, wait: float = CLOSE_WAIT) -> Outcome:
    """Read until the edge closes, answers the trailing PINGREQ, or ``wait`` runs out."""
    data = b""
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:  # closed with our PINGREQ unread: still a close
            return Outcome(data, closed=True)
        if not chunk:
            return Outcome(data, closed=True)
        data += chunk
        if _has_pingresp(data):
            return Outcome(data, closed=False)
    return Outcome(data, closed=False)


def _has_pingresp(data: bytes) -> bool:
    # Only whole packets count; a partial tail is simply not looked at yet.
    pos = 0
    while pos + 2 <= len(data):
        first, pos = data[pos], pos + 1
        length, shift = 0, 0
        while pos < len(data):
            byte, pos = data[pos], pos + 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        else:
            return False
        if first >> 4 == PINGRESP_TYPE:
            return True
        pos += length
    return False


@contextmanager
def _connected(port: int, connect: bytes) -> Iterator[tuple[socket.socket, bytes]]:
    """A raw connection that sent ``connect`` and read the whole CONNACK."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    try:
        sock.sendall(connect)
        connack = _read_packet(sock)
        assert connack[0] == 0x20, connack.hex(" ")
        yield sock, connack
    finally:
        sock.close()


def _connack_v5(raw: bytes) -> Connack:
    """The CONNACK's fields, decoded only to learn the capabilities the edge announced."""
    decoder = Decoder(protocol_version=ProtocolVersion.MQTT_5)
    decoder.feed(raw)
    packet = decoder.next_packet()
    assert isinstance(packet, Connack), raw.hex(" ")
    assert packet.reason_code == 0, f"CONNACK refused: {raw.hex(' ')}"
    return packet


def _assert_disconnect(outcome: Outcome, codes: frozenset[int]) -> None:
    """MQTT 5.0: the last thing sent is one DISCONNECT with one of ``codes``, then close."""
    frames = outcome.frames
    disconnects = [body for first, body in frames if first >> 4 == DISCONNECT_TYPE]
    assert disconnects, f"no DISCONNECT: {outcome.describe()}"
    assert len(disconnects) == 1, outcome.describe()
    assert frames[-1][0] == 0xE0, f"DISCONNECT is not last / has flags: {outcome.describe()}"
    body = disconnects[0]
    reason = body[0] if body else 0x00  # no reason code means 0x00 (3.14.2.1)
    wanted = ", ".join(f"0x{c:02X}" for c in sorted(codes))
    assert reason in codes, f"DISCONNECT 0x{reason:02X}, spec wants {wanted}: {outcome.describe()}"
    assert outcome.closed, outcome.describe()


def _assert_closed_silently(outcome: Outcome) -> None:
    """MQTT 3.1.1: nothing more is sent (there is no server DISCONNECT), then close."""
    assert outcome.data == b"", outcome.describe()
    assert outcome.closed, outcome.describe()


def _assert_refused_before_connack(outcome: Outcome, codes: frozenset[int]) -> None:
    """MQTT 5.0 CONNECT error: close, optionally after one CONNACK with one of ``codes``."""
    assert outcome.closed, outcome.describe()
    if outcome.data:
        frames = outcome.frames
        assert len(frames) == 1, outcome.describe()
        first, body = frames[0]
        assert first == 0x20, outcome.describe()
        assert len(body) >= 2, outcome.describe()
        assert body[1] in codes, outcome.describe()


# -- MQTT 5.0: violations after CONNACK ----------------------------------------------------------

M = frozenset({MALFORMED})
P = frozenset({PROTOCOL_ERROR})
# The spec names no code for these: parsed but not allowed (1.2) is a Protocol Error, and 0x90
# "Topic Name invalid" is the more specific code 4.13.1 prefers where one applies.
TOPIC = frozenset({PROTOCOL_ERROR, TOPIC_NAME_INVALID})
# Unclassified by the text: either generic code is a correct answer.
EITHER = frozenset({MALFORMED, PROTOCOL_ERROR})

V5_VIOLATIONS = [
    # -- Malformed Packet (0x81): the bytes cannot be parsed ----------------------------------
    # 1.5.5: "The maximum number of bytes in the Variable Byte Integer field is four."
    pytest.param(b"\x30\xff\xff\xff\xff\x7f", M, id="remaining-length-of-five-bytes"),
    # [MQTT-1.5.5-1] "MUST use the minimum number of bytes": PINGREQ, length 0 in two bytes.
    pytest.param(b"\xc0\x80\x00", M, id="remaining-length-not-minimal"),
    # 1.5.4: a two-byte string length (5) runs past the 3-byte body: a truncated field.
    pytest.param(b"\x30\x03\x00\x05a", M, id="topic-length-past-end"),
    # 3.3.2.2: QoS 1 needs a two-byte packet identifier after the topic; the body ends first.
    pytest.param(b"\x32\x03\x00\x01a", M, id="qos1-publish-truncated-before-packet-id"),
    # 2.2.2.1: Property Length 5 with one byte of properties left in the packet.
    pytest.param(b"\x30\x05\x00\x01a\x05\x01", M, id="property-length-past-end"),
    # [MQTT-1.5.4-1] "ill-formed UTF-8 ... is a Malformed Packet": C3 28 is not UTF-8.
    pytest.param(b"\x30\x06\x00\x02\xc3\x28\x00x", M, id="topic-ill-formed-utf8"),
    # [MQTT-1.5.4-1] "MUST NOT include encodings of code points between U+D800 and U+DFFF".
    pytest.param(b"\x30\x07\x00\x03\xed\xa0\x80\x00x", M, id="topic-utf8-surrogate"),
    # [MQTT-1.5.4-2] "MUST NOT include an encoding of the null character U+0000".
    pytest.param(b"\x30\x06\x00\x02a\x00\x00x", M, id="topic-contains-nul"),
    # [MQTT-2.1.3-1] reserved flag bits "MUST be set to the value listed ... If invalid flags
    # are received it is a Malformed Packet": PINGREQ with flags 0001.
    pytest.param(b"\xc1\x00", M, id="pingreq-reserved-flags"),
    # [MQTT-3.8.1-1] SUBSCRIBE flags MUST be 0010, "treat any other value as malformed".
    pytest.param(b"\x80\x07\x00\x01\x00\x00\x01a\x00", M, id="subscribe-reserved-flags"),
    # [MQTT-3.6.1-1] PUBREL flags MUST be 0010, "treat any other value as malformed".
    pytest.param(b"\x60\x02\x00\x01", M, id="pubrel-reserved-flags"),
    # [MQTT-3.3.1-4] both QoS bits set "is a Malformed Packet. Use DISCONNECT with 0x81".
    pytest.param(b"\x36\x06\x00\x01a\x00\x01\x00", M, id="publish-qos-3"),
    # [MQTT-3.8.3-5] "treat a SUBSCRIBE packet as malformed if any of Reserved bits in the
    # Payload are non-zero": subscription options 0xC1.
    pytest.param(b"\x82\x07\x00\x01\x00\x00\x01a\xc1", M, id="subscription-options-reserved-bits"),
    # 2.2.2.2: "an Identifier which is not valid for its packet type ... is a Malformed
    # Packet ... use a CONNACK or DISCONNECT packet with Reason Code 0x81": identifier 0x7F.
    pytest.param(b"\x30\x07\x00\x01a\x02\x7f\x00x", M, id="unknown-property-identifier"),
    # 2.2.2.2 again: Session Expiry Interval (0x11) exists, but not in PUBLISH.
    pytest.param(
        b"\x30\x0a\x00\x01a\x05\x11\x00\x00\x00\x01x",
        M,
        id="property-not-valid-for-publish",
    ),
    # -- Protocol Error (0x82): parsed, but not allowed --------------------------------------
    # [MQTT-3.1.0-2] "MUST process a second CONNECT packet ... as a Protocol Error".
    pytest.param(connect_v5(b"rc"), P, id="second-connect"),
    # [MQTT-2.2.1-3] a QoS > 0 PUBLISH "MUST assign it a non-zero Packet Identifier".
    pytest.param(b"\x32\x06\x00\x01a\x00\x00\x00", P, id="qos1-publish-packet-id-0"),
    # 3.3.2.3.9: "It is a Protocol Error to include the Content Type more than once."
    pytest.param(
        b"\x30\x0d\x00\x01a\x08\x03\x00\x01a\x03\x00\x01bx", P, id="duplicate-content-type"
    ),
    # 3.15: "It is a Protocol Error for the Client or Server to send an AUTH packet if the
    # CONNECT packet did not contain the same Authentication Method"; 3.15.2.2.2: "It is a
    # Protocol Error to omit the Authentication Method".
    pytest.param(b"\xf0\x00", P, id="auth-without-method"),
    # [MQTT-3.8.3-2] "A SUBSCRIBE packet with no Payload is a Protocol Error."
    pytest.param(b"\x82\x03\x00\x01\x00", P, id="subscribe-without-payload"),
    # 3.8.3.1: "It is a Protocol Error if the Maximum QoS field has the value 3."
    pytest.param(b"\x82\x07\x00\x01\x00\x00\x01a\x03", P, id="subscription-qos-3"),
    # 3.8.3.1: "It is a Protocol Error to send a Retain Handling value of 3."
    pytest.param(b"\x82\x07\x00\x01\x00\x00\x01a\x30", P, id="retain-handling-3"),
    # [MQTT-3.10.3-2] "An UNSUBSCRIBE packet with no Payload is a Protocol Error."
    pytest.param(b"\xa2\x03\x00\x01\x00", P, id="unsubscribe-without-payload"),
    # 3.8.2.1.2: "It is a Protocol Error if the Subscription Identifier has a value of 0."
    pytest.param(
        b"\x82\x09\x00\x01\x02\x0b\x00\x00\x01a\x00",
        frozenset({PROTOCOL_ERROR, 0xA1}),  # 0xA1 if identifiers are not supported at all
        id="subscription-identifier-0",
    ),
    # [MQTT-3.3.4-6] "A PUBLISH packet sent from a Client to a Server MUST NOT contain a
    # Subscription Identifier"; 3.3.4: "It is a Protocol Error for a PUBLISH packet to contain
    # any Subscription Identifier other than those received in SUBSCRIBE".
    pytest.param(
        b"\x30\x07\x00\x01a\x02\x0b\x01x",
        P,
        id="publish-from-client-with-subscription-identifier",
    ),
    # Table 2-1: CONNACK flows Server to Client only; DISCONNECT 0x82 is "An unexpected or out
    # of order packet was received".
    pytest.param(b"\x20\x03\x00\x00\x00", P, id="connack-from-client"),
    # Table 2-1: packet type 0 is "Reserved / Forbidden"; the text does not classify it.
    pytest.param(b"\x00\x00", EITHER, id="reserved-packet-type-0"),
    # [MQTT-3.4.2-1] "MUST use one of the PUBACK Reason Codes"; 0x05 is not one.
    pytest.param(b"\x40\x03\x00\x01\x05", EITHER, id="puback-unknown-reason-code"),
    # 3.3.4: "A Topic Alias value of 0 or greater than the Maximum Topic Alias is a Protocol
    # Error, the receiver uses DISCONNECT with Reason Code of 0x94 (Topic Alias invalid)";
    # [MQTT-3.3.2-8] "A Topic Alias of 0 is not permitted".
    pytest.param(
        b"\x30\x08\x00\x01a\x03\x23\x00\x00x",
        frozenset({TOPIC_ALIAS_INVALID}),
        id="topic-alias-0",
    ),
    # -- Topic Name invalid ------------------------------------------------------------------
    # [MQTT-3.3.2-2] "The Topic Name in the PUBLISH packet MUST NOT contain wildcard
    # characters"; [MQTT-4.7.0-1] "MUST NOT be used within a Topic Name".
    pytest.param(b"\x30\x06\x00\x03a/#\x00", TOPIC, id="multi-level-wildcard-in-topic-name"),
    pytest.param(b"\x30\x06\x00\x03a/+\x00", TOPIC, id="single-level-wildcard-in-topic-name"),
    # 3.3.2.1: "It is a Protocol Error if the Topic Name is zero length and there is no Topic
    # Alias."
    pytest.param(b"\x30\x03\x00\x00\x00", TOPIC, id="empty-topic-name-without-alias"),
]


@pytest.mark.parametrize(("violation", "codes"), V5_VIOLATIONS)
def test_v5_violation_gets_disconnect_with_reason_code(edge, violation, codes):
    with _connected(edge.port, connect_v5()) as (sock, _):
        sock.sendall(violation + PINGREQ)
        _assert_disconnect(_outcome(sock), codes)


# -- MQTT 5.0: violations of what the edge announced in its CONNACK -------------------------------


@dataclass(frozen=True)
class CapabilityRow:
    applies: Callable[[Connack], bool]
    violation: Callable[[Connack], bytes]
    codes: frozenset[int]


def _topic_alias_above_maximum(connack: Connack) -> bytes:
    alias = (connack.properties.topic_alias_maximum or 0) + 1  # absent means 0 (3.2.2.3.8)
    return publish_v5(b"a", b"x", props=b"\x23" + alias.to_bytes(2, "big"))


def _receive_maximum_exceeded(connack: Connack) -> bytes:
    # One more QoS 1 PUBLISH than Receive Maximum, in one write: the edge reads them in one go,
    # before any can have been acknowledged (acknowledgements wait for the journal).
    allowed = connack.properties.receive_maximum or 65_535  # absent means 65535 (3.2.2.3.3)
    body = lambda pid: _str(b"rm") + pid.to_bytes(2, "big") + b"\x00" + b"x"  # noqa: E731
    return b"".join(_frame(0x32, body(pid)) for pid in range(1, allowed + 2))


CAPABILITY_ROWS = [
    # 3.3.4: a Topic Alias "greater than the Maximum Topic Alias is a Protocol Error, the
    # receiver uses DISCONNECT with Reason Code of 0x94"; [MQTT-3.2.2-18] "If Topic Alias
    # Maximum is absent or 0, the Client MUST NOT send any Topic Aliases".
    pytest.param(
        CapabilityRow(lambda c: True, _topic_alias_above_maximum, frozenset({TOPIC_ALIAS_INVALID})),
        id="topic-alias-above-maximum",
    ),
    # 3.3.4 3(a): "If the receiver does not already have a mapping for this Topic Alias ... If
    # the packet has a zero length Topic Name field it is a Protocol Error and the receiver
    # uses DISCONNECT with Reason Code of 0x82".
    pytest.param(
        CapabilityRow(
            lambda c: (c.properties.topic_alias_maximum or 0) >= 1,
            lambda c: publish_v5(b"", b"x", props=b"\x23\x00\x01"),
            P,
        ),
        id="topic-alias-never-set-with-empty-topic",
    ),
    # [MQTT-3.3.4-7] and 3.3.4: "If it receives more than Receive Maximum QoS 1 and QoS 2
    # PUBLISH packets where it has not sent a PUBACK or PUBCOMP in response, the Server uses a
    # DISCONNECT packet with Reason Code 0x93 (Receive Maximum exceeded)".
    pytest.param(
        CapabilityRow(
            lambda c: (c.properties.receive_maximum or 65_535) <= 1000,
            _receive_maximum_exceeded,
            frozenset({0x93}),
        ),
        id="receive-maximum-exceeded",
    ),
    # 3.2.2.3.12: "If the Server receives a SUBSCRIBE packet containing Subscription Identifier
    # and it does not support Subscription Identifiers, this is a Protocol Error. The Server
    # uses DISCONNECT with Reason Code of 0xA1".
    pytest.param(
        CapabilityRow(
            lambda c: c.properties.subscription_identifier_available == 0,
            lambda c: b"\x82\x09\x00\x01\x02\x0b\x01\x00\x01a\x00",
            frozenset({0xA1}),
        ),
        id="subscription-identifier-not-supported",
    ),
    # 3.2.2.3.13: "If the Server receives a SUBSCRIBE packet containing Shared Subscriptions
    # and it does not support Shared Subscriptions, this is a Protocol Error. The Server uses
    # DISCONNECT with Reason Code 0x9E".
    pytest.param(
        CapabilityRow(
            lambda c: c.properties.shared_subscription_available == 0,
            lambda c: b"\x82\x10\x00\x01\x00\x00\x0a$share/g/a\x01",
            frozenset({0x9E}),
        ),
        id="shared-subscription-not-supported",
    ),
]


@pytest.mark.parametrize("row", CAPABILITY_ROWS)
def test_v5_capability_used_as_the_connack_announces_it(edge, row):
    with _connected(edge.port, connect_v5()) as (sock, raw):
        connack = _connack_v5(raw)
        sock.sendall(row.violation(connack) + PINGREQ)
        outcome = _outcome(sock)
        if row.applies(connack):
            _assert_disconnect(outcome, row.codes)
        else:
            # The edge announces the capability, so the same packet is a valid use of it:
            # granted (SUBACK, every reason code a success), and the connection stays up.
            assert not outcome.closed, outcome.describe()
            subacks = [body for first, body in outcome.frames if first >> 4 == SUBACK_TYPE]
            assert len(subacks) == 1, outcome.describe()
            props_len = subacks[0][2]  # packet id (2 bytes), then a one-byte property length
            assert all(code < 0x80 for code in subacks[0][3 + props_len :]), outcome.describe()


# -- Maximum Packet Size (make_edge(max_packet_size=1024)) ---------------------------------------

MAX_PACKET = 1024


def _publish_of_size(total: int) -> bytes:
    """A v5 QoS 0 PUBLISH to "big" that is exactly ``total`` bytes on the wire."""
    overhead = 1 + 2 + len(b"big") + 1  # first byte, topic, property length
    for varint_size in (1, 2, 3):
        body = total - 1 - varint_size
        if len(_varint(body)) == varint_size:
            packet = publish_v5(b"big", b"p" * (body - (overhead - 1)))
            assert len(packet) == total
            return packet
    raise AssertionError(total)


def test_v5_connack_announces_maximum_packet_size(make_edge):
    # 3.2.2.3.6: "If the Maximum Packet Size is not present, there is no limit on the packet
    # size imposed beyond the limitations in the protocol"; an edge that refuses larger packets
    # has to say so, or a compliant client cannot know it will be disconnected.
    edge = make_edge(max_packet_size=MAX_PACKET)
    with _connected(edge.port, connect_v5()) as (_, raw):
        assert _connack_v5(raw).properties.maximum_packet_size == MAX_PACKET


def test_v5_packet_over_maximum_packet_size_gets_disconnect_0x95(make_edge):
    # [MQTT-3.2.2-15]: "If a Server receives a packet whose size exceeds this limit, this is a
    # Protocol Error, the Server uses DISCONNECT with Reason Code 0x95 (Packet too large)".
    edge = make_edge(max_packet_size=MAX_PACKET)
    with _connected(edge.port, connect_v5()) as (sock, _):
        sock.sendall(_publish_of_size(MAX_PACKET + 1) + PINGREQ)
        _assert_disconnect(_outcome(sock), frozenset({0x95}))


def test_v5_packet_of_exactly_maximum_packet_size_is_accepted(make_edge):
    # 3.2.2.3.6: only packets whose size *exceeds* the limit are refused; the size is the
    # whole packet, fixed header included (2.1.4).
    edge = make_edge(max_packet_size=MAX_PACKET)
    with _connected(edge.port, connect_v5()) as (sock, _):
        sock.sendall(_publish_of_size(MAX_PACKET) + PINGREQ)
        outcome = _outcome(sock)
        assert [first for first, _ in outcome.frames] == [0xD0], outcome.describe()


def test_v311_packet_over_maximum_packet_size_closes(make_edge):
    # 3.1.1 has no size negotiation; refusing the packet is a protocol violation on the
    # edge's terms and it can only close [MQTT-4.8.0-1].
    edge = make_edge(max_packet_size=MAX_PACKET)
    with _connected(edge.port, connect_v311()) as (sock, _):
        big = _frame(0x30, _str(b"big") + b"p" * MAX_PACKET)
        sock.sendall(big + PINGREQ)
        _assert_closed_silently(_outcome(sock))


def test_v5_edge_honours_client_maximum_packet_size(edge):
    # [MQTT-3.1.2-24] "The Server MUST NOT send packets exceeding Maximum Packet Size to the
    # Client"; [MQTT-3.1.2-25] "Where a Packet is too large to send, the Server MUST discard it
    # without sending it".
    limit = 64
    small = connect_v5(b"small", props=b"\x27" + limit.to_bytes(4, "big"))
    with _connected(edge.port, small) as (sub, _):
        sub.sendall(_frame(0x82, b"\x00\x01\x00" + _str(b"mps/#") + b"\x00"))
        assert _read_packet(sub)[0] == 0x90  # SUBACK
        with _connected(edge.port, connect_v5(b"big-pub")) as (pub, _):
            pub.sendall(publish_v5(b"mps/big", b"B" * 200) + publish_v5(b"mps/small", b"s"))
            sub.settimeout(TIMEOUT)
            received = _read_packet(sub)
    assert len(received) <= limit, f"{len(received)}-byte packet sent to a client asking <= 64"
    assert received == publish_v5(b"mps/small", b"s")


# -- MQTT 5.0: problems in CONNECT, before CONNACK ------------------------------------------------

V5_CONNECT_PROBLEMS = [
    # [MQTT-3.1.2-3] "If the reserved flag is not 0 it is a Malformed Packet."
    pytest.param(connect_v5(flags=0x03), M, id="reserved-connect-flag"),
    # 3.1.2.6: Will QoS "A value of 3 (0x03) is a Malformed Packet."
    pytest.param(
        connect_v5(flags=0x1E, tail=b"\x00" + _str(b"w") + _str(b"x")), M, id="will-qos-3"
    ),
    # [MQTT-3.1.2-11] "If the Will Flag is set to 0, then the Will QoS MUST be set to 0".
    pytest.param(connect_v5(flags=0x0A), EITHER, id="will-qos-without-will-flag"),
    # 3.1.2.11.3: "It is a Protocol Error to include the Receive Maximum value ... 0."
    pytest.param(connect_v5(props=b"\x21\x00\x00"), P, id="receive-maximum-0"),
    # 3.1.2.11.4: "It is a Protocol Error to include the Maximum Packet Size ... zero."
    pytest.param(connect_v5(props=b"\x27\x00\x00\x00\x00"), P, id="maximum-packet-size-0"),
    # 3.1.2.11.2: "It is a Protocol Error to include the Session Expiry Interval more than
    # once."
    pytest.param(
        connect_v5(props=b"\x11\x00\x00\x00\x01\x11\x00\x00\x00\x01"),
        P,
        id="duplicate-session-expiry-interval",
    ),
    # 3.1.2.11.10: "It is a Protocol Error to include Authentication Data if there is no
    # Authentication Method."
    pytest.param(connect_v5(props=b"\x16\x00\x01a"), P, id="authentication-data-without-method"),
    # 2.2.2.2: Topic Alias (0x23) is not valid in CONNECT: Malformed Packet.
    pytest.param(connect_v5(props=b"\x23\x00\x01"), M, id="property-not-valid-for-connect"),
    # [MQTT-1.5.4-1] / [MQTT-3.1.3-4]: the ClientID is a UTF-8 Encoded String; C3 28 is not.
    pytest.param(connect_v5(b"\xc3\x28"), M, id="client-id-ill-formed-utf8"),
    # 1.5.4: the ClientID length (10) runs past the end of the packet.
    pytest.param(
        _frame(0x10, _str(b"MQTT") + b"\x05\x02\x00\x3c\x00" + b"\x00\x0aab"),
        M,
        id="client-id-length-past-end",
    ),
    # [MQTT-4.12.0-1] "If the Server does not support the Authentication Method supplied by
    # the Client, it MAY send a CONNACK with a Reason Code of 0x8C (Bad authentication method)
    # or 0x87 (Not Authorized) ... and MUST close the Network Connection".
    pytest.param(
        connect_v5(props=b"\x15" + _str(b"SCRAM-SHA-1")),
        frozenset({0x87, 0x8C}),
        id="unsupported-authentication-method",
    ),
]


@pytest.mark.parametrize(("connect", "codes"), V5_CONNECT_PROBLEMS)
def test_v5_connect_problem_closes_with_optional_connack(edge, connect, codes):
    # 4.13.1: "In the case of an error in a CONNECT packet it MAY send a CONNACK packet
    # containing the Reason Code, before closing the Network Connection."
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect + PINGREQ)
        _assert_refused_before_connack(_outcome(sock), codes)


# -- protocol name and level ----------------------------------------------------------------------

V311_CONNACK_UNACCEPTABLE_LEVEL = b"\x20\x02\x00\x01"


@pytest.mark.parametrize(
    "connect",
    [
        pytest.param(_frame(0x10, _str(b"MQTT") + b"\x06\x02\x00\x3c" + _str(b"l6")), id="311"),
        pytest.param(_frame(0x10, _str(b"MQTT") + b"\x06\x02\x00\x3c\x00" + _str(b"l6")), id="5.0"),
    ],
)
def test_unsupported_protocol_level_gets_connack_0x01(edge, connect):
    # Level 6 laid out like 3.1.1 and like 5.0 (property length after Keep Alive).
    # 3.1.1 [MQTT-3.1.2-2]: "The Server MUST respond to the CONNECT Packet with a CONNACK return
    # code 0x01 (unacceptable protocol level) and then disconnect the Client if the Protocol
    # Level is not supported". 5.0 [MQTT-3.1.2-2] only says it "MAY send a CONNACK packet with
    # Reason Code 0x84 ... and then MUST close". An edge serving both versions satisfies both
    # texts only with the 3.1.1 answer, which is also the one a client of unknown level can
    # be expected to read.
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect + PINGREQ)
        outcome = _outcome(sock)
    assert outcome.data == V311_CONNACK_UNACCEPTABLE_LEVEL, outcome.describe()
    assert outcome.closed, outcome.describe()


def test_v5_bad_protocol_name_closes_or_gets_connack_0x84(edge):
    # 5.0 [MQTT-3.1.2-1]: "If the Server does not want to accept the CONNECT, and wishes to
    # reveal that it is an MQTT Server it MAY send a CONNACK packet with Reason Code of 0x84
    # (Unsupported Protocol Version), and then it MUST close the Network Connection." A CONNACK,
    # if any, is a 5.0 CONNACK: [MQTT-3.2.2-8] "MUST use one of the Connect Reason Code values".
    connect = _frame(0x10, _str(b"MQTX") + b"\x05\x02\x00\x3c\x00" + _str(b"bn"))
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect + PINGREQ)
        outcome = _outcome(sock)
    assert outcome.closed, outcome.describe()
    if outcome.data:
        (first, body), *rest = outcome.frames
        assert not rest, outcome.describe()
        assert first == 0x20, outcome.describe()
        # 5.0 CONNACK: flags, reason code, property length (3.2.2).
        assert len(body) >= 3, f"not a 5.0 CONNACK: {outcome.describe()}"
        assert body[1] == 0x84, outcome.describe()


def test_v311_bad_protocol_name_closes(edge):
    # 3.1.1 [MQTT-3.1.2-1]: "If the protocol name is incorrect the Server MAY disconnect the
    # Client"; a CONNACK 0x01 before closing is tolerated (the text does not forbid it).
    connect = _frame(0x10, _str(b"MQTX") + b"\x04\x02\x00\x3c" + _str(b"bn"))
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect + PINGREQ)
        outcome = _outcome(sock)
    assert outcome.data in (b"", V311_CONNACK_UNACCEPTABLE_LEVEL), outcome.describe()
    assert outcome.closed, outcome.describe()


# -- MQTT 3.1.1: the same kinds of violation just close -------------------------------------------

V311_VIOLATIONS = [
    # 2.2.3: "The maximum number of bytes in the Remaining Length field is four."
    pytest.param(b"\x30\xff\xff\xff\xff\x7f", id="remaining-length-of-five-bytes"),
    # 1.5.3: a string length runs past the end of the packet.
    pytest.param(b"\x30\x03\x00\x05a", id="topic-length-past-end"),
    # 3.3.2.2: QoS 1 PUBLISH cut before its packet identifier.
    pytest.param(b"\x32\x03\x00\x01a", id="qos1-publish-truncated-before-packet-id"),
    # [MQTT-1.5.3-1] "If a Server or Client receives a Control Packet containing ill-formed
    # UTF-8 it MUST close the Network Connection".
    pytest.param(b"\x30\x05\x00\x02\xc3\x28x", id="topic-ill-formed-utf8"),
    # [MQTT-1.5.3-2] "If a receiver (Server or Client) receives a Control Packet containing
    # U+0000 it MUST close the Network Connection".
    pytest.param(b"\x30\x05\x00\x02a\x00x", id="topic-contains-nul"),
    # [MQTT-2.2.2-2] "If invalid flags are received, the receiver MUST close the Network
    # Connection."
    pytest.param(b"\xc1\x00", id="pingreq-reserved-flags"),
    # [MQTT-3.8.1-1] SUBSCRIBE flags "MUST treat any other value as malformed and close".
    pytest.param(b"\x80\x06\x00\x01\x00\x01a\x00", id="subscribe-reserved-flags"),
    # [MQTT-3.6.1-1] PUBREL flags "MUST treat any other value as malformed and close".
    pytest.param(b"\x60\x02\x00\x01", id="pubrel-reserved-flags"),
    # [MQTT-3.3.1-4] "A PUBLISH Packet MUST NOT have both QoS bits set to 1. If a Server or
    # Client receives a PUBLISH Packet which has both QoS bits set to 1 it MUST close".
    pytest.param(b"\x36\x05\x00\x01a\x00\x01", id="publish-qos-3"),
    # [MQTT-3-8.3-4] "MUST treat a SUBSCRIBE packet as malformed and close the Network
    # Connection if any of Reserved bits in the payload are non-zero, or QoS is not 0,1 or 2".
    pytest.param(b"\x82\x06\x00\x01\x00\x01a\x03", id="subscription-qos-3"),
    pytest.param(b"\x82\x06\x00\x01\x00\x01a\x04", id="subscription-reserved-bits"),
    # [MQTT-3.1.0-2] "MUST process a second CONNECT Packet sent from a Client as a protocol
    # violation and disconnect the Client".
    pytest.param(connect_v311(b"rc"), id="second-connect"),
    # [MQTT-2.3.1-1] "SUBSCRIBE, UNSUBSCRIBE, and PUBLISH (in cases where QoS > 0) Control
    # Packets MUST contain a non-zero 16-bit Packet Identifier".
    pytest.param(b"\x32\x05\x00\x01a\x00\x00", id="qos1-publish-packet-id-0"),
    # [MQTT-3.8.3-3] "A SUBSCRIBE packet with no payload is a protocol violation."
    pytest.param(b"\x82\x02\x00\x01", id="subscribe-without-payload"),
    # [MQTT-3.10.3-2] "An UNSUBSCRIBE packet with no payload is a protocol violation."
    pytest.param(b"\xa2\x02\x00\x01", id="unsubscribe-without-payload"),
    # [MQTT-3.3.2-2] "The Topic Name in the PUBLISH Packet MUST NOT contain wildcard
    # characters."
    pytest.param(b"\x30\x05\x00\x03a/#", id="wildcard-in-topic-name"),
    # [MQTT-4.7.3-1] "All Topic Names and Topic Filters MUST be at least one character long".
    pytest.param(b"\x30\x02\x00\x00", id="empty-topic-name"),
    # Table 2.1: types 0 and 15 are "Reserved / Forbidden" in 3.1.1.
    pytest.param(b"\x00\x00", id="reserved-packet-type-0"),
    pytest.param(b"\xf0\x00", id="reserved-packet-type-15"),
    # Table 2.1: CONNACK flows Server to Client only.
    pytest.param(b"\x20\x02\x00\x00", id="connack-from-client"),
]


@pytest.mark.parametrize("violation", V311_VIOLATIONS)
def test_v311_violation_closes_without_disconnect(edge, violation):
    # [MQTT-4.8.0-1] "if either the Server or Client encounters a protocol violation, it MUST
    # close the Network Connection"; the Server has no DISCONNECT to send (Table 2.1).
    with _connected(edge.port, connect_v311()) as (sock, connack):
        assert connack == b"\x20\x02\x00\x00"
        sock.sendall(violation + PINGREQ)
        _assert_closed_silently(_outcome(sock))


V311_CONNECT_PROBLEMS = [
    # [MQTT-3.1.2-3] "validate that the reserved flag ... is set to zero and disconnect the
    # Client if it is not zero".
    pytest.param(connect_v311(flags=0x03), id="reserved-connect-flag"),
    # [MQTT-3.1.2-14] "If the Will Flag is set to 1, the value of Will QoS can be 0, 1 or 2. It
    # MUST NOT be 3."
    pytest.param(connect_v311(flags=0x1E, tail=_str(b"w") + _str(b"x")), id="will-qos-3"),
    # [MQTT-3.1.2-22] "If the User Name Flag is set to 0, the Password Flag MUST be set to 0."
    pytest.param(connect_v311(flags=0x42, tail=_str(b"pw")), id="password-without-user-name"),
]


@pytest.mark.parametrize("connect", V311_CONNECT_PROBLEMS)
def test_v311_connect_problem_closes(edge, connect):
    # 3.1.1 offers no CONNACK code for a malformed CONNECT: close [MQTT-4.8.0-1].
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect + PINGREQ)
        _assert_closed_silently(_outcome(sock))


def test_v311_empty_client_id_without_clean_session_gets_connack_0x02(edge):
    # [MQTT-3.1.3-8] "If the Client supplies a zero-byte ClientId with CleanSession set to 0,
    # the Server MUST respond to the CONNECT Packet with a CONNACK return code 0x02 (Identifier
    # rejected) and then close the Network Connection."
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect_v311(b"", flags=0x00) + PINGREQ)
        outcome = _outcome(sock)
    assert outcome.data == b"\x20\x02\x00\x02", outcome.describe()
    assert outcome.closed, outcome.describe()


# -- Will Topic: a Topic Name, so no wildcards and not empty --------------------------------------


@pytest.mark.parametrize("version", [5, 4], ids=["v5", "v311"])
@pytest.mark.parametrize(
    "will_topic", [b"w/+", b"w/#", b""], ids=["single-level", "multi-level", "empty"]
)
def test_connect_with_will_topic_that_is_no_topic_name_is_refused(edge, version, will_topic):
    # The Will Topic is the Topic Name of the Will Message (3.1.3.3); [MQTT-4.7.0-1] (5.0) /
    # [MQTT-4.7.1-1] (3.1.1): wildcards "MUST NOT be used within a Topic Name"; [MQTT-4.7.3-1]
    # Topic Names "MUST be at least one character long". 5.0 CONNACK 0x90: "The Will Topic Name
    # is not malformed, but is not accepted by this Server". 3.1.1 has no code for it: close.
    will_flags = 0x02 | 0x04
    if version == 5:
        connect = connect_v5(
            b"will", flags=will_flags, tail=b"\x00" + _str(will_topic) + _str(b"x")
        )
    else:
        connect = connect_v311(b"will", flags=will_flags, tail=_str(will_topic) + _str(b"x"))
    with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as sock:
        sock.sendall(connect + PINGREQ)
        outcome = _outcome(sock)
    if version == 5:
        _assert_refused_before_connack(outcome, TOPIC)
    else:
        _assert_closed_silently(outcome)


@pytest.mark.parametrize("will_topic", [b"w/+", b""], ids=["wildcard", "empty"])
def test_will_topic_that_is_no_topic_name_never_reaches_subscribers(edge, will_topic):
    # Whether the edge refuses the CONNECT or drops the will later, it must never itself send
    # a PUBLISH whose Topic Name has a wildcard [MQTT-3.3.2-2] or is empty [MQTT-4.7.3-1]. A
    # 3.1.1 subscriber on "#" must only ever see the sentinel.
    with _connected(edge.port, connect_v311(b"watcher")) as (watcher, _):
        watcher.sendall(_frame(0x82, b"\x00\x01" + _str(b"#") + b"\x00"))
        assert _read_packet(watcher) == b"\x90\x03\x00\x01\x00"
        doomed_connect = connect_v311(b"doomed", flags=0x06, tail=_str(will_topic) + _str(b"w"))
        with socket.create_connection(("127.0.0.1", edge.port), timeout=TIMEOUT) as doomed:
            # If the CONNECT is accepted, the reserved packet type 0 after it is a protocol
            # violation that closes the connection without DISCONNECT, so the will is due
            # [MQTT-3.1.2-8]. Waiting for the close orders it before the sentinel below.
            doomed.sendall(doomed_connect + b"\x00\x00")
            assert _outcome(doomed).closed
        with _connected(edge.port, connect_v311(b"sentinel")) as (sentinel, _):
            sentinel.sendall(_frame(0x30, _str(b"sentinel") + b"s"))
            watcher.settimeout(TIMEOUT)
            topics = []
            while not topics or topics[-1] != b"sentinel":
                packet = _read_packet(watcher)
                assert packet[0] >> 4 == 3, packet.hex(" ")
                (_, body), *_ = _frames(packet)
                topics.append(body[2 : 2 + int.from_bytes(body[:2], "big")])
    assert topics == [b"sentinel"]
