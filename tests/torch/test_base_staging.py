"""Bases copied beside the next forward and backward (issue 24, item 1): each base is still
exactly the state after its step, whatever runs between the base step and the next optimizer
step; a tensor changed in place meanwhile drops the base (never a mixed state on disk); the
staging memory is reused, kept within its budget, and a base it cannot hold yet is put off,
never waited for."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from lowdiff_store.errors import ConfigError
from lowdiff_store.format.checksum import crc32c
from lowdiff_store.format.constants import BASE_NAME
from lowdiff_store.log import LogReader
from lowdiff_store.log.base import BaseFile
from lowdiff_store.log.writer import LogWriter
from lowdiff_store.torch import DiffCheckpointer, restore
from lowdiff_store.torch.capture.bases.copy import (
    CopyJob,
    StagingArea,
    new_slot,
    plan_pieces,
    populate,
)

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

State = dict[str, np.ndarray]


def objects(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def loss_of(model: torch.nn.Module, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + t)
    x = torch.randn(8, 16, generator=g)
    return model(x).pow(2).mean()


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> State:
    """Bits of the model and the AdamW moments, by base tensor name."""
    out = {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"@opt/{names[id(p)]}/{k}"] = v.detach().numpy().copy()
    return out


def base_state(path: Any, step: int) -> State:
    """The tensors of the base of ``step`` (model and optimizer state) as written."""
    assert step in bases(path)
    b = BaseFile(os.path.join(path, BASE_NAME.format(step)))
    try:
        return {n: np.array(b.tensor(n)) for n in b.names
                if not n.startswith("@") or n.startswith("@opt/")}
    finally:
        b.close()


def same(a: State, b: State) -> None:
    assert sorted(a) == sorted(b)
    for n in a:
        assert (a[n].dtype, a[n].shape) == (b[n].dtype, b[n].shape), n
        assert a[n].tobytes() == b[n].tobytes(), n


def bases(path: Any) -> list[int]:
    with LogReader(path) as r:
        return list(r.bases)


Hook = Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]


def base_ready(ckpt: Any) -> None:
    """Wait until the last base is written and the staging memory asked for is made (on
    the helper thread), so the next base is taken on time rather than put off."""
    ckpt.flush()
    assert ckpt._out.stager.area.wait_made(60)


def train(path: Any, steps: int, *, every: int = 2, between: Hook | None = None,
          step_fn: Hook | None = None, ready: bool = True, **kw: Any
          ) -> tuple[dict[int, State], torch.nn.Module, torch.optim.Optimizer, Any]:
    """Train ``steps`` steps under a checkpointer (``step_fn(t, model, optimizer)``
    instead of the plain step); the state after each step, as the loop saw it right after
    ``optimizer.step()`` (before ``between(t, model, optimizer)`` runs). ``ready``: before
    each base step, wait until the staging memory is made (on the helper thread) and the
    previous base is written, so every base is taken on time."""
    model, opt = objects()
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=every, **kw)
    seen = {0: state(model, opt)}
    for t in range(1, steps + 1):
        if step_fn is not None:
            step_fn(t, model, opt)
        else:
            opt.zero_grad()
            loss_of(model, t).backward()
            opt.step()
        seen[t] = state(model, opt)
        if between is not None:
            between(t, model, opt)
        if ready and (t + 1) % every == 0:  # the next base finds its memory free and made
            base_ready(ckpt)
    return seen, model, opt, ckpt


@pytest.mark.parametrize("staging", ["overlap", "sync"])
def test_every_base_is_the_state_after_its_step(tmp_path: Any, staging: str) -> None:
    path = tmp_path / "log"
    seen, _model, _opt, ckpt = train(path, 9, base_staging=staging)
    ckpt.close()
    assert bases(path) == [0, 2, 4, 6, 8]
    for t in bases(path):
        same(base_state(path, t), seen[t])
    st = ckpt.stats()
    assert st["base_dropped"] == 0
    assert st["base_deferred"] == 0
    assert st["base_staging_bytes"] > 0


def test_staging_memory_is_reused_across_bases(tmp_path: Any) -> None:
    path = tmp_path / "log"
    model, opt = objects()
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=2)
    area = ckpt._out.stager.area  # (the part under test)
    made = []
    for t in range(1, 13):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
        if t % 2:
            base_ready(ckpt)  # the last base is written: its memory is free again
        made.append(area.allocated)
    ckpt.flush()
    held = area.capacity, len(area._slots)
    ckpt.close()
    assert bases(path) == [0, 2, 4, 6, 8, 10, 12]
    # buffers for the state with its optimizer state, made (and touched) after the first
    # step, before the first base (a small state gets a spare for the next base); then
    # reused: none is made after the first bases
    assert made[3] <= 3
    assert made[-1] == made[3]
    assert held[1] <= 2
    assert held[0] >= sum(a.nbytes for a in base_state(path, 12).values())


@pytest.mark.parametrize("mode", ["grad", "delta"])
def test_an_in_place_edit_between_steps_drops_the_base_being_copied(
        tmp_path: Any, mode: str, caplog: Any) -> None:
    path = tmp_path / "log"

    def edit(t: int, model: Any, opt: Any) -> None:
        if t == 4:  # after the base step 4, before step 5: a user's in-place change
            with torch.no_grad():
                model[0].weight.mul_(0.5)

    with caplog.at_level(logging.WARNING):
        seen, _model, _opt, ckpt = train(path, 8, mode=mode, between=edit)
    ckpt.close()
    # base 4 would mix the states before and after the edit: dropped; step 5 takes one;
    # from then on bases are copied inside the step
    assert bases(path) == [0, 2, 5, 6, 8]
    assert "changed in place" in caplog.text
    assert "0.weight" in caplog.text
    for t in bases(path):
        same(base_state(path, t), seen[t])
    st = ckpt.stats()
    assert st["base_dropped"] == 1
    if mode == "delta":  # the edit is in step 5's diff: every step restores bitwise
        for t in (3, 5, 7, 8):
            m2, o2 = objects(1)
            res = restore(path, m2, o2, step=t)
            assert res.exact
            assert res.step == t
            same(state(m2, o2), seen[t])


def test_a_step_skipped_by_the_grad_scaler_after_a_base_step(tmp_path: Any) -> None:
    path = tmp_path / "log"
    model, opt = objects()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=2, scaler=scaler)
    seen = {}
    for t in range(1, 8):
        opt.zero_grad()
        loss = loss_of(model, t) * (float("inf") if t in (3, 5) else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)  # steps 3 and 5: skipped (inf gradients)
        scaler.update()
        seen[t] = state(model, opt)
        if t % 2:
            base_ready(ckpt)
    ckpt.close()
    assert bases(path) == [0, 2, 4, 6]
    for t in (2, 4, 6):
        same(base_state(path, t), seen[t])
    m2, o2 = objects(1)
    s2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    res = restore(path, m2, o2, scaler=s2)
    assert res.step == 7
    assert res.exact
    same(state(m2, o2), seen[7])


def test_closures_and_zero_grad_without_none(tmp_path: Any) -> None:
    path = tmp_path / "log"

    def step(t: int, model: Any, opt: Any) -> None:
        def closure() -> torch.Tensor:
            opt.zero_grad(set_to_none=False)  # gradients zeroed in place
            loss = loss_of(model, t)
            loss.backward()
            return loss

        opt.step(closure)

    seen, _model, _opt, ckpt = train(path, 7, step_fn=step)
    ckpt.close()
    assert bases(path) == [0, 2, 4, 6]
    for t in bases(path):
        same(base_state(path, t), seen[t])
    m2, o2 = objects(1)
    res = restore(path, m2, o2)
    assert res.step == 7
    assert res.exact
    same(state(m2, o2), seen[7])


def test_a_step_that_raises_after_a_base_step(tmp_path: Any) -> None:
    path = tmp_path / "log"
    model, opt = objects()
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=2)
    seen = {}
    t = 0
    for i in range(1, 9):
        def closure(i: int = i) -> torch.Tensor:
            opt.zero_grad()
            loss = loss_of(model, i)
            loss.backward()
            if i == 5:  # after the base of step 4: the step fails inside the optimizer
                raise RuntimeError("data loader failed")
            return loss

        try:
            opt.step(closure)
        except RuntimeError:
            continue  # the step did not happen: nothing changed
        t += 1
        seen[t] = state(model, opt)
        if t % 2:
            base_ready(ckpt)
    ckpt.close()
    assert t == 7
    assert bases(path) == [0, 2, 4, 6]
    for s in (2, 4, 6):
        same(base_state(path, s), seen[s])
    m2, o2 = objects(1)
    res = restore(path, m2, o2)
    assert res.step == 7
    assert res.exact
    same(state(m2, o2), seen[7])


def test_a_base_the_staging_memory_cannot_hold_yet_is_put_off(
        tmp_path: Any, monkeypatch: Any) -> None:
    """The base of step 2 is held in the writer (a slow disk): bases due meanwhile are put
    off, training goes on without waiting, and the first step after the memory is free
    takes the base."""
    gate = threading.Event()
    orig = LogWriter.write_base

    def slow(self: LogWriter, step: int, tensors: Any, meta: Any = None,
             crcs: Any = None) -> int:
        if step == 2:
            assert gate.wait(60), "training waited for the base write"
        return orig(self, step, tensors, meta, crcs)

    monkeypatch.setattr(LogWriter, "write_base", slow)
    path = tmp_path / "log"
    model, opt = objects()
    nbytes = sum(a.nbytes for a in state(model, opt).values())
    # AdamW: the moments double the state after the first step; room for one base only.
    # (Not exact_bases: those wait for a buffer still being written, see
    # test_staging_release.py.)
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=2,
                            staging_budget=int(3 * nbytes * 1.5))
    seen = {}
    for t in range(1, 11):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
        seen[t] = state(model, opt)
        if t == 1:  # the memory of step 2's base is made (on a loaded machine too)
            assert ckpt._out.stager.area.wait_made(60)
        if t == 7:
            gate.set()  # the disk catches up
        if t in (7, 9):
            ckpt.flush()
    ckpt.close()
    got = bases(path)
    assert got[:2] == [0, 2]
    assert 4 not in got
    assert 6 not in got
    assert got[2] == 8
    assert 10 in got
    for s in got:
        same(base_state(path, s), seen[s] if s else state(*objects()))
    assert ckpt.stats()["base_deferred"] >= 1


def test_a_staging_budget_smaller_than_a_base_is_refused(tmp_path: Any) -> None:
    model, opt = objects()
    with pytest.raises(ConfigError, match=r"staging_budget=64: raise staging_budget to at "
                                          r"least \d+"):
        DiffCheckpointer(tmp_path / "log", model, opt, staging_budget=64)
    for bad in (0, -1, 1.5, "1G"):
        with pytest.raises(ConfigError, match="staging_budget"):
            DiffCheckpointer(tmp_path / "log2", model, opt, staging_budget=bad)


def test_copy_job_pieces_are_shared_from_both_ends_and_versions_are_checked() -> None:
    src = np.random.default_rng(0).integers(0, 255, (40 << 20) + 5, dtype=np.uint8)
    dst = np.zeros_like(src)
    pieces = plan_pieces(src, dst)
    assert len(pieces) == 3  # 16 + 16 + 8 MiB and 5 bytes
    t = torch.zeros(3)
    job = CopyJob(pieces, [("t", t, t._version)], groups={"x": pieces})
    helper = threading.Thread(target=job.work)
    helper.start()
    assert job.settle()  # helps from the back, waits for the helper's piece
    helper.join()
    assert not job.pending
    assert np.array_equal(src, dst)
    assert job.crcs() == {"x": crc32c(src)}  # the pieces' CRCs, combined in order
    t.add_(1)
    job2 = CopyJob(plan_pieces(src, dst), [("t", t, t._version - 1)])
    assert not job2.settle()
    assert job2.changed == ["t"]


def test_staging_area_budget_and_reuse() -> None:
    """Buffers are made only by ``provide`` (the helper thread's job), asked for by
    ``want`` within the budget; ``acquire`` hands out a made buffer or None, never
    allocates."""
    area = StagingArea(budget=10_000)
    assert area.acquire(4000, pinned=False) is None  # nothing made yet: put off
    assert area.want(4000, pinned=False)
    assert not area.want(4000, pinned=False)  # (asked for already)
    area.provide()
    a = area.acquire(4000, pinned=False)
    assert a is not None
    assert a.touched
    assert a.capacity >= 4000
    assert area.want(4000, pinned=False)  # a second buffer fits the budget
    area.provide()
    b = area.acquire(4000, pinned=False)
    assert b is not None
    assert b is not a
    assert not area.want(4000, pinned=False)  # both busy, no room: put off
    assert area.acquire(4000, pinned=False) is None
    area.release(a)
    assert not area.want(4000, pinned=False)  # a free one fits
    assert area.acquire(4000, pinned=False) is a  # reused, not reallocated
    assert area.allocated == 2
    with pytest.raises(ConfigError, match="staging_budget=10000"):
        area.acquire(20_000, pinned=False)
    one = StagingArea()  # no budget: one buffer for a large state
    assert one.want(300 << 20, pinned=False)
    one.provide()
    assert one.acquire(300 << 20, pinned=False) is not None
    assert not one.want(300 << 20, pinned=False)
    assert one.acquire(300 << 20, pinned=False) is None


@pytest.mark.parametrize("staging", ["overlap", "sync"])
def test_digests_are_computed_beside_the_next_step_and_left_out_when_the_state_changed(
        tmp_path: Any, staging: str) -> None:
    """The digest of step t (every ``digest_every`` steps) is computed on the helper thread
    while step t+1's forward runs; when a parameter changed in place meanwhile, the record
    goes without a digest rather than with one of a state that is not step t's. With
    ``base_staging="sync"`` it is computed inside the step and always kept."""
    path = tmp_path / "log"

    def edit(t: int, model: Any, opt: Any) -> None:
        if t == 4:
            with torch.no_grad():
                model[3].bias.add_(1.0)

    _seen, _m, _o, ckpt = train(path, 6, every=100, between=edit, digest_every=1,
                                base_staging=staging)
    ckpt.close()
    with LogReader(path) as r:
        has = {t: "digest" in r.record(t).meta for t in range(1, 7)}
    # sync: computed inside step 4, before the edit, so it is step 4's and kept
    assert has == {1: True, 2: True, 3: True, 4: staging == "sync", 5: True, 6: True}
    m2, o2 = objects(1)
    res = restore(path, m2, o2, step=3)  # digests of the steps before the edit check out
    assert res.exact
    assert res.verified == [3]


def test_non_contiguous_and_bf16_tensors_are_staged_bit_for_bit(tmp_path: Any) -> None:
    """A non-contiguous parameter is copied at once (its bits view is already private);
    a bf16 one goes through the copy job as int16 bits. (Plain SGD keeps no state, so the
    staging memory is asked for at the first step, not at base 0, whose state may still
    grow: the base due at step 1 is put off to step 2.)"""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    with torch.no_grad():
        model.weight.set_(model.weight.detach().t().contiguous().t())  # non-contiguous
    model.bias.data = model.bias.data.to(torch.bfloat16)
    assert not model.weight.is_contiguous()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    path = tmp_path / "log"
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=1)
    seen = {}
    for t in range(1, 5):
        base_ready(ckpt)
        opt.zero_grad()
        model.weight.grad = torch.full_like(model.weight, 0.25 * t)
        model.bias.grad = torch.full_like(model.bias, 0.5 * t)
        opt.step()
        seen[t] = {"weight": model.weight.detach().contiguous().numpy().copy(),
                   "bias": model.bias.detach().view(torch.int16).numpy().copy()}
    ckpt.close()
    assert bases(path) == [0, 2, 3, 4]
    for t in (2, 3, 4):
        got = base_state(path, t)
        assert got["weight"].tobytes() == seen[t]["weight"].tobytes()
        assert got["bias"].view(np.int16).tobytes() == seen[t]["bias"].tobytes()


def test_touching_staging_memory_keeps_its_contents() -> None:
    """The first touch of a staging buffer (one madvise where Linux has it, else a write
    per page) faults the pages in without changing a byte already there."""
    area = StagingArea()
    slot = new_slot(3 << 20, pinned=False)
    slot.buf[:] = 7
    area.touch(slot)
    assert slot.touched
    assert populate(slot.buf) in (True, False)
    assert int(slot.buf.min()) == 7
    assert int(slot.buf.max()) == 7
