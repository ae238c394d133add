"""The session log: records come back in order, across generations; a torn tail ends it, a
corrupt record in the middle is an error naming the file and byte offset."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker_edge import sessionlog
from broker_edge.sessionlog import SessionLog, SessionLogError


def test_records_come_back_in_order_across_generations(tmp_path: Path) -> None:
    log = SessionLog(tmp_path, fsync=False)
    log.append({"op": "open", "seq": 1})
    log.sync()
    second = log.rotate()
    log.append({"op": "sub", "seq": 2})
    log.close()
    assert [r["seq"] for r in sessionlog.read(tmp_path, 0)] == [1, 2]
    assert [r["seq"] for r in sessionlog.read(tmp_path, second)] == [2]
    SessionLog(tmp_path, fsync=False).forget_before(second)
    assert sessionlog.generations(tmp_path)[0] == second


def test_a_restarted_log_writes_a_new_generation(tmp_path: Path) -> None:
    SessionLog(tmp_path, fsync=False).close()
    again = SessionLog(tmp_path, fsync=False)
    assert again.generation == 2
    again.close()


def test_a_torn_last_line_ends_the_log(tmp_path: Path) -> None:
    log = SessionLog(tmp_path, fsync=False)
    log.append({"op": "open", "seq": 1})
    log.close()
    path = sessionlog.path_of(tmp_path, 1)
    path.write_bytes(path.read_bytes() + b'{"op": "sub", "se')
    assert [r["op"] for r in sessionlog.read(tmp_path, 0)] == ["open"]


def test_a_corrupt_record_names_the_file_and_offset(tmp_path: Path) -> None:
    path = sessionlog.path_of(tmp_path, 1)
    path.write_bytes(b'{"op": "open"}\nnot json\n{"op": "drop"}\n')
    with pytest.raises(
        SessionLogError, match=r"sessions\.00000001\.log: corrupt record at byte 15"
    ):
        list(sessionlog.read(tmp_path, 0))


def test_changes_before_a_journal_cut_back_are_read_as_made_after_its_durable_record() -> None:
    # Journal records 3-6 were dropped by a failed frame and their seqs given out again: the
    # changes logged at seq 5 and 6 were made after record 2, before the new records 3-6.
    logged = [
        {"op": "open", "seq": 1},
        {"op": "sub", "seq": 5},
        {"op": "unsub", "seq": 6},
        {"op": sessionlog.CUT, "seq": 2},
        {"op": "sub", "seq": 4},
        {"op": sessionlog.CUT, "seq": 4},  # nothing after 4 yet: nothing moves
    ]
    changes = sessionlog.cut_back(iter(logged))
    assert [(c["op"], c["seq"]) for c in changes] == [
        ("open", 1),
        ("sub", 2),
        ("unsub", 2),
        ("sub", 4),
    ]
