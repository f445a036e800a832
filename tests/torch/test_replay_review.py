"""Replay and restore review (2026-11): records and objects that do not fit each other give
one typed error naming the file, offset and step, never a state that is not training's.

Each crafted record is written through the log layer's own API (``LogWriter.append``), so
its CRC is valid: only replay's own checks can refuse it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _cases import build, ckpt_kwargs, run

from lowdiff_store import LowdiffError, Reason
from lowdiff_store.log import LogReader, LogWriter, tensor_input
from lowdiff_store.torch import DiffCheckpointer, replay_state, restore

CASE = "sgd_bn"
LAST, CRAFTED = 6, 7
Tensors = list[tuple[str, str, np.ndarray]]


def logged(path: Any) -> str:
    """A grad-mode log of 6 steps (SGD + BatchNorm + StepLR), bases every 3."""
    o = build(CASE)
    kw = {**ckpt_kwargs(CASE), "snapshot_every": 3}
    with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, **kw) as ck:
        run(CASE, o, 0, LAST, ck)
    return str(path)


def append_crafted(path: str, change: Callable[[Tensors], Tensors]) -> int:
    """Append step 7: step 6's tensors changed by ``change``, its side channel, no digest
    (a log written with ``digest_every`` > 1 has steps without one)."""
    with LogReader(path) as r:
        rec = r.record(LAST)
        tensors = [(n, rec.entry(n).dtype, rec.tensor(n).copy()) for n in rec.names]
        side = copy.deepcopy(rec.side)
    with LogWriter(path) as w:
        w.append(CRAFTED, [tensor_input(n, a, t) for n, t, a in change(tensors)],
                 kind="grad", side=side)
        w.sync()
    with LogReader(path) as r:
        return int(r.record(CRAFTED).offset)


def _renamed(old: str, new: str) -> Callable[[Tensors], Tensors]:
    return lambda ts: [(new if n == old else n, t, a) for n, t, a in ts]


def _added(name: str) -> Callable[[Tensors], Tensors]:
    return lambda ts: [*ts, (name, ts[0][1], ts[0][2])]


@pytest.mark.parametrize("change", [
    pytest.param(_renamed("@grad/net.0.weight", "@grad/ghost.weight"), id="renamed"),
    pytest.param(_added("@grad/ghost.weight"), id="extra"),
    pytest.param(_added("@grad/net.1.running_mean"), id="of_a_buffer"),
])
def test_a_gradient_of_no_parameter_is_refused(tmp_path: Any, change: Any) -> None:
    """A record whose gradient names no parameter of the log was replayed without it (the
    parameter it replaced not stepped, the result reported exact): now bad_metadata
    naming the record's file, offset and step, from restore and from replay_state."""
    path = logged(tmp_path / "log")
    offset = append_crafted(path, change)
    o = build(CASE)
    with pytest.raises(LowdiffError) as e:
        restore(path, o.model, o.optimizer, scheduler=o.scheduler, step=CRAFTED)
    assert e.value.reason == Reason.BAD_METADATA
    assert e.value.offset == offset
    assert e.value.path is not None
    assert "ghost.weight" in str(e.value) or "running_mean" in str(e.value)
    assert f"step {CRAFTED}" in str(e.value)
    assert all(p.grad is None for p in o.model.parameters())
    with pytest.raises(LowdiffError) as e2:
        replay_state(path, CRAFTED)
    assert e2.value.reason == Reason.BAD_METADATA
    assert e2.value.offset == offset
    # the steps before it are untouched and restore exactly
    o6 = build(CASE)
    assert restore(path, o6.model, o6.optimizer, scheduler=o6.scheduler, step=LAST).exact
    assert bits(o6.model) == bits(trained(LAST).model)


def trained(steps: int) -> Any:
    """The objects of an uninterrupted run of ``steps`` steps, without a checkpointer."""
    o = build(CASE)
    run(CASE, o, 0, steps)
    return o


def bits(model: torch.nn.Module) -> dict[str, bytes]:
    """Every tensor of the model's state, as bytes."""
    return {n: t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for n, t in model.state_dict().items()}


def delta_logged(path: Any) -> str:
    """A delta-mode log (lossless xor diffs) of 6 steps, bases every 3."""
    o = build("delta")
    kw = {**ckpt_kwargs("delta"), "snapshot_every": 3}
    with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, **kw) as ck:
        run("delta", o, 0, LAST, ck)
    return str(path)


@pytest.mark.parametrize(("codec", "shape"), [("q8", (1,)), ("q8", (1, 8)), ("q8", (8,)),
                                              ("xor", (1,))])
def test_a_weight_diff_of_another_shape_is_refused(tmp_path: Any, codec: str,
                                                   shape: tuple[int, ...]) -> None:
    """A lossy weight diff of another shape than its tensor was added with numpy
    broadcasting: a diff of shape [1] or [1, 8] moved every entry of the [32, 8] weight
    (the result reported exact). Now state_mismatch naming the record's file, offset, step
    and tensor, from restore and from replay_state."""
    path = delta_logged(tmp_path / "log")
    with LogReader(path) as r:
        side = copy.deepcopy(r.record(LAST).side)
    kw: dict[str, Any] = {"block": 256} if codec == "q8" else \
        {"ref": np.zeros(shape, np.float32)}
    with LogWriter(path) as w:
        w.append(CRAFTED, [tensor_input("net.0.weight", np.full(shape, 0.5, np.float32),
                                        "F32", codec, **kw)], kind="delta", side=side)
        w.sync()
    with LogReader(path) as r:
        offset = r.record(CRAFTED).offset
    o = build("delta")
    with pytest.raises(LowdiffError) as e:
        restore(path, o.model, o.optimizer, scheduler=o.scheduler, step=CRAFTED)
    assert e.value.reason == Reason.STATE_MISMATCH
    assert e.value.offset == offset
    assert "net.0.weight" in str(e.value)
    assert f"step {CRAFTED}" in str(e.value)
    with pytest.raises(LowdiffError) as e2:
        replay_state(path, CRAFTED)
    assert e2.value.reason == Reason.STATE_MISMATCH
    assert e2.value.offset == offset
    o6 = build("delta")
    assert restore(path, o6.model, o6.optimizer, scheduler=o6.scheduler, step=LAST).exact
    ref = build("delta")
    run("delta", ref, 0, LAST)
    assert bits(o6.model) == bits(ref.model)
