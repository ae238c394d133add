"""Spare segments: the next segment written ahead as zeros, so a sync of the frames written over
them does not also have to write the file's size. Real files in a temporary directory."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import zlib
from pathlib import Path

import pytest

from broker_edge.durability import GroupCommitter
from ingest.journal import (
    FILE_HEADER,
    FRAME_HEADER,
    SPARE_FILE,
    SPARE_SLACK,
    JournalCorruptError,
    JournalReader,
    JournalWriter,
    list_segments,
)

NODE = "unit"
SEGMENT = 8192


def _commit(writer: JournalWriter, first: int, count: int, size: int = 200) -> None:
    for i in range(first, first + count):
        writer.append(i, "acme", "c", "t", 1, False, b"%d:" % i + b"x" * size)
    writer.flush()


def _payload_ids(node_dir: Path) -> list[int]:
    reader = JournalReader(node_dir)
    batches = reader.read(0, reader.last_seq())
    return [int(p.as_py().split(b":")[0]) for b in batches for p in b.column("payload")]


def _until_the_spare_is_taken(writer: JournalWriter) -> None:
    for _ in range(1000):
        _commit(writer, writer.durable_seq, 10)  # payload ids go on from the seqs
        if not writer.spare_bytes:
            return
    raise AssertionError("the spare was never taken")


def test_a_roll_takes_the_spare_and_seals_the_segment_at_its_data(tmp_path: Path) -> None:
    node_dir = tmp_path / NODE
    spare = len(FILE_HEADER) + SEGMENT + SPARE_SLACK
    with JournalWriter.open(tmp_path, NODE, segment_bytes=SEGMENT) as writer:
        _commit(writer, 0, 10)  # the first segment: a plain file
        writer.prepare_spare()
        assert writer.spare_bytes == spare
        assert (node_dir / SPARE_FILE).stat().st_size == spare
        first = list_segments(node_dir)[0][1]
        assert writer.bytes_on_disk == first.stat().st_size + spare  # the spare counts
        _until_the_spare_is_taken(writer)
        assert not (node_dir / SPARE_FILE).exists()
        (_, sealed), (_, active) = list_segments(node_dir)
        assert sealed.stat().st_size < SEGMENT + 4096  # plain: its frames only
        assert active.stat().st_size == spare  # frames written over the zeros: same size
        _commit(writer, writer.durable_seq, 10)
        assert active.stat().st_size == spare
        # Readers stop at the watermark: neither the zeros nor a frame not yet synced show.
        assert JournalReader(node_dir).last_seq() == writer.durable_seq
        assert _payload_ids(node_dir) == list(range(writer.durable_seq))
        writer.prepare_spare()
        _until_the_spare_is_taken(writer)  # the spare's segment is full: it is sealed
        # Cut at its last frame: a reader would find zeros in a sealed segment corrupt.
        assert active.stat().st_size < spare
        assert writer.bytes_on_disk == sum(p.stat().st_size for _, p in list_segments(node_dir))
        last, data_end = writer.durable_seq, writer._size
        newest = list_segments(node_dir)[-1][1]
        assert newest.stat().st_size == spare  # the third segment is the second spare
    assert newest.stat().st_size == data_end  # close() cuts it at its last frame
    assert _payload_ids(node_dir) == list(range(last))


def test_a_writer_stopped_without_closing_resumes_after_its_last_frame(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer = JournalWriter.open(tmp_path, NODE, segment_bytes=SEGMENT)
    _commit(writer, 0, 40)
    writer.prepare_spare()
    while writer.spare_bytes:
        _commit(writer, writer.durable_seq, 10)
    _commit(writer, writer.durable_seq, 5)
    last = writer.durable_seq
    crashed = tmp_path / "crashed"
    shutil.copytree(tmp_path / NODE, crashed / NODE)  # the files as a crash would leave them
    writer.close()
    os.remove(crashed / NODE / "LOCK")
    newest = list_segments(crashed / NODE)[-1][1]
    assert newest.stat().st_size == len(FILE_HEADER) + SEGMENT + SPARE_SLACK
    with caplog.at_level(logging.INFO, logger="ingest.journal"):
        reopened = JournalWriter.open(crashed, NODE, segment_bytes=SEGMENT)
    assert reopened.next_seq == last + 1
    assert "zero-filled tail" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # expected, not torn
    _commit(reopened, last, 5)
    reopened.close()
    assert _payload_ids(crashed / NODE) == list(range(last + 5))


def test_a_frame_half_written_over_zeros_is_a_torn_tail(tmp_path: Path) -> None:
    writer = JournalWriter.open(tmp_path, NODE, segment_bytes=SEGMENT)
    _commit(writer, 0, 40)
    writer.prepare_spare()
    while writer.spare_bytes:
        _commit(writer, writer.durable_seq, 10)
    before = writer.durable_seq
    size_before = writer._size
    _commit(writer, before, 10)
    crashed = tmp_path / "crashed"
    shutil.copytree(tmp_path / NODE, crashed / NODE)
    writer.close()
    os.remove(crashed / NODE / "LOCK")
    newest = list_segments(crashed / NODE)[-1][1]
    with open(newest, "r+b") as f:  # the last frame's second half never reached the disk
        f.seek(size_before)
        header = FRAME_HEADER.unpack(f.read(FRAME_HEADER.size))
        half = size_before + FRAME_HEADER.size + header[1] // 2
        f.seek(half)
        f.write(bytes(header[1] - header[1] // 2))
    reopened = JournalWriter.open(crashed, NODE, segment_bytes=SEGMENT)
    assert reopened.next_seq == before + 1  # the torn frame was cut, nothing before it
    reopened.close()
    assert _payload_ids(crashed / NODE) == list(range(before))


def test_the_committer_writes_spares_ahead_only_within_the_disk_budget(tmp_path: Path) -> None:
    async def run(root: Path, max_bytes: int) -> tuple[int, bool]:
        writer = JournalWriter.open(root, NODE, segment_bytes=SEGMENT)
        committer = GroupCommitter(writer, max_bytes=max_bytes)
        committer.start()
        done = asyncio.Event()
        for i in range(300):  # ~9 segments
            payload = b"%d:" % i + b"x" * 200
            seq = committer.append(i, "acme", "c", "t", 1, False, payload, None, ())
            if i == 299:
                committer.after_durable(seq, done.set)
            if i % 10 == 9:
                await asyncio.sleep(0.001)
        await asyncio.wait_for(done.wait(), 10)
        for _ in range(2000):  # the spare after the last roll is written in the executor
            if writer.spare_bytes or (max_bytes and committer._spare_job is None):
                break
            await asyncio.sleep(0.005)
        spare, on_disk = writer.spare_bytes, (root / NODE / SPARE_FILE).exists()
        await committer.close()
        return spare, on_disk

    spare, on_disk = asyncio.run(run(tmp_path / "free", 0))
    assert spare == len(FILE_HEADER) + SEGMENT + SPARE_SLACK
    assert on_disk
    assert not (tmp_path / "free" / NODE / SPARE_FILE).exists()  # close() removed it
    assert _payload_ids(tmp_path / "free" / NODE) == list(range(300))
    budget = 40 * SEGMENT  # room for the frames, not for a spare and the segment it becomes
    assert asyncio.run(run(tmp_path / "tight", budget)) == (0, False)
    assert _payload_ids(tmp_path / "tight" / NODE) == list(range(300))


def test_a_reader_never_looks_past_the_watermark_into_a_frame_being_written(
    tmp_path: Path,
) -> None:
    node_dir = tmp_path / NODE
    with JournalWriter.open(tmp_path, NODE, segment_bytes=SEGMENT) as writer:
        _commit(writer, 0, 40)
        writer.prepare_spare()
        _until_the_spare_is_taken(writer)
        durable, data_end = writer.durable_seq, writer._size
        active = list_segments(node_dir)[-1][1]
        with open(active, "r+b") as f:  # a reader's view in the middle of the next pwrite
            f.seek(data_end)
            f.write(b"EBFR")
        reader = JournalReader(node_dir)
        assert reader.last_seq() == durable
        assert _payload_ids(node_dir) == list(range(durable))


def _crash_with_garbage_after_the_last_frame(tmp_path: Path) -> tuple[Path, int]:
    """A writer on a spare killed while a frame's later sectors reached the disk and its
    first did not: zeros where the frame header should be, then bytes that are not zeros."""
    writer = JournalWriter.open(tmp_path, NODE, segment_bytes=SEGMENT)
    _commit(writer, 0, 40)
    writer.prepare_spare()
    _until_the_spare_is_taken(writer)
    durable, data_end = writer.durable_seq, writer._size
    crashed = tmp_path / "crashed"
    shutil.copytree(tmp_path / NODE, crashed / NODE)
    writer.close()
    os.remove(crashed / NODE / "LOCK")
    with open(list_segments(crashed / NODE)[-1][1], "r+b") as f:
        f.seek(data_end + 512)
        f.write(b"\x5a" * 1024)
    return crashed, durable


def test_a_frame_whose_first_sector_was_lost_is_a_torn_tail_when_never_durable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    crashed, durable = _crash_with_garbage_after_the_last_frame(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ingest.journal"):
        reopened = JournalWriter.open(crashed, NODE, segment_bytes=SEGMENT)
    assert reopened.next_seq == durable + 1
    assert "unreadable bytes after the last frame" in caplog.text
    reopened.close()
    assert _payload_ids(crashed / NODE) == list(range(durable))


def test_unreadable_bytes_where_durable_records_were_are_damage(tmp_path: Path) -> None:
    crashed, durable = _crash_with_garbage_after_the_last_frame(tmp_path)
    # The watermark says a later record was durable: those bytes held it, so they are damage.
    seq = (durable + 3).to_bytes(8, "little")
    (crashed / NODE / "DURABLE").write_bytes(seq + zlib.crc32(seq).to_bytes(4, "little"))
    with pytest.raises(JournalCorruptError, match=f"seq {durable + 1} should start"):
        JournalWriter.open(crashed, NODE, segment_bytes=SEGMENT)
