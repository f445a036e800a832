"""Streamed bases (issue 50): a base spread over k steps, one slice of the state per step,
and a restore that replays each tensor from its own slice's step, bit for bit."""

from __future__ import annotations

import os
from typing import Any

import pytest
from _cases import CASES, assert_same, build, ckpt_kwargs, reference, run, snapshot

from lowdiff_store.log import LogReader
from lowdiff_store.torch import DiffCheckpointer, restore

STEPS = 22


def _ckpt(path: Any, case: str, o: Any, **kw: Any) -> DiffCheckpointer:
    return DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                            compressor=o.compressor, extra_state=lambda: dict(o.extra),
                            **{**ckpt_kwargs(case), **kw})


def _restore(path: Any, o: Any, **kw: Any) -> Any:
    return restore(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler, **kw)


STREAMED = CASES


@pytest.mark.parametrize("case", STREAMED)
def test_restore_from_a_streamed_base_is_bitwise(case: str, tmp_path: Any) -> None:
    at = tuple(range(1, STEPS + 1))
    _, ref = reference(case, STEPS, at=at)
    path = tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, snapshot_every=6, base_slices=3) as ckpt:
        run(case, o, 0, STEPS, ckpt)
        stats = ckpt.stats()
    with LogReader(path) as r:
        assert r.bases == [0]
        assert r.streamed == [(6, (4, 5, 6)), (12, (10, 11, 12)), (18, (16, 17, 18))]
        names = sorted(os.listdir(path))
    assert [n for n in names if n.startswith("slice-")] == [
        f"slice-{s:016d}.safetensors" for s in (4, 5, 6, 10, 11, 12, 16, 17, 18)]
    # the slice after step 22 began the base of step 24: never complete, removed at close
    assert stats["base_slices"] == 10
    assert stats["bases"] == 4
    for t in (3, 5, 6, 7, 11, 12, 17, 19, STEPS):
        o2 = build(case)
        res = _restore(path, o2, step=t)
        assert res.step == t
        want = max(b for b in (0, 6, 12, 18) if b <= t)
        assert res.base_step == want
        assert res.base_slices == ([] if want == 0 else [want - 2, want - 1, want])
        assert res.exact
        assert_same(snapshot(o2), ref[t])


@pytest.mark.parametrize("case", ["adamw", "topk_ef_step"])
def test_streamed_bases_through_the_writer_process(case: str, tmp_path: Any) -> None:
    _, ref = reference(case, 14, at=(9, 13, 14))
    path = tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, snapshot_every=5, base_slices=3, writer_process=True) as ckpt:
        run(case, o, 0, 14, ckpt)
    with LogReader(path) as r:
        assert r.streamed == [(5, (3, 4, 5)), (10, (8, 9, 10))]
    assert not [n for n in os.listdir(path) if n.startswith("slice-0000000000000013")]
    for t in (9, 13, 14):
        o2 = build(case)
        res = _restore(path, o2, step=t)
        assert (res.base_step, res.exact) == (5 if t < 10 else 10, True)
        assert_same(snapshot(o2), ref[t])
