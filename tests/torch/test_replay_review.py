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


def _pieces_source(tmp_path: Any, boxes: list[list[tuple[str, tuple[int, ...],
                                                            tuple[int, ...]]]]) -> Any:
    """A 2-shard FSDP2 :class:`Source` over the ``sgd_bn`` log's model whose shards hold
    ``boxes`` (``net.0.weight`` is [32, 8]; every other parameter whole on shard 0)."""
    from lowdiff_store.torch.distributed.reshard import ShardFacts, Source
    from lowdiff_store.torch.replay.engine import log_meta

    path = logged(tmp_path / "log")
    with LogReader(path) as r:
        meta = log_meta(r)
    rest = tuple((n, (0,) * len(s), tuple(s)) for n, _t, s in meta.model
                 if n not in meta.buffers and n != "net.0.weight")
    facts = [ShardFacts(LAST, (0, 3, 6), "grad", (*tuple(b), *(rest if s == 0 else ())))
             for s, b in enumerate(boxes)]
    return Source(path, [None, None], [meta, meta], "fsdp", facts=facts)  # type: ignore[list-item]


@pytest.mark.parametrize("boxes", [
    pytest.param([[("net.0.weight", (0, 0), (16, 8))], [("net.0.weight", (0, 0), (16, 8))]],
                 id="both_shards_the_same_half"),
    pytest.param([[("net.0.weight", (0, 0), (20, 8))], [("net.0.weight", (8, 0), (12, 8))]],
                 id="overlap_hiding_a_gap"),
    pytest.param([[("net.0.weight", (0, 0), (16, 8))], [("net.0.weight", (16, 0), (8, 8))]],
                 id="a_gap"),
])
def test_pieces_that_do_not_tile_their_tensor_are_refused(tmp_path: Any,
                                                          boxes: Any) -> None:
    """Shards whose recorded pieces of a parameter overlap were cut together by counting
    elements: two pieces of the same half of a [32, 8] weight counted as the whole, and
    the other half of the restored parameter kept whatever the destination held (no
    error). Now bad_metadata naming the checkpoint and the parameter when the pieces do
    not tile the global tensor exactly."""
    with pytest.raises(LowdiffError) as e:
        _pieces_source(tmp_path, boxes)
    assert e.value.reason == Reason.BAD_METADATA
    assert "net.0.weight" in str(e.value)
    assert e.value.path == str(tmp_path / "log")


def test_pieces_that_tile_their_tensor_are_cut_exactly(tmp_path: Any) -> None:
    """The same weight in two disjoint halves (the shard-0 half [0:20), the other [20:32))
    is assembled from both, every element from its own piece."""
    from lowdiff_store.torch.distributed.reshard import Replayed, assemble_value

    src = _pieces_source(tmp_path, [[("net.0.weight", (0, 0), (20, 8))],
                                    [("net.0.weight", (20, 0), (12, 8))]])
    rep = Replayed()
    rep.values[(0, "net.0.weight")] = torch.full((20, 8), 1.0)
    rep.values[(1, "net.0.weight")] = torch.full((12, 8), 2.0)
    out = torch.full((32, 8), -7.0)
    assemble_value(src, rep, "net.0.weight", ((0, 0), (32, 8)), out=out)
    assert torch.equal(out[:20], torch.full((20, 8), 1.0))
    assert torch.equal(out[20:], torch.full((12, 8), 2.0))


