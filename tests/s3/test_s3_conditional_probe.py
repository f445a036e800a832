"""Stores that ignore conditional writes (issue 26 item 5, ``object_store.md`` section 8):
a writer probes at open (a create-only PUT written twice under the log's prefix) and refuses
with one line, unless single-writer mode is accepted.

The store that ignores ``If-None-Match`` is a proxy that drops the header in front of
moto_server: the header is signed (SigV4), so a server that checks signatures, as SeaweedFS
does, would refuse the stripped request instead of ignoring the condition. This is the one
place moto is kept in the object-store tests."""

from __future__ import annotations

import logging
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lowdiff_store import LogReader, LogWriter, tensor_input
from lowdiff_store.errors import LowdiffError, Reason
from lowdiff_store.storage.s3 import S3Store
from tests.s3.faultproxy import Fault, FaultProxy
from tests.s3.servers import S3Server, start_moto

pytest.importorskip("moto.server", reason="moto[server] is not installed")


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server, proc = start_moto(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def stripping(moto: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
              ) -> Iterator[tuple[FaultProxy, str]]:
    """A proxy in front of moto that drops If-None-Match from every PUT; the AWS variables
    point at the proxy. Yields it and a fresh ``s3://`` URL."""
    bucket = f"t-{uuid.uuid4().hex[:20]}"
    moto.client().create_bucket(Bucket=bucket)
    with FaultProxy(moto.port, lifetime_s=120) as p:
        p.plan(Fault("strip", "PUT", times=10_000, header="If-None-Match"))
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                    "LOWDIFF_S3_SINGLE_WRITER", "LOWDIFF_S3_WAL_DIR"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto.secret_key)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        yield p, f"s3://{bucket}/run"


def test_a_store_that_ignores_if_none_match_is_refused_with_one_line(
        stripping: tuple[FaultProxy, str]) -> None:
    proxy, url = stripping
    with pytest.raises(LowdiffError) as ei:
        LogWriter(url)
    e = ei.value
    assert e.reason is Reason.UNSAFE_STORE
    msg = str(e)
    assert "\n" not in msg
    assert "ignores conditional writes" in msg
    assert "LOWDIFF_S3_SINGLE_WRITER=1" in msg
    assert "/run/LOCK@probe" in msg  # names the probe key under the log's prefix
    assert any(k == "strip" for k, _m, _t in proxy.fired)
    assert S3Store(url).list() == []  # nothing written: no manifest, no lock, no probe left


def test_single_writer_mode_accepts_it_with_a_warning(
        stripping: tuple[FaultProxy, str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    _proxy, url = stripping
    monkeypatch.setenv("LOWDIFF_S3_SINGLE_WRITER", "1")
    g = np.arange(8, dtype="<f4")
    with caplog.at_level(logging.WARNING):
        with LogWriter(url) as w:
            w.append(0, [tensor_input("g", g, "F32")], kind="grad")
            assert w.flush() == 0
    assert any("single-writer mode accepted" in r.getMessage() for r in caplog.records)
    with LogReader(url) as r:
        np.testing.assert_array_equal(r.record(0).tensor("g"), g)


def test_the_probe_passes_where_the_header_arrives(s3_url: str) -> None:
    """On the session's server (SeaweedFS by default) the probe passes and leaves no key."""
    store = S3Store(s3_url)
    store.check_conditional_writes()
    assert store.objects.list_keys(store.prefix + "/") == []
    assert os.environ["AWS_ENDPOINT_URL"]
