"""The journal when the disk says no (issue 9): injected ENOSPC/EIO/EFBIG on write and on
sync through the writer's file layer, recovery to the last durable frame, retention, and the
reader's answer for removed seqs. The group committer on top: refuses, retries, resumes."""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
from pathlib import Path

import pytest

from broker_edge.durability import GroupCommitter, JournalStatus
from ingest.journal import (
    FileOps,
    JournalGapError,
    JournalReader,
    JournalWriteError,
    JournalWriter,
    list_segments,
)

NODE = "edge-1"


class FaultyFiles(FileOps):
    """The real file layer, with faults armed per call kind: the next ``n`` calls fail."""

    def __init__(self) -> None:
        self.faults: dict[str, list[int]] = {}  # kind -> errnos of the next calls to fail
        self.free = 10 * 2**30

    def arm(self, kind: str, err: int, times: int = 1) -> None:
        self.faults.setdefault(kind, []).extend([err] * times)

    def _maybe_fail(self, kind: str) -> None:
        pending = self.faults.get(kind)
        if pending:
            err = pending.pop(0)
            raise OSError(err, os.strerror(err))

    def write(self, fd: int, data: memoryview | bytes) -> int:
        pending = self.faults.get("short-write")
        if pending:  # half the frame reaches the file, then the disk is full
            pending.pop(0)
            os.write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._maybe_fail("write")
        return super().write(fd, data)

    def datasync(self, fd: int) -> None:
        self._maybe_fail("sync")
        super().datasync(fd)

    def fsync(self, fd: int) -> None:
        self._maybe_fail("sync")
        super().fsync(fd)

    def truncate(self, fd: int, size: int) -> None:
        self._maybe_fail("truncate")
        super().truncate(fd, size)

    def free_bytes(self, path: Path) -> int:
        return self.free


def append(writer: JournalWriter, i: int) -> int:
    return writer.append(
        ts_us=1_700_000_000_000_000 + i,
        tenant="acme",
        client_id="dev",
        topic=f"t/{i}",
        qos=1,
        retain=False,
        payload=b"p%d" % i,
    )


def payloads(root: Path) -> list[bytes]:
    reader = JournalReader(root / NODE)
    last = reader.last_seq()
    return [p for b in reader.read(0, last) for p in b.column("payload").to_pylist()]


@pytest.mark.parametrize(
    ("kind", "err"),
    [
        ("write", errno.ENOSPC),
        ("short-write", errno.ENOSPC),
        ("write", errno.EFBIG),
        ("sync", errno.EIO),
        ("sync", errno.ENOSPC),
    ],
)
def test_a_failed_frame_is_cut_away_and_its_seqs_given_out_again(
    tmp_path: Path, kind: str, err: int
) -> None:
    files = FaultyFiles()
    with JournalWriter.open(tmp_path, NODE, files=files) as w:
        for i in range(3):
            append(w, i)
        assert w.flush() == 3
        append(w, 3)
        append(w, 4)
        files.arm(kind, err)
        frame = w.drain()
        assert frame is not None
        with pytest.raises(JournalWriteError) as failed:
            w.commit(frame)
        assert failed.value.errno == err
        assert w.durable_seq == 3
        assert w.failed is not None
        append(w, 5)  # buffered while failing: dropped with the failed frame
        assert w.discard_buffered() == 3
        assert w.next_seq == 4
        # Readers never see past the durable seq, whatever reached the file.
        assert JournalReader(tmp_path / NODE).last_seq() == 3
        with pytest.raises(JournalWriteError, match="recover"):
            w.commit(frame)
        w.recover()
        assert w.failed is None
        assert append(w, 6) == 4
        assert w.flush() == 4
    assert payloads(tmp_path) == [b"p0", b"p1", b"p2", b"p6"]
    # A fresh open finds a clean journal: nothing torn to cut.
    with JournalWriter.open(tmp_path, NODE) as w:
        assert w.next_seq == 5


