"""What the REST API's ``GET /messages`` asks of the ``messages`` table: a tenant's messages on
the topics an MQTT topic filter matches, in a time range, paged as ``logs`` is.

One DataFusion query through delta-rs, paged by :mod:`edgebus.page` (partition bounds, the
``(ts, node, seq)`` order and its cursor). The topic filter becomes SQL: ``topic = ...`` when it
has no wildcard, else a regular expression (``+`` one level, ``#`` the level it stands on and
every level below, MQTT 5.0 section 4.7) behind a ``starts_with`` on the filter's literal
prefix, which DataFusion evaluates first and cheaply.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from edgebus import lake_command
from edgebus.lake_command import CommandError, iso, sql_string
from edgebus.page import Cursor, Page, fetch_by_days

if TYPE_CHECKING:
    from deltalake import DeltaTable

# The name the table is registered under in the queries.
QUERY_TABLE = "messages"
COLUMNS = (
    "ts",
    "node",
    "seq",
    "tenant",
    "client_id",
    "topic",
    "qos",
    "retain",
    "payload",
    "content_type",
    "user_properties",
    "size",
)
# The characters a Rust regular expression (DataFusion's) reads as syntax.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def check_topic_filter(text: str) -> str:
    """``text`` if it is a valid MQTT topic filter, else :class:`CommandError` (exit 2)."""
    from broker_edge.topics import InvalidTopic, validate_topic_filter

    try:
        return validate_topic_filter(text)
    except InvalidTopic as exc:
        raise CommandError(f"topic {text!r} is not a topic filter: {exc}", exit_code=2) from exc


def topic_conditions(topic_filter: str) -> list[str]:
    """SQL conditions on ``topic`` that hold exactly for the topics ``topic_filter`` matches."""
    levels = topic_filter.split("/")
    if "+" not in levels and "#" not in levels:
        return [f"topic = {sql_string(topic_filter)}"]
    literal = []
    for level in levels:
        if level in ("+", "#"):
            break
        literal.append(level)
    conditions = []
    if literal:
        conditions.append(f"starts_with(topic, {sql_string('/'.join(literal))})")
    else:
        # [MQTT-4.7.2-1] a filter starting with a wildcard matches no topic starting with '$'.
        conditions.append("NOT starts_with(topic, '$')")
    parts = ["[^/]*" if level == "+" else _regex_literal(level) for level in levels]
    if levels[-1] == "#":
        # [MQTT-4.7.1-2] '#' also matches the parent level: "a/#" matches "a".
        pattern = "/".join(parts[:-1]) + "(/.*)?" if len(levels) > 1 else ".*"
    else:
        pattern = "/".join(parts)
    conditions.append(f"topic ~ {sql_string('^' + pattern + '$')}")
    return conditions


def _regex_literal(level: str) -> str:
    return "".join("\\" + char if char in _REGEX_META else char for char in level)


@dataclass(frozen=True, slots=True)
class MessageQuery:
    """A tenant's messages on ``topic_filter`` (default: every topic), one page of them."""

    tenant: str
    topic_filter: str = "#"
    since: datetime | None = None
    until: datetime | None = None
    client_ids: tuple[str, ...] = ()
    after: Cursor | None = None
    oldest_first: bool = False
    limit: int = 100

    def page(self) -> Page:
        return Page(self.tenant, self.since, self.until, self.after, self.oldest_first)

    def sql(self) -> str:
        """The page's query over the table registered as :data:`QUERY_TABLE`."""
        conditions = self.page().conditions() + topic_conditions(self.topic_filter)
        if self.client_ids:
            conditions.append(f"client_id IN ({', '.join(map(sql_string, self.client_ids))})")
        return self.page().sql(QUERY_TABLE, COLUMNS, conditions, self.limit)


def fetch(delta: DeltaTable, query: MessageQuery) -> list[dict[str, Any]]:
    """The first ``query.limit`` matching rows in the query's order."""

    def one_window(window: MessageQuery) -> list[dict[str, Any]]:
        return lake_command.query(delta, QUERY_TABLE, window.sql())

    return fetch_by_days(delta, query, one_window)


def message_doc(row: dict[str, Any]) -> dict[str, Any]:
    """One row as JSON: the payload as text when it is UTF-8, else base64 (``payload_encoding``
    says which), user properties as ``[key, value]`` pairs (MQTT allows a key twice), and the
    row's cursor."""
    payload: bytes = row["payload"]
    try:
        text, encoding = payload.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(payload).decode("ascii"), "base64"
    properties = row["user_properties"]
    return {
        "ts": iso(row["ts"]),
        "node": row["node"],
        "seq": row["seq"],
        "tenant": row["tenant"],
        "client_id": row["client_id"],
        "topic": row["topic"],
        "qos": row["qos"],
        "retain": row["retain"],
        "payload": text,
        "payload_encoding": encoding,
        "content_type": row["content_type"],
        "user_properties": None
        if properties is None
        else [[item["key"], item["value"]] for item in properties],
        "size": row["size"],
        "cursor": Cursor.of(row).encode(),
    }
