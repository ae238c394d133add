"""Time without sockets or sleeps (issue 10): wills, keepalive, session expiry and flow control
driven by a fake clock. The broker never reads a clock for these: ``tick(now)`` does what is due
and returns when it next needs the clock; ``wake_at`` asks for an earlier tick."""

from __future__ import annotations

from test_connection import FakeJournal, Peer, Reading, connected, publish_three

from broker_edge.broker import SCAN_INTERVAL, Broker
from broker_edge.packets import (
    Connect,
    Properties,
    ProtocolVersion,
    QoS,
    Subscribe,
    Subscription,
    Will,
)
from broker_edge.settings import EdgeSettings

V5 = ProtocolVersion.MQTT_5


def _broker(journal: FakeJournal) -> tuple[Broker, list[float]]:
    broker = Broker(EdgeSettings(node_id="unit"), journal, wall_clock_us=lambda: 1)
    wakes: list[float] = []
    broker.wake_at = wakes.append
    return broker, wakes


def _with_will(broker: Broker, now: float, *, delay: int, expiry: int) -> Peer:
    peer = Peer(broker, V5)
    will = Will(
        "dev/1/status", b"gone", QoS.AT_LEAST_ONCE, properties=Properties(will_delay_interval=delay)
    )
    props = Properties(session_expiry_interval=expiry)
    peer.send(Connect(client_id="dev-1", protocol_version=V5, will=will, properties=props), now)
    return peer


def _wills(journal: FakeJournal) -> list[object]:
    return [r["payload"] for r in journal.device if r["topic"] == "dev/1/status"]


def test_a_delayed_will_is_published_when_due_and_the_broker_says_when() -> None:
    journal = FakeJournal()
    broker, wakes = _broker(journal)
    peer = _with_will(broker, 0.0, delay=5, expiry=60)
    broker.connection_lost(peer.conn, 10.0)  # no DISCONNECT: the will, 5 s later
    assert wakes == [15.0]
    assert broker.tick(14.9) == 15.0  # not yet, and the next time it needs the clock
    assert _wills(journal) == []
    broker.tick(15.0)
    assert _wills(journal) == [b"gone"]
    assert broker.tick(15.0) == 14.9 + SCAN_INTERVAL  # nothing left but the periodic scan


def test_reconnecting_within_the_delay_cancels_the_will() -> None:
    journal = FakeJournal()
    broker, _ = _broker(journal)
    peer = _with_will(broker, 0.0, delay=5, expiry=60)
    broker.connection_lost(peer.conn, 10.0)
    back = Peer(broker, V5)
    props = Properties(session_expiry_interval=60)
    back.send(
        Connect(client_id="dev-1", protocol_version=V5, clean_start=False, properties=props), 12.0
    )
    broker.tick(20.0)
    assert _wills(journal) == []


def test_a_will_comes_when_the_session_expires_if_that_is_sooner() -> None:
    journal = FakeJournal()
    broker, wakes = _broker(journal)
    peer = _with_will(broker, 0.0, delay=30, expiry=3)
    broker.connection_lost(peer.conn, 0.0)
    assert wakes == [3.0]
    broker.tick(3.0)
    assert _wills(journal) == [b"gone"]


def test_keepalive_closes_a_silent_client_within_a_scan_of_one_and_a_half_times() -> None:
    journal = FakeJournal()
    broker, _ = _broker(journal)
    peer = Peer(broker, ProtocolVersion.MQTT_3_1_1)
    peer.send(Connect(client_id="quiet", keepalive=10), 0.0)
    broker.tick(14.9)
    assert not peer.closed
    chatty = connected(broker, "chatty", ProtocolVersion.MQTT_3_1_1)
    broker.tick(14.9 + SCAN_INTERVAL)  # 15.9 > 1.5 x 10 s of silence
    assert peer.closed
    assert not chatty.closed  # keepalive 60 s


def test_a_session_expires_after_its_interval_offline() -> None:
    journal = FakeJournal()
    broker, _ = _broker(journal)
    peer = Peer(broker, V5)
    props = Properties(session_expiry_interval=30)
    peer.send(Connect(client_id="s", protocol_version=V5, clean_start=False, properties=props), 0.0)
    peer.send(Subscribe(packet_id=1, subscriptions=(Subscription("a/#", QoS.AT_LEAST_ONCE),)), 0.0)
    broker.connection_lost(peer.conn, 100.0)
    broker.tick(129.0)
    assert ("default", "s") in broker.sessions
    broker.tick(130.0)
    assert ("default", "s") not in broker.sessions
    assert broker.stats.sessions_expired == 1


def test_a_rate_limited_publisher_reads_again_when_its_bucket_allows() -> None:
    journal = FakeJournal()
    broker, peer, reading = _rate_limited(journal)
    publish_three(peer)  # at t=0, 1 msg/s: paused until t=1
    assert reading.paused
    assert reading.wakes == [1.0]
    journal.make_durable()
    broker.after_commit()
    assert broker.tick(0.5) == 1.0  # still paused, and the broker says until when
    assert reading.paused
    broker.tick(1.0)
    assert not reading.paused


def _rate_limited(journal: FakeJournal) -> tuple[Broker, Peer, Reading]:
    broker = Broker(EdgeSettings(node_id="unit"), journal, wall_clock_us=lambda: 1)
    peer = connected(broker, "limited", ProtocolVersion.MQTT_3_1_1)
    journal.make_durable()
    peer.conn.rate = peer.conn.bucket = 1.0
    return broker, peer, Reading(peer)
