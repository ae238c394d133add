"""Tenants, tokens, access rules and limits, from a TOML tenants file (flespi style).

The MQTT username of a client is its token; the token names its tenant, and every topic the
client uses lives in that tenant's namespace. The file's shape::

    [operator]
    token = "op-secret"                 # the platform's own clients (pipeline, ops)

    [tenants.acme]
    tokens = ["token-a", "token-b"]     # MQTT username = token; password not needed
    logs_retention_days = 90            # optional: history the pipeline keeps (whole days
    messages_retention_days = 365       # besides today; 0: forever), else [pipeline]'s
    [tenants.acme.limits]
    messages_per_day = 1_000_000        # enforced by the pipeline (quota loop)
    bytes_per_day = 1_000_000_000       # enforced by the pipeline (quota loop)
    sessions = 1000                     # enforced by each edge at once
    messages_per_second = 100           # per client, enforced by each edge (token bucket)
    max_payload_bytes = 262144          # enforced by each edge
    [tenants.acme.acl."token-b"]        # optional, per token; absent = everything allowed
    publish = ["fleet/+/telemetry"]
    subscribe = ["fleet/#", "$log/#", "$counters/#", "$quota/#"]

Unknown keys and bad values are refused with a message naming the key.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker_edge.errors import ConfigError
from broker_edge.topics import InvalidTopic, validate_topic_filter
from broker_edge.trie import TopicTrie
from schemas.names import DEFAULT_TENANT, RETENTION_DAYS

OPERATOR_TENANT = "$operator"  # cannot clash: tenant names may not start with "$"


@dataclass(frozen=True, slots=True)
class Limits:
    messages_per_day: int | None = None
    bytes_per_day: int | None = None
    sessions: int | None = None
    messages_per_second: float | None = None
    max_payload_bytes: int | None = None


class Acl:
    """Topic filters a token may publish to and subscribe with; ``None`` allows everything."""

    __slots__ = ("_publish", "_subscribe", "publish", "subscribe")

    def __init__(
        self, publish: tuple[str, ...] | None = None, subscribe: tuple[str, ...] | None = None
    ) -> None:
        self.publish = publish
        self.subscribe = subscribe
        self._publish = _filter_set(publish)
        self._subscribe = _filter_set(subscribe)

    def may_publish(self, topic: str) -> bool:
        return self._publish is None or bool(self._publish.match(topic))

    def may_subscribe(self, topic_filter: str) -> bool:
        """A subscription is allowed when its filter is one of the granted filters or is
        covered by one (``fleet/v1/+`` under ``fleet/#``)."""
        if self.subscribe is None:
            return True
        return any(_covers(granted, topic_filter) for granted in self.subscribe)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Acl)
            and self.publish == other.publish
            and self.subscribe == other.subscribe
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    tokens: tuple[str, ...]
    limits: Limits = Limits()
    acl: Mapping[str, Acl] = field(default_factory=dict)
    # table -> whole days of history the pipeline keeps besides today (0: forever); a table
    # not here keeps the pipeline's default (schemas.names.RETENTION_DAYS names the keys).
    retention_days: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Grant:
    """What one token gives: its tenant and its access rules."""

    tenant: str
    acl: Acl
    operator: bool = False


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    operator_token: str | None
    tenants: Mapping[str, Tenant]

    def grant(self, token: str | None) -> Grant | None:
        if token is None:
            return None
        if self.operator_token is not None and token == self.operator_token:
            return Grant(OPERATOR_TENANT, ALLOW_ALL, operator=True)
        for tenant in self.tenants.values():
            if token in tenant.tokens:
                return Grant(tenant.name, tenant.acl.get(token, ALLOW_ALL))
        return None

    def limits(self, tenant: str) -> Limits:
        found = self.tenants.get(tenant)
        return found.limits if found is not None else Limits()


def load(path: Path) -> TenantsConfig:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: tenants file not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse(data, str(path))


