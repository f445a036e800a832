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
