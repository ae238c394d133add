"""Link frames that carry shares (broker_edge.mesh, broker_edge.meshgroups): a PUBLISH naming
any shares round-trips whole and byte by byte; any bytes either parse or raise the link's
protocol error; the choice of an edge spreads a share's messages by connected members."""

from __future__ import annotations

import contextlib
import json
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from broker_edge import mesh
from broker_edge.meshgroups import ShareChoice
from broker_edge.message import Message
from broker_edge.packets import QoS

names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
shares = st.lists(st.tuples(names, names), max_size=4)


@given(shares=shares, payload=st.binary(max_size=64), topic=names)
def test_a_publish_naming_shares_round_trips(
    shares: list[tuple[str, str]], payload: bytes, topic: str
) -> None:
    message = Message("acme", topic, payload, QoS.AT_LEAST_ONCE, False, "d", 5, seq=9)
    data = mesh.publish_frame(message, shares=shares)
    whole = mesh.FrameBuffer(1 << 20).feed(data)
    pieces = mesh.FrameBuffer(1 << 20)
    assert whole == [f for i in range(len(data)) for f in pieces.feed(data[i : i + 1])]
    got, named = mesh.parse_publish(whole[0][1], "a")
    assert named == tuple(shares)
    assert (got.topic, got.payload, got.seq) == (topic, payload, 9)


@given(body=st.binary(max_size=96))
def test_any_publish_body_parses_or_is_a_protocol_error(body: bytes) -> None:
    with contextlib.suppress(mesh.MeshProtocolError):
        mesh.parse_publish(body, "a")


values = (
    st.none()
    | names
    | st.integers(-1, 3)
    | st.lists(names, max_size=2)
    | st.lists(st.lists(names | st.integers(-1, 3), max_size=3), max_size=2)
)


@given(doc=st.dictionaries(st.sampled_from(["t", "add", "del", "sset", "sdel"]), values))
def test_any_interest_parses_or_is_a_protocol_error(doc: dict[str, object]) -> None:
    with contextlib.suppress(mesh.MeshProtocolError):
        mesh.parse_interest(json.dumps(doc).encode())


@given(weights=st.dictionaries(names, st.integers(0, 5), min_size=1, max_size=5))
def test_the_choice_gives_each_edge_its_weight_in_a_round(weights: dict[str, int]) -> None:
    choice = ShareChoice()
    live = {node: w for node, w in weights.items() if w} or dict.fromkeys(weights, 1)
    rounds = 3
    picks = Counter(
        choice.pick("acme", ("g", "x"), weights) for _ in range(rounds * sum(live.values()))
    )
    assert picks == {node: rounds * w for node, w in live.items()}
