"""The log on an S3 store: write, roll, bases, reopen, read, verify; the commit is a
create-only manifest object; two writers: one wins, the other gets a clear error."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogReader, LogWriter, tensor_input
from lowdiff_store.compaction import compact
from lowdiff_store.storage.s3 import S3Store
from lowdiff_store.verify import verify_log


def values(step: int, n: int = 64) -> np.ndarray:
    return (np.arange(n, dtype="<f4") + np.float32(step) * 1000).astype("<f4")


def write(w: LogWriter, steps: range, n: int = 64) -> None:
    for s in steps:
        w.append(s, [tensor_input("g", values(s, n), "F32")], kind="grad")
        w.sync()


def test_write_reopen_read(s3_url: str) -> None:
    w = LogWriter(s3_url, segment_bytes=8192)
    write(w, range(0, 30))
    w.write_base(30, {"w": ("F32", values(30, 1000))})
    write(w, range(31, 40))
    # sync uploads at most every upload_interval_s: durable_step is what the bucket holds
    # (the segments sealed so far), flush uploads the rest
    assert w.durable_step is not None
    assert w.durable_step < 39
    assert w.flush() == 39
    w.close()
    w = LogWriter(s3_url, segment_bytes=8192)
    assert w.last_step == 39
    write(w, range(40, 45))
    w.close()
    with LogReader(s3_url) as r:
        steps = [rec.step for rec in r.iter_records()]
        assert steps == [s for s in range(45) if s != 30]
        for rec in r.iter_records():
            np.testing.assert_array_equal(rec.tensor("g"), values(rec.step))
        b = r.base(30)
        np.testing.assert_array_equal(b.tensor("w"), values(30, 1000))
    rep = verify_log(s3_url)
    assert rep.ok, rep
    keys = [k for k, _ in S3Store(s3_url).objects.list_keys(S3Store(s3_url).prefix + "/")]
    assert any(k.endswith("MANIFEST.00000000000000000000") for k in keys), keys


_WRITER = textwrap.dedent("""
    import sys, numpy as np
    from lowdiff_store import LogWriter, tensor_input
    url, start, stop, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        w = LogWriter(url, segment_bytes=8192)
    except Exception as e:
        print("ERROR", e, flush=True)
        sys.exit(3)
    print("OPEN", flush=True)
    for s in range(start, stop):
        v = (np.arange(64, dtype="<f4") + np.float32(s) * 1000).astype("<f4")
        w.append(s, [tensor_input("g", v, "F32")], kind="grad")
        w.sync()
        d = w.durable_step
        print("DURABLE", -1 if d is None else d, s, flush=True)
    if hold == "hold":
        sys.stdin.read()
    w.close()
