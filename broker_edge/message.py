"""An accepted application message on its way to subscribers and the journal."""

from __future__ import annotations

from typing import Any

from broker_edge.packets import NO_PROPERTIES, Properties, QoS


class Message:
    """One accepted PUBLISH. ``seq`` is its journal sequence number at its ``origin`` (the node
    that accepted it; 0 = not journaled; "" = none named, a message that never crosses a
    mesh link). Treated as immutable once built.

    A plain ``__slots__`` class rather than a frozen dataclass: one is built per publish, and a
    frozen dataclass's ``__init__`` (``object.__setattr__`` per field) costs a visible share of
    the per-message budget.
    """

    __slots__ = (
        "client_id",
        "enc",
        "enc_key",
        "encoded",
        "origin",
        "payload",
        "properties",
        "qos",
        "retain",
        "seq",
        "tenant",
        "topic",
        "ts_us",
        "wire",
    )

    def __init__(
        self,
        tenant: str,
        topic: str,
        payload: bytes,
        qos: QoS,
        retain: bool,
        client_id: str,
        ts_us: int,
        properties: Properties = NO_PROPERTIES,
        seq: int = 0,
        origin: str = "",
    ) -> None:
        self.tenant = tenant
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.client_id = client_id
        self.ts_us = ts_us
        self.properties = properties
        self.seq = seq
        self.origin = origin
        # Encoded QoS 0 deliveries keyed by protocol version * 2 + retain flag: every QoS 0
        # subscriber of one version gets the same bytes, so a fan-out encodes once. The first
        # encoding has slots of its own (most messages have one subscriber, or subscribers of
        # one version: no dict per message); any other goes into ``encoded``.
        self.enc_key = -1
        self.enc = b""
        self.encoded: dict[int, bytes] | None = None
        # A QoS 1/2 publisher's own packet (Publish.wire) as (protocol version, where its
        # packet id is, the bytes): a subscriber of that version taking it at that QoS gets it
        # with its own packet id there (Outbox._send_publish). One slot: set once a message.
        self.wire: tuple[int, int, bytes] | None = None

    def __repr__(self) -> str:
        return (
            f"Message({self.tenant!r}, {self.topic!r}, {len(self.payload)} B, qos={int(self.qos)},"
            f" retain={self.retain}, seq={self.seq})"
        )


def message_from_row(row: dict[str, Any], node: str) -> Message:
    """A journal record of ``node`` (JOURNAL_SCHEMA row, ``ts`` in microseconds) back into a
    Message."""
    props = NO_PROPERTIES
    user_properties = tuple((p["key"], p["value"]) for p in row["user_properties"] or ())
    if row["content_type"] is not None or user_properties:
        props = Properties(content_type=row["content_type"], user_properties=user_properties)
    return Message(
        row["tenant"],
        row["topic"],
        row["payload"],
        QoS(row["qos"]),
        row["retain"],
        row["client_id"],
        row["ts"],  # microseconds since the epoch (JournalReader.read_records)
        props,
        row["seq"],
        node,
    )
