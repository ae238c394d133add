"""The journal frame body written directly (ingest.ipcframe) is the Arrow writer's, bytewise."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from ingest import journal
from ingest.ipcframe import Layout, LayoutError

NODES = ("bench", "n", "node-with-a-longer-name")


def _records(rnd: random.Random, n: int, *, retain: bool) -> list[object]:
    values: list[object] = []
    for i in range(n):
        values.extend(
            (
                rnd.randrange(1_600_000_000_000_000, 1_900_000_000_000_000),
                rnd.choice(["default", "té", ""]),
                rnd.choice(["pub-1", "c" * rnd.randrange(30), "€"]),
                rnd.choice(["a/b", "x/ü/€", f"t/{i}"]),
                rnd.randrange(3),
                retain and rnd.random() < 0.3,
                bytes(rnd.randrange(100)),
                None,
                (),
            )
        )
    return values


def _arrow_body(node: str, first: int, n: int, values: list[object]) -> bytes:
    frame = journal.PendingFrame(node, first, n, list(values))
    return journal._ipc_messages(frame.to_batch())[1]


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 12, 64, 65, 1000])
def test_direct_body_is_the_arrow_writers(n: int) -> None:
    rnd = random.Random(n)
    layout = journal._body_layout()
    for trial in range(20):
        values = _records(rnd, n, retain=bool(trial % 2))
        node = NODES[trial % len(NODES)]
        first = rnd.randrange(1, 2**40)
        direct = layout.message(node, first, values, journal._RECORD_WIDTH)
        assert direct == _arrow_body(node, first, n, values)


def test_frames_with_content_types_or_user_properties_take_the_arrow_path() -> None:
    layout = journal._body_layout()
    width = journal._RECORD_WIDTH
    plain = [1, "t", "c", "a/b", 1, False, b"x", None, ()]
    typed = [2, "t", "c", "a/b", 1, False, b"y", "text/plain", ()]
    props = [3, "t", "c", "a/b", 1, False, b"z", None, (("k", "v"),)]
    assert layout.message("n", 1, plain + typed, width) is None
    assert layout.message("n", 1, props + plain, width) is None
    frame = journal.PendingFrame("n", 5, 3, plain + typed + props)
    encoded = frame.encode()
    body = bytes(encoded[journal.FRAME_HEADER.size :])
    assert body == journal._ipc_messages(frame.to_batch())[1]


def test_a_direct_frame_reads_back_with_pyarrow() -> None:
    values = _records(random.Random(7), 5, retain=True)
    frame = journal.PendingFrame("edge-1", 41, 5, list(values))
    body = bytes(frame.encode()[journal.FRAME_HEADER.size :])
    schema = pa.ipc.read_schema(pa.py_buffer(journal._schema_message()))
    batch = pa.ipc.read_record_batch(pa.py_buffer(body), schema)
    batch.validate(full=True)
    rows = batch.to_pylist()
    assert [r["seq"] for r in rows] == [41, 42, 43, 44, 45]
    assert [r["payload"] for r in rows] == values[6 :: journal._RECORD_WIDTH]
    assert [r["topic"] for r in rows] == values[3 :: journal._RECORD_WIDTH]
    assert [r["retain"] for r in rows] == values[5 :: journal._RECORD_WIDTH]
    assert all(r["content_type"] is None and r["user_properties"] == [] for r in rows)


def test_a_message_of_another_shape_is_refused() -> None:
    with pytest.raises(LayoutError):
        Layout.of(b"\x00" * 16)
