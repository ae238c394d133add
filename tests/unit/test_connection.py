"""The connection state machine without sockets: bytes in, bytes out, a fake journal."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from broker_edge import sessionlog
from broker_edge.broker import Broker
from broker_edge.codec import Decoder, encode
from broker_edge.connection import ConnState
from broker_edge.errors import ProtocolError
from broker_edge.packets import (
    Connack,
    Connect,
    Packet,
    Pingreq,
    ProtocolVersion,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    QoS,
    ReasonCode,
    Subscribe,
    Subscription,
)
from broker_edge.sessionlog import SessionLog
from broker_edge.settings import EdgeSettings


class FakeJournal:
    """Appends in memory; nothing is durable until ``make_durable``."""

    def __init__(self) -> None:
        self.records: list[dict[str, object]] = []
        self.durable = 0
        self.waiters: list[tuple[int, Callable[[], None], Callable[[], None] | None]] = []
        self.lake_committed_seq = 0
        self.peer_acked: dict[str, int] = {}

    FIELDS = ("ts_us", "tenant", "client_id", "topic", "qos", "retain", "payload")

    def append(self, *values: object) -> int:
        self.records.append(dict(zip(self.FIELDS, values, strict=False)))
        return len(self.records)

    def append_run(
        self, ts_us: int, tenant: str, client_id: str, topic: str, qos: int, payloads: list[bytes]
    ) -> int:
        for payload in payloads:
            self.append(ts_us, tenant, client_id, topic, qos, False, payload)
        return len(self.records) - len(payloads) + 1

    def after_durable(
        self, seq: int, callback: Callable[[], None], refused: Callable[[], None] | None = None
    ) -> None:
        if seq <= self.durable:
            callback()
        else:
            self.waiters.append((seq, callback, refused))

    @property
    def appended_seq(self) -> int:
        return len(self.records)

    @property
    def durable_seq(self) -> int:
        return self.durable

    def fail(self) -> None:
        """The frame holding every waiting record failed: refuse them (GroupCommitter)."""
        waiting, self.waiters = self.waiters, []
        del self.records[self.durable :]
        for _, _, refused in waiting:
            assert refused is not None
            refused()

    @property
    def device(self) -> list[dict[str, object]]:
        """Records of device traffic (not the edge's own $log / $counters publishes)."""
        return [r for r in self.records if not str(r["topic"]).startswith("$")]

    @property
    def backlog(self) -> int:
        return len(self.records) - self.durable

    def make_durable(self) -> None:
        self.durable = len(self.records)
        waiting, self.waiters = self.waiters, []
        for seq, callback, _ in waiting:
            assert seq <= self.durable
            callback()


def _noop() -> None:
    pass


class FakeIO:
    """A connection's transport: each part replaceable by a test."""

    def __init__(self, write: Callable[[bytes], None], close: Callable[[], None] = _noop) -> None:
        self.write = write
        self.close = close
        self.pause_reading: Callable[[], None] = _noop
        self.resume_reading: Callable[[], None] = _noop


class Peer:
    """A client's view of one Connection: send packets, read decoded replies."""

    def __init__(self, broker: Broker, version: ProtocolVersion) -> None:
        self.broker = broker
        self.version = version
        self.wire: list[bytes] = []
        self.closed = False
        self.io = FakeIO(self.wire.append, self._close)
        self.conn = broker.open_connection("test:1", 0.0, self.io)
        self.decoder = Decoder(protocol_version=version)

    def _close(self) -> None:
        self.closed = True

    def send(self, packet: Packet, now: float = 0.0) -> None:
        try:
            self.broker.receive(self.conn, encode(packet, self.version), now)
        except ProtocolError as exc:
            self.broker.protocol_failure(self.conn, exc)
        self.broker.flush_dirty()

    def replies(self) -> list[Packet]:
        self.decoder.feed(b"".join(self.wire))
        self.wire.clear()
        return list(self.decoder.packets())


@pytest.fixture
def journal() -> FakeJournal:
    return FakeJournal()


@pytest.fixture
def broker(journal: FakeJournal) -> Broker:
    return Broker(EdgeSettings(node_id="unit"), journal, wall_clock_us=lambda: 1_000_000)


def connected(broker: Broker, client_id: str, version: ProtocolVersion) -> Peer:
    peer = Peer(broker, version)
    peer.send(Connect(client_id=client_id, protocol_version=version))
    assert peer.replies() == [Connack(session_present=False, reason_code=0)] or version == 5
    return peer


@pytest.mark.parametrize("version", [ProtocolVersion.MQTT_3_1_1, ProtocolVersion.MQTT_5])
def test_qos1_puback_waits_for_the_journal(broker, journal, version):
    peer = connected(broker, "pub", version)
    peer.replies()
    peer.send(Publish(topic="t/1", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=7))
    assert peer.replies() == []  # journaled, not yet durable: no PUBACK
    assert journal.device[0]["topic"] == "t/1"
    journal.make_durable()
    broker.flush_dirty()
    assert peer.replies() == [Puback(packet_id=7)]


def test_qos0_is_journaled_and_routed(broker, journal):
    sub = connected(broker, "sub", ProtocolVersion.MQTT_3_1_1)
    sub.send(Subscribe(packet_id=1, subscriptions=(Subscription("a/+"),)))
    sub.replies()
    pub = connected(broker, "pub", ProtocolVersion.MQTT_3_1_1)
    pub.send(Publish(topic="a/b", payload=b"hello"))
    assert [r["payload"] for r in journal.device] == [b"hello"]
    (msg,) = sub.replies()
    assert isinstance(msg, Publish)
    assert (msg.topic, msg.payload, msg.qos) == ("a/b", b"hello", QoS.AT_MOST_ONCE)


@pytest.mark.parametrize(
    "pub_version", [ProtocolVersion.MQTT_3_1, ProtocolVersion.MQTT_3_1_1, ProtocolVersion.MQTT_5]
)
def test_a_qos0_publish_reaches_subscribers_of_every_version_as_their_own_packet(
    broker, pub_version
):
    # The publisher's bytes go out as they came to its own version's subscribers
    # (Publish.wire); the others get the packet encoded for theirs.
    subs = {}
    for version in (ProtocolVersion.MQTT_3_1_1, ProtocolVersion.MQTT_5):
        sub = subs[version] = connected(broker, f"sub-{version}", version)
        sub.send(Subscribe(packet_id=1, subscriptions=(Subscription("a/#"),)))
        sub.replies()
    pub = connected(broker, "pub", pub_version)
    sent = [Publish(topic="a/b", payload=b"x" * 200), Publish(topic="a", payload=b"")]
    pub.send(sent[0])
    pub.send(sent[1])
    for version, sub in subs.items():
        assert b"".join(sub.wire) == b"".join(encode(p, version) for p in sent)
        assert sub.replies() == sent


@pytest.mark.parametrize("pub_version", [ProtocolVersion.MQTT_3_1_1, ProtocolVersion.MQTT_5])
@pytest.mark.parametrize("qos", [QoS.AT_LEAST_ONCE, QoS.EXACTLY_ONCE])
def test_a_qos1_or_2_publish_reaches_each_subscriber_with_its_own_packet_id(
    broker, pub_version, qos
):
    # A subscriber of the publisher's version at its QoS gets the publisher's bytes with a
    # packet id of its own (Message.wire); the others get theirs encoded.
    subs = []
    for version in (ProtocolVersion.MQTT_3_1_1, ProtocolVersion.MQTT_5):
        for sub_qos in QoS:
            sub = connected(broker, f"sub-{version}-{sub_qos}", version)
            sub.send(Subscribe(packet_id=1, subscriptions=(Subscription("a/#", sub_qos),)))
            sub.replies()
            subs.append((version, sub_qos, sub))
    pub = connected(broker, "pub", pub_version)
    pub.replies()
    pub.send(Publish(topic="a/b", payload=b"x" * 300, qos=qos, packet_id=40_000))
    pub.send(Publish(topic="a/c", payload=b"y", qos=qos, packet_id=40_001, retain=True))
    for version, sub_qos, sub in subs:
        got = min(qos, sub_qos)
        ids = [1, 2] if got else [None, None]
        expected = [
            Publish(topic="a/b", payload=b"x" * 300, qos=got, packet_id=ids[0]),
            Publish(topic="a/c", payload=b"y", qos=got, packet_id=ids[1]),
        ]
        assert b"".join(sub.wire) == b"".join(encode(p, version) for p in expected)


def test_packet_before_connect_closes(broker):
    peer = Peer(broker, ProtocolVersion.MQTT_3_1_1)
    peer.decoder = Decoder(protocol_version=ProtocolVersion.MQTT_3_1_1)
    with pytest.raises(ProtocolError):
        broker.receive(peer.conn, encode(Pingreq(), ProtocolVersion.MQTT_3_1_1), 0.0)


def test_second_connect_is_a_protocol_error(broker):
    peer = connected(broker, "twice", ProtocolVersion.MQTT_5)
    peer.replies()
    peer.send(Connect(client_id="twice", protocol_version=ProtocolVersion.MQTT_5))
    assert peer.closed
    replies = peer.replies()
    assert [type(p).__name__ for p in replies] == ["Disconnect"]
    assert replies[0].reason_code == ReasonCode.PROTOCOL_ERROR  # type: ignore[union-attr]


def test_wildcard_in_publish_topic_disconnects_v5(broker, journal):
    peer = connected(broker, "bad", ProtocolVersion.MQTT_5)
    peer.replies()
    peer.send(Publish(topic="a/+", payload=b"x"))
    assert peer.closed
    (disconnect,) = peer.replies()
    assert disconnect.reason_code == ReasonCode.TOPIC_NAME_INVALID  # type: ignore[union-attr]
    assert journal.device == []


def test_empty_client_id_with_persistent_session_rejected_311(broker):
    peer = Peer(broker, ProtocolVersion.MQTT_3_1_1)
    peer.send(Connect(client_id="", clean_start=False))
    assert peer.replies() == [Connack(reason_code=0x02)]  # [MQTT-3.1.3-8]
    assert peer.closed
    assert peer.conn.state is ConnState.CLOSED


def test_assigned_client_identifier_v5(broker):
    peer = Peer(broker, ProtocolVersion.MQTT_5)
    peer.send(Connect(client_id="", protocol_version=ProtocolVersion.MQTT_5))
    (connack,) = peer.replies()
    assert isinstance(connack, Connack)
    assert connack.properties.assigned_client_identifier
    assert peer.conn.client_id == connack.properties.assigned_client_identifier


def test_publish_after_disconnect_is_ignored(broker, journal):
    from broker_edge.packets import Disconnect

    peer = connected(broker, "bye", ProtocolVersion.MQTT_3_1_1)
    broker.receive(
        peer.conn,
        encode(Disconnect(), ProtocolVersion.MQTT_3_1_1)
        + encode(Publish(topic="late", payload=b"x"), ProtocolVersion.MQTT_3_1_1),
        0.0,
    )
    broker.flush_dirty()
    assert journal.device == []
    assert peer.closed


def test_publisher_paused_while_journal_is_behind_and_resumed_after(journal):
    broker = Broker(
        EdgeSettings(node_id="unit", max_journal_backlog=4), journal, wall_clock_us=lambda: 1
    )
    peer = connected(broker, "fast", ProtocolVersion.MQTT_3_1_1)
    journal.make_durable()  # the connect log event
    calls: list[str] = []
    peer.io.pause_reading = lambda: calls.append("pause")
    peer.io.resume_reading = lambda: calls.append("resume")
    for i in range(4):
        peer.send(Publish(topic="t", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=i + 1))
    assert calls == []  # 4 records behind: at the limit, still reading
    peer.send(Publish(topic="t", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=5))
    assert calls == ["pause"]
    assert peer.replies() == []  # nothing acknowledged that is not durable
    journal.make_durable()
    broker.after_commit()
    assert calls == ["pause", "resume"]
    assert [p.packet_id for p in peer.replies()] == [1, 2, 3, 4, 5]  # type: ignore[union-attr]


def test_connection_without_connect_is_closed_after_the_timeout(broker):
    peer = Peer(broker, ProtocolVersion.MQTT_3_1_1)
    broker.awaiting_connect.add(peer.conn)
    broker.check_keepalives(now=broker.settings.connect_timeout - 1)
    assert not peer.closed
    broker.check_keepalives(now=broker.settings.connect_timeout + 1)
    assert peer.closed


class Reading:
    """A connection's socket reading state, driven by pause_reading/resume_reading, and the
    times the broker asked to be woken at (a fake clock: broker.tick is called by hand)."""

    def __init__(self, peer: Peer) -> None:
        self.paused = False
        self.broker = peer.broker
        self.wakes: list[float] = []
        peer.io.pause_reading = self._pause
        peer.io.resume_reading = self._resume
        peer.broker.wake_at = self.wakes.append

    def _pause(self) -> None:
        self.paused = True

    def _resume(self) -> None:
        self.paused = False

    def fire_timers(self) -> None:
        """The fake clock jumps to the last time the broker asked for; it ticks."""
        wakes, self.wakes = self.wakes, []
        self.broker.tick(max(wakes))


def rate_limited_publisher(journal: FakeJournal) -> tuple[Broker, Peer, Reading]:
    """A publisher allowed 1 message a second (a bucket of 1) on an edge whose journal pauses
    publishers above 2 records behind."""
    broker = Broker(
        EdgeSettings(node_id="unit", max_journal_backlog=2), journal, wall_clock_us=lambda: 1
    )
    peer = connected(broker, "limited", ProtocolVersion.MQTT_3_1_1)
    journal.make_durable()  # the connect log event
    peer.conn.rate = peer.conn.bucket = 1.0
    return broker, peer, Reading(peer)


def publish_three(peer: Peer) -> None:
    """Three QoS 1 publishes in one read at t=0: over the rate and over the journal backlog."""
    version = ProtocolVersion.MQTT_3_1_1
    peer.broker.receive(
        peer.conn,
        b"".join(
            encode(Publish(topic="t", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=i), version)
            for i in (1, 2, 3)
        ),
        0.0,
    )


def test_journal_catching_up_does_not_resume_a_rate_limited_publisher(journal):
    broker, peer, reading = rate_limited_publisher(journal)
    publish_three(peer)
    assert reading.paused
    assert reading.wakes == [1.0]  # one wake per pause (the 2nd msg at 1/s), however overdrawn
    journal.make_durable()
    broker.after_commit()  # the journal caught up ...
    assert reading.paused  # ... but the rate limit still holds
    reading.fire_timers()
    assert not reading.paused


def test_rate_pause_ending_does_not_resume_a_publisher_the_journal_holds(journal):
    broker, peer, reading = rate_limited_publisher(journal)
    publish_three(peer)
    reading.fire_timers()  # the rate pause ends ...
    assert reading.paused  # ... but the journal is still 3 records behind
    journal.make_durable()
    broker.after_commit()
    assert not reading.paused
    assert [p.packet_id for p in peer.replies()] == [1, 2, 3]  # type: ignore[union-attr]


class FakeTransport:
    """What MqttProtocol uses of an asyncio transport: writes kept, reading state recorded."""

    def __init__(self, n: int) -> None:
        self.written: list[bytes] = []
        self.reading = True
        self.n = n

    def get_extra_info(self, name: str) -> tuple[str, int]:
        assert name == "peername"
        return ("127.0.0.1", self.n)

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        del high, low

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        pass

    def publishes(self) -> list[bytes]:
        decoder = Decoder(protocol_version=ProtocolVersion.MQTT_3_1_1)
        decoder.feed(b"".join(self.written))
        return [p.payload for p in decoder.packets() if isinstance(p, Publish)]


def test_a_burst_to_many_subscribers_is_routed_in_turns_with_writes_between(journal):
    from broker_edge.listener import MqttProtocol

    version = ProtocolVersion.MQTT_3_1_1
    loop = asyncio.new_event_loop()
    try:
        # 3 subscribers, at most 4 deliveries a turn: a publish (3 deliveries) fits in a turn,
        # the second one ends it.
        settings = EdgeSettings(node_id="unit", max_deliveries_per_turn=4)
        broker = Broker(settings, journal, wall_clock_us=lambda: 1)
        transports = []
        for n in range(4):
            transport = FakeTransport(n)
            protocol = MqttProtocol(broker, loop)
            protocol.connection_made(transport)  # type: ignore[arg-type]
            protocol.data_received(encode(Connect(client_id=f"c{n}"), version))
            if n < 3:
                protocol.data_received(
                    encode(Subscribe(packet_id=1, subscriptions=(Subscription("burst"),)), version)
                )
            transports.append(transport)
        *subscribers, publisher = transports
        burst = [b"%d" % i for i in range(5)]
        protocol.data_received(
            b"".join(encode(Publish(topic="burst", payload=p), version) for p in burst)
        )
        # The first turn's deliveries are written before the rest of the read is routed, and
        # the publisher is not read from meanwhile.
        assert [s.publishes() for s in subscribers] == [burst[:2]] * 3
        assert not publisher.reading
        loop.run_until_complete(asyncio.sleep(0))  # the next turns run on the loop
        assert [s.publishes() for s in subscribers] == [burst] * 3
        assert publisher.reading
    finally:
        loop.close()


# -- issue 9: the journal full or failing -----------------------------------------------------


def _status(state: str) -> object:
    from broker_edge.durability import JournalStatus

    return JournalStatus(state=state, full="over budget" if state == "full" else "", error="EIO")


@pytest.mark.parametrize(("state", "code"), [("full", 0x97), ("error", 0x80)])
def test_v5_publishes_refused_while_the_journal_refuses(broker, journal, state, code):
    peer = connected(broker, "pub", ProtocolVersion.MQTT_5)
    peer.replies()
    broker.journal_status_changed(_status(state))
    before = len(journal.device)
    peer.send(Publish(topic="t/1", payload=b"a", qos=QoS.AT_LEAST_ONCE, packet_id=1))
    peer.send(Publish(topic="t/1", payload=b"b", qos=QoS.EXACTLY_ONCE, packet_id=2))
    peer.send(Publish(topic="t/1", payload=b"c"))
    assert peer.replies() == [
        Puback(packet_id=1, reason_code=code),
        Pubrec(packet_id=2, reason_code=code),
    ]
    assert len(journal.device) == before  # nothing taken, nothing journaled
    assert (broker.journal_refused, broker.journal_dropped) == (2, 1)
    assert not peer.closed
    # The operator's $log says why, once.
    events = [r["topic"] for r in journal.records if str(r["topic"]).startswith("$log/journal/")]
    assert events == [f"$log/journal/journal_{state}"]
    assert all(r["tenant"] == "$operator" for r in journal.records if r["topic"] in events)

    broker.journal_status_changed(_status("ok"))
    peer.send(Publish(topic="t/1", payload=b"d", qos=QoS.AT_LEAST_ONCE, packet_id=3))
    journal.make_durable()
    broker.flush_dirty()
    assert peer.replies() == [Puback(packet_id=3)]
    assert journal.records[-2]["topic"] == "$log/journal/journal_resumed"


def test_a_failed_frame_is_logged_as_a_cut_back_in_the_session_log(broker, journal, tmp_path):
    # Session changes logged after the dropped records' seqs must not be replayed after the
    # records that reuse those seqs (broker_edge.sessionlog.cut_back).
    broker.session_log = SessionLog(tmp_path, fsync=False)
    syncs: list[bool] = []
    broker.request_session_sync = lambda: syncs.append(True)
    for i in range(3):
        journal.append(1, "acme", "pub", f"t/{i}", 0, False, b"", None, ())
    journal.durable = 1
    journal.fail()  # the frame of records 2-3 failed: the next append gets seq 2 again
    broker.journal_status_changed(_status("error"))
    broker.session_log.close()
    assert list(sessionlog.read(tmp_path, 0)) == [{"op": sessionlog.CUT, "seq": 1}]
    assert syncs == [True]


@pytest.mark.parametrize("state", ["full", "error"])
def test_311_qos1_closes_the_connection_while_the_journal_refuses(broker, journal, state):
    peer = connected(broker, "pub", ProtocolVersion.MQTT_3_1_1)
    peer.replies()
    broker.journal_status_changed(_status(state))
    peer.send(Publish(topic="t/1", payload=b"q0"))
    assert not peer.closed  # QoS 0: dropped and counted
    peer.send(Publish(topic="t/1", payload=b"q1", qos=QoS.AT_LEAST_ONCE, packet_id=1))
    assert peer.closed
    assert peer.replies() == []  # no PUBACK: 3.1.1 cannot say no, the client resends
    assert [r["payload"] for r in journal.device] == []


@pytest.mark.parametrize("version", [ProtocolVersion.MQTT_3_1_1, ProtocolVersion.MQTT_5])
def test_publishes_of_a_failed_frame_are_refused_not_left_waiting(broker, journal, version):
    peer = connected(broker, "pub", version)
    peer.replies()
    peer.send(Publish(topic="t/1", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=7))
    if version == ProtocolVersion.MQTT_5:
        peer.send(Publish(topic="t/1", payload=b"y", qos=QoS.EXACTLY_ONCE, packet_id=8))
    assert peer.replies() == []
    journal.fail()
    broker.flush_dirty()
    if version == ProtocolVersion.MQTT_5:
        assert peer.replies() == [
            Puback(packet_id=7, reason_code=0x80),
            Pubrec(packet_id=8, reason_code=0x80),
        ]
        assert peer.conn.inbound_unacked == 0
        assert not broker.session_of[peer.conn].awaiting_rel
        assert not peer.closed
    else:
        assert peer.replies() == []
        assert peer.closed


def _one_read_of_qos1(broker: Broker, version: ProtocolVersion, pids: tuple[int, ...]) -> Peer:
    """A connected client whose QoS 1 publishes (payload b"x") arrive in one read: one turn."""
    peer = connected(broker, "pub", version)
    peer.replies()
    publishes = (
        Publish(topic="t/1", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=p) for p in pids
    )
    broker.receive(peer.conn, b"".join(encode(p, version) for p in publishes), 0.0)
    return peer


def test_one_read_of_qos1_publishes_is_acknowledged_in_order_once_durable(broker, journal):
    peer = _one_read_of_qos1(broker, ProtocolVersion.MQTT_3_1_1, (5, 3, 9))
    broker.flush_dirty()
    assert peer.replies() == []  # nothing before the journal says durable
    journal.make_durable()
    broker.flush_dirty()
    assert peer.replies() == [Puback(packet_id=5), Puback(packet_id=3), Puback(packet_id=9)]
    assert peer.conn.inbound_unacked == 0


def test_a_read_split_by_a_failed_frame_acknowledges_what_was_durable(broker, journal):
    # One read's publishes can straddle two frames (the commit thread drains at any time):
    # those of the frame that was written are acknowledged, the failed frame's refused.
    peer = _one_read_of_qos1(broker, ProtocolVersion.MQTT_5, (1, 2))
    first = next(i for i, r in enumerate(journal.records, 1) if r["payload"] == b"x")
    journal.durable = first
    journal.fail()
    broker.flush_dirty()
    assert peer.replies() == [Puback(packet_id=1), Puback(packet_id=2, reason_code=0x80)]
    assert peer.conn.inbound_unacked == 0
    assert broker.journal_refused == 1


def test_a_qos2_exchange_stays_open_after_its_durable_pubrec_until_pubrel(broker, journal):
    # PUBREC (durable) does not end an inbound QoS 2 exchange; PUBREL does [MQTT-4.3.3]: the
    # receive maximum counts it until then.
    version = ProtocolVersion.MQTT_5
    peer = connected(broker, "pub", version)
    peer.replies()
    publishes = [
        Publish(topic="t/1", payload=b"x", qos=QoS.AT_LEAST_ONCE, packet_id=1),
        Publish(topic="t/2", payload=b"y", qos=QoS.EXACTLY_ONCE, packet_id=2),
    ]
    broker.receive(peer.conn, b"".join(encode(p, version) for p in publishes), 0.0)
    journal.make_durable()
    broker.flush_dirty()
    assert peer.replies() == [Puback(packet_id=1), Pubrec(packet_id=2)]
    assert peer.conn.inbound_unacked == 1  # the QoS 2 exchange is still open
    broker.receive(peer.conn, encode(Pubrel(packet_id=2), version), 0.0)
    broker.flush_dirty()
    assert peer.replies() == [Pubcomp(packet_id=2)]
    assert peer.conn.inbound_unacked == 0
