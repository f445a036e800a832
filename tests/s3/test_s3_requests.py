"""Requests and honesty of an ``s3://`` log without a write-ahead directory: the active
segment is uploaded at most every ``upload_interval_s`` (not per step), ``durable_step``
only names steps that are in the bucket, a SIGKILLed writer loses nothing it reported
durable, and a segment's bytes are uploaded once (sealed segments stay their pieces)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogReader
from lowdiff_store.storage.s3 import S3Store
from lowdiff_store.writer import AsyncLogWriter, TensorSpec

#: Requests that upload bytes (a multipart upload counts its parts and its completion).
_PUTS = ("PutObject", "UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload")


class Requests:
    """S3 requests sent by this process's shared client (boto3's parameter-build event:
    one per request as the library issues it, retries not counted)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []  # (operation, key, body bytes)
        self._lock = threading.Lock()

    def __call__(self, params: dict[str, Any], model: Any, **_kw: Any) -> None:
        body = params.get("Body", b"")
        if hasattr(body, "getbuffer"):  # botocore wraps bytes in a BytesIO first
            body = body.getbuffer()
        n = memoryview(body).nbytes
        with self._lock:
            self.calls.append((model.name, str(params.get("Key", "")), n))

    def puts(self) -> int:
        with self._lock:
            return sum(op in _PUTS for op, _k, _n in self.calls)

    def uploaded(self, suffix: str) -> int:
        with self._lock:
            return sum(n for op, k, n in self.calls
                       if op in ("PutObject", "UploadPart") and suffix in k)


@pytest.fixture
def requests(s3_url: str) -> Iterator[Requests]:
    events = S3Store(s3_url).objects.s3.meta.events
    r = Requests()
    events.register("before-parameter-build.s3", r, unique_id="lowdiff-test-requests")
    yield r
    events.unregister("before-parameter-build.s3", unique_id="lowdiff-test-requests")


def grad(step: int, n: int = 4096) -> list[TensorSpec]:
    return [TensorSpec("g", "F32", np.full(n, step, dtype="<f4"))]


def in_bucket(url: str) -> list[int]:
    with LogReader(url) as r:
        return [int(s) for s in r.steps]


def test_uploads_per_interval_not_per_step_and_durable_is_in_the_bucket(
        s3_url: str, requests: Requests, monkeypatch: pytest.MonkeyPatch) -> None:
    interval = 0.5
    monkeypatch.setenv("LOWDIFF_S3_UPLOAD_INTERVAL_S", str(interval))
    w = AsyncLogWriter(s3_url, batch=1, segment_bytes=256 << 10)  # 16 KiB records: rolls too
    try:
        n_steps = 60
        before = requests.puts()
        t0 = time.monotonic()
        for s in range(n_steps):
            w.append(s, grad(s), kind="grad")
            time.sleep(0.01)
            if s % 20 == 19:  # honesty: every step reported durable is in the bucket
                d = w.durable_step
                if d is not None:
                    assert in_bucket(s3_url)[:d + 1] == list(range(d + 1))
        elapsed = time.monotonic() - t0
        puts = requests.puts() - before
        # the segment: one piece per interval, plus five per roll (the last pieces of the
        # segment and its index, the headers of the new ones, the manifest)
        rolls = w.log.stats["rolls"]
        assert 1 <= rolls <= 4
        assert puts <= elapsed / interval + 2 + 5 * rolls, requests.calls
        assert puts < n_steps / 2
        assert w.flush() == n_steps - 1
        assert in_bucket(s3_url) == list(range(n_steps))
    finally:
        w.close()
    # every byte of every segment was uploaded exactly once
    store = S3Store(s3_url)
    stored = sum(store.size(n) for n in store.list() if n.endswith(".ldlog"))
    assert requests.uploaded(".ldlog") == stored


