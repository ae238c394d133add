"""Every legal state change of one client connection, in one place (like h11's ``_state.py``).

Theory of operation
-------------------
Two kinds of state live here, each a small table:

* ``ConnState``: the connection's own life. ``RECEIVABLE`` says which packet types the peer may
  send in each state [MQTT-3.1.0-1, MQTT-3.1.0-2]; ``CONN_STEPS`` says where *our* events (the
  CONNACK that accepts, the close) lead.
* ``Flow``: one QoS 1 or QoS 2 exchange, in either direction. An inbound publish (client to
  edge) is acknowledged only once its journal record is durable; an outbound one (edge to
  client) waits in the session's in-flight window for the client's acknowledgements.
  ``FLOW_STEPS`` maps (state, event) to the next state; ``DONE`` ends the exchange.

A step the table does not have is an error, and the error says who broke the protocol:
:func:`peer_step` raises :class:`~broker_edge.errors.ProtocolError` (the peer sent something it
must not), :func:`local_step` raises :class:`~broker_edge.errors.LocalProtocolError` (our own code
asked for a step that does not exist: a bug here). Peer acknowledgements that match no open
exchange are not errors: MQTT lets a receiver ignore them (``peer_ack`` returns None).

Pure data: no I/O, no clock, no logging.
"""

from __future__ import annotations

from enum import IntEnum

from broker_edge.errors import LocalProtocolError, ProtocolError
from broker_edge.packets import (
    Auth,
    Connect,
    Disconnect,
    Pingreq,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    ReasonCode,
    Subscribe,
    Unsubscribe,
)


class ConnState(IntEnum):
    AWAIT_CONNECT = 1  # the socket is open; only a CONNECT may come
    CONNECTED = 2  # CONNACK 0 sent
    CLOSED = 3  # closing or closed: nothing more is read or written


class ConnEvent(IntEnum):
    ACCEPTED = 1  # we sent CONNACK 0
    CLOSE = 2  # we close (DISCONNECT sent, refused CONNACK, protocol error, socket gone)


# Which packet types a server may receive in each state [MQTT-3.1.0-1, MQTT-3.1.0-2].
RECEIVABLE: dict[ConnState, frozenset[type]] = {
    ConnState.AWAIT_CONNECT: frozenset({Connect}),
    ConnState.CONNECTED: frozenset(
        {Publish, Puback, Pubrec, Pubrel, Pubcomp, Subscribe, Unsubscribe, Pingreq, Disconnect}
        | {Auth}  # received, then refused: no enhanced authentication is offered
    ),
    ConnState.CLOSED: frozenset(),
}

CONN_STEPS: dict[ConnState, dict[ConnEvent, ConnState]] = {
    ConnState.AWAIT_CONNECT: {
        ConnEvent.ACCEPTED: ConnState.CONNECTED,
        ConnEvent.CLOSE: ConnState.CLOSED,
    },
    ConnState.CONNECTED: {ConnEvent.CLOSE: ConnState.CLOSED},
    ConnState.CLOSED: {ConnEvent.CLOSE: ConnState.CLOSED},
}


class Flow(IntEnum):
    """Where one QoS 1/2 exchange stands. IN_*: the client published; OUT_*: we delivered."""

    DONE = 0  # no exchange open for this packet id
    IN_QOS1 = 1  # PUBLISH QoS 1 received; PUBACK once durable [MQTT-4.3.2-2]
    IN_QOS2 = 2  # PUBLISH QoS 2 received; PUBREC once durable, then PUBREL ends it [MQTT-4.3.3-9]
    OUT_AWAIT_PUBACK = 3  # PUBLISH QoS 1 sent [MQTT-4.3.2-1]
    OUT_AWAIT_PUBREC = 4  # PUBLISH QoS 2 sent [MQTT-4.3.3-1]
    OUT_AWAIT_PUBCOMP = 5  # PUBREC received, PUBREL sent [MQTT-4.3.3-3]


