"""The per-node durable journal: every publish an edge accepts, in seq order, on local disk.

Theory of operation
-------------------
Each broker node owns one directory, ``{journal_root}/{node}/``. Records get a per-node ``seq``
that starts at 1 and grows by one with no gaps; ``(node, seq)`` is a record's identity all the
way into Delta.

The directory holds *segment* files named by the seq of their first record (``%020d.seg``), so
segment ``i`` covers ``[first_i, first_{i+1} - 1]`` and finding the segment for a seq is a
search over names. A segment is a 5-byte file header (``b"EBJ1"`` + format version) followed by
*frames*. A frame is one group commit::

    header (24 bytes, little-endian): b"EBFR" | u32 body length | u32 crc32(body)
                                      | u64 first_seq | u32 record count
    body: one Arrow IPC RecordBatch in JOURNAL_SCHEMA, serialized without its schema

Writing is split in three so the asyncio broker never waits for the disk:

* ``append()`` (event-loop thread) assigns the next seq and adds the record's fields to one
  flat Python list. Nothing is durable yet.
* ``drain()`` swaps the list out as a :class:`PendingFrame`: in the appending thread, or in
  another one that holds the same lock as every ``append`` (the broker's commit thread).
* ``commit(frame)`` (one worker thread, frames in drain order) encodes the batch, writes the
  whole frame with one ``os.write``, fdatasyncs, and only then advances ``durable_seq``. The
  broker acknowledges a QoS 1/2 publish once ``durable_seq`` reaches its seq. ``write``,
  ``sync`` and ``durable`` are its steps, for a committer that syncs asynchronously
  (broker_edge.durability: the event loop writes the frame into the page cache and Linux AIO
  syncs it; the loop learns it is done from an eventfd).

Spares. Appending to a file changes its size, and an fdatasync then writes the inode too: two
disk writes and a cache flush per sync. ``prepare_spare`` writes the next segment ahead (a file
header and ``segment_bytes`` + 1 MiB of zeros, synced, named ``spare.tmp``: not a segment
name, so readers, retention and recovery never see it); the next roll renames it into place and
frames are then written over the zeros in place (``pwrite``), so a sync writes the data alone
(here: 133 µs instead of 200). A plain segment is sealed early once a spare is ready. A sealed
spare is cut to its data, and so is the active one on ``close``; after a crash, recovery cuts
the zeros after the last frame (a frame half written over them is a torn tail). Readers never
scan the active segment past the ``DURABLE`` watermark: past it lie zeros, and perhaps a frame
being written.

``append``/``drain`` touch only the in-memory buffer and ``commit`` touches only the file, so the
two sides need no lock.

A crash can leave the newest segment with a *torn tail*: a partial frame, a complete last frame
whose CRC fails, or a zero-filled block the filesystem extended but never wrote. None of those
was ever durable (the writer had not returned from fsync), so :meth:`JournalWriter.open`
truncates them with a warning and the next record reuses the first lost seq. So are bytes after
the last frame that are neither a frame nor zeros (a frame written over a spare's zeros whose
first sector was lost and a later one not), unless the ``DURABLE`` watermark says a record
there was durable. Anything else bad that is *followed* by more bytes cannot be a torn write; it
is corruption and raises :class:`JournalCorruptError` with the file and byte offset. Nothing is
ever skipped silently.

Readers (the Spark source) open segments read-only and see only what is durable: after each
commit's fdatasync the writer records the durable seq in the node's ``DURABLE`` file (8 bytes
of seq and a CRC, rewritten in place), and :meth:`JournalReader.last_seq` never goes past it. A
frame written but not yet synced is invisible, so a machine crash in that window cannot make
the recovered journal reuse seqs a reader already consumed. The file itself needs no fsync: it
is written only after the data it names is durable, and a lost update only hides records until
the next commit (on open, the writer rewrites it from the recovered journal). With
``fsync=False`` nothing is durable across a machine crash, the watermark included. Everything a
reader returns is CRC-checked.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import functools
import itertools
import logging
import os
import re
import struct
import zlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import nanoarrow
import nanoarrow.ipc
from arro3.core import Array, DataType, Field, RecordBatch, Schema, list_array, struct_array

from ingest.ipcframe import Layout, int8s

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

# A decoded frame: a pyarrow batch (readers) or an arro3 one (the edge).
_B = TypeVar("_B", "pa.RecordBatch", RecordBatch, "_IpcFrame")

FILE_MAGIC = b"EBJ1"
FORMAT_VERSION = 1
FILE_HEADER = FILE_MAGIC + bytes([FORMAT_VERSION])
FRAME_MAGIC = b"EBFR"
# magic, body length, crc32(body), first_seq, record count
FRAME_HEADER = struct.Struct("<4sIIQI")
SEGMENT_SUFFIX = ".seg"
LOCK_FILE = "LOCK"
# The next segment written ahead (a header and zeros): not a segment's name, so readers,
# retention and recovery never take it for one.
SPARE_FILE = "spare.tmp"
# A spare is this much larger than segment_bytes: the frame that crosses segment_bytes stays
# inside its zeros unless it is larger.
SPARE_SLACK = 2**20
# What recovery calls the bytes after the last frame: zeros (a spare's unused part, or a block
# the filesystem extended but never wrote), or neither a frame nor zeros.
ZERO_TAIL = "zero-filled tail"
GARBAGE_TAIL = "unreadable bytes after the last frame"
DURABLE_FILE = "DURABLE"
# The DURABLE file: the durable seq and the CRC-32 of those 8 bytes.
_DURABLE = struct.Struct("<QI")

_SEGMENT_NAME = re.compile(r"^(\d{20})\.seg$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")


class JournalError(Exception):
    """Root of the journal's errors."""


class JournalWriteError(JournalError):
    """Writing or syncing a frame failed (ENOSPC, EIO, EFBIG...): nothing of it is durable.

    The writer is *failed* until :meth:`JournalWriter.recover` succeeds; ``errno`` is the
    operating system's error number.
    """

    def __init__(self, message: str, errno_: int | None) -> None:
        super().__init__(message)
        self.errno = errno_


class JournalGapError(JournalError):
    """A reader asked for records that retention (or a person) already removed."""

    def __init__(self, node_dir: Path, first: int, last: int, oldest: int) -> None:
        super().__init__(
            f"journal of node {node_dir.name!r}: seqs {first}..{last} were removed from "
            f"{node_dir} (its oldest segment starts at seq {oldest}); the reader's offset "
            "points before the journal's retention"
        )
        self.node = node_dir.name
        self.first = first
        self.last = last
        self.oldest = oldest


