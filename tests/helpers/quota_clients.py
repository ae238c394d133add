"""Paho MQTT 5 clients of the quota tests (issues 14 and the quota loop): QoS 1 publishes one at
a time, each answered by its PUBACK reason code, and what the client receives."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

QUOTA_EXCEEDED = 0x97


def clear_of_utc_midnight(seconds: float) -> None:
    """Return once the next ``seconds`` all fall on one UTC day (waiting past midnight if not):
    the quota day is the UTC day, so a run across midnight sees every day count start again."""
    now = datetime.now(UTC)
    left = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC) - now
    if left.total_seconds() < seconds:
        time.sleep(left.total_seconds() + 1.0)


class Client:
    """One MQTT 5 paho client; ``connack`` is its CONNACK's reason code."""

    def __init__(self, port: int, token: str, client_id: str) -> None:
        self._acks: queue.Queue[tuple[int, int]] = queue.Queue()
        self._subscribed: queue.Queue[object] = queue.Queue()
        self.inbox: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        connected: queue.Queue[int] = queue.Queue()
        self.mqtt = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=False,
        )
        self.mqtt.username_pw_set(token)
        self.mqtt.on_connect = lambda c, u, f, rc, p: connected.put(rc.value)
        self.mqtt.on_publish = lambda c, u, mid, rc, p: self._acks.put((mid, rc.value))
        self.mqtt.on_message = lambda c, u, m: self.inbox.put(m)
        self.mqtt.on_subscribe = lambda c, u, mid, codes, p: self._subscribed.put(codes)
        self.mqtt.connect("127.0.0.1", port)
        self.mqtt.loop_start()
        self.connack = connected.get(timeout=10)

    def publish(self, topic: str = "fleet/v1/telemetry", payload: bytes = b'{"speed":42}') -> int:
        """The PUBACK reason code of one QoS 1 publish (retained on ``$control/...``, as the
        pipeline publishes there)."""
        info = self.mqtt.publish(topic, payload, qos=1, retain=topic.startswith("$control"))
        mid, code = self._acks.get(timeout=10)
        assert mid == info.mid
        return code

    def codes(self, count: int) -> list[int]:
        """The PUBACK reason codes of ``count`` publishes, one after the other."""
        return [self.publish() for _ in range(count)]

    def subscribe(self, topic_filter: str) -> None:
        self.mqtt.subscribe(topic_filter, qos=1)
        self._subscribed.get(timeout=10)

    def close(self) -> None:
        self.mqtt.disconnect()
        self.mqtt.loop_stop()


def wait_for(what: str, done: Callable[[], bool], timeout: float, *procs: Any) -> None:
    """Until ``done()`` (each call may publish: asked every 0.2 s), failing when ``timeout``
    passes or one of ``procs`` exits first."""
    deadline = time.monotonic() + timeout
    while not done():
        for proc in procs:
            assert proc.poll() is None, f"{proc.args[3:6]} exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.2)
