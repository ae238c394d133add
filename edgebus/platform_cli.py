"""The ``edgebus`` commands that run the platform: ``edge``, ``pipeline``, ``run`` (both, the
embedded default), ``maintain`` and ``api``.

:mod:`edgebus.cli` parses the command line and imports this module only for these commands, so
the lake's readers (``edgebus logs``, ``usage``, ``quality``, ``sql``) start without the edge's
and the pipeline's settings, packets and errors.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from broker_edge.errors import ConfigError
from edgebus import lake_command
from edgebus.settings import SettingsError, load_edge, load_pipeline
from schemas import operator_token
from schemas.operator_token import OperatorTokenError
from streaming.errors import PipelineConfigError

log = logging.getLogger("edgebus")


def main(args: argparse.Namespace) -> int:
    """Run ``args.command`` (one of :data:`edgebus.cli.PLATFORM_COMMANDS`); 2 for bad settings."""
    commands = {"edge": edge, "pipeline": pipeline, "maintain": maintain, "api": api, "run": run}
    try:
        return commands[args.command](args)
    except SettingsError as exc:
        print(f"edgebus: bad settings: {exc}", file=sys.stderr)
        return 2


def edge(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {
        "data_dir": args.data_dir,
        "node_id": args.node_id,
        "host": args.listen[0] if args.listen else None,
        "port": args.listen[1] if args.listen else None,
        "http_listen": _join_host_port(args.http) if args.http else None,
        "tls_cert": args.cert,
        "tls_key": args.key,
        "tls_cafile": args.cafile,
    }
    for kind in ("tls", "ws", "wss"):
        address = getattr(args, f"listen_{kind}")
        overrides[f"listen_{kind}"] = _join_host_port(address) if address else None
    settings = load_edge(args.config, overrides, defaults={"node_id": socket.gethostname()})
    if args.peer:
        added = [_join_host_port(peer) for peer in args.peer]
        try:
            settings = dataclasses.replace(
                settings, peers=tuple(dict.fromkeys([*settings.peers, *added]))
            )
        except ConfigError as exc:
            raise SettingsError(f"--peer: {exc}") from exc
    runner = _event_loop_runner(args.loop)
    if args.tenants is not None and _tenants_file(args.tenants) is None:
        return 2  # refused before binding the port
    try:
        runner(_serve_edge(settings, args.tenants))
    except ConfigError as exc:  # refused before any port opened (bad token file, exposure)
        print(f"edgebus: bad settings: {exc}", file=sys.stderr)
        return 2
    return 0


def _join_host_port(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _event_loop_runner(choice: str) -> Any:
    if choice in {"auto", "uvloop"}:
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise
        else:
            return uvloop.run
    import asyncio  # here, not at the top: the lake's commands (edgebus logs ...) never need it

    return asyncio.run


async def _serve_edge(settings: Any, tenants: Path | None) -> None:
    import asyncio

    from broker_edge.node import EdgeNode

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node = EdgeNode(settings, tenants)
    loop.add_signal_handler(signal.SIGHUP, node.reload_tenants)
    async with node:
        print(
            f"edgebus edge {settings.node_id} listening on {settings.host}:{node.port}", flush=True
        )
        if node.http is not None:
            host = settings.http_address[0]
            print(f"edgebus edge {settings.node_id} http on {host}:{node.http.port}", flush=True)
        for kind, (host, _) in settings.listeners.items():
            if kind != "mqtt":  # after the first two lines, which scripts read as they are
                print(f"edgebus edge {settings.node_id} {kind} on {host}:{node.ports[kind]}")
        sys.stdout.flush()
        await stop.wait()
        log.info("signal received: stopping")
    log.info("edge stopped cleanly")


def _pipeline_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {"data_dir": args.data_dir, "lake": args.lake, "master": args.master}


def pipeline(args: argparse.Namespace) -> int:
    overrides = _pipeline_overrides(args)
    if args.metrics:
        overrides["metrics_listen"] = _join_host_port(args.metrics)
    settings = load_pipeline(args.config, overrides)
    if args.edge:
        added = [_join_host_port(edge) for edge in args.edge]
        edges = tuple(dict.fromkeys([*settings.edges, *added]))
        try:
            settings = dataclasses.replace(settings, edges=edges)
        except PipelineConfigError as exc:
            raise SettingsError(f"--edge: {exc}") from exc
    # Before anything slow (imports, Spark): a signal during start-up stops the pipeline
    # cleanly (`edgebus run` forwards SIGTERM and SIGHUP as soon as it gets them).
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        log.info("signal %d received: stopping the pipeline", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGHUP, lambda signum, frame: _reread_tenants(args.tenants))
    if args.tenants is not None:
        tenants = _tenants_file(args.tenants)  # a bad file stops us before Spark starts
        if tenants is None:
            return 2
        log.info("tenants file %s: %d tenant(s)", args.tenants, len(tenants.tenants))
        if tenants.operator_token is None:
            # Without --broker too: the quota step refuses to start without one (a traceback).
            print(
                f"edgebus: {args.tenants}: the quota step needs an [operator] token to publish "
                "its decisions with",
                file=sys.stderr,
            )
            return 2
        if not args.broker:
            log.warning(
                "no --broker: quota decisions are recorded, not sent to any edge, and no edge "
                "gets journal notices (retention keeps every segment)"
            )
        quota = _quota_settings(args.tenants, tenants.operator_token, args.broker)
        retention = _tenant_retention(args.tenants)
        notices = None
        edge_token: str | None = tenants.operator_token
    else:
        quota = retention = None
        try:
            notices = local_notices(settings.data_dir, args.broker)
        except OperatorTokenError as exc:
            print(f"edgebus: {exc}", file=sys.stderr)
            return 2
        edge_token = None
        if settings.edges:
            log.warning(
                "no --tenants: the edges %s are asked without a token (an edge without a "
                "configured operator token guards its port with its own, in its data dir) "
                "and get no journal notices unless listed with --broker",
                ", ".join(settings.edges),
            )
    from streaming.session import delta_jars

    try:
        delta_jars()  # before Spark: a missing part is one line, not a JVM stack trace
    except PipelineConfigError as exc:
        print(f"edgebus: {exc}", file=sys.stderr)
        return 2
    if not _reachable(settings):
        return 2
    if stop.is_set():
        return 0  # stopped before Spark started
    return _run_pipeline(
        settings,
        once=args.once,
        stop=stop,
        quota=quota,
        notices=notices,
        edge_token=edge_token,
        retention=retention,
    )


def _run_pipeline(settings: Any, **run_args: Any) -> int:
    """Run the pipeline with ``run_args``, its metrics served when the settings ask for them."""
    import streaming.pipeline

    if settings.metrics_address is None:
        streaming.pipeline.run(settings, **run_args)
        return 0
    from streaming.metrics import PipelineMetrics

    metrics = PipelineMetrics(settings, edge_token=run_args.get("edge_token"))
    try:
        server = serve_metrics(metrics, *settings.metrics_address)
    except OSError as exc:
        where = settings.metrics_listen
        print(f"edgebus: cannot serve metrics on {where}: {exc}", file=sys.stderr)
        return 2
    try:
        streaming.pipeline.run(settings, metrics=metrics, **run_args)
    finally:
        server.shutdown()
        server.server_close()
    return 0


def serve_metrics(metrics: Any, host: str, port: int) -> Any:
    """Serve ``metrics`` at http://HOST:PORT/metrics from a thread (before Spark starts, so a
    scrape during start-up already shows each node's lag); the server, to shut down."""
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    bound = server.server_address[1]
    print(
        f"edgebus pipeline metrics on http://{_join_host_port((host, bound))}/metrics", flush=True
    )
    return server


