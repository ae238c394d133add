"""A real edge node on 127.0.0.1 port 0, run on its own event loop thread, and paho clients."""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import uvloop

from broker_edge.node import EdgeNode
from broker_edge.settings import EdgeSettings
from ingest.journal import OS_FILES, FileOps

TIMEOUT = 10.0

# The operator's token and one tenant (modules with other tenants have their own fixture). With
# a tenants file the node's $SYS is in the operator's namespace: the operator's token reads it.
OPERATOR_TENANTS = """
[operator]
token = "op-token"

[tenants.acme]
tokens = ["acme-1"]
"""


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(OPERATOR_TENANTS)
    return path


class RunningEdge:
    """An EdgeNode served from a background thread; ``port`` is the real bound port."""

    def __init__(
        self,
        settings: EdgeSettings,
        loop_kind: str = "asyncio",
        tenants: Path | None = None,
        files: FileOps = OS_FILES,
    ) -> None:
        self.settings = settings
        self.loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
        self.node = EdgeNode(settings, tenants, journal_files=files)
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="edge", daemon=True)

    @property
    def port(self) -> int:
        return self.node.port

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced to the test in start()/stop()
            self._error = exc
            self._ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with self.node:
            self._ready.set()
            await self._stop.wait()

    def start(self) -> RunningEdge:
        self._thread.start()
        assert self._ready.wait(TIMEOUT), "edge did not start"
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the edge's loop thread and return its result."""
        done: queue.Queue[Any] = queue.Queue()
        self.loop.call_soon_threadsafe(lambda: done.put(fn(*args)))
        return done.get(timeout=TIMEOUT)

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(TIMEOUT)
        assert not self._thread.is_alive(), "edge did not stop"
        if self._error is not None:
            raise self._error


@pytest.fixture
def edge_settings(tmp_path: Path) -> EdgeSettings:
    return EdgeSettings(host="127.0.0.1", port=0, data_dir=tmp_path / "data", node_id="test")


@pytest.fixture(params=["asyncio", "uvloop"])
def loop_kind(request: pytest.FixtureRequest) -> str:
    """Every broker test runs on both event loops the edge supports."""
    kind: str = request.param
    return kind


@pytest.fixture
def edge(edge_settings: EdgeSettings, loop_kind: str) -> Iterator[RunningEdge]:
    running = RunningEdge(edge_settings, loop_kind).start()
    yield running
    running.stop()


@pytest.fixture
def make_edge(edge_settings: EdgeSettings, loop_kind: str) -> Iterator[Any]:
    """Start edges with setting overrides (restarts on the same data dir included)."""
    started: list[RunningEdge] = []

    def _make(
        tenants: Path | None = None, files: FileOps = OS_FILES, **overrides: Any
    ) -> RunningEdge:
        settings = replace(edge_settings, **overrides)
        running = RunningEdge(settings, loop_kind, tenants, files).start()
        started.append(running)
        return running

    yield _make
    for running in started:
        running.stop()


@dataclass
class Received:
    topic: str
    payload: bytes
    qos: int
    retain: bool


@dataclass
class Client:
    """A paho client with a queue of what it received, connected and looping."""

    paho: mqtt.Client
    messages: queue.Queue[Received] = field(default_factory=queue.Queue)
    disconnected: threading.Event = field(default_factory=threading.Event)

    def subscribe(self, topic_filter: str, qos: int = 0) -> None:
        granted: queue.Queue[Any] = queue.Queue()
        self.paho.on_subscribe = lambda c, u, mid, codes, props: granted.put(codes)
        result, _ = self.paho.subscribe(topic_filter, qos)
        assert result == mqtt.MQTT_ERR_SUCCESS
        codes = granted.get(timeout=TIMEOUT)
        assert not codes[0].is_failure, codes

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        info = self.paho.publish(topic, payload, qos=qos, retain=retain)
        info.wait_for_publish(TIMEOUT)
        assert info.is_published()

    def get(self, timeout: float = TIMEOUT) -> Received:
        return self.messages.get(timeout=timeout)

    def nothing_more(self, wait: float = 0.3) -> bool:
        try:
            extra = self.messages.get(timeout=wait)
        except queue.Empty:
            return True
        pytest.fail(f"unexpected message {extra}")

    def close(self) -> None:
        self.paho.disconnect()
        self.paho.loop_stop()


@pytest.fixture
def make_client() -> Iterator[Any]:
    """Connect paho clients to any edge (``port`` required); no edge is started here."""
    clients: list[Client] = []

    def _make(
        client_id: str | None = None,
        *,
        protocol: int = mqtt.MQTTv311,
        clean_session: bool = True,
        port: int,
        keepalive: int = 60,
        will: tuple[str, bytes, int, bool] | None = None,
        username: str | None = None,
        transport: str = "tcp",
        tls: dict[str, Any] | None = None,
    ) -> Client:
        """``transport="websockets"``: MQTT over WebSocket at /mqtt; ``tls``: tls_set's
        arguments (the CA, a client certificate)."""
        cid = client_id if client_id is not None else f"c-{uuid.uuid4().hex[:8]}"
        kwargs: dict[str, Any] = {"client_id": cid, "protocol": protocol, "transport": transport}
        if protocol != mqtt.MQTTv5:
            kwargs["clean_session"] = clean_session
        paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, **kwargs)
        if transport == "websockets":
            paho.ws_set_options(path="/mqtt")
        if tls is not None:
            paho.tls_set(**tls)
        client = Client(paho)
        connected: queue.Queue[Any] = queue.Queue()
        paho.on_connect = lambda c, u, flags, rc, props: connected.put((flags, rc))
        paho.on_message = lambda c, u, m: client.messages.put(
            Received(m.topic, m.payload, m.qos, bool(m.retain))
        )
        paho.on_disconnect = lambda c, u, flags, rc, props: client.disconnected.set()
        if will is not None:
            paho.will_set(*will)
        if username is not None:
            paho.username_pw_set(username)
        paho.connect("127.0.0.1", port, keepalive=keepalive)
        paho.loop_start()
        flags, rc = connected.get(timeout=TIMEOUT)
        assert not rc.is_failure, rc
        client.session_present = flags.session_present  # type: ignore[attr-defined]
        clients.append(client)
        return client

    yield _make
    for client in clients:
        client.close()


@pytest.fixture
def connect(edge: RunningEdge, make_client: Any) -> Any:
    """Connect paho clients to the ``edge`` fixture's node."""

    def _connect(client_id: str | None = None, **kwargs: Any) -> Client:
        kwargs.setdefault("port", edge.port)
        client: Client = make_client(client_id, **kwargs)
        return client

    return _connect
