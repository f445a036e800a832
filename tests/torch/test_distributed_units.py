"""In-process unit tests of the distributed pieces (no process group needed): the
partition, the restore plan, the hook tee on fake buckets (fp16/bf16 round trip, fallbacks,
top-k, PowerSGD memory layout), the hook signature DDP checks, compaction retention."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from lowdiff_store.compaction.sharded import _keep_count
from lowdiff_store.errors import StepNotFoundError
from lowdiff_store.log.shardset import combine_digests
from lowdiff_store.torch import DiffCheckpointer, TopKAllGatherState, topk_allgather_hook
from lowdiff_store.torch.core.hook_records import narrow_decode, psgd_decode
from lowdiff_store.torch.core.tensors import same_bits
from lowdiff_store.torch.distributed.checkpointer import partition_by_bytes
from lowdiff_store.torch.distributed.restore import _plan
from lowdiff_store.torch.distributed.tee import Tee, hook_kind


def test_partition_by_bytes_is_deterministic_and_balanced() -> None:
    items = [("a", 100), ("b", 60), ("c", 50), ("d", 40), ("e", 10), ("f", 10)]
    parts = partition_by_bytes(items, 2)
    assert parts == partition_by_bytes(items, 2)
    assert sorted(n for p in parts for n in p) == sorted(n for n, _s in items)
    size = dict(items)
    loads = [sum(size[n] for n in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 10
    assert parts[0][0] == "a"                      # largest first, to rank 0
    for p in parts:                                # input order kept within a rank
        assert p == [n for n, _s in items if n in p]
    # more ranks than tensors: some ranks own nothing
    assert partition_by_bytes([("x", 4)], 3) == [["x"], [], []]
    # ties go to the lowest rank
    assert partition_by_bytes([("x", 4), ("y", 4)], 2) == [["x"], ["y"]]


def test_combine_digests_depends_on_order() -> None:
    assert combine_digests([1, 2]) != combine_digests([2, 1])
    assert combine_digests([1, 2]) == combine_digests([1, 2])


def test_plan_replicated_uses_a_base_common_to_all_shards() -> None:
    infos = [{"durable": 9, "bases": [0, 4, 8]}, {"durable": 8, "bases": [0, 4]}]
    assert _plan(infos, None, "replicated", "/x") == (8, [4, 4], 8)
    assert _plan(infos, 5, "replicated", "/x") == (5, [4, 4], 8)
    assert _plan(infos, None, "zero", "/x") == (8, [8, 4], 8)   # shards replay alone
    with pytest.raises(StepNotFoundError, match="not durable on every rank"):
        _plan(infos, 9, "replicated", "/x")
    with pytest.raises(StepNotFoundError, match="no base"):
        _plan([{"durable": 3, "bases": [2]}, {"durable": 3, "bases": [1]}], None,
              "replicated", "/x")
    with pytest.raises(StepNotFoundError, match="no base yet"):
        _plan([{"durable": None, "bases": []}, {"durable": 3, "bases": [0]}], None,
              "replicated", "/x")


def test_keep_count_keeps_the_common_bases() -> None:
    # shard has an extra base (12) the other lacks: keeping 1 common base (8) needs 2 here
    assert _keep_count([0, 4, 8, 12], [0, 4, 8], 1) == 2
    assert _keep_count([0, 4, 8], [0, 4, 8], 2) == 2
    assert _keep_count([0, 4, 8], [0, 4, 8], 5) == 3


# ---------------------------------------------------------------------- the tee


class FakeBucket:
    """What a comm hook sees: a flat buffer and per-parameter views into it."""

    def __init__(self, params: list[torch.nn.Parameter], index: int = 0) -> None:
        self._params = params
        n = sum(p.numel() for p in params)
        self._buf = torch.zeros(n)
        self._index = index

    def buffer(self) -> torch.Tensor:
        return self._buf

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        out, off = [], 0
        for p in self._params:
            out.append(self._buf[off:off + p.numel()].view(p.shape))
            off += p.numel()
        return out

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True


def _fixture(owned: set[str] | None = None) -> tuple[dict[str, torch.nn.Parameter], Tee,
                                                      FakeBucket]:
    torch.manual_seed(0)
    params = {"w": torch.nn.Parameter(torch.zeros(4, 3)), "b": torch.nn.Parameter(
        torch.zeros(4)), "v": torch.nn.Parameter(torch.zeros(6, 5))}
    tee = Tee({id(p): n for n, p in params.items()}, params,
              set(params) if owned is None else owned, ef_step=False)
    return params, tee, FakeBucket(list(params.values()))


def _hook_returning(values: torch.Tensor) -> Any:
    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        bucket.buffer().copy_(values)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    return hook


def _run(tee: Tee, kind: str, bucket: FakeBucket, values: torch.Tensor) -> torch.Tensor:
    out = tee._call(_hook_returning(values), kind, None, bucket).wait()
    return out


def _scratch(like: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(like)


def _grads(params: dict[str, torch.nn.Parameter], bucket: FakeBucket) -> None:
    for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
        p.grad = g.clone()


@pytest.mark.parametrize(("kind", "dtype", "tag"), [("fp16", torch.float16, "F16"),
                                                     ("bf16", torch.bfloat16, "BF16")])
def test_narrow_tee_is_lossless_and_checked(kind: str, dtype: torch.dtype, tag: str) -> None:
    params, tee, bucket = _fixture()
    vals = torch.randn(bucket.buffer().numel()).to(dtype).to(torch.float32)
    _run(tee, kind, bucket, vals)
    _grads(params, bucket)
    teed = tee.take()
    assert set(teed) == set(params)
    assert tee.take() == {}
    for n, t in teed.items():
        assert t.kind == "narrow"
        assert t.tensors[0].dtype == dtype
        assert t.matches(params[n].grad, _scratch)
        (spec,) = t.specs(n, None)
        assert spec.name == "@grad/" + n
        assert spec.tag == tag
        assert spec.nbytes == params[n].numel() * 2      # half of fp32
    # the optimizer consumed something else (say clipping scaled it): not a match
    g = params["w"].grad
    assert g is not None
    g.mul_(0.5)
    assert not teed["w"].matches(g, _scratch)


def test_narrow_tee_is_refused_when_not_representable() -> None:
    params, tee, bucket = _fixture()
    vals = torch.randn(bucket.buffer().numel())           # fp32 values: not fp16-exact
    _run(tee, "fp16", bucket, vals)
    _grads(params, bucket)
    teed = tee.take()
    assert not any(t.matches(params[n].grad, _scratch) for n, t in teed.items())


def test_dense_results_are_not_teed() -> None:
    """All-reduce output is the gradient: the pre-step dense copy logs it."""
    _params, tee, bucket = _fixture()
    _run(tee, "allreduce", bucket, torch.randn(bucket.buffer().numel()))
    assert tee.take() == {}


def test_tee_keeps_only_owned_parameters() -> None:
    _params, tee, bucket = _fixture(owned={"v"})
    _run(tee, "fp16", bucket, torch.randn(bucket.buffer().numel()))
    assert set(tee.take()) == {"v"}


def test_topk_tee_is_sparse_and_exact() -> None:
    params, tee, bucket = _fixture()
    vals = torch.zeros(bucket.buffer().numel())
    vals[[0, 5, 13, 40]] = torch.tensor([1.5, -2.0, 0.25, 3.0])
    _run(tee, "topk", bucket, vals)
    _grads(params, bucket)
    teed = tee.take()
    assert teed["w"].kind == "sparse"
    assert teed["w"].tensors[0].tolist() == [0, 5]
    for n, t in teed.items():
        assert t.matches(params[n].grad, _scratch), n
        (spec,) = t.specs(n, None)
        assert spec.enc.codec == "sparse"
    g = params["w"].grad
    assert g is not None
    g.view(-1)[1] = -0.0          # a zero with other bits outside the indices: not a match
    assert not teed["w"].matches(g, _scratch)
    g.view(-1)[1] = 0.0
    g.view(-1)[5] = 7.0           # a different value at an index
    assert not teed["w"].matches(g, _scratch)


def test_decoders_are_the_hooks_ops() -> None:
    p, q = torch.randn(6, 2), torch.randn(5, 2)
    ref = torch.empty(1, 6, 5)
    torch.bmm(p.view(1, 6, 2), q.view(1, 5, 2).transpose(1, 2), out=ref)  # PowerSGD's op
    assert same_bits(psgd_decode(p, q, (6, 5)), ref.view(6, 5))
    h = torch.randn(7).half()
    assert same_bits(narrow_decode(h, torch.float32), h.float())
    assert same_bits(torch.tensor([-0.0]), torch.tensor([-0.0]))
    assert not same_bits(torch.tensor([-0.0]), torch.tensor([0.0]))


def test_powersgd_memory_layout_groups_by_shape() -> None:
    """Factors are cut out of PowerSGD's P/Q memories at the offsets its hook uses:
    compressed matrices grouped by shape in order of first appearance."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    shapes = [(16, 8), (32,), (20, 16), (16, 8), (4, 4)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    tee = Tee(names, {f"p{i}": p for i, p in enumerate(params)}, set(names.values()),
              ef_step=False)
    state = PowerSGDState(process_group=None, matrix_approximation_rank=2,
                          min_compression_rate=1.0, start_powerSGD_iter=2)
    plan, total_p = tee._psgd_plan(state, tee._slots(FakeBucket(params)))
    got = [(it.slot, it.n, it.m, it.r, it.p_off, it.q_off) for it in plan]
    # p0 and p3 share a shape (grouped, so p3 comes before p2); p1 is a vector and p4
    # would not shrink ((4 + 4) * 2 == 4 * 4): both are sent uncompressed
    assert got == [(0, 16, 8, 2, 0, 0), (3, 16, 8, 2, 32, 16), (2, 20, 16, 2, 64, 32)]
    assert total_p == sum(it.n * it.r for it in plan)
    assert all(it.slot != 1 for it in plan)