class JournalCorruptError(JournalError):
    """Bytes on disk that no crash of the writer can explain."""

    def __init__(self, path: Path, offset: int, reason: str) -> None:
        super().__init__(f"journal corrupt: {path} at byte offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


def segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}{SEGMENT_SUFFIX}"


def list_segments(node_dir: Path) -> list[tuple[int, Path]]:
    """(first_seq, path) of every segment in ``node_dir``, oldest first."""
    try:
        names = os.listdir(node_dir)
    except FileNotFoundError:
        return []
    found = [
        (int(m.group(1)), node_dir / name) for name in names if (m := _SEGMENT_NAME.match(name))
    ]
    return sorted(found)


def list_nodes(journal_root: Path) -> list[str]:
    """Names of the node directories under ``journal_root``, sorted."""
    try:
        entries = list(os.scandir(journal_root))
    except FileNotFoundError:
        return []
    return sorted(e.name for e in entries if e.is_dir() and _NODE_NAME.match(e.name))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileOps:
    """The writer's file layer: every call that can fail with a full or broken disk.

    The one seam where tests inject ``ENOSPC``/``EIO`` on write and on sync (subclass and
    override); the writer never calls these ``os`` functions any other way.
    """

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def write(self, fd: int, data: memoryview | bytes) -> int:
        return os.write(fd, data)

    def datasync(self, fd: int) -> None:
        _datasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def free_bytes(self, path: Path) -> int:
        """Bytes an unprivileged writer may still use on ``path``'s filesystem."""
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize


OS_FILES = FileOps()


# --- frame scanning, shared by writer recovery and the reader -----------------------------------


@dataclass(frozen=True, slots=True)
class _Frame:
    offset: int
    body_len: int
    crc: int
    first_seq: int
    count: int

    @property
    def end(self) -> int:
        return self.offset + FRAME_HEADER.size + self.body_len

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.count - 1


@dataclass(frozen=True, slots=True)
class _Tail:
    """Where a segment's readable frames stop and why (``torn`` is empty for a clean end)."""

    offset: int
    torn: str


def _read_file_header(f: BinaryIO, path: Path) -> bool:
    """True when the file header is complete and valid; False when it is torn (short file)."""
    f.seek(0)
    head = f.read(len(FILE_HEADER))
    if len(head) < len(FILE_HEADER):
        if FILE_HEADER.startswith(head):
            return False
        raise JournalCorruptError(path, 0, "bad segment file header")
    if head[:4] != FILE_MAGIC:
        raise JournalCorruptError(path, 0, f"bad segment magic {head[:4]!r}")
    if head[4] != FORMAT_VERSION:
        raise JournalCorruptError(path, 4, f"unsupported journal format version {head[4]}")
    return True


def _is_zero_tail(f: BinaryIO, offset: int, size: int) -> bool:
    f.seek(offset)
    while offset < size:
        chunk = f.read(min(1 << 20, size - offset))
        if not chunk or chunk.count(0) != len(chunk):
            return False
        offset += len(chunk)
    return True


def _scan_frames(
    f: BinaryIO,
    path: Path,
    first_seq: int,
    size: int,
    *,
    start: int = len(FILE_HEADER),
    stop_after: int | None = None,
    garbage_is_torn: bool = False,
) -> tuple[list[_Frame], _Tail]:
    """Walk frame headers by seeking (bodies are not read).

    Frames must continue the seq run from ``first_seq`` (the seq the frame at ``start`` must
    begin with). Returns the complete frames and where they stop: at the end of the file, at
    the first frame holding ``stop_after``, or at a torn tail (a stop that can only be a crash
    artifact). Anything else raises :class:`JournalCorruptError`.
    """
    frames: list[_Frame] = []
    offset, expected = start, first_seq
    while offset < size and (stop_after is None or expected <= stop_after):
        remaining = size - offset
        f.seek(offset)
        raw = f.read(min(remaining, FRAME_HEADER.size))
        if len(raw) < FRAME_HEADER.size:
            if FRAME_MAGIC.startswith(raw[:4]) or _is_zero_tail(f, offset, size):
                return frames, _Tail(offset, "incomplete frame header")
            raise JournalCorruptError(path, offset, "bad frame magic")
        magic, body_len, crc, frame_first, count = FRAME_HEADER.unpack(raw)
        if magic != FRAME_MAGIC:
            if _is_zero_tail(f, offset, size):
                return frames, _Tail(offset, ZERO_TAIL)
            if garbage_is_torn:  # recovery decides (_recover: the DURABLE watermark)
                return frames, _Tail(offset, GARBAGE_TAIL)
            raise JournalCorruptError(path, offset, f"bad frame magic {magic!r}")
        if frame_first != expected or count == 0:
            raise JournalCorruptError(
                path, offset, f"frame says seqs {frame_first}+{count}, expected seq {expected}"
            )
        frame = _Frame(offset, body_len, crc, frame_first, count)
        if frame.end > size:
            return frames, _Tail(offset, "incomplete frame body")
        frames.append(frame)
        offset, expected = frame.end, frame.last_seq + 1
    return frames, _Tail(offset, "")


def _check_crc(path: Path, frame: _Frame, body: bytes) -> None:
    if zlib.crc32(body) != frame.crc:
        raise JournalCorruptError(path, frame.offset, "frame body CRC mismatch")


def _check_seqs(path: Path, frame: _Frame, rows: int, first: object, last: object) -> None:
    if rows != frame.count or first != frame.first_seq or last != frame.last_seq:
        raise JournalCorruptError(path, frame.offset, "frame body disagrees with its header")


def _decode_body(path: Path, frame: _Frame, body: bytes) -> pa.RecordBatch:
    """A frame body as a pyarrow batch (readers: the Spark source, tests; never the edge)."""
    import pyarrow as pa  # here, not at the top: the edge must not import it (issue 9)

    from schemas.journal import JOURNAL_SCHEMA

    _check_crc(path, frame, body)
    try:
        batch = pa.ipc.read_record_batch(pa.py_buffer(body), JOURNAL_SCHEMA)
    except (pa.ArrowException, ValueError) as exc:
        raise JournalCorruptError(path, frame.offset, f"undecodable frame body: {exc}") from exc
    seqs = batch.column(1)
    _check_seqs(path, frame, batch.num_rows, seqs[0].as_py(), seqs[-1].as_py())
    return batch


