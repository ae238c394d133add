"""The benchmark load generator: MQTT 3.1.1 bytes, the hot-path scanners, and short real runs
against Mosquitto and the null sink (the real runs take a few seconds in all)."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# bench/ is a tool directory, not an installed package; make it importable however pytest runs.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench import brokers, loadgen, wire  # noqa: E402

# --- encoding against known bytes ------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "encoded"),
    [
        (0, b"\x00"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (16_383, b"\xff\x7f"),
        (16_384, b"\x80\x80\x01"),
        (2_097_151, b"\xff\xff\x7f"),
        (2_097_152, b"\x80\x80\x80\x01"),
        (268_435_455, b"\xff\xff\xff\x7f"),
    ],
)
def test_remaining_length_matches_spec_table(n: int, encoded: bytes) -> None:
    # [MQTT-2.2.3] table 2.4
    assert wire.encode_remaining_length(n) == encoded
    assert wire.read_header(b"\x30" + encoded, 0) == (1 + len(encoded), n)


def test_remaining_length_out_of_range() -> None:
    with pytest.raises(wire.UsageError):
        wire.encode_remaining_length(268_435_456)


def test_five_byte_remaining_length_is_a_protocol_error() -> None:
    with pytest.raises(wire.ProtocolError):
        wire.read_header(b"\x30\xff\xff\xff\xff\x01", 0)


def test_connect_bytes() -> None:
    assert wire.connect("a", keepalive=60) == bytes.fromhex("100d00044d5154540402003c000161")
    assert wire.connect("", keepalive=0, clean_session=False) == bytes.fromhex(
        "100c00044d51545404000000" + "0000"
    )


def test_small_packets_bytes() -> None:
    assert wire.connack(0) == b"\x20\x02\x00\x00"
    assert wire.connack(5, session_present=True) == b"\x20\x02\x01\x05"
    assert wire.puback(0x1234) == b"\x40\x02\x12\x34"
    assert wire.PINGREQ == b"\xc0\x00"
    assert wire.PINGRESP == b"\xd0\x00"
    assert wire.DISCONNECT == b"\xe0\x00"


def test_publish_bytes() -> None:
    assert wire.publish("a/b", b"hi") == b"\x30\x07\x00\x03a/bhi"
    assert wire.publish("a/b", b"hi", qos=1, packet_id=10) == b"\x32\x09\x00\x03a/b\x00\x0ahi"
    assert wire.publish("t", b"", dup=True, retain=True, qos=1, packet_id=1) == (
        b"\x3b\x05\x00\x01t\x00\x01"
    )


def test_publish_rejects_what_311_cannot_say() -> None:
    with pytest.raises(wire.UsageError):
        wire.publish("t", b"", qos=2, packet_id=1)
    with pytest.raises(wire.UsageError):
        wire.publish("t", b"", qos=1, packet_id=0)  # [MQTT-2.3.1-1]


def test_subscribe_and_suback_bytes() -> None:
    # [MQTT-3.8.1-1] fixed header flags 0010
    assert wire.subscribe(1, [("a/#", 1)]) == b"\x82\x08\x00\x01\x00\x03a/#\x01"
    assert wire.suback(1, [0, 1, 0x80]) == b"\x90\x05\x00\x01\x00\x01\x80"
    packet = wire.PacketReader()
    packet.feed(wire.subscribe(7, [("x", 0), ("y/+", 1)]))
    parsed = packet.next_packet()
    assert parsed is not None
    assert wire.parse_subscribe(parsed) == (7, [("x", 0), ("y/+", 1)])


# --- decoding ----------------------------------------------------------------------------------

STREAM = [
    wire.connack(0),
    wire.suback(1, [1]),
    wire.publish("bench/x/1", b"p" * 200, qos=1, packet_id=9),
    wire.PINGRESP,
    wire.publish("b", b"", qos=0),
]


@pytest.mark.parametrize("how", ["whole", "byte_by_byte", "trailing"])
def test_reader_whole_byte_by_byte_and_trailing(how: str) -> None:
    data = b"".join(STREAM)
    reader = wire.PacketReader()
    got: list[wire.Packet] = []
    if how == "whole":
        reader.feed(data)
        got = reader.packets()
    elif how == "byte_by_byte":
        for i in range(len(data)):
            reader.feed(data[i : i + 1])
            got += reader.packets()
    else:
        reader.feed(data + b"\x30\x05\x00")  # an incomplete packet stays buffered
        got = reader.packets()
        reader.feed(b"\x01t12")
        got += reader.packets()
    types = [p.type for p in got]
    assert types[:5] == [2, 9, 3, 13, 3]
    assert wire.parse_connack(got[0]) == 0
    assert wire.parse_suback(got[1]) == (1, [1])
    assert wire.parse_publish(got[2]) == ("bench/x/1", 9, b"p" * 200)
    if how == "trailing":
        assert wire.parse_publish(got[5]) == ("t", 0, b"12")


def test_random_bytes_parse_or_raise_protocol_error() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        reader = wire.PacketReader()
        reader.feed(data)
        try:
            reader.packets()
            scanner = wire.PublishScanner(sample_every=1)
            scanner.scan(bytearray(data), 0, bytearray(), [])
        except wire.ProtocolError:
            pass


# --- hot paths -------------------------------------------------------------------------------


def _bench_stream(qos: int, n: int) -> tuple[bytes, list[int]]:
    """n benchmark publishes from two topics of equal length, plus their send times."""
    packets = []
    stamps = []
    for i in range(n):
        stamps.append(1_000_000 + i)
        payload = (1_000_000 + i).to_bytes(8, "big") + i.to_bytes(8, "big") + bytes(16)
        pid = i % 0xFFFF + 1
        packets.append(wire.publish(f"bench/r/{i % 2:05d}", payload, qos=qos, packet_id=pid))
    return b"".join(packets), stamps


def _scan_in_chunks(
    data: bytes, sizes: Iterator[int], *, sample_every: int, fast: bool
) -> tuple[wire.PublishScanner, bytes, list[wire.Packet]]:
    scanner = wire.PublishScanner(sample_every=sample_every)
    if not fast:
        scanner._scan_run = lambda *_: 0  # type: ignore[method-assign]
    buf = bytearray()
    acks = bytearray()
    others: list[wire.Packet] = []
    i = 0
    while i < len(data):
        size = next(sizes)
        buf += data[i : i + size]
        i += size
        scanner.scan(buf, 2_000_000, acks, others)
    assert not buf
    return scanner, bytes(acks), others


@pytest.mark.parametrize("qos", [0, 1])
@pytest.mark.parametrize("sample_every", [0, 1, 7])
def test_scanner_fast_path_agrees_with_the_general_loop(qos: int, sample_every: int) -> None:
    body, stamps = _bench_stream(qos, 500)
    data = wire.suback(1, [qos]) + body + wire.PINGRESP + body
    rng = random.Random(qos * 100 + sample_every)
    chunk_sizes = [rng.choice([1, 7, 53, 400, 5000]) for _ in range(len(data))]
    fast, fast_acks, fast_others = _scan_in_chunks(
        data, iter(chunk_sizes), sample_every=sample_every, fast=True
    )
    slow, slow_acks, slow_others = _scan_in_chunks(
        data, iter(chunk_sizes), sample_every=sample_every, fast=False
    )
    assert fast.count == slow.count == 1000
    assert fast.samples == slow.samples
    assert fast_acks == slow_acks
    assert [p.type for p in fast_others] == [p.type for p in slow_others] == [9, 13]
    if qos:
        expected = b"".join(wire.puback(i % 0xFFFF + 1) for i in range(500)) * 2
        assert fast_acks == expected
    else:
        assert fast_acks == b""
    if sample_every:
        # the first publish is sampled, then every k-th after it
        every_kth = [2_000_000 - s for s in (stamps + stamps)[::sample_every]]
        assert fast.samples == every_kth


def test_scanner_bounds_its_samples() -> None:
    data, _ = _bench_stream(0, 1000)
    scanner = wire.PublishScanner(sample_every=1, max_samples=100)
    scanner.scan(bytearray(data), 0, bytearray(), [])
    assert scanner.count == 1000
    assert len(scanner.samples) <= 100


def test_count_pubacks() -> None:
    acks = b"".join(wire.puback(i) for i in (1, 0x4002, 3))
    assert wire.count_pubacks(bytearray(acks)) == (3, 12)
    assert wire.count_pubacks(bytearray(acks + b"\x40\x02\x00")) == (3, 12)
    assert wire.count_pubacks(bytearray(acks[:4] + wire.PINGRESP + acks[4:])) == (1, 4)
    assert wire.count_pubacks(bytearray(wire.PINGRESP)) == (0, 0)


@pytest.mark.parametrize("qos", [0, 1])
def test_publish_batch_stamps_time_sequence_and_packet_id(qos: int) -> None:
    batch = wire.PublishBatch("bench/r/00001", 64, qos=qos, size=8)
    reader = wire.PacketReader()
    reader.feed(batch.fill(3, 123_456_789, 65_534))
    packets = reader.packets()
    assert len(packets) == 3
    for k, packet in enumerate(packets):
        topic, pid, payload = wire.parse_publish(packet)
        assert topic == "bench/r/00001"
        assert len(payload) == 64
        assert wire.stamp_of(payload) == (123_456_789, 65_534 + k)
        assert pid == ((65_534 + k) % 0xFFFF + 1 if qos else 0)
        assert pid != 0 or not qos


def test_topic_matches() -> None:
    assert loadgen.topic_matches("bench/r/#", "bench/r/00001")
    assert loadgen.topic_matches("bench/+/1", "bench/r/1")
    assert loadgen.topic_matches("a/b", "a/b")
    assert not loadgen.topic_matches("bench/s/#", "bench/r/00001")
    assert not loadgen.topic_matches("a/+", "a/b/c")


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="qos"):
        loadgen.LoadOptions(qos=2)
    with pytest.raises(ValueError, match="payload_size"):
        loadgen.LoadOptions(payload_size=8)


# --- real runs ---------------------------------------------------------------------------------

SHORT = {"duration": 1.5, "pub_procs": 1, "sub_procs": 1, "drain_timeout": 5.0}


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[brokers.BrokerProcess]:
    if not Path(brokers.MOSQUITTO).exists():
        pytest.skip(f"Mosquitto is not installed at {brokers.MOSQUITTO}")
    with brokers.start_mosquitto() as broker:
        yield broker


@pytest.mark.parametrize("qos", [0, 1])
def test_fanin_against_mosquitto_delivers_everything(
    mosquitto: brokers.BrokerProcess, qos: int
) -> None:
    target = loadgen.Target(mosquitto.host, mosquitto.port, mosquitto.pid)
    options = loadgen.LoadOptions(qos=qos, rate=2000.0, **SHORT)  # type: ignore[arg-type]
    result = loadgen.fanin(target, options, publishers=2)
    assert result["sent"] > 1000
    assert result["received"] == result["sent"] == result["expected"]
    assert result["loss"] == 0
    assert result["msgs_per_s"] > 0
    assert result["latency_ms"]["samples"] > 0
    if qos:
        assert result["acked"] == result["sent"]
    assert result["cpu"]["broker_s"] is not None
    assert brokers.rss_kib(mosquitto.pid)


def test_fanin_against_the_null_sink_measures_the_ceiling() -> None:
    with brokers.start_null_sink() as sink:
        target = loadgen.Target(sink.host, sink.port, sink.pid, null=True)
        result = loadgen.fanin(target, loadgen.LoadOptions(qos=0, **SHORT), publishers=2)  # type: ignore[arg-type]
    assert result["sent"] > 0
    assert result["send_rate"] > 0
    assert result["msgs_per_s"] > 0  # the sink floods the subscriber
    assert result["loss"] is None