""")


def _spawn(url: str, start: int, stop: int, hold: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _WRITER, url, str(start), str(stop), hold],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_writers_race_one_wins(s3_url: str) -> None:
    """Two processes open one log at once: exactly one writes, the other gets one line."""
    procs = [_spawn(s3_url, 0, 3, "hold") for _ in range(2)]
    firsts = [p.stdout.readline().strip() for p in procs]  # type: ignore[union-attr]
    assert sorted(f.split(" ")[0] for f in firsts) == ["ERROR", "OPEN"], firsts
    loser = procs[firsts.index(next(f for f in firsts if f.startswith("ERROR")))]
    assert "another writer holds this log" in firsts[procs.index(loser)]
    winner = procs[1 - procs.index(loser)]
    loser.communicate("", timeout=60)
    assert loser.returncode == 3
    _out, err = winner.communicate("", timeout=60)
    assert winner.returncode == 0, err
    with LogReader(s3_url) as r:
        assert [rec.step for rec in r.iter_records()] == [0, 1, 2]


def test_sigkill_writer_then_read_bitwise(s3_url: str) -> None:
    """SIGKILL the writer mid-run: every step it reported durable is in the bucket, bit
    for bit; a new writer goes on from there. Syncs upload at most every
    upload_interval_s, so durable_step lags the steps synced, and says so."""
    p = _spawn(s3_url, 0, 10_000, "")
    durable = -1
    lagged = False
    for line in p.stdout:  # type: ignore[union-attr]
        if line.startswith("DURABLE"):
            durable, synced = map(int, line.split()[1:])
            lagged |= durable < synced
            if durable >= 25:
                break
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=30)
    with LogReader(s3_url) as r:
        steps = [rec.step for rec in r.iter_records()]
        assert steps[:durable + 1] == list(range(durable + 1))
        for rec in r.iter_records():
            np.testing.assert_array_equal(rec.tensor("g"), values(rec.step))
    assert lagged
    last = steps[-1]
    w = LogWriter(s3_url, segment_bytes=8192)  # the dead writer's lock is broken
    assert w.last_step == last
    write(w, range(last + 1, last + 3))
    w.close()


def test_compaction_with_a_reader_holding_the_old_manifest(s3_url: str) -> None:
    """Compaction drops base 5 and the segments before it; a reader that opened the log
    before keeps reading them (deletes wait out a grace period), a new reader never sees
    them, and once the grace has passed they are gone."""
    n = 1024  # 4 KiB records: about two per 8 KiB segment
    w = LogWriter(s3_url, segment_bytes=8192)
    write(w, range(0, 5), n)
    w.write_base(5, {"w": ("F32", values(5, 1000))})
    write(w, range(6, 10), n)
    w.write_base(10, {"w": ("F32", values(10, 1000))})
    write(w, range(11, 13), n)
    w.close()
    old = LogReader(s3_url)  # holds the manifest naming base 10 and segments before it
    try:
        res = compact(s3_url, keep_bases=1)
        assert res.plan.delete_bases == [5]
        assert res.plan.delete_segments
        with LogReader(s3_url) as new:
            assert new.bases == [10]
            assert new.first_step is not None
            assert new.first_step > 0
        # the old reader still reads everything its manifest names (grace period)
        np.testing.assert_array_equal(old.base(5).tensor("w"), values(5, 1000))
        assert [rec.step for rec in old.iter_records(0, 5)] == list(range(5))
        for rec in old.iter_records(0, 5):
            np.testing.assert_array_equal(rec.tensor("g"), values(rec.step, n))
    finally:
        old.close()
    store = S3Store(s3_url)
    gone = [f"seg-{s:016d}.ldlog" for s in res.plan.delete_segments]
    assert store.collect_garbage() == 0  # within the grace: nothing removed yet
    assert store.collect_garbage(now=time.time() + store.options.gc_grace_s + 1) > 0
    keys = {k.rsplit("/", 1)[-1] for k, _ in store.objects.list_keys(store.prefix + "/")}
    assert not keys & {*gone, "base-0000000000000005.safetensors"}
    with LogReader(s3_url) as new:
        steps = [rec.step for rec in new.iter_records()]
        assert steps == [s for s in range(steps[0], 13) if s not in (5, 10)]
        np.testing.assert_array_equal(new.base(10).tensor("w"), values(10, 1000))
    assert verify_log(s3_url).ok


def test_write_ahead_directory_keeps_what_was_acknowledged(s3_url: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """With LOWDIFF_S3_WAL_DIR, a sync is durable in the local directory and uploads wait
    (here: an hour). SIGKILL: the bucket alone lacks the acknowledged steps; the next
    process opening the log with the same directory uploads them first."""
    monkeypatch.setenv("LOWDIFF_S3_WAL_DIR", str(tmp_path / "wal"))
    monkeypatch.setenv("LOWDIFF_S3_UPLOAD_INTERVAL_S", "3600")
    p = _spawn(s3_url, 0, 10_000, "")
    durable = -1
    for line in p.stdout:  # type: ignore[union-attr]
        if line.startswith("DURABLE"):
            durable = int(line.split()[1])
            if durable >= 8:
                break
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=30)
    monkeypatch.delenv("LOWDIFF_S3_WAL_DIR")
    with LogReader(s3_url) as r:  # the bucket alone: not everything acknowledged
        in_bucket = [rec.step for rec in r.iter_records()]
    assert len(in_bucket) < durable + 1
    monkeypatch.setenv("LOWDIFF_S3_WAL_DIR", str(tmp_path / "wal"))
    with LogWriter(s3_url, segment_bytes=8192) as w:  # uploads the write-ahead copy
        assert w.last_step is not None
        assert w.last_step >= durable
    monkeypatch.delenv("LOWDIFF_S3_WAL_DIR")
    with LogReader(s3_url) as r:
        steps = [rec.step for rec in r.iter_records()]
        assert steps[:durable + 1] == list(range(durable + 1))
        for rec in r.iter_records():
            np.testing.assert_array_equal(rec.tensor("g"), values(rec.step))


def test_a_commit_is_one_create_only_put(s3_url: str) -> None:
    """The commit path sends one conditional PUT of MANIFEST.<n+1>: no rename, copy or
    delete."""
    from lowdiff_store.log.manifest import update_manifest

    LogWriter(s3_url).close()
    store = S3Store(s3_url)
    sent: list[tuple[str, Any, str, bool]] = []

    def on_send(request: Any, **_kw: Any) -> None:
        cond = request.headers.get("If-None-Match")
        sent.append((request.method, cond.decode() if isinstance(cond, bytes) else cond,
                     request.url, "x-amz-copy-source" in request.headers))

    events = store.objects.s3.meta.events
    events.register("before-send.s3", on_send)
    try:
        update_manifest(store, lambda m: m.meta.update(note="x"))
    finally:
        events.unregister("before-send.s3", on_send)
    writes = [s for s in sent if s[0] != "GET" and s[0] != "HEAD"]
    assert len(writes) == 1, sent
    method, cond, url, copy = writes[0]
    assert (method, cond, copy) == ("PUT", "*", False)
    versions = sorted(n for n in store.list() if n.startswith("MANIFEST."))
    assert url.endswith("/run/" + versions[-1])