def _decode_body_lean(path: Path, frame: _Frame, body: bytes) -> RecordBatch:
    """A frame body as an arro3 batch: what the edge reads (recovery, state replay)."""
    _check_crc(path, frame, body)
    try:
        stream = _schema_message() + body + _END_OF_STREAM
        batch = RecordBatch.from_arrow(nanoarrow.ArrayStream.from_readable(stream).read_all())
    except Exception as exc:  # nanoarrow and arro3 raise plain exceptions for bad input
        raise JournalCorruptError(path, frame.offset, f"undecodable frame body: {exc}") from exc
    rows = batch.num_rows
    seqs = batch.column(1)
    ends = seqs.slice(0, 1).to_pylist() + seqs.slice(rows - 1, 1).to_pylist() if rows else [0, 0]
    _check_seqs(path, frame, rows, ends[0], ends[-1])
    return batch


# --- writer --------------------------------------------------------------------------------------


# The fields of one appended record, in this order, as ``_RECORD_WIDTH`` consecutive items of
# one flat list: append() is a single list.extend on the event loop, and to_batch() gets each
# column back with a strided slice (``values[i::_RECORD_WIDTH]``), which copies pointers in C.
# (One list per column cost nine appends a record; one tuple per record, a zip(*records)
# transpose five times slower than the slices.)
_RECORD_FIELDS = (
    "ts_us", "tenant", "client_id", "topic", "qos", "retain", "payload", "content_type",
    "user_properties",
)  # fmt: skip
_RECORD_WIDTH = len(_RECORD_FIELDS)

# JOURNAL_SCHEMA (schemas/journal.py, pyarrow) as arro3 types: the edge builds frames with
# arro3.core and serializes them with nanoarrow, small Arrow libraries, so that it never imports
# pyarrow (issue 9: ~7 MiB resident against 54 for pyarrow and pandas).
# tests/unit/test_journal_lean.py checks that the two schemas are the same.
_UTF8 = DataType.utf8()
_USER_PROPERTY_FIELDS = [
    Field("key", _UTF8, nullable=False),
    Field("value", _UTF8, nullable=False),
]
_USER_PROPERTIES_TYPE = DataType.list(
    Field("item", DataType.struct(_USER_PROPERTY_FIELDS), nullable=True)
)
_TS_TYPE = DataType.timestamp("us", tz="UTC")
WRITER_SCHEMA = Schema(
    [
        Field("node", _UTF8, nullable=False),
        Field("seq", DataType.int64(), nullable=False),
        Field("ts", _TS_TYPE, nullable=False),
        Field("tenant", _UTF8, nullable=False),
        Field("client_id", _UTF8, nullable=False),
        Field("topic", _UTF8, nullable=False),
        Field("qos", DataType.int8(), nullable=False),
        Field("retain", DataType.bool(), nullable=False),
        Field("payload", DataType.binary(), nullable=False),
        Field("content_type", _UTF8, nullable=True),
        Field("user_properties", _USER_PROPERTIES_TYPE, nullable=True),
    ]
)


def _ipc_messages(batch: RecordBatch) -> tuple[bytes, bytes]:
    """(schema message, record batch message) of ``batch`` in the Arrow IPC stream format.

    A stream is the schema message, the batch messages and an end-of-stream marker; each
    message is ``0xFFFFFFFF``, an int32 metadata length, the metadata, then a body whose
    length the metadata gives (0 for a schema). A frame body is the batch message alone: what
    ``pyarrow.RecordBatch.serialize`` writes and ``pyarrow.ipc.read_record_batch`` reads.
    """
    out = BytesIO()
    # nanoarrow's IPC writer, not arro3.io's: the same bytes a reader needs (uncompressed,
    # 8-byte aligned, as pyarrow writes them) for ~4 MiB resident instead of ~9 (issue 9).
    # serialize_stream: the writer's one-call path (schema, batch, end of stream), ~10 us less
    # per frame than write_stream; the commit thread holds the GIL for it.
    nanoarrow.ipc.StreamWriter.from_writable(out).serialize_stream(batch)
    data = out.getvalue()
    if data[:4] != _CONTINUATION or not data.endswith(_END_OF_STREAM):
        raise JournalError("unexpected Arrow IPC stream layout from arro3")
    schema_end = 8 + int.from_bytes(data[4:8], "little")
    return data[:schema_end], data[schema_end : -len(_END_OF_STREAM)]


_CONTINUATION = b"\xff\xff\xff\xff"
_END_OF_STREAM = _CONTINUATION + b"\x00\x00\x00\x00"


@functools.cache
def _schema_message() -> bytes:
    """The IPC schema message of WRITER_SCHEMA: put before a frame body, it makes a stream."""
    one = PendingFrame("-", 1, 1, [0, "", "", "", 0, False, b"", None, ()])  # any record
    schema, _ = _ipc_messages(one.to_batch())
    return schema


@functools.cache
def _body_layout() -> Layout:
    """Where a frame body's numbers sit (ingest.ipcframe), read from one the writer made."""
    two = PendingFrame("-", 1, 2, [0, "", "", "", 0, False, b"", None, ()] * 2)  # any records
    return Layout.of(_ipc_messages(two.to_batch())[1])


@dataclass(frozen=True, slots=True)
class PendingFrame:
    """Drained, not yet durable records: seqs ``first_seq .. first_seq + count - 1``."""

    node: str
    first_seq: int
    count: int
    _values: list[Any] = field(repr=False)  # count records of _RECORD_WIDTH fields

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.count - 1

    def encode(self) -> bytearray:
        """Header + body of this frame, in one buffer. The usual frame, without content
        types or user properties, is written directly (ingest.ipcframe: the same bytes for a
        fraction of the GIL time); the others through Arrow."""
        body = _body_layout().message(self.node, self.first_seq, self._values, _RECORD_WIDTH)
        if body is None:
            body = _ipc_messages(self.to_batch())[1]
        return _frame_bytes(body, self.first_seq, self.count)

    def to_batch(self) -> RecordBatch:
        # This runs in the commit thread but holds the GIL while it reads Python objects:
        # integers go through array.array (packed in C), strings that are one value repeated
        # (node, usually tenant and client id) are built from that one value.
        n, values, width = self.count, self._values, _RECORD_WIDTH
        ts, tenant, client_id, topic, qos, retain, payload, content_type, user_properties = (
            values[i::width] for i in range(width)
        )
        first = self.first_seq
        arrays = [
            Array([self.node] * n, type=_UTF8),
            Array.from_buffer(array("q", range(first, first + n))),
            Array.from_buffer(array("q", ts)).cast(_TS_TYPE),
            Array(tenant, type=_UTF8),
            Array(client_id, type=_UTF8),
            Array(topic, type=_UTF8),
            Array.from_buffer(int8s(qos)),
            Array(retain, type=DataType.bool()),
            Array(payload, type=DataType.binary()),
            Array(content_type, type=_UTF8),
            _user_properties_column(user_properties),
        ]
        return RecordBatch.from_arrays(arrays, schema=WRITER_SCHEMA)


