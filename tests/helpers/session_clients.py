"""Paho clients with a persistent session (3.1.1 clean session 0, or MQTT 5 clean start 0 with
a session expiry), for sessions that move between the edges of a mesh (issue 11): the CONNACK's
session present flag, what was received, and how the connection ended."""

from __future__ import annotations

import queue
import threading
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

TIMEOUT = 10.0
SESSION_TAKEN_OVER = 0x8E


class SessionClient:
    """One stock paho client; ``v5`` False is MQTT 3.1.1. It never reconnects by itself."""

    def __init__(self, port: int, client_id: str, token: str, *, v5: bool, clean: bool = False,
                 expiry: int = 300) -> None:  # fmt: skip
        self.client_id = client_id
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.ended = threading.Event()
        self.end_reason: int | None = None  # the DISCONNECT's reason code (MQTT 5)
        connected: queue.Queue[tuple[bool, int]] = queue.Queue()
        self._acks: queue.Queue[object] = queue.Queue()
        kwargs: dict[str, Any] = {"client_id": client_id, "reconnect_on_failure": False}
        if v5:
            kwargs["protocol"] = mqtt.MQTTv5
        else:
            kwargs["protocol"] = mqtt.MQTTv311
            kwargs["clean_session"] = clean
        paho = self.paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, **kwargs)
        paho.username_pw_set(token)
        paho.on_connect = lambda c, u, flags, rc, p: connected.put(
            (bool(flags.session_present), rc.value)
        )
        paho.on_message = lambda c, u, m: self.messages.put(m)
        paho.on_subscribe = lambda c, u, mid, codes, p: self._acks.put(codes)
        paho.on_disconnect = self._ended
        if v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 0 if clean else expiry
            paho.connect("127.0.0.1", port, clean_start=clean, properties=props)
        else:
            paho.connect("127.0.0.1", port)
        paho.loop_start()
        self.session_present, code = connected.get(timeout=TIMEOUT)
        assert code == 0, f"CONNACK {code:#x}"

    def _ended(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        self.end_reason = rc.value
        self.ended.set()

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        self.paho.subscribe(topic_filter, qos)
        codes: Any = self._acks.get(timeout=TIMEOUT)
        assert not codes[0].is_failure, codes

    def get(self, timeout: float = TIMEOUT) -> mqtt.MQTTMessage:
        return self.messages.get(timeout=timeout)

    def payloads(self, count: int) -> list[bytes]:
        """The payloads of the next ``count`` messages, in the order they came."""
        return [self.get().payload for _ in range(count)]

    def nothing_more(self, wait: float = 1.0) -> None:
        try:
            extra = self.messages.get(timeout=wait)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected message {extra.topic} {extra.payload!r}")

    def close(self) -> None:
        """DISCONNECT (the session stays, as its expiry says) and stop."""
        if not self.ended.is_set():
            self.paho.disconnect()
            self.ended.wait(TIMEOUT)
        self.paho.loop_stop()
