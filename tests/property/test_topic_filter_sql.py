"""``GET /messages``'s topic filter as SQL against the broker's own matcher.

For any valid topic filter, the rows DataFusion keeps with
:func:`edgebus.message_query.topic_conditions` are exactly the topics
:func:`broker_edge.topics.matches` says the filter matches, over a ``messages`` table whose
topics hold every character a regular expression reads as syntax.
"""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from hypothesis import given, settings
from hypothesis import strategies as st
from lake_fixture import DeltaBatchWriter

from broker_edge.topics import InvalidTopic, matches, validate_topic_filter
from edgebus import lake_command
from edgebus.message_query import QUERY_TABLE, topic_conditions
from schemas.tables import MESSAGES_PARTITION_BY, MESSAGES_SCHEMA

TS = dt.datetime(2024, 3, 10, tzinfo=dt.UTC)
# Levels with regular expression syntax in them, empty levels, and plain ones.
LEVELS = [
    "a",
    "b",
    "",
    "a.b",
    "x*",
    "(y)",
    "[z]",
    "^",
    "$",
    "\\",
    "{1}",
    "a|b",
    "?",
    "~-&",
    "é",
    " ",
]


def topic_names() -> list[str]:
    names = {"a", "b", "/", "//", "a/", "/a"}
    names |= {f"{x}/{y}" for x in LEVELS for y in LEVELS}
    names |= {f"{x}/{y}/{z}" for x in LEVELS[:6] for y in LEVELS[:6] for z in LEVELS[:6]}
    return sorted(name for name in names if name and not name.startswith("$"))


TOPICS = topic_names()


@pytest.fixture(scope="module")
def messages(tmp_path_factory: pytest.TempPathFactory) -> DeltaTable:
    path = tmp_path_factory.mktemp("lake") / "messages"
    rows = [
        {
            "node": "edge-a",
            "seq": seq,
            "ts": TS,
            "date": TS.date(),
            "tenant": "acme",
            "client_id": "c",
            "topic": topic,
            "qos": 0,
            "retain": False,
            "payload": b"",
            "content_type": None,
            "user_properties": None,
            "size": 0,
        }
        for seq, topic in enumerate(TOPICS, start=1)
    ]
    writer = DeltaBatchWriter(path, "test", MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)
    writer.write(0, pa.Table.from_pylist(rows, schema=MESSAGES_SCHEMA))
    return DeltaTable(str(path))


filters = st.lists(st.sampled_from([*LEVELS, "+", "+", "#"]), min_size=1, max_size=4).map("/".join)


@settings(max_examples=150, deadline=None)
@given(topic_filter=filters)
def test_sql_keeps_exactly_the_matching_topics(messages: DeltaTable, topic_filter: str) -> None:
    try:
        validate_topic_filter(topic_filter)
    except InvalidTopic:
        return  # the API refuses it (400) before any SQL
    where = " AND ".join(topic_conditions(topic_filter))
    sql = f"SELECT topic FROM {QUERY_TABLE} WHERE {where}"
    found = sorted(row["topic"] for row in lake_command.query(messages, QUERY_TABLE, sql))
    assert found == [topic for topic in TOPICS if matches(topic_filter, topic)], topic_filter
