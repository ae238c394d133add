"""An accepted application message on its way to subscribers and the journal."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker_edge.packets import NO_PROPERTIES, Properties, QoS


@dataclass(frozen=True, slots=True)
class Message:
    """One accepted PUBLISH. ``seq`` is its journal sequence number on this node (0 = not journaled,
    e.g. a will message that was never published)."""

    tenant: str
    topic: str
    payload: bytes
    qos: QoS
    retain: bool
    client_id: str
    ts_us: int
    properties: Properties = NO_PROPERTIES
    seq: int = 0
    # Encoded QoS 0 deliveries keyed by (protocol version, retain flag): every QoS 0 subscriber of
    # the same version gets the same bytes, so a fan-out encodes once.
    encoded: dict[tuple[int, bool], bytes] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )
