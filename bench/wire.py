"""MQTT 3.1.1 on the wire, as much as a load generator needs — sans-IO, no clock, no logging.

Theory of operation
-------------------
Encoding is a handful of pure functions returning `bytes`. Decoding is `PacketReader`
(`feed(bytes)` then `next_packet()`), used for control traffic, plus two hot paths that the
generator runs on every received byte:

- `PublishScanner.scan()` walks a bytearray of whole and partial packets in one tight loop,
  counts PUBLISH packets, samples the send timestamp of every k-th one and appends the
  PUBACKs a QoS 1 subscription owes; other packets are handed back as `Packet`s.
- `count_pubacks()` checks with strided slices (C speed) that a buffer is nothing but
  PUBACKs and counts them, falling back to the general reader otherwise.

Benchmark payload layout: 8-byte big-endian send time (`time.monotonic_ns()`, which is
CLOCK_MONOTONIC and so comparable between processes on Linux), 8-byte sequence number, then
zero padding. `PublishBatch` pre-encodes a run of identical PUBLISH packets once and only
patches those 16 bytes (and the packet identifier for QoS 1) before each write.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from bench import BenchError

MAX_REMAINING_LENGTH = 268_435_455  # [MQTT-2.2.3] four bytes of 7 bits
STAMP_SIZE = 16  # send time + sequence at the start of every benchmark payload


class ProtocolError(BenchError):
    """The peer sent bytes that are not valid MQTT 3.1.1."""


class UsageError(BenchError):
    """Our own code asked for a packet that MQTT 3.1.1 cannot express."""


class PacketType(IntEnum):
    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    SUBSCRIBE = 8
    SUBACK = 9
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14


@dataclass(frozen=True, slots=True)
class Packet:
    """One decoded packet: type, the low nibble of the first byte, and the body."""

    type: int
    flags: int
    body: bytes


# --- encoding ---------------------------------------------------------------------------


def encode_remaining_length(n: int) -> bytes:
    """[MQTT-2.2.3] variable byte integer, 1-4 bytes, 7 bits each, least significant first."""
    if not 0 <= n <= MAX_REMAINING_LENGTH:
        raise UsageError(f"remaining length {n} out of range")
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_string(text: str) -> bytes:
    """[MQTT-1.5.3] UTF-8 string with a two-byte length prefix."""
    raw = text.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise UsageError("string longer than 65535 bytes")
    return len(raw).to_bytes(2, "big") + raw


def _packet(first_byte: int, body: bytes) -> bytes:
    return bytes((first_byte,)) + encode_remaining_length(len(body)) + body


def connect(
    client_id: str,
    *,
    keepalive: int = 0,
    clean_session: bool = True,
    username: str | None = None,
) -> bytes:
    """CONNECT with protocol name "MQTT", level 4 [MQTT-3.1.2-1/2]; keepalive 0 = none; a user
    name (an edgebus tenant token) follows the client id when given [MQTT-3.1.3-11]."""
    flags = (0x02 if clean_session else 0x00) | (0x80 if username is not None else 0x00)
    body = encode_string("MQTT") + bytes((4, flags)) + keepalive.to_bytes(2, "big")
    user = encode_string(username) if username is not None else b""
    return _packet(0x10, body + encode_string(client_id) + user)


def connack(return_code: int = 0, *, session_present: bool = False) -> bytes:
    return bytes((0x20, 2, 1 if session_present else 0, return_code))


def publish(
    topic: str,
    payload: bytes,
    *,
    qos: int = 0,
    packet_id: int = 0,
    dup: bool = False,
    retain: bool = False,
) -> bytes:
    if qos not in (0, 1):
        raise UsageError("only QoS 0 and 1 are supported")
    if qos and not 0 < packet_id <= 0xFFFF:
        raise UsageError("QoS 1 needs a packet identifier in 1..65535")  # [MQTT-2.3.1-1]
    first = 0x30 | (0x08 if dup else 0) | (qos << 1) | (0x01 if retain else 0)
    pid = packet_id.to_bytes(2, "big") if qos else b""
    return _packet(first, encode_string(topic) + pid + payload)


def puback(packet_id: int) -> bytes:
    return bytes((0x40, 2)) + packet_id.to_bytes(2, "big")


def subscribe(packet_id: int, filters: list[tuple[str, int]]) -> bytes:
    """SUBSCRIBE; the fixed-header flags must be 0b0010 [MQTT-3.8.1-1]."""
    if not filters:
        raise UsageError("SUBSCRIBE needs at least one filter")  # [MQTT-3.8.3-3]
    body = packet_id.to_bytes(2, "big")
    for topic_filter, qos in filters:
        body += encode_string(topic_filter) + bytes((qos,))
    return _packet(0x82, body)


def suback(packet_id: int, return_codes: list[int]) -> bytes:
    return _packet(0x90, packet_id.to_bytes(2, "big") + bytes(return_codes))


PINGREQ = b"\xc0\x00"
PINGRESP = b"\xd0\x00"
DISCONNECT = b"\xe0\x00"


# --- decoding ---------------------------------------------------------------------------


def read_header(buf: bytes | bytearray, start: int) -> tuple[int, int] | None:
    """Return (body start, body length) of the packet at `start`, or None if incomplete."""
    n = len(buf)
    length = 0
    shift = 0
    j = start + 1
    while True:
        if j >= n:
            return None
        byte = buf[j]
        j += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return j, length
        shift += 7
        if shift >= 28:
            raise ProtocolError("remaining length longer than four bytes")  # [MQTT-2.2.3]


class PacketReader:
    """Feed bytes in, take whole packets out; a half-read packet stays buffered."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_packet(self) -> Packet | None:
        header = read_header(self._buf, 0) if self._buf else None
        if header is None:
            return None
        start, length = header
        end = start + length
        if end > len(self._buf):
            return None
        first = self._buf[0]
        packet = Packet(first >> 4, first & 0x0F, bytes(self._buf[start:end]))
        del self._buf[:end]
        return packet

    def packets(self) -> list[Packet]:
        out = []
        while (packet := self.next_packet()) is not None:
            out.append(packet)
        return out


