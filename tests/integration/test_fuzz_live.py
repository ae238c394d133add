"""Garbage from many raw sockets against the live edge while a good paho pair keeps working.

Theory of operation
-------------------
A pool of threads opens ``GARBAGE_CONNECTIONS`` raw TCP connections, 16 at a time, each driven
by its own ``random.Random(seed)``, so every run sends the same bytes and a failure names the
seed that reproduces it. The kinds of garbage:

* ``random``: random bytes from the first byte on;
* ``mutated``: a valid CONNECT and a few packets (3.1.1 or 5.0, built with the codec's
  encoder), then bytes flipped, set, inserted, deleted or cut;
* ``truncated``: the same valid stream cut short;
* ``connect_then_garbage``: a valid CONNECT, its CONNACK, then random or mutated packets;
* ``oversized_length``: remaining lengths of 256 MB (the default limit) or five bytes long;
* ``dribble``: a valid stream, or a mutated one, sent one byte at a time.

Meanwhile a paho publisher sends numbered QoS 1 messages to a paho subscriber until the garbage
is done. The invariants, all from the spec or from "one bad client must not hurt the others":

* the subscriber receives exactly the messages sent, in order [MQTT-4.6.0-2], and nothing else:
  no garbage connection routed anything to it;
* whatever the edge sends to a garbage connection starts with CONNACK [MQTT-3.2.0-1]; where the
  garbage began with a valid CONNECT the CONNACK accepts it, every later packet parses, a 3.1.1
  client never gets a DISCONNECT (Table 2.1) and a 5.0 DISCONNECT carries an error code and
  comes last (4.13.1);
* a valid stream dribbled byte by byte gets the same answers as one sent whole;
* no garbage reaches the edge's "internal error" path (an ERROR log record);
* afterwards the edge has dropped every garbage connection and still serves new clients.
"""

from __future__ import annotations

import logging
import random
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt

from broker_edge.codec import Decoder, encode
from broker_edge.errors import ProtocolError
from broker_edge.packets import (
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Properties,
    ProtocolVersion,
    Puback,
    Publish,
    Pubrel,
    QoS,
    Subscribe,
    Subscription,
    Unsubscribe,
    Will,
)

TIMEOUT = 10.0
GARBAGE_CONNECTIONS = 72
WORKERS = 16
LISTEN_AFTER = 0.4  # how long a garbage client keeps reading after its last byte
DRIBBLE_GAP = 0.002
DRIBBLE_MAX_BYTES = 160
MAX_GOOD_MESSAGES = 5000  # bound on the good pair, whatever the garbage does

GOOD_TOPIC = "fuzz/good"
GOOD_IDS = ("fuzz-good-sub", "fuzz-good-pub")
VERSIONS = (ProtocolVersion.MQTT_3_1_1, ProtocolVersion.MQTT_5)


# -- valid material to damage ---------------------------------------------------------------------


def _connect(rng: random.Random, version: ProtocolVersion, client_id: str) -> Connect:
    will = None
    if rng.random() < 0.5:
        # Wills are published when garbage closes a connection [MQTT-3.1.2-8]: keep them (and
        # every other garbage topic) under junk/, away from the good subscriber's filter.
        will = Will("junk/will", b"gone", QoS(rng.randint(0, 2)), rng.random() < 0.3)
    return Connect(
        client_id=client_id,
        protocol_version=version,
        clean_start=rng.random() < 0.8,
        keepalive=rng.choice([0, 10, 60]),
        will=will,
    )


def _packet(rng: random.Random, version: ProtocolVersion) -> Packet:
    pid = rng.randint(1, 0xFFFF)
    qos = QoS(rng.randint(0, 2))
    v5 = version == ProtocolVersion.MQTT_5
    choice = rng.randrange(7)
    if choice == 0:
        props = Properties(content_type="junk", user_properties=(("k", "v"),)) if v5 else None
        return Publish(
            topic=f"junk/{rng.randrange(100)}",
            payload=rng.randbytes(rng.randint(0, 64)),
            qos=qos,
            retain=rng.random() < 0.2,
            packet_id=pid if qos else None,
            properties=props or Properties(),
        )
    if choice == 1:
        return Subscribe(pid, (Subscription(f"junk/{rng.randrange(10)}/#", qos),))
    if choice == 2:
        return Unsubscribe(pid, ("junk/#",))
    if choice == 3:
        return Puback(pid)
    if choice == 4:
        return Pubrel(pid)
    if choice == 5:
        return Disconnect()
    return Pingreq()


def _valid_stream(rng: random.Random, version: ProtocolVersion, client_id: str) -> bytes:
    packets = [_connect(rng, version, client_id)]
    packets += [_packet(rng, version) for _ in range(rng.randint(1, 4))]
    return b"".join(encode(p, version) for p in packets)


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """1-4 random edits, the same operations as the codec's property-based fuzz test."""
    wire = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(max(len(wire), 1))
        op = rng.choice(("flip", "set", "insert", "delete", "truncate"))
        if op == "flip" and wire:
            wire[at] ^= 1 << rng.randrange(8)
        elif op == "set" and wire:
            wire[at] = rng.randrange(256)
        elif op == "insert":
            wire[at:at] = rng.randbytes(rng.randint(1, 4))
        elif op == "delete":
            del wire[at : at + rng.randint(1, 4)]
        else:
            del wire[max(at, 1) :]
    return bytes(wire)