def test_recover_keeps_failing_while_the_disk_does(tmp_path: Path) -> None:
    files = FaultyFiles()
    with JournalWriter.open(tmp_path, NODE, files=files) as w:
        append(w, 0)
        w.flush()
        append(w, 1)
        files.arm("short-write", errno.ENOSPC)
        frame = w.drain()
        assert frame is not None
        with pytest.raises(JournalWriteError):
            w.commit(frame)
        w.discard_buffered()
        files.arm("truncate", errno.EIO)
        with pytest.raises(OSError, match="Input/output"):
            w.recover()
        assert w.failed is not None
        w.recover()
        append(w, 2)
        assert w.flush() == 2
    assert payloads(tmp_path) == [b"p0", b"p2"]


def test_a_failure_while_rolling_removes_the_new_segment(tmp_path: Path) -> None:
    files = FaultyFiles()
    with JournalWriter.open(tmp_path, NODE, segment_bytes=64, files=files) as w:
        append(w, 0)
        w.flush()  # the first segment is now over its size: the next frame rolls
        append(w, 1)
        files.arm("sync", errno.EIO)  # the new segment's header fsync
        frame = w.drain()
        assert frame is not None
        with pytest.raises(JournalWriteError):
            w.commit(frame)
        assert len(list_segments(tmp_path / NODE)) == 2
        w.discard_buffered()
        w.recover()
        assert [first for first, _ in list_segments(tmp_path / NODE)] == [1]
        append(w, 2)
        w.flush()
    assert [first for first, _ in list_segments(tmp_path / NODE)] == [1, 2]
    assert payloads(tmp_path) == [b"p0", b"p2"]


def test_bytes_on_disk_follow_the_segments(tmp_path: Path) -> None:
    with JournalWriter.open(tmp_path, NODE, segment_bytes=4096) as w:
        for i in range(200):
            append(w, i)
            w.flush()
        on_disk = sum(p.stat().st_size for _, p in list_segments(tmp_path / NODE))
        assert w.bytes_on_disk == on_disk
    with JournalWriter.open(tmp_path, NODE, segment_bytes=4096) as w:
        assert w.bytes_on_disk == on_disk


# -- retention --------------------------------------------------------------------------------


def _segmented(tmp_path: Path, records: int = 60) -> JournalWriter:
    w = JournalWriter.open(tmp_path, NODE, segment_bytes=4096)
    for i in range(records):
        append(w, i)
        w.flush()  # one frame per record: the segments roll every few dozen records
    return w


def test_retention_removes_only_committed_sealed_segments(tmp_path: Path) -> None:
    with _segmented(tmp_path, 300) as w:
        segments = list_segments(tmp_path / NODE)
        firsts = [first for first, _ in segments]
        assert len(firsts) >= 4
        # Committed up to one record short of the second segment's end: only the first goes.
        removed = w.remove_committed(firsts[2] - 2, 0, now=9e12)
        assert removed == [segments[0][1]]
        assert w.remove_committed(firsts[2] - 1, 0, now=9e12) == [segments[1][1]]
        # Everything committed: every sealed segment goes, never the one being written.
        w.remove_committed(w.durable_seq, 0, now=9e12)
        assert list_segments(tmp_path / NODE) == [segments[-1]]
        assert w.bytes_on_disk == segments[-1][1].stat().st_size
        # A reader still reads what is left.
        reader = JournalReader(tmp_path / NODE)
        assert reader.first_seq() == firsts[-1]
        got = [p for b in reader.read(firsts[-1] - 1, w.durable_seq) for p in b["payload"]]
        assert len(got) == w.durable_seq - firsts[-1] + 1


def test_retention_waits_for_the_age(tmp_path: Path) -> None:
    with _segmented(tmp_path, 200) as w:
        segments = list_segments(tmp_path / NODE)
        newest_sealed = max(p.stat().st_mtime for _, p in segments[:-1])
        oldest = segments[0][1].stat().st_mtime
        hour = 3600.0
        assert w.remove_committed(w.durable_seq, hour, now=oldest + hour - 1) == []
        removed = w.remove_committed(w.durable_seq, hour, now=newest_sealed + hour)
        assert removed == [p for _, p in segments[:-1]]