def api(args: argparse.Namespace) -> int:
    """``edgebus api``: refuse a bad tenants file or a directory that is no lake, then serve."""
    from edgebus import api

    try:
        lake_command.lake_tables(args.lake)
        app = api.create_app(args.lake, args.tenants)
    except lake_command.CommandError as exc:
        return lake_command.fail("api", exc)
    except ConfigError as exc:
        print(f"edgebus: bad tenants file: {exc}", file=sys.stderr)
        return 2
    host, port = args.listen
    try:
        return api.serve(app, host, port)
    except OSError as exc:  # the port is taken, the host is not this machine's
        print(
            f"edgebus api: cannot listen on {_join_host_port(args.listen)}: {exc}", file=sys.stderr
        )
        return 2


def maintain(args: argparse.Namespace) -> int:
    settings = load_pipeline(args.config, _pipeline_overrides(args))
    if isinstance(settings.lake, Path) and not settings.lake.is_dir():
        print(f"edgebus: {settings.lake}: no such lake", file=sys.stderr)
        return 2
    retention = None
    if args.tenants is not None:
        if _tenants_file(args.tenants) is None:
            return 2  # refused before Spark starts
        retention = _tenant_retention(args.tenants)
    if not _reachable(settings):
        return 2
    from sinks.maintenance import describe
    from streaming.maintenance import MaintenanceSchedule, spark_maintainer
    from streaming.session import build_spark, delta_jars, stop_spark

    try:
        delta_jars()
    except PipelineConfigError as exc:
        print(f"edgebus: {exc}", file=sys.stderr)
        return 2
    spark = build_spark(settings)
    try:
        schedule = MaintenanceSchedule(settings, spark_maintainer(spark), tenants=retention)
        reports = schedule.run_once()
    finally:
        stop_spark(spark)
    for report in reports:
        print(describe(report))
    return 0


