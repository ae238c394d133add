"""An S3-compatible server (moto's) in a process of its own, on a free port, with one bucket.

Its own process, not a thread of the caller's: delta-rs holds the GIL while it waits for an
answer, so a server thread in the same interpreter could never answer it (the call hangs until
object_store gives up, minutes later). ``python -m bench.s3_server`` prints
``http://127.0.0.1:PORT`` once it listens and serves until its stdin closes. The lake tests and
``bench.pipeline --lake s3`` start it with :func:`s3_server`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sinks.storage import StorageOptions

ROOT = Path(__file__).resolve().parents[1]
# moto takes any keys; these only have to be the same on both sides.
ACCESS_KEY_ID = "test-key"
SECRET_ACCESS_KEY = "test-secret"
REGION = "us-east-1"


@contextmanager
def s3_server(bucket: str, *, authenticated: bool = False) -> Iterator[StorageOptions]:
    """Start the server, create ``bucket``; the options that reach it. Stopped on exit.

    ``authenticated``: the server checks every request's signature against the keys of its
    IAM users (moto's ``INITIAL_NO_AUTH_ACTION_COUNT``: the first three requests, which make
    the user, its key and its policy, go unchecked), so wrong keys get 403 as from S3.
    """
    import boto3

    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"} if authenticated else None
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.s3_server"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert server.stdout is not None
        endpoint = server.stdout.readline().strip()
        if not endpoint.startswith("http://"):
            raise RuntimeError(f"the S3 server did not start (said {endpoint!r})")
        key_id, secret = ACCESS_KEY_ID, SECRET_ACCESS_KEY
        if authenticated:
            key_id, secret = _iam_user(endpoint)
        options = StorageOptions(
            endpoint_url=endpoint, region=REGION, access_key_id=key_id, secret_access_key=secret
        )
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
        ).create_bucket(Bucket=bucket)
        yield options
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=30)


def _iam_user(endpoint: str) -> tuple[str, str]:
    """A user allowed everything on S3, and its access key."""
    import boto3

    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY_ID,
        aws_secret_access_key=SECRET_ACCESS_KEY,
    )
    iam.create_user(UserName="lake")
    key = iam.create_access_key(UserName="lake")["AccessKey"]
    allow = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
    policy = {"Version": "2012-10-17", "Statement": [allow]}
    iam.put_user_policy(UserName="lake", PolicyName="s3", PolicyDocument=json.dumps(policy))
    return key["AccessKeyId"], key["SecretAccessKey"]


def main() -> None:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    print(f"http://{host}:{port}", flush=True)
    sys.stdin.read()  # until the caller closes our stdin (or dies)
    server.stop()


if __name__ == "__main__":
    main()
