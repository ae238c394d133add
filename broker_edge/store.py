"""Persistent sessions and retained messages across edge restarts.

Theory of operation
-------------------
The journal already holds every accepted publish durably, so it is the write-ahead log of the
broker's state too. This module adds *snapshots*: one JSON document with every persistent
session (subscriptions, in-flight window, queue, QoS 2 packet ids awaiting PUBREL) and every
retained message and tombstone (a clear, with its version: see :mod:`broker_edge.retained`;
each message names its ``origin`` node), tagged with ``journal_seq``, the last journal record
whose effects it holds.

On start the node loads the newest snapshot, then replays the journal records after
``journal_seq``: retained publishes update the retained store, and every record is routed to
the (all offline) persistent sessions whose subscriptions match, which queues it. So:

- after a clean stop (snapshot written last), the state is exactly what it was;
- after a crash, retained messages and queues are rebuilt from the journal; a message that was
  delivered and acknowledged after the last snapshot may be delivered again (at least once,
  as QoS 1 allows). Session changes made after the last snapshot come from the session log
  (:mod:`broker_edge.sessionlog`), synced before their CONNACK or SUBACK is sent and applied in
  journal order; the node also snapshots within a second of such a change, to keep it short.

A snapshot also holds the edge mesh's state (:class:`broker_edge.mesh.MeshState`: what each
peer acknowledged and wants, when it was last up and whether it is forgotten, what was
delivered here from each origin), which the node gives
the mesh back before the journal is replayed.

Snapshots are written atomically (temporary file, fsync, rename, fsync of the directory); a
snapshot that cannot be read is an error naming the file, never silently ignored. The journal
keeps content type and user properties of a message; other MQTT 5 properties of messages
rebuilt from the journal (not from a snapshot) are not restored.
"""

from __future__ import annotations

import base64
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker_edge.errors import EdgeError
from broker_edge.message import Message
from broker_edge.packets import NO_PROPERTIES, Properties, QoS, RetainHandling, Subscription
from broker_edge.session import NO_CLAIM, Outbound, Pending, Session
from broker_edge.states import Flow

FORMAT_VERSION = 1
SNAPSHOT_NAME = "snapshot.json"


