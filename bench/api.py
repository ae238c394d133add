"""``GET /logs`` of ``edgebus api`` on a 10-million-row ``logs`` table: latency per request.

    python -m bench.api --rows 10000000 --tenants 10 --days 10 --requests 200

Builds the ``logs`` table of :mod:`bench.logs_query` (the same builder: ``rows`` events over
``tenants`` tenants and ``days`` UTC days, one commit per tenant-day, then a maintenance pass),
or reuses it (``--workdir``). Starts ``edgebus api`` as an operator would (its own process, port
0, access log off with ``--log-level WARNING``), warms it (``--warmup`` requests), then times
``--requests`` requests, one after another over one keep-alive connection (httpx), each the
wall time from sending to the parsed JSON body:

* ``day``: ``GET /logs?since=DAY&until=DAY+1`` with tenant ``T``'s own token (the newest 100 of
  one tenant-day, the issue's figure);
* ``day_next_page``: the same with ``cursor=`` the first page's ``next_cursor``;
* ``day_where``: ``event_type=disconnect&where=clean=false`` for the day;
* ``newest``: ``GET /logs`` with no time bounds (the newest 100 of the tenant).

p50, p99 and max per case; every answer must be 200 with the rows it asks for.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench.compare import report
from bench.logs_query import FIRST_DAY, build_table

TENANT = "tenant-03"
TOKEN = "bench-tenant-03"
TENANTS_FILE = f"""
[operator]
token = "bench-operator"

[tenants.{TENANT}]
tokens = ["{TOKEN}"]
"""


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "requests": len(seconds),
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p99_ms": round(p99 * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
        "min_ms": round(ordered[0] * 1000, 1),
    }


def start_api(lake: Path, tenants: Path) -> tuple[subprocess.Popen[str], str]:
    edgebus = str(Path(sys.executable).with_name("edgebus"))
    command = [edgebus, "--log-level", "WARNING", "api", "--lake", str(lake)]
    command += ["--tenants", str(tenants), "--listen", "127.0.0.1:0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("edgebus api listening on "), line
    return process, line.rsplit(" ", 1)[1].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--days", type=int, default=10)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--workdir", type=Path, help="keep the lake here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.requests < 50:
        parser.error("--requests: at least 50 (a p99 needs them)")

    work = args.workdir or Path(tempfile.mkdtemp(prefix="edgebus-bench-api-"))
    lake = work / "lake"
    work.mkdir(parents=True, exist_ok=True)
    tenants = work / "tenants.toml"
    tenants.write_text(TENANTS_FILE)
    try:
        if not (lake / "logs" / "_delta_log").is_dir():
            started = time.perf_counter()
            build_table(lake, args.rows, args.tenants, args.days)
            print(f"built {args.rows} rows in {time.perf_counter() - started:.1f} s", flush=True)
        day = FIRST_DAY + timedelta(days=args.days // 2)
        since = datetime(day.year, day.month, day.day, tzinfo=UTC)
        day_params = {"since": since.isoformat(), "until": (since + timedelta(days=1)).isoformat()}
        process, url = start_api(lake, tenants)
        try:
            with httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60.0
            ) as client:

                def get(params: dict[str, Any]) -> dict[str, Any]:
                    response = client.get("/logs", params=params)
                    assert response.status_code == 200, response.text
                    doc: dict[str, Any] = response.json()
                    return doc

                first = get(day_params)
                assert len(first["rows"]) == 100
                where = {**day_params, "event_type": "disconnect", "where": "clean=false"}
                where_rows = len(get(where)["rows"])
                assert 0 < where_rows <= 100
                cases: dict[str, tuple[dict[str, Any], int]] = {
                    "day": (day_params, 100),
                    "day_next_page": ({**day_params, "cursor": first["next_cursor"]}, 100),
                    "day_where": (where, where_rows),
                    "newest": ({}, 100),
                }
                load_before = os.getloadavg()
                timings: dict[str, dict[str, float]] = {}
                for name, (params, rows) in cases.items():
                    for _ in range(args.warmup):
                        get(params)
                    seconds = []
                    for _ in range(args.requests):
                        started = time.perf_counter()
                        doc = get(params)
                        seconds.append(time.perf_counter() - started)
                        assert len(doc["rows"]) == rows, (name, len(doc["rows"]))
                    timings[name] = percentiles(seconds)
                    print(name, timings[name], flush=True)
                load_after = os.getloadavg()
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=60)
        assert code == 0, f"edgebus api exited {code}"
        result: dict[str, Any] = {
            "benchmark": "edgebus api: GET /logs through a warm server",
            "rows": args.rows,
            "tenants": args.tenants,
            "days": args.days,
            "rows_per_tenant_day": args.rows // (args.tenants * args.days),
            "tenant": TENANT,
            "day": day.isoformat(),
            "url": f"{url}/logs?since=...&until=...",
            **timings,
            "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        }
        report(result, "api")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
