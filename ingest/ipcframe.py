"""A journal frame's Arrow IPC record batch message, written without an Arrow library for the
usual frame: no record with a content type or user properties.

Theory of operation
-------------------
The edge's commit thread encodes one frame per group commit, and every Python object it reads
holds the GIL, which the event loop needs too. Built with arro3 and nanoarrow, a frame costs
~200 us of GIL time however few its records (eleven arrays, a record batch and an IPC writer,
each with a fixed cost); a QoS 1 load commits thousands of small frames a second, so the loop
waited on that GIL for a quarter of its time.

The message is ``0xFFFFFFFF``, the metadata's length, the metadata (a flatbuffer ``Message``
holding a ``RecordBatch``), then the body: every buffer of every column in schema order, each
padded to 8 bytes. For one schema the flatbuffer's layout depends only on how many field nodes
and buffers it lists, never on their values: the record count, each node's length and null
count, each buffer's offset and length and the body length sit at fixed places. :class:`Layout`
finds those places once, in a message the Arrow writer made, and :meth:`Layout.message` copies
that metadata, writes the frame's numbers into it and appends the frame's buffers as the writer
lays them out. The result is the writer's message byte for byte (tests/unit/test_journal_ipc.py
compares them), so readers see no difference. Frames with content types or user properties
take the Arrow path (``Layout.message`` returns None).
"""

from __future__ import annotations

import itertools
import struct
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# A record batch message holds one FieldNode (length, null count) per column and child, and
# one Buffer (offset, length) per buffer: both are two little-endian int64 in the flatbuffer.
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")
_I64 = struct.Struct("<q")
_CONTINUATION = b"\xff\xff\xff\xff"
_PAD = bytes(8)

# The journal schema's field nodes in order (ingest.journal.WRITER_SCHEMA): nine columns taken
# from the records, content_type (all null here), user_properties and its struct, key and value
# children (all empty here).
NODES = 14
BUFFERS = 35


class LayoutError(ValueError):
    """The Arrow writer's message is not shaped as this module expects."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a record batch message's numbers sit in its metadata (see the module docstring)."""

    metadata: bytes  # the template's flatbuffer, padding included
    length_at: int  # RecordBatch.length
    nodes_at: int  # the first FieldNode
    buffers_at: int  # the first Buffer
    body_length_at: int  # Message.bodyLength
    children: tuple[int, ...]  # the lengths of user_properties' struct, key and value buffers

    @classmethod
    def of(cls, message: bytes) -> Layout:
        """Read the layout of ``message``, a record batch message of the journal schema."""
        if message[:4] != _CONTINUATION:
            raise LayoutError("not an encapsulated IPC message")
        size = _I32.unpack_from(message, 4)[0]
        meta = bytes(message[8 : 8 + size])
        root = _U32.unpack_from(meta, 0)[0]
        msg_fields = _table_fields(meta, root)
        header = _field_at(msg_fields, 2, "Message.header")
        header += _U32.unpack_from(meta, header)[0]
        batch_fields = _table_fields(meta, header)
        nodes = _vector(meta, _field_at(batch_fields, 1, "RecordBatch.nodes"), NODES)
        buffers = _vector(meta, _field_at(batch_fields, 2, "RecordBatch.buffers"), BUFFERS)
        # The struct, key and value children of an all-empty user_properties column: their
        # buffers are the same in every frame (validity, offsets and data of zero items).
        children = tuple(_I64.unpack_from(meta, buffers + 16 * i + 8)[0] for i in range(28, 35))
        return cls(
            meta,
            _field_at(batch_fields, 0, "RecordBatch.length"),
            nodes,
            buffers,
            _field_at(msg_fields, 3, "Message.bodyLength"),
            children,
        )

    def message(self, node: str, first_seq: int, values: list[Any], width: int) -> bytes | None:
        """The record batch message of ``values`` (records of ``width`` fields, the writer's
        flat list), or None when a record has a content type or user properties."""
        if sys.byteorder != "little":
            return None
        n = len(values) // width
        ts, tenant, client_id, topic, qos, retain, payload, content_type, props = (
            values[i::width] for i in range(width)
        )
        if content_type.count(None) != n or props.count(()) != n:
            return None
        bitmap = (n + 7) // 8
        no_offsets = bytes(4 * (n + 1))
        body: list[bytes] = []
        spans = array("q")
        at = 0

        def put(*buffers: bytes) -> None:
            nonlocal at
            for data in buffers:
                size = len(data)
                spans.append(at)
                spans.append(size)
                if size:
                    body.append(data)
                    pad = -size % 8
                    if pad:
                        body.append(_PAD[:pad])
                    at += size + pad

        put(b"", *_strings([node] * n))
        put(b"", _int64s(range(first_seq, first_seq + n), n))
        put(b"", _int64s(ts, n))
        put(b"", *_strings(tenant))
        put(b"", *_strings(client_id))
        put(b"", *_strings(topic))
        put(b"", _qos_bytes(qos))
        put(b"", _bits(retain, bitmap))
        put(b"", *_binaries(payload))
        put(bytes(bitmap), no_offsets, b"")  # content_type: every value null
        put(b"", no_offsets)  # user_properties: an empty list each
        for size in self.children:
            put(bytes(size))
        meta = bytearray(self.metadata)
        _I64.pack_into(meta, self.length_at, n)
        nodes = array("q", [n, 0] * 9 + [n, n, n, 0, 0, 0, 0, 0, 0, 0])
        meta[self.nodes_at : self.nodes_at + 16 * NODES] = nodes.tobytes()
        meta[self.buffers_at : self.buffers_at + 16 * BUFFERS] = spans.tobytes()
        _I64.pack_into(meta, self.body_length_at, at)
        return b"".join((_CONTINUATION, _I32.pack(len(meta)), meta, *body))


