"""The asynchronous writer: ordering, staging safety, group commit, durability, back-pressure,
errors. Faults are injected through ``file_factory`` (segment and index files)."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogReader, codecs
from lowdiff_store.errors import (
    CommitError,
    ConfigError,
    FormatError,
    LowdiffError,
    Reason,
    StorageError,
    WriterClosedError,
)
from lowdiff_store.storage import AppendFile
from lowdiff_store.writer import AsyncLogWriter, TensorSpec
from tests.helpers.timing import scaled

Buffer = bytes | bytearray | memoryview


# ---------------------------------------------------------------------------- helpers

def _is_segment(path: str) -> bool:
    return path.endswith(".ldlog")


def counting_factory() -> type[AppendFile]:
    """An AppendFile class counting writes and syncs of segment files (class attributes)."""

    class Counting(AppendFile):
        writes = 0
        syncs = 0

        def _writev(self, fd: int, chunks: Sequence[Buffer]) -> int:
            if _is_segment(self.path):
                type(self).writes += 1
            return super()._writev(fd, chunks)

        def _sync(self, fd: int) -> None:
            if _is_segment(self.path):
                type(self).syncs += 1
            super()._sync(fd)

    return Counting


def gated_factory(gate: threading.Event) -> type[AppendFile]:
    """Segment writes wait for ``gate`` (the background stays behind the test)."""

    class Gated(AppendFile):
        def _writev(self, fd: int, chunks: Sequence[Buffer]) -> int:
            if _is_segment(self.path) and self.size > 0:  # not the segment header
                gate.wait(scaled(60))  # (a hang bound: the test opens it)
            return super()._writev(fd, chunks)

    return Gated


def slow_factory(delay: float) -> type[AppendFile]:
    class Slow(AppendFile):
        def _writev(self, fd: int, chunks: Sequence[Buffer]) -> int:
            if _is_segment(self.path):
                time.sleep(delay)
            return super()._writev(fd, chunks)

    return Slow


def failing_factory(*, write_at: int | None = None, sync_at: int | None = None,
                    err: int = errno.ENOSPC, partial: bool = False) -> type[AppendFile]:
    """Segment writes (or syncs) numbered ``write_at`` (``sync_at``) and later raise
    OSError(err), counting from the first after the writer was opened; with ``partial``
    the failing write first puts half its bytes in the file (a torn record)."""

    class Failing(AppendFile):
        armed = False
        writes = 0
        syncs = 0

        def _writev(self, fd: int, chunks: Sequence[Buffer]) -> int:
            cls = type(self)
            if _is_segment(self.path) and cls.armed:
                cls.writes += 1
                if write_at is not None and cls.writes >= write_at:
                    if partial:
                        data = b"".join(bytes(c) for c in chunks)
                        super()._writev(fd, [data[:len(data) // 2]])
                    raise OSError(err, os.strerror(err))
            return super()._writev(fd, chunks)

        def _sync(self, fd: int) -> None:
            cls = type(self)
            if _is_segment(self.path) and cls.armed:
                cls.syncs += 1
                if sync_at is not None and cls.syncs >= sync_at:
                    raise OSError(err, os.strerror(err))
            super()._sync(fd)

    return Failing


def arrays_for(step: int, n: int = 300) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(n).astype(np.float32),
            "b": rng.integers(0, 1 << 16, n // 3, dtype=np.uint16)}


def specs_for(step: int) -> list[TensorSpec]:
    a = arrays_for(step)
    return [TensorSpec("w", "F32", a["w"]), TensorSpec("b", "BF16", a["b"], zstd=3)]


def check_step(reader: LogReader, step: int) -> None:
    rec = reader.record(step)
    a = arrays_for(step)
    assert np.array_equal(rec.tensor("w"), a["w"])
    assert np.array_equal(rec.tensor("b"), a["b"])
    assert rec.side == {"step": step}


def append_step(w: AsyncLogWriter, step: int, **kw: Any) -> Any:
    return w.append(step, specs_for(step), kind="grad", side={"step": step}, **kw)


# ---------------------------------------------------------------------------- basics

def test_append_flush_read_back_in_order(tmp_path: Any) -> None:
    with AsyncLogWriter(tmp_path / "log", batch=4) as w:
        futs = [append_step(w, s) for s in range(1, 12)]
        assert w.last_step == 11
        assert w.flush() == 11
        assert [f.result(0) for f in futs] == list(range(1, 12))
        assert w.durable_step == 11
    with LogReader(tmp_path / "log") as r:
        assert list(r.steps) == list(range(1, 12))
        for s in range(1, 12):
            check_step(r, s)
            assert r.record(s).kind == "grad"


def test_every_codec_path(tmp_path: Any) -> None:
    rng = np.random.default_rng(0)
    dense = rng.standard_normal(1000).astype(np.float32)
    ref = rng.standard_normal(1000).astype(np.float32)
    idx = np.array([3, 17, 999], np.int32)
    val = np.array([1.5, -2.0, 3.25], np.float32)
    specs = [
        TensorSpec("raw", "F32", dense.reshape(10, 100)),
        TensorSpec("noncontig", "F32", dense.reshape(10, 100)[:, ::2]),
        TensorSpec("xor", "F32", dense, codec="xor", ref=ref, zstd=1),
        TensorSpec("q8", "F32", dense, codec="q8", options={"block": 64}),
        TensorSpec("sparse", "F32", encoded=codecs.encode_sparse(idx, val, 1000, "F32"),
                   shape=(10, 100), zstd=5),
        TensorSpec("empty", "F32", np.zeros(0, np.float32)),
    ]
    with AsyncLogWriter(tmp_path / "log") as w:
        w.append(1, specs, kind="weight", extra={"digest": "abc"}).result(10)
    with LogReader(tmp_path / "log") as r:
        rec = r.record(1)
        assert rec.kind == "weight"
        assert rec.meta["digest"] == "abc"
        assert np.array_equal(rec.tensor("raw"), dense.reshape(10, 100))
        assert np.array_equal(rec.tensor("noncontig"), dense.reshape(10, 100)[:, ::2])
        assert np.array_equal(rec.tensor("xor", ref=ref), dense)
        q = rec.tensor("q8")
        assert q.shape == (1000,)
        assert np.abs(q - dense).max() < 0.05
        want = np.zeros(1000, np.float32)
        want[idx] = val
        assert np.array_equal(rec.tensor("sparse"), want.reshape(10, 100))
        assert rec.tensor("empty").size == 0


def test_staging_copies_everything_before_append_returns(tmp_path: Any) -> None:
    gate = threading.Event()
    rng = np.random.default_rng(1)
    arr = rng.standard_normal(5000).astype(np.float32)
    ref = rng.standard_normal(5000).astype(np.float32)
    idx = np.arange(0, 5000, 7, dtype=np.int32)
    val = rng.standard_normal(idx.size).astype(np.float32)
    enc = codecs.encode_sparse(idx, val, 5000, "F32")
    want_arr, want_ref, want_val = arr.copy(), ref.copy(), val.copy()
    opts = {"block": 128}
    spec_q8 = TensorSpec("q", "F32", arr, codec="q8", options=opts)
    side = {"lr": [0.1, 0.2]}
    with AsyncLogWriter(tmp_path / "log", file_factory=gated_factory(gate)) as w:
        fut = w.append(1, [TensorSpec("a", "F32", arr), TensorSpec("x", "F32", arr, codec="xor",
                                                                    ref=ref),
                           TensorSpec("s", "F32", encoded=enc, shape=(5000,)), spec_q8],
                       kind="grad", side=side)
        # the background is held before its write: scribble over everything now
        arr[:] = 7.0
        ref[:] = -1.0
        for p in enc.parts:
            p.data[:] = 0
        opts["block"] = 9999
        spec_q8.name = "renamed"
        side["lr"].append(99.0)
        gate.set()
        assert fut.result(10) == 1
    with LogReader(tmp_path / "log") as r:
        rec = r.record(1)
        assert np.array_equal(rec.tensor("a"), want_arr)
        assert np.array_equal(rec.tensor("x", ref=want_ref), want_arr)
        dense = np.zeros(5000, np.float32)
        dense[idx] = want_val
        assert np.array_equal(rec.tensor("s"), dense)
        assert rec.entry("q").params["block"] == 128
        assert np.abs(rec.tensor("q") - want_arr).max() < 0.05
        assert rec.side == {"lr": [0.1, 0.2]}


def test_staging_copies_in_chunks(tmp_path: Any, monkeypatch: Any) -> None:
    import lowdiff_store.writer.staging as writer_mod

    monkeypatch.setattr(writer_mod, "_COPY_CHUNK", 1000)
    arr = np.random.default_rng(3).standard_normal(2501).astype(np.float32)
    with AsyncLogWriter(tmp_path / "log") as w:
        w.append(1, [TensorSpec("a", "F32", arr.reshape(41, 61))], kind="grad").result(10)
    with LogReader(tmp_path / "log") as r:
        assert np.array_equal(r.record(1).tensor("a"), arr.reshape(41, 61))


def test_owned_hands_the_buffer_over_without_copy(tmp_path: Any) -> None:
    gate = threading.Event()
    arr = np.arange(1000, dtype=np.float32)  # 4000 bytes: a copy would stage 4096
    with AsyncLogWriter(tmp_path / "log", file_factory=gated_factory(gate)) as w:
        fut = w.append(1, [TensorSpec("a", "F32", arr)], kind="grad", owned=True)
        assert w.stats()["staged_bytes"] == arr.nbytes  # counted, not copied
        gate.set()
        fut.result(10)
        st = w.stats()
        assert (st["staged_bytes"], st["pooled_bytes"]) == (0, 0)  # no staging buffer
    with LogReader(tmp_path / "log") as r:
        assert np.array_equal(r.record(1).tensor("a"), np.arange(1000, dtype=np.float32))


# ---------------------------------------------------------------------------- group commit

def test_batch_groups_records_into_one_write_and_one_sync(tmp_path: Any) -> None:
    F = counting_factory()
    with AsyncLogWriter(tmp_path / "log", batch=8, max_delay_s=60, file_factory=F) as w:
        w0, s0 = F.writes, F.syncs
        for s in range(1, 33):
            append_step(w, s)
        w.flush()
        assert (F.writes - w0, F.syncs - s0) == (4, 4)
        st = w.stats()
        assert st["batches"] == 4
        assert st["records"] == 32
        assert st["last_batch_records"] == 8


def test_set_batch_changes_the_group_size(tmp_path: Any) -> None:
    F = counting_factory()
    with AsyncLogWriter(tmp_path / "log", batch=1, max_delay_s=60, file_factory=F) as w:
        s0 = F.syncs
        for s in range(1, 3):
            append_step(w, s).result(10)
        w.set_batch(4)
        for s in range(3, 11):
            append_step(w, s)
        w.wait(10, timeout=10)
        assert F.syncs - s0 == 4  # 1 + 1 + 4 + 4
        with pytest.raises(ConfigError):
            w.set_batch(0)


def test_partial_group_waits_for_max_delay_then_commits(tmp_path: Any) -> None:
    F = counting_factory()
    # the delay is long enough that the two appends land in one group even on a busy
    # machine (a lower bound on the time taken is the only clock the test reads)
    with AsyncLogWriter(tmp_path / "log", batch=100, max_delay_s=0.5, file_factory=F) as w:
        s0 = F.syncs
        t0 = time.monotonic()
        append_step(w, 1)
        append_step(w, 2)
        w.wait(2, timeout=scaled(60))  # no flush: the delay closes the group
        assert time.monotonic() - t0 >= 0.45
        assert F.syncs - s0 == 1
        assert w.stats()["last_batch_records"] == 2


def test_max_batch_bytes_closes_a_group(tmp_path: Any) -> None:
    F = counting_factory()
    rec = 4096
    with AsyncLogWriter(tmp_path / "log", batch=100, max_delay_s=60, max_batch_bytes=3 * rec,
                    file_factory=F) as w:
        s0 = F.syncs
        for s in range(1, 7):
            w.append(s, [TensorSpec("a", "U8", np.zeros(rec, np.uint8))], kind="grad")
        w.wait(6, timeout=10)
        assert F.syncs - s0 == 2
        assert w.stats()["max_batch_records"] == 3


def test_sync_true_commits_its_group_at_once(tmp_path: Any) -> None:
    F = counting_factory()
    with AsyncLogWriter(tmp_path / "log", batch=100, max_delay_s=60, file_factory=F) as w:
        s0 = F.syncs
        for s in range(1, 4):
            append_step(w, s)
        f4 = append_step(w, 4, sync=True)
        assert f4.result(10) == 4
        assert F.syncs - s0 == 1
        assert w.stats()["last_batch_records"] == 4
        f5 = append_step(w, 5)
        time.sleep(0.2)
        assert not f5.done()  # not folded into the synced group, waits for its own
        assert w.durable_step == 4
        assert w.flush() == 5
        assert F.syncs - s0 == 2


def test_futures_callback_and_durable_step_in_order(tmp_path: Any) -> None:
    seen: list[int] = []
    done: list[int] = []
    durable_seen: list[int | None] = []
    with AsyncLogWriter(tmp_path / "log", batch=3, max_delay_s=0.01,
                    on_durable=seen.append) as w:
        for s in range(1, 20):
            f = append_step(w, s)
            f.add_done_callback(lambda f: done.append(f.result()))
            durable_seen.append(w.durable_step)
        w.flush()
    assert done == list(range(1, 20))
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen)
    assert seen[-1] == 19
    vals = [d for d in durable_seen if d is not None]
    assert vals == sorted(vals)


def test_on_durable_exception_is_counted_not_fatal(tmp_path: Any) -> None:
    def boom(step: int) -> None:
        raise RuntimeError("callback bug")

    with AsyncLogWriter(tmp_path / "log", on_durable=boom) as w:
        append_step(w, 1).result(10)
        append_step(w, 2).result(10)
        assert w.stats()["callback_errors"] == 2


def test_wait_timeout_and_unknown_step(tmp_path: Any) -> None:
    gate = threading.Event()
    with AsyncLogWriter(tmp_path / "log", file_factory=gated_factory(gate)) as w:
        append_step(w, 1)
        with pytest.raises(TimeoutError):
            w.wait(1, timeout=0.05)
        with pytest.raises(ConfigError):
            w.wait(5)
        gate.set()
        w.wait(1, timeout=10)


# ---------------------------------------------------------------------------- back-pressure

def test_back_pressure_bounds_staged_memory(tmp_path: Any) -> None:
    n = 64 * 1024
    budget = 3 * n + 1000
    with AsyncLogWriter(tmp_path / "log", memory_budget=budget,
                    file_factory=slow_factory(0.02)) as w:
        for s in range(1, 16):
            w.append(s, [TensorSpec("a", "U8", np.full(n, s % 256, np.uint8))], kind="grad")
            st = w.stats()
            assert st["staged_bytes"] + st["pooled_bytes"] <= budget
        w.flush()
        st = w.stats()
    assert st["blocked_s"] > 0
    assert 0 < st["staged_bytes_peak"] <= budget
    with LogReader(tmp_path / "log") as r:
        assert list(r.steps) == list(range(1, 16))
        assert np.all(r.record(9).tensor("a") == 9)


def test_a_record_larger_than_the_budget_is_admitted_alone(tmp_path: Any) -> None:
    with AsyncLogWriter(tmp_path / "log", memory_budget=10_000,
                    file_factory=slow_factory(0.01)) as w:
        w.append(1, [TensorSpec("a", "U8", np.zeros(4000, np.uint8))], kind="grad")
        w.append(2, [TensorSpec("a", "U8", np.ones(50_000, np.uint8))], kind="grad")
        w.append(3, [TensorSpec("a", "U8", np.zeros(4000, np.uint8))], kind="grad")
        assert w.flush() == 3
        st = w.stats()
        assert st["blocked_s"] > 0
        assert st["staged_bytes_peak"] <= 10_000 + 50_000 + 4096  # budget + one record


# ---------------------------------------------------------------------------- errors

def _assert_names_step(err: BaseException, step: int) -> None:
    assert isinstance(err, CommitError)
    assert f"failed at step {step}" in str(err)
    assert err.reason is Reason.WRITER_FAILED


@pytest.mark.parametrize("partial", [False, True])
def test_enospc_on_write_fails_the_step_and_keeps_earlier_records(tmp_path: Any,
                                                                  partial: bool) -> None:
    F = failing_factory(write_at=5, partial=partial)
    w = AsyncLogWriter(tmp_path / "log", file_factory=F)
    F.armed = True
    futs = [append_step(w, s) for s in range(1, 5)]
    assert [f.result(10) for f in futs] == [1, 2, 3, 4]
    f5 = append_step(w, 5)
    with pytest.raises(CommitError) as ei:
        f5.result(10)
    _assert_names_step(ei.value, 5)
    assert "step 5 is not durable" in str(ei.value)
    cause = ei.value.__cause__
    assert isinstance(cause, StorageError)
    assert cause.errno == errno.ENOSPC
    assert w.durable_step == 4
    with pytest.raises(CommitError) as ei2:
        append_step(w, 6)
    _assert_names_step(ei2.value, 5)
    with pytest.raises(CommitError):
        w.flush()
    w.close()  # already reported by append/flush: closes quietly and releases the lock
    w.close()
    with pytest.raises(WriterClosedError):
        append_step(w, 6)
    with LogReader(tmp_path / "log") as r:
        assert list(r.steps) == [1, 2, 3, 4]
        for s in range(1, 5):
            check_step(r, s)
        assert r.report.clean  # a partial record is a torn tail (or already cut), no error
    with AsyncLogWriter(tmp_path / "log") as w2:  # the lock is free; the torn tail is cut
        assert w2.durable_step == 4
        append_step(w2, 5).result(10)
    with LogReader(tmp_path / "log") as r:
        assert list(r.steps) == [1, 2, 3, 4, 5]
        check_step(r, 5)


def test_fsync_error_fails_the_group_and_close_raises_once(tmp_path: Any) -> None:
    F = failing_factory(sync_at=3, err=errno.EIO)
    w = AsyncLogWriter(tmp_path / "log", batch=2, max_delay_s=60, file_factory=F)
    F.armed = True
    futs = [append_step(w, s) for s in range(1, 7)]
    assert [f.result(10) for f in futs[:4]] == [1, 2, 3, 4]
    for f in futs[4:]:
        with pytest.raises(CommitError) as ei:
            f.result(10)
        _assert_names_step(ei.value, 5)
        assert isinstance(ei.value.__cause__, StorageError)
        assert ei.value.__cause__.errno == errno.EIO
    assert w.durable_step == 4
    with pytest.raises(CommitError) as ei:
        w.close()
    _assert_names_step(ei.value, 5)
    w.close()  # raised once
    with LogReader(tmp_path / "log") as r:
        steps = list(r.steps)
        # 5 and 6 were written but never reported durable: they may survive, intact
        assert steps[:4] == [1, 2, 3, 4]
        assert steps in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6])
        for s in steps:
            check_step(r, s)


def test_appends_queued_behind_a_failure_all_fail(tmp_path: Any) -> None:
    gate = threading.Event()

    class GatedFailing(AppendFile):
        def _writev(self, fd: int, chunks: Sequence[Buffer]) -> int:
            if _is_segment(self.path) and self.size > 0:
                gate.wait(scaled(60))  # (a hang bound: the test opens it)
                raise OSError(errno.EACCES, "denied")
            return super()._writev(fd, chunks)

    w = AsyncLogWriter(tmp_path / "log", file_factory=GatedFailing)
    futs = [append_step(w, s) for s in range(1, 6)]
    gate.set()
    for s, f in zip(range(1, 6), futs, strict=True):
        with pytest.raises(CommitError) as ei:
            f.result(10)
        _assert_names_step(ei.value, 1)
        assert f"step {s} is not durable" in str(ei.value)
    with pytest.raises(CommitError):
        w.close()
    with LogReader(tmp_path / "log") as r:
        assert len(r.steps) == 0


def test_encoding_error_poisons_after_committing_the_records_before_it(tmp_path: Any) -> None:
    with AsyncLogWriter(tmp_path / "log", batch=10, max_delay_s=60) as w:
        f1 = append_step(w, 1)
        f2 = append_step(w, 2)
        bad = TensorSpec("q", "F32", np.ones(10, np.float32), codec="q8",
                         options={"block": -3})
        f3 = w.append(3, [bad], kind="grad")
        assert (f1.result(10), f2.result(10)) == (1, 2)
        with pytest.raises(CommitError) as ei:
            f3.result(10)
        _assert_names_step(ei.value, 3)
        assert isinstance(ei.value.__cause__, LowdiffError)
        with pytest.raises(CommitError):
            append_step(w, 4)
    with LogReader(tmp_path / "log") as r:
        assert list(r.steps) == [1, 2]


@pytest.mark.timeout(30)
def test_a_bug_in_the_committer_fails_waiters_instead_of_hanging(tmp_path: Any) -> None:
    w = AsyncLogWriter(tmp_path / "log")

    def broken(*a: Any) -> None:
        raise RuntimeError("bug")

    w._commit = broken  # type: ignore[method-assign]
    append_step(w, 1)
    with pytest.raises(CommitError) as ei:
        w.flush()
    assert isinstance(ei.value.__cause__, RuntimeError)
    w.close()


def test_invalid_input_raises_in_append_and_leaves_the_writer_usable(tmp_path: Any) -> None:
    with AsyncLogWriter(tmp_path / "log") as w:
        append_step(w, 1)
        with pytest.raises(ConfigError) as ei:
            append_step(w, 1)
        assert ei.value.reason is Reason.STEP_OUT_OF_ORDER
        with pytest.raises(FormatError):
            w.append(2, [TensorSpec("a", "F32", np.zeros(3, np.float64))], kind="g")
        with pytest.raises(ConfigError):
            w.append(2, [TensorSpec("a", "F32")], kind="g")
        with pytest.raises(ConfigError):
            w.append(2, [TensorSpec("a", "F32", np.zeros(3, np.float32)),
                         TensorSpec("a", "F32", np.zeros(3, np.float32))], kind="g")
        with pytest.raises(ConfigError):
            enc = codecs.encode_sparse(np.array([1]), np.ones(1, np.float32), 4, "F32")
            w.append(2, [TensorSpec("a", "F32", encoded=enc)], kind="g")
        with pytest.raises(ConfigError):
            append_step(w, 2, extra={"x": object()})
        with pytest.raises(LowdiffError):
            w.append(2, [TensorSpec("a", "NOPE", np.zeros(3, np.float32))], kind="g")
        with pytest.raises(ConfigError) as ei:
            w.append(2, [TensorSpec("a", "F32", np.zeros(3, np.float32), codec="zip")],
                     kind="g")
        assert ei.value.reason is Reason.UNKNOWN_CODEC
        with pytest.raises(ConfigError):
            w.append(2, [TensorSpec("a", "F32", np.zeros(3, np.float32), codec="xor")],
                     kind="g")
        assert w.stats()["staged_bytes"] <= 4096
        append_step(w, 2)
        assert w.flush() == 2


def test_constructor_validates_tunables(tmp_path: Any) -> None:
    for kw in ({"batch": 0}, {"max_batch_bytes": 0}, {"max_delay_s": -1},
               {"memory_budget": 0}):
        with pytest.raises(ConfigError):
            AsyncLogWriter(tmp_path / "log", **kw)


def test_close_is_idempotent_and_append_after_close_raises(tmp_path: Any) -> None:
    w = AsyncLogWriter(tmp_path / "log")
    append_step(w, 1)
    w.close()
    w.close()
    assert w.durable_step == 1
    with pytest.raises(WriterClosedError):
        append_step(w, 2)
    with pytest.raises(WriterClosedError):
        w.flush()
    with AsyncLogWriter(tmp_path / "log") as w2:  # lock released
        assert (w2.last_step, w2.durable_step) == (1, 1)


# ---------------------------------------------------------------------------- bases, meta, history

def test_bases_interleave_with_diffs(tmp_path: Any) -> None:
    state = {"w": ("F32", np.arange(100, dtype=np.float32))}
    with AsyncLogWriter(tmp_path / "log", batch=4, max_delay_s=60) as w:
        b0 = w.write_base(0, state, {"opt": "adam"})
        for s in range(1, 6):
            append_step(w, s)
        # base at the step just appended: must not overtake the diffs still queued
        b5 = w.write_base(5, {"w": ("F32", state["w"][1])}, owned=False)
        state["w"][1][:] = -1  # staged: the base keeps the values of the call
        assert b0.result(10) > 0
        assert b5.result(10) > 0
        assert w.durable_step == 5
        append_step(w, 6)
        w.flush()
        assert w.stats()["bases"] == 2
        with pytest.raises(ConfigError):
            w.write_base(5, state)
        with pytest.raises(ConfigError) as ei:
            w.write_base(7, {"__lowdiff__.meta": ("U8", np.zeros(1, np.uint8))})
        assert ei.value.reason is Reason.UNSAFE_NAME
        append_step(w, 7, sync=True).result(10)  # still usable
    with LogReader(tmp_path / "log") as r:
        assert r.bases == [0, 5]
        assert list(r.steps) == list(range(1, 8))
        with r.base(5) as b:
            assert np.array_equal(b.tensor("w"), np.arange(100, dtype=np.float32))
        with r.base(0) as b:
            assert b.meta() == {"opt": "adam"}
        assert r.chain(6) == (5, [6])


def test_base_waits_for_the_diffs_appended_before_it(tmp_path: Any) -> None:
    gate = threading.Event()
    with AsyncLogWriter(tmp_path / "log", file_factory=gated_factory(gate)) as w:
        fd = [append_step(w, s) for s in (1, 2)]
        fb = w.write_base(2, {"w": ("F32", np.zeros(4, np.float32))})
        time.sleep(0.2)  # a base that did not wait would be published by now
        assert not fb.done()
        gate.set()
        assert [f.result(10) for f in fd] == [1, 2]
        assert fb.result(10) > 0
        append_step(w, 3).result(10)
    with LogReader(tmp_path / "log") as r:
        assert list(r.steps) == [1, 2, 3]
        assert r.bases == [2]


def test_initial_base_makes_its_step_durable(tmp_path: Any) -> None:
    seen: list[int] = []
    with AsyncLogWriter(tmp_path / "log", on_durable=seen.append) as w:
        w.write_base(0, {"w": ("F32", np.zeros(4, np.float32))}).result(10)
        assert w.durable_step == 0
        assert w.last_step == 0
        append_step(w, 1).result(10)
    assert seen == [0, 1]


def test_base_failure_poisons_the_writer(tmp_path: Any, monkeypatch: Any) -> None:
    import lowdiff_store.log.writer as logwriter

    def no_space(*a: Any, **k: Any) -> int:
        raise StorageError("write failed: No space left on device", path=str(tmp_path))

    with AsyncLogWriter(tmp_path / "log") as w:
        append_step(w, 1).result(10)
        monkeypatch.setattr(logwriter, "store_base", no_space)
        fb = w.write_base(1, {"w": ("F32", np.zeros(4, np.float32))})
        with pytest.raises(CommitError) as ei:
            fb.result(10)
        _assert_names_step(ei.value, 1)
        with pytest.raises(CommitError):
            append_step(w, 2)
    with LogReader(tmp_path / "log") as r:
        assert list(r.steps) == [1]
        assert r.bases == []


def test_truncate_after_and_append_again(tmp_path: Any) -> None:
    with AsyncLogWriter(tmp_path / "log", batch=3) as w:
        for s in range(1, 11):
            append_step(w, s)
        assert w.truncate_after(6) == 4
        assert (w.last_step, w.durable_step) == (6, 6)
        with pytest.raises(ConfigError):
            append_step(w, 6)
        append_step(w, 7).result(10)
    with LogReader(tmp_path / "log") as r:
        assert list(r.steps) == list(range(1, 8))
        check_step(r, 7)


def test_update_meta_and_reopen(tmp_path: Any) -> None:
    with AsyncLogWriter(tmp_path / "log", meta={"model": "m"}) as w:
        append_step(w, 1)
        w.update_meta({"world_size": 1})
    with LogReader(tmp_path / "log") as r:
        assert r.meta == {"model": "m", "world_size": 1}
    with AsyncLogWriter(tmp_path / "log") as w:
        assert (w.last_step, w.durable_step) == (1, 1)
        append_step(w, 2).result(10)


def test_stats_has_the_tuner_keys(tmp_path: Any) -> None:
    with AsyncLogWriter(tmp_path / "log", batch=2) as w:
        for s in range(1, 5):
            append_step(w, s)
        w.flush()
        st = w.stats()
    for k in ("stage_s", "encode_s", "write_s", "fsync_s", "bytes", "records", "batches",
              "blocked_s", "staged_bytes_peak", "last_batch_records"):
        assert k in st
    assert st["records"] == 4
    assert st["batches"] == 2
    assert st["bytes"] > 4 * 1200
    assert st["fsync_s"] > 0
    assert st["durable_step"] == 4
