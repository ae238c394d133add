"""MQTT control packets as small frozen value objects (MQTT 3.1.1 and 5.0).

One class per packet type; the codec turns bytes into these and back. Fields that only exist in
MQTT 5.0 (reason codes on acks, properties) have defaults that encode to nothing in 3.1.1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class PacketType(IntEnum):
    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


class QoS(IntEnum):
    AT_MOST_ONCE = 0
    AT_LEAST_ONCE = 1
    EXACTLY_ONCE = 2


class ProtocolVersion(IntEnum):
    """The protocol level byte of CONNECT."""

    MQTT_3_1 = 3  # "MQIsdp"; accepted for old clients, behaves as 3.1.1
    MQTT_3_1_1 = 4
    MQTT_5 = 5


class ReasonCode(IntEnum):
    """MQTT 5.0 reason codes (section 2.4). 3.1.1 CONNACK return codes are in ``ConnackCode311``."""

    SUCCESS = 0x00  # also NORMAL_DISCONNECTION and GRANTED_QOS_0
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    REAUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


class ConnackCode311(IntEnum):
    """MQTT 3.1.1 CONNACK return codes (section 3.2.2.3)."""

    ACCEPTED = 0x00
    UNACCEPTABLE_PROTOCOL_VERSION = 0x01
    IDENTIFIER_REJECTED = 0x02
    SERVER_UNAVAILABLE = 0x03
    BAD_USER_NAME_OR_PASSWORD = 0x04
    NOT_AUTHORIZED = 0x05


SUBACK_FAILURE_311 = 0x80


@dataclass(frozen=True, slots=True)
class Properties:
    """MQTT 5.0 properties (section 2.2.2). ``None`` / empty means absent.

    Only the properties legal for a packet type are encoded; the codec rejects a property that
    is not allowed in the packet it arrives in with a protocol error.
    """

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: tuple[int, ...] = ()
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: int | None = None
    will_delay_interval: int | None = None
    request_response_information: int | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: int | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    maximum_packet_size: int | None = None
    wildcard_subscription_available: int | None = None
    subscription_identifier_available: int | None = None
    shared_subscription_available: int | None = None


NO_PROPERTIES = Properties()


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes
    qos: QoS = QoS.AT_MOST_ONCE
    retain: bool = False
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Connect:
    client_id: str
    protocol_version: ProtocolVersion = ProtocolVersion.MQTT_3_1_1
    clean_start: bool = True
    keepalive: int = 60
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.CONNECT


@dataclass(frozen=True, slots=True)
class Connack:
    session_present: bool = False
    reason_code: int = 0  # ReasonCode in 5.0, ConnackCode311 in 3.1.1
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.CONNACK


# Not frozen, unlike its siblings: a frozen dataclass's __init__ assigns every field through
# object.__setattr__, which made building one cost 0.77 us against 0.17 us here, and the codec
# builds one per message on the hot path. Treat it as immutable all the same (use
# dataclasses.replace); unsafe_hash keeps the field-wise __hash__ frozen=True used to give.
@dataclass(slots=True, unsafe_hash=True)
class Publish:
    topic: str  # may be "" in 5.0 when a topic alias is set
    payload: bytes = b""
    qos: QoS = QoS.AT_MOST_ONCE
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None  # present iff qos > 0 [MQTT-2.3.1-5]
    properties: Properties = NO_PROPERTIES
    # The packet as the decoder read it, when it is the PUBLISH a subscriber of the same
    # protocol version gets at the same QoS but for the packet id (no DUP, no RETAIN, no
    # properties): the broker forwards it as is (QoS 0) or with its own packet id instead of
    # encoding it again. Not an argument of __init__, so dataclasses.replace, which may change
    # what the bytes say, never copies it.
    wire: bytes | None = field(default=None, init=False, compare=False, repr=False)
    packet_type = PacketType.PUBLISH


# Not frozen either, for the same reason as Publish: the decoder builds one per QoS 1 delivery
# a subscriber acknowledges.
@dataclass(slots=True, unsafe_hash=True)
class Puback:
    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.PUBACK


@dataclass(frozen=True, slots=True)
class Pubrec:
    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.PUBREC


@dataclass(frozen=True, slots=True)
class Pubrel:
    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.PUBREL


@dataclass(frozen=True, slots=True)
class Pubcomp:
    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.PUBCOMP


class RetainHandling(IntEnum):
    SEND_ON_SUBSCRIBE = 0
    SEND_IF_NEW_SUBSCRIPTION = 1
    DO_NOT_SEND = 2


@dataclass(frozen=True, slots=True)
class Subscription:
    topic_filter: str
    qos: QoS = QoS.AT_MOST_ONCE
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: RetainHandling = RetainHandling.SEND_ON_SUBSCRIBE


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_id: int
    subscriptions: tuple[Subscription, ...]
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.SUBSCRIBE


@dataclass(frozen=True, slots=True)
class Suback:
    packet_id: int
    reason_codes: tuple[int, ...]
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.SUBACK


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    topic_filters: tuple[str, ...]
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.UNSUBSCRIBE


@dataclass(frozen=True, slots=True)
class Unsuback:
    packet_id: int
    reason_codes: tuple[int, ...] = ()  # empty in 3.1.1
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.UNSUBACK


@dataclass(frozen=True, slots=True)
class Pingreq:
    packet_type = PacketType.PINGREQ


@dataclass(frozen=True, slots=True)
class Pingresp:
    packet_type = PacketType.PINGRESP


@dataclass(frozen=True, slots=True)
class Disconnect:
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.DISCONNECT


@dataclass(frozen=True, slots=True)
class Auth:
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES
    packet_type = PacketType.AUTH


Packet = (
    Connect
    | Connack
    | Publish
    | Puback
    | Pubrec
    | Pubrel
    | Pubcomp
    | Subscribe
    | Suback
    | Unsubscribe
    | Unsuback
    | Pingreq
    | Pingresp
    | Disconnect
    | Auth
)

__all__ = [
    "NO_PROPERTIES",
    "SUBACK_FAILURE_311",
    "Auth",
    "Connack",
    "ConnackCode311",
    "Connect",
    "Disconnect",
    "Packet",
    "PacketType",
    "Pingreq",
    "Pingresp",
    "Properties",
    "ProtocolVersion",
    "Puback",
    "Pubcomp",
    "Publish",
    "Pubrec",
    "Pubrel",
    "QoS",
    "ReasonCode",
    "RetainHandling",
    "Suback",
    "Subscribe",
    "Subscription",
    "Unsuback",
    "Unsubscribe",
    "Will",
]