def test_hook_wrapper_keeps_what_ddp_checks() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D

    _params, tee, _b = _fixture()
    w = tee.wrap(D.fp16_compress_hook)
    assert w.__name__ == "fp16_compress_hook"      # DDP's backend checks go by name
    sig = inspect.signature(w)
    assert list(sig.parameters) == ["state", "bucket"]
    assert all(p.annotation is inspect.Parameter.empty for p in sig.parameters.values())
    assert list(inspect.signature(topk_allgather_hook).parameters) == ["state", "bucket"]
    assert hook_kind(D.allreduce_hook) == "allreduce"
    assert hook_kind(topk_allgather_hook) == "topk"
    assert hook_kind(lambda s, b: None) == "dense"


def test_single_process_wrapper_is_a_passthrough(tmp_path: Any) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D

    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ck = DiffCheckpointer(tmp_path / "log", m, opt)
    assert type(ck) is DiffCheckpointer                # no process group: unsharded layout
    w = ck.wrap_comm_hook(D.allreduce_hook)
    assert w.__name__ == "allreduce_hook"
    ck.close()
    assert (tmp_path / "log" / "MANIFEST").exists()


def test_topk_state_validates_ratio() -> None:
    from lowdiff_store.errors import ConfigError

    with pytest.raises(ConfigError):
        TopKAllGatherState(ratio=0.0)
    assert TopKAllGatherState(ratio=0.1).k_for(25) == 2
    assert TopKAllGatherState(ratio=0.001).k_for(25) == 1
