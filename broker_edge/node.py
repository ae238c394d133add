"""One edge node's lifecycle: journal, broker, listener and housekeeping, as ``async with``.

Two background tasks: housekeeping (keepalives, session expiry) every second, and ``$SYS``
statistics every ``sys_interval`` seconds (its own task, so its period is not tied to the
housekeeping tick; see :mod:`broker_edge.sysstats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from types import TracebackType

from broker_edge.broker import Broker
from broker_edge.durability import GroupCommitter
from broker_edge.listener import MqttProtocol
from broker_edge.packets import ReasonCode
from broker_edge.settings import EdgeSettings
from broker_edge.sysstats import SysTree, installed_version, sample
from ingest.journal import JournalWriter

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL = 1.0


class EdgeNode:
    """``async with EdgeNode(settings) as node:`` serves MQTT on ``node.port`` until exit."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.port = settings.port
        self._server: asyncio.Server | None = None
        self._committer: GroupCommitter | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self._sys: asyncio.Task[None] | None = None
        self.started_at = 0.0  # event loop time
        self.broker: Broker | None = None

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
        writer = await loop.run_in_executor(
            None,
            lambda: JournalWriter.open(
                settings.journal_root,
                settings.node_id,
                segment_bytes=settings.journal_segment_bytes,
                fsync=settings.journal_fsync,
            ),
        )
        committer = GroupCommitter(writer)
        broker = Broker(settings, committer)
        committer.on_commit = broker.flush_dirty
        committer.start()
        self._committer = committer
        self.broker = broker
        self._server = await loop.create_server(
            lambda: MqttProtocol(broker, loop),
            host=settings.host,
            port=settings.port,
            reuse_address=True,
            backlog=4096,
        )
        sock: socket.socket = self._server.sockets[0]
        self.port = sock.getsockname()[1]
        self.started_at = loop.time()
        self._housekeeping = loop.create_task(self._housekeep(), name="housekeeping")
        if settings.sys_interval > 0:
            self._sys = loop.create_task(self._publish_sys(settings.sys_interval), name="sys")
        log.info(
            "edge %s listening on %s:%d, journal %s (fsync=%s), next seq %d",
            settings.node_id,
            settings.host,
            self.port,
            settings.journal_root / settings.node_id,
            settings.journal_fsync,
            writer.next_seq,
        )

    async def _housekeep(self) -> None:
        loop = asyncio.get_running_loop()
        broker = self.broker
        assert broker is not None
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            now = loop.time()
            broker.check_keepalives(now)
            broker.expire_sessions(now)

    async def _publish_sys(self, interval: float) -> None:
        """Publish $SYS/broker/... at once, then every ``interval`` seconds (no drift)."""
        loop = asyncio.get_running_loop()
        broker = self.broker
        assert broker is not None
        tree = SysTree(installed_version())
        deadline = loop.time()
        while True:
            now = loop.time()
            try:
                uptime = int(now - self.started_at)
                for topic, payload in tree.update(sample(broker, uptime), now):
                    broker.publish_system(topic, payload)
                broker.flush_dirty()
            except Exception:
                # Statistics are not worth the node: log our bug and try again next interval.
                log.exception("$SYS update failed")
            deadline = max(deadline + interval, loop.time())
            await asyncio.sleep(deadline - loop.time())

    async def stop(self) -> None:
        """Stop accepting, close clients (MQTT 5: DISCONNECT 0x8B), flush the journal."""
        if self._server is not None:
            self._server.close()
        for task in (self._housekeeping, self._sys):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.broker is not None:
            self.broker.close_all(ReasonCode.SERVER_SHUTTING_DOWN)
        if self._committer is not None:
            await self._committer.close()
            log.info("journal flushed up to seq %d", self._committer.durable_seq)
        if self._server is not None:
            await self._server.wait_closed()
        self._server = None
