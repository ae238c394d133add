"""Syncs that complete on the event loop (Linux AIO): real files, a real loop, real kernel syncs;
failures come from a syncer that wraps the real one and reports -EIO for the syncs it is told
to fail (the kernel's own sync then still ran)."""

from __future__ import annotations

import asyncio
import errno
import os
import select
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from broker_edge.durability import GroupCommitter, JournalStatus, Syncer
from ingest.aiosync import AioSync
from ingest.journal import JournalReader, JournalWriter, list_segments

NODE = "unit"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="Linux AIO: the edge's production platform"
)


def _real_syncer() -> AioSync:
    syncer = AioSync.open()
    assert syncer is not None, "this Linux kernel should offer AIO fdatasync"
    return syncer


class FailingSyncs:
    """The real syncer; ``fail(n)`` reports the next ``n`` syncs as failed with EIO, and
    ``refuse_submit`` makes submitting raise (a filesystem AIO cannot sync)."""

    def __init__(self) -> None:
        self.real = _real_syncer()
        self.to_fail = 0
        self.failing: list[bool] = []
        self.refuse_submit = False
        self.submitted = 0

    def fileno(self) -> int:
        return self.real.fileno()

    def submit(self, fd: int) -> None:
        if self.refuse_submit:
            raise OSError(errno.EINVAL, "Invalid argument")
        self.real.submit(fd)
        self.submitted += 1
        self.failing.append(self.to_fail > 0)
        self.to_fail = max(0, self.to_fail - 1)

    def reap(self) -> list[int]:
        results = self.real.reap()
        return [-errno.EIO if self.failing.pop(0) else r for r in results]

    def close(self) -> None:
        self.real.close()


def test_aio_sync_signals_its_descriptor_when_the_fdatasync_is_done(tmp_path: Path) -> None:
    syncer = _real_syncer()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert syncer.reap() == []  # nothing finished: never blocks
        os.write(fd, b"x" * 5000)
        syncer.submit(fd)
        assert syncer.in_flight == 1
        readable, _, _ = select.select([syncer.fileno()], [], [], 10)
        assert readable == [syncer.fileno()]
        assert syncer.reap() == [0]
        assert syncer.in_flight == 0
        r, w = os.pipe()  # a pipe has no fsync: the kernel refuses at submit, nothing starts
        with pytest.raises(OSError) as refused:
            syncer.submit(r)
        assert refused.value.errno == errno.EINVAL
        assert syncer.in_flight == 0
        os.close(r)
        os.close(w)
    finally:
        os.close(fd)
        syncer.close()


def _publish(committer: GroupCommitter, i: int, acked: list[int], refused: list[int]) -> int:
    seq = committer.append(i, "acme", "c", "t", 1, False, b"%d" % i, None, ())

    def ack() -> None:
        # The invariant the broker relies on: never acknowledged before it is durable.
        assert committer._writer.durable_seq >= seq
        acked.append(i)

    committer.after_durable(seq, ack, lambda: refused.append(i))
    return seq


