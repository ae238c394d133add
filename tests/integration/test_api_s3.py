"""``edgebus api --lake s3://bucket/prefix``: the same API over a lake in a bucket (moto's
S3-compatible server in its own process), reached as the AWS_* environment variables say."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow as pa
from deltalake import write_deltalake
from test_api import LOGS, TENANTS

from bench.s3_server import s3_server
from schemas.tables import LOGS_PARTITION_BY, LOGS_SCHEMA
from sinks.storage import lake_path

BUCKET = "edgebus-api"


def test_the_api_reads_a_lake_in_a_bucket(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    with s3_server(BUCKET) as options:
        lake = lake_path(f"s3://{BUCKET}/lake", options)
        write_deltalake(
            str(lake / "logs"),
            pa.Table.from_pylist(LOGS, schema=LOGS_SCHEMA),
            partition_by=list(LOGS_PARTITION_BY),
            storage_options=options.delta_rs(),
        )
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": options.access_key_id,
            "AWS_SECRET_ACCESS_KEY": options.secret_access_key,
            "AWS_ENDPOINT_URL": options.endpoint_url,
            "AWS_REGION": options.region,
        }
        command = [sys.executable, "-m", "edgebus.cli", "--log-level", "WARNING", "api"]
        command += ["--lake", str(lake), "--tenants", str(tenants), "--listen", "127.0.0.1:0"]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        try:
            assert process.stdout is not None
            url = process.stdout.readline().rsplit(" ", 1)[1].strip()
            with httpx.Client(base_url=url, timeout=60.0) as http:
                auth = {"Authorization": "Bearer acme-1"}
                logs = http.get("/logs", params={"limit": 5}, headers=auth)
                assert logs.status_code == 200, logs.text
                page = logs.json()
                assert len(page["rows"]) == 5
                rest = http.get("/logs", params={"cursor": page["next_cursor"]}, headers=auth)
                acme = [row for row in LOGS if row["tenant"] == "acme"]
                assert len(page["rows"]) + len(rest.json()["rows"]) == len(acme)
                # The tables the pipeline has not written into the bucket: empty answers.
                assert http.get("/messages", headers=auth).json()["rows"] == []
                assert http.get("/quota", headers=auth).json()["history"] == []
        finally:
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
