"""Property tests of the connection machine (issue 10).

* Random bytes after a CONNECT either come out as events or raise ``ProtocolError``: nothing
  else escapes the machine, and it always terminates.
* The events do not depend on how the bytes are chunked on the way in.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_edge.codec import encode
from broker_edge.connection import Connection, ConnLimits, TopicCache
from broker_edge.errors import ProtocolError
from broker_edge.packets import (
    Connect,
    Packet,
    Pingreq,
    ProtocolVersion,
    Puback,
    Publish,
    QoS,
    Subscribe,
    Subscription,
)
from broker_edge.settings import EdgeSettings

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = ConnLimits.of(EdgeSettings(node_id="prop"))
VERSIONS = st.sampled_from(list(ProtocolVersion))


def _connected(version: ProtocolVersion) -> Connection:
    conn = Connection("prop:1", 0.0, LIMITS, TopicCache())
    conn.receive_data(encode(Connect(client_id="c", protocol_version=version), version), 0.0)
    assert isinstance(conn.next_event(), Connect)
    conn.connect_received(version, "c", 0)
    conn.accept(False, None, -1, None)
    conn.data_to_send()
    return conn


def _run(conn: Connection, chunks: list[bytes]) -> tuple[list[Packet], str | None]:
    """The events and the error (class and reason code) the chunks give."""
    out: list[Packet] = []
    try:
        for chunk in chunks:
            conn.receive_data(chunk, 0.0)
            while (event := conn.next_event()) is not None:
                out.append(event)
    except ProtocolError as exc:
        return out, f"{type(exc).__name__}:{int(exc.reason_code)}"
    return out, None


@SETTINGS
@given(VERSIONS, st.binary(max_size=200))
def test_random_bytes_are_events_or_the_peers_protocol_error(
    version: ProtocolVersion, data: bytes
) -> None:
    _run(_connected(version), [data])  # anything but ProtocolError fails the test


packets = st.lists(
    st.one_of(
        st.builds(
            Publish, topic=st.sampled_from(["a", "a/b", "c/d/e"]), payload=st.binary(max_size=8)
        ),
        st.builds(
            Publish,
            topic=st.just("q"),
            payload=st.binary(max_size=8),
            qos=st.just(QoS.AT_LEAST_ONCE),
            packet_id=st.integers(1, 50),
        ),
        st.builds(Puback, packet_id=st.integers(1, 50)),
        st.just(Pingreq()),
        st.builds(
            Subscribe,
            packet_id=st.integers(1, 50),
            subscriptions=st.just((Subscription("a/#", QoS.AT_LEAST_ONCE),)),
        ),
    ),
    max_size=12,
)


@SETTINGS
@given(VERSIONS, packets, st.data())
def test_events_do_not_depend_on_how_the_bytes_are_chunked(
    version: ProtocolVersion, sent: list[Packet], data: st.DataObject
) -> None:
    wire = b"".join(encode(p, version) for p in sent) + data.draw(st.binary(max_size=6))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=8)))
    chunks = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    whole = _run(_connected(version), [wire])
    split = _run(_connected(version), chunks)
    assert split == whole
    expected = [p for p in sent if not isinstance(p, Pingreq)]  # PINGREQ: answered inside
    assert whole[0][: len(expected)] == expected  # then whatever the random tail makes
