"""``edgebus logs`` and ``edgebus sql`` on a 10-million-row ``logs`` table: seconds per query.

    python -m bench.logs_query --rows 10000000 --tenants 10 --days 10

Builds a ``logs`` Delta table the way the pipeline leaves it: ``rows`` log events spread evenly
over ``tenants`` tenants and ``days`` UTC days (one commit per tenant and day, as a long-running
pipeline's compacted partitions would be), then a maintenance pass (checkpoint). Disconnects
carry a real edge's details (``peer``, ``clean``, ``reason_code``; a quarter not clean), the
other events ``peer`` and ``clean_start``. Then times, each ``--repeat`` times, every command
as an operator runs it, a fresh process each time (wall time including interpreter start and
imports), for one tenant (``T``) and one day (``DAY``):

* ``cli_day``: ``edgebus logs --tenant T --since DAY --until DAY+1 --format json``;
* ``cli_where``: the same with ``--event-type disconnect --where clean=false``;
* ``cli_cursor_page``: the second page of ``cli_day`` (``--after`` the first page's cursor);
* ``cli_cursor_page_no_bounds``: ``--after`` a cursor mid-table, no time bounds;
* ``cli_filters_all_days``: ``--event-type connect --event-type disconnect --node edge-a
  --client-id veh-00042 --oldest-first`` over every day;
* ``cli_count_day`` / ``cli_count_where_day``: ``--count`` for the day (and with the ``--where``);
* ``sql_count_day``: ``edgebus sql`` counting the day's events per type;

and in this process (``edgebus.logs_cli.query_rows``): ``query_day`` and ``query_newest`` (no
time bounds). Every command must exit 0 with the rows it asks for.
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
import pyarrow.compute as pc

from bench.compare import report

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
    event_index = rng.integers(0, len(EVENTS), n)
    client_index = pa.array(rng.integers(0, CLIENTS, n))
    node_index = rng.integers(0, 2, n)
    # 64 details per event type; a row's details are those of its type.
    details = pa.array(
        [
            json.dumps(
                {"peer": f"10.0.{i}.7:5{i:03d}", "clean": i % 4 != 0, "reason_code": 0}
                if event == "disconnect"
                else {"peer": f"10.0.{i}.7:5{i:03d}", "clean_start": True}
            )
            for event in EVENTS
            for i in range(64)
        ]
    )
    details_index = pa.array(np.asarray(event_index) * 64 + rng.integers(0, 64, n), pa.int64())
    columns: dict[str, Any] = {
        "node": pa.array(np.where(node_index == 0, "edge-a", "edge-b").tolist()),
        "seq": pa.array(np.arange(1, n + 1, dtype=np.int64)),
        "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
        "date": pa.array([day] * n, pa.date32()),
        "tenant": pa.array([tenant] * n),
        "origin": pa.array(["mqtt"] * n),
        "event_type": events.take(pa.array(event_index)),
        "client_id": clients.take(client_index),
        "details": details.take(details_index),
        "time": pa.array([None] * n, pa.string()),
        "payload_valid": pa.array(np.ones(n, dtype=bool)),
        "invalid_reason": pa.array([None] * n, pa.string()),
        "raw": pa.array([None] * n, pa.binary()),
    }
    # The typed columns the logs step reads out of the details: a disconnect's reason code.
    for name in ("reason", "reason_code", "topic", "qos", "metric", "limit", "value"):
        columns[name] = pa.nulls(n, LOGS_SCHEMA.field(name).type)
    disconnects = pc.equal(columns["event_type"], "disconnect")
    columns["reason_code"] = pc.if_else(
        disconnects, pa.scalar(0, pa.int32()), columns["reason_code"]
    )
    return pa.Table.from_pydict({name: columns[name] for name in LOGS_SCHEMA.names}).cast(
        LOGS_SCHEMA
    )


def ensure_table(lake: Path, rows: int, tenants: int, days: int) -> None:
    """``lake``'s ``logs`` table as :func:`build_table` makes it, built unless it is there
    already (a ``--workdir`` kept from an earlier run: building 10M rows takes minutes)."""
    if (lake / "logs" / "_delta_log").is_dir():
        return
    started = time.perf_counter()
    build_table(lake, rows, tenants, days)
    print(f"built {rows} rows in {time.perf_counter() - started:.1f} s", flush=True)


def build_table(lake: Path, rows: int, tenants: int, days: int) -> None:
    """The logs table as the pipeline writes it: Spark's Delta, one commit per tenant-day
    (with the logs step's app id), then compacted by the pipeline's maintenance."""
    from sinks.maintenance import maintain_table
    from streaming.logs import APP_ID, logs_writer
    from streaming.session import build_spark, stop_spark
    from streaming.settings import PipelineSettings

    settings = PipelineSettings(lake=lake, master="local[2]")
    spark = build_spark(settings)
    try:
        writer = logs_writer(settings)
        assert writer.app_id == APP_ID
        rng = np.random.default_rng(7)
        per_partition = rows // (tenants * days)
        batch = 0
        for d in range(days):
            for t in range(tenants):
                table = log_rows(f"tenant-{t:02d}", FIRST_DAY + timedelta(d), per_partition, rng)
                writer.append(batch, spark.createDataFrame(table))
                batch += 1
        maintain_table(spark, writer.path, vacuum_retention_hours=168)
    finally:
        stop_spark(spark)


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
        ensure_table(lake, args.rows, args.tenants, args.days)
        tenant = "tenant-03"
        day = FIRST_DAY + timedelta(days=args.days // 2)
        since = datetime(day.year, day.month, day.day, tzinfo=UTC)
        until = since + timedelta(days=1)
        edgebus = str(Path(sys.executable).with_name("edgebus"))
        logs = [edgebus, "logs", "--lake", str(lake), "--tenant", tenant]
        day_args = ["--since", since.isoformat(), "--until", until.isoformat()]

        def run(command: list[str]) -> list[str]:
            done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
            assert done.returncode == 0, (command, done.returncode, done.stderr[-2000:])
            return [line for line in done.stdout.splitlines() if line.strip()]

        def json_rows(*extra: str) -> list[dict[str, Any]]:
            return [json.loads(line) for line in run([*logs, *extra, "--format", "json"])]

        first_page = json_rows(*day_args)
        after_first = ["--after", first_page[-1]["cursor"]]
        # A cursor mid-table: the first row of the day after DAY (newest first, DAY+1 is read
        # after it, DAY and the days before are left).
        mid = json_rows("--since", until.isoformat(), "--oldest-first", "--limit", "1")
        after_mid = ["--after", mid[0]["cursor"]]
        where = ["--event-type", "disconnect", "--where", "clean=false"]
        filters = ["--event-type", "connect", "--event-type", "disconnect", "--node", "edge-a"]
        filters += ["--client-id", "veh-00042", "--oldest-first"]
        sql = (
            f"SELECT event_type, count(*) AS n FROM logs WHERE tenant = '{tenant}' "
            f"AND date = DATE '{day.isoformat()}' GROUP BY event_type ORDER BY n DESC"
        )
        second_page = json_rows(*day_args, *after_first)
        assert not {r["cursor"] for r in first_page} & {r["cursor"] for r in second_page}
        where_rows = json_rows(*day_args, *where)
        assert 0 < len(where_rows) <= 100
        assert all(r["details"]["clean"] is False for r in where_rows)

        def check(command: list[str], rows: int | None) -> Any:
            def once() -> None:
                lines = run(command)
                assert rows is None or len(lines) == rows, f"{len(lines)} rows: {command}"

            return once

        cases: dict[str, tuple[list[str], int | None]] = {
            "cli_day": ([*logs, *day_args, "--format", "json"], 100),
            "cli_where": ([*logs, *day_args, *where, "--format", "json"], len(where_rows)),
            "cli_cursor_page": ([*logs, *day_args, *after_first, "--format", "json"], 100),
            "cli_cursor_page_no_bounds": ([*logs, *after_mid, "--format", "json"], 100),
            "cli_filters_all_days": ([*logs, *filters, "--format", "json"], None),
            "cli_count_day": ([*logs, *day_args, "--count", "--format", "json"], len(EVENTS)),
            "cli_count_where_day": ([*logs, *day_args, *where, "--count", "--format", "json"], 1),
            "sql_count_day": ([edgebus, "sql", "--lake", str(lake), sql, "--format", "json"], 5),
        }

        def query_day() -> None:
            assert len(query_rows(lake, LogQuery(tenant, since, until))) == 100

        def query_newest() -> None:
            assert len(query_rows(lake, LogQuery(tenant))) == 100

        load_before = os.getloadavg()
        result: dict[str, Any] = {
            "benchmark": "edgebus logs and edgebus sql on a large logs table",
            "rows": args.rows,
            "tenants": args.tenants,
            "days": args.days,
            "rows_per_tenant_day": args.rows // (args.tenants * args.days),
            **{
                name: {
                    "command": " ".join(command),
                    **summary(timed(check(command, rows), args.repeat)),
                }
                for name, (command, rows) in cases.items()
            },
            "query_day": summary(timed(query_day, args.repeat)),
            "query_newest": summary(timed(query_newest, args.repeat)),
            "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        }
        report(result, "logs-query")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
