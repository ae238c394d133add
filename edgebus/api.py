"""``edgebus api``: the lake over HTTP for tenants and operators (flespi's ``GET /platform/logs``).

Theory of operation
-------------------
A FastAPI application (OpenAPI at ``/openapi.json``) served by uvicorn. Every endpoint reads the
lake through the same query layer as the commands (:mod:`edgebus.log_query`,
:mod:`edgebus.message_query`, :mod:`edgebus.usage_query`): the SQL lives there once, the API only
turns query parameters into a query and rows into JSON.

Tenancy: the bearer token is looked up in the tenants file (:mod:`broker_edge.tenants`, re-read
when the file changes). A tenant's token reads its own tenant only (``?tenant=`` may name it, and
no other: 403); the operator token must name one with ``?tenant=``. A token reads over HTTP what
its access rules let it subscribe to over MQTT: ``$log/#`` for ``/logs``, ``$counters/#`` for
``/usage``, ``$quota/#`` for ``/quota``, the topic filter itself for ``/messages`` (a token
without rules reads everything of its tenant). Every error is JSON, ``{"error": CODE,
"detail": TEXT}``; a bad parameter's detail starts with the parameter's name.

The endpoints are plain functions, run in the server's thread pool: delta-rs and DataFusion
block, and release the GIL while they read. Tables stay open between requests (a table's log is
read once, then only its new commits: ``update_incremental``); a table the pipeline has not
created yet answers an empty result.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations, and
# those name create_app's local dependency, which postponed annotations could not resolve.
import logging
import os
import signal
import socket
import threading
from argparse import ArgumentTypeError
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import orjson
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from broker_edge.errors import ConfigError
from broker_edge.tenants import ALLOW_ALL, Acl, Grant, TenantsConfig
from broker_edge.tenants import load as load_tenants
from edgebus import lake_command, log_query, message_query, usage_query
from edgebus.lake_command import CommandError, resolve_time, time_arg
from edgebus.log_query import DetailMatch, LogQuery
from edgebus.message_query import MessageQuery
from edgebus.page import Cursor
from edgebus.usage_query import QuotaHistory, UsageQuery
from sinks.storage import LakePath

if TYPE_CHECKING:
    from deltalake import DeltaTable

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 100
# A page is built in memory and sent in one response: more rows at once is edgebus sql's job.
MAX_LIMIT = 10_000
_T = TypeVar("_T")
_R = TypeVar("_R")
LOG_TOPICS = "$log/#"
COUNTER_TOPICS = "$counters/#"
QUOTA_TOPICS = "$quota/#"
DESCRIPTION = """\
A tenant's log events, messages, usage counters and quota state from the edgebus lake.

