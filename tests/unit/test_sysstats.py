"""$SYS statistics without sockets: counters -> topics and payloads, load averages, change-only
publishing, packet framing, and the broker's publish_system routing."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
from test_connection import FakeIO

from broker_edge.broker import Broker
from broker_edge.codec import Decoder, encode
from broker_edge.packets import (
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    ProtocolVersion,
    Publish,
    QoS,
    Subscribe,
    Subscription,
)
from broker_edge.settings import EdgeSettings
from broker_edge.sysstats import LOADS, Sample, SysTree, load_step, sample
from schemas.journal import DEFAULT_TENANT

V4 = ProtocolVersion.MQTT_3_1_1

P = "$SYS/broker/"


class FakeJournal:
    """Appends in memory; nothing ever becomes durable (no PUBACK needed here)."""

    def __init__(self) -> None:
        self.records: list[tuple[object, ...]] = []

    def append(self, *fields: object) -> int:
        self.records.append(fields)
        return len(self.records)

    def append_run(
        self, ts_us: int, tenant: str, client_id: str, topic: str, qos: int, payloads: list[bytes]
    ) -> int:
        for payload in payloads:
            self.append(ts_us, tenant, client_id, topic, qos, False, payload, None, ())
        return len(self.records) - len(payloads) + 1

    backlog = 0  # everything is durable at once

    lake_committed_seq = 0
    durable_seq = 0

    @property
    def appended_seq(self) -> int:
        return len(self.records)

    def after_durable(
        self, seq: int, callback: Callable[[], None], refused: Callable[[], None] | None = None
    ) -> None:
        pass


class Peer:
    """A client's view of one Connection: send packets, read decoded replies."""

    def __init__(self, broker: Broker, client_id: str, *, clean: bool = True) -> None:
        self.broker = broker
        self.wire: list[bytes] = []
        self.conn = broker.open_connection(f"test:{client_id}", 0.0, FakeIO(self.wire.append))
        self.decoder = Decoder(protocol_version=V4)
        self.send(Connect(client_id=client_id, protocol_version=V4, clean_start=clean))
        self.replies()

    def send(self, packet: Packet) -> None:
        self.broker.receive(self.conn, encode(packet, V4), 0.0)
        self.broker.flush_dirty()

    def replies(self) -> list[Packet]:
        self.decoder.feed(b"".join(self.wire))
        self.wire.clear()
        return list(self.decoder.packets())


def as_dict(pairs: list[tuple[str, bytes]]) -> dict[str, bytes]:
    topics = [topic for topic, _ in pairs]
    assert len(topics) == len(set(topics)), "a topic published twice in one update"
    return dict(pairs)


# -- counters -> topics ------------------------------------------------------------------------


