"""``edgebus logs`` for one tenant and day on a 10-million-row ``logs`` table: seconds per query.

    python -m bench.logs_query --rows 10000000 --tenants 10 --days 10

Builds a ``logs`` Delta table the way the pipeline leaves it: ``rows`` log events spread evenly
over ``tenants`` tenants and ``days`` UTC days (one commit per tenant and day, as a long-running
pipeline's compacted partitions would be), then a maintenance pass (checkpoint). Then times, each
``--repeat`` times:

* ``cli_day``: the command as an operator runs it, a fresh process each time
  (``edgebus logs --lake L --tenant T --since DAY --until DAY+1 --format json``): wall time
  including interpreter start and imports;
* ``query_day``: the same query in this process (``edgebus.logs_cli.query_rows``): the part the
  table's size can affect;
* ``query_newest``: no time bounds (the tenant's newest events over every day).

Every CLI run must exit 0 with 100 rows (the default ``--limit``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench.compare import RESULTS_DIR, machine_info, write_report

FIRST_DAY = date(2026, 11, 1)
EVENTS = ("connect", "disconnect", "subscribe", "acl_denied", "quota_warn")
CLIENTS = 5_000


def log_rows(tenant: str, day: date, n: int, rng: np.random.Generator) -> pa.Table:
    """``n`` ``logs`` rows of one tenant and UTC day, vectorised (no Python loop per row)."""
    from schemas.tables import LOGS_SCHEMA

    start_us = int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp() * 1_000_000)
    ts = np.sort(rng.integers(start_us, start_us + 86_400_000_000, n))
    clients = pa.array([f"veh-{i:05d}" for i in range(CLIENTS)])
    events = pa.array(list(EVENTS))
    event_index = pa.array(rng.integers(0, len(EVENTS), n))
    client_index = pa.array(rng.integers(0, CLIENTS, n))
    node_index = rng.integers(0, 2, n)
    details = pa.array(
        [json.dumps({"peer": f"10.0.{i}.7:5{i:03d}", "clean_start": True}) for i in range(64)]
    )
    columns: dict[str, Any] = {
        "node": pa.array(np.where(node_index == 0, "edge-a", "edge-b").tolist()),
        "seq": pa.array(np.arange(1, n + 1, dtype=np.int64)),
        "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
        "date": pa.array([day] * n, pa.date32()),
        "tenant": pa.array([tenant] * n),
        "origin": pa.array(["mqtt"] * n),
        "event_type": events.take(event_index),
        "client_id": clients.take(client_index),
        "details": details.take(pa.array(rng.integers(0, 64, n))),
        "time": pa.array([None] * n, pa.string()),
        "payload_valid": pa.array(np.ones(n, dtype=bool)),
        "invalid_reason": pa.array([None] * n, pa.string()),
        "raw": pa.array([None] * n, pa.binary()),
    }
    return pa.Table.from_pydict(columns).cast(LOGS_SCHEMA)


def build_table(lake: Path, rows: int, tenants: int, days: int) -> None:
    from sinks.delta import DeltaBatchWriter
    from sinks.maintenance import maintain_table
    from streaming.logs import APP_ID, logs_writer
    from streaming.settings import PipelineSettings

    writer: DeltaBatchWriter = logs_writer(PipelineSettings(lake=lake))
    assert writer.app_id == APP_ID
    rng = np.random.default_rng(7)
    per_partition = rows // (tenants * days)
    batch = 0
    for d in range(days):
        for t in range(tenants):
            writer.write(
                batch, log_rows(f"tenant-{t:02d}", FIRST_DAY + timedelta(d), per_partition, rng)
            )
            batch += 1
    maintain_table(writer.path, vacuum_retention_hours=168)


def timed(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def summary(seconds: list[float]) -> dict[str, float]:
    return {
        "p50_s": round(statistics.median(seconds), 3),
        "max_s": round(max(seconds), 3),
        "min_s": round(min(seconds), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--days", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--workdir", type=Path, help="keep the lake here (default: a temp dir)")
    args = parser.parse_args(argv)

    from edgebus.logs_cli import LogQuery, query_rows

    work = args.workdir or Path(tempfile.mkdtemp(prefix="edgebus-bench-logs-"))
    lake = work / "lake"
    try:
        if not (lake / "logs" / "_delta_log").is_dir():
            started = time.perf_counter()
            build_table(lake, args.rows, args.tenants, args.days)
            print(f"built {args.rows} rows in {time.perf_counter() - started:.1f} s", flush=True)
        tenant = "tenant-03"
        day = FIRST_DAY + timedelta(days=args.days // 2)
        since = datetime(day.year, day.month, day.day, tzinfo=UTC)
        until = since + timedelta(days=1)
        edgebus = Path(sys.executable).with_name("edgebus")
        command = [
            str(edgebus),
            "logs",
            "--lake",
            str(lake),
            "--tenant",
            tenant,
            "--since",
            since.isoformat(),
            "--until",
            until.isoformat(),
            "--format",
            "json",
        ]

        def cli() -> None:
            done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
            assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
            lines = [line for line in done.stdout.splitlines() if line.strip()]
            assert len(lines) == 100, f"{len(lines)} rows"

        def query_day() -> None:
            assert len(query_rows(lake, LogQuery(tenant, since, until))) == 100

        def query_newest() -> None:
            assert len(query_rows(lake, LogQuery(tenant))) == 100

        now = datetime.now(UTC)
        result: dict[str, Any] = {
            "benchmark": "edgebus logs on a large logs table",
            "rows": args.rows,
            "tenants": args.tenants,
            "days": args.days,
            "rows_per_tenant_day": args.rows // (args.tenants * args.days),
            "cli_day": summary(timed(cli, args.repeat)),
            "query_day": summary(timed(query_day, args.repeat)),
            "query_newest": summary(timed(query_newest, args.repeat)),
            "date": now.isoformat(timespec="seconds"),
            "timestamp_compact": f"{now:%Y%m%dT%H%M%SZ}",
            "machine": machine_info(),
        }
        print(json.dumps(result, indent=2))
        print(f"results: {write_report(result, RESULTS_DIR, 'logs-query')}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
