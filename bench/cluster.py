"""Journal → Delta on a Spark standalone cluster: one worker against two, side by side.

    python -m bench.cluster --records 400000 --nodes 2 --rounds 2

Starts a real standalone cluster from the pyspark installation (``spark-class`` Master and
Workers on 127.0.0.1, one core and 1 GiB each) with one worker, then with two, and runs the
pipeline's journal query to caught-up on each (the driver in this process, the executors in the
workers' JVMs, ``--master spark://...`` as ``edgebus pipeline`` runs it), into a fresh lake
each time. Figures as ``bench.pipeline``: rows/s over the whole run and sustained. The order
alternates between rounds. On this 2-core machine the driver, the Python workers and two
executors share two cores: the ratio says what a second worker buys here, not on real machines.

:func:`standalone_cluster` is also what the e2e tests start their clusters with.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyspark

SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"
MASTER_URL = re.compile(rb"Starting Spark master at (spark://127\.0\.0\.1:\d+)")
REGISTERED = re.compile(rb"Successfully registered with master")


def wait_for_line(log: Path, pattern: re.Pattern[bytes], process: subprocess.Popen[bytes]) -> bytes:
    """The first match of ``pattern`` in the log a process writes (group 1 if it has one)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = pattern.search(log.read_bytes())
        if found:
            return found.group(1) if pattern.groups else found.group(0)
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited: {log.read_text()[-2000:]}")
        time.sleep(0.2)  # the JVM writes its log; there is no event to await
    raise RuntimeError(f"no {pattern.pattern!r} in {log}")


@dataclass
class Cluster:
    """A running standalone cluster: the master's URL and each worker's process."""

    url: str
    workers: list[subprocess.Popen[bytes]]

    def kill_worker(self, index: int) -> None:
        """SIGKILL worker ``index`` and the executors it started, as a lost machine would."""
        worker = self.workers[index]
        executors = [pid for pid in _children(worker.pid) if b"Executor" in _cmdline(pid)]
        worker.send_signal(signal.SIGKILL)
        for pid in executors:
            os.kill(pid, signal.SIGKILL)
        worker.wait(30)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@contextlib.contextmanager
def standalone_cluster(
    workdir: Path, workers: int, cores: int, memory: str = "1g"
) -> Iterator[Cluster]:
    """A master and ``workers`` workers of ``cores`` cores each on 127.0.0.1, from the pyspark
    installation; logs and work dirs under ``workdir``; stopped at the end."""
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_CLASS.parent.parent),
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    common = ["--host", "127.0.0.1", "--port", "0", "--webui-port", "0"]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        master_log = workdir / "master.log"
        with master_log.open("wb") as out:
            master = subprocess.Popen(
                [str(SPARK_CLASS), "org.apache.spark.deploy.master.Master", *common],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        processes.append(master)
        url = wait_for_line(master_log, MASTER_URL, master).decode()
        started: list[subprocess.Popen[bytes]] = []
        for index in range(workers):
            worker_log = workdir / f"worker-{index}.log"
            with worker_log.open("wb") as out:
                worker = subprocess.Popen(
                    [
                        str(SPARK_CLASS),
                        "org.apache.spark.deploy.worker.Worker",
                        *common,
                        *("--cores", str(cores), "--memory", memory),
                        *("--work-dir", str(workdir / f"work-{index}")),
                        url,
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            processes.append(worker)
            started.append(worker)
            wait_for_line(worker_log, REGISTERED, worker)
        yield Cluster(url, started)
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
        for process in processes:
            process.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=400_000)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-records-per-batch", type=int, default=200_000)
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from bench.compare import report
    from bench.pipeline import timed_run, write_journals
    from streaming.session import build_spark, stop_spark
    from streaming.settings import PipelineSettings

    work = Path(tempfile.mkdtemp(prefix="edgebus-bench-cluster-"))
    runs: list[dict[str, Any]] = []
    try:
        base = PipelineSettings(
            data_dir=work / "data",
            lake=work / "lake",
            max_records_per_batch=args.max_records_per_batch,
            shuffle_partitions=2,
            driver_memory="1g",
        )
        write_journals(base.journal_root, args.records, args.nodes)
        written = args.records // args.nodes * args.nodes
        for round_ in range(args.rounds):
            order = (1, 2) if round_ % 2 == 0 else (2, 1)
            for workers in order:
                run_dir = work / f"round-{round_}-workers-{workers}"
                run_dir.mkdir()
                with standalone_cluster(run_dir, workers=workers, cores=1) as cluster:
                    settings = dataclasses.replace(base, master=cluster.url, lake=run_dir / "lake")
                    spark = build_spark(settings)
                    try:
                        result = timed_run(spark, settings, written)
                    finally:
                        stop_spark(spark)
                runs.append({"round": round_, "workers": workers, **result})
                print(
                    f"round {round_}, {workers} worker(s): {result['rows_per_s']} rows/s whole, "
                    f"{result['sustained_rows_per_s']} sustained",
                    flush=True,
                )
        report(
            {
                "benchmark": "pipeline journal->delta on a standalone cluster, 1 vs 2 workers",
                "records": written,
                "nodes": args.nodes,
                "max_records_per_batch": args.max_records_per_batch,
                "worker_cores": 1,
                "load_average_after": os.getloadavg()[0],
                "runs": runs,
            },
            "cluster",
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
