"""Typed settings of one broker edge node. Loaded from TOML by ``edgebus.settings``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from broker_edge.errors import ConfigError

MAX_REMAINING_LENGTH = 268_435_455  # [MQTT-2.2.3] four-byte variable byte integer


@dataclass(frozen=True, slots=True)
class EdgeSettings:
    """Everything one edge node needs; every field has a working embedded default."""

    host: str = "127.0.0.1"
    port: int = 1883
    data_dir: Path = Path("data")
    node_id: str = "edge"
    # Journal: fsync every group commit before acknowledging QoS 1/2 (the durable default).
    journal_fsync: bool = True
    journal_segment_bytes: int = 64 * 2**20
    # Disk budget: at either limit the edge refuses publishes (MQTT 5: 0x97; 3.1.1 QoS 1/2:
    # the connection is closed; QoS 0: dropped and counted) until retention frees space.
    # journal_max_bytes: the node's segment files together; 0 = no limit.
    journal_max_bytes: int = 10 * 2**30
    # Free bytes the journal leaves on its filesystem; 0 = no limit.
    journal_min_free_bytes: int = 2**30
    # Retention: a sealed segment whose every record the lake has committed (the pipeline's
    # retained $control/journal/{node}) is deleted once its last write is this old; 0 = as
    # soon as it is committed.
    journal_retention_hours: float = 24.0
    # Persistent sessions and retained messages: snapshot at most this often while publishes
    # flow (a crash replays the journal after the last snapshot), and within a second of any
    # change to a persistent session.
    state_snapshot_interval: float = 60.0
    # Protocol limits. A packet is buffered whole before it is handled, so the maximum packet
    # size bounds what one connection holds (the tenant's max_payload_bytes lowers it further):
    # 1 MiB, as EMQX, not the protocol's 256 MiB, which let one slow PUBLISH hold that much.
    max_packet_size: int = 2**20
    max_keepalive: int = 65_535
    # Levels of a topic name or filter (EMQX's default): a filter of thousands of levels costs
    # a trie node each; more is refused (SUBACK 0x8F / PUBLISH DISCONNECT 0x90).
    max_topic_levels: int = 128
    # Subscriptions one session may hold (SUBACK 0x97 beyond). What one client's filters cost
    # every publish (the trie walk) and in memory grows with them: 100 filters of 128 levels
    # match in ~1.6 ms and hold ~10 MiB at most (BENCHMARKS.md, issue 10).
    max_subscriptions_per_client: int = 100
    # A connection that has not completed CONNECT within this many seconds is closed.
    connect_timeout: float = 10.0
    # Per-tenant usage published on $counters/{metric} every this many seconds (>= 1). The
    # pipeline decides quotas on these: waiting for the next one is most of the quota reaction
    # time (BENCHMARKS.md, quota reaction p50: 4.9 s at 10 s, 2.3 s at 2 s; target 3 s).
    counter_interval: float = 2.0
    # Per-session delivery bounds (slow subscribers never grow memory without bound).
    max_queued_messages: int = 1_000
    # 4 MiB, not 16: a client that subscribes to its own big messages and never reads holds
    # this much in its queue, beyond its socket buffer (bench/abuse.py no_reader, issue 10).
    max_queued_bytes: int = 4 * 2**20
    max_inflight_messages: int = 100
    write_buffer_high_water: int = 1 * 2**20
    # MQTT 5: topic aliases a client may use towards this edge (0 = none) [MQTT-3.2.2.3.8].
    topic_alias_maximum: int = 64
    # Publishers are paused (reads stop) while this many journal records await their commit.
    max_journal_backlog: int = 200_000
    # ... and one client's reads are paused while its own records awaiting the journal hold
    # more than this many bytes (topics, payloads and per-record overhead). The commit copies
    # each frame a few times over (Arrow, IPC), so what one client can pin is several times
    # this: at 4 MiB one client of 60 KB topics raised RSS by 45 MiB, at 1 MiB by 19 MiB.
    max_journal_backlog_bytes_per_client: int = 2**20
    # A read whose publishes fan out to more deliveries than this is handled in turns: what is
    # routed so far is written and other connections are served before the rest (reading from
    # that publisher is paused meanwhile), so a burst to many subscribers keeps flowing.
    max_deliveries_per_turn: int = 200_000
    # ... and a read whose packets took longer than this (seconds) to handle yields the same
    # way, so one client's costly packets (publishes matching many filters) delay the others'
    # by about this much, not by a whole read's worth (2 ms: another client's p99 round trip
    # +5 ms under a flood where 5 ms turns gave +12 to +13 ms; BENCHMARKS.md, issue 10).
    max_turn_seconds: float = 0.002
    # Seconds between $SYS/broker/... statistics updates (Mosquitto's sys_interval); 0 disables.
    sys_interval: float = 10.0
    # HOST:PORT of the HTTP port serving the durable journal to remote pipelines, and /healthz
    # ("" = no HTTP port). Needs the tenants file's operator token unless on a loopback address.
    http_listen: str = ""
    # Records one HTTP request may ask for (413 beyond): what one request costs the edge.
    http_max_records: int = 1_000_000
    # More MQTT listeners, all feeding the same broker ("" = none), as HOST:PORT: MQTT over TLS
    # (1.2+), over WebSocket (path /mqtt, subprotocol mqtt) and over WebSocket over TLS.
    listen_tls: str = ""
    listen_ws: str = ""
    listen_wss: str = ""
    # The TLS listeners' certificate chain and private key (PEM files; both needed by either
    # TLS listener), and, when set, the CAs a client certificate must be signed by: every TLS
    # client must then present one (broker_edge.tls).
    tls_cert: str = ""
    tls_key: str = ""
    tls_cafile: str = ""
    # Failed TLS handshakes reported (a log line and a tls_handshake_failed event each) per
    # window of handshake_refusal_interval seconds: at most this many from one source address,
    # and this many on one listener; the rest are only counted, and the window's end reports
    # them in one tls_handshake_failures_suppressed event per listener (broker_edge.refusals).
    # A scanner on the TLS port then costs the journal a bounded number of events a minute, not
    # one per connection (EMQX throttles its log the same way, over one minute). Refused
    # WebSocket upgrades (a log line each) are limited alike, counted apart.
    handshake_refusals_per_source: int = 10
    handshake_refusals_per_listener: int = 100
    handshake_refusal_interval: float = 60.0
    # The edge mesh (broker_edge.mesh): HOST:PORT (the MQTT port) of every other edge; each is
    # dialed and redialed with backoff. Empty: a single edge.
    peers: tuple[str, ...] = ()
    # What links authenticate with when there is no tenants file (with one: its operator
    # token). An edge with neither refuses links. At least 16 characters.
    mesh_token: str = ""
    # A peer whose link to this edge has been down this long is forgotten: the journal no longer
    # keeps what it has not acknowledged (broker_edge.mesh, "Peers gone for good"); 0 = never.
    peer_expiry_hours: float = 24.0

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65_535, "edge.port", f"must be 0..65535, got {self.port}")
        _require(bool(self.host), "edge.host", "must not be empty")
        _require(
            bool(self.node_id) and "/" not in self.node_id and self.node_id not in {".", ".."},
            "edge.node_id",
            f"must be a non-empty name without '/', got {self.node_id!r}",
        )
        _require(
            self.counter_interval >= 1,
            "edge.counter_interval",
            f"must be >= 1 second, got {self.counter_interval}",
        )
        _require(
            self.connect_timeout > 0,
            "edge.connect_timeout",
            f"must be > 0, got {self.connect_timeout}",
        )
        _require(
            self.state_snapshot_interval > 0,
            "edge.state_snapshot_interval",
            f"must be > 0, got {self.state_snapshot_interval}",
        )
        _require(
            self.journal_segment_bytes >= 4096,
            "edge.journal_segment_bytes",
            f"must be >= 4096, got {self.journal_segment_bytes}",
        )
        _require(
            16 <= self.max_packet_size <= MAX_REMAINING_LENGTH + 5,
            "edge.max_packet_size",
            f"must be 16..{MAX_REMAINING_LENGTH + 5}, got {self.max_packet_size}",
        )
        _require(
            0 < self.max_keepalive <= 65_535,
            "edge.max_keepalive",
            f"must be 1..65535, got {self.max_keepalive}",
        )
        _require(
            0 <= self.topic_alias_maximum <= 65_535,
            "edge.topic_alias_maximum",
            f"must be 0..65535, got {self.topic_alias_maximum}",
        )
        _require(
            self.max_inflight_messages <= 65_535,
            "edge.max_inflight_messages",
            f"must be <= 65535 (the MQTT 5 receive maximum), got {self.max_inflight_messages}",
        )
        for key in ("journal_max_bytes", "journal_min_free_bytes"):
            value = getattr(self, key)
            _require(value >= 0, f"edge.{key}", f"must be >= 0 (0: no limit), got {value}")
        _require(
            math.isfinite(self.journal_retention_hours) and self.journal_retention_hours >= 0,
            "edge.journal_retention_hours",
            f"must be a number of hours >= 0, got {self.journal_retention_hours}",
        )
        for key in (
            "max_queued_messages",
            "max_queued_bytes",
            "max_inflight_messages",
            "write_buffer_high_water",
            "max_journal_backlog",
            "max_journal_backlog_bytes_per_client",
            "max_deliveries_per_turn",
            "max_topic_levels",
            "max_subscriptions_per_client",
            "handshake_refusals_per_source",
            "handshake_refusals_per_listener",
        ):
            value = getattr(self, key)
            _require(value >= 1, f"edge.{key}", f"must be >= 1, got {value}")
        _require(
            math.isfinite(self.max_turn_seconds) and self.max_turn_seconds > 0,
            "edge.max_turn_seconds",
            f"must be a number of seconds > 0, got {self.max_turn_seconds}",
        )
        _require(
            math.isfinite(self.handshake_refusal_interval) and self.handshake_refusal_interval > 0,
            "edge.handshake_refusal_interval",
            f"must be a number of seconds > 0, got {self.handshake_refusal_interval}",
        )
        _require(
            math.isfinite(self.peer_expiry_hours) and self.peer_expiry_hours >= 0,
            "edge.peer_expiry_hours",
            f"must be a number of hours >= 0 (0: never), got {self.peer_expiry_hours}",
        )
        _require(
            math.isfinite(self.sys_interval) and self.sys_interval >= 0,
            "edge.sys_interval",
            f"must be a number of seconds >= 0 (0 disables $SYS), got {self.sys_interval}",
        )

        if self.http_listen:
            self.http_address  # noqa: B018 (validates)
        self.listeners  # noqa: B018 (validates)
        tls = bool(self.listen_tls or self.listen_wss)
        for key in ("tls_cert", "tls_key"):
            _require(
                bool(getattr(self, key)) or not tls,
                f"edge.{key}",
                "needed by listen_tls and listen_wss (a PEM file)",
            )
        for key in ("tls_cert", "tls_key", "tls_cafile"):
            _require(
                not getattr(self, key) or tls,
                f"edge.{key}",
                "set but no TLS listener uses it (set listen_tls or listen_wss)",
            )
        _require(
            self.http_max_records >= 1,
            "edge.http_max_records",
            f"must be >= 1, got {self.http_max_records}",
        )

        for peer in self.peers:
            host_port("edge.peers", peer, minimum=1)
        _require(
            len(set(self.peers)) == len(self.peers),
            "edge.peers",
            f"lists a peer twice: {list(self.peers)}",
        )
        _require(
            not self.mesh_token or (len(self.mesh_token) >= 16 and self.mesh_token.isprintable()),
            "edge.mesh_token",
            "must be at least 16 printable characters (or empty: no links without a tenants file)",
        )

    @property
    def journal_root(self) -> Path:
        return self.data_dir / "journal"

    @property
    def http_address(self) -> tuple[str, int]:
        """``http_listen`` as (host, port); ConfigError naming the key when it is not one."""
        return host_port("edge.http_listen", self.http_listen)

    @property
    def listeners(self) -> dict[str, tuple[str, int]]:
        """Every MQTT listener by kind (``mqtt``, ``tls``, ``ws``, ``wss``) and its address."""
        found = {"mqtt": (self.host, self.port)}
        for kind in ("tls", "ws", "wss"):
            value = getattr(self, f"listen_{kind}")
            if value:
                found[kind] = host_port(f"edge.listen_{kind}", value)
        return found

    @property
    def peer_addresses(self) -> tuple[tuple[str, int], ...]:
        """``peers`` as (host, port) pairs."""
        return tuple(host_port("edge.peers", peer, minimum=1) for peer in self.peers)


def host_port(key: str, value: str, minimum: int = 0) -> tuple[str, int]:
    """``value`` (HOST:PORT, [V6]:PORT) as (host, port); ConfigError naming ``key`` if not."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not minimum <= int(port) <= 65_535:
        raise ConfigError(f"{key}: expected HOST:PORT (port {minimum}..65535), got {value!r}")
    return host, int(port)


def _require(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}")
