"""Compressor state across the resharding engine (:mod:`lowdiff_store.torch.distributed.reshard`).

A compressor's error-feedback residuals (TopK's, DeMo's momenta in a one-process job) are
per parameter and shaped like it: the engine replays them with each shard and assembles
them like optimizer state, so a restore through it is exact and training continued from it
is bitwise the uninterrupted run. What cannot be carried is said: DeMo momenta of a
multi-rank log (each rank's own), residuals into FSDP2 parameters, DDP hook state.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _cases import assert_same, build, ckpt_kwargs, reference, run, snapshot

from lowdiff_store.log import LogReader
from lowdiff_store.torch import DiffCheckpointer
from lowdiff_store.torch.distributed.reshard import Replayed, Source, residuals_of, restore_pieces
from lowdiff_store.torch.replay.engine import RestoreResult, log_meta


@pytest.mark.parametrize("case", ["topk_ef_step", "demo"])
def test_residuals_carried_bitwise_through_the_engine(case: str, tmp_path: Any) -> None:
    _, ref = reference(case, 30, at=(16,))
    path = tmp_path / "log"
    o = build(case)
    extra = o.extra
    ck = DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                          compressor=o.compressor, extra_state=lambda: dict(extra),
                          **ckpt_kwargs(case))
    run(case, o, 0, 17, ck)
    del ck, o   # crash: step 17 never completed
    gc.collect()

    o2 = build(case)
    with LogReader(path) as reader:
        src = Source(str(path), [reader], [log_meta(reader)], "single")
        res, _job, residuals = restore_pieces(src, 0, 1, o2.model, o2.optimizer,
                                              scheduler=o2.scheduler, scaler=None,
                                              step=None, verify=True)
    assert res.step == 16
    assert res.exact, res.notes
    assert residuals
    assert set(residuals) <= set(o2.model.parameters())
    assert_same(snapshot(o2), ref[16])
    o2.compressor.residuals = residuals
    o2.compressor.attach(o2.optimizer)
    run(case, o2, 16, 30)   # continued with the carried residuals: the same bits
    assert_same(snapshot(o2), ref[30])


def test_rank_local_momenta_are_not_carried() -> None:
    """DeMo momenta of a 2-rank log: each rank's own, so not carried (exact=False, said)."""
    w = torch.nn.Parameter(torch.zeros(4, 2))
    src = SimpleNamespace(world=2, metas=[SimpleNamespace(compressor=SimpleNamespace(
                          kind="demo"))], pieces={"w": []})
    rep = Replayed()
    rep.residuals[(0, "w")] = torch.ones(4, 2)
    res = RestoreResult(step=3, base_step=0, replayed=3)
    box = ((0, 0), (4, 2))
    assert residuals_of(src, rep, ["w"], [w], {"w": box}, res) is None  # type: ignore[arg-type]
    assert not res.exact
    assert "demo compressor residuals, not carried" in res.notes[0]
    assert "each rank's own" in res.notes[0]