def test_first_update_publishes_every_topic_with_mosquitto_names() -> None:
    now = Sample(
        uptime=42,
        clients_connected=3,
        clients_total=5,
        messages_received=100,
        messages_sent=90,
        messages_inflight=2,
        bytes_received=4096,
        bytes_sent=2048,
        publish_received=40,
        publish_sent=35,
        publish_dropped=1,
        publish_bytes_received=400,
        publish_bytes_sent=350,
        sockets=6,
        connects=7,
        clients_expired=4,
        retained_count=7,
        subscriptions_count=8,
        store_count=9,
        store_bytes=640,
        journal_state="full",
        journal_reason="journal holds 11 bytes, journal_max_bytes is 10",
        journal_bytes=11,
        journal_free_bytes=12,
        journal_durable_seq=13,
        journal_committed_seq=14,
        journal_segments_removed=15,
        journal_refused=16,
        journal_dropped=17,
        journal_frames_loop=18,
        journal_frames_thread=19,
    )
    out = as_dict(SysTree("edgebus 0.1.0").update(now, at=0.0))
    expected = {
        "version": b"edgebus 0.1.0",
        "uptime": b"42 seconds",
        "clients/connected": b"3",
        "clients/disconnected": b"2",
        "clients/total": b"5",
        "clients/maximum": b"5",
        "clients/expired": b"4",
        "messages/received": b"100",
        "messages/sent": b"90",
        "messages/inflight": b"2",
        "bytes/received": b"4096",
        "bytes/sent": b"2048",
        "publish/messages/received": b"40",
        "publish/messages/sent": b"35",
        "publish/messages/dropped": b"1",
        "publish/bytes/received": b"400",
        "publish/bytes/sent": b"350",
        "retained messages/count": b"7",
        "subscriptions/count": b"8",
        "store/messages/count": b"9",
        "store/messages/bytes": b"640",
        "messages/stored": b"9",
        # The journal (issue 9): edgebus's own, beside Mosquitto's names.
        "journal/state": b"full",
        "journal/reason": b"journal holds 11 bytes, journal_max_bytes is 10",
        "journal/bytes": b"11",
        "journal/free_bytes": b"12",
        "journal/durable_seq": b"13",
        "journal/committed_seq": b"14",
        "journal/segments/removed": b"15",
        "journal/publish/refused": b"16",
        "journal/publish/dropped": b"17",
        "journal/frames/synced_on_loop": b"18",
        "journal/frames/synced_in_thread": b"19",
    }
    for topic, payload in expected.items():
        assert out.pop(P + topic) == payload, topic
    # What is left are the load averages: all of them, starting at 0.00 (as Mosquitto does).
    loads = [f"{P}load/{name}/{w}" for name, _ in LOADS for w in ("1min", "5min", "15min")]
    assert out == dict.fromkeys(loads, b"0.00")
    assert P + "load/messages/received/1min" in out
    assert P + "load/sockets/15min" in out
    assert P + "load/connections/5min" in out


def test_only_changed_values_are_published_again_and_uptime_always() -> None:
    tree = SysTree("edgebus 0.1.0")
    first = Sample(uptime=1, clients_connected=1, clients_total=1)
    tree.update(first, at=0.0)
    assert tree.update(first, at=0.0) == [(P + "uptime", b"1 seconds")]
    later = dataclasses.replace(first, uptime=2, subscriptions_count=4)
    assert as_dict(tree.update(later, at=0.0)) == {
        P + "uptime": b"2 seconds",
        P + "subscriptions/count": b"4",
    }


def test_disconnected_is_total_minus_connected() -> None:
    out = as_dict(SysTree("v").update(Sample(clients_connected=2, clients_total=6), at=0.0))
    assert out[P + "clients/disconnected"] == b"4"


def test_maximum_only_grows() -> None:
    tree = SysTree("v")
    tree.update(Sample(clients_total=5), at=0.0)
    out = as_dict(tree.update(Sample(clients_total=2), at=0.0))
    assert out[P + "clients/total"] == b"2"
    assert P + "clients/maximum" not in out  # still 5: unchanged, not published
    out = as_dict(tree.update(Sample(clients_total=9), at=0.0))
    assert out[P + "clients/maximum"] == b"9"


# -- load averages ---------------------------------------------------------------------------


def test_load_step_is_mosquittos_damped_per_minute_rate() -> None:
    # 600 packets in 10 s is 3600/min; from 0 the 1 min average moves by (1 - e^(-10/60)).
    assert load_step(0.0, 600, 10.0, 60.0) == pytest.approx(3600 * (1 - math.exp(-1 / 6)))
    # No traffic: the average decays by e^(-dt/T).
    assert load_step(100.0, 0, 30.0, 300.0) == pytest.approx(100 * math.exp(-0.1))
    # A steady rate is a fixed point.
    assert load_step(120.0, 20, 10.0, 900.0) == pytest.approx(120.0)