Authenticate with `Authorization: Bearer TOKEN`, a token of the tenants file: a tenant's token
reads its own tenant; the operator token names the tenant with `?tenant=`. Times are ISO 8601
(UTC unless they name a zone) or durations back from now (`90s`, `15m`, `2h`, `7d`, `2w`);
`since` is inclusive, `until` exclusive. `/logs` and `/messages` are paged: a full page has a
`next_cursor`; pass it as `cursor` for the rows after it, in the same order (no row is lost or
repeated, also when rows share a timestamp). Every row's own `cursor` works the same way (and is
the `--after` of `edgebus logs`). Errors are `{"error": CODE, "detail": TEXT}`.
"""


class ApiError(Exception):
    """A request the API answers with ``status`` and ``{"error": error, "detail": detail}``."""

    def __init__(
        self, status: int, error: str, detail: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = headers


def bad_parameter(name: str, message: str) -> ApiError:
    return ApiError(400, "invalid_parameter", f"{name}: {message}")


class OrjsonResponse(JSONResponse):
    """JSON by orjson: rows hold dates, bytes are already text; several times json's speed."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class TenantsFile:
    """The tenants file, read again when it changes (its modification time or size)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self.config = load_tenants(path)  # a bad file at start is the caller's error

    def _stat(self) -> tuple[int, int] | None:
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def current(self) -> TenantsConfig:
        stamp = self._stat()
        if stamp is not None and stamp != self._stamp:
            with self._lock:
                if stamp != self._stamp:
                    self._stamp = stamp
                    try:
                        self.config = load_tenants(self.path)
                        log.info("tenants file %s reloaded", self.path)
                    except (ConfigError, OSError) as exc:
                        log.warning("tenants file not reloaded, keeping the old one: %s", exc)
        return self.config


class LakeTables:
    """The lake's tables, kept open: each request brings a table up to its newest commit."""

    def __init__(self, lake: LakePath) -> None:
        self.lake = lake
        self._open: dict[str, DeltaTable] = {}
        self._lock = threading.Lock()

    def open(self, name: str) -> "DeltaTable | None":
        """``name`` at its newest version; None when the pipeline has not created it yet."""
        from deltalake.exceptions import DeltaError

        with self._lock:
            delta = self._open.get(name)
            if delta is None:
                delta = lake_command.open_table(self.lake, name)
                if delta is not None:
                    self._open[name] = delta
                return delta
            try:
                delta.update_incremental()
            except (DeltaError, OSError) as exc:
                del self._open[name]  # opened afresh next time (vacuumed away, recreated)
                raise CommandError(f"cannot read {self.lake / name}: {exc}", 1) from exc
            return delta


@dataclass(frozen=True, slots=True)
class Access:
    """Whose data a request reads, and what its token may subscribe to."""

    tenant: str
    acl: Acl

    def check(self, topic_filter: str, what: str) -> None:
        if not self.acl.may_subscribe(topic_filter):
            raise ApiError(
                403,
                "forbidden",
                f"this token may not read {what}: its access rules do not let it subscribe "
                f"to {topic_filter!r}",
            )


# The parameters several endpoints share.
Since = Annotated[
    str | None,
    Query(description="from this time on (inclusive): ISO 8601, or a duration back: 2h, 7d"),
]
Until = Annotated[str | None, Query(description="up to this time (exclusive), as since")]
Order = Annotated[
    Literal["newest", "oldest"], Query(description="newest first (default) or oldest first")
]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description=f"at most this many (<= {MAX_LIMIT})")]
CursorParam = Annotated[
    str | None,
    Query(description="the next_cursor of the previous page (or any row's cursor)"),
]
Day = Annotated[
    date | None,
    Query(alias="date", description="the UTC day YYYY-MM-DD (default today)"),
]


Clock = Callable[[], datetime]


