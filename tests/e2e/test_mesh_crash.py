"""QoS 1 (and 2) across the edge mesh survives a SIGKILL of either edge (issue 11): three real
``edgebus edge`` processes meshed (tests.helpers.mesh_edges), a stock paho publisher streaming
numbered QoS 1 messages on edge A and a paho subscriber with a persistent session on edge B.
Whatever A acknowledged reaches the subscriber, and nothing reaches it twice."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt
import pytest

from tests.helpers.edge_process import TENANT_TOKEN, EdgeProcess
from tests.helpers.mesh_clients import SETTLE, numbers_until_quiet, settle
from tests.helpers.mesh_edges import meshed, sys_values, wait_inbound_up
from tests.integration.conftest import Client, Received

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

# How long the subscriber waits for the stream, and then for a copy too many.
ARRIVAL = 45.0
QUIET = 2.0
# What a subscriber gets, as (number, DUP flag).
Numbered = queue.Queue[tuple[int, bool]]


@pytest.fixture(scope="module")
def edges(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EdgeProcess]]:
    with meshed(tmp_path_factory.mktemp("mesh-crash")) as started:
        yield started


def _connect(port: int, client_id: str, *, clean: bool, numbered: Numbered | None = None) -> Client:
    """A paho 3.1.1 client of tenant acme on the edge at ``port``, connected and looping;
    with ``numbered``, what it gets goes there as (number, DUP flag) from the start."""
    paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean)
    client = Client(paho)
    connected: queue.Queue[bool] = queue.Queue()
    paho.on_connect = lambda c, u, flags, rc, props: connected.put(not rc.is_failure)
    paho.on_message = lambda c, u, m: client.messages.put(
        Received(m.topic, m.payload, m.qos, bool(m.retain))
    )
    if numbered is not None:
        paho.on_message = lambda c, u, m: numbered.put((int(m.payload), bool(m.dup)))
    paho.on_disconnect = lambda c, u, flags, rc, props: client.disconnected.set()
    paho.username_pw_set(TENANT_TOKEN)
    # Few publishes in flight: a stream is still going when a test kills an edge right after
    # queueing the rest of it.
    paho.max_inflight_messages_set(5)
    paho.connect("127.0.0.1", port)
    paho.loop_start()
    assert connected.get(timeout=SETTLE)
    return client


@dataclass
class Stream:
    """A QoS 1 publisher of numbered payloads on one edge, never sending one twice: after a
    broken connection it stops (paho would send again what was not acknowledged)."""

    client: Client
    topic: str
    qos: int = 1
    sent: list[tuple[int, mqtt.MQTTMessageInfo]] = field(default_factory=list)

    def send(self, numbers: range) -> None:
        for number in numbers:
            info = self.client.paho.publish(self.topic, str(number).encode(), qos=self.qos)
            self.sent.append((number, info))

    def acked(self) -> set[int]:
        return {number for number, info in self.sent if info.is_published()}

    def wait_acked(self, count: int) -> None:
        deadline = time.monotonic() + ARRIVAL
        while len(self.acked()) < count:
            assert time.monotonic() < deadline, f"{len(self.acked())} acknowledged"
            time.sleep(0.01)

    def killed_midway(self, edge: EdgeProcess, first: int, total: int) -> set[int]:
        """Send ``first`` numbers and wait for their acks, queue the rest up to ``total`` and
        SIGKILL ``edge`` (this stream's) at once: what it acknowledged. No reconnect."""
        self.send(range(first))
        self.wait_acked(first)
        self.send(range(first, total))
        edge.kill()
        assert self.client.disconnected.wait(SETTLE)
        self.client.paho.loop_stop()
        acked = self.acked()
        assert len(acked) < total  # killed in the middle of it
        return acked


def _stream_on(edge: EdgeProcess, client_id: str, topic: str, numbers: range) -> set[int]:
    """A new publisher on ``edge`` sends ``numbers``, every one acknowledged."""
    stream = Stream(_connect(edge.mqtt_port, client_id, clean=True), topic)
    stream.send(numbers)
    stream.wait_acked(len(numbers))
    stream.client.close()
    return stream.acked()


def _subscriber(b: EdgeProcess, client_id: str, topic_filter: str, publisher: Client) -> Client:
    """A persistent session on B subscribed to ``topic_filter`` at QoS 1, which ``publisher``'s
    edge routes to (probes crossed)."""
    sub = _connect(b.mqtt_port, client_id, clean=False)
    sub.subscribe(topic_filter, qos=1)
    settle(publisher.paho, [sub], topic_filter.replace("#", "probe"))
    return sub


def _arrivals(sub: Client, wanted: set[int]) -> list[int]:
    """The numbers ``sub`` gets until it has every one of ``wanted``, then until it is quiet."""
    return numbers_until_quiet(sub, wanted, ARRIVAL, QUIET)


def _assert_once(got: list[int], acked: set[int], published: int) -> None:
    twice = sorted({n for n in got if got.count(n) > 1})
    assert not twice, f"delivered twice: {twice[:20]}"
    assert acked <= set(got)
    assert set(got) <= set(range(published))


def _wait_snapshot_holds(edge: EdgeProcess, topic_filter: str) -> None:
    """Until ``edge``'s state snapshot holds a peer's ``topic_filter`` (it follows a change of
    a peer's filters within about a second: a crash before it does not know the filter)."""
    snapshot = edge.data_dir / "state" / edge.node / "snapshot.json"
    deadline = time.monotonic() + SETTLE
    while f'"{topic_filter}"'.encode() not in (snapshot.read_bytes() if snapshot.exists() else b""):
        assert time.monotonic() < deadline, f"{edge.node}'s snapshot never held {topic_filter}"
        time.sleep(0.05)


def _sys(edge: EdgeProcess, name: str) -> int:
    """``$SYS/broker/mesh/publish/{name}`` on ``edge``."""
    topic = f"$SYS/broker/mesh/publish/{name}"
    return int(sys_values(edge.mqtt_port, topic, lambda values: topic in values)[topic])


def _restart(edge: EdgeProcess, *linked: EdgeProcess) -> None:
    """Start ``edge`` again (same data dir, same ports) and wait until each of ``linked`` has
    its link to it up again (``edge``'s publishes reach them on it)."""
    edge.start()
    for peer in linked:
        wait_inbound_up(edge, peer.node)


def test_sigkill_of_the_origin_mid_stream(edges: list[EdgeProcess]) -> None:
    """The receiver keeps running: what the restarted origin sends again (all it had not had
    acknowledged, from its journal) is dropped by (origin, seq)."""
    a, b, _ = edges
    pub = _connect(a.mqtt_port, "kill-a-pub", clean=True)
    sub = _subscriber(b, "kill-a-sub", "kill-a/#", pub)
    _wait_snapshot_holds(a, "kill-a/#")
    duplicates = _sys(b, "duplicates")
    acked = Stream(pub, "kill-a/x").killed_midway(a, 120, 400)
    _restart(a, b)
    # What B had not acknowledged when A last snapshotted, from A's journal (B acknowledges
    # only once its own snapshot holds them, so some always wait in a stream).
    assert _sys(a, "replayed") > 0
    acked |= _stream_on(a, "kill-a-pub-2", "kill-a/x", range(400, 500))
    _assert_once(_arrivals(sub, acked), acked, 500)
    assert _sys(b, "duplicates") > duplicates  # what B had, sent again and dropped
    sub.close()


def test_sigkill_of_the_origin_while_the_receiver_is_away(edges: list[EdgeProcess]) -> None:
    """Both die: the origin's journal is all that holds what the receiver had not had, and its
    snapshot what the receiver wanted."""
    a, b, _ = edges
    pub = _connect(a.mqtt_port, "away-pub", clean=True)
    sub = _subscriber(b, "away-sub", "away/#", pub)
    sub.close()
    _wait_snapshot_holds(a, "away/#")
    b.kill()
    acked = Stream(pub, "away/x").killed_midway(a, 100, 300)
    a.start()
    assert _sys(a, "replayed") >= len(acked)  # taken back from its journal for B
    acked |= _stream_on(a, "away-pub-2", "away/x", range(300, 350))
    _restart(b, a)
    back = _connect(b.mqtt_port, "away-sub", clean=False)
    _assert_once(_arrivals(back, acked), acked, 350)
    back.close()


def test_sigkill_of_the_receiver_mid_stream(edges: list[EdgeProcess]) -> None:
    """The subscriber's session is offline, queued on B: what B had queued and not made
    durable in a snapshot it had not acknowledged, so A sends it again."""
    a, b, _ = edges
    pub = _connect(a.mqtt_port, "kill-b-pub", clean=True)
    sub = _subscriber(b, "kill-b-sub", "kill-b/#", pub)
    sub.close()
    stream = Stream(pub, "kill-b/x")
    stream.send(range(300))
    stream.wait_acked(120)
    b.kill()
    stream.send(range(300, 400))
    _restart(b, a)
    stream.wait_acked(400)
    back = _connect(b.mqtt_port, "kill-b-sub", clean=False)
    _assert_once(_arrivals(back, stream.acked()), set(range(400)), 400)
    back.close()
    pub.close()


def _numbered(client: Client) -> Numbered:
    """What ``client`` gets from now on, as (number, DUP flag)."""
    arrivals: Numbered = queue.Queue()
    client.paho.on_message = lambda c, u, m: arrivals.put((int(m.payload), bool(m.dup)))
    return arrivals


def _until_quiet(arrivals: Numbered, wanted: set[int]) -> list[tuple[int, bool]]:
    """What ``arrivals`` gets until it has every one of ``wanted``, then until it is quiet."""
    got: list[tuple[int, bool]] = []
    deadline = time.monotonic() + ARRIVAL
    while not wanted <= {n for n, _ in got}:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"missing {sorted(wanted - {n for n, _ in got})[:20]}"
        with contextlib.suppress(queue.Empty):
            got.append(arrivals.get(timeout=remaining))
    with contextlib.suppress(queue.Empty):
        while True:
            got.append(arrivals.get(timeout=QUIET))
    return got


def _killed_while_delivering(
    b: EdgeProcess, sub: Client, got: Numbered, stream: Stream, total: int
) -> list[tuple[int, bool]]:
    """``stream`` sends ``total`` numbers through B to ``sub``; B is SIGKILLed once ``sub`` has
    a fifth of them (B in the middle of delivering the rest). What ``sub`` got by then."""
    stream.send(range(total))
    first: list[tuple[int, bool]] = []
    while len(first) < total // 5:
        first.append(got.get(timeout=ARRIVAL))
    b.kill()
    assert sub.disconnected.wait(SETTLE)
    stream.wait_acked(total)
    return first


def test_sigkill_of_the_receiver_with_its_subscriber_online(edges: list[EdgeProcess]) -> None:
    """B delivers A's stream to an online persistent session and dies in the middle of it:
    what B delivered before a snapshot held it was in its session log first, so the restarted B
    drops A's copies sent again (by origin and seq). The subscriber gets every message; a
    message twice only as the MQTT redelivery of one whose PUBACK B had not made durable (DUP=1,
    at most B's in-flight window: see broker_edge.receipts)."""
    a, b, _ = edges
    pub = _connect(a.mqtt_port, "online-pub", clean=True)
    sub = _subscriber(b, "online-sub", "online/#", pub)
    got = _numbered(sub)
    total = 1000  # below edge.max_queued_messages: B queues what A sends while it is away
    first = _killed_while_delivering(b, sub, got, Stream(pub, "online/x"), total)
    sub.paho.loop_stop()
    while not got.empty():
        first.append(got.get())
    assert len(first) < total  # killed in the middle of it
    _restart(b, a)
    again: Numbered = queue.Queue()  # B sends what it put back in flight at once
    back = _connect(b.mqtt_port, "online-sub", clean=False, numbered=again)
    arrivals = first + _until_quiet(again, set(range(total)) - {n for n, _ in first})
    numbers = [n for n, _ in arrivals]
    assert set(numbers) == set(range(total)), f"missing {sorted(set(range(total)) - set(numbers))}"
    seen: set[int] = set()
    second = []
    for number, dup in arrivals:
        if number in seen:
            second.append((number, dup))
        seen.add(number)
    assert all(dup for _, dup in second), f"delivered again as new: {second[:20]}"
    assert len(second) <= 100  # edge.max_inflight_messages: what B had sent and not had acked
    assert _sys(b, "duplicates") > 0  # A's copies sent again, dropped by the restarted B
    back.close()
    pub.close()


def test_sigkill_of_the_receiver_with_its_qos2_subscriber_online(edges: list[EdgeProcess]) -> None:
    """As above at QoS 2, the subscriber a paho client that keeps its session state (the QoS 2
    packet ids not yet released) and reconnects to the restarted B by itself: B sends again
    only what it had not had received, and a PUBREL only for what it had: every message once."""
    a, b, _ = edges
    pub = _connect(a.mqtt_port, "online2-pub", clean=True)
    sub = _connect(b.mqtt_port, "online2-sub", clean=False)
    sub.subscribe("online2/#", qos=2)
    settle(pub.paho, [sub], "online2/probe")
    got = _numbered(sub)
    total = 600  # below edge.max_queued_messages: B queues what A sends while it is away
    first = _killed_while_delivering(b, sub, got, Stream(pub, "online2/x", qos=2), total)
    _restart(b, a)  # the subscriber's paho reconnects on its own, with its session state
    arrivals = first + _until_quiet(got, set(range(total)) - {n for n, _ in first})
    numbers = [n for n, _ in arrivals]
    twice = sorted({n for n in numbers if numbers.count(n) > 1})
    assert not twice, f"delivered twice: {twice[:20]}"
    assert sorted(numbers) == list(range(total))
    assert _sys(b, "duplicates") > 0  # A's copies sent again, dropped by the restarted B
    sub.close()
    pub.close()