def test_retention_never_passes_the_durable_seq(tmp_path: Path) -> None:
    with _segmented(tmp_path, 200) as w:
        before = list_segments(tmp_path / NODE)
        append(w, 999)  # buffered, not durable
        assert w.remove_committed(0, 0, now=9e12) == []
        removed = w.remove_committed(10**9, 0, now=9e12)  # a bogus notice past the journal
        assert list_segments(tmp_path / NODE) == before[-1:]
        assert len(removed) == len(before) - 1


def test_a_reader_before_the_oldest_segment_gets_a_gap_error(tmp_path: Path) -> None:
    with _segmented(tmp_path, 200) as w:
        firsts = [first for first, _ in list_segments(tmp_path / NODE)]
        w.remove_committed(firsts[2] - 1, 0, now=9e12)
        durable = w.durable_seq
    reader = JournalReader(tmp_path / NODE)
    with pytest.raises(JournalGapError) as gap:
        list(reader.read(0, durable))
    assert (gap.value.node, gap.value.first, gap.value.last) == (NODE, 1, firsts[2] - 1)
    assert f"seqs 1..{firsts[2] - 1} were removed" in str(gap.value)
    with pytest.raises(JournalGapError):
        list(reader.read_records(0, durable))  # the edge's reader says the same
    reader.check_available(firsts[2] - 1)  # right at the edge: fine
    with pytest.raises(JournalGapError, match=f"node '{NODE}'"):
        reader.check_available(0)


# -- the group committer on a failing disk ----------------------------------------------------


def test_committer_refuses_the_failed_frame_retries_and_resumes(tmp_path: Path) -> None:
    files = FaultyFiles()
    statuses: list[JournalStatus] = []

    async def main() -> tuple[list[int], list[int]]:
        committer = GroupCommitter(JournalWriter.open(tmp_path, NODE, files=files))
        acked: list[int] = []
        refused: list[int] = []
        recovered = asyncio.Event()

        def on_state(status: JournalStatus) -> None:
            statuses.append(status)
            if status.state == "error":
                # What the broker does: a record for the retry to write (the journal_error event).
                topic = "$log/journal/journal_error"
                committer.append(0, "$operator", "$edge", topic, 0, False, b"e", None, ())
            elif status.state == "ok":
                recovered.set()

        committer.on_state = on_state
        committer.start()

        def publish(i: int) -> int:
            seq = committer.append(i, "acme", "c", "t", 1, False, b"%d" % i, None, ())
            committer.after_durable(seq, lambda: acked.append(i), lambda: refused.append(i))
            return seq

        publish(0)
        while not acked:
            await asyncio.sleep(0.001)
        files.arm("sync", errno.EIO, times=2)  # the next frame, then the first retry
        publish(1)
        publish(2)
        while len(refused) < 2:
            await asyncio.sleep(0.001)
        assert committer.refusing == 0x80
        await asyncio.wait_for(recovered.wait(), 10)
        assert committer.refusing == 0
        publish(3)
        while len(acked) < 2:
            await asyncio.sleep(0.001)
        await committer.close()
        return acked, refused

    acked, refused = asyncio.run(main())
    assert (acked, refused) == ([0, 3], [1, 2])
    assert [s.state for s in statuses] == ["error", "error", "ok"]
    assert "Input/output error" in statuses[0].error
    # Exactly the acknowledged publishes and the one retried error event, each once, in order.
    assert payloads(tmp_path) == [b"0", b"e", b"3"]