def _strings(values: list[str]) -> tuple[bytes, bytes]:
    """Offsets and data of a UTF-8 column; one value repeated (node, often tenant and client
    id) is encoded once."""
    first = values[0]
    if values.count(first) == len(values):
        raw = first.encode()
        n = len(values)
        if not raw:
            return bytes(4 * (n + 1)), b""
        return array("i", range(0, len(raw) * (n + 1), len(raw))).tobytes(), raw * n
    joined = "".join(values)
    if joined.isascii():  # a character is a byte: one encode, lengths from the str
        return _offsets(values), joined.encode("ascii")
    return _binaries([value.encode() for value in values])


def _binaries(values: list[bytes]) -> tuple[bytes, bytes]:
    return _offsets(values), b"".join(values)


def _offsets(values: list[str] | list[bytes]) -> bytes:
    """The int32 offsets of a variable-size column (struct, not array("i"): see _int64s)."""
    return struct.pack(f"<{len(values) + 1}i", 0, *itertools.accumulate(map(len, values)))


def int8s(values: list[int]) -> array[int]:
    """The QoS column's values packed (the journal's append checked they are 0, 1 or 2)."""
    try:
        return array("b", values)  # packs in C
    except TypeError:  # equal to one but not an int (1.0): convert them one by one
        return array("b", [int(v) for v in values])


def _int64s(values: Iterable[int], n: int) -> bytes:
    """``n`` little-endian int64: struct converts each int directly, where array("q") goes
    through the argument parser per item (this thread's GIL time per record, twice a record)."""
    return struct.pack(f"<{n}q", *values)


def _qos_bytes(values: list[int]) -> bytes:
    """The QoS column's bytes: ``bytes`` packs 0, 1 and 2 several times faster than an
    int8 array; ``int8s`` takes what it does not (a value equal to one but not an int)."""
    try:
        return bytes(values)
    except TypeError:
        return int8s(values).tobytes()


def _bits(flags: list[bool], size: int) -> bytes:
    """A validity-style bitmap, least significant bit first."""
    if not any(flags):
        return bytes(size)
    return sum(1 << i for i, flag in enumerate(flags) if flag).to_bytes(size, "little")


def _table_fields(buf: bytes, table: int) -> tuple[int, list[int]]:
    """(table position, its fields' offsets from the vtable; 0 where absent)."""
    vtable = table - _I32.unpack_from(buf, table)[0]
    vsize = _U16.unpack_from(buf, vtable)[0]
    return table, [_U16.unpack_from(buf, vtable + 4 + 2 * i)[0] for i in range((vsize - 4) // 2)]


def _field_at(fields: tuple[int, list[int]], index: int, name: str) -> int:
    table, offsets = fields
    if index >= len(offsets) or not offsets[index]:
        raise LayoutError(f"{name} is absent")
    return table + offsets[index]


def _vector(buf: bytes, at: int, count: int) -> int:
    """The position of the first element of the vector that ``at`` points to."""
    start: int = at + _U32.unpack_from(buf, at)[0]
    if _U32.unpack_from(buf, start)[0] != count:
        raise LayoutError(f"a vector of {count} structs expected at {start}")
    if (start + 4) % 8:
        raise LayoutError("structs of int64 not 8-byte aligned")
    return start + 4