def parse_connack(packet: Packet) -> int:
    """Return the CONNACK return code (0 = accepted)."""
    if packet.type != PacketType.CONNACK or len(packet.body) != 2:
        raise ProtocolError(f"expected CONNACK, got type {packet.type}")
    return packet.body[1]


def parse_suback(packet: Packet) -> tuple[int, list[int]]:
    if packet.type != PacketType.SUBACK or len(packet.body) < 3:
        raise ProtocolError(f"expected SUBACK, got type {packet.type}")
    return int.from_bytes(packet.body[:2], "big"), list(packet.body[2:])


def parse_publish(packet: Packet) -> tuple[str, int, bytes]:
    """Return (topic, packet id or 0, payload)."""
    body = packet.body
    if packet.type != PacketType.PUBLISH or len(body) < 2:
        raise ProtocolError("expected PUBLISH")
    topic_end = 2 + int.from_bytes(body[:2], "big")
    qos = (packet.flags >> 1) & 3
    pid = int.from_bytes(body[topic_end : topic_end + 2], "big") if qos else 0
    payload_start = topic_end + (2 if qos else 0)
    if payload_start > len(body):
        raise ProtocolError("PUBLISH shorter than its topic")
    return body[2:topic_end].decode("utf-8"), pid, body[payload_start:]


def parse_subscribe(packet: Packet) -> tuple[int, list[tuple[str, int]]]:
    body = packet.body
    if packet.type != PacketType.SUBSCRIBE or len(body) < 2:
        raise ProtocolError("expected SUBSCRIBE")
    pid = int.from_bytes(body[:2], "big")
    filters = []
    i = 2
    while i < len(body):
        end = i + 2 + int.from_bytes(body[i : i + 2], "big")
        if end >= len(body):
            raise ProtocolError("truncated SUBSCRIBE filter")
        filters.append((body[i + 2 : end].decode("utf-8"), body[end]))
        i = end + 1
    return pid, filters


def stamp_of(payload: bytes) -> tuple[int, int]:
    """Return (send time ns, sequence) from a benchmark payload."""
    return int.from_bytes(payload[:8], "big"), int.from_bytes(payload[8:16], "big")


def count_pubacks(buf: bytes | bytearray) -> tuple[int, int]:
    """Count leading PUBACK packets; return (count, bytes consumed).

    The common case — the buffer is a whole number of PUBACKs — is verified with strided
    slices, so it costs a few C calls however many acks arrived. Anything else (a PINGRESP in
    between, a partial packet) stops the count at the first non-PUBACK.
    """
    whole = len(buf) - len(buf) % 4
    n = whole // 4
    if n and buf[0:whole:4].count(0x40) == n and buf[1:whole:4].count(2) == n:
        return n, whole
    count = 0
    i = 0
    while i + 4 <= len(buf) and buf[i] == 0x40 and buf[i + 1] == 2:
        count += 1
        i += 4
    return count, i