def parse(data: Mapping[str, Any], where: str = "tenants") -> TenantsConfig:
    _known(data, {"operator", "tenants"}, where)
    operator = data.get("operator", {})
    _table(operator, f"{where}: operator")
    _known(operator, {"token"}, f"{where}: operator")
    operator_token = operator.get("token")
    if operator_token is not None:
        _token(operator_token, f"{where}: operator.token")
    tenants_table = data.get("tenants", {})
    _table(tenants_table, f"{where}: tenants")
    tenants: dict[str, Tenant] = {}
    seen: dict[str, str] = {}
    if operator_token is not None:
        seen[operator_token] = "operator"
    for name, body in tenants_table.items():
        key = f"{where}: tenants.{name}"
        if not name or name.startswith("$") or "/" in name:
            raise ConfigError(f"{key}: a tenant name may not be empty, start with '$' or hold '/'")
        if name == DEFAULT_TENANT:
            # The anonymous tenant of an edge without a tenants file: a tenant of that name
            # would share its journal records, and once saw the node's $SYS statistics.
            raise ConfigError(
                f"{key}: {DEFAULT_TENANT!r} is reserved for the anonymous tenant of an edge "
                "without a tenants file; choose another name"
            )
        _table(body, key)
        _known(body, {"tokens", "limits", "acl", *RETENTION_DAYS.values()}, key)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ConfigError(f"{key}.tokens: must be a non-empty list of strings")
        for token in tokens:
            _token(token, f"{key}.tokens")
            if token in seen:
                raise ConfigError(f"{key}.tokens: token also used by {seen[token]}")
            seen[token] = f"tenants.{name}"
        limits = _limits(body.get("limits", {}), f"{key}.limits")
        acl_table = body.get("acl", {})
        _table(acl_table, f"{key}.acl")
        acl: dict[str, Acl] = {}
        for token, rules in acl_table.items():
            if token not in tokens:
                raise ConfigError(f"{key}.acl.{token}: not one of this tenant's tokens")
            acl[token] = _acl(rules, f"{key}.acl.{token}")
        retention: dict[str, int] = {}
        for table, days_key in RETENTION_DAYS.items():
            days = body.get(days_key)
            if days is None:
                continue
            if not isinstance(days, int) or isinstance(days, bool) or days < 0:
                raise ConfigError(
                    f"{key}.{days_key}: must be a whole number of days >= 0 (0: forever), "
                    f"got {days!r}"
                )
            retention[table] = days
        tenants[name] = Tenant(name, tuple(tokens), limits, acl, retention)
    return TenantsConfig(operator_token, tenants)


def _limits(table: Any, key: str) -> Limits:
    _table(table, key)
    _known(table, set(Limits.__dataclass_fields__), key)
    values: dict[str, Any] = {}
    for name, value in table.items():
        if name == "messages_per_second":
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
            ok = ok and math.isfinite(value)
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        if not ok:
            raise ConfigError(f"{key}.{name}: must be a number >= 0 (rate: > 0), got {value!r}")
        values[name] = value
    return Limits(**values)


def _acl(table: Any, key: str) -> Acl:
    _table(table, key)
    _known(table, {"publish", "subscribe"}, key)
    lists: dict[str, tuple[str, ...] | None] = {"publish": None, "subscribe": None}
    for name in ("publish", "subscribe"):
        if name not in table:
            continue
        filters = table[name]
        if not isinstance(filters, list) or not all(isinstance(f, str) for f in filters):
            raise ConfigError(f"{key}.{name}: must be a list of topic filters")
        for topic_filter in filters:
            try:
                validate_topic_filter(topic_filter)
            except InvalidTopic as exc:
                raise ConfigError(f"{key}.{name}: {topic_filter!r}: {exc}") from exc
        lists[name] = tuple(filters)
    return Acl(lists["publish"], lists["subscribe"])


def _covers(granted: str, wanted: str) -> bool:
    """Whether every topic matched by ``wanted`` is matched by ``granted``."""
    g_levels = granted.split("/")
    w_levels = wanted.split("/")
    for i, g in enumerate(g_levels):
        if g == "#":
            # "#" at the first level never covers "$" topics [MQTT-4.7.2-1].
            return not (i == 0 and w_levels[0].startswith("$"))
        if i >= len(w_levels):
            return False
        w = w_levels[i]
        if g == "+":
            if w == "#" or (i == 0 and w.startswith("$")):
                return False
            continue
        if g != w:
            return False
    return len(w_levels) == len(g_levels)


def _filter_set(filters: tuple[str, ...] | None) -> TopicTrie[int, None] | None:
    if filters is None:
        return None
    trie: TopicTrie[int, None] = TopicTrie()
    for topic_filter in filters:
        trie.add(topic_filter, 0, None)
    return trie


def _known(table: Mapping[str, Any], known: set[str], key: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"{key}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )


def _table(value: Any, key: str) -> None:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: must be a table")


def _token(value: Any, key: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: a token must be a non-empty string")


ALLOW_ALL = Acl()