def test_committer_refuses_over_budget_and_resumes_when_space_is_freed(tmp_path: Path) -> None:
    files = FaultyFiles()
    files.free = 10 * 2**20

    async def main() -> list[str]:
        committer = GroupCommitter(
            JournalWriter.open(tmp_path, NODE, files=files), min_free_bytes=2**20
        )
        states: list[str] = []
        changed = asyncio.Event()

        def on_state(status: JournalStatus) -> None:
            states.append(status.state)
            changed.set()

        committer.on_state = on_state
        committer.start()
        committer.append(0, "acme", "c", "t", 1, False, b"x", None, ())
        files.free = 2**19  # the filesystem fills up (someone else's files)
        await asyncio.wait_for(changed.wait(), 10)
        changed.clear()
        assert committer.refusing == 0x97
        assert "journal_min_free_bytes" in committer.status.full
        files.free = 2**21
        await asyncio.wait_for(changed.wait(), 10)  # the next maintenance tick, within ~1 s
        assert committer.refusing == 0
        await committer.close()
        return states

    assert asyncio.run(main()) == ["full", "ok"]


def test_committer_applies_retention_from_the_lake_notice(tmp_path: Path) -> None:
    async def main() -> None:
        writer = JournalWriter.open(tmp_path, NODE, segment_bytes=4096, fsync=False)
        committer = GroupCommitter(writer, max_bytes=3 * 4096 + 2048, retention_seconds=0)
        states: list[str] = []
        committer.on_state = lambda status: states.append(status.state)
        committer.start()
        seq = 0
        while committer.refusing == 0:  # one frame at a time, so the segments roll
            seq = committer.append(seq, "acme", "c", "t", 1, False, b"x" * 200, None, ())
            while committer.durable_seq < seq:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.001)  # the full report comes after the commit's
        assert states[-1] == "full"
        committer.lake_committed_seq = seq  # what the pipeline's notice does (broker)
        while committer.refusing:
            await asyncio.sleep(0.01)
        assert states[-1] == "ok"
        assert len(list_segments(tmp_path / NODE)) == 1
        assert committer.segments_removed >= 2
        await committer.close()

    asyncio.run(main())


def test_retention_keeps_what_a_peer_has_not_acknowledged_until_the_budget_wins(
    tmp_path: Path,
) -> None:
    """Records after a peer's acked position stay though the lake has them, until the journal
    is over its budget: then the oldest go (with a segment to spare) and the loop is told the
    seqs the peer gives up, once each."""

    async def main() -> None:
        writer = JournalWriter.open(tmp_path, NODE, segment_bytes=4096, fsync=False)
        committer = GroupCommitter(writer, max_bytes=6 * 4096, retention_seconds=0)
        dropped: list[tuple[str, int, int]] = []
        told = asyncio.Event()

        def on_peer_dropped(node: str, first: int, last: int) -> None:
            dropped.append((node, first, last))
            told.set()

        committer.on_peer_dropped = on_peer_dropped
        committer.peer_acked = {"far": 0, "near": 10**9}
        committer.start()

        async def fill(count: int) -> int:
            seq = 0
            for _ in range(count):  # one frame at a time, so the segments roll
                seq = committer.append(seq, "acme", "c", "t", 1, False, b"x" * 200, None, ())
                while committer.durable_seq < seq:
                    await asyncio.sleep(0.001)
            return seq

        seq = await fill(12)  # a few segments: under budget
        committer.lake_committed_seq = seq
        removed = committer.segments_removed
        await asyncio.sleep(2.5)  # two maintenance passes (every second)
        assert committer.segments_removed == removed == 0  # "far" acknowledged none of them
        assert not dropped
        while committer.refusing == 0:
            seq = await fill(1)
            await asyncio.sleep(0.001)  # the full report comes after the commit's
        committer.lake_committed_seq = seq
        await asyncio.wait_for(told.wait(), 10)
        while committer.refusing:
            await asyncio.sleep(0.01)
        assert committer.bytes_on_disk + 4096 < 6 * 4096  # a segment to spare
        # Only the peer that had not acknowledged them, each seq once, up to what is left.
        assert {node for node, _, _ in dropped} == {"far"}
        assert dropped[0][1] == 1
        for (_, _, last), (_, first, _) in itertools.pairwise(dropped):
            assert first == last + 1
        assert dropped[-1][2] == list_segments(tmp_path / NODE)[0][0] - 1
        await committer.close()

    asyncio.run(main())
