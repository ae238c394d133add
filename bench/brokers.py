"""Start and stop the brokers under test on a free port of 127.0.0.1, and watch their resources.

Each `start_*` returns a `BrokerProcess` (host, port, pid, `stop()`, usable as a context
manager) once the port accepts TCP connections; `cpus` pins it (all its threads) to those
CPUs. The free port comes from binding port 0 and closing the socket again; the tiny race
with other programs is accepted for a benchmark. Broker output goes to a log file in the
broker's own temporary directory, quoted in the error if the broker fails to start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from bench import BenchError
from bench.loadgen import raise_nofile

log = logging.getLogger(__name__)

MOSQUITTO = "/usr/sbin/mosquitto"
REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


class BrokerError(BenchError):
    """A broker did not start, or did not stop."""


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class BrokerProcess:
    """A broker (or the null sink) running as a child process."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        port: int,
        workdir: Path,
        host: str = HOST,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        # What `ulimit -n` does in a launcher script: the child inherits our soft
        # RLIMIT_NOFILE, raised to the hard limit, so 10,000 idle clients fit.
        self.nofile_limit = raise_nofile()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
        )
        self.pid = self.proc.pid
        self.cpus = cpus
        if cpus:
            pin(self.pid, cpus)  # early, so threads and children it starts inherit it

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Poll until the port accepts a TCP connection (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise BrokerError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            if self.cpus:
                pin(self.pid, self.cpus)  # again: threads started before the first pin
            return
        self.stop()
        raise BrokerError(f"{self.name} did not listen on {self.port} in {timeout}s: {self.tail()}")

    def tail(self, limit: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return "<no log>"

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; return the exit code. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %ss; killing", self.name, timeout)
                self.proc.kill()
                self.proc.wait(timeout)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def log_summary(self, *, problems: int = 20, tail: int = 3000) -> dict[str, object]:
        """Lines that look like trouble (warnings, errors, tracebacks) and the log's tail."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return {"lines": 0, "problem_lines": 0, "problems": [], "tail": ""}
        lines = text.splitlines()
        bad = [line for line in lines if PROBLEM.search(line)]
        return {
            "lines": len(lines),
            "problem_lines": len(bad),
            "problems": bad[:problems],
            "tail": text[-tail:],
        }

    def cleanup(self) -> None:
        """Stop, then remove the temporary directory (its log goes with it)."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"BrokerProcess({self.name!r}, {self.host}:{self.port}, pid={self.pid})"


PROBLEM = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|Exception|[Ee]rror:|[Ww]arning:")

MOSQUITTO_CONFIG = """\
listener {port} {host}
# Idle-connection scenario: no cap on clients (RLIMIT_NOFILE is raised by the launcher).
max_connections -1
allow_anonymous true
persistence false
# No per-client limits: a fast subscriber must never see a message dropped by the broker.
max_queued_messages 0
max_queued_bytes 0
max_inflight_messages 0
max_inflight_bytes 0
queue_qos0_messages false
set_tcp_nodelay true
sys_interval 0
log_dest stderr
log_type error
log_type warning
"""


def mosquitto_version(binary: str = MOSQUITTO) -> str | None:
    try:
        out = subprocess.run(
            [binary, "-h"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.splitlines()[0] if out else ""
    return first.removeprefix("mosquitto version ").strip() or None


# The listener's TLS (bench TLS cases): the same certificate and key edgebus serves.
MOSQUITTO_TLS = """\
certfile {cert}
keyfile {key}
"""

# (certificate chain, private key): PEM files a broker serves MQTT over TLS with.
TlsFiles = tuple[Path, Path]


def start_mosquitto(
    binary: str = MOSQUITTO,
    *,
    extra_config: str = "",
    timeout: float = 20.0,
    cpus: set[int] | None = None,
    tls: TlsFiles | None = None,
) -> BrokerProcess:
    """Mosquitto on a free port; with ``tls``, that listener speaks MQTT over TLS."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-mosquitto-"))
    port = free_port()
    conf = workdir / "mosquitto.conf"
    listener_tls = ""
    if tls is not None:
        _readable_by_mosquitto(tls)
        listener_tls = MOSQUITTO_TLS.format(cert=tls[0], key=tls[1])
    # The listener's options follow its line; the general ones may come anywhere.
    config = MOSQUITTO_CONFIG.format(port=port, host=HOST).replace("\n", "\n" + listener_tls, 1)
    conf.write_text(config + extra_config)
    broker = BrokerProcess(
        "mosquitto", [binary, "-c", str(conf)], port=port, workdir=workdir, cpus=cpus
    )
    _ready_or_cleanup(broker, timeout)
    return broker


def _readable_by_mosquitto(files: TlsFiles) -> None:
    """Mosquitto started as root reads its certificate files after it has become the
    ``mosquitto`` user: hand them (and their directory) to that user."""
    if os.geteuid() != 0:
        return
    try:
        user = pwd.getpwnam("mosquitto")
    except KeyError:
        return  # no such user: Mosquitto stays root
    for path in {*files, *(f.parent for f in files)}:
        os.chown(path, user.pw_uid, user.pw_gid)


def start_edgebus(
    data_dir: str | os.PathLike[str],
    *,
    node_id: str = "bench",
    extra_args: list[str] | None = None,
    timeout: float = 30.0,
    cpus: set[int] | None = None,
    tls: TlsFiles | None = None,
    port: int | None = None,
) -> BrokerProcess:
    """Run the edgebus broker edge (`python -m edgebus.cli edge ...`) on ``port`` (default: a
    free one; edges of a mesh must know each other's before they start); with ``tls``, the
    returned port is its TLS listener's (the plain one is on another)."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-edgebus-"))
    port = port or free_port()
    if tls is not None:
        tls_port = free_port()
        tls_args = ["--listen-tls", f"{HOST}:{tls_port}", "--cert", str(tls[0])]
        extra_args = [*tls_args, "--key", str(tls[1]), *(extra_args or [])]
        port, plain = tls_port, port
    else:
        plain = port
    argv = [
        sys.executable,
        "-m",
        "edgebus.cli",
        "edge",
        "--listen",
        f"{HOST}:{plain}",
        "--data-dir",
        str(data_dir),
        "--node-id",
        node_id,
        *(extra_args or []),
    ]
    broker = BrokerProcess("edgebus", argv, port=port, workdir=workdir, cwd=REPO_ROOT, cpus=cpus)
    _ready_or_cleanup(broker, timeout)
    return broker


def start_null_sink(
    *, blast: bool = True, timeout: float = 20.0, cpus: set[int] | None = None
) -> BrokerProcess:
    """Run `bench.sink` — the generator-ceiling target — on a free port."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-null-"))
    port = free_port()
    argv = [sys.executable, "-m", "bench.sink", "--listen", f"{HOST}:{port}"]
    if blast:
        argv.append("--blast")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    broker = BrokerProcess(
        "null", argv, port=port, workdir=workdir, env=env, cwd=REPO_ROOT, cpus=cpus
    )
    _ready_or_cleanup(broker, timeout)
    return broker


def _ready_or_cleanup(broker: BrokerProcess, timeout: float) -> None:
    try:
        broker.wait_ready(timeout)
    except BaseException:
        broker.cleanup()
        raise


# --- resources of a running process --------------------------------------------------------


def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])  # "VmRSS:	  12345 kB"
    except (OSError, ValueError):
        return None
    return None


def rss_kib(pid: int) -> int | None:
    """Resident set size (VmRSS) in KiB, or None if the process is gone."""
    return _status_kib(pid, "VmRSS")


def peak_rss_kib(pid: int) -> int | None:
    """Peak resident set size (VmHWM) in KiB, or None if the process is gone."""
    return _status_kib(pid, "VmHWM")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process from /proc/PID/stat, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; the fields after it start past ')'.
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """Sample a process's RSS on demand; keeps (monotonic time, KiB) pairs, bounded."""

    def __init__(self, pid: int, *, max_samples: int = 100_000) -> None:
        self.pid = pid
        self.max_samples = max_samples
        self.samples: list[tuple[float, int]] = []

    def sample(self) -> int | None:
        value = rss_kib(self.pid)
        if value is not None and len(self.samples) < self.max_samples:
            self.samples.append((time.monotonic(), value))
        return value

    @property
    def peak(self) -> int | None:
        return max((kib for _, kib in self.samples), default=None)


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds summed over all cores since boot, from /proc/stat."""
    return per_cpu_busy()["cpu"]


def per_cpu_busy() -> dict[str, tuple[float, float]]:
    """(busy, total) CPU seconds since boot for "cpu" (all) and each "cpuN", from /proc/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    with open("/proc/stat") as stat:
        for line in stat:
            if not line.startswith("cpu"):
                break
            name, *values = line.split()
            # user nice system idle iowait irq softirq steal [guest*, already in user/nice]
            fields = [int(x) for x in values[:8]]
            idle = fields[3] + fields[4]
            out[name] = ((sum(fields) - idle) / tick, sum(fields) / tick)
    return out


def pin(pid: int, cpus: set[int]) -> None:
    """Restrict every thread of a process to `cpus` (affinity is per thread on Linux)."""
    try:
        tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)