@pytest.mark.parametrize("case", ["sgd_bn", "delta"])
def test_replay_state_leaves_the_callers_rng_alone(tmp_path: Any, case: str) -> None:
    """``replay_state`` of one log set this process's RNG to the log's state at the step
    (a researcher inspecting a step in the middle of a run changed that run's dropout and
    shuffling from then on), where the sharded ``replay_state``, ``materialize`` and the
    per-replica replay leave it alone. Now one log too: the generator draws the numbers it
    would have drawn without the call."""
    path = delta_logged(tmp_path / "log") if case == "delta" else logged(tmp_path / "log")
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    replay_state(path, 5)
    assert torch.equal(torch.rand(4), want)
    # restore still puts the log's RNG state into the process (it resumes training)
    o = build(case)
    restore(path, o.model, o.optimizer, scheduler=o.scheduler, step=5)
    after_restore = torch.get_rng_state()
    ref = build(case)
    run(case, ref, 0, 5)
    assert torch.equal(after_restore, torch.get_rng_state())


def _replicated_copies(tmp_path: Any) -> str:
    """A 2-rank replicated checkpoint made of two runs of the same ``sgd_bn`` training (one
    log each, as every rank writes its own: digests at step 1000 only, none on the way),
    each rank owning half of the parameters, whose bases hold a CUDA generator state (all
    7s) besides the CPU one."""
    from lowdiff_store.log import write_base
    from lowdiff_store.log.base import BaseFile
    from lowdiff_store.log.manifest import update_manifest
    from lowdiff_store.log.shards import write_shards_manifest

    root = tmp_path / "ck"
    kw = {**ckpt_kwargs(CASE), "snapshot_every": 3, "digest_every": 1000}
    for rank in range(2):
        log = root / f"rank-{rank:05d}"
        o = build(CASE)
        with DiffCheckpointer(log, o.model, o.optimizer, scheduler=o.scheduler, **kw) as ck:
            run(CASE, o, 0, LAST, ck)
        with LogReader(log) as r:
            bases = list(r.bases)
            params, groups = list(r.meta["torch"]["params"]), list(r.meta["torch"]["groups"])
        for b in bases:
            bpath = str(log / f"base-{b:016d}.safetensors")
            with BaseFile(bpath) as bf:
                tensors = {n: (bf.info(n)[0], bf.tensor(n).copy()) for n in bf.names}
                meta, log_id = copy.deepcopy(bf.meta()), bf.log_id
            tensors["@rng/cuda/0"] = ("U8", np.full(16, 7, np.uint8))
            write_base(bpath, b, tensors, meta, log_id)
        owned = (params[:3], params[3:])[rank]
        shard = {"rank": rank, "world_size": 2, "layout": "replicated", "owned": owned,
                 "global_params": params, "global_groups": groups}

        def place(m: Any, s: dict[str, Any] = shard) -> None:
            m.meta["torch"]["shard"] = s

        update_manifest(log, place)
    write_shards_manifest(root, 2, layout="replicated")
    return str(root)


@pytest.mark.consistent_bases  # (its bases' steps)
@pytest.mark.parametrize("call", ["replay_state", "materialize"])
def test_sharded_replay_leaves_the_callers_cuda_rng_alone(tmp_path: Any, monkeypatch: Any,
                                                          call: str) -> None:
    """``replay_state`` of a sharded checkpoint and the per-rank materializer of its
    compaction replayed with the process's generators set to the log's and kept only the
    CPU one (``fork_rng(devices=[])``): on a machine with the log's CUDA device count, the
    caller's CUDA generators were left at the log's states. Now neither sets any
    generator (a CUDA machine is simulated: its generator calls are recorded)."""
    from lowdiff_store.torch.distributed.restore import shard_materializer

    root = _replicated_copies(tmp_path)
    names = set(build(CASE).model.state_dict())
    cuda_set: list[list[bytes]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda states: cuda_set.append([bytes(s.numpy()) for s in states]))
    torch.manual_seed(123)
    cpu = torch.get_rng_state()
    if call == "replay_state":
        state, _opt = replay_state(root, 5)
        assert set(state) == names
    else:
        tensors, _meta = shard_materializer(root)(0)(None, 5)
        assert tensors["@rng/cuda/0"][1].tolist() == [7] * 16   # the base holds it
    assert cuda_set == []
    assert torch.equal(torch.get_rng_state(), cpu)