class PublishScanner:
    """Count PUBLISH packets in a stream, sample their latency, and owe PUBACKs.

    `scan()` is the subscriber's hot loop. A benchmark stream is mostly PUBLISH packets of
    one shape (same first byte, same length), so the shape of the last publish seen is
    remembered and each chunk is first checked against it with strided slices: if every
    packet boundary the shape predicts starts with the shape's header bytes, then by
    induction from offset 0 every packet in the run has that length, and the run is counted,
    sampled and acknowledged at C speed. Anything else (mixed sizes, a SUBACK, a DUP flag)
    goes through the general one-pass loop.

    Latency is sampled every `sample_every`-th publish (0 = never); when `max_samples` is
    reached the samples are halved (every other one kept) and the interval doubled, so memory
    stays bounded and the samples stay spread over the whole run.
    """

    def __init__(self, *, sample_every: int = 16, max_samples: int = 100_000) -> None:
        self.sample_every = max(0, sample_every)
        self.max_samples = max_samples
        # (packet length, header bytes, payload offset, is QoS 1) of the last publish seen
        self._shape: tuple[int, bytes, int, bool] | None = None
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.samples: list[int] = []
        self.first_ns = 0
        self.last_ns = 0
        self._every = self.sample_every
        self._countdown = 1 if self.sample_every else -1

    def scan(self, buf: bytearray, now_ns: int, acks: bytearray, others: list[Packet]) -> int:
        """Consume the whole packets at the front of `buf`; return how many were PUBLISH.

        `now_ns` is the receive time for every publish in this chunk. PUBACK bytes for QoS 1
        publishes are appended to `acks`, other packets to `others`.
        """
        count = self._scan_run(buf, now_ns, acks) if self._shape is not None else 0
        count += self._scan_each(buf, now_ns, acks, others)
        if count:
            self.count += count
            if not self.first_ns:
                self.first_ns = now_ns
            self.last_ns = now_ns
            while len(self.samples) > self.max_samples:
                del self.samples[1::2]
                self._every *= 2
        return count

    def _scan_run(self, buf: bytearray, now_ns: int, acks: bytearray) -> int:
        """Fast path: a run of publishes of the remembered shape at the front of `buf`."""
        assert self._shape is not None
        size, header, payload, qos1 = self._shape
        n = len(buf) // size
        if not n:
            return 0
        whole = n * size
        for k, byte in enumerate(header):
            if buf[k:whole:size].count(byte) != n:
                return 0
        if qos1:
            out = bytearray(4 * n)
            out[0::4] = b"\x40" * n
            out[1::4] = b"\x02" * n
            out[2::4] = buf[payload - 2 : whole : size]
            out[3::4] = buf[payload - 1 : whole : size]
            acks += out
        countdown = self._countdown
        if 0 < countdown <= n:
            every = self._every
            last = n - 1
            for index in range(countdown - 1, n, every):
                at = index * size + payload
                self.samples.append(now_ns - int.from_bytes(buf[at : at + 8], "big"))
                last = index
            countdown = every - (n - 1 - last)
        elif countdown > 0:
            countdown -= n
        self._countdown = countdown
        del buf[:whole]
        return n

    def _scan_each(self, buf: bytearray, now_ns: int, acks: bytearray, others: list[Packet]) -> int:
        """General path: one packet at a time, everything in local variables."""
        n = len(buf)
        i = 0
        count = 0
        countdown = self._countdown
        samples = self.samples
        shape_at = -1
        while n - i >= 2:
            first = buf[i]
            length = buf[i + 1]
            j = i + 2
            if length & 0x80:
                header = read_header(buf, i)
                if header is None:
                    break
                j, length = header
            end = j + length
            if end > n:
                break
            if first & 0xF0 == 0x30:
                count += 1
                shape_at = i
                topic_end = j + 2 + ((buf[j] << 8) | buf[j + 1])
                payload = topic_end
                if first & 0x06:
                    acks += b"\x40\x02"
                    acks += buf[topic_end : topic_end + 2]
                    payload += 2
                countdown -= 1
                if not countdown:
                    countdown = self._every
                    samples.append(now_ns - int.from_bytes(buf[payload : payload + 8], "big"))
            else:
                others.append(Packet(first >> 4, first & 0x0F, bytes(buf[j:end])))
            i = end
        if shape_at >= 0:
            self._remember_shape(buf, shape_at)
        if i:
            del buf[:i]
        self._countdown = countdown
        return count

    def _remember_shape(self, buf: bytearray, at: int) -> None:
        header = read_header(buf, at)
        assert header is not None
        body, length = header
        payload = body + 2 + ((buf[body] << 8) | buf[body + 1])
        qos1 = bool(buf[at] & 0x06)
        if qos1:
            payload += 2
        self._shape = (body + length - at, bytes(buf[at:body]), payload - at, qos1)


class PublishBatch:
    """`size` pre-encoded copies of one PUBLISH packet; `fill()` stamps the first `n`."""

    def __init__(self, topic: str, payload_size: int, *, qos: int, size: int) -> None:
        if payload_size < STAMP_SIZE:
            raise UsageError(f"payload must be at least {STAMP_SIZE} bytes")
        packet = publish(topic, bytes(payload_size), qos=qos, packet_id=1)
        self.qos = qos
        self.size = size
        self.packet_size = len(packet)
        self.buffer = bytearray(packet * size)
        # The stamp (and, for QoS 1, the packet id just before it) sits right after the topic.
        self._offset = len(packet) - payload_size - (2 if qos else 0)
        self._pack_into = struct.Struct(">HQQ" if qos else ">QQ").pack_into

    def fill(self, n: int, now_ns: int, seq: int) -> bytes:
        """Stamp packets 0..n-1 with `now_ns` and sequences seq.. and return them as bytes.

        Returns a copy so the transport may keep it while the buffer is reused.
        """
        pack_into = self._pack_into
        buffer = self.buffer
        size = self.packet_size
        offset = self._offset
        if self.qos:
            for k in range(n):
                s = seq + k
                pack_into(buffer, offset + k * size, s % 0xFFFF + 1, now_ns, s)
        else:
            for k in range(n):
                pack_into(buffer, offset + k * size, now_ns, seq + k)
        return bytes(buffer[: n * size])
