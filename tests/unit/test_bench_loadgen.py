"""The benchmark load generator: MQTT 3.1.1 bytes, the hot-path scanners, the suite's
bookkeeping, and short real runs against Mosquitto and the null sink (the real runs take a
few seconds each)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import brokers, compare, loadgen, suite, wire

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
    with pytest.raises(ValueError, match="keepalive"):
        loadgen.LoadOptions(keepalive=70_000)
    with pytest.raises(ValueError, match="e2e_window"):
        loadgen.LoadOptions(e2e_window=0)


# --- timeline, stalls, end-to-end gate ---------------------------------------------------------

STEP_NS = int(loadgen.TIMELINE_STEP_S * 1e9)


def test_longest_stall_counts_only_between_first_and_last_delivery() -> None:
    counts = [0, 0, 5, 10, 10, 10, 10, 20, 30, 30, 30]  # flat before, mid-run, and after
    timeline = [(k * STEP_NS, c) for k, c in enumerate(counts)]
    assert loadgen._longest_stall(timeline) == pytest.approx(3 * loadgen.TIMELINE_STEP_S)
    assert loadgen._longest_stall([]) == 0
    # A late sample (the worker's own loop was busy) stretches the stall by its lateness.
    late = [(0, 1), (STEP_NS, 1), (5 * STEP_NS, 1), (6 * STEP_NS, 2)]
    assert loadgen._longest_stall(late) == pytest.approx(5 * loadgen.TIMELINE_STEP_S)


def test_timelines_add_up_and_give_rates_per_second() -> None:
    a = {"timeline": [0, 10, 20, 30, 40, 50, 60, 70, 80, 90]}
    b = {"timeline": [0, 1, 2, 3, 4]}  # shorter: holds its last value
    total = loadgen._sum_timelines([a, b, {"timeline": []}])
    assert total == [0, 11, 22, 33, 44, 54, 64, 74, 84, 94]
    stats = loadgen.timeline_stats(total, send_s=2.25)
    assert stats["per_step"] == [11, 11, 11, 11, 10, 10, 10, 10, 10]
    # whole seconds while publishing, the first left out: [1 s, 2 s) only
    assert stats["min_rate_1s"] == stats["max_rate_1s"] == 40


def test_gate_keeps_deliveries_in_flight_within_the_window() -> None:
    async def scenario() -> None:
        counters = [0, 0, 0]  # two publisher workers, one subscriber worker
        spec = loadgen._WorkerSpec(
            "pub", "h", 1, (), loadgen.LoadOptions(), slot=0, pub_slots=2, fanout=10
        )
        gate = loadgen._Gate(counters, spec, window=1000)
        assert gate.allowed() == 100
        gate.sent(60)
        counters[1] = 40  # the other publisher process
        assert gate.allowed() == 0  # 1000 deliveries owed, none received
        counters[2] = 250
        assert gate.allowed() == 25
        gate.close()

    asyncio.run(scenario())


# --- the suite's bookkeeping (no brokers) -----------------------------------------------------


def _fake_run(rate: float, *, send: float | None = None, p99: float = 1.0) -> dict[str, object]:
    return {
        "msgs_per_s": rate,
        "send_rate": send or rate,
        "loss": 0,
        "expected": 100,
        "timeline": {"stall_max_s": 0.0, "tail_s": 0.1},
        "cpu": {
            "broker_cores": 0.9,
            "publishers_cores": 0.1,
            "subscribers_cores": 0.2,
            "machine_busy_cores": 1.3,
        },
        "latency_ms": {"p50": 0.5, "p99": p99, "max": 2.0},
        "options": {"rate": 1000.0},
        "background_cores_before": 0.02,
        "broker_log": {"problem_lines": 0},
    }


def test_suite_rows_give_ratios_latency_and_headroom() -> None:
    case = suite.Case("fanin-q0", "fanin", 0, publishers=100)
    runs = {
        "mosquitto": _fake_run(100_000),
        "edgebus": _fake_run(80_000),
        "null": _fake_run(2_000_000, send=1_000_000),
        "mosquitto@rate": _fake_run(10_000, p99=3.0),
        "edgebus@rate": {"error": "LoadgenError: boom"},
    }
    rows = {r["broker"]: r for r in suite.summary_rows(case, runs)}
    assert set(rows) == {"mosquitto", "edgebus", "null"}
    assert rows["edgebus"]["ratio"] == pytest.approx(0.8)
    assert rows["mosquitto"]["ratio"] is None
    assert rows["mosquitto"]["p99_ms"] == 3.0
    assert rows["edgebus"]["error"] == "LoadgenError: boom"
    assert rows["mosquitto"]["headroom"] == pytest.approx(10.0)  # publisher side is lower
    assert rows["null"]["ceiling"] == {"publishers": 1_000_000, "subscribers": 2_000_000}
    assert rows["mosquitto"]["other_cores"] == pytest.approx(0.1)  # 1.3 busy - 1.2 ours
    assert rows["edgebus"]["other_cores_at_rate"] is None
    text = suite.format_summary([{"rows": list(rows.values())}])
    assert "ceiling: publishers 1,000,000 msgs/s" in text
    assert "ERROR: LoadgenError: boom" in text


def test_suite_idle_rows_compare_memory_per_connection() -> None:
    def idle_run(per: float) -> dict[str, object]:
        return {
            "connected": 10,
            "failed": 0,
            "lost_during_hold": 0,
            "kib_per_connection": per,
            "rss_kib": {"before": 1000, "end_of_hold": 1100, "after_close": 1100},
            "cpu": {"broker_cores": 0.0, "broker_us_per_connect": 50.0},
            "background_cores_before": 0.01,
        }

    rows = suite.summary_rows(
        suite.Case("idle", "idle"), {"mosquitto": idle_run(2.0), "edgebus": idle_run(5.0)}
    )
    assert [r["ratio"] for r in rows] == [None, pytest.approx(2.5)]
    assert "KiB/conn" in suite.format_summary([{"rows": rows}])


def test_suite_rounds_give_each_cases_median_ratio() -> None:
    tls = suite.Case("tls-pairs-q1", "pairs", 1, tls=True)
    plain = suite.Case("pairs-q0", "pairs", 0)

    def one_round(tls_edgebus: float, plain_edgebus: float) -> list[dict[str, object]]:
        return [
            {
                "case": tls.__dict__,
                "rows": suite.summary_rows(
                    tls, {"mosquitto": _fake_run(30_000), "edgebus": _fake_run(tls_edgebus)}
                ),
            },
            {
                "case": plain.__dict__,
                "rows": suite.summary_rows(
                    plain, {"edgebus": _fake_run(plain_edgebus), "mosquitto": _fake_run(50_000)}
                ),
            },
        ]

    rounds = [one_round(27_000, 60_000), one_round(33_000, 75_000), one_round(36_000, 40_000)]
    by_case = {r["case"]: r for r in suite.rounds_summary(rounds)}
    assert by_case["tls-pairs-q1"]["ratios"] == pytest.approx([0.9, 1.1, 1.2])
    assert by_case["tls-pairs-q1"]["median"] == pytest.approx(1.1)
    assert by_case["tls-pairs-q1"]["rounds_at_or_above_1"] == 2
    assert by_case["pairs-q0"]["median"] == pytest.approx(1.2)
    assert by_case["pairs-q0"]["min"] == pytest.approx(0.8)
    text = suite.format_rounds(list(by_case.values()))
    assert "tls-pairs-q1         1.10  0.90  1.20  0.90 1.10 1.20" in text


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


def test_idle_connections_against_mosquitto(mosquitto: brokers.BrokerProcess) -> None:
    target = loadgen.Target(mosquitto.host, mosquitto.port, mosquitto.pid)
    options = loadgen.LoadOptions(duration=0.5, keepalive=60, connect_concurrency=16)
    result = loadgen.idle(target, options, connections=200, settle_s=0.3)
    assert result["connected"] == 200
    assert result["failed"] == 0
    assert result["lost_during_hold"] == 0
    assert result["procs"] >= 2
    rss = result["rss_kib"]
    assert rss["before"]
    assert rss["end_of_hold"] >= rss["before"]
    assert result["kib_per_connection"] is not None
    assert result["cpu"]["broker_us_per_connect"] is not None
    assert result["nofile_limit"] >= 1024


def test_compare_run_one_reports_settings_exit_and_log() -> None:
    if not Path(brokers.MOSQUITTO).exists():
        pytest.skip(f"Mosquitto is not installed at {brokers.MOSQUITTO}")
    options = loadgen.LoadOptions(
        qos=0, duration=1.0, pub_procs=1, sub_procs=1, drain_timeout=5.0, e2e_window=100
    )
    result = compare.run_one("mosquitto", "pairs", options, publishers=2, pin=False)
    assert result["loss"] == 0
    assert result["received"] == result["sent"] > 0
    assert result["e2e_window"] == loadgen.E2E_MIN_MESSAGES  # 100 < 300 messages x fan-out 1
    assert result["broker_exit"] == {"alive_at_end": True, "code": 0}
    assert result["broker_log"]["problem_lines"] == 0
    assert "max_queued_messages 0" in result["broker_settings"]
    assert result["timeline"]["per_step"]
    assert result["timeline"]["stall_max_s"] is not None
    assert "max_queued_messages = 1000000" in compare.broker_settings("edgebus")


@pytest.mark.parametrize("broker", ["mosquitto", "edgebus"])
def test_compare_run_one_over_tls(broker: str) -> None:
    """The TLS cases: the broker serves a certificate made for the run, the generator
    verifies it and speaks MQTT over TLS (QoS 1, paced)."""
    if not Path(brokers.MOSQUITTO).exists():
        pytest.skip(f"Mosquitto is not installed at {brokers.MOSQUITTO}")
    options = loadgen.LoadOptions(qos=1, rate=2000.0, **SHORT)  # type: ignore[arg-type]
    result = compare.run_one(broker, "pairs", options, publishers=2, pin=False, tls=True)
    assert result["tls"] is True
    assert result["options"]["tls_ca"]
    assert result["loss"] == 0
    assert result["acked"] == result["received"] == result["sent"] > 1000
    assert result["broker_log"]["problem_lines"] == 0


def test_fanin_against_the_null_sink_measures_the_ceiling() -> None:
    with brokers.start_null_sink() as sink:
        target = loadgen.Target(sink.host, sink.port, sink.pid, null=True)
        result = loadgen.fanin(target, loadgen.LoadOptions(qos=0, **SHORT), publishers=2)  # type: ignore[arg-type]
    assert result["sent"] > 0
    assert result["send_rate"] > 0
    assert result["msgs_per_s"] > 0  # the sink floods the subscriber
    assert result["loss"] is None
