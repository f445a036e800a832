"""Ring 2.0's batches (``format_spec/ring.md`` section 3.1) without torch: a DIFF whose
tensors the writer process encodes from a step batch's flat buffers by their recipes, the
record equal byte for byte to the one the codecs make from the same arrays in this
process; every field of a batch checked before it is read through; META messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogReader, codecs
from lowdiff_store.codecs.batch import bases_of
from lowdiff_store.errors import FormatError, LowdiffError, Reason
from lowdiff_store.writer.ring import (
    Ring,
    RingBatch,
    RingTensor,
    layout_diff,
    read_message,
    write_message,
)
from lowdiff_store.writer.ring_client import RingClient


def _topk_batch(rng: np.random.Generator, numels: list[int], k: int
                ) -> tuple[RingBatch, list[tuple[np.ndarray, np.ndarray, int]]]:
    """A batch of top-k pairs of tensors of ``numels`` as a CPU step lays them out (indices
    unsorted, sorted by the writer with the bases added: one ``sorts`` group) and the pairs
    themselves."""
    pairs = []
    keys, vals = [], []
    for n in numels:
        idx = rng.choice(n, size=k, replace=False).astype(np.int64)
        v = rng.standard_normal(k).astype(np.float32)
        pairs.append((idx, v, n))
        keys.append(idx)
        vals.append(v)
    rb = RingBatch(buffers=[("I64", np.concatenate(keys)), ("F32", np.concatenate(vals))])
    lay = [(n, k) for n in numels]
    rb.sorts.append((0, 1, lay))
    rb.layouts.append((0, lay))
    for i, (n, base) in enumerate(zip(numels, bases_of(numels), strict=True)):
        rb.recipes.append((i, f"g{i}", "F32", [n], None, "topk",
                           [[[0, i * k, k], [1, i * k, k], int(base), True]], [n, "F32"]))
    return rb, pairs


def test_the_writer_process_encodes_a_batch_as_the_codecs_do(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    numels = [97, 4000, 13, 70000]
    with RingClient(tmp_path / "log", slots=8, slot_size=1 << 16) as c:
        c.put_base(0, {"w": ("F32", np.zeros(4, np.float32))})
        for step in (1, 2):
            rb, pairs = _topk_batch(rng, numels, 8)
            extra = RingTensor.raw("side", "U8", [3], np.arange(3, dtype=np.uint8))
            rb.recipes = [(r[0] + 1, *r[1:]) for r in rb.recipes]  # the raw tensor first
            c.put_step(step, "grad", [extra], batch=rb)
            want = [codecs.encode_sparse(np.sort(i), v[np.argsort(i)], n, "F32", delta=True)
                    for i, v, n in pairs]
            c.flush()
            with LogReader(tmp_path / "log") as r:
                rec = r.record(step)
                assert rec.names == ["side", "g0", "g1", "g2", "g3"]
                for j, w in enumerate(want):
                    got = rec.parts(f"g{j}")
                    assert [p.tobytes() for p in got] == [
                        np.ascontiguousarray(p.data).tobytes() for p in w.parts]
                    assert rec.entry(f"g{j}").params == dict(w.params)
                assert rec.parts("side")[0].tolist() == [0, 1, 2]
        assert c.durable_step == 2


def test_a_batch_with_a_bad_index_fails_with_the_codecs_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    rb, _pairs = _topk_batch(rng, [50, 60], 4)
    rb.buffers[0][1][5] = 10**6  # an index past its tensor: the codec's own refusal
    c = RingClient(tmp_path / "log", slots=4, slot_size=1 << 16)
    c.put_base(0, {"w": ("F32", np.zeros(4, np.float32))})
    c.put_step(1, "grad", [], batch=rb)
    with pytest.raises(LowdiffError) as ei:
        c.flush()
    assert ei.value.reason is Reason.WRITER_FAILED  # (step 1 is not durable) because
    cause = ei.value.__cause__                      # of the codec's own refusal
    assert isinstance(cause, LowdiffError)
    assert cause.reason is Reason.BAD_CODEC_PARAMS
    assert "sparse index out of range [0, 60)" in str(ei.value)
    c.close()  # (raised once: close does not raise it again)
    with LogReader(tmp_path / "log") as r:
        assert list(r.steps) == []  # nothing of step 1 reached the log
        assert r.bases == [0]


def _read_batch(rb: RingBatch, tensors: list[RingTensor] | None = None) -> Any:
    ring, fd = Ring.create(4, 1 << 16)
    try:
        write_message(ring, 0, layout_diff(1, "grad", tensors or [], batch=rb))
        return read_message(ring, 0).batch
    finally:
        import os

        os.close(fd)
        ring.close()


def test_a_batch_is_read_back_as_written() -> None:
    rb, _p = _topk_batch(np.random.default_rng(5), [10, 20], 3)
    b = _read_batch(rb)
    assert [(p.dtype, p.length) for p in b.buffers] == [("I64", 48), ("F32", 24)]
    assert b.sorts == ((0, 1, ((10, 3), (20, 3))),)
    assert [r.name for r in b.recipes] == ["g0", "g1"]
    assert b.recipes[1].slots[0].values == (1, 3, 3)
    assert b.recipes[1].params == (20, "F32")


def _broken(edit: str) -> RingBatch:
    rb, _p = _topk_batch(np.random.default_rng(6), [10, 20], 3)
    r0 = list(rb.recipes[0])
    if edit == "slot past its buffer":
        r0[6] = [[[0, 5, 3], [1, 0, 3], 1, True]]  # 5 + 3 > 6 elements
    elif edit == "unknown op":
        r0[5] = "gzip"
    elif edit == "same place twice":
        r0[0] = 1
    elif edit == "numel not the shape's":
        r0[7] = [11, "F32"]
    elif edit == "sort of a float buffer":
        rb.sorts = [(1, 0, [(10, 3), (20, 3)])]
    elif edit == "layout sum":
        rb.sorts = [(0, 1, [(10, 3), (20, 4)])]
    elif edit == "buffer index":
        r0[6] = [[[7, 0, 3], [1, 0, 3], 1, True]]
    rb.recipes[0] = tuple(r0)
    return rb


@pytest.mark.parametrize(("edit", "reason"), [
    ("slot past its buffer", Reason.OUT_OF_BOUNDS), ("unknown op", Reason.BAD_METADATA),
    ("same place twice", Reason.BAD_METADATA), ("numel not the shape's", Reason.BAD_METADATA),
    ("sort of a float buffer", Reason.BAD_METADATA), ("layout sum", Reason.BAD_METADATA),
    ("buffer index", Reason.BAD_METADATA)])
def test_a_bad_batch_is_refused_naming_the_slot(edit: str, reason: Reason) -> None:
    with pytest.raises(FormatError) as ei:
        _read_batch(_broken(edit))
    assert ei.value.reason is reason
    assert "ring slot 0" in str(ei.value)
    assert ei.value.offset == 4096 + 64  # the table of slot 0


def test_meta_truncates_merges_and_sets_the_group_size(tmp_path: Path) -> None:
    with RingClient(tmp_path / "log", slots=4, slot_size=1 << 16, batch=1) as c:
        c.put_base(0, {"w": ("F32", np.zeros(4, np.float32))})
        for s in range(1, 6):
            c.put_step(s, "grad", [("g", "F32", [2], np.full(2, s, np.float32))])
        c.flush()
        assert c.published_base == 0
        assert c.put_meta(truncate_after=3) == 2
        assert (c.last_step, c.durable_step) == (3, 3)
        c.put_meta(meta={"note": "kept"}, batch=4)
        c.put_step(4, "grad", [("g", "F32", [2], np.full(2, 40, np.float32))])
        assert c.flush() == 4
        assert c.writer_stats()["records"] >= 6
    with LogReader(tmp_path / "log") as r:
        assert list(r.steps) == [1, 2, 3, 4]
        assert r.record(4).parts("g")[0].tolist() == [40.0, 40.0]
        assert r.meta["note"] == "kept"
