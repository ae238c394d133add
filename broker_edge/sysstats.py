"""``$SYS/broker/...`` statistics: what an edge node publishes about itself (pure; no I/O).

Theory of operation
-------------------
Every ``sys_interval`` seconds the node takes a :class:`Sample` of the broker (plain numbers, see
:func:`sample`) and hands it to :meth:`SysTree.update`, which returns the ``(topic, payload)``
pairs to publish now. Topic names and payload formats are Mosquitto's (mosquitto(8), "BROKER
STATUS", and its ``src/sys_tree.c``), so dashboards and ``mosquitto_sub -t '$SYS/#'`` read them
unchanged:

* counters and gauges are decimal integers, published only when the value changed since the
  last publish, as Mosquitto does; ``uptime`` (``"N seconds"``) is published every time, and
  ``version`` once (it never changes).
* ``load/.../1min|5min|15min`` are exponentially damped moving averages of a per-minute rate,
  computed as Mosquitto computes them: with ``dt`` seconds since the last sample and ``dn`` the
  counter's increase, ``rate = dn * 60 / dt`` and ``load = rate + exp(-dt / T) * (load - rate)``
  for ``T`` = 60, 300 and 900 s. They start at 0.00 and are published as ``"%.2f"`` whenever that
  text changes (Mosquitto compares the raw value with a 0.01 threshold instead, which can leave a
  slow decay unpublished; comparing the text is the same rule as every other topic).
* ``clients/maximum`` is the highest ``clients/total`` seen at a sample: like Mosquitto's, it is
  only computed when the tree is updated, so short-lived clients may be missed.
* ``store/messages/count`` (and its older name ``messages/stored``) is the deliveries held for
  sessions (queued plus in flight), ``store/messages/bytes`` their payload bytes. Mosquitto
  counts its deduplicated message store instead, which also holds retained messages; those are
  in ``retained messages/count`` here.
* ``load/connections/...`` averages CONNECT packets received, refused ones included (Mosquitto
  counts every CONNECT it handles); ``clients/expired`` counts disconnected sessions dropped
  because their session expiry interval ended (Mosquitto: ``persistent_client_expiration``).

Not journaled. ``$SYS`` values are derived from counters and regenerated every interval, and
Mosquitto does not persist them either; the journal is the record of what clients published, for
the pipeline. So the node publishes them with ``Broker.publish_system``: retained (a late
subscriber gets the latest values at once) and routed to live subscribers as QoS 0, but never
appended to the journal. After a restart they start again from zero, like the counters.

Tenants: the values are node-wide and published in the default tenant's namespace for now; who
may see which ``$SYS`` values is decided when tenants arrive. ``#`` and ``+`` subscribers never
get them: the topic tree does not walk wildcards into a first level starting with ``$``
[MQTT-4.7.2-1], and clients may not publish there (``Connection._on_publish``).

``messages/received`` counts the packets each connection's decoder returned (a malformed packet,
which closes its connection, is not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker_edge.broker import Broker
    from broker_edge.durability import GroupCommitter


@dataclass(slots=True)
class Stats:
    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    dropped: int = 0
    # MQTT packets of any type (Broker.receive, flush_dirty) and bytes on the wire, for $SYS.
    packets_in: int = 0
    packets_out: int = 0
    wire_bytes_in: int = 0
    wire_bytes_out: int = 0
    sockets_opened: int = 0
    connects: int = 0  # CONNECT packets received, refused ones too
    sessions_expired: int = 0  # disconnected sessions dropped at the end of their expiry
    # Times a publisher's reads were paused because the journal was behind.
    reads_paused: int = 0


PREFIX = "$SYS/broker/"
UPTIME = PREFIX + "uptime"

# Time constants of the load averages, as in Mosquitto's sys_tree.c.
LOAD_WINDOWS: tuple[tuple[str, float], ...] = (("1min", 60.0), ("5min", 300.0), ("15min", 900.0))

# $SYS/broker/load/<name>/<window> is the load of Sample.<field>.
LOADS: tuple[tuple[str, str], ...] = (
    ("messages/received", "messages_received"),
    ("messages/sent", "messages_sent"),
    ("publish/dropped", "publish_dropped"),
    ("publish/received", "publish_received"),
    ("publish/sent", "publish_sent"),
    ("bytes/received", "bytes_received"),
    ("bytes/sent", "bytes_sent"),
    ("sockets", "sockets"),
    ("connections", "connects"),
)

# $SYS/broker/<topic> carries Sample.<field> as a decimal integer.
GAUGES: tuple[tuple[str, str], ...] = (
    ("clients/connected", "clients_connected"),
    ("clients/disconnected", "clients_disconnected"),
    ("clients/total", "clients_total"),
    ("clients/expired", "clients_expired"),
    ("messages/received", "messages_received"),
    ("messages/sent", "messages_sent"),
    ("messages/inflight", "messages_inflight"),
    ("bytes/received", "bytes_received"),
    ("bytes/sent", "bytes_sent"),
    ("publish/messages/received", "publish_received"),
    ("publish/messages/sent", "publish_sent"),
    ("publish/messages/dropped", "publish_dropped"),
    ("publish/bytes/received", "publish_bytes_received"),
    ("publish/bytes/sent", "publish_bytes_sent"),
    ("retained messages/count", "retained_count"),
    ("subscriptions/count", "subscriptions_count"),
    ("store/messages/count", "store_count"),
    ("store/messages/bytes", "store_bytes"),
    ("messages/stored", "store_count"),  # Mosquitto's older name of store/messages/count
    # The journal (edgebus only, issue 9): "ok" / "full" / "error", why, and its numbers.
    ("journal/state", "journal_state"),
    ("journal/reason", "journal_reason"),
    ("journal/bytes", "journal_bytes"),
    ("journal/free_bytes", "journal_free_bytes"),
    ("journal/durable_seq", "journal_durable_seq"),
    ("journal/committed_seq", "journal_committed_seq"),
    ("journal/segments/removed", "journal_segments_removed"),
    ("journal/frames/synced_on_loop", "journal_frames_loop"),
    ("journal/frames/synced_in_thread", "journal_frames_thread"),
    ("journal/publish/refused", "journal_refused"),
    ("journal/publish/dropped", "journal_dropped"),
)


@dataclass(frozen=True, slots=True)
class Sample:
    """The broker's numbers at one instant. Counters only grow; gauges go up and down."""

    uptime: int = 0  # whole seconds since the node started
    clients_connected: int = 0
    clients_total: int = 0  # sessions: connected, plus persistent ones without a connection
    messages_received: int = 0  # MQTT packets of any type
    messages_sent: int = 0
    messages_inflight: int = 0  # QoS 1/2 deliveries awaiting acknowledgement
    bytes_received: int = 0  # on the wire
    bytes_sent: int = 0
    publish_received: int = 0
    publish_sent: int = 0
    publish_dropped: int = 0
    publish_bytes_received: int = 0  # payload bytes
    publish_bytes_sent: int = 0
    sockets: int = 0  # TCP connections accepted
    connects: int = 0  # CONNECT packets received (accepted or refused)
    clients_expired: int = 0  # disconnected sessions dropped when their expiry interval ended
    retained_count: int = 0
    subscriptions_count: int = 0
    store_count: int = 0  # deliveries held for sessions: queued plus in flight
    store_bytes: int = 0  # their payload bytes
    journal_state: str = "ok"
    journal_reason: str = ""  # why it is full or failing ("" when ok)
    journal_bytes: int = 0  # the node's segment files
    journal_free_bytes: int = -1  # on their filesystem (-1: not measured, no free-space limit)
    journal_durable_seq: int = 0
    journal_committed_seq: int = 0  # what the lake has committed ($control/journal/{node})
    journal_segments_removed: int = 0  # by retention since start
    journal_frames_loop: int = 0  # frames whose sync completed on the event loop (Linux AIO)
    journal_frames_thread: int = 0  # frames the commit thread wrote and synced
    journal_refused: int = 0  # QoS 1/2 publishes refused because of the journal
    journal_dropped: int = 0  # QoS 0 publishes dropped because of the journal
    # The edge mesh, when the edge may have peers: (topic under mesh/, value) pairs, e.g.
    # ("peers/10.0.0.2:1883", "up") (see broker_edge.meshlink.Mesh.sys_values).
    mesh: tuple[tuple[str, str], ...] = ()

    @property
    def clients_disconnected(self) -> int:
        return max(0, self.clients_total - self.clients_connected)


