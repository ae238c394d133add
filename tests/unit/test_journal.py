"""The journal: round trips, seq continuity, segment rolling, crash recovery and corruption."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.journal import (
    FILE_HEADER,
    FRAME_HEADER,
    JournalCorruptError,
    JournalError,
    JournalReader,
    JournalWriter,
    list_nodes,
    list_segments,
)
from schemas.journal import DEFAULT_TENANT, JOURNAL_SCHEMA

NODE = "edge-1"
REPO = Path(__file__).resolve().parents[2]


def record(i: int) -> dict[str, Any]:
    """A deterministic record whose fields all depend on ``i``."""
    return {
        "ts_us": 1_700_000_000_000_000 + i,
        "tenant": DEFAULT_TENANT if i % 3 else "acme",
        "client_id": f"dev-{i % 7}",
        "topic": f"fleet/v{i % 5}/telemetry",
        "qos": i % 3,
        "retain": i % 4 == 0,
        "payload": bytes([i % 256]) * (i % 13),
        "content_type": None if i % 2 else "application/json",
        "user_properties": tuple((f"k{j}", f"v{i}-{j}") for j in range(i % 3)),
    }


def expected_row(seq: int, rec: dict[str, Any]) -> dict[str, Any]:
    ts = pa.scalar(rec["ts_us"], JOURNAL_SCHEMA.field("ts").type).as_py()
    return {
        "node": NODE,
        "seq": seq,
        "ts": ts,
        "tenant": rec["tenant"],
        "client_id": rec["client_id"],
        "topic": rec["topic"],
        "qos": rec["qos"],
        "retain": rec["retain"],
        "payload": rec["payload"],
        "content_type": rec["content_type"],
        "user_properties": [{"key": k, "value": v} for k, v in rec["user_properties"]],
    }


def rows(batches: Iterator[pa.RecordBatch]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for batch in batches:
        assert batch.schema.equals(JOURNAL_SCHEMA)
        out.extend(batch.to_pylist())
    return out


def write(root: Path, groups: list[int], *, start: int = 1, **kw: Any) -> int:
    """Append records start.. in commit groups of the given sizes; return the durable seq."""
    with JournalWriter.open(root, NODE, **kw) as w:
        i = start
        for size in groups:
            for _ in range(size):
                assert w.append(**record(i)) == i
                i += 1
            w.flush()
        return w.durable_seq


def seqs(root: Path, after: int = 0, upto: int | None = None) -> list[int]:
    reader = JournalReader(root / NODE)
    end = reader.last_seq() if upto is None else upto
    return [r["seq"] for r in rows(reader.read(after, end))]


def only_segment(root: Path) -> Path:
    segments = list_segments(root / NODE)
    assert len(segments) == 1
    return segments[0][1]


def frame_offsets(path: Path) -> list[tuple[int, int]]:
    """(offset, end) of each frame, parsed independently of the module under test."""
    data = path.read_bytes()
    out, offset = [], len(FILE_HEADER)
    while offset < len(data):
        _, body_len, _, _, _ = FRAME_HEADER.unpack_from(data, offset)
        end = offset + FRAME_HEADER.size + body_len
        out.append((offset, end))
        offset = end
    return out


# --- round trips ---------------------------------------------------------------------------------


def test_round_trip_every_field(tmp_path: Path) -> None:
    assert write(tmp_path, [1, 5, 3]) == 9
    reader = JournalReader(tmp_path / NODE)
    assert reader.last_seq() == 9
    assert rows(reader.read(0, 9)) == [expected_row(i, record(i)) for i in range(1, 10)]


def uniform(i: int) -> dict[str, Any]:
    """What one device publishing plain messages looks like: every repeatable column repeats."""
    return {**record(i), "tenant": DEFAULT_TENANT, "client_id": "dev", "retain": False}


def plain(i: int) -> dict[str, Any]:
    return {**uniform(i), "content_type": None, "user_properties": ()}


FRAME_SHAPES: dict[str, list[dict[str, Any]]] = {
    "mixed": [record(i) for i in range(1, 40)],
    "one record": [plain(1)],
    "uniform, no content types or user properties": [plain(i) for i in range(1, 40)],
    "uniform but the first": [record(1)] + [plain(i) for i in range(2, 40)],
    "uniform but the last": [plain(i) for i in range(1, 39)] + [record(40)],
    "every content type and user property set": [
        {**uniform(i), "content_type": "text/plain", "user_properties": (("k", str(i)),)}
        for i in range(1, 40)
    ],
    "empty strings": [{**plain(i), "client_id": "", "topic": "", "payload": b""} for i in (1, 2)],
    "qos given as a float": [{**plain(i), "qos": float(i % 3)} for i in range(1, 5)],
}


@pytest.mark.parametrize("shape", list(FRAME_SHAPES))
def test_batch_columns_match_a_plain_conversion(tmp_path: Path, shape: str) -> None:
    # to_batch() builds repeated columns and seq without converting every Python value; the
    # result must be the batch a plain row-by-row conversion gives.
    records = FRAME_SHAPES[shape]
    with JournalWriter.open(tmp_path, NODE, fsync=False) as w:
        for _ in range(6):  # start past seq 1
            w.append(**plain(0))
        w.flush()
        for rec in records:
            w.append(**rec)
        frame = w.drain()
        assert frame is not None
        batch = pa.record_batch(frame.to_batch())  # arro3 -> pyarrow (Arrow C interface)
        w.commit(frame)
    batch.validate(full=True)
    expected = [expected_row(7 + i, rec) for i, rec in enumerate(records)]
    assert batch.equals(pa.RecordBatch.from_pylist(expected, schema=JOURNAL_SCHEMA))
    assert rows(JournalReader(tmp_path / NODE).read(6, 6 + len(records))) == expected


def test_empty_journal(tmp_path: Path) -> None:
    reader = JournalReader(tmp_path / NODE)
    assert reader.last_seq() == 0
    assert list(reader.read(0, 0)) == []
    assert list_nodes(tmp_path) == []
    with JournalWriter.open(tmp_path, NODE) as w:
        assert (w.next_seq, w.durable_seq) == (1, 0)
        assert w.drain() is None
        assert w.flush() == 0
    assert list_nodes(tmp_path) == [NODE]
    assert reader.last_seq() == 0


def test_append_is_not_durable_until_commit(tmp_path: Path) -> None:
    with JournalWriter.open(tmp_path, NODE) as w:
        w.append(**record(1))
        w.append(**record(2))
        assert (w.next_seq, w.durable_seq) == (3, 0)
        frame = w.drain()
        assert frame is not None
        assert (frame.first_seq, frame.last_seq, frame.count) == (1, 2, 2)
        # Appends keep going while the drained frame is being committed.
        assert w.append(**record(3)) == 3
        assert JournalReader(tmp_path / NODE).last_seq() == 0
        assert w.commit(frame) == 2
        assert JournalReader(tmp_path / NODE).last_seq() == 2
        assert w.flush() == 3


def test_a_run_appended_at_once_is_the_frame_its_records_make_one_by_one(
    tmp_path: Path,
) -> None:
    """append_run (the edge's runs of one topic's QoS 0 publishes) buffers exactly what an
    append per payload would: the same seqs, the same frame bytes."""
    payloads = [b"", b"x", bytes(300)]
    frames = []
    for root, run in ((tmp_path / "one-by-one", False), (tmp_path / "run", True)):
        with JournalWriter.open(root, NODE) as w:
            w.append(5, "t", "c", "a/b", 1, True, b"before")
            if run:
                assert w.append_run(7, "acme", "dev-1", "a/b", 0, payloads) == 2
            else:
                for payload in payloads:
                    w.append(7, "acme", "dev-1", "a/b", 0, False, payload, None, ())
            assert w.next_seq == 5
            frame = w.drain()
            assert frame is not None
            frames.append(frame.encode())
            w.commit(frame)
    assert frames[0] == frames[1]
    rows = pa.Table.from_batches(JournalReader(tmp_path / "run" / NODE).read(0, 4)).to_pylist()
    assert [(r["seq"], r["payload"], r["qos"], r["retain"]) for r in rows[1:]] == [
        (2, b"", 0, False),
        (3, b"x", 0, False),
        (4, bytes(300), 0, False),
    ]


def test_commit_out_of_order_is_refused(tmp_path: Path) -> None:
    with JournalWriter.open(tmp_path, NODE) as w:
        w.append(**record(1))
        first = w.drain()
        w.append(**record(2))
        second = w.drain()
        assert first is not None
        assert second is not None
        with pytest.raises(JournalError, match="out of order"):
            w.commit(second)


def test_file_starts_with_magic_and_frame_header(tmp_path: Path) -> None:
    write(tmp_path, [2])
    path = only_segment(tmp_path)
    assert path.name == "00000000000000000001.seg"
    data = path.read_bytes()
    assert data[:5] == b"EBJ1\x01"
    magic, body_len, _, first_seq, count = FRAME_HEADER.unpack_from(data, 5)
    assert (magic, first_seq, count) == (b"EBFR", 1, 2)
    assert len(data) == 5 + 24 + body_len


def test_seq_continues_across_reopen(tmp_path: Path) -> None:
    assert write(tmp_path, [3]) == 3
    assert write(tmp_path, [2, 2], start=4) == 7
    assert seqs(tmp_path) == list(range(1, 8))


def test_second_writer_on_same_node_is_refused(tmp_path: Path) -> None:
    with (
        JournalWriter.open(tmp_path, NODE),
        pytest.raises(JournalError, match="already open"),
    ):
        JournalWriter.open(tmp_path, NODE)


@pytest.mark.parametrize("node", ["", ".", "..", "a/b", ".hidden"])
def test_bad_node_name(tmp_path: Path, node: str) -> None:
    with pytest.raises(ValueError, match="node name"):
        JournalWriter.open(tmp_path, node)


def test_bad_qos_is_refused_at_append(tmp_path: Path) -> None:
    with JournalWriter.open(tmp_path, NODE) as w, pytest.raises(ValueError, match="qos"):
        w.append(**{**record(1), "qos": 3})


# --- segments ------------------------------------------------------------------------------------


def test_segments_roll_and_read_across(tmp_path: Path) -> None:
    write(tmp_path, [3] * 10, segment_bytes=2000)
    write(tmp_path, [4] * 3, start=31, segment_bytes=2000)
    segments = list_segments(tmp_path / NODE)
    assert len(segments) > 3
    assert segments[0][0] == 1
    # Each segment is named by its first seq, which continues the previous one.
    for (_, path), (nxt, _) in itertools.pairwise(segments):
        offsets = frame_offsets(path)
        last = FRAME_HEADER.unpack_from(path.read_bytes(), offsets[-1][0])
        assert last[3] + last[4] == nxt
    assert seqs(tmp_path) == list(range(1, 43))
    # Ranges that start and end inside frames, across segment boundaries.
    reader = JournalReader(tmp_path / NODE)
    for after, upto in [(0, 1), (2, 17), (5, 6), (29, 42), (41, 42), (10, 10)]:
        got = [r["seq"] for r in rows(reader.read(after, upto))]
        assert got == list(range(after + 1, upto + 1))


def test_read_beyond_the_journal_raises(tmp_path: Path) -> None:
    write(tmp_path, [5])
    reader = JournalReader(tmp_path / NODE)
    with pytest.raises(JournalError, match=r"6\.\.7 are not in the journal"):
        list(reader.read(3, 7))


def test_node_listing(tmp_path: Path) -> None:
    for node in ["b", "a"]:
        JournalWriter.open(tmp_path, node).close()
    (tmp_path / "stray.txt").write_text("x")
    assert list_nodes(tmp_path) == JournalReader.list_nodes(tmp_path) == ["a", "b"]
    assert list_nodes(tmp_path / "missing") == []


# --- crash recovery ------------------------------------------------------------------------------


def torn_cases() -> list[tuple[str, int | None]]:
    # (name, cut point relative to the last frame start; None: flip a body byte instead)
    return [
        ("header-1", 1),
        ("header-mid", 13),
        ("header-whole", 24),
        ("body-1", 25),
        ("body-mid", -2),  # resolved to half the body below
        ("body-minus-1", -1),
        ("crc-flip", None),
    ]


@pytest.mark.parametrize(("name", "cut"), torn_cases())
def test_torn_tail_is_truncated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, cut: int | None
) -> None:
    write(tmp_path, [3, 4, 5])
    path = only_segment(tmp_path)
    start, end = frame_offsets(path)[-1]
    data = bytearray(path.read_bytes())
    if cut is None:
        data[end - 3] ^= 0xFF
    elif cut == -2:
        data = data[: (start + 24 + end) // 2]
    elif cut == -1:
        data = data[: end - 1]
    else:
        data = data[: start + cut]
    path.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="ingest.journal"):
        w = JournalWriter.open(tmp_path, NODE)
    with w:
        assert "truncating" in caplog.text
        assert str(path) in caplog.text
        assert path.stat().st_size == start
        # The lost frame held seqs 8..12; the next append reuses 8.
        assert (w.next_seq, w.durable_seq) == (8, 7)
        for i in range(8, 11):
            assert w.append(**record(100 + i)) == i
        w.flush()
    reader = JournalReader(tmp_path / NODE)
    got = rows(reader.read(0, reader.last_seq()))
    assert got == [expected_row(i, record(i)) for i in range(1, 8)] + [
        expected_row(i, record(100 + i)) for i in range(8, 11)
    ]


def test_reader_does_not_see_an_incomplete_tail(tmp_path: Path) -> None:
    write(tmp_path, [3, 4])
    path = only_segment(tmp_path)
    _, end = frame_offsets(path)[-1]
    with open(path, "r+b") as f:
        f.truncate(end - 5)
    reader = JournalReader(tmp_path / NODE)
    assert reader.last_seq() == 3
    assert seqs(tmp_path) == [1, 2, 3]


def test_zero_filled_tail_is_truncated(tmp_path: Path) -> None:
    write(tmp_path, [3, 4])
    path = only_segment(tmp_path)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)
    assert JournalReader(tmp_path / NODE).last_seq() == 7
    with JournalWriter.open(tmp_path, NODE) as w:
        assert w.next_seq == 8
    assert path.stat().st_size == size


def test_torn_segment_header_is_rewritten(tmp_path: Path) -> None:
    write(tmp_path, [3], segment_bytes=1)
    # A crash right after creating the next segment left only part of its header.
    (tmp_path / NODE / "00000000000000000004.seg").write_bytes(FILE_HEADER[:2])
    assert JournalReader(tmp_path / NODE).last_seq() == 3
    assert write(tmp_path, [2, 1], start=4, segment_bytes=1) == 6
    assert seqs(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert [first for first, _ in list_segments(tmp_path / NODE)] == [1, 4, 6]


def test_empty_newest_segment_is_reused(tmp_path: Path) -> None:
    write(tmp_path, [3], segment_bytes=1)
    # A crash right after creating (and syncing) the next segment, before its first frame.
    (tmp_path / NODE / "00000000000000000004.seg").write_bytes(FILE_HEADER)
    assert write(tmp_path, [2], start=4, segment_bytes=1) == 5
    assert [first for first, _ in list_segments(tmp_path / NODE)] == [1, 4]


def corrupt_middle(root: Path, how: str) -> tuple[Path, int]:
    write(root, [3, 4, 5])
    path = only_segment(root)
    start, end = frame_offsets(path)[1]
    data = bytearray(path.read_bytes())
    if how == "body":
        data[end - 3] ^= 0xFF
    elif how == "magic":
        data[start] ^= 0xFF
    elif how == "seq":
        data[start + 12] ^= 0x01
    elif how == "length":
        # A longer length makes the frame look torn; the frame after it proves otherwise.
        data[start + 4 : start + 8] = (10**6).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path, start


@pytest.mark.parametrize("how", ["body", "magic", "seq", "length"])
def test_corrupt_frame_in_the_middle_fails_writer_open(tmp_path: Path, how: str) -> None:
    path, offset = corrupt_middle(tmp_path, how)
    size = path.stat().st_size
    with pytest.raises(JournalCorruptError) as info:
        JournalWriter.open(tmp_path, NODE)
    assert (info.value.path, info.value.offset) == (path, offset)
    assert str(path) in str(info.value)
    assert f"offset {offset}" in str(info.value)
    assert path.stat().st_size == size  # nothing was truncated
    # The failed open released the node lock.
    with pytest.raises(JournalCorruptError):
        JournalWriter.open(tmp_path, NODE)


@pytest.mark.parametrize("how", ["body", "magic", "seq"])
def test_corrupt_frame_in_the_middle_fails_reader(tmp_path: Path, how: str) -> None:
    path, offset = corrupt_middle(tmp_path, how)
    reader = JournalReader(tmp_path / NODE)
    # Records before the bad frame are still readable.
    assert [r["seq"] for r in rows(reader.read(0, 3))] == [1, 2, 3]
    with pytest.raises(JournalCorruptError) as info:
        list(reader.read(0, 12))
    assert (info.value.path, info.value.offset) == (path, offset)


def test_corrupt_closed_segment_fails_reader(tmp_path: Path) -> None:
    write(tmp_path, [3] * 6, segment_bytes=1500)
    segments = list_segments(tmp_path / NODE)
    assert len(segments) > 2
    path = segments[0][1]
    start, end = frame_offsets(path)[-1]
    data = bytearray(path.read_bytes())
    data[end - 2] ^= 0x55
    path.write_bytes(bytes(data))
    reader = JournalReader(tmp_path / NODE)
    assert reader.last_seq() == 18  # headers only: the body is not read
    with pytest.raises(JournalCorruptError) as info:
        list(reader.read(0, 18))
    assert (info.value.path, info.value.offset) == (path, start)


CRASH_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from ingest.journal import JournalWriter

    root = Path(sys.argv[1])
    with JournalWriter.open(root, "edge-1", segment_bytes=4096, fsync=True) as w:
        i = w.next_seq
        print("ready", flush=True)
        while True:
            for _ in range(1 + i % 5):
                w.append(
                    ts_us=i, tenant="t", client_id="c", topic=f"t/{i}",
                    qos=1, retain=False, payload=i.to_bytes(8, "big") * (i % 9),
                )
                i += 1
            print(w.flush(), flush=True)
    """
)


