"""A real S3-compatible server for the object-store tests: ``moto_server`` (``moto[server]``,
pinned in requirements-dev.txt) on 127.0.0.1, on a free port, in a subprocess started once
per test session. Each test gets its own bucket and the standard AWS variables pointing at
the server (``AWS_ENDPOINT_URL``, static credentials, no profile or config file), which
subprocesses inherit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="moto[server] is not installed")
boto3 = pytest.importorskip("boto3", reason="boto3 (lowdiff-store[s3]) is not installed")


@dataclass
class S3Server:
    """A running server: its endpoint and port."""

    endpoint: str
    port: int
    home: Path  # a session directory (no AWS config files in it)

    def client(self):  # type: ignore[no-untyped-def]
        """A boto3 client on the server (for checks from the test itself)."""
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """``python -m moto.server -H 127.0.0.1 -p PORT``, stopped at the end of the session."""
    port = _free_port()
    home = tmp_path_factory.mktemp("moto")
    log = home / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"})
    server = S3Server(f"http://127.0.0.1:{port}", port, home)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited: {log.read_text()[-2000:]}")
            try:
                server.client().list_buckets()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The standard AWS variables pointing at the server (and nothing else configured)."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "LOWDIFF_S3_WAL_DIR", "LOWDIFF_S3_UPLOAD_INTERVAL_S", "LOWDIFF_S3_GC_GRACE_S",
                "LOWDIFF_S3_MAX_ATTEMPTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # never ask an instance-metadata service (an address other than 127.0.0.1) for
    # credentials, e.g. in the missing-credentials test
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(s3_server.home / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(s3_server.home / "no-aws-credentials"))
    return s3_server


@pytest.fixture
def s3_bucket(s3_env: S3Server) -> str:
    """A fresh, empty bucket (moto lists a bucket by scanning all its keys: one bucket
    per test keeps listings short)."""
    name = f"t-{uuid.uuid4().hex[:20]}"
    s3_env.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_url(s3_bucket: str) -> str:
    """``s3://<fresh bucket>/run``: an empty store for this test."""
    return f"s3://{s3_bucket}/run"
