"""The ``edgebus`` command line: the parser, and each command handed to the module that runs it.

The platform's commands (``edge``, ``pipeline``, ``run``, ``maintain``, ``api``) are
:mod:`edgebus.platform_cli`, imported only when one of them runs: the lake's readers (``logs``,
``usage``, ``quality``, ``sql``) start without the broker's and the pipeline's modules.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from edgebus import lake_command

# The lake's readers: the module that adds each command to the parser and runs it.
LAKE_COMMANDS = {
    "logs": "edgebus.logs_cli",
    "quality": "edgebus.quality_cli",
    "sql": "edgebus.sql_cli",
    "usage": "edgebus.usage_cli",
}
# What `edgebus --help` says (the module docstring's ``markup`` would show as it is).
DESCRIPTION = "MQTT broker edges, the Spark pipeline that writes the lake, and reading the lake."


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65_535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """``edgebus``'s parser; for a lake ``command``, with that command alone (the others' parsers
    and modules are not built: a quarter of an ``edgebus logs``'s own start-up)."""
    parser = argparse.ArgumentParser(prog="edgebus", description=DESCRIPTION)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    if command in LAKE_COMMANDS:
        importlib.import_module(LAKE_COMMANDS[command]).add_parser(sub)
        return parser

    edge = sub.add_parser("edge", help="run one MQTT broker edge node")
    edge.add_argument("--listen", type=_host_port, help="HOST:PORT (default 127.0.0.1:1883)")
    edge.add_argument("--data-dir", type=Path, help="data dir; journal in DIR/journal/NODE")
    edge.add_argument("--node-id", help="node name (default: the host name)")
    edge.add_argument("--config", type=Path, help="TOML settings file with an [edge] table")
    edge.add_argument(
        "--tenants", type=Path, help="TOML tenants file (tokens, ACLs, limits); SIGHUP reloads it"
    )
    edge.add_argument(
        "--http",
        type=_host_port,
        help="HOST:PORT serving the durable journal to remote pipelines, and /healthz "
        "(bearer: the tenants file's operator token; without one, loopback only)",
    )
    for kind, what in (
        ("tls", "MQTT over TLS 1.2+ (needs --cert and --key)"),
        ("ws", "MQTT over WebSocket (path /mqtt, subprotocol mqtt)"),
        ("wss", "MQTT over WebSocket over TLS (needs --cert and --key)"),
    ):
        edge.add_argument(f"--listen-{kind}", type=_host_port, metavar="HOST:PORT", help=what)
    edge.add_argument("--cert", metavar="FILE", help="the TLS listeners' certificate chain (PEM)")
    edge.add_argument("--key", metavar="FILE", help="its private key (PEM, unencrypted)")
    edge.add_argument(
        "--cafile",
        metavar="FILE",
        help="CA certificates (PEM): TLS clients must present a certificate one of them signed",
    )
    edge.add_argument(
        "--loop", choices=("auto", "uvloop", "asyncio"), default="auto", help="event loop"
    )
    _peer_arg(edge)

    pipe = sub.add_parser("pipeline", help="run the Spark pipeline over every node's journal")
    _pipeline_args(pipe)
    pipe.add_argument("--once", action="store_true", help="process what is there, then exit")
    pipe.add_argument(
        "--metrics",
        type=_host_port,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port, "
        "printed; overrides [pipeline] metrics_listen)",
    )
    pipe.add_argument(
        "--tenants",
        type=Path,
        help="TOML tenants file: the limits the quota step enforces, and the tenants' own "
        "logs_retention_days / messages_retention_days",
    )
    pipe.add_argument(
        "--broker",
        type=_host_port,
        action="append",
        default=[],
        help="HOST:PORT (MQTT) of an edge to send quota decisions and journal notices to "
        "(repeatable; edges meshed with peers pass them on to each other, so one of a mesh "
        "is enough; else list every edge, those read with --edge too); without --tenants the "
        "notices use the operator token the edge made in the data dir",
    )
    pipe.add_argument(
        "--edge",
        type=_host_port,
        action="append",
        default=[],
        help="HOST:PORT of an edge's HTTP port (edgebus edge --http) to read its journal from "
        "(repeatable; adds to [pipeline] edges; bearer: the --tenants operator token)",
    )

    run = sub.add_parser("run", help="the embedded default: one edge plus the pipeline")
    _peer_arg(run)
    run.add_argument("--listen", type=_host_port, default=("127.0.0.1", 1883))
    run.add_argument("--node-id", default=None)
    run.add_argument("--tenants", type=Path, help="tenants file for the edge and the quota step")
    _pipeline_args(run)
    maintain = sub.add_parser(
        "maintain",
        help="maintain every table of the lake once, now (expire history, repair, compact, "
        "vacuum, checkpoint)",
        description="Maintain every table of the lake once, now: delete the logs and messages "
        "older than each tenant keeps (logs_retention_days, messages_retention_days), rewrite "
        "files whose physical types differ from the table's (lakes written before Spark's "
        "Delta wrote them), compact small files, vacuum files older than "
        "vacuum_retention_hours, checkpoint. What the pipeline does every "
        "maintenance_interval_seconds.",
    )
    _pipeline_args(maintain)
    maintain.add_argument(
        "--tenants",
        type=Path,
        help="TOML tenants file: the tenants' own logs_retention_days and "
        "messages_retention_days (else [pipeline]'s hold for every tenant)",
    )
    api = sub.add_parser(
        "api",
        help="serve the lake over HTTP: logs, messages, usage and quota per tenant (REST)",
        description="Serve the lake's tables over HTTP (a REST API; OpenAPI at /openapi.json): "
        "GET /logs, /messages, /usage and /quota for one tenant, with the tenants file's tokens "
        "as bearer tokens (the operator token names the tenant with ?tenant=). SIGTERM or "
        "Ctrl-C stops it.",
    )
    lake_command.add_lake_arguments(api, tenant_help=None)
    api.add_argument(
        "--tenants", type=Path, required=True, help="TOML tenants file: the tokens it accepts"
    )
    api.add_argument(
        "--listen",
        type=_host_port,
        default=("127.0.0.1", 8080),
        metavar="HOST:PORT",
        help="where to serve (default 127.0.0.1:8080; port 0: any free port, printed)",
    )
    for module in LAKE_COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names, when only ``--log-level LEVEL`` comes before it."""
    rest = list(argv)
    while rest and rest[0].startswith("--log-level"):
        option = rest.pop(0)
        if option == "--log-level" and rest:
            rest.pop(0)
    return rest[0] if rest and not rest[0].startswith("-") else None


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    return _parser(_command_in(argv)).parse_args(argv)


def _peer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--peer",
        type=_host_port,
        action="append",
        default=[],
        help="HOST:PORT (MQTT) of another edge of the mesh (repeatable; added to [edge] peers)",
    )


def _pipeline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, help="data dir holding journal/{node}/")
    parser.add_argument(
        "--lake", help="directory of the Delta tables, or s3://bucket/prefix (see [lake] settings)"
    )
    parser.add_argument("--config", type=Path, help="TOML settings file with a [pipeline] table")
    parser.add_argument("--master", help="Spark master (default local[*])")


def main(argv: Sequence[str] | None = None) -> int:
    return _run(_parse(argv))


def console() -> None:
    """The ``edgebus`` executable: :func:`main`, then, after a lake command, the process ends at
    once (``os._exit``) once its output is flushed.

    Those commands hold nothing to clean up, and the interpreter's normal finalization with
    delta-rs loaded costs ~25 ms of each ``edgebus logs`` and can abort (``terminate called
    without an active exception``, exit 134) as delta-rs's runtime is torn down.
    """
    args = _parse(None)
    code = _run(args)
    if args.command not in LAKE_COMMANDS:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BrokenPipeError, ValueError):  # reader gone (| head), closed
            stream.flush()
    os._exit(code)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command in LAKE_COMMANDS:
        return int(importlib.import_module(LAKE_COMMANDS[args.command]).run(args))
    from edgebus import platform_cli  # here: the lake's readers never need it

    return platform_cli.main(args)


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    console()