def sample(broker: Broker, uptime: int, journal: GroupCommitter | None = None) -> Sample:
    """Read ``broker``'s counters and sizes. Linear in sessions (queue and window sizes)."""
    stats = broker.stats
    inflight = queued = held_bytes = 0
    for session in broker.sessions.values():
        inflight += len(session.inflight)
        queued += len(session.queue)
        held_bytes += session.queued_bytes
        held_bytes += sum(len(out.message.payload) for out in session.inflight.values())
    namespaces = broker.namespaces.values()
    status = journal.status if journal is not None else None
    return Sample(
        uptime=uptime,
        clients_connected=len(broker.connections),
        clients_total=len(broker.sessions),
        messages_received=stats.packets_in,
        messages_sent=stats.packets_out,
        messages_inflight=inflight,
        bytes_received=stats.wire_bytes_in,
        bytes_sent=stats.wire_bytes_out,
        publish_received=stats.messages_in,
        publish_sent=stats.messages_out,
        publish_dropped=stats.dropped,
        publish_bytes_received=stats.bytes_in,
        publish_bytes_sent=stats.bytes_out,
        sockets=stats.sockets_opened,
        connects=stats.connects,
        clients_expired=stats.sessions_expired,
        retained_count=sum(len(ns.retained) for ns in namespaces),
        subscriptions_count=sum(len(ns.subscriptions) for ns in namespaces),
        store_count=inflight + queued,
        store_bytes=held_bytes,
        journal_state=status.state if status is not None else "ok",
        journal_reason=(
            "" if status is None else status.error if status.state == "error" else status.full
        ),
        journal_bytes=journal.bytes_on_disk if journal is not None else 0,
        journal_free_bytes=journal.free_bytes if journal is not None else -1,
        journal_durable_seq=journal.durable_seq if journal is not None else 0,
        journal_committed_seq=journal.lake_committed_seq if journal is not None else 0,
        journal_segments_removed=journal.segments_removed if journal is not None else 0,
        journal_frames_loop=journal.loop_commits if journal is not None else 0,
        journal_frames_thread=journal.thread_commits if journal is not None else 0,
        journal_refused=broker.journal_refused,
        journal_dropped=broker.journal_dropped,
        mesh=broker.mesh.sys_values() if broker.mesh is not None else (),
    )


