"""A paho MQTT 5 client that publishes one message at a time and returns its PUBACK code."""

from __future__ import annotations

import queue
import threading

import paho.mqtt.client as mqtt

TIMEOUT = 10.0
TOPIC = "fleet/v1/telemetry"


class V5Publisher:
    """Connected on ``port`` with ``username`` (None: anonymous); what it receives on its
    subscriptions waits in ``messages``."""

    def __init__(self, port: int, username: str | None, client_id: str = "pub-v5") -> None:
        self.acks: queue.Queue[tuple[int, int]] = queue.Queue()
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.paho = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        if username is not None:
            self.paho.username_pw_set(username)
        self.paho.on_publish = lambda c, u, mid, rc, props: self.acks.put((mid, rc.value))
        self.paho.on_message = lambda c, u, message: self.messages.put(message)
        connected = threading.Event()
        self.paho.on_connect = lambda *args: connected.set()
        self.paho.connect("127.0.0.1", port)
        self.paho.loop_start()
        assert connected.wait(TIMEOUT)

    def publish(self, payload: bytes, qos: int = 1, topic: str = TOPIC) -> int:
        """Publish and wait for the edge's answer: the PUBACK reason code (0: accepted)."""
        info = self.paho.publish(topic, payload, qos=qos)
        mid, code = self.acks.get(timeout=TIMEOUT)  # never silence: an answer, in time
        assert mid == info.mid
        return code

    def close(self) -> None:
        self.paho.disconnect()
        self.paho.loop_stop()
