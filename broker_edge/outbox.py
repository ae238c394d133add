"""Bytes out: deliveries turned into each client's packets, one transport write per turn.

Theory of operation
-------------------
The router says who gets a message (:data:`~broker_edge.router.Delivery` values); the outbox
turns each delivery into bytes through the subscriber's connection machine, or queues it in the
session while the client is offline, its socket buffer is over the high-water mark or its
in-flight window is full [MQTT-4.9.0-2]. Outbound QoS 1/2 exchanges open here (states.Flow
SENT_QOS1 / SENT_QOS2) and close in the router when the client acknowledges them.

Connections with output are marked; :meth:`Outbox.flush` writes each once. A connection whose
persistent-session change is not durable yet is *held*: its CONNACK or SUBACK waits for the
session log (see Broker.sync_sessions).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from broker_edge.connection import Connection
from broker_edge.logtext import printable
from broker_edge.message import Message
from broker_edge.packets import Pubrel, QoS
from broker_edge.router import Delivery
from broker_edge.session import Outbound, Pending, Session
from broker_edge.states import Flow, FlowEvent, local_step
from broker_edge.sysstats import Stats

log = logging.getLogger(__name__)

# Where a delivery's exchange stands once sent, by QoS (the table's SENT_QOS1/SENT_QOS2 steps,
# looked up once: this runs per QoS 1/2 delivery).
_SENT = {
    QoS.AT_LEAST_ONCE: local_step(Flow.DONE, FlowEvent.SENT_QOS1),
    QoS.EXACTLY_ONCE: local_step(Flow.DONE, FlowEvent.SENT_QOS2),
}


class Outbox:
    def __init__(
        self,
        stats: Stats,
        wall_clock_us: Callable[[], int],
        overflowed: Callable[[Session], None],
    ) -> None:
        self.stats = stats
        self.wall_clock_us = wall_clock_us
        self.overflowed = overflowed  # a session's queue dropped a message (log it)
        # Connections with output or closing, written at the next flush (the broker's hot
        # paths add to it directly: mark without the call).
        self.dirty: set[Connection] = set()
        # Connections whose output waits for the session log (see Broker.sync_sessions).
        self.held: set[Connection] = set()

    def mark(self, conn: Connection) -> None:
        """``conn`` has output (or is closing): write it at the next flush."""
        self.dirty.add(conn)

    def hold(self, conn: Connection) -> None:
        """Keep ``conn``'s output until :meth:`release` (its session change is not durable)."""
        self.held.add(conn)

    def release(self) -> set[Connection]:
        """Stop holding every held connection; returns them (the caller marks them)."""
        held, self.held = self.held, set()
        return held

    def forget(self, conn: Connection) -> None:
        self.dirty.discard(conn)
        self.held.discard(conn)

    def flush(self) -> None:
        """Write every connection's pending output: one transport write per connection.
        A connection whose session change is not durable yet waits (see sync_sessions)."""
        stats = self.stats
        while self.dirty:
            dirty = self.dirty
            self.dirty = set()
            held = self.held
            for conn in dirty:
                if held and conn in held:
                    continue  # its CONNACK/SUBACK waits for the session log
                out = conn.out
                if out:
                    stats.packets_out += len(out)  # one emit() per packet
                    data = conn.data_to_send()
                    stats.wire_bytes_out += len(data)
                    conn.io.write(data)
                if conn.closing and conn.closed():
                    conn.io.close()

    def emit(self, conn: Connection, data: bytes) -> None:
        if conn.emit(data):
            self.dirty.add(conn)

    def send(self, conn: Connection, packet: Any) -> None:
        if conn.send(packet):
            self.dirty.add(conn)

    def close(self, conn: Connection, reason: int | None, **kwargs: Any) -> None:
        """Close ``conn`` (after its output), MQTT 5 with DISCONNECT ``reason``."""
        conn.close(reason, **kwargs)
        self.dirty.add(conn)

    def resume_session(self, conn: Connection, session: Session) -> None:
        """Redeliver the in-flight window with DUP set, then what waited in the queue
        [MQTT-4.4.0-1]."""
        now_us = self.wall_clock_us()
        for pid, out in session.inflight.items():
            if out.state is Flow.OUT_AWAIT_PUBCOMP:
                self.send(conn, Pubrel(packet_id=pid))
            else:
                data = conn.publish_bytes(
                    out.message, out.qos, out.retain, pid, True, out.subscription_ids, now_us
                )
                if data is not None:
                    self.emit(conn, data)
        self.drain(session)

    def deliver(self, deliveries: list[Delivery]) -> None:
        """Turn the router's deliveries into bytes for their clients, or queue them."""
        stats = self.stats
        dirty = self.dirty
        for session, message, qos, retain, sub_ids in deliveries:
            conn = session.connection
            if (
                qos == 0
                and conn is not None
                and not conn.write_paused
                and not sub_ids
                and not conn.alias_out_max
                and not conn.max_packet_out
            ):
                # The hot path, straight out: one shared encoding per version and retain.
                size = len(message.payload)
                stats.messages_out += 1
                stats.bytes_out += size
                usage = conn.usage
                usage.messages_out += 1
                usage.bytes_out += size
                if conn.deliver_qos0(message, retain):
                    dirty.add(conn)
            elif (
                conn is not None
                and not conn.write_paused
                and len(session.inflight) < session.max_inflight  # Session.window_open
            ):
                # QoS 1/2 into an open window (deliver_one's common case, without its call).
                self._send_publish(conn, session, message, qos, retain, sub_ids)
            else:
                self.deliver_one(session, conn, message, qos, retain, sub_ids)

    def deliver_whole(
        self, deliveries: list[Delivery], count: int, size: int, wire: bytes, version: int
    ) -> list[Delivery]:
        """A QoS 0 run's deliveries (Broker.accept_run: ``count`` messages, ``size`` payload
        bytes, ``wire`` their packets as they came, of protocol ``version``): :meth:`deliver`'s
        QoS 0 hot path for the whole run at once, to the connected subscribers of that version
        that take the packets as they are; returns the others, to be delivered message by
        message."""
        rest = []
        for delivery in deliveries:
            session, _, _, retain, sub_ids = delivery
            conn = session.connection
            if (
                conn is not None
                and conn.version == version
                and not retain  # a QoS 0 message: its delivery's QoS is 0 too
                and not conn.write_paused
                and not sub_ids
                and not conn.alias_out_max
                and not conn.max_packet_out
            ):
                self._sent(conn, count, size, wire)
            else:
                rest.append(delivery)
        return rest

    def _sent(self, conn: Connection, count: int, size: int, data: bytes) -> None:
        """``count`` deliveries of ``size`` payload bytes, in ``data``, to ``conn``: counted and
        queued for its next write (the run paths; the one-message paths count inline)."""
        stats = self.stats
        stats.messages_out += count
        stats.bytes_out += size
        usage = conn.usage
        usage.messages_out += count
        usage.bytes_out += size
        if conn.emit(data):
            self.dirty.add(conn)

    def deliver_run(
        self,
        session: Session,
        messages: list[Message],
        qos: QoS,
        retain: bool,
        sub_ids: tuple[int, ...],
    ) -> None:
        """One session's deliveries of a run (Broker.accept_run: QoS 1 messages to one topic,
        each with its publisher's packet in ``wire``), as :meth:`deliver` makes them: those
        that fit the in-flight window go out as the publisher's packets with this session's
        packet ids, in one write; the rest, and any delivery the shortcut does not cover,
        through :meth:`deliver`."""
        conn = session.connection
        wire = messages[0].wire
        if (
            qos != 1
            or conn is None
            or conn.write_paused
            or retain
            or sub_ids
            or conn.alias_out_max
            or conn.max_packet_out
            or wire is None
            or wire[0] != conn.version
            or session.queue  # what waits goes first
        ):
            self.deliver([(session, message, qos, retain, sub_ids) for message in messages])
            return
        room = session.max_inflight - len(session.inflight)
        now = messages[:room] if room < len(messages) else messages
        inflight = session.inflight
        sent = _SENT[qos]
        parts: list[bytes] = []
        size = 0
        for message in now:
            pid = session.next_packet_id()
            assert pid is not None  # the window is far below 65535
            _, at, raw = message.wire  # type: ignore[misc]
            parts += (raw[:at], pid.to_bytes(2, "big"), raw[at + 2 :])
            size += len(message.payload)
            inflight[pid] = Outbound(message, qos, False, sent, ())
        count = len(now)
        self._sent(conn, count, size, b"".join(parts))
        if count < len(messages):
            self.deliver([(session, message, qos, retain, sub_ids) for message in messages[count:]])

    # -- deliveries: the outbound QoS flows (states.Flow.OUT_*) ------------------------------

    def deliver_one(
        self,
        session: Session,
        conn: Connection | None,
        message: Message,
        qos: QoS,
        retain: bool,
        sub_ids: tuple[int, ...] = (),
    ) -> None:
        if conn is None or conn.write_paused or (qos and not session.window_open()):
            if (qos or conn is not None) and not self._enqueue(
                session, message, qos, retain, sub_ids
            ):
                self.stats.dropped += 1
            return
        self._send_publish(conn, session, message, qos, retain, sub_ids)

    def _enqueue(
        self, session: Session, message: Message, qos: QoS, retain: bool, sub_ids: tuple[int, ...]
    ) -> bool:
        ok = session.enqueue(Pending(message, qos, retain, sub_ids))
        if not ok and (session.dropped in {1, 10, 100, 1000} or session.dropped % 10_000 == 0):
            self.overflowed(session)
            log.warning(
                "queue of %s/%s full (%d messages / %d bytes): dropped %d message(s) so far",
                session.tenant,
                printable(session.client_id),
                session.max_queued,
                session.max_queued_bytes,
                session.dropped,
            )
        return ok

    def _send_publish(
        self,
        conn: Connection,
        session: Session,
        message: Message,
        qos: QoS,
        retain: bool,
        sub_ids: tuple[int, ...],
    ) -> None:
        pid = None
        if qos:
            pid = session.next_packet_id()
            assert pid is not None  # the window is far below 65535
        wire = message.wire
        if (
            wire is not None
            and wire[0] == conn.version
            and qos == message.qos
            and not retain
            and not sub_ids
            and not conn.alias_out_max
            and not conn.max_packet_out
        ):
            # The publisher's own packet (no properties, so no expiry either), with this
            # client's packet id in place of the publisher's.
            _, at, raw = wire
            assert pid is not None  # the publisher's QoS is 1 or 2
            data: bytes | None = b"".join((raw[:at], pid.to_bytes(2, "big"), raw[at + 2 :]))
        else:
            # The clock only for a message whose expiry counts down [MQTT-3.3.2-6].
            expires = message.properties.message_expiry_interval is not None
            now_us = self.wall_clock_us() if expires else 0
            data = conn.publish_bytes(message, qos, retain, pid, False, sub_ids, now_us)
        if data is None:
            # Over the client's maximum packet size: dropped for it [MQTT-3.1.2-25].
            log.info(
                "PUBLISH over %s's maximum packet size %d: not sent",
                printable(conn.client_id),
                conn.max_packet_out,
            )
            self.stats.dropped += 1
            return
        size = len(message.payload)
        self.stats.messages_out += 1
        self.stats.bytes_out += size
        conn.usage.messages_out += 1
        conn.usage.bytes_out += size
        if pid is not None:
            session.inflight[pid] = Outbound(message, qos, retain, _SENT[qos], sub_ids)
        if conn.emit(data):  # not self.emit: one call less per QoS 1/2 delivery
            self.dirty.add(conn)

    def drain(self, session: Session) -> None:
        """Send what waits in the session's queue while the client can take it."""
        conn = session.connection
        if conn is None or not session.queue:
            return  # most acks: nothing waits (and no clock read)
        now_us = self.wall_clock_us()
        while session.queue and not conn.write_paused:
            head = session.queue[0]
            if head.qos > QoS.AT_MOST_ONCE and not session.window_open():
                return
            session.pop()
            expiry = head.message.properties.message_expiry_interval
            if expiry is not None and now_us - head.message.ts_us >= expiry * 1_000_000:
                continue  # expired while waiting: never delivered [MQTT-3.3.2-5]
            self._send_publish(
                conn, session, head.message, head.qos, head.retain, head.subscription_ids
            )
