"""Publishes the pipeline's decisions to every edge over MQTT (paho-mqtt), retained, QoS 1.

Theory of operation: :meth:`DecisionPublisher.publish` takes, per topic, the complete ordered
list of payloads that topic should get now, queues it in every broker's outbox (replacing an
undelivered older list for the same topic: a newer list supersedes it, since each list is
complete) and then tries every broker with a non-empty outbox. A delivery is one MQTT 5
connection with the operator token as user name: publish the outbox in order, wait for every
PUBACK, check its reason code, disconnect. Connecting per delivery keeps no socket or thread
alive between micro-batches; decisions are rare (state changes), so the cost does not matter.

A broker that is down, refuses the token or a publish, or does not answer in time keeps its
outbox: the error (naming the broker) is logged and returned, never raised, and a later
``publish`` call (a later micro-batch, with or without new messages) tries again, once the
broker's back-off (1 s, doubling up to 60 s, reset by a delivery) has passed. Messages are
retained and idempotent, so sending one twice (a delivery that failed half way) is harmless.

Outboxes live in memory. What a process that dies takes with it is recovered by the caller:
the quota step republishes every tenant's recorded decisions in its first batch.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from schemas.control import JournalCommitted, journal_control_topic
from sinks.errors import SinkError

logger = logging.getLogger(__name__)

Broker = tuple[str, int]


class MqttSinkError(SinkError):
    """Delivering to one broker failed; the message names the broker."""


class DecisionPublisher:
    """Retained QoS 1 publishes to every broker in ``brokers``, retried until delivered."""

    def __init__(
        self,
        brokers: Sequence[Broker],
        token: str,
        *,
        timeout: float = 10.0,
        retry_backoff: tuple[float, float] = (1.0, 60.0),
        client_id_prefix: str = "edgebus-pipeline",
    ) -> None:
        if not token:
            raise ValueError("token must not be empty")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if not 0 <= retry_backoff[0] <= retry_backoff[1]:
            raise ValueError(f"retry_backoff must be (min, max), 0 <= min <= max: {retry_backoff}")
        self._brokers = tuple(dict.fromkeys(brokers))
        self._token = token
        self._timeout = timeout
        self._backoff = retry_backoff
        self._client_id_prefix = client_id_prefix
        self._outboxes: dict[Broker, dict[str, tuple[bytes, ...]]] = {
            broker: {} for broker in self._brokers
        }
        # After a failed delivery a broker is not tried again before _retry_at (monotonic).
        self._retry_at: dict[Broker, float] = {}
        self._delay: dict[Broker, float] = {}
        # The pipeline publishes from two threads: the journal notices and the quota step's.
        self._lock = threading.Lock()

    @property
    def brokers(self) -> tuple[Broker, ...]:
        return self._brokers

    def pending(self) -> dict[str, int]:
        """Per broker (``host:port``) with undelivered messages, how many topics wait."""
        return {_name(b): len(box) for b, box in self._outboxes.items() if box}

    def publish(self, messages: Mapping[str, Sequence[bytes]]) -> list[MqttSinkError]:
        """Queue ``messages`` (topic -> payloads, in order) for every broker, then deliver every
        outbox whose broker is not backing off. Returns the errors of this call's attempts.
        One call at a time (calls from other threads wait)."""
        with self._lock:
            return self._publish(messages)

    def _publish(self, messages: Mapping[str, Sequence[bytes]]) -> list[MqttSinkError]:
        for box in self._outboxes.values():
            box.update((topic, tuple(payloads)) for topic, payloads in messages.items())
        errors: list[MqttSinkError] = []
        for broker, box in self._outboxes.items():
            if not box or time.monotonic() < self._retry_at.get(broker, 0.0):
                continue
            try:
                self._deliver(broker, box)
            except MqttSinkError as exc:
                # Back off, so a broker that swallows connection attempts (each one costs up to
                # `timeout`) does not stall every micro-batch.
                low, high = self._backoff
                delay = min(high, max(low, 2 * self._delay.get(broker, 0.0)))
                self._delay[broker] = delay
                self._retry_at[broker] = time.monotonic() + delay
                logger.warning(
                    "%s; %d topic(s) kept, next attempt in %g s or later", exc, len(box), delay
                )
                errors.append(exc)
            else:
                logger.info("broker %s: delivered %d topic(s)", _name(broker), len(box))
                box.clear()
                self._delay.pop(broker, None)
                self._retry_at.pop(broker, None)
        return errors

    def publish_committed(self, node: str, committed_seq: int) -> list[MqttSinkError]:
        """Tell every edge that the lake holds ``node``'s journal up to ``committed_seq``
        (inclusive, in every table): retained on ``$control/journal/{node}``
        (``schemas.control``). Each edge deletes its own committed segments (retention);
        the others keep the retained notice. Errors as in :meth:`publish`."""
        notice = JournalCommitted.now(node, committed_seq)
        return self.publish({journal_control_topic(node): [notice.payload()]})

    def _deliver(self, broker: Broker, box: Mapping[str, tuple[bytes, ...]]) -> None:
        host, port = broker
        name = _name(broker)
        session = _Session()
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"{self._client_id_prefix}-{uuid.uuid4().hex[:12]}",
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=False,
        )
        client.username_pw_set(self._token)
        client.connect_timeout = self._timeout
        client.on_connect = session.on_connect
        client.on_publish = session.on_publish
        client.on_disconnect = session.on_disconnect
        try:
            client.connect(host, port, keepalive=max(5, int(self._timeout * 2)))
        except OSError as exc:
            raise MqttSinkError(f"broker {name}: cannot connect: {exc}") from exc
        client.loop_start()
        try:
            self._publish_all(client, session, name, box)
        finally:
            client.disconnect()
            client.loop_stop()

    def _publish_all(
        self,
        client: mqtt.Client,
        session: _Session,
        name: str,
        box: Mapping[str, tuple[bytes, ...]],
    ) -> None:
        deadline = time.monotonic() + self._timeout
        if not session.wait(lambda: session.connack is not None, deadline):
            raise MqttSinkError(f"broker {name}: {session.failure('no CONNACK', self._timeout)}")
        code = session.connack
        if code.is_failure:
            raise MqttSinkError(f"broker {name}: connection refused: {_reason(code)}")
        sent: list[tuple[str, int]] = []
        for topic, payloads in box.items():
            for payload in payloads:
                info = client.publish(topic, payload, qos=1, retain=True)
                if info.rc != mqtt.MQTT_ERR_SUCCESS:
                    raise MqttSinkError(
                        f"broker {name}: publish to {topic} failed: {mqtt.error_string(info.rc)}"
                    )
                sent.append((topic, info.mid))
        mids = {mid for _, mid in sent}
        if not session.wait(lambda: mids <= session.acks.keys(), deadline):
            raise MqttSinkError(f"broker {name}: {session.failure('no PUBACK', self._timeout)}")
        for topic, mid in sent:
            ack = session.acks[mid]
            if ack.is_failure:
                raise MqttSinkError(f"broker {name}: publish to {topic} refused: {_reason(ack)}")


class _Session:
    """What paho's network thread reports about one connection, for the calling thread."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.connack: Any = None
        self.acks: dict[int, Any] = {}
        self.disconnect: Any = None

    def on_connect(self, client: Any, userdata: Any, flags: Any, code: Any, props: Any) -> None:
        with self._changed:
            self.connack = code
            self._changed.notify_all()

    def on_publish(self, client: Any, userdata: Any, mid: int, code: Any, props: Any) -> None:
        with self._changed:
            self.acks[mid] = code
            self._changed.notify_all()

    def on_disconnect(self, client: Any, userdata: Any, flags: Any, code: Any, props: Any) -> None:
        with self._changed:
            self.disconnect = code
            self._changed.notify_all()

    def wait(self, done: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``done()``: False when the deadline passed or the connection closed first."""
        with self._changed:
            self._changed.wait_for(
                lambda: done() or self.disconnect is not None,
                timeout=max(0.0, deadline - time.monotonic()),
            )
            return done()

    def failure(self, what: str, timeout: float) -> str:
        if self.disconnect is not None:
            return f"{what}: disconnected ({_reason(self.disconnect)})"
        return f"{what} within {timeout:g} s"


def _reason(code: Any) -> str:
    value = getattr(code, "value", code)
    return f"{code} (0x{value:02x})" if isinstance(value, int) else str(code)


def _name(broker: Broker) -> str:
    return f"{broker[0]}:{broker[1]}"