def test_steady_traffic_converges_to_the_rate_faster_for_shorter_windows() -> None:
    tree = SysTree("v")
    tree.update(Sample(), at=0.0)
    loads = {}
    for step in range(1, 31):  # 5 minutes of 10 s samples at 60 packets/s = 3600/min
        out = as_dict(tree.update(Sample(messages_received=600 * step), at=10.0 * step))
        loads.update(out)
    one, five, fifteen = (
        float(loads[f"{P}load/messages/received/{w}"]) for w in ("1min", "5min", "15min")
    )
    assert 3600 * (1 - math.exp(-5)) == pytest.approx(one, abs=0.01)
    assert 3600 * (1 - math.exp(-1)) == pytest.approx(five, abs=0.01)
    assert 3600 * (1 - math.exp(-1 / 3)) == pytest.approx(fifteen, abs=0.01)
    assert fifteen < five < one < 3600
    # Other sources saw nothing: still at 0.00, so not published again after the first update.
    assert P + "load/bytes/sent/1min" not in loads


def test_load_payload_is_two_decimals_and_only_sent_when_the_text_changes() -> None:
    tree = SysTree("v")
    tree.update(Sample(), at=0.0)
    out = as_dict(tree.update(Sample(publish_dropped=1), at=60.0))
    # 1 per minute over one minute: 1 - e^-1 = 0.632...
    assert out[P + "load/publish/dropped/1min"] == b"0.63"
    out = as_dict(tree.update(Sample(publish_dropped=1), at=60.0))
    assert not [t for t in out if "/load/" in t]  # no time passed: loads unchanged


def test_loads_from_the_first_sample_do_not_count_traffic_before_it() -> None:
    tree = SysTree("v")
    tree.update(Sample(messages_sent=10_000), at=100.0)
    out = as_dict(tree.update(Sample(messages_sent=10_000), at=110.0))
    assert P + "load/messages/sent/1min" not in out  # still 0.00


# -- packet framing --------------------------------------------------------------------------


def _stream() -> tuple[bytes, int]:
    v5 = ProtocolVersion.MQTT_5
    packets = [
        Connect(client_id="c", protocol_version=v5),
        Pingreq(),
        Publish(topic="a/b", payload=b"x" * 200, qos=QoS.AT_LEAST_ONCE, packet_id=1),
        Publish(topic="a", payload=b""),
        Publish(topic="big", payload=b"y" * 20_000),  # three-byte Remaining Length
        Subscribe(packet_id=2, subscriptions=(Subscription("a/#"),)),
        Disconnect(),
    ]
    return b"".join(encode(p, v5) for p in packets), len(packets)


def test_the_decoder_counts_packets_whole_and_byte_by_byte() -> None:
    data, n = _stream()
    whole = Decoder()
    whole.feed(data)
    assert len(list(whole.packets())) == whole.decoded == n
    one = Decoder()
    for i in range(len(data)):
        one.feed(data[i : i + 1])
        list(one.packets())
    assert one.decoded == n


def test_received_packets_are_counted_per_turn() -> None:
    broker = _broker()
    Peer(broker, "pub").send(Publish(topic="a", payload=b"x"))  # CONNECT, then PUBLISH
    assert broker.stats.packets_in == 2


# -- sampling the broker and publishing ------------------------------------------------------


def _broker(journal: FakeJournal | None = None) -> Broker:
    journal = journal or FakeJournal()
    return Broker(EdgeSettings(node_id="unit"), journal, wall_clock_us=lambda: 1_000_000)


def test_sample_reads_sessions_subscriptions_retained_and_stats() -> None:
    broker = _broker()
    sub = Peer(broker, "sub", clean=False)
    sub.send(Subscribe(packet_id=1, subscriptions=(Subscription("a/#", QoS.AT_LEAST_ONCE),)))
    pub = Peer(broker, "pub")
    pub.send(Publish(topic="a/r", payload=b"kept", retain=True))
    pub.send(Publish(topic="a/q", payload=b"12345", qos=QoS.AT_LEAST_ONCE, packet_id=3))
    broker.stats.packets_in = 11  # the listener counts these; there is no listener here
    now = sample(broker, uptime=5)
    assert now.uptime == 5
    assert (now.clients_connected, now.clients_total, now.clients_disconnected) == (2, 2, 0)
    assert (now.subscriptions_count, now.retained_count) == (1, 1)
    assert (now.publish_received, now.publish_bytes_received) == (2, 9)
    assert (now.publish_sent, now.publish_bytes_sent) == (2, 9)
    assert now.messages_inflight == now.store_count == 1  # the QoS 1 delivery awaits PUBACK
    assert now.store_bytes == 5  # its payload
    assert now.connects == 2
    assert now.messages_received == 11
    # CONNACK x2, SUBACK, two PUBLISHes (no PUBACK: the fake journal is never durable).
    assert now.messages_sent == broker.stats.packets_out == 5
    # A persistent session without a connection counts as disconnected.
    broker.connection_lost(sub.conn, now=1.0)
    later = sample(broker, uptime=6)
    assert (later.clients_connected, later.clients_total, later.clients_disconnected) == (1, 2, 1)


