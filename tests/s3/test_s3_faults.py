"""Faults between the S3 client and the server, injected by a local proxy (faultproxy.py):
throttling, connections reset before or after the server applied a request, dropped
connections; and the one-line errors for a missing bucket, missing credentials and an
endpoint that stays unreachable."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from lowdiff_store.errors import LowdiffError, Reason, StorageError
from lowdiff_store.storage import ObjectExists
from lowdiff_store.storage.s3 import MULTIPART_MIN_BYTES, S3Options, S3Store
from tests.s3.faultproxy import Fault, FaultProxy
from tests.s3.servers import S3Server


@pytest.fixture
def proxy(s3_env: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A proxy in front of the server; the AWS endpoint points at the proxy."""
    with FaultProxy(s3_env.port, lifetime_s=60) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        yield p


def _store(url: str, **kw: object) -> S3Store:
    return S3Store(url, S3Options.from_env(gc_grace_s=0, **kw))


def test_throttling_is_retried(proxy: FaultProxy, s3_url: str) -> None:
    store = _store(s3_url)
    proxy.plan(Fault("slowdown", "PUT", times=2), Fault("slowdown", "GET", times=1))
    store.create("seg", [b"payload"])
    assert store.read("seg", max_bytes=100) == b"payload"
    assert [k for k, _m, _t in proxy.fired] == ["slowdown"] * 3


def test_resets_and_drops_are_retried(proxy: FaultProxy, s3_url: str) -> None:
    store = _store(s3_url)
    store.create("a", [bytes(range(256)) * 64])
    proxy.plan(Fault("reset", "GET"), Fault("drop", "GET"), Fault("reset", "PUT"))
    assert bytes(store.open("a", "pread").read(256, 512)) == (bytes(range(256)) * 2)
    store.publish("b", [b"x"])
    assert store.read("b", max_bytes=1) == b"x"
    assert sorted(k for k, _m, _t in proxy.fired) == ["drop", "reset", "reset"]


def test_a_create_whose_response_was_lost_is_recognised(proxy: FaultProxy,
                                                        s3_url: str) -> None:
    """The server applied the create-only PUT, the client saw a reset and retried: the
    retry's 412 is this writer's own object, not another writer's."""
    store = _store(s3_url)
    proxy.plan(Fault("reset_after", "PUT", "/seg"))
    store.create("seg", [b"mine"])
    assert proxy.fired
    assert proxy.fired[0][0] == "reset_after"
    assert store.read("seg", max_bytes=10) == b"mine"
    with pytest.raises(ObjectExists):  # a real second create is still refused
        store.create("seg", [b"theirs"])


def test_a_multipart_create_whose_completion_was_lost(proxy: FaultProxy, s3_url: str
                                                       ) -> None:
    store = _store(s3_url)
    data = os.urandom(MULTIPART_MIN_BYTES + 12345)
    proxy.plan(Fault("reset_after", "POST", "uploadId="))
    store.create("base", [data])
    assert [k for k, _m, _t in proxy.fired] == ["reset_after"]
    src = store.open("base", "pread")
    assert bytes(src.read(0, len(data))) == data


def test_an_unreachable_endpoint_is_one_line(proxy: FaultProxy, s3_url: str) -> None:
    store = _store(s3_url, max_attempts=2)
    proxy.plan(Fault("reset", times=10))
    with pytest.raises(StorageError) as ei:
        store.create("seg", [b"x"])
    msg = str(ei.value)
    assert "\n" not in msg
    assert "cannot reach" in msg
    assert proxy.url in msg


def test_a_missing_bucket_is_one_line(s3_env: S3Server) -> None:
    store = S3Store("s3://no-such-bucket-here/run")
    with pytest.raises(StorageError) as ei:
        store.ensure_root()
    assert str(ei.value) == (f"s3://no-such-bucket-here: io_error: bucket 'no-such-bucket-here'"
                             f" does not exist (endpoint {s3_env.endpoint})")
    with pytest.raises(StorageError) as ei:
        store.read("MANIFEST", max_bytes=10)
    assert "bucket does not exist" in str(ei.value)


def test_missing_credentials_are_one_line(s3_env: S3Server, s3_url: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError) as ei:
        S3Store(s3_url).exists("MANIFEST")
    assert "no AWS credentials found" in str(ei.value)