def load_step(load: float, increase: int, dt: float, window: float) -> float:
    """One update of a load average: the per-minute rate over the last ``dt`` seconds, damped
    into ``load`` with time constant ``window`` (Mosquitto's calc_load)."""
    rate = increase * 60.0 / dt
    return rate + math.exp(-dt / window) * (load - rate)


def installed_version() -> str:
    """``$SYS/broker/version``: ``"edgebus <version>"`` of the installed distribution."""
    try:
        return f"edgebus {metadata.version('edgebus')}"
    except metadata.PackageNotFoundError:
        return "edgebus (not installed)"


class SysTree:
    """The ``$SYS/broker`` values last published, and the load averages between samples."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.maximum_clients = 0
        self.loads: dict[str, float] = {}  # topic -> current load average
        self._published: dict[str, bytes] = {}  # topic -> payload last published
        self._last: Sample | None = None
        self._last_at = 0.0

    def update(self, now: Sample, at: float) -> list[tuple[str, bytes]]:
        """The ``(topic, payload)`` pairs to publish for sample ``now`` taken at monotonic time
        ``at`` (seconds): uptime always, everything else only if its payload changed."""
        self.maximum_clients = max(self.maximum_clients, now.clients_total)
        self._update_loads(now, at)
        values: list[tuple[str, str]] = [(PREFIX + "version", self.version)]
        values += [(PREFIX + topic, str(getattr(now, name))) for topic, name in GAUGES]
        values.append((PREFIX + "clients/maximum", str(self.maximum_clients)))
        values += [(topic, f"{load:.2f}") for topic, load in self.loads.items()]
        values += [(PREFIX + "mesh/" + topic, text) for topic, text in now.mesh]
        out = [(UPTIME, f"{now.uptime} seconds".encode())]
        published = self._published
        for topic, text in values:
            payload = text.encode()
            if published.get(topic) != payload:
                published[topic] = payload
                out.append((topic, payload))
        return out

    def _update_loads(self, now: Sample, at: float) -> None:
        last = self._last
        if last is None:
            # The first sample has no rate yet: every load starts at 0.00, as in Mosquitto.
            self.loads = {
                f"{PREFIX}load/{name}/{window}": 0.0
                for name, _ in LOADS
                for window, _ in LOAD_WINDOWS
            }
        else:
            dt = at - self._last_at
            if dt <= 0:
                return  # no time passed: no rate (keep the baseline of the last sample)
            loads = self.loads
            for name, field in LOADS:
                increase = getattr(now, field) - getattr(last, field)
                for window, seconds in LOAD_WINDOWS:
                    topic = f"{PREFIX}load/{name}/{window}"
                    loads[topic] = load_step(loads[topic], increase, dt, seconds)
        self._last = now
        self._last_at = at