async def _until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` (each check a loop iteration apart), failing after 10 s."""

    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), 10)


def _payloads(root: Path) -> list[bytes]:
    reader = JournalReader(root / NODE)
    return [p.as_py() for b in reader.read(0, reader.last_seq()) for p in b.column("payload")]


def test_syncs_complete_on_the_loop_and_segment_rolls_go_to_the_thread(tmp_path: Path) -> None:
    async def main() -> GroupCommitter:
        writer = JournalWriter.open(tmp_path, NODE, segment_bytes=4096)
        committer = GroupCommitter(writer)
        committer.start()
        assert committer.sync_mode == "loop"
        acked: list[int] = []
        refused: list[int] = []
        for r in range(60):  # reads of 10 publishes, each a frame (the next waits for it)
            for i in range(10):
                _publish(committer, r * 10 + i, acked, refused)
            await _until(lambda: len(acked) == 10 * (r + 1))  # noqa: B023 (awaited here)
        assert acked == list(range(600))
        assert refused == []
        await committer.close()
        return committer

    committer = asyncio.run(main())
    assert committer.loop_commits > 0  # most frames: synced by the kernel, reported on the loop
    assert committer.thread_commits > 0  # each frame that starts a segment: in the thread
    assert len(list_segments(tmp_path / NODE)) > 2
    assert _payloads(tmp_path) == [b"%d" % i for i in range(600)]


def test_under_steady_load_the_thread_hands_the_commits_back_after_a_roll(
    tmp_path: Path,
) -> None:
    async def main() -> GroupCommitter:
        committer = GroupCommitter(JournalWriter.open(tmp_path, NODE))
        committer.start()
        acked: list[int] = []
        refused: list[int] = []
        for r in range(200):  # reads that never let the buffer run dry for long
            for i in range(5):
                _publish(committer, r * 5 + i, acked, refused)
            await asyncio.sleep(0.0005)
        await _until(lambda: len(acked) == 1000)
        await committer.close()
        return committer

    committer = asyncio.run(main())
    # The thread commits only the frames that start a segment: the first one, and the one
    # that moves onto the spare segment once it is written (1 or 2 segments by then).
    assert committer.thread_commits == len(list_segments(tmp_path / NODE))
    assert committer.loop_commits > 1


def test_a_failed_loop_sync_refuses_its_publishes_and_the_thread_recovers(
    tmp_path: Path,
) -> None:
    syncs = FailingSyncs()
    statuses: list[JournalStatus] = []

    async def main() -> tuple[list[int], list[int]]:
        committer = GroupCommitter(JournalWriter.open(tmp_path, NODE), syncer=lambda: syncs)
        acked: list[int] = []
        refused: list[int] = []
        recovered = asyncio.Event()

        def on_state(status: JournalStatus) -> None:
            statuses.append(status)
            if status.state == "error":  # what the broker does: the journal_error event
                topic = "$log/journal/journal_error"
                committer.append(0, "$operator", "$edge", topic, 0, False, b"e", None, ())
            elif status.state == "ok":
                recovered.set()

        committer.on_state = on_state
        committer.start()
        _publish(committer, 0, acked, refused)
        await _until(lambda: len(acked) > 0)
        # A frame that does not start a segment (the first one did): synced on the loop.
        assert committer.loop_commits + committer.thread_commits == 1
        syncs.to_fail = 1
        _publish(committer, 1, acked, refused)
        _publish(committer, 2, acked, refused)
        await _until(lambda: len(refused) == 2)
        assert committer.refusing == 0x80
        await asyncio.wait_for(recovered.wait(), 10)
        assert committer.refusing == 0
        _publish(committer, 3, acked, refused)
        await _until(lambda: len(acked) == 2)
        assert committer.sync_mode == "loop"  # the loop syncs again after the recovery
        await committer.close()
        return acked, refused

    acked, refused = asyncio.run(main())
    assert (acked, refused) == ([0, 3], [1, 2])
    assert [s.state for s in statuses] == ["error", "ok"]
    assert "Input/output error" in statuses[0].error
    # The failed frame was cut away: the acknowledged publishes and the error event, in order.
    assert _payloads(tmp_path) == [b"0", b"e", b"3"]


def test_a_refused_submit_syncs_that_frame_and_falls_back_to_the_thread(tmp_path: Path) -> None:
    syncs = FailingSyncs()

    async def main() -> list[int]:
        syncer: Syncer = syncs
        committer = GroupCommitter(JournalWriter.open(tmp_path, NODE), syncer=lambda: syncer)
        committer.start()
        acked: list[int] = []
        refused: list[int] = []
        _publish(committer, 0, acked, refused)  # starts the segment: the thread
        await _until(lambda: len(acked) > 0)
        syncs.refuse_submit = True
        for i in range(1, 30):
            _publish(committer, i, acked, refused)
            await asyncio.sleep(0)
        await _until(lambda: len(acked) == 30)
        assert committer.sync_mode == "thread"
        assert refused == []
        await committer.close()
        return acked

    assert asyncio.run(main()) == list(range(30))
    assert _payloads(tmp_path) == [b"%d" % i for i in range(30)]


def test_close_waits_for_the_sync_in_flight(tmp_path: Path) -> None:
    async def main() -> int:
        committer = GroupCommitter(JournalWriter.open(tmp_path, NODE))
        committer.start()
        acked: list[int] = []
        refused: list[int] = []
        _publish(committer, 0, acked, refused)
        await _until(lambda: len(acked) > 0)
        _publish(committer, 1, acked, refused)
        await asyncio.sleep(0)  # the kick: the frame is written and its sync submitted
        assert committer._syncing is not None
        await committer.close()
        assert refused == []
        return committer.durable_seq

    assert asyncio.run(main()) == 2
    assert JournalReader(tmp_path / NODE).last_seq() == 2