def _reachable(settings: Any) -> bool:
    """Whether the lake's bucket answers (always, for a local lake); says why not on one line,
    before Spark starts (S3A would retry for minutes, then fail with a JVM stack trace)."""
    from sinks.storage import StorageError, check_reachable

    try:
        check_reachable(settings.lake)
    except StorageError as exc:
        print(f"edgebus: {exc}", file=sys.stderr)
        return False
    return True


def _reread_tenants(path: Path | None) -> None:
    """SIGHUP in the pipeline: read the tenants file at once and say whether it is usable.

    The quota step re-reads the file on every batch anyway, so a good file counts from the next
    batch; this gives the operator the answer now, as the edge does on SIGHUP.
    """
    from broker_edge.tenants import load as load_tenants

    if path is None:
        log.info("SIGHUP: no tenants file to reload")
        return
    try:
        config = load_tenants(path)
    except (ConfigError, OSError) as exc:  # raised here, it would stop the pipeline
        log.warning("SIGHUP: tenants file not reloaded, the quota step keeps the old one: %s", exc)
        return
    log.info(
        "SIGHUP: tenants file %s reloaded (%d tenants), the quota step uses it from its next batch",
        path,
        len(config.tenants),
    )


def local_notices(data_dir: Path, brokers: list[tuple[str, int]]) -> Any:
    """Without a tenants file: the journal notices go to ``brokers`` with the operator token
    the edge made in ``data_dir`` (schemas.operator_token); None when there is nothing to
    send them to or with."""
    from streaming.quota_settings import NoticeSettings

    if not brokers:
        return None  # a pipeline on journals alone (no edge to tell)
    token = operator_token.read(data_dir)
    if token is None:
        log.warning(
            "no %s (an edge makes it when it starts on this data dir): journal notices are "
            "not sent, the edges keep their journals",
            operator_token.token_path(data_dir),
        )
        return None
    return NoticeSettings(operator_token=token, brokers=tuple(brokers))


def _quota_settings(path: Path, token: str, brokers: list[tuple[str, int]]) -> Any:
    """The quota step's settings; the limits loader reads the tenants file on every call, so a
    changed file (limits raised or lowered) counts from the next batch."""
    from broker_edge.tenants import load as load_tenants
    from streaming.quota_settings import QuotaSettings, TenantLimits

    def load_limits() -> dict[str, TenantLimits]:
        config = load_tenants(path)
        return {
            name: TenantLimits(t.limits.messages_per_day, t.limits.bytes_per_day)
            for name, t in config.tenants.items()
        }

    return QuotaSettings(load_limits=load_limits, operator_token=token, brokers=tuple(brokers))


def _tenants_file(path: Path) -> Any:
    """The tenants file at ``path``; None, once its fault is printed, when it is bad."""
    from broker_edge.tenants import load as load_tenants

    try:
        return load_tenants(path)
    except ConfigError as exc:
        print(f"edgebus: bad tenants file: {exc}", file=sys.stderr)
        return None


