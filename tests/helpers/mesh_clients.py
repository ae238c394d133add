"""Clients across the edge mesh (issue 11): waiting until subscriptions reached other edges."""

from __future__ import annotations

import queue
import time
from typing import Any

# Seconds a mesh test waits for links and subscriptions to settle.
SETTLE = 15.0


def settle(publisher: Any, subscribers: list[Any], topic: str) -> None:
    """Publish probes on ``topic`` until every subscriber got one (the filters reached the
    publisher's edge), then drain the probes."""
    deadline = time.monotonic() + SETTLE
    waiting = list(subscribers)
    while waiting:
        assert time.monotonic() < deadline, "subscriptions never reached the publisher's edge"
        publisher.publish(topic, b"probe")
        for sub in list(waiting):
            try:
                if sub.get(timeout=0.1).payload == b"probe":
                    waiting.remove(sub)
            except queue.Empty:
                pass
    time.sleep(0.3)
    for sub in subscribers:
        while True:
            try:
                got = sub.messages.get(timeout=0.2)
            except queue.Empty:
                break
            assert got.payload == b"probe", got


def numbers_until_quiet(
    sub: Any, wanted: set[int], timeout: float = SETTLE, quiet: float = 2.0
) -> list[int]:
    """The numbered payloads ``sub`` gets until it has every one of ``wanted`` (within
    ``timeout``), then until it is quiet for ``quiet`` seconds."""
    got: list[int] = []
    deadline = time.monotonic() + timeout
    while not wanted <= set(got):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"missing {sorted(wanted - set(got))[:20]}"
        try:
            got.append(int(sub.get(timeout=remaining).payload))
        except queue.Empty:
            continue
    while True:
        try:
            got.append(int(sub.get(timeout=quiet).payload))
        except queue.Empty:
            return got
