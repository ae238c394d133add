"""Time to maintain (compact, vacuum, checkpoint) a Delta table of many small files.

    python -m bench.maintenance --files 200 --rows 500

Appends ``files`` micro-batches of ``rows`` ``messages`` rows each with the pipeline's own
writer (one small file per batch, spread over ``tenants`` partitions), then times
``sinks.maintenance.maintain_table`` with a 0 h retention (so vacuum deletes the compacted-away
files too), and a full read of the table before and after.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable

from bench.compare import RESULTS_DIR, machine_info, write_report
from schemas.tables import MESSAGES_PARTITION_BY, MESSAGES_SCHEMA
from sinks.delta import DeltaBatchWriter, read_table
from sinks.maintenance import maintain_table

DAY = dt.datetime(2026, 11, 22, 12, tzinfo=UTC)


def batch(batch_id: int, rows: int, tenant: str) -> pa.Table:
    seqs = range(batch_id * rows, (batch_id + 1) * rows)
    payload = b'{"vehicle":"veh-00001","speed_kmh":88.5,"lat":52.1,"lon":4.3}' * 3
    return pa.table(
        {
            "node": ["edge-1"] * rows,
            "seq": list(seqs),
            "ts": [DAY] * rows,
            "date": [DAY.date()] * rows,
            "tenant": [tenant] * rows,
            "client_id": ["truck-1"] * rows,
            "topic": ["fleet/truck-1/telemetry"] * rows,
            "qos": [1] * rows,
            "retain": [False] * rows,
            "payload": [payload] * rows,
            "content_type": [None] * rows,
            "user_properties": [None] * rows,
            "size": [len(payload)] * rows,
        },
        schema=MESSAGES_SCHEMA,
    )


def timed_read(path: Path) -> tuple[int, float]:
    start = time.perf_counter()
    rows = read_table(path, columns=["seq"]).num_rows
    return rows, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--tenants", type=int, default=4)
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="edgebus-bench-maintenance-"))
    try:
        path = root / "messages"
        writer = DeltaBatchWriter(path, "bench.maintenance", MESSAGES_SCHEMA, MESSAGES_PARTITION_BY)
        for batch_id in range(args.files):
            writer.write(batch_id, batch(batch_id, args.rows, f"tenant-{batch_id % args.tenants}"))
        files_before = len(DeltaTable(path).file_uris())
        rows_before, read_before = timed_read(path)

        start = time.perf_counter()
        report = maintain_table(path, vacuum_retention_hours=0)
        seconds = time.perf_counter() - start

        rows_after, read_after = timed_read(path)
        if rows_after != rows_before:
            raise SystemExit(f"rows changed: {rows_before} -> {rows_after}")
        result = {
            "bench": "maintenance",
            "files_before": files_before,
            "files_after": len(DeltaTable(path).file_uris()),
            "rows": rows_after,
            "maintain_seconds": round(seconds, 3),
            "vacuumed_files": report.vacuumed_files,
            "full_read_seconds_before": round(read_before, 3),
            "full_read_seconds_after": round(read_after, 3),
            "machine": machine_info(),
            "timestamp_compact": f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}",
        }
        print(json.dumps(result, indent=2))
        write_report(result, RESULTS_DIR, "maintenance")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
