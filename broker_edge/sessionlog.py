"""The session log: every change to a persistent session, durable before it is confirmed.

Theory of operation
-------------------
Snapshots (:mod:`broker_edge.store`) are written at most once a second, so on their own a
session confirmed just before a crash is lost. This log closes that gap: each change to a
persistent session (opened with its expiry, subscribed, unsubscribed, dropped) is appended as
one JSON line, and the broker holds back the connection's output (its CONNACK or SUBACK) until
the log is synced; one sync covers every change of a loop iteration.

The mesh's origin side logs here too: a peer's change of filters (``{"op": "peer"}``), so an
edge killed before its next snapshot still knows what its peers want (broker_edge.mesh).

Each record carries ``seq``, the last journal seq appended when the change was made, so the
restore can interleave the log with the journal replay: a record with seq ``s`` is applied
before journal record ``s + 1``. A message published before a subscription is thus never queued
for it, and one published after it always is.

A journal whose frame failed drops its records after the last durable one and gives their seqs
out again (``broker_edge.durability``). It then logs ``{"op": "cut", "seq": d}``: the changes
logged before with a seq above ``d`` were made after record ``d`` and before any record that now
has their seq, so the restore reads them as made after ``d`` (:func:`cut_back`).

Files are ``sessions.{generation}.log`` in the node's state directory. A snapshot starts a new
generation when it captures the state and names it; once the snapshot is durable the older
generations are deleted. The restore applies every generation from the snapshot's on. A line
without its newline (torn by a crash) ends the log; any other line that cannot be read is an
error naming the file and byte offset, never skipped. A restarted node writes a new generation,
never after a torn tail.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from broker_edge.errors import EdgeError
from broker_edge.store import fsync_directory

_NAME = re.compile(r"sessions\.(\d{8})\.log")


class SessionLogError(EdgeError):
    """The session log cannot be read or written; the message names the file."""


def generations(directory: Path) -> list[int]:
    """Generations present in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = (_NAME.fullmatch(name) for name in names)
    return sorted(int(m.group(1)) for m in found if m is not None)


def path_of(directory: Path, generation: int) -> Path:
    return directory / f"sessions.{generation:08d}.log"


def read(directory: Path, since: int) -> Iterator[dict[str, Any]]:
    """Every record of generations ``since`` and later, in the order written."""
    for generation in generations(directory):
        if generation < since:
            continue
        path = path_of(directory, generation)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SessionLogError(f"{path}: cannot read session log: {exc}") from exc
        pos = 0
        while pos < len(data):
            end = data.find(b"\n", pos)
            if end < 0:
                break  # a torn last line: the change was never confirmed
            try:
                record = json.loads(data[pos:end])
            except ValueError as exc:
                raise SessionLogError(f"{path}: corrupt record at byte {pos}: {exc}") from exc
            if not isinstance(record, dict):
                raise SessionLogError(f"{path}: corrupt record at byte {pos}: not an object")
            yield record
            pos = end + 1


CUT = "cut"  # the op of a journal cut-back record (no session: never applied itself)
# The op of a mesh peer's change of filters (broker_edge.mesh: "Restarts"): ``n`` the peer's
# node, ``i`` its INTEREST frame's document; applied to the mesh's routes, not to a session.
PEER = "peer"


def cut_back(records: Iterator[dict[str, Any]]) -> list[dict[str, Any]]:
    """The session changes of ``records`` in order, each ``seq`` lowered to the durable seq of
    a journal cut-back logged after it (see the module docstring); the cut records removed."""
    changes: list[dict[str, Any]] = []
    for record in records:
        if record["op"] != CUT:
            changes.append(record)
            continue
        durable = record["seq"]
        # Seqs never decrease along the log once cut back: only the tail can be above it.
        for change in reversed(changes):
            if change["seq"] <= durable:
                break
            change["seq"] = durable
    return changes


class SessionLog:
    """Appends records to the current generation; ``sync`` makes them durable."""

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        self.directory = directory
        self.fsync = fsync
        directory.mkdir(parents=True, exist_ok=True)
        present = generations(directory)
        self.generation = (present[-1] + 1) if present else 1
        self._fd = self._open(self.generation)
        self._buffer: list[bytes] = []

    @property
    def pending(self) -> bool:
        return bool(self._buffer)

    def append(self, record: dict[str, Any]) -> None:
        self._buffer.append(json.dumps(record, separators=(",", ":")).encode() + b"\n")

    def sync(self) -> None:
        """Write what was appended and (with ``fsync``) make it durable."""
        if not self._buffer:
            return
        data = b"".join(self._buffer)
        self._buffer.clear()
        path = path_of(self.directory, self.generation)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            if self.fsync:
                os.fdatasync(self._fd)
        except OSError as exc:
            raise SessionLogError(f"{path}: cannot write session log: {exc}") from exc

    def rotate(self) -> int:
        """Sync, then start the next generation; returns it. A snapshot that captured the state
        at this moment names it: the records before it are in the snapshot."""
        self.sync()
        os.close(self._fd)
        self.generation += 1
        self._fd = self._open(self.generation)
        return self.generation

    def forget_before(self, generation: int) -> None:
        """Delete generations older than ``generation`` (a durable snapshot holds them)."""
        for old in generations(self.directory):
            if old < generation:
                path_of(self.directory, old).unlink(missing_ok=True)

    def close(self) -> None:
        self.sync()
        os.close(self._fd)

    def _open(self, generation: int) -> int:
        path = path_of(self.directory, generation)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            if self.fsync:  # the new name must survive a crash too
                fsync_directory(self.directory)
        except OSError as exc:
            raise SessionLogError(f"{path}: cannot open session log: {exc}") from exc
        return fd
