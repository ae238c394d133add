"""One edge node's lifecycle: journal, broker, listener and housekeeping, as ``async with``.

Two background tasks: housekeeping (keepalives, session expiry) every second, and ``$SYS``
statistics every ``sys_interval`` seconds (its own task, so its period is not tied to the
housekeeping tick; see :mod:`broker_edge.sysstats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from broker_edge import receipts, sessionlog, store
from broker_edge.broker import Broker
from broker_edge.durability import GroupCommitter, JournalStatus
from broker_edge.errors import ConfigError
from broker_edge.http_api import HttpApi, HttpServer, check_exposure
from broker_edge.listener import BufferedMqttProtocol, MqttProtocol
from broker_edge.localquota import until_midnight
from broker_edge.mesh import MeshState
from broker_edge.meshlink import Mesh
from broker_edge.message import message_from_row
from broker_edge.metrics import Snapshot, exposition
from broker_edge.packets import ReasonCode
from broker_edge.refusals import RefusalLimiter
from broker_edge.settings import EdgeSettings
from broker_edge.sysstats import SysTree, installed_version, sample
from broker_edge.tenants import OPERATOR_TENANT
from broker_edge.tenants import load as tenants_load
from broker_edge.tls import Handshakes, server_context
from broker_edge.websocket import WebSocketProtocol
from ingest.journal import OS_FILES, FileOps, JournalReader, JournalWriter
from schemas import operator_token
from schemas.operator_token import OperatorTokenError

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL = 1.0
# The refusal limiter's key of a listener's WebSocket upgrades (its TLS handshakes are its kind).
UPGRADE = " upgrade"
# How long an HTTP worker waits for the loop to read the broker's numbers (/metrics, /readyz).
LOOP_READ_TIMEOUT = 5.0
_T = TypeVar("_T")


class EdgeNode:
    """``async with EdgeNode(settings) as node:`` serves MQTT on ``node.port`` until exit."""

    def __init__(
        self,
        settings: EdgeSettings,
        tenants_file: Path | None = None,
        *,
        journal_files: FileOps = OS_FILES,
    ) -> None:
        self.settings = settings
        self.tenants_file = tenants_file
        self._journal_files = journal_files  # the journal's file layer (tests inject faults)
        self.port = settings.port
        # Every MQTT listener's bound port by kind (mqtt, tls, ws, wss: settings.listeners).
        self.ports: dict[str, int] = {}
        self._servers: list[asyncio.Server] = []
        self._handshakes: Handshakes | None = None
        self._refusals = RefusalLimiter(
            settings.handshake_refusals_per_source,
            settings.handshake_refusals_per_listener,
            settings.handshake_refusal_interval,
        )
        self._refusals_due: asyncio.TimerHandle | None = None
        self._committer: GroupCommitter | None = None
        # The broker's tick (keepalives, wills, expiry, rate limits): see _wake_at.
        self._tick_handle: asyncio.TimerHandle | None = None
        self._tick_at = 0.0
        self._sys: asyncio.Task[None] | None = None
        self._snapshots: asyncio.Task[None] | None = None
        # The snapshot file's last write (in the loop's executor): see _snapshot.
        self._snapshot_write: asyncio.Future[None] | None = None
        self._counters: asyncio.Task[None] | None = None
        self._days: asyncio.Task[None] | None = None
        self.started_at = 0.0  # event loop time
        self.broker: Broker | None = None
        self._session_log: sessionlog.SessionLog | None = None
        self.http: HttpServer | None = None
        self._local_token: str | None = None  # the edge's own operator token (none configured)
        self._sys_tree = SysTree(installed_version())
        self.mesh: Mesh | None = None

    async def __aenter__(self) -> EdgeNode:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        settings = self.settings
        loop = asyncio.get_running_loop()
        tls_context = server_context(settings)  # a bad certificate: refused before anything opens
        tenants = tenants_load(self.tenants_file) if self.tenants_file is not None else None
        # No operator token configured: the edge's own, for the local pipeline's journal
        # notices (schemas.operator_token), or the journal would never be trimmed.
        local_token = None
        if tenants is None or tenants.operator_token is None:
            try:
                local_token = operator_token.ensure(settings.data_dir)
            except (OperatorTokenError, OSError) as exc:
                raise ConfigError(str(exc)) from exc
        # The HTTP port is the operator's: the configured token, else the edge's own (then
        # only on loopback: a port others reach wants a token the operator chose).
        configured = tenants.operator_token if tenants is not None else None
        http_token = configured or local_token
        self._local_token = local_token
        if settings.http_listen:
            check_exposure(settings.http_address[0], configured)  # before anything opens
        linked = _linked(settings, configured)  # links have a token to show
        writer = await loop.run_in_executor(
            None,
            lambda: JournalWriter.open(
                settings.journal_root,
                settings.node_id,
                segment_bytes=settings.journal_segment_bytes,
                fsync=settings.journal_fsync,
                files=self._journal_files,
            ),
        )
        committer = GroupCommitter(
            writer,
            max_bytes=settings.journal_max_bytes,
            min_free_bytes=settings.journal_min_free_bytes,
            retention_seconds=settings.journal_retention_hours * 3600,
        )
        broker = Broker(settings, committer, tenants=tenants, local_operator_token=local_token)
        committer.on_commit = broker.after_commit
        committer.on_state = broker.journal_status_changed
        broker.on_journal_status = self._journal_status_changed
        self.broker = broker
        mesh = self._make_mesh(broker, committer, linked)
        await self._restore(broker, mesh, writer.next_seq - 1)
        # Changes to persistent sessions from now on: durable before their CONNACK/SUBACK.
        session_log = sessionlog.SessionLog(self.state_dir, fsync=settings.journal_fsync)
        self._session_log = broker.session_log = session_log

        def request_session_sync() -> None:
            # After this loop iteration's reads: one sync covers every change they made.
            loop.call_soon(broker.sync_sessions)

        broker.request_session_sync = request_session_sync
        broker.clock = loop.time
        broker.wake_at = self._wake_at
        committer.start()
        self._committer = committer
        await self._listen(broker, loop, tls_context)
        if settings.http_listen:
            api = HttpApi(
                settings.journal_root / settings.node_id,
                http_token,
                max_records=settings.http_max_records,
                metrics=lambda: exposition(_on_loop(loop, self._metrics_snapshot)),
                unready=lambda: _on_loop(loop, self._unready),
            )
            self.http = HttpServer(api)
            await self.http.start(*settings.http_address)
            log.info(
                "edge %s: journal over HTTP on %s port %d",
                settings.node_id,
                settings.http_address[0],
                self.http.port,
            )
        self.started_at = loop.time()
        mesh.on_state = self._show_state_now
        mesh.start()
        self._wake_at(loop.time() + HOUSEKEEPING_INTERVAL)
        self._snapshots = loop.create_task(self._snapshot_loop(), name="snapshots")
        self._counters = loop.create_task(self._publish_counters(), name="counters")
        self._days = loop.create_task(self._roll_days(), name="days")
        if settings.sys_interval > 0:
            self._sys = loop.create_task(self._publish_sys(settings.sys_interval), name="sys")
        log.info(
            "edge %s listening on %s, journal %s (fsync=%s), next seq %d",
            settings.node_id,
            ", ".join(
                f"{kind} {host}:{self.ports[kind]}"
                for kind, (host, _) in settings.listeners.items()
            ),
            settings.journal_root / settings.node_id,
            settings.journal_fsync,
            writer.next_seq,
        )

    async def _listen(
        self, broker: Broker, loop: asyncio.AbstractEventLoop, tls: ssl.SSLContext | None
    ) -> None:
        """Open every MQTT listener (settings.listeners), all feeding ``broker``."""
        if tls is not None:
            self._handshakes = Handshakes(
                loop, tls, self._tls_refused, self.settings.connect_timeout
            )
        for kind, (host, port) in self.settings.listeners.items():
            server = await loop.create_server(
                self._protocol_factory(kind, broker, loop),
                host=host,
                port=port,
                reuse_address=True,
                backlog=4096,
            )
            self._servers.append(server)
            sock: socket.socket = server.sockets[0]
            self.ports[kind] = sock.getsockname()[1]
        self.port = self.ports["mqtt"]

    def _protocol_factory(
        self, kind: str, broker: Broker, loop: asyncio.AbstractEventLoop
    ) -> Callable[[], asyncio.BaseProtocol]:
        """What each socket accepted by the ``kind`` listener starts with."""

        def mqtt() -> MqttProtocol:
            return MqttProtocol(broker, loop)

        def mqtt_tls() -> MqttProtocol:
            return BufferedMqttProtocol(broker, loop)

        refused = functools.partial(self._upgrade_refused, kind)

        def websocket() -> asyncio.BaseProtocol:
            return WebSocketProtocol(loop, mqtt, self.settings.connect_timeout, refused)

        inner = {"tls": mqtt_tls, "ws": websocket, "wss": websocket}.get(kind, mqtt)
        if kind in ("tls", "wss"):
            assert self._handshakes is not None
            return self._handshakes.gate(inner, kind)
        return inner

    def _tls_refused(self, listener: str, peer: str, reason: str) -> None:
        """A TLS handshake failed: one log line, one event in the operator's ``$log``; past
        the limits (broker_edge.refusals) only counted, for the window's summary."""
        if not self._admit(listener, peer):
            return
        log.warning("%s: TLS handshake with %s failed: %s", listener, peer, reason)
        details = {"listener": listener, "peer": peer, "reason": reason[:300]}
        self._operator_event("tls_handshake_failed", details)

    def _upgrade_refused(self, listener: str, peer: str, why: str) -> None:
        """A WebSocket upgrade was refused: one log line, within the same limits (counted
        apart from the listener's TLS handshakes)."""
        if self._admit(listener + UPGRADE, peer):
            log.info("%s: refusing WebSocket upgrade from %s: %s", listener, peer, why)

    def _admit(self, listener: str, peer: str) -> bool:
        """Whether to report this refusal (see broker_edge.refusals); opens the window."""
        loop = asyncio.get_running_loop()
        refusals = self._refusals
        opening = refusals.window_end is None
        reported = refusals.admit(listener, peer.rpartition(":")[0], loop.time())
        if opening and refusals.window_end is not None:
            self._refusals_due = loop.call_at(refusals.window_end, self._refusals_window_ended)
        return reported

    def _refusals_window_ended(self) -> None:
        self._refusals_due = None
        for held in self._refusals.close_window():
            if held.listener.endswith(UPGRADE):
                log.info(
                    "%s: %d more refused WebSocket upgrades from %d sources in %g s not logged",
                    held.listener.removesuffix(UPGRADE),
                    held.count,
                    held.sources,
                    held.interval,
                )
                continue
            log.warning(
                "%s: %d more failed TLS handshakes from %d sources in %g s not logged",
                held.listener,
                held.count,
                held.sources,
                held.interval,
            )
            details = {
                "listener": held.listener,
                "suppressed": held.count,
                "sources": held.sources,
                "interval": held.interval,
            }
            self._operator_event("tls_handshake_failures_suppressed", details)

    def _operator_event(self, event: str, details: dict[str, Any]) -> None:
        broker = self.broker
        if broker is None:
            return
        broker.log(OPERATOR_TENANT, event, "", details, origin="tls")
        broker.flush_dirty()

    def _make_mesh(self, broker: Broker, committer: GroupCommitter, linked: bool) -> Mesh:
        """The edge's links (started once it serves): forwarding only when it has a token."""
        mesh = self.mesh = Mesh(broker, self.settings, self._link_token)
        mesh.durable_seq = lambda: committer.durable_seq
        committer.on_peer_dropped = mesh.gave_up
        broker.link_acceptor = mesh.accept  # refuses every link while there is no token
        if linked:
            broker.mesh = mesh
            broker.router.interest = mesh.interest  # before the restored subscriptions
        return mesh

    @property
    def state_dir(self) -> Path:
        return self.settings.data_dir / "state" / self.settings.node_id

    @property
    def snapshot_path(self) -> Path:
        return self.state_dir / store.SNAPSHOT_NAME

    async def _restore(self, broker: Broker, mesh: Mesh, last_seq: int) -> None:
        """Snapshot, then the journal after it: persistent sessions and retained messages; and
        from what each peer had acknowledged, what it had not (broker_edge.mesh: "Restarts")."""
        loop = asyncio.get_running_loop()
        settings = self.settings
        snapshot = await loop.run_in_executor(
            None,
            lambda: store.load(
                self.snapshot_path,
                max_queued=settings.max_queued_messages,
                max_inflight=settings.max_inflight_messages,
                now=loop.time(),
            ),
        )
        after = 0
        log_since = 0
        mesh_from = None
        if snapshot is not None:
            broker.restore(snapshot.sessions, snapshot.retained)
            after = min(snapshot.journal_seq, last_seq)
            log_since = snapshot.session_log
            mesh_state = MeshState.of(snapshot.mesh)
            mesh.restore(mesh_state)
            mesh_from = mesh_state.floor()
        now = loop.time()
        # Session changes after the snapshot, interleaved with the journal by seq: a record
        # made after journal record s is applied before record s + 1 is routed.
        changes = await loop.run_in_executor(
            None, lambda: sessionlog.cut_back(sessionlog.read(self.state_dir, log_since))
        )
        pending = iter(changes)
        change = next(pending, None)
        replayed = 0
        reader = JournalReader(settings.journal_root / settings.node_id)
        start = after if mesh_from is None else min(after, mesh_from)
        start = _available(reader, start, after)
        if last_seq > start:
            for row in reader.read_records(start, last_seq):  # without pyarrow (issue 9)
                message = message_from_row(row, settings.node_id)
                # Changes are logged after the snapshot: none comes before a record it holds.
                while change is not None and change["seq"] < row["seq"]:
                    _apply_change(broker, mesh, change, now)
                    change = next(pending, None)
                mesh.replay(message)
                if message.seq <= after:
                    continue  # before the snapshot: only peers may still be due it
                broker.replay(message)
                replayed += 1
        while change is not None:
            _apply_change(broker, mesh, change, now)
            change = next(pending, None)
        mesh.replayed_all()
        self._snapshot_seq = last_seq
        log.info(
            "restored %d persistent session(s), %d retained message(s); replayed %d journal "
            "record(s) after seq %d and %d session change(s); %d QoS 1/2 message(s) for peers "
            "from seq %d",
            len(broker.persistent_sessions()),
            len(broker.retained_messages()),
            replayed,
            after,
            len(changes),
            mesh.replayed,
            start,
        )

    async def _snapshot_loop(self) -> None:
        """Snapshot within a second of a persistent-session change, and every
        ``state_snapshot_interval`` seconds while publishes flow (bounds crash replay)."""
        loop = asyncio.get_running_loop()
        broker = self.broker
        committer = self._committer
        assert broker is not None
        assert committer is not None
        last = loop.time()
        interval = self.settings.state_snapshot_interval
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            if self.mesh is not None:
                self.mesh.expire()  # peers away longer than edge.peer_expiry_hours
                self.mesh.tell_acked()  # what peers acknowledged moves on without ACKs too
            stale = committer.appended_seq > self._snapshot_seq and loop.time() - last >= interval
            # A peer's filters or away clock changed, or acks wait for a snapshot
            # (broker_edge.mesh).
            mesh = self.mesh is not None and (self.mesh.state_changed or bool(self.mesh.gate))
            if broker.state_changed or stale or mesh:
                await self._snapshot()
                last = loop.time()

    async def _snapshot(self) -> None:
        """Encode the state on the loop (consistent), write it once the journal records it
        covers are durable (so it never claims a seq a crash could still take back)."""
        broker = self.broker
        committer = self._committer
        assert broker is not None
        assert committer is not None
        broker.state_changed = False
        seq = committer.appended_seq
        # $SYS values are derived and never persisted (see broker_edge.sysstats): a restart
        # must not serve the previous run's numbers.
        retained = [m for m in broker.retained_state() if not m.topic.startswith("$SYS/")]
        # Session changes from here on go to a new generation of the session log; the older
        # ones are in this snapshot and deleted once it is durable.
        session_log = self._session_log
        generation = session_log.rotate() if session_log is not None else 0
        mesh = self.mesh.state(seq) if self.mesh is not None else None
        data = store.encode(
            seq,
            broker.persistent_sessions(),
            retained,
            generation,
            mesh.doc() if mesh is not None else None,
        )
        while (
            committer.durable_seq < seq
            and committer.failure is None
            and committer.status.state != "error"
            and not committer.closed
        ):
            await asyncio.sleep(0.005)
        if committer.durable_seq < seq:
            # The journal failed or closed before this state was durable: no snapshot (while
            # it fails, the records it covers were dropped and their seqs will be reused).
            return
        # One write at a time. Cancelling a task that awaits a write (stop() cancels the
        # snapshot loop) does not stop the write's thread, and a second write beside it would
        # share its .tmp file: truncate what the first is about to rename, or find it renamed.
        previous = self._snapshot_write
        if previous is not None:
            await asyncio.wait([previous])
            failed = None if previous.cancelled() else previous.exception()
            if failed is not None:
                log.warning("the previous state snapshot failed: %s", failed)
        write = asyncio.get_running_loop().run_in_executor(
            None, store.write_encoded, self.snapshot_path, data
        )
        self._snapshot_write = write
        await asyncio.shield(write)  # a cancelled caller leaves it running, to be waited for
        self._snapshot_seq = seq
        if session_log is not None:
            session_log.forget_before(generation)
        if mesh is not None and self.mesh is not None:
            self.mesh.covered(mesh.delivered)  # what it holds may be acknowledged now

    def reload_tenants(self) -> None:
        """SIGHUP: read the tenants file again; connections stay up (see Broker.reload_tenants)."""
        if self.tenants_file is None or self.broker is None:
            log.info("SIGHUP: no tenants file to reload")
            return
        try:
            config = tenants_load(self.tenants_file)
        except ConfigError as exc:
            log.warning("SIGHUP: tenants file not reloaded, keeping the old one: %s", exc)
            return
        self.broker.reload_tenants(config)
        if self.http is not None:
            self.http.api.token = config.operator_token or self._local_token
        log.info(
            "SIGHUP: tenants file %s reloaded (%d tenants)", self.tenants_file, len(config.tenants)
        )

    async def _publish_counters(self) -> None:
        """Every ``counter_interval``: each tenant's usage on ``$counters/{metric}``."""
        broker = self.broker
        assert broker is not None
        interval = self.settings.counter_interval
        start_us = broker.wall_clock_us()
        while True:
            await asyncio.sleep(interval)
            end_us = broker.wall_clock_us()
            try:
                broker.publish_counters(start_us, end_us)
            except Exception:
                log.exception("counters not published")
            start_us = end_us

    async def _roll_days(self) -> None:
        """At every UTC midnight: the local quota's new day (broker_edge.localquota). A wake-up
        a little early finds the same day (roll_day does nothing) and sleeps the rest."""
        broker = self.broker
        assert broker is not None
        while True:
            await asyncio.sleep(until_midnight(broker.wall_clock_us()) + 0.001)
            try:
                broker.roll_day()
            except Exception:
                log.exception("the local quota's new day failed")

    def _wake_at(self, at: float) -> None:
        """Run the broker's tick at loop time ``at`` at the latest: one timer for the whole
        node, moved earlier when something falls due sooner (broker.wake_at)."""
        if self._tick_handle is not None:
            if self._tick_at <= at:
                return
            self._tick_handle.cancel()
        self._tick_at = at
        self._tick_handle = asyncio.get_running_loop().call_at(at, self._tick)

    def _tick(self) -> None:
        self._tick_handle = None
        broker = self.broker
        assert broker is not None
        now = asyncio.get_running_loop().time()
        try:
            due = broker.tick(now)
        except Exception:
            # Our bug: log it and keep the node serving; the next tick tries again.
            log.exception("housekeeping failed")
            due = now + HOUSEKEEPING_INTERVAL
        self._wake_at(due)

    async def _publish_sys(self, interval: float) -> None:
        """Publish $SYS/broker/... at once, then every ``interval`` seconds (no drift)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            self._update_sys()
            deadline = max(deadline + interval, loop.time())
            await asyncio.sleep(deadline - loop.time())

    def _update_sys(self) -> None:
        broker = self.broker
        assert broker is not None
        now = asyncio.get_running_loop().time()
        try:
            uptime = int(now - self.started_at)
            for topic, payload in self._sys_tree.update(
                sample(broker, uptime, self._committer), now
            ):
                broker.publish_system(topic, payload)
            broker.flush_dirty()
        except Exception:
            # Statistics are not worth the node: log our bug and try again next interval.
            log.exception("$SYS update failed")

    def _metrics_snapshot(self) -> Snapshot:
        """What ``/metrics`` shows, read on the loop (the broker is the loop's alone)."""
        broker = self.broker
        assert broker is not None
        uptime = int(asyncio.get_running_loop().time() - self.started_at)
        tenancy = broker.tenancy
        return Snapshot(
            sample(broker, uptime, self._committer),
            {tenant: dataclasses.replace(usage) for tenant, usage in tenancy.usage.items()},
            {tenant: dict(decisions) for tenant, decisions in tenancy.quota.items()},
        )

    def _unready(self) -> str | None:
        """Why the edge refuses publishes now (its journal is full or failing), or None."""
        status = self._committer.status if self._committer is not None else None
        if status is None or status.state == "ok":
            return None
        return f"journal {status.state}: {status.error if status.state == 'error' else status.full}"

    def _journal_status_changed(self, status: JournalStatus) -> None:
        """The journal became full, failing or fine again: ``$SYS`` says so at once."""
        self._show_state_now()

    def _show_state_now(self) -> None:
        """Something ``$SYS`` shows changed (the journal's state, a peer's link): at once."""
        if self._sys is not None:
            self._update_sys()

    def _link_token(self) -> str | None:
        """What mesh links authenticate with now (None: no links): the tenants file's operator
        token (as reloaded), else ``edge.mesh_token``."""
        config = self.broker.tenancy.config if self.broker is not None else None
        if config is not None and config.operator_token is not None:
            return config.operator_token
        return self.settings.mesh_token or None

    async def stop(self) -> None:
        """Stop accepting, close clients (MQTT 5: DISCONNECT 0x8B), flush the journal."""
        for server in self._servers:
            server.close()
        if self._handshakes is not None:
            self._handshakes.close()
        if self._refusals_due is not None:  # what the window held back, said before the end
            self._refusals_due.cancel()
            self._refusals_window_ended()
        if self.broker is not None:
            self.broker.wake_at = _no_wake  # what closing the clients makes due never runs
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        if self.http is not None:
            await self.http.close()
        if self.mesh is not None:
            await self.mesh.stop()
        for task in (self._sys, self._snapshots, self._counters, self._days):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.broker is not None:
            self.broker.close_all(ReasonCode.SERVER_SHUTTING_DOWN)
        if self._committer is not None:
            await self._committer.close()
            log.info("journal flushed up to seq %d", self._committer.durable_seq)
            if self.broker is not None and self._committer.failure is None:
                await self._snapshot()
        if self._session_log is not None:
            if self.broker is not None:
                self.broker.sync_sessions()  # release anything still held, then stop logging
                self.broker.session_log = None
            self._session_log.close()
            self._session_log = None
        for server in self._servers:
            await server.wait_closed()
        self._servers = []


def _apply_change(broker: Broker, mesh: Mesh, change: dict[str, Any], now: float) -> None:
    """One session log record at restore: a session's change, a mesh peer's, or a crossing
    message delivered here (broker_edge.receipts)."""
    op = change["op"]
    if op == sessionlog.PEER:
        mesh.restore_change(str(change["n"]), int(change["seq"]), change["i"])
    elif op == receipts.RX:
        mesh.dedup.delivered(str(change["o"]), int(change["q"]))
        receipts.restore_received(broker.router, change)
    elif op == receipts.RX_DONE:
        receipts.restore_done(broker.router, change)
    else:
        broker.apply_session_record(change, now)


def _available(reader: JournalReader, start: int, after: int) -> int:
    """Where the journal can be read from for a restore from ``start``: records retention
    removed are gone (peers due them do not get them: logged), those after ``after`` are
    never removed before a snapshot covers them."""
    oldest = reader.first_seq()
    if oldest is None or start + 1 >= oldest or start >= after:
        return start
    log.warning(
        "journal records %d..%d were removed: peers that had not acknowledged them never get them",
        start + 1,
        oldest - 1,
    )
    return min(oldest - 1, after)


def _linked(settings: EdgeSettings, operator_token: str | None) -> bool:
    """Whether the edge has a token for mesh links; ConfigError if it has peers and none."""
    linked = bool(operator_token or settings.mesh_token)
    if settings.peers and not linked:
        raise ConfigError(
            "edge.peers: links authenticate with the tenants file's operator token, or "
            "without one with edge.mesh_token: neither is set"
        )
    return linked


def _no_wake(at: float) -> None:
    del at


def _on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], _T]) -> _T:
    """``read()`` run on ``loop``'s thread, from another thread (the HTTP server's workers)."""

    async def call() -> _T:
        return read()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=LOOP_READ_TIMEOUT)