def _user_properties_column(values: list[tuple[tuple[str, str], ...]]) -> Array:
    # Built with its final type (no cast) and, in the usual case of no user properties at all,
    # from one shared empty entries array: ~30 us less per frame, GIL held.
    if values.count(()) == len(values):  # the usual case: an empty list per record
        offsets = array("i", bytes(4 * (len(values) + 1)))
        entries = _no_user_properties()
    else:
        offsets = array("i", [0])
        keys: list[str] = []
        props: list[str] = []
        for pairs in values:
            for key, value in pairs:
                keys.append(key)
                props.append(value)
            offsets.append(len(keys))
        entries = struct_array(
            [Array(keys, type=_UTF8), Array(props, type=_UTF8)], fields=_USER_PROPERTY_FIELDS
        )
    return list_array(Array.from_buffer(offsets), entries, type=_USER_PROPERTIES_TYPE)


@functools.cache
def _no_user_properties() -> Array:
    """The entries of a user_properties column in which no record has any (immutable)."""
    return struct_array(
        [Array([], type=_UTF8), Array([], type=_UTF8)], fields=_USER_PROPERTY_FIELDS
    )


class JournalWriter:
    """Appends records for one node. See the module docstring for the threading contract.

    Failures: a write or sync error makes :meth:`commit` raise :class:`JournalWriteError` and
    leaves the writer *failed*: nothing of that frame is durable, and the file's state past
    the last durable frame is unknown (a failed fsync may have dropped dirty pages, a short
    write left half a frame). The owner then drops the records it had buffered
    (:meth:`discard_buffered`: their seqs are given out again) and calls :meth:`recover`
    until it succeeds: it reopens the segment, cuts it back to the end of the last durable
    frame, removes any segment started after it, and syncs that state before the next frame.
    """

    def __init__(
        self,
        node_dir: Path,
        node: str,
        *,
        lock_fd: int,
        next_seq: int,
        segment: tuple[int, Path] | None,
        segment_bytes: int,
        fsync: bool,
        files: FileOps = OS_FILES,
    ) -> None:
        # Use JournalWriter.open(); this only wires up already-recovered state.
        self._dir = node_dir
        self._node = node
        self._lock_fd = lock_fd
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self._files = files
        self._next_seq = next_seq
        self._durable_seq = next_seq - 1
        self._values: list[Any] = []  # see _RECORD_FIELDS
        self._fd: int | None = None
        self._path: Path | None = None  # the segment _fd appends to
        self._size = 0  # where the active segment's data ends (the next frame goes there)
        self._alloc = 0  # the active segment's file size: past _size while it was a spare
        self._positional = False  # _fd writes at _size (a spare), not appends
        # A complete spare's size (0: none): set by prepare_spare, taken by _roll.
        self._spare_bytes = 0
        # Where the last durable frame ends: (segment, its size then). recover() cuts back here.
        self._durable_at: tuple[Path, int] | None = None
        self._failed: BaseException | None = None
        if segment is not None:
            _, path = segment
            self._fd = files.open(path, os.O_WRONLY | os.O_APPEND)
            self._path = path
            self._size = self._alloc = os.fstat(self._fd).st_size
            self._durable_at = (path, self._size)
        # Bytes of the node's segments: added by the committing side, removed by retention
        # (which may run in another thread), each counter written by one side only.
        self._bytes_added = sum(_file_size(p) for _, p in list_segments(node_dir))
        self._bytes_removed = 0
        self._durable_fd = files.open(node_dir / DURABLE_FILE, os.O_WRONLY | os.O_CREAT, 0o644)
        # What survived recovery is what is on disk: durable from here on.
        self._publish_durable()

    @classmethod
    def open(
        cls,
        journal_root: Path,
        node: str,
        *,
        segment_bytes: int = 64 * 2**20,
        fsync: bool = True,
        files: FileOps = OS_FILES,
    ) -> JournalWriter:
        if not _NODE_NAME.match(node):
            raise ValueError(f"invalid node name {node!r}: use letters, digits, '_', '-', '.'")
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        node_dir = Path(journal_root) / node
        created = not node_dir.exists()
        node_dir.mkdir(parents=True, exist_ok=True)
        if created:
            _fsync_dir(node_dir.parent)
        lock_fd = os.open(node_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock_fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise JournalError(f"journal {node_dir} is already open for writing") from exc
            raise
        try:
            (node_dir / SPARE_FILE).unlink(missing_ok=True)  # maybe incomplete: made again
            next_seq, segment = _recover(node_dir, fsync=fsync)
            return cls(
                node_dir,
                node,
                lock_fd=lock_fd,
                next_seq=next_seq,
                segment=segment,
                segment_bytes=segment_bytes,
                fsync=fsync,
                files=files,
            )
        except BaseException:
            os.close(lock_fd)
            raise

    @property
    def node(self) -> str:
        return self._node

    @property
    def node_dir(self) -> Path:
        return self._dir

    @property
    def next_seq(self) -> int:
        """The seq the next append() will get."""
        return self._next_seq

    @property
    def durable_seq(self) -> int:
        """Every seq up to and including this one is durable (0: none)."""
        return self._durable_seq

    @property
    def failed(self) -> BaseException | None:
        """The error that failed the writer, until :meth:`recover` succeeds."""
        return self._failed

    @property
    def fsync(self) -> bool:
        """Frames are synced before they count as durable."""
        return self._fsync

    @property
    def files(self) -> FileOps:
        """The file layer every write and sync goes through."""
        return self._files

    @property
    def segment_bytes(self) -> int:
        """The size at which a segment is sealed and the next one started."""
        return self._segment_bytes

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of every segment file of this node (the journal's share of the disk)."""
        return self._bytes_added - self._bytes_removed + self._spare_bytes

    def free_bytes(self) -> int:
        """Bytes still free for the journal on its filesystem."""
        return self._files.free_bytes(self._dir)

    def append(  # positional or by name: the edge appends positionally, once per publish
        self,
        ts_us: int,
        tenant: str,
        client_id: str,
        topic: str,
        qos: int,
        retain: bool,
        payload: bytes,
        content_type: str | None = None,
        user_properties: tuple[tuple[str, str], ...] = (),
    ) -> int:
        """Buffer one record in memory and return its seq. Not durable until committed."""
        # Reject here what would fail encoding later: one bad record must not sink a whole frame.
        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
        self._values.extend(
            (ts_us, tenant, client_id, topic, qos, retain, payload, content_type, user_properties)
        )  # the order of _RECORD_FIELDS
        seq = self._next_seq
        self._next_seq = seq + 1
        return seq

    def append_run(
        self,
        ts_us: int,
        tenant: str,
        client_id: str,
        topic: str,
        qos: int,
        payloads: list[bytes],
    ) -> int:
        """Buffer one record without RETAIN, content type or user properties per payload, all
        with the same time, tenant, client id, topic and QoS; return the first one's seq (the
        others follow it). What ``append`` does for each, in one call."""
        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
        count = len(payloads)
        self._values.extend(
            itertools.chain.from_iterable(
                zip(
                    itertools.repeat(ts_us, count),
                    itertools.repeat(tenant),
                    itertools.repeat(client_id),
                    itertools.repeat(topic),
                    itertools.repeat(qos),
                    itertools.repeat(False),
                    payloads,
                    itertools.repeat(None),
                    itertools.repeat(()),
                )
            )
        )  # the order of _RECORD_FIELDS
        seq = self._next_seq
        self._next_seq = seq + count
        return seq

    def drain(self) -> PendingFrame | None:
        """Take the buffered records out as one frame to commit (None when there are none)."""
        values = self._values
        count = len(values) // _RECORD_WIDTH
        if count == 0:
            return None
        self._values = []
        return PendingFrame(self._node, self._next_seq - count, count, values)

    def discard_buffered(self) -> int:
        """After a failed commit: drop every buffered record and give their seqs out again
        (the next append gets ``durable_seq + 1``). Returns how many records were dropped."""
        dropped = self._next_seq - 1 - self._durable_seq
        self._values = []
        self._next_seq = self._durable_seq + 1
        return dropped

    def commit(self, frame: PendingFrame) -> int:
        """Write ``frame`` durably; return the last seq now durable. Safe in a worker thread.

        Raises :class:`JournalWriteError` when the disk refuses it (see the class docstring).
        """
        self.write(frame)
        return self.sync(frame)

    # commit() in steps, for a committer that syncs without blocking (broker_edge.durability:
    # Linux AIO): write(frame), then an fdatasync of the returned descriptor, then durable(frame)
    # or sync_failed(frame, error). One frame at a time between write() and the end of its sync.

    @property
    def needs_roll(self) -> bool:
        """The next frame starts a new segment (it creates and syncs a file and its directory).

        Also when a spare is ready and the segment is a plain file that holds a frame: a plain
        segment (the first after start, or one rolled while no spare was ready) is sealed early
        rather than synced the slower way to its end."""
        if self._fd is None or self._size >= max(self._segment_bytes, len(FILE_HEADER) + 1):
            return True
        return bool(self._spare_bytes) and not self._positional and self._size > len(FILE_HEADER)

    @property
    def spare_bytes(self) -> int:
        """The size of the spare segment ready for the next roll (0: none)."""
        return self._spare_bytes

    def spare_size(self) -> int:
        """The size :meth:`prepare_spare` makes a spare."""
        return len(FILE_HEADER) + self._segment_bytes + SPARE_SLACK

    def prepare_spare(self) -> None:
        """Write the next segment ahead: a file header and zeros, synced (see "Spares" in the
        module docstring). Runs in a thread of its own (it writes ``segment_bytes`` to disk),
        never two at once; :meth:`_roll` takes the spare once it is complete. Raises
        ``OSError`` (the partial spare removed) when the disk refuses."""
        if self._spare_bytes:
            return
        path, size = self._dir / SPARE_FILE, self.spare_size()
        files = self._files
        fd = files.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = files.pwrite(fd, FILE_HEADER, 0)
            zeros = bytes(min(size, 1 << 20))
            while offset < size:
                offset += files.pwrite(fd, zeros[: size - offset], offset)
            files.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        finally:
            os.close(fd)
        self._spare_bytes = size

    def write(self, frame: PendingFrame) -> int:
        """Encode and write ``frame`` after the last one (not durable yet); return the file
        descriptor to sync. Raises :class:`JournalWriteError` when the disk refuses it."""
        if self._failed is not None:
            raise JournalWriteError(
                f"journal writer in {self._dir} failed earlier ({self._failed}); recover() first",
                getattr(self._failed, "errno", None),
            )
        if frame.first_seq != self._durable_seq + 1:
            raise JournalError(
                f"commit out of order: frame starts at seq {frame.first_seq}, "
                f"durable seq is {self._durable_seq}"
            )
        data = frame.encode()
        try:
            # Roll only a segment that holds a frame: an empty one is already named first_seq.
            if self.needs_roll:
                self._roll(frame.first_seq)
            assert self._fd is not None
            self._write_all(data)
        except OSError as exc:
            raise self.sync_failed(frame, exc) from exc
        end = self._size + len(data)
        self._bytes_added += max(0, end - self._alloc)  # past a spare's zeros, if at all
        self._size, self._alloc = end, max(self._alloc, end)
        return self._fd

    def sync(self, frame: PendingFrame) -> int:
        """fdatasync the frame :meth:`write` wrote, then :meth:`durable`."""
        assert self._fd is not None
        if self._fsync:
            try:
                # fdatasync: the data and the file size (what reading it back needs), not the
                # timestamps; the segment's name was made durable when it was created (_roll).
                self._files.datasync(self._fd)
            except OSError as exc:
                raise self.sync_failed(frame, exc) from exc
        return self.durable(frame)

    def durable(self, frame: PendingFrame) -> int:
        """The frame :meth:`write` wrote is synced: let readers see it; the durable seq."""
        try:
            self._publish_durable(frame.last_seq)
        except OSError as exc:
            raise self.sync_failed(frame, exc) from exc
        assert self._path is not None
        self._durable_seq = frame.last_seq
        self._durable_at = (self._path, self._size)
        return self._durable_seq

    def sync_failed(self, frame: PendingFrame, exc: OSError) -> JournalWriteError:
        """Writing or syncing ``frame`` failed with ``exc``: the writer is failed until
        :meth:`recover`; returns the error to raise."""
        self._fail(exc, frame)
        return JournalWriteError(f"journal write failed in {self._dir}: {exc}", exc.errno)

    def _fail(self, exc: OSError, frame: PendingFrame) -> None:
        # After a failed write or fsync the file state is unknown (and a failed fsync may
        # have dropped dirty pages): nothing of this frame counts, recover() cuts it away.
        self._failed = exc
        logger.error(
            "journal %s: frame of seqs %d..%d not written: %s",
            self._dir,
            frame.first_seq,
            frame.last_seq,
            exc,
        )

    def recover(self) -> None:
        """Make the files end at the last durable frame again; the writer is usable after.

        Raises ``OSError`` when the disk still refuses (the writer stays failed: call again).
        """
        if self._failed is None:
            return
        if self._fd is not None:
            fd, self._fd, self._path = self._fd, None, None
            with contextlib.suppress(OSError):
                os.close(fd)  # a close after a failed write may report the same error again
        # Segments started after the last durable frame hold nothing durable.
        for first, path in list_segments(self._dir):
            if first > self._durable_seq and (
                self._durable_at is None or path != self._durable_at[0]
            ):
                path.unlink()
                logger.warning(
                    "journal %s: removed %s (nothing in it was durable)", self._dir, path
                )
        _fsync_dir(self._dir)
        if self._durable_at is not None:
            path, durable_size = self._durable_at
            fd = self._files.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                before = os.fstat(fd).st_size
                if before != durable_size:
                    self._files.truncate(fd, durable_size)
                    logger.warning(
                        "journal %s: cut %d bytes after the last durable frame (seq %d)",
                        path,
                        before - durable_size,
                        self._durable_seq,
                    )
                if self._fsync:
                    self._files.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self._path, self._size = fd, path, durable_size
            self._alloc, self._positional = durable_size, False
        on_disk = sum(_file_size(p) for _, p in list_segments(self._dir))
        self._bytes_added = on_disk + self._bytes_removed
        self._publish_durable()
        self._failed = None
        logger.warning("journal %s: recovered at durable seq %d", self._dir, self._durable_seq)

    def remove_committed(
        self, committed_seq: int, min_age: float, now: float, count: int | None = None
    ) -> list[Path]:
        """Retention: delete the oldest sealed segments (at most ``count``) whose every record
        is at most ``committed_seq`` and whose last write is at least ``min_age`` seconds before
        ``now`` (wall clock). Never the segment being written, never a record past
        ``committed_seq`` or past the durable seq. Returns the removed paths, oldest first.
        """
        committed = min(committed_seq, self._durable_seq)
        segments = list_segments(self._dir)
        removed: list[Path] = []
        for (_, path), (next_first, _) in itertools.pairwise(segments):
            if path == self._path or next_first - 1 > committed or len(removed) == count:
                break  # the rest are newer: not committed yet either
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if now - st.st_mtime < min_age:
                break
            path.unlink()
            self._bytes_removed += st.st_size
            removed.append(path)
        if removed:
            _fsync_dir(self._dir)
        return removed

    def _publish_durable(self, durable_seq: int | None = None) -> None:
        """Let readers see every seq up to ``durable_seq`` (see the module docstring)."""
        durable = self._durable_seq if durable_seq is None else durable_seq
        seq = durable.to_bytes(8, "little")
        self._files.pwrite(self._durable_fd, _DURABLE.pack(durable, zlib.crc32(seq)), 0)

    def flush(self) -> int:
        """drain() + commit() in the calling thread; returns the durable seq."""
        frame = self.drain()
        if frame is not None:
            self.commit(frame)
        return self._durable_seq

    def close(self) -> None:
        """Close the files. Records appended but not committed are dropped."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if self._alloc > self._size and self._failed is None:
                    self._files.truncate(self._fd, self._size)  # readers see a file of frames
                os.close(self._fd)
            self._fd = None
        if self._spare_bytes:
            with contextlib.suppress(OSError):  # it is made again after the next open
                (self._dir / SPARE_FILE).unlink()
            self._spare_bytes = 0
        if self._durable_fd >= 0:
            os.close(self._durable_fd)
            self._durable_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write_all(self, data: bytearray) -> None:
        assert self._fd is not None
        view = memoryview(data)
        # One write per frame; the loop only runs again on a short write (e.g. disk full).
        offset = self._size
        while view:
            if self._positional:  # a spare: the frame goes over its zeros
                written = self._files.pwrite(self._fd, view, offset)
            else:
                written = self._files.write(self._fd, view)
            view = view[written:]
            offset += written

    def _roll(self, first_seq: int) -> None:
        if self._fd is not None:
            if self._alloc > self._size:  # a spare's unused zeros: the sealed file is its data
                self._files.truncate(self._fd, self._size)
                if self._fsync:
                    self._files.datasync(self._fd)
                self._bytes_added -= self._alloc - self._size
                self._alloc = self._size
            os.close(self._fd)
            self._fd = None
        path = self._dir / segment_name(first_seq)
        spare = self._spare_bytes
        if spare and not path.exists():
            # The spare becomes the segment: its name is the only thing left to make durable.
            # Renamed before _spare_bytes says there is none: from then on a new spare may be
            # started (in another thread), and it must not open this file as spare.tmp.
            os.rename(self._dir / SPARE_FILE, path)
            self._spare_bytes = 0
            self._fd = self._files.open(path, os.O_WRONLY)
            self._path, self._size, self._alloc, self._positional = (
                path, len(FILE_HEADER), spare, True
            )  # fmt: skip
            self._bytes_added += spare
            if self._fsync:
                _fsync_dir(self._dir)
            return
        fd = self._files.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._fd, self._path, self._size = fd, path, 0
        if self._files.write(fd, FILE_HEADER) != len(FILE_HEADER):
            raise OSError(errno.ENOSPC, "short write of a segment header")
        self._size = len(FILE_HEADER)
        self._bytes_added += len(FILE_HEADER)
        self._alloc, self._positional = self._size, False
        if self._fsync:
            self._files.fsync(fd)
            _fsync_dir(self._dir)


def _file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


_datasync = getattr(os, "fdatasync", os.fsync)  # fdatasync is POSIX, not on macOS


def _frame_bytes(body: bytes, first_seq: int, count: int) -> bytearray:
    """Header + body of one frame, in one buffer so it goes out in one write."""
    data = bytearray(FRAME_HEADER.size + len(body))
    FRAME_HEADER.pack_into(data, 0, FRAME_MAGIC, len(body), zlib.crc32(body), first_seq, count)
    data[FRAME_HEADER.size :] = body
    return data


def _recover(node_dir: Path, *, fsync: bool) -> tuple[int, tuple[int, Path] | None]:
    """Check the newest segment, cut a torn tail; return (next_seq, newest segment or None)."""
    segments = list_segments(node_dir)
    if not segments:
        return 1, None
    first_seq, path = segments[-1]
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        if not _read_file_header(f, path):
            logger.warning("journal %s: torn segment header, rewriting it", path)
            _truncate(f, 0, fsync=fsync)
            f.write(FILE_HEADER)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            return first_seq, segments[-1]
        frames, tail = _scan_frames(f, path, first_seq, size, garbage_is_torn=True)
        next_seq = first_seq
        for i, frame in enumerate(frames):
            f.seek(frame.offset + FRAME_HEADER.size)
            body = f.read(frame.body_len)
            try:
                _decode_body_lean(path, frame, body)
            except JournalCorruptError:
                if i != len(frames) - 1 or (tail.torn and not _is_zero_tail(f, frame.end, size)):
                    raise  # more bytes follow the bad frame: not a torn write
                tail = _Tail(frame.offset, "last frame fails its CRC")
                break
            next_seq = frame.last_seq + 1
        if tail.torn == GARBAGE_TAIL:
            _check_garbage_never_durable(node_dir, path, tail, next_seq, fsync=fsync)
        if tail.torn:
            _check_no_later_frame(f, path, tail, size)
            # Zeros after the last frame are a spare's unused part (the writer stopped without
            # closing): expected, not a torn write.
            log = logger.info if tail.torn == ZERO_TAIL else logger.warning
            log(
                "journal %s: %s at byte offset %d, truncating %d bytes (never durable)",
                path,
                tail.torn,
                tail.offset,
                size - tail.offset,
            )
            _truncate(f, tail.offset, fsync=fsync)
    return next_seq, segments[-1]


def _check_garbage_never_durable(
    node_dir: Path, path: Path, tail: _Tail, next_seq: int, *, fsync: bool
) -> None:
    """Bytes after the last frame that are neither a frame nor zeros: a write torn across
    sectors (over a spare's zeros, the frame's first sector lost and a later one written) when
    nothing there was ever durable, else damage. The ``DURABLE`` watermark tells: it is written
    only after a sync, so it never names a seq that was not durable (a lost update only makes
    it lower). Without fsync nothing was durable across a crash: always torn."""
    durable = read_durable_seq(node_dir) if fsync else None
    if durable is not None and durable >= next_seq:
        raise JournalCorruptError(
            path,
            tail.offset,
            f"bad frame magic where seq {next_seq} should start; seqs up to {durable} were durable",
        )


def _check_no_later_frame(f: BinaryIO, path: Path, tail: _Tail, size: int) -> None:
    """A torn write is the end of the file. If a later frame header shows up past the cut
    (the header of the "torn" frame had a corrupt length), truncating would lose durable data.
    """
    f.seek(tail.offset)
    raw = f.read(FRAME_HEADER.size)
    if len(raw) < FRAME_HEADER.size or raw[:4] != FRAME_MAGIC:
        return
    _, _, _, first, count = FRAME_HEADER.unpack(raw)
    rest = f.read(size - tail.offset - FRAME_HEADER.size)
    later = struct.pack("<Q", first + count)
    pos = rest.find(FRAME_MAGIC)
    while pos >= 0:
        if rest[pos + 12 : pos + 20] == later:
            raise JournalCorruptError(
                path, tail.offset, "frame length runs past a later frame (corrupt header)"
            )
        pos = rest.find(FRAME_MAGIC, pos + 1)


def _truncate(f: BinaryIO, offset: int, *, fsync: bool) -> None:
    f.truncate(offset)
    f.seek(offset)
    if fsync:
        os.fsync(f.fileno())


# --- reader --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _SegmentIndex:
    frames: list[_Frame]
    complete: bool  # a closed segment scanned to its end: never changes again


def read_durable_seq(node_dir: Path) -> int | None:
    """The durable seq the node's writer last recorded, or None without a ``DURABLE`` file.

    Raises :class:`JournalCorruptError` when the file does not hold a seq and its CRC (a
    torn 12-byte in-place write is not possible on one page; a bad file is damage).
    """
    path = Path(node_dir) / DURABLE_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) == 0:
        return None  # created, not yet written: the writer is opening
    if len(data) != _DURABLE.size:
        raise JournalCorruptError(path, 0, f"{len(data)} bytes, expected {_DURABLE.size}")
    seq, crc = _DURABLE.unpack(data)
    if zlib.crc32(seq.to_bytes(8, "little")) != crc:
        raise JournalCorruptError(path, 0, "durable seq fails its CRC")
    return int(seq)


class JournalReader:
    """Reads one node's journal by seq range. Safe to use while a writer appends."""

    def __init__(self, node_dir: Path) -> None:
        self._dir = Path(node_dir)
        self._index: dict[Path, _SegmentIndex] = {}

    @property
    def node_dir(self) -> Path:
        return self._dir

    @staticmethod
    def list_nodes(journal_root: Path) -> list[str]:
        """Same as the module-level :func:`list_nodes`."""
        return list_nodes(journal_root)

    def last_seq(self) -> int:
        """The newest durable seq (0 when there is none). Reads frame headers only.

        Never past the writer's ``DURABLE`` watermark (see the module docstring); a journal
        without one (written before it existed) is read to its last complete frame.
        """
        durable = read_durable_seq(self._dir)
        segments = self._segments()
        if not segments:
            return 0
        # Every older segment ends right before the next one starts (seqs have no gaps), so
        # only the newest one is scanned, incrementally from where the last call stopped.
        first_seq, path = segments[-1]
        # Scanned only up to the watermark: past it, a frame may be half written, and a
        # spare's zeros (megabytes of them) follow the last frame.
        frames = self._frames(first_seq, path, closed=False, upto=durable)
        written = frames[-1].last_seq if frames else first_seq - 1
        return written if durable is None else min(written, durable)

    def first_seq(self) -> int | None:
        """The seq of the oldest record still in the journal (None: no segment yet)."""
        segments = list_segments(self._dir)
        return segments[0][0] if segments else None

    def check_available(self, after_seq: int) -> None:
        """Raise :class:`JournalGapError` when records after ``after_seq`` were removed: a
        reader at that offset would otherwise have to skip them."""
        oldest = self.first_seq()
        if oldest is not None and after_seq + 1 < oldest:
            raise JournalGapError(self._dir, after_seq + 1, oldest - 1, oldest)

    def read(self, after_seq: int, upto_seq: int) -> Iterator[pa.RecordBatch]:
        """Yield exactly the records with ``after_seq < seq <= upto_seq``, CRC-checked.

        Raises :class:`JournalError` when part of the range is not in the journal (not written
        yet, or removed) and :class:`JournalCorruptError` on a bad frame inside the range.
        """
        return self._read(after_seq, upto_seq, _decode_body)

    def read_records(self, after_seq: int, upto_seq: int) -> Iterator[dict[str, Any]]:
        """The same records as :meth:`read`, one dict per record, decoded without pyarrow
        (the edge replays its state from these); ``ts`` is microseconds since the epoch."""
        for batch in self._read(after_seq, upto_seq, _decode_body_lean):
            yield from _batch_rows(batch)

    def read_ipc(self, after_seq: int, upto_seq: int) -> Iterator[bytes]:
        """The same records as :meth:`read` as the pieces of one Arrow IPC stream (schema
        message, one record batch message per frame, end-of-stream), without pyarrow: what the
        edge serves over HTTP. A whole frame goes out as its body is on disk (CRC-checked); a
        frame cut by the range is decoded and its part encoded again.

        Errors as :meth:`read`, raised while iterating: check the range first
        (:meth:`last_seq`, :meth:`check_available`) to answer before the first piece.
        """
        yield _schema_message()
        for frame in self._read(after_seq, upto_seq, _IpcFrame.checked):
            yield frame.message
        yield _END_OF_STREAM

    def _read(
        self, after_seq: int, upto_seq: int, decode: Callable[[Path, _Frame, bytes], _B]
    ) -> Iterator[_B]:
        if upto_seq <= after_seq:
            return
        wanted = after_seq + 1
        segments = self._segments()
        firsts = [first for first, _ in segments]
        # The segment holding `wanted` is the last one starting at or before it.
        index = bisect.bisect_right(firsts, wanted) - 1
        if index < 0 and firsts:
            raise JournalGapError(self._dir, wanted, firsts[0] - 1, firsts[0])
        if index < 0:
            raise JournalError(f"{self._dir}: seqs {wanted}..{upto_seq} are not in the journal")
        for i in range(index, len(segments)):
            first_seq, path = segments[i]
            try:
                frames = self._frames(first_seq, path, closed=i < len(segments) - 1, upto=upto_seq)
                for batch in _read_frames(path, frames, wanted, upto_seq, decode):
                    wanted += batch.num_rows
                    yield batch
            except FileNotFoundError:
                # Retention removed the segment since it was listed: those seqs are gone.
                oldest = self.first_seq() or first_seq
                raise JournalGapError(self._dir, wanted, max(wanted, oldest - 1), oldest) from None
            if wanted > upto_seq:
                return
        raise JournalError(f"{self._dir}: seqs {wanted}..{upto_seq} are not in the journal (yet)")

    def _segments(self) -> list[tuple[int, Path]]:
        """The segments now, and the frame index of those retention removed forgotten: a
        reader that lives as long as the pipeline would otherwise keep every segment's frame
        headers it ever scanned (issue 9's soak: megabytes a minute at 10,000 records/s)."""
        segments = list_segments(self._dir)
        kept = {path for _, path in segments}
        for path in [p for p in self._index if p not in kept]:
            del self._index[path]
        return segments

    def _frames(
        self, first_seq: int, path: Path, *, closed: bool, upto: int | None
    ) -> list[_Frame]:
        """Frame headers of one segment, at least up to the frame holding ``upto``."""
        cached = self._index.get(path)
        if cached is not None and cached.complete:
            return cached.frames
        frames = cached.frames if cached is not None else []
        if frames and upto is not None and frames[-1].last_seq >= upto:
            return frames
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if frames and not _still_there(f, frames[-1], size):
                frames = []  # the writer recovered and cut this tail since we looked: rescan
            if not frames and not _read_file_header(f, path):
                return []
            new, tail = _scan_frames(
                f,
                path,
                frames[-1].last_seq + 1 if frames else first_seq,
                size,
                start=frames[-1].end if frames else len(FILE_HEADER),
                stop_after=upto,
            )
        if closed and tail.torn:
            raise JournalCorruptError(path, tail.offset, f"{tail.torn} in a closed segment")
        frames = frames + new
        complete = closed and tail.offset == size
        self._index[path] = _SegmentIndex(frames, complete)
        return frames


def _batch_rows(batch: RecordBatch) -> Iterator[dict[str, Any]]:
    columns = {
        name: batch.column(i).to_pylist()
        for i, name in enumerate(WRITER_SCHEMA.names)
        if name != "ts"
    }
    columns["ts"] = batch.column(2).cast(DataType.int64()).to_pylist()
    names = list(columns)
    for row in zip(*columns.values(), strict=True):
        yield dict(zip(names, row, strict=True))


@dataclass(frozen=True, slots=True)
class _IpcFrame:
    """A frame body as an IPC record batch message, sliced without decoding where it can be."""

    path: Path
    frame: _Frame
    message: bytes
    num_rows: int

    @classmethod
    def checked(cls, path: Path, frame: _Frame, body: bytes) -> _IpcFrame:
        _check_crc(path, frame, body)
        return cls(path, frame, body, frame.count)

    def slice(self, offset: int, length: int) -> _IpcFrame:
        """Rows ``offset .. offset + length - 1`` as a message of their own: nanoarrow cannot
        write a sliced array (it refuses a nonzero offset), so they are built again as the
        writer builds a frame."""
        batch = _decode_body_lean(self.path, self.frame, self.message).slice(offset, length)
        values: list[Any] = []
        for row in _batch_rows(batch):
            pairs = tuple((p["key"], p["value"]) for p in row["user_properties"] or ())
            values.append(row["ts"])
            values.extend(row[name] for name in _RECORD_FIELDS[1:-1])
            values.append(pairs)
        first = self.frame.first_seq + offset
        pending = PendingFrame(self.path.parent.name, first, length, values)  # dir = node
        return _IpcFrame(self.path, self.frame, _ipc_messages(pending.to_batch())[1], length)


def _still_there(f: BinaryIO, frame: _Frame, size: int) -> bool:
    if frame.end > size:
        return False
    f.seek(frame.offset)
    raw = f.read(FRAME_HEADER.size)
    return raw == FRAME_HEADER.pack(
        FRAME_MAGIC, frame.body_len, frame.crc, frame.first_seq, frame.count
    )


def _read_frames(
    path: Path,
    frames: list[_Frame],
    wanted: int,
    upto_seq: int,
    decode: Callable[[Path, _Frame, bytes], _B],
) -> Iterator[_B]:
    """Decode the frames overlapping ``[wanted, upto_seq]`` and slice them to the range."""
    starts = [frame.first_seq for frame in frames]
    i = max(bisect.bisect_right(starts, wanted) - 1, 0)
    with open(path, "rb") as f:
        for frame in frames[i:]:
            if frame.first_seq > upto_seq:
                return
            if frame.last_seq < wanted:
                continue
            f.seek(frame.offset + FRAME_HEADER.size)
            batch = decode(path, frame, f.read(frame.body_len))
            lo = wanted - frame.first_seq
            hi = min(upto_seq, frame.last_seq) - frame.first_seq + 1
            yield batch if (lo, hi) == (0, frame.count) else batch.slice(lo, hi - lo)
            wanted = frame.first_seq + hi
