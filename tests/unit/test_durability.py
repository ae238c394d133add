"""GroupCommitter: a real journal in a temporary directory, a real event loop, no clock."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from broker_edge.durability import GroupCommitter
from ingest.journal import JournalReader, JournalWriter

NODE = "unit"


def _append(committer: GroupCommitter, i: int) -> int:
    return committer.append(i, "default", "c", f"t/{i % 3}", 1, False, b"%d" % i, None, ())


async def _publish_in_reads(committer: GroupCommitter, reads: int, per_read: int) -> list[int]:
    """Append ``reads`` x ``per_read`` records, one read per loop iteration, each acknowledged
    through ``after_durable``; returns the seqs in the order their acknowledgements ran."""
    writer = committer._writer
    acked: list[int] = []

    def ack(seq: int) -> None:
        # The invariant the broker relies on: never acknowledged before it is durable.
        assert writer.durable_seq >= seq
        acked.append(seq)

    for r in range(reads):
        for i in range(per_read):
            seq = _append(committer, r * per_read + i)
            committer.after_durable(seq, lambda seq=seq: ack(seq))
        await asyncio.sleep(0)
    while len(acked) < reads * per_read:
        await asyncio.sleep(0)  # the commit thread reports on the loop
    return acked


def test_every_record_is_acknowledged_in_order_after_it_is_durable(tmp_path: Path) -> None:
    async def main() -> tuple[list[int], int]:
        committer = GroupCommitter(JournalWriter.open(tmp_path, NODE, fsync=True))
        commits = 0

        def on_commit() -> None:
            nonlocal commits
            commits += 1

        committer.on_commit = on_commit
        committer.start()
        acked = await _publish_in_reads(committer, reads=50, per_read=20)
        assert committer.durable_seq == committer.appended_seq == 1000
        assert committer.backlog == 0
        await committer.close()
        return acked, commits

    acked, commits = asyncio.run(main())
    assert acked == list(range(1, 1001))
    assert 1 <= commits <= 1000  # group commits: one report may cover many records
    batches = list(JournalReader(tmp_path / NODE).read(0, 1000))
    assert [p.as_py() for b in batches for p in b.column("payload")] == [
        b"%d" % i for i in range(1000)
    ]


def test_close_commits_what_was_appended_while_it_stopped(tmp_path: Path) -> None:
    async def main() -> int:
        committer = GroupCommitter(JournalWriter.open(tmp_path, NODE, fsync=False))
        committer.start()
        _append(committer, 0)
        closing = asyncio.ensure_future(committer.close())
        await asyncio.sleep(0)  # close() is waiting for the thread ...
        _append(committer, 1)  # ... when a closing connection logs one more record
        await closing
        assert committer.closed
        return committer.durable_seq

    assert asyncio.run(main()) == 2
    assert JournalReader(tmp_path / NODE).last_seq() == 2


def test_a_failed_commit_is_reported_and_nothing_after_it_is_acknowledged(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        writer = JournalWriter.open(tmp_path, NODE, fsync=False)
        committer = GroupCommitter(writer)
        committer.start()
        acked: list[int] = []
        seq = _append(committer, 0)
        committer.after_durable(seq, lambda: acked.append(seq))
        while not acked:
            await asyncio.sleep(0)

        def broken(frame: object) -> int:
            raise OSError(28, "No space left on device")

        writer.commit = broken  # type: ignore[method-assign]
        seq = _append(committer, 1)
        committer.after_durable(seq, lambda: acked.append(seq))
        with pytest.raises(OSError, match="No space left"):
            await committer.close()  # the failure is not hidden
        assert isinstance(committer.failure, OSError)
        assert acked == [1]  # seq 2 was never durable: never acknowledged

    asyncio.run(main())