def _tenant_retention(path: Path) -> Any:
    """The tenants' own retention days (tenant -> table -> days), read from the tenants file on
    every call, so a changed file counts from the next maintenance run."""
    from broker_edge.tenants import load as load_tenants

    def load() -> dict[str, dict[str, int]]:
        config = load_tenants(path)
        return {name: dict(t.retention_days) for name, t in config.tenants.items()}

    return load


def run(args: argparse.Namespace) -> int:
    """Supervise an edge and the pipeline as child processes; stop both on a signal."""
    pipeline_settings = load_pipeline(args.config, _pipeline_overrides(args))
    host, port = args.listen
    exe = [sys.executable, "-m", "edgebus.cli", "--log-level", args.log_level]
    edge_cmd = [
        *exe,
        "edge",
        "--listen",
        f"{host}:{port}",
        "--data-dir",
        str(pipeline_settings.data_dir),
    ]
    if args.node_id:
        edge_cmd += ["--node-id", args.node_id]
    for peer in args.peer:  # a single edge unless peers are given
        edge_cmd += ["--peer", _join_host_port(peer)]
    pipe_cmd = [*exe, "pipeline", "--data-dir", str(pipeline_settings.data_dir)]
    if args.tenants:
        edge_cmd += ["--tenants", str(args.tenants)]
        pipe_cmd += ["--tenants", str(args.tenants)]
    pipe_cmd += ["--lake", str(pipeline_settings.lake)]
    if args.config:  # its [edge] table for the edge, its [pipeline] table for the pipeline
        edge_cmd += ["--config", str(args.config)]
        pipe_cmd += ["--config", str(args.config)]
    if args.master:
        pipe_cmd += ["--master", args.master]
    # The edge first: its port (port 0 picks one) is known once it listens, and the quota
    # decisions go back to it. The supervisor runs no threads yet: preexec_fn is safe here.
    edge = subprocess.Popen(
        edge_cmd,
        stdout=subprocess.PIPE,
        preexec_fn=_die_with_parent,  # noqa: PLW1509
    )
    assert edge.stdout is not None
    listening = edge.stdout.readline()  # "edgebus edge NODE listening on HOST:PORT"
    if not listening:
        return edge.wait() or 1  # it said why on stderr
    port = int(listening.rsplit(b":", 1)[1])
    # Quota decisions and journal notices (without a tenants file: with the edge's own token).
    pipe_cmd += ["--broker", f"{host}:{port}"]
    children = [edge, subprocess.Popen(pipe_cmd, preexec_fn=_die_with_parent)]  # noqa: PLW1509
    # The edge's line, then ours, in this order (scripts read them), before the relay starts.
    sys.stdout.buffer.write(listening)
    print(
        f"edgebus: edge on {host}:{port}, pipeline writing Delta tables to "
        f"{pipeline_settings.lake} (Ctrl-C stops both)",
        flush=True,
    )
    threading.Thread(target=_relay, args=(edge.stdout,), daemon=True).start()
    stopping = threading.Event()

    def _forward(signum: int, frame: object) -> None:
        stopping.set()
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    def _forward_hup(signum: int, frame: object) -> None:
        for child in children:  # both reload the tenants file
            if child.poll() is None:
                child.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    signal.signal(signal.SIGHUP, _forward_hup)
    while any(child.poll() is None for child in children):
        if not stopping.is_set() and any(child.poll() is not None for child in children):
            log.error("a child process exited unexpectedly: stopping the other")
            _forward(signal.SIGTERM, None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            children[0].wait(timeout=0.5)
    codes = [child.returncode for child in children]
    return 0 if stopping.is_set() and codes == [0, 0] else max(codes) or 1


def _relay(lines: IO[bytes]) -> None:
    """Pass the edge's stdout on (so it never blocks on a full pipe)."""
    for line in lines:
        sys.stdout.buffer.write(line)
        sys.stdout.flush()


def _die_with_parent() -> None:
    """In a child of `edgebus run`: get SIGTERM when the supervisor dies, even by SIGKILL, so
    no edge or pipeline is left running on its own (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