def run_and_kill(root: Path, commits: int) -> int:
    """Run a child that appends and commits in a loop; SIGKILL it mid-stream."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD, str(root)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        durable = 0
        for _ in range(commits):
            line = child.stdout.readline()
            assert line, "child died early"
            reported = int(line)
            assert reported > durable
            durable = reported
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        child.kill()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return durable


def test_sigkill_loses_nothing_reported_durable(tmp_path: Path) -> None:
    durable_before = 0
    for commits in (150, 40, 90):
        durable = run_and_kill(tmp_path, commits)
        assert durable > durable_before
        with JournalWriter.open(tmp_path, NODE) as w:  # recovery
            assert w.next_seq > durable
            last = w.durable_seq
        got = rows(JournalReader(tmp_path / NODE).read(0, last))
        assert [r["seq"] for r in got] == list(range(1, last + 1))
        for r in got:
            seq = r["seq"]
            assert r["payload"] == seq.to_bytes(8, "big") * (seq % 9)
            assert r["topic"] == f"t/{seq}"
        durable_before = durable
    assert len(list_segments(tmp_path / NODE)) > 1


# --- property ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.integers(min_value=1, max_value=8), min_size=1, max_size=12),
    segment_bytes=st.sampled_from([1, 900, 3000, 64 * 2**20]),
    data=st.data(),
)
def test_read_returns_exactly_the_range(
    groups: list[int], segment_bytes: int, data: st.DataObject
) -> None:
    total = sum(groups)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write(root, groups, segment_bytes=segment_bytes)
        reader = JournalReader(root / NODE)
        assert reader.last_seq() == total
        for _ in range(5):
            after = data.draw(st.integers(min_value=0, max_value=total), label="after")
            upto = data.draw(st.integers(min_value=after, max_value=total), label="upto")
            got = rows(reader.read(after, upto))
            assert got == [expected_row(i, record(i)) for i in range(after + 1, upto + 1)]


def test_a_frame_written_but_not_yet_synced_is_invisible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from ingest import journal

    in_sync, release = threading.Event(), threading.Event()
    real_sync = journal._datasync

    def slow_sync(fd: int) -> None:
        in_sync.set()
        assert release.wait(10)
        real_sync(fd)

    with JournalWriter.open(tmp_path, NODE) as w:
        w.append(**record(1))
        w.flush()
        monkeypatch.setattr(journal, "_datasync", slow_sync)
        w.append(**record(2))
        frame = w.drain()
        assert frame is not None
        committer = threading.Thread(target=w.commit, args=(frame,))
        committer.start()
        assert in_sync.wait(10)
        # The frame is in the file (a reader scanning frames would find it) but not durable.
        assert seqs(tmp_path, upto=None) == [1]
        assert JournalReader(tmp_path / NODE).last_seq() == 1
        release.set()
        committer.join(10)
        assert JournalReader(tmp_path / NODE).last_seq() == 2


def test_the_watermark_is_rewritten_from_the_recovered_journal(tmp_path: Path) -> None:
    write(tmp_path, [3, 2])
    durable = tmp_path / NODE / "DURABLE"
    durable.write_bytes(b"")  # as if the machine died before the first watermark write
    assert JournalReader(tmp_path / NODE).last_seq() == 5  # no watermark: complete frames
    with JournalWriter.open(tmp_path, NODE) as w:
        assert w.durable_seq == 5
        assert JournalReader(tmp_path / NODE).last_seq() == 5


def test_a_damaged_watermark_is_an_error_naming_the_file(tmp_path: Path) -> None:
    write(tmp_path, [2])
    durable = tmp_path / NODE / "DURABLE"
    data = bytearray(durable.read_bytes())
    data[0] ^= 0xFF
    durable.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError, match="DURABLE"):
        JournalReader(tmp_path / NODE).last_seq()


@pytest.mark.parametrize(
    ("after", "upto"), [(0, 25), (3, 7), (3, 15), (10, 20), (12, 13), (24, 25)]
)
def test_read_ipc_is_one_arrow_stream_of_exactly_the_range(
    tmp_path: Path, after: int, upto: int
) -> None:
    """What the edge serves over HTTP: whole frames as on disk, cut frames re-encoded (user
    properties and nulls included), the same records as read()."""
    import pyarrow as pa

    with JournalWriter.open(tmp_path, "n", fsync=False) as writer:
        for frame in range(3):  # frames of 10, 10 and 5 records
            for i in range(10 if frame < 2 else 5):
                writer.append(
                    ts_us=1_790_000_000_000_000 + i,
                    tenant="acme",
                    client_id=f"c{frame}",
                    topic=f"fleet/{i}",
                    qos=i % 3,
                    retain=i == 4,
                    payload=b"x" * i,
                    content_type="application/json" if i % 2 else None,
                    user_properties=(("k", str(i)), ("k2", "v")) if i % 4 == 0 else (),
                )
            writer.flush()
    reader = JournalReader(tmp_path / "n")
    got = pa.ipc.open_stream(b"".join(reader.read_ipc(after, upto))).read_all()
    assert got.equals(pa.Table.from_batches(list(reader.read(after, upto))))
    assert got.column("seq").to_pylist() == list(range(after + 1, upto + 1))


def test_a_long_lived_reader_forgets_the_segments_retention_removed(tmp_path: Path) -> None:
    """The pipeline's source and lag metrics, and the edge's HTTP journal, keep one reader for
    their whole life while segments roll and retention deletes them: its memory must not grow
    with every segment it ever scanned (issue 9's soak found megabytes a minute)."""
    import gc
    import tracemalloc

    reader = JournalReader(tmp_path / NODE)
    journal_py = str(REPO / "ingest" / "journal.py")

    def held_by_journal() -> int:
        gc.collect()
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, journal_py)])
        return sum(stat.size for stat in snap.statistics("filename"))

    tracemalloc.start()
    try:
        with JournalWriter.open(tmp_path, NODE, segment_bytes=4096) as w:
            i = 1
            sizes = []
            for rnd in range(240):
                for _ in range(4):  # one frame of 4 records a round: ~6 rounds a segment
                    w.append(**record(i))
                    i += 1
                w.flush()
                last = reader.last_seq()
                assert last == i - 1
                # The source reads what it planned, across the segments still on disk.
                first = list_segments(tmp_path / NODE)[0][0]
                assert [r["seq"] for r in rows(reader.read(first - 1, last))][-1] == last
                w.remove_committed(last, min_age=0.0, now=float("inf"))
                if rnd in (40, 239):
                    sizes.append(held_by_journal())
        assert len(list_segments(tmp_path / NODE)) <= 2
    finally:
        tracemalloc.stop()
    # 200 rounds (~30 segments) later the reader holds what it held: the live segments' frames.
    assert sizes[1] - sizes[0] < 8_000, sizes
