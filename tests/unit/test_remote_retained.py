"""What an edge does with its peers' retained messages and the operator's decisions (issue 11,
broker_edge.broker: deliver_remote, retain_remote), without sockets."""

from __future__ import annotations

import json

from test_sysstats import FakeJournal, Peer

from broker_edge.broker import Broker
from broker_edge.message import Message
from broker_edge.packets import Properties, Publish, QoS, Subscribe, Subscription
from broker_edge.settings import EdgeSettings
from broker_edge.tenants import OPERATOR_TENANT
from schemas.journal import DEFAULT_TENANT


def _broker() -> tuple[Broker, FakeJournal]:
    journal = FakeJournal()
    settings = EdgeSettings(node_id="edge-b")
    return Broker(settings, journal, wall_clock_us=lambda: 1_000), journal


def _journaled(journal: FakeJournal, topic: str) -> int:
    return sum(1 for record in journal.records if record[3] == topic)


def _from(origin: str, ts_us: int, payload: bytes, topic: str = "fleet/x", seq: int = 1) -> Message:
    return Message(
        DEFAULT_TENANT,
        topic,
        payload,
        QoS.AT_LEAST_ONCE,
        True,
        "dev",
        ts_us,
        seq=seq,
        origin=origin,
    )


def _publishes(peer: Peer) -> list[Publish]:
    return [p for p in peer.replies() if isinstance(p, Publish)]


def _subscribe(broker: Broker, client_id: str, topic_filter: str) -> Peer:
    peer = Peer(broker, client_id)
    subscription = Subscription(topic_filter, QoS.AT_LEAST_ONCE)
    peer.send(Subscribe(packet_id=1, subscriptions=(subscription,)))
    return peer  # its SUBACK, and the retained messages it brings, not read yet


def _retained_payloads(broker: Broker) -> list[bytes]:
    return [m.payload for m in broker.namespace(DEFAULT_TENANT).retained.matching("fleet/#")]


def test_a_peers_retained_publish_is_delivered_once_and_kept_if_newest() -> None:
    broker, journal = _broker()
    live = _subscribe(broker, "live", "fleet/#")
    live.replies()
    broker.deliver_remote(_from("edge-a", 20, b"newest"))
    broker.flush_dirty()
    assert [(p.payload, p.retain) for p in _publishes(live)] == [(b"newest", False)]
    assert broker.state_changed  # not in this node's journal: a snapshot keeps it
    # Published before it elsewhere, arriving after it: delivered (it was published), not kept.
    broker.deliver_remote(_from("edge-c", 10, b"older"))
    broker.flush_dirty()
    assert [p.payload for p in _publishes(live)] == [b"older"]
    assert _retained_payloads(broker) == [b"newest"]
    assert not _journaled(journal, "fleet/x")  # its origin's journal has it


def test_a_peers_retained_set_as_a_link_comes_up_is_kept_and_delivered_to_nobody() -> None:
    broker, _ = _broker()
    live = _subscribe(broker, "live", "fleet/#")
    live.replies()
    broker.retain_remote(_from("edge-a", 20, b"set"))
    broker.retain_remote(_from("edge-c", 10, b"", topic="fleet/x"))  # an older clear
    broker.flush_dirty()
    assert not _publishes(live)
    assert _retained_payloads(broker) == [b"set"]
    later = _subscribe(broker, "later", "fleet/#")
    assert [(p.payload, p.retain) for p in _publishes(later)] == [(b"set", True)]
    broker.retain_remote(_from("edge-c", 30, b""))  # a newer clear
    assert _retained_payloads(broker) == []


def _decision(state: str) -> bytes:
    return json.dumps({"state": state, "metric": "messages_per_day"}).encode()


def _decided(origin: str, ts_us: int, state: str) -> Message:
    topic = "$control/quota/acme"
    return Message(
        OPERATOR_TENANT, topic, _decision(state), QoS.AT_LEAST_ONCE, True, "p", ts_us, seq=1,
        origin=origin,
    )  # fmt: skip


def test_a_decision_from_a_peer_applies_here_unless_an_older_one() -> None:
    broker, journal = _broker()
    broker.deliver_remote(_decided("edge-a", 20, "blocked"))
    assert "acme" in broker.tenancy.blocked
    # Its retained $quota state, made and journaled here as for a local decision.
    assert _journaled(journal, "$quota/messages_per_day") == 1
    broker.retain_remote(_decided("edge-c", 10, "ok"))  # older: the held decision stands
    assert "acme" in broker.tenancy.blocked
    broker.retain_remote(_decided("edge-c", 30, "ok"))
    assert "acme" not in broker.tenancy.blocked


def test_a_peers_retained_message_expires_by_its_origins_time() -> None:
    broker, _ = _broker()  # its clock: 1 ms after the epoch
    props = Properties(message_expiry_interval=2)
    expired = Message(DEFAULT_TENANT, "fleet/old", b"o", QoS.AT_LEAST_ONCE, True, "dev",
                      1_000 - 3_000_000, props, 1, "edge-a")  # fmt: skip
    fresh = Message(DEFAULT_TENANT, "fleet/new", b"n", QoS.AT_LEAST_ONCE, True, "dev",
                    1_000 - 1_000_000, props, 2, "edge-a")  # fmt: skip
    broker.retain_remote(expired)
    broker.retain_remote(fresh)
    later = _subscribe(broker, "later", "fleet/#")
    assert [p.topic for p in _publishes(later)] == ["fleet/new"]