def test_a_step_not_uploaded_is_not_reported_durable(s3_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWDIFF_S3_UPLOAD_INTERVAL_S", "3600")
    released: list[int] = []
    w = AsyncLogWriter(s3_url, batch=1)
    try:
        futs = [w.append(s, grad(s), kind="grad", owned=True,
                         on_release=lambda s=s: released.append(s))  # type: ignore[misc]
                for s in range(5)]
        deadline = time.monotonic() + 30
        while w.stats()["records"] < 5:  # written and synced (staged), not uploaded
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        assert w.durable_step is None
        assert not any(f.done() for f in futs)
        assert sorted(released) == list(range(5))  # arrays released once written
        assert in_bucket(s3_url) == []
        assert w.flush() == 4
        assert [f.result(timeout=0) for f in futs] == list(range(5))
        assert in_bucket(s3_url) == list(range(5))
    finally:
        w.close()


_WRITER = textwrap.dedent("""
    import os, sys, time, numpy as np
    from lowdiff_store.writer import AsyncLogWriter, TensorSpec
    def say(line):  # one write per line: the two threads' lines never interleave
        os.write(1, (line + "\\n").encode())
    w = AsyncLogWriter(sys.argv[1], batch=1, on_durable=lambda d: say(f"DURABLE {d}"))
    for s in range(100_000):
        w.append(s, [TensorSpec("g", "F32", np.full(1024, s, dtype="<f4"))], kind="grad")
        say(f"APPENDED {s}")
        time.sleep(0.005)
""")


def test_sigkill_after_durable_restores_bitwise_from_the_bucket(
        s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A AsyncLogWriter SIGKILLed mid-run: every step it reported durable (on_durable) is in
    the bucket bit for bit; durable_step moved with the uploads, not with the steps."""
    monkeypatch.setenv("LOWDIFF_S3_UPLOAD_INTERVAL_S", "0.3")
    p = subprocess.Popen([sys.executable, "-c", _WRITER, s3_url], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    durable, reports = -1, 0
    t0 = time.monotonic()
    try:
        for line in p.stdout:  # type: ignore[union-attr]
            kind, v = line.split()
            if kind == "DURABLE":
                durable = int(v)
                reports += 1
                if durable >= 60:
                    break
    finally:
        p.send_signal(signal.SIGKILL)
        _out, err = p.communicate(timeout=30)
    assert durable >= 60, err
    # durable_step moved once per upload (every 0.3 s), not once per step
    assert reports <= (time.monotonic() - t0) / 0.3 + 3
    with LogReader(s3_url) as r:
        steps = [int(s) for s in r.steps]
        assert steps[:durable + 1] == list(range(durable + 1))
        for rec in r.iter_records():
            np.testing.assert_array_equal(rec.tensor("g"), np.full(1024, rec.step, "<f4"))


def test_reading_in_order_reads_ahead_in_few_large_ranges(s3_url: str) -> None:
    """Large reads in order (a restore reading a base tensor after tensor): the second
    fetches ``readahead_bytes`` in ``concurrency`` ranges, the next ones are served from
    it; a lone large read, or one elsewhere, fetches only itself."""
    import os

    from lowdiff_store.storage.s3 import S3Options

    mib = 1 << 20
    store = S3Store(s3_url, S3Options(part_bytes=5 * mib, concurrency=2,
                                      readahead_bytes=16 * mib))
    requests = Requests()  # (these options have a client of their own)
    store.objects.s3.meta.events.register("before-parameter-build.s3", requests,
                                   unique_id="lowdiff-test-readahead")
    data = os.urandom(22 * mib)
    store.create("obj", [data])
    src = store.open("obj", "pread")

    def gets() -> int:
        return sum(op == "GetObject" for op, _k, _n in requests.calls)

    before = gets()
    assert bytes(src.read(0, 4 * mib)) == data[:4 * mib]
    assert gets() - before == 1  # one large read alone (a record's payload): itself only
    assert bytes(src.read(4 * mib, 4 * mib)) == data[4 * mib:8 * mib]
    assert gets() - before == 3  # the second in order: a window [4, 20) MiB, two 8 MiB ranges
    for off in (8 * mib, 12 * mib, 16 * mib):
        assert bytes(src.read(off, 4 * mib)) == data[off:off + 4 * mib]
    assert bytes(src.read(9 * mib, 100)) == data[9 * mib:9 * mib + 100]  # small, inside
    assert gets() - before == 3  # all served from the window
    # the window serves several reads: nobody may write in it (replay copies, not lends)
    assert src.read(8 * mib, 4 * mib).readonly
    assert src.read(9 * mib - 10, 20).readonly
    assert bytes(src.read(1 * mib, 4 * mib)) == data[mib:5 * mib]  # elsewhere: itself
    assert gets() - before == 4
    src.close()
    store.objects.s3.meta.events.unregister("before-parameter-build.s3",
                                     unique_id="lowdiff-test-readahead")