def test_sample_counts_queued_bytes_and_expired_sessions() -> None:
    broker = _broker()
    sub = Peer(broker, "sub", clean=False)
    sub.send(Subscribe(packet_id=1, subscriptions=(Subscription("a/#", QoS.AT_LEAST_ONCE),)))
    broker.sessions[(sub.conn.tenant, "sub")].expiry_interval = 10
    broker.connection_lost(sub.conn, now=1.0)
    pub = Peer(broker, "pub")
    for payload in (b"123", b"4567"):  # queued for the offline session
        pub.send(Publish(topic="a/q", payload=payload, qos=QoS.AT_LEAST_ONCE, packet_id=3))
    now = sample(broker, uptime=5)
    assert (now.store_count, now.store_bytes, now.clients_expired) == (2, 7, 0)
    broker.expire_sessions(now=10.9)
    assert sample(broker, uptime=6).clients_expired == 0  # not yet
    broker.expire_sessions(now=11.0)
    later = sample(broker, uptime=7)
    assert (later.store_count, later.store_bytes, later.clients_expired) == (0, 0, 1)
    assert (later.clients_total, later.connects) == (1, 2)


def test_publish_system_retains_and_routes_without_the_journal() -> None:
    journal = FakeJournal()
    broker = _broker(journal)
    sys_sub, all_sub = Peer(broker, "sys"), Peer(broker, "all")
    sys_sub.send(Subscribe(packet_id=1, subscriptions=(Subscription("$SYS/#", QoS.AT_LEAST_ONCE),)))
    all_sub.send(Subscribe(packet_id=1, subscriptions=(Subscription("#"),)))
    sys_sub.replies()
    all_sub.replies()

    broker.publish_system(P + "uptime", b"3 seconds")
    broker.flush_dirty()

    assert [r for r in journal.records if str(r[3]).startswith("$SYS")] == []  # never journaled
    # QoS 0 as published although QoS 1 was granted; the routed copy has RETAIN 0.
    assert sys_sub.replies() == [Publish(topic=P + "uptime", payload=b"3 seconds")]
    assert all_sub.replies() == []  # [MQTT-4.7.2-1]: "#" does not match "$SYS/..."
    retained = list(broker.namespace(DEFAULT_TENANT).retained.all())
    assert [(m.topic, m.payload, m.seq) for m in retained] == [(P + "uptime", b"3 seconds", 0)]
    # A late subscriber gets the retained value, with RETAIN 1 [MQTT-3.3.1-8].
    late = Peer(broker, "late")
    late.send(Subscribe(packet_id=1, subscriptions=(Subscription("$SYS/broker/+"),)))
    assert late.replies()[1:] == [Publish(topic=P + "uptime", payload=b"3 seconds", retain=True)]


def test_clients_may_not_overwrite_sys_topics() -> None:
    broker = _broker()
    broker.publish_system(P + "version", b"edgebus 0.1.0")
    Peer(broker, "evil").send(Publish(topic=P + "version", payload=b"pwned", retain=True))
    retained = list(broker.namespace(DEFAULT_TENANT).retained.all())
    assert [m.payload for m in retained] == [b"edgebus 0.1.0"]