def test_a_profile_supplies_endpoint_and_credentials(s3_env: S3Server, s3_url: str,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: object) -> None:
    """The standard AWS config: a named profile with its own endpoint_url."""
    from pathlib import Path

    d = Path(str(tmp_path))
    (d / "config").write_text(f"[profile ld]\nregion = us-east-1\n"
                              f"endpoint_url = {s3_env.endpoint}\n")
    (d / "credentials").write_text(f"[ld]\naws_access_key_id = {s3_env.access_key}\n"
                                   f"aws_secret_access_key = {s3_env.secret_key}\n")
    for v in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(v)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(d / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(d / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "ld")
    store = S3Store(s3_url)
    store.create("x", [b"via profile"])
    assert store.read("x", max_bytes=20) == b"via profile"


def test_bad_urls() -> None:
    for url in ("s3://", "s3:///x", "s3://b/../x"):
        with pytest.raises(LowdiffError) as ei:
            S3Store(url)
        assert ei.value.reason in (Reason.INVALID_ARGUMENT, Reason.UNSAFE_NAME)


def test_a_writer_whose_uploads_fail_past_the_outage_budget_fails_and_keeps_what_was_durable(
        proxy: FaultProxy, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush the store does not answer raises (store_unavailable) but does not fail the
    writer; the outage fails it once over its budget (here 0 s: at the first retry)."""
    import time

    import numpy as np

    from lowdiff_store import LogReader, LogWriter, tensor_input

    monkeypatch.setenv("LOWDIFF_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("LOWDIFF_S3_OUTAGE_BUDGET_S", "0")
    w = LogWriter(s3_url)
    g = np.arange(16, dtype="<f4")
    w.append(0, [tensor_input("g", g, "F32")], kind="grad")
    assert w.flush() == 0  # (sync uploads only every upload_interval_s: flush forces it)
    proxy.plan(Fault("reset", "PUT", times=100))
    w.append(1, [tensor_input("g", g + 1, "F32")], kind="grad")
    with pytest.raises(StorageError) as ei:
        w.flush()
    assert ei.value.reason is Reason.STORE_UNAVAILABLE
    assert "cannot reach" in str(ei.value)
    w.append(2, [tensor_input("g", g + 2, "F32")], kind="grad")  # the writer goes on
    assert w.sync() == 0
    time.sleep(1.2)  # the first retry (OUTAGE_RETRY_MIN_S) is due: over the 0 s budget
    with pytest.raises(StorageError) as ei:
        w.sync()
    assert ei.value.reason is Reason.STORE_UNAVAILABLE
    assert "over the outage budget (outage_budget_s=0" in str(ei.value)
    assert "\n" not in str(ei.value)
    with pytest.raises(LowdiffError) as ei2:
        w.append(3, [tensor_input("g", g + 3, "F32")], kind="grad")
    assert ei2.value.reason is Reason.WRITER_FAILED
    assert w.durable_step == 0
    proxy.plan()
    w.close()
    with LogReader(s3_url) as r:
        assert [rec.step for rec in r.iter_records()] == [0]
        np.testing.assert_array_equal(r.record(0).tensor("g"), g)


def test_an_outage_does_not_stop_the_writer_and_durable_step_catches_up(
        proxy: FaultProxy, s3_url: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """While every PUT is refused, appends and syncs go on (staged locally), durable_step
    stays, one warning says so; once the store answers it catches up, and every step reads
    back."""
    import logging
    import time

    import numpy as np

    from lowdiff_store import LogReader, LogWriter, tensor_input

    monkeypatch.setenv("LOWDIFF_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("LOWDIFF_S3_UPLOAD_INTERVAL_S", "0.1")
    w = LogWriter(s3_url, segment_bytes=4096)  # small segments: a roll falls in the outage
    g = np.arange(256, dtype="<f4")
    w.append(0, [tensor_input("g", g, "F32")], kind="grad")
    assert w.flush() == 0
    proxy.plan(Fault("reset", "PUT", times=10_000))
    with caplog.at_level(logging.WARNING):
        for step in range(1, 30):
            w.append(step, [tensor_input("g", g + step, "F32")], kind="grad")
            assert w.sync() == 0
            time.sleep(0.05)
    warned = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(warned) == 1, warned
    proxy.plan()
    deadline = time.monotonic() + 30
    while w.sync() != 29:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    w.append(30, [tensor_input("g", g + 30, "F32")], kind="grad")
    assert w.flush() == 30
    w.close()
    with LogReader(s3_url) as r:
        assert [rec.step for rec in r.iter_records()] == list(range(31))
        for step in (0, 15, 30):
            np.testing.assert_array_equal(r.record(step).tensor("g"), g + step)


def test_a_lock_whose_create_was_answered_late_is_ours(proxy: FaultProxy, s3_url: str
                                                      ) -> None:
    store = _store(s3_url)
    proxy.plan(Fault("reset_after", "PUT", "/LOCK"))
    lock = store.try_lock("LOCK")
    assert lock is not None
    assert [k for k, _m, _t in proxy.fired] == ["reset_after"]
    assert store.try_lock("LOCK") is None
    lock.release()
    again = store.try_lock("LOCK")
    assert again is not None
    again.release()


def test_a_lease_refresh_answered_late_keeps_the_lease(proxy: FaultProxy, s3_url: str
                                                       ) -> None:
    import time

    store = _store(s3_url, lock_ttl_s=0.6)  # refreshed every 0.2 s
    lock = store.try_lock("LOCK")
    assert lock is not None
    proxy.plan(Fault("reset_after", "PUT", "/LOCK"))
    deadline = time.monotonic() + 10
    while not proxy.fired and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # more refreshes after the lost answer
    assert proxy.fired
    assert lock._thread.is_alive()  # type: ignore[attr-defined]
    lock.release()
    assert "LOCK" not in store.list()


def test_a_write_ahead_writer_closed_while_uploads_fail_keeps_what_it_acknowledged(
        proxy: FaultProxy, s3_url: str, tmp_path: os.PathLike[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a write-ahead directory a step is durable once fsynced there. A close whose
    uploads fail must still release the lock and close the staged copy, so that the same
    process can reopen the log once the network is back, and that reopening uploads the
    write-ahead copy instead of cutting it to the bucket's shorter object (which lost the
    acknowledged step 0)."""
    import numpy as np

    from lowdiff_store import LogReader, LogWriter, tensor_input

    monkeypatch.setenv("LOWDIFF_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("LOWDIFF_S3_WAL_DIR", os.path.join(os.fspath(tmp_path), "wal"))
    g = np.arange(16, dtype="<f4")
    w = LogWriter(s3_url)
    w.append(0, [tensor_input("g", g, "F32")], kind="grad")
    assert w.sync() == 0  # in the write-ahead directory, not yet in the bucket
    proxy.plan(Fault("reset", "PUT", times=100))
    with pytest.raises(StorageError):
        w.close()
    proxy.plan()
    w2 = LogWriter(s3_url)  # not LOCKED: the failed close released the lock
    assert w2.durable_step == 0
    w2.close()
    with LogReader(s3_url) as r:
        assert [rec.step for rec in r.iter_records()] == [0]
        np.testing.assert_array_equal(r.record(0).tensor("g"), g)