# -- one garbage connection ------------------------------------------------------------------------


@dataclass
class Session:
    """What one garbage connection sent and got back; ``problems`` are invariant breaches."""

    kind: str
    seed: int
    sent: bytearray = field(default_factory=bytearray)
    received: bytearray = field(default_factory=bytearray)
    problems: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (
            f"{self.kind} seed={self.seed}: sent [{bytes(self.sent).hex(' ')}] "
            f"received [{bytes(self.received).hex(' ')}]: {'; '.join(self.problems)}"
        )


class Garbage:
    """A raw client that tolerates the edge closing on it at any point."""

    def __init__(self, port: int, session: Session) -> None:
        self.session = session
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.open = True

    def send(self, data: bytes) -> None:
        if not self.open:
            return
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.open = False
            return
        self.session.sent += data

    def dribble(self, data: bytes) -> None:
        for i in range(min(len(data), DRIBBLE_MAX_BYTES)):
            self.send(data[i : i + 1])
            time.sleep(DRIBBLE_GAP)  # the point of this kind: one byte per read at the edge

    def read(
        self, until: Callable[[bytes], bool] = lambda data: False, wait: float = LISTEN_AFTER
    ) -> None:
        """Read until the edge closes, ``until(received)`` holds, or ``wait`` passes."""
        deadline = time.monotonic() + wait
        while self.open and (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.open = False
                return
            self.session.received += chunk
            if until(bytes(self.session.received)):
                return

    def close(self) -> None:
        self.sock.close()


def _client_packets(data: bytes, version: ProtocolVersion) -> list[Packet]:
    """Whole packets in what the edge sent, read as a client of ``version`` reads them."""
    decoder = Decoder(protocol_version=version)
    decoder.feed(data)
    return list(decoder.packets())


def _check_first_byte(session: Session) -> None:
    # [MQTT-3.2.0-1] "The first packet sent from the Server to the Client MUST be a CONNACK".
    if session.received and session.received[0] != 0x20:
        session.problems.append("first packet from the edge is not CONNACK")


def _check_answers(session: Session, version: ProtocolVersion) -> list[Packet]:
    """Answers to a stream that began with a valid CONNECT."""
    try:
        packets = _client_packets(bytes(session.received), version)
    except ProtocolError as exc:
        session.problems.append(f"edge sent bytes a {version.name} client cannot parse: {exc}")
        return []
    if not packets or not isinstance(packets[0], Connack) or packets[0].reason_code != 0:
        session.problems.append("a valid CONNECT was not accepted with CONNACK 0x00")
    disconnects = [i for i, p in enumerate(packets) if isinstance(p, Disconnect)]
    if version != ProtocolVersion.MQTT_5 and disconnects:
        session.problems.append("DISCONNECT sent to a 3.1.1 client (Table 2.1: client only)")
    for i in disconnects:
        packet = packets[i]
        assert isinstance(packet, Disconnect)
        if packet.reason_code < 0x80 or i != len(packets) - 1:
            session.problems.append(f"DISCONNECT 0x{packet.reason_code:02X} at {i}")
    return packets


def _random(garbage: Garbage, rng: random.Random) -> None:
    garbage.send(rng.randbytes(rng.randint(1, 512)))
    garbage.read()


def _mutated(garbage: Garbage, rng: random.Random) -> None:
    version = rng.choice(VERSIONS)
    garbage.send(_mutate(rng, _valid_stream(rng, version, f"junk-m{garbage.session.seed}")))
    garbage.read()


def _truncated(garbage: Garbage, rng: random.Random) -> None:
    version = rng.choice(VERSIONS)
    stream = _valid_stream(rng, version, f"junk-t{garbage.session.seed}")
    garbage.send(stream[: rng.randint(1, len(stream) - 1)])
    garbage.read()


def _connect_then_garbage(garbage: Garbage, rng: random.Random) -> None:
    version = rng.choice(VERSIONS)
    connect = _connect(rng, version, f"junk-c{garbage.session.seed}")
    garbage.send(encode(connect, version))
    garbage.read(until=lambda data: bool(_whole_packets(data)), wait=TIMEOUT)
    if rng.random() < 0.5:
        tail = rng.randbytes(rng.randint(1, 256))
    else:
        packets = [_packet(rng, version) for _ in range(rng.randint(1, 4))]
        tail = _mutate(rng, b"".join(encode(p, version) for p in packets))
    garbage.send(tail)
    garbage.read()
    _check_answers(garbage.session, version)


def _oversized_length(garbage: Garbage, rng: random.Random) -> None:
    version = rng.choice(VERSIONS)
    first = rng.choice((0x10, 0x30, 0x32, 0x82, 0xC0, 0xE0))
    # Four bytes is 268,435,455, the largest remaining length (1.5.5); a fifth byte is invalid.
    length = rng.choice((b"\xff\xff\xff\x7f", b"\xff\xff\xff\xff\x7f", b"\x80\x80\x80\x01"))
    if rng.random() < 0.5:
        garbage.send(encode(_connect(rng, version, f"junk-o{garbage.session.seed}"), version))
    garbage.send(bytes((first,)) + length + rng.randbytes(rng.randint(0, 4096)))
    garbage.read()


def _dribble(garbage: Garbage, rng: random.Random) -> None:
    version = rng.choice(VERSIONS)
    client_id = f"junk-d{garbage.session.seed}"
    if rng.random() < 0.5:
        garbage.dribble(_mutate(rng, _valid_stream(rng, version, client_id)))
        garbage.read()
        return
    # Valid input split into one-byte reads gets the answers it would get whole.
    stream = [
        Connect(client_id, protocol_version=version, keepalive=60),
        Publish("junk/dribble", b"d", QoS.AT_LEAST_ONCE, packet_id=7),
        Pingreq(),
    ]
    garbage.dribble(b"".join(encode(p, version) for p in stream))
    # The PUBACK waits for the journal commit, which the load can slow down: wait for it.
    garbage.read(until=lambda data: len(_whole_packets(data)) >= 3, wait=TIMEOUT)
    answers = _check_answers(garbage.session, version)
    kinds = sorted(type(p).__name__ for p in answers[1:])
    if kinds != ["Pingresp", "Puback"] or Puback(7) not in answers:
        garbage.session.problems.append(f"byte-by-byte valid input answered with {answers}")


KINDS: dict[str, Callable[[Garbage, random.Random], None]] = {
    "random": _random,
    "mutated": _mutated,
    "truncated": _truncated,
    "connect_then_garbage": _connect_then_garbage,
    "oversized_length": _oversized_length,
    "dribble": _dribble,
}


def _whole_packets(data: bytes) -> list[bytes]:
    """Complete packets at the start of ``data`` (framing only, no decoding)."""
    out, pos = [], 0
    while pos < len(data):
        start, pos, length = pos, pos + 1, 0
        for shift in (0, 7, 14, 21):
            if pos >= len(data):
                return out
            byte, pos = data[pos], pos + 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
        if pos + length > len(data):
            return out
        pos += length
        out.append(data[start:pos])
    return out


def _run_garbage(port: int, seed: int) -> Session:
    kind = list(KINDS)[seed % len(KINDS)]
    session = Session(kind, seed)
    garbage = Garbage(port, session)
    try:
        KINDS[kind](garbage, random.Random(seed))
    finally:
        garbage.close()
    _check_first_byte(session)
    return session


# -- the test --------------------------------------------------------------------------------------


def _edge_client_ids(edge) -> list[str]:
    return edge.call(lambda: sorted(cid for _, cid in edge.node.broker.connections))


def test_garbage_connections_do_not_disturb_a_good_pair(edge, connect, caplog):
    caplog.set_level(logging.WARNING, logger="broker_edge")
    sub = connect(GOOD_IDS[0], protocol=mqtt.MQTTv5)
    sub.subscribe(GOOD_TOPIC, qos=1)
    pub = connect(GOOD_IDS[1])

    with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="garbage") as pool:
        futures = [
            pool.submit(_run_garbage, edge.port, seed) for seed in range(GARBAGE_CONNECTIONS)
        ]
        sent = 0
        # Keep the good pair busy for as long as the garbage lasts (and a little after).
        while sent < MAX_GOOD_MESSAGES and (sent < 20 or not all(f.done() for f in futures)):
            pub.publish(GOOD_TOPIC, str(sent).encode(), qos=1)  # waits for PUBACK
            sent += 1
        sessions = [f.result() for f in futures]

    assert sent < MAX_GOOD_MESSAGES, "garbage never finished"
    payloads = [sub.get().payload for _ in range(sent)]
    assert payloads == [str(i).encode() for i in range(sent)]
    sub.nothing_more()

    broken = [str(s) for s in sessions if s.problems]
    assert not broken, "\n".join(broken)
    assert {s.kind for s in sessions} == set(KINDS)

    internal = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not internal, [r.getMessage() for r in internal]

    # Every garbage connection was closed by its client or the edge; the edge lets go of all
    # of them (connection_lost runs on the edge's loop, so allow it a moment).
    deadline = time.monotonic() + TIMEOUT
    while (ids := _edge_client_ids(edge)) != sorted(GOOD_IDS) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ids == sorted(GOOD_IDS)

    # Still accepting: a new client subscribes and gets a message through.
    late = connect("fuzz-late")
    late.subscribe("fuzz/late", qos=1)
    pub.publish("fuzz/late", b"still serving", qos=1)
    assert late.get().payload == b"still serving"
    sub.nothing_more(wait=0.1)
