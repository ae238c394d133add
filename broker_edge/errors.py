"""Errors of the broker edge: one root, and two protocol errors that say who broke the rules.

``ProtocolError`` means the *peer* sent something the specification forbids; it carries the MQTT
5.0 reason code to put in the DISCONNECT (or CONNACK) before the connection is closed.
``LocalProtocolError`` means *our* code asked the codec or state machine for something illegal.
"""

from __future__ import annotations

from broker_edge.packets import ReasonCode


class EdgeError(Exception):
    """Root of every error raised by ``broker_edge``."""


class ProtocolError(EdgeError):
    """The peer violated MQTT; close its connection with ``reason_code``."""

    def __init__(self, message: str, reason_code: ReasonCode = ReasonCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.reason_code = reason_code


class MalformedPacket(ProtocolError):
    """Bytes that cannot be parsed as the packet they claim to be [MQTT-4.13.1-1]."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ReasonCode.MALFORMED_PACKET)


class UnsupportedProtocol(ProtocolError):
    """A CONNECT naming a protocol or level this edge does not speak [MQTT-3.1.2-1/2].

    ``known_name``: the name was "MQTT" (or "MQIsdp") and only the level is unknown; such a
    client gets the 3.1.1 CONNACK 0x01, anything else is closed without an answer.
    """

    def __init__(self, message: str, *, known_name: bool) -> None:
        super().__init__(message, ReasonCode.UNSUPPORTED_PROTOCOL_VERSION)
        self.known_name = known_name


class PacketTooLarge(ProtocolError):
    """A packet over the maximum packet size this side accepts [MQTT-3.1.2-24]."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ReasonCode.PACKET_TOO_LARGE)


class LocalProtocolError(EdgeError):
    """Our own code tried something MQTT does not allow (a bug here, not in the peer)."""


class ConfigError(EdgeError):
    """A setting is missing, unknown or has a bad value; the message names the key."""