class StateStoreError(EdgeError):
    """A snapshot cannot be read or written; the message names the file."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    journal_seq: int
    sessions: list[Session]
    retained: list[Message]
    # The first session log generation written after this state (broker_edge.sessionlog).
    session_log: int = 0
    # The edge mesh's state (broker_edge.mesh.MeshState.doc), None in a snapshot without one.
    mesh: object = None


def encode(
    journal_seq: int,
    sessions: list[Session],
    retained: list[Message],
    session_log: int = 0,
    mesh: dict[str, object] | None = None,
) -> bytes:
    doc: dict[str, object] = {
        "version": FORMAT_VERSION,
        "journal_seq": journal_seq,
        "session_log": session_log,
        "written_at_us": time.time_ns() // 1000,
        "sessions": [session_doc(s) for s in sessions],
        "retained": [message_doc(m) for m in retained],
    }
    if mesh is not None:
        doc["mesh"] = mesh
    return json.dumps(doc, separators=(",", ":")).encode()


def write_encoded(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except OSError as exc:
        raise StateStoreError(f"{path}: cannot write snapshot: {exc}") from exc


def fsync_directory(directory: Path) -> None:
    """Make a name created or renamed in ``directory`` survive a crash."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: Path, *, max_queued: int, max_inflight: int, now: float) -> Snapshot | None:
    """Read a snapshot (None if there is none). ``now`` is the loop clock: disconnect times are
    carried over so session expiry keeps counting across the restart."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateStoreError(f"{path}: cannot read snapshot: {exc}") from exc
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise StateStoreError(f"{path}: snapshot is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        raise StateStoreError(f"{path}: snapshot format {version!r}, expected {FORMAT_VERSION}")
    try:
        offline_for = max(0.0, (time.time_ns() // 1000 - int(doc["written_at_us"])) / 1e6)
        sessions = [
            session_from(d, max_queued, max_inflight, now - offline_for) for d in doc["sessions"]
        ]
        retained = [message_from(d) for d in doc["retained"]]
        return Snapshot(
            int(doc["journal_seq"]),
            sessions,
            retained,
            int(doc.get("session_log", 0)),
            doc.get("mesh"),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise StateStoreError(f"{path}: snapshot is corrupt: {exc!r}") from exc


def message_doc(m: Message) -> dict[str, Any]:
    """One message as JSON (snapshots, the session log's crossing messages)."""
    p = m.properties
    doc: dict[str, Any] = {
        "tenant": m.tenant,
        "topic": m.topic,
        "payload": base64.b64encode(m.payload).decode(),
        "qos": int(m.qos),
        "retain": m.retain,
        "client_id": m.client_id,
        "ts_us": m.ts_us,
        "seq": m.seq,
    }
    if m.origin:
        doc["origin"] = m.origin
    props = {
        "payload_format_indicator": p.payload_format_indicator,
        "message_expiry_interval": p.message_expiry_interval,
        "content_type": p.content_type,
        "response_topic": p.response_topic,
        "correlation_data": (
            base64.b64encode(p.correlation_data).decode() if p.correlation_data else None
        ),
        "user_properties": [list(kv) for kv in p.user_properties] or None,
    }
    doc["properties"] = {k: v for k, v in props.items() if v is not None}
    return doc


def message_from(d: dict[str, Any]) -> Message:
    """The message of a :func:`message_doc`."""
    props = dict(d.get("properties") or {})
    if "correlation_data" in props:
        props["correlation_data"] = base64.b64decode(props["correlation_data"])
    if "user_properties" in props:
        props["user_properties"] = tuple((k, v) for k, v in props["user_properties"])
    return Message(
        d["tenant"],
        d["topic"],
        base64.b64decode(d["payload"]),
        QoS(d["qos"]),
        bool(d["retain"]),
        d["client_id"],
        int(d["ts_us"]),
        Properties(**props) if props else NO_PROPERTIES,
        int(d["seq"]),
        str(d.get("origin", "")),
    )


def session_doc(s: Session) -> dict[str, Any]:
    """One persistent session as JSON (snapshots, and a session moving to another edge)."""
    doc = {
        "tenant": s.tenant,
        "client_id": s.client_id,
        "expiry_interval": s.expiry_interval,
        "dropped": s.dropped,
        "subscriptions": [subscription_doc(f, sub) for f, sub in s.subscriptions.items()],
        "inflight": [
            {
                "packet_id": pid,
                "state": out.state.name.removeprefix("OUT_"),  # AWAIT_PUBACK ...
                "qos": int(out.qos),
                "retain": out.retain,
                "message": message_doc(out.message),
            }
            for pid, out in s.inflight.items()
        ],
        "queue": [
            {"qos": int(p.qos), "retain": p.retain, "message": message_doc(p.message)}
            for p in s.queue
        ],
        "awaiting_rel": sorted(s.awaiting_rel),
    }
    if s.subscription_ids:
        doc["ids"] = dict(s.subscription_ids)
    if s.claim != NO_CLAIM or s.since != NO_CLAIM:  # in a mesh (broker_edge.handover)
        doc["claim"], doc["since"] = list(s.claim), list(s.since)
    return doc


def subscription_doc(topic_filter: str, sub: Subscription) -> dict[str, Any]:
    """One subscription as JSON (snapshots and the session log)."""
    return {
        "filter": topic_filter,
        "qos": int(sub.qos),
        "no_local": sub.no_local,
        "retain_as_published": sub.retain_as_published,
        "retain_handling": int(sub.retain_handling),
    }


def subscription_from(d: dict[str, Any]) -> Subscription:
    return Subscription(
        topic_filter=d["filter"],
        qos=QoS(d["qos"]),
        no_local=bool(d["no_local"]),
        retain_as_published=bool(d["retain_as_published"]),
        retain_handling=RetainHandling(d["retain_handling"]),
    )


def session_from(d: dict[str, Any], max_queued: int, max_inflight: int, since: float) -> Session:
    session = Session(
        client_id=d["client_id"],
        tenant=d["tenant"],
        clean=False,
        max_queued=max_queued,
        max_inflight=max_inflight,
        expiry_interval=int(d["expiry_interval"]),
    )
    session.dropped = int(d.get("dropped", 0))
    session.disconnected_at = since
    for sub in d["subscriptions"]:
        session.subscriptions[sub["filter"]] = subscription_from(sub)
    for topic_filter, sub_id in d.get("ids", {}).items():
        session.set_subscription_id(str(topic_filter), int(sub_id))
    if "claim" in d:
        session.claim = (int(d["claim"][0]), str(d["claim"][1]))
        session.since = (int(d["since"][0]), str(d["since"][1]))
    for out in d["inflight"]:
        session.inflight[int(out["packet_id"])] = Outbound(
            message_from(out["message"]),
            QoS(out["qos"]),
            bool(out["retain"]),
            Flow["OUT_" + out["state"]],
        )
    session.restore(
        (Pending(message_from(p["message"]), QoS(p["qos"]), bool(p["retain"])) for p in d["queue"]),
        (int(pid) for pid in d["awaiting_rel"]),
    )
    return session