def create_app(
    lake: LakePath, tenants: Path, *, clock: Clock = lambda: datetime.now(UTC)
) -> FastAPI:
    """The API over ``lake`` for the tokens of the tenants file ``tenants``."""
    tenants_file = TenantsFile(tenants)
    tables = LakeTables(lake)
    bearer = HTTPBearer(auto_error=False, description="a token of the tenants file")
    app = FastAPI(
        title="edgebus",
        description=DESCRIPTION,
        version="1",
        default_response_class=OrjsonResponse,
        docs_url=None,
        redoc_url=None,
    )
    _add_error_handlers(app)

    def access(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
        tenant: Annotated[
            str | None,
            Query(description="the tenant to read: required with the operator token"),
        ] = None,
    ) -> Access:
        if credentials is None:
            raise ApiError(
                401,
                "unauthorized",
                "send the tenant's token: Authorization: Bearer TOKEN",
                {"WWW-Authenticate": "Bearer"},
            )
        grant: Grant | None = tenants_file.current().grant(credentials.credentials)
        if grant is None:
            raise ApiError(
                401,
                "unauthorized",
                "the token is not in the tenants file",
                {"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        if grant.operator:
            if not tenant:
                raise bad_parameter("tenant", "the operator token names the tenant: ?tenant=NAME")
            return Access(tenant, ALLOW_ALL)
        if tenant is not None and tenant != grant.tenant:
            raise ApiError(403, "forbidden", f"this token reads tenant {grant.tenant!r} only")
        return Access(grant.tenant, grant.acl)

    Reader = Annotated[Access, Depends(access)]  # noqa: N806 (a type, named as one)

    @app.get("/logs", summary="a tenant's log events, newest first")
    def get_logs(
        reader: Reader,
        since: Since = None,
        until: Until = None,
        event_type: Annotated[
            list[str], Query(description="only these event types (repeatable: any)")
        ] = [],  # noqa: B006 (FastAPI copies a list default per request)
        client_id: Annotated[list[str], Query(description="only these client ids")] = [],  # noqa: B006
        origin: Annotated[list[str], Query(description="only these origins: mqtt, quota")] = [],  # noqa: B006
        node: Annotated[list[str], Query(description="only events of these edge nodes")] = [],  # noqa: B006
        where: Annotated[
            list[str],
            Query(description="KEY=VALUE on a details field, e.g. clean=false (repeatable: all)"),
        ] = [],  # noqa: B006
        order: Order = "newest",
        limit: Limit = DEFAULT_LIMIT,
        cursor: CursorParam = None,
    ) -> dict[str, Any]:
        reader.check(LOG_TOPICS, "log events")
        query = LogQuery(
            reader.tenant,
            event_types=tuple(event_type),
            client_ids=tuple(client_id),
            origins=tuple(origin),
            nodes=tuple(node),
            where=tuple(_parsed("where", DetailMatch.parse, text) for text in where),
            limit=limit,
            **_paging(since, until, cursor, order, clock()),
        )
        if event_type:
            _parsed("event_type", log_query.check_event_types, event_type)
        delta = _read(tables.open, "logs")
        rows = [] if delta is None else _read(log_query.fetch, delta, query)
        return _page(reader.tenant, [log_query.event_doc(row) for row in rows], limit)

    @app.get("/messages", summary="a tenant's messages by topic filter, newest first")
    def get_messages(
        reader: Reader,
        topic: Annotated[
            str, Query(description="an MQTT topic filter: + one level, # every level below")
        ] = "#",
        since: Since = None,
        until: Until = None,
        client_id: Annotated[list[str], Query(description="only from these client ids")] = [],  # noqa: B006
        order: Order = "newest",
        limit: Limit = DEFAULT_LIMIT,
        cursor: CursorParam = None,
    ) -> dict[str, Any]:
        _parsed("topic", message_query.check_topic_filter, topic)
        reader.check(topic, "these messages")
        query = MessageQuery(
            reader.tenant,
            topic,
            client_ids=tuple(client_id),
            limit=limit,
            **_paging(since, until, cursor, order, clock()),
        )
        delta = _read(tables.open, "messages")
        rows = [] if delta is None else _read(message_query.fetch, delta, query)
        return _page(reader.tenant, [message_query.message_doc(row) for row in rows], limit)

    @app.get("/usage", summary="a tenant's usage counters for one UTC day")
    def get_usage(reader: Reader, day: Day = None) -> dict[str, Any]:
        reader.check(COUNTER_TOPICS, "usage counters")
        result = _usage(reader.tenant, day or clock().date())
        return usage_query.usage_doc(result)

    @app.get("/quota", summary="a tenant's quota state and its history")
    def get_quota(
        reader: Reader,
        day: Day = None,
        since: Since = None,
        until: Until = None,
        limit: Limit = DEFAULT_LIMIT,
    ) -> dict[str, Any]:
        reader.check(QUOTA_TOPICS, "quota states")
        now = clock()
        start, end = _time_range(since, until, now)
        doc = usage_query.usage_doc(_usage(reader.tenant, day or now.date()))
        history = QuotaHistory(reader.tenant, start, end, limit)
        delta = _read(tables.open, usage_query.QUOTA_TABLE)
        return {
            "tenant": reader.tenant,
            "date": doc["date"],
            "state": doc["quota"],
            "history": _read(usage_query.quota_history, delta, history),
        }

    def _usage(tenant: str, day: date) -> usage_query.TenantUsage:
        return _read(usage_query.read_usage, lake, UsageQuery(tenant, day), tables.open)

    return app


def _parsed(name: str, parse: Callable[[_T], _R], value: _T) -> _R:
    """``parse(value)``; a :class:`CommandError` it raises becomes a 400 naming ``name``."""
    try:
        return parse(value)
    except CommandError as exc:
        raise bad_parameter(name, str(exc)) from exc


def _read(function: Callable[..., _R], *args: Any) -> _R:
    """``function(*args)`` reading the lake; a lake that cannot be read answers 503."""
    try:
        return function(*args)
    except CommandError as exc:
        raise ApiError(503, "lake_unavailable", str(exc)) from exc


def _time_range(
    since: str | None, until: str | None, now: datetime
) -> tuple[datetime | None, datetime | None]:
    def absolute(name: str, text: str | None) -> datetime | None:
        if text is None:
            return None
        try:
            value = time_arg(text)
        except ArgumentTypeError as exc:
            raise bad_parameter(name, str(exc)) from exc
        return _parsed(name, lambda v: resolve_time(name, v, now), value)

    start, end = absolute("since", since), absolute("until", until)
    if start is not None and end is not None and start >= end:
        raise bad_parameter("since", f"{since!r} is not before until {until!r}")
    return start, end


def _paging(
    since: str | None, until: str | None, cursor: str | None, order: str, now: datetime
) -> dict[str, Any]:
    """The paging arguments of a query (:class:`edgebus.page.Page`'s) from the parameters."""
    start, end = _time_range(since, until, now)
    oldest_first = order == "oldest"
    return {"since": start, "until": end, "after": _cursor(cursor), "oldest_first": oldest_first}


def _cursor(text: str | None) -> Cursor | None:
    if not text:  # cursor= (a client that sends the parameter on its first page too)
        return None
    return _parsed("cursor", lambda t: Cursor.decode(t, "cursor"), text)


def _page(tenant: str, rows: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """A page of rows; a full one names the cursor to go on with."""
    next_cursor = rows[-1]["cursor"] if len(rows) == limit else None
    return {"tenant": tenant, "rows": rows, "next_cursor": next_cursor}


def _add_error_handlers(app: FastAPI) -> None:
    def body(status: int, error: str, detail: str, headers: Mapping[str, str] | None = None) -> Any:
        return OrjsonResponse({"error": error, "detail": detail}, status, headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Any:
        return body(exc.status, exc.error, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Any:
        details = []
        for error in exc.errors():
            where = [str(part) for part in error.get("loc", ()) if part not in ("query", "header")]
            details.append(f"{'.'.join(where) or 'request'}: {error.get('msg', 'invalid')}")
        return body(422, "invalid_parameter", "; ".join(details))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        error = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return body(exc.status_code, error, str(exc.detail), exc.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Any:
        # Starlette raises it again after this answer: uvicorn logs it with its traceback.
        return body(500, "internal", f"{type(exc).__name__}: {exc}")


def serve(app: FastAPI, host: str, port: int) -> int:
    """Serve ``app`` on ``host:port`` (0: any free port) until SIGTERM or SIGINT; exit code 0.

    The port is bound before anything is printed, so the "listening" line a script waits for
    names the real port; connections made before the server loop runs wait in the backlog.
    """
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, lifespan="off", server_header=False)
    server = uvicorn.Server(config)

    # uvicorn catches SIGTERM/SIGINT, shuts down gracefully, then raises the signal again for
    # the handlers it found: these, so the process ends with 0 rather than dying of the signal.
    def stopped(signum: int, frame: object) -> None:
        log.info("signal %d: stopped", signum)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"edgebus api listening on http://{shown}:{bound}", flush=True)
    server.run(sockets=[sock])
    return 0
