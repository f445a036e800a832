"""Correctness review of the writer: faults and accounting the rest of the suite misses
(each test failed before the fix it comes with)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lowdiff_store import LogReader, codecs
from lowdiff_store.errors import Reason, StorageError
from lowdiff_store.storage import AppendFile
from lowdiff_store.writer import AsyncLogWriter, TensorSpec
from lowdiff_store.writer.deferred import DeferredEncoding


class _Unanswered(AppendFile):
    """A segment whose ``flush`` (make durable *now*, an object store's upload) finds the
    store not answering ``fails`` times, as an ``s3://`` log's does in an outage; its
    ``sync`` works (the bytes are taken)."""

    fails = 0
    flushes = 0

    def flush(self) -> None:
        cls = type(self)
        cls.flushes += 1
        if cls.fails:
            cls.fails -= 1
            raise StorageError("the store does not answer", reason=Reason.STORE_UNAVAILABLE,
                               path=self.path)
        super().flush()


def _spec(v: float) -> list[TensorSpec]:
    return [TensorSpec("w", "F32", array=np.full(16, v, np.float32))]


def test_sync_true_in_a_store_outage_goes_on_like_flush(tmp_path: Path) -> None:
    # flush() in an outage takes the records with a sync and goes on (nothing is lost);
    # append(sync=True) must do the same, not fail the writer for an outage it survives.
    _Unanswered.fails, _Unanswered.flushes = 0, 0
    with AsyncLogWriter(tmp_path / "log", file_factory=_Unanswered) as w:
        assert w.append(1, _spec(1.0), kind="grad").result(timeout=60) == 1
        _Unanswered.fails = 1
        f2 = w.append(2, _spec(2.0), kind="grad", sync=True)
        assert f2.result(timeout=60) == 2
        assert _Unanswered.flushes >= 1  # the outage was met
        assert _Unanswered.fails == 0
        assert w.durable_step == 2
        assert w.append(3, _spec(3.0), kind="grad").result(timeout=60) == 3
        assert w.flush() == 3
    with LogReader(tmp_path / "log") as r:
        assert [int(s) for s in r.steps] == [1, 2, 3]
        assert [float(r.record(s).tensor("w")[0]) for s in (1, 2, 3)] == [1.0, 2.0, 3.0]


def test_deferred_bytes_count_when_the_other_arrays_are_empty(tmp_path: Path) -> None:
    # A record's deferred host bytes count in the budget whatever its other arrays hold;
    # an empty array beside them made the record cost nothing.
    gate = threading.Event()
    idx = np.array([1, 5], np.int64)
    vals = np.array([2.0, 3.0], np.float32)

    def later() -> codecs.Encoded:
        gate.wait(60)
        return codecs.encode_sparse(idx, vals, 8, "F32")

    released: list[int] = []
    w = AsyncLogWriter(tmp_path / "log")
    try:
        tensors: Sequence[TensorSpec] = [
            TensorSpec("empty", "F32", array=np.zeros(0, np.float32)),
            TensorSpec("g", "F32", encoded=DeferredEncoding(later, 4096), shape=(8,))]
        fut = w.append(1, tensors, kind="grad", on_release=lambda: released.append(1))
        assert w.stats()["staged_bytes"] == 4096  # held until the record is released
        gate.set()
        assert fut.result(timeout=60) == 1
        assert released == [1]
        assert w.stats()["staged_bytes"] == 0
    finally:
        gate.set()
        w.close()
    with LogReader(tmp_path / "log") as r:
        rec = r.record(1)
        assert rec.tensor("empty").shape == (0,)
        assert rec.tensor("g").tolist() == [0, 2.0, 0, 0, 0, 3.0, 0, 0]


def _gate_bases(w: AsyncLogWriter) -> threading.Event:
    """Hold every base of ``w`` before it is written until the returned event is set."""
    gate = threading.Event()
    write_base = w.log.write_base

    def held(*args: object, **kwargs: object) -> int:
        gate.wait(60)
        return write_base(*args, **kwargs)  # type: ignore[arg-type]

    w.log.write_base = held  # type: ignore[method-assign]
    return gate


def _base(v: float) -> dict[str, tuple[str, np.ndarray]]:
    return {"w": ("F32", np.full(16, v, np.float32))}


def test_durable_step_does_not_pass_a_base_not_yet_published(tmp_path: Path) -> None:
    # Base 0, then diff 1: diff 1 reaches the disk first. Until base 0 is published a crash
    # leaves nothing to restore from, so step 1 (appended after the base) is not durable.
    w = AsyncLogWriter(tmp_path / "log")
    gate = _gate_bases(w)
    try:
        base = w.write_base(0, _base(0.0))
        assert w.append(1, _spec(1.0), kind="grad").result(timeout=60) == 1  # its record
        with LogReader(tmp_path / "log") as r:  # what a crash now would leave
            assert [int(s) for s in r.steps] == [1]
            assert r.durable_step is None
        assert w.durable_step is None
        assert w.stats()["durable_step"] == -1
        gate.set()
        assert base.result(timeout=60) > 0
        assert w.flush() == 1
    finally:
        gate.set()
        w.close()


def test_diffs_after_a_pending_base_count_once_it_is_published(tmp_path: Path) -> None:
    # Base 5 stands in for steps 4 and 5, which have no diff (diffs 1-3 came from base 0):
    # diffs 6 and 7 are durable before it, but until it is published the log restores
    # only up to step 3, and durable_step says no more.
    seen: list[int] = []
    with AsyncLogWriter(tmp_path / "log", on_durable=seen.append) as w:
        w.write_base(0, _base(0.0)).result(timeout=60)
        for s in (1, 2, 3):
            w.append(s, _spec(float(s)), kind="grad")
        w.flush()
        gate = _gate_bases(w)
        try:
            base = w.write_base(5, _base(5.0))
            futs = [w.append(s, _spec(float(s)), kind="grad") for s in (6, 7)]
            assert [f.result(timeout=60) for f in futs] == [6, 7]
            with LogReader(tmp_path / "log") as r:
                assert r.durable_step == 3
            assert w.durable_step == 3
        finally:
            gate.set()
        assert base.result(timeout=60) > 0
        assert w.flush() == 7
        with LogReader(tmp_path / "log") as r:
            assert r.durable_step == 7
    assert seen == sorted(seen)
    assert seen[-1] == 7
    assert 6 not in seen  # never reported while base 5 was not published


def test_a_reopened_log_keeps_its_durable_step_while_a_base_is_written(tmp_path: Path
                                                                        ) -> None:
    with AsyncLogWriter(tmp_path / "log") as w:
        w.write_base(0, _base(0.0))
        for s in (1, 2):
            w.append(s, _spec(float(s)), kind="grad")
    with AsyncLogWriter(tmp_path / "log") as w:
        assert w.durable_step == 2
        gate = _gate_bases(w)
        try:
            base = w.write_base(2, _base(2.0))
            assert w.durable_step == 2
            assert w.append(3, _spec(3.0), kind="grad").result(timeout=60) == 3
            assert w.durable_step == 2  # base 2 not yet published: it stops before it
        finally:
            gate.set()
        assert base.result(timeout=60) > 0
        assert w.flush() == 3


def test_set_batch_closes_a_group_already_at_the_new_size(tmp_path: Path) -> None:
    # Three records wait in a group of up to 10 (for up to max_delay_s = 10 min); the
    # tuner lowers the batch to 2: the group is over the new size and must close now,
    # not when the next record or the delay comes.
    encoded = threading.Semaphore(0)

    def deferred(v: float) -> list[TensorSpec]:
        def encode() -> codecs.Encoded:
            encoded.release()  # (the encoder adds the item to its group right after)
            return codecs.encode_sparse(np.array([0], np.int64), np.array([v], np.float32),
                                        4, "F32")
        return [TensorSpec("g", "F32", encoded=DeferredEncoding(encode, 0), shape=(4,))]

    with AsyncLogWriter(tmp_path / "log", batch=10, max_delay_s=600) as w:
        futs = [w.append(s, deferred(float(s)), kind="grad") for s in (1, 2, 3)]
        for _ in range(3):  # the three are in the open group (or about to be)
            assert encoded.acquire(timeout=60)
        w.set_batch(2)
        assert [f.result(timeout=60) for f in futs] == [1, 2, 3]
        assert w.durable_step == 3
        assert w.stats()["batches"] == 1  # the three, in one group
        assert w.stats()["last_batch_records"] == 3


def test_truncate_after_a_bad_step_is_refused_and_the_writer_goes_on(tmp_path: Path
                                                                     ) -> None:
    import pytest

    from lowdiff_store.errors import ConfigError

    with AsyncLogWriter(tmp_path / "log") as w:
        w.write_base(0, _base(0.0))
        for s in (1, 2, 3):
            w.append(s, _spec(float(s)), kind="grad")
        for bad in ("2", 2.5, None):
            with pytest.raises(ConfigError, match="truncate_after"):
                w.truncate_after(bad)  # type: ignore[arg-type]
        assert w.last_step == 3  # nothing cut, nothing failed
        assert w.truncate_after(2) == 1
        assert w.append(3, _spec(30.0), kind="grad").result(timeout=60) == 3
    with LogReader(tmp_path / "log") as r:
        assert [int(s) for s in r.steps] == [1, 2, 3]
        assert float(r.record(3).tensor("w")[0]) == 30.0


def test_a_base_release_that_raises_is_counted_and_flush_returns(tmp_path: Path) -> None:
    # A raising on_release of a diff is logged and counted; a raising release of a base
    # skipped the base's bookkeeping, so flush and close waited for it forever.
    calls: list[int] = []

    def release() -> None:
        calls.append(1)
        raise RuntimeError("the caller's release failed")

    done = threading.Event()
    result: list[object] = []
    w = AsyncLogWriter(tmp_path / "log")

    def body() -> None:
        try:
            fut = w.write_base(0, _base(0.0), release=release)
            w.append(1, _spec(1.0), kind="grad")
            result.extend([w.flush(), fut.result(timeout=60)])
            w.close()
        except BaseException as e:  # (reported below)
            result.append(e)
        finally:
            done.set()

    threading.Thread(target=body, daemon=True).start()
    assert done.wait(60), "flush or close never returned"
    assert result[0] == 1
    assert isinstance(result[1], int)
    assert result[1] > 0  # the base's size: it was published
    assert calls == [1]
    assert w.stats()["callback_errors"] == 1
    with LogReader(tmp_path / "log") as r:
        assert r.bases == [0]
        assert r.durable_step == 1