class FlowEvent(IntEnum):
    # from the peer
    PUBLISH_QOS1 = 1
    PUBLISH_QOS2 = 2
    PUBREL = 3
    PUBACK = 4
    PUBREC = 5
    PUBCOMP = 6
    # ours
    DURABLE = 7  # the journal made the inbound publish durable: acknowledge it
    REFUSED = 8  # we refuse the inbound publish (policy, or its journal frame failed)
    SENT_QOS1 = 9
    SENT_QOS2 = 10


_IN = Flow
_E = FlowEvent

# The QoS flows, both directions. Inbound QoS 2 stays IN_QOS2 from the PUBLISH to the PUBREL
# (its packet id is kept in the session, across reconnects [MQTT-4.3.3-9]); a PUBLISH resent
# with that id is acknowledged again and not delivered twice [MQTT-4.3.3-10]. A PUBREC at 0x80
# or above ends the exchange [MQTT-4.3.3-4]. A repeated PUBREC while awaiting PUBCOMP gets the
# PUBREL again.
FLOW_STEPS: dict[Flow, dict[FlowEvent, Flow]] = {
    _IN.DONE: {
        _E.PUBLISH_QOS1: _IN.IN_QOS1,
        _E.PUBLISH_QOS2: _IN.IN_QOS2,
        _E.SENT_QOS1: _IN.OUT_AWAIT_PUBACK,
        _E.SENT_QOS2: _IN.OUT_AWAIT_PUBREC,
    },
    _IN.IN_QOS1: {_E.DURABLE: _IN.DONE, _E.REFUSED: _IN.DONE},
    _IN.IN_QOS2: {
        _E.PUBLISH_QOS2: _IN.IN_QOS2,
        _E.DURABLE: _IN.IN_QOS2,
        _E.REFUSED: _IN.DONE,
        _E.PUBREL: _IN.DONE,
    },
    _IN.OUT_AWAIT_PUBACK: {_E.PUBACK: _IN.DONE},
    _IN.OUT_AWAIT_PUBREC: {_E.PUBREC: _IN.OUT_AWAIT_PUBCOMP},
    _IN.OUT_AWAIT_PUBCOMP: {_E.PUBREC: _IN.OUT_AWAIT_PUBCOMP, _E.PUBCOMP: _IN.DONE},
}

# The event a received acknowledgement is, by packet type.
ACK_EVENTS: dict[type, FlowEvent] = {
    Puback: FlowEvent.PUBACK,
    Pubrec: FlowEvent.PUBREC,
    Pubcomp: FlowEvent.PUBCOMP,
    Pubrel: FlowEvent.PUBREL,
}


def receivable(state: ConnState, kind: type) -> None:
    """Raise ProtocolError unless the peer may send a ``kind`` packet in ``state``."""
    if kind not in RECEIVABLE[state]:
        raise ProtocolError(
            f"{kind.__name__} not allowed in state {state.name}", ReasonCode.PROTOCOL_ERROR
        )


def conn_step(state: ConnState, event: ConnEvent) -> ConnState:
    """Where our ``event`` takes the connection; LocalProtocolError if nowhere (our bug)."""
    to = CONN_STEPS[state].get(event)
    if to is None:
        raise LocalProtocolError(f"{event.name} in state {state.name}")
    return to


def local_step(flow: Flow, event: FlowEvent) -> Flow:
    """Our ``event`` on an exchange; LocalProtocolError if the table has no such step."""
    to = FLOW_STEPS[flow].get(event)
    if to is None:
        raise LocalProtocolError(f"{event.name} on an exchange in state {flow.name}")
    return to


def peer_ack(flow: Flow, event: FlowEvent) -> Flow | None:
    """The peer's acknowledgement ``event`` on an exchange: the next state, or None when it
    matches nothing open (ignored: a late or repeated acknowledgement)."""
    return FLOW_STEPS[flow].get(event)
