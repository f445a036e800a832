"""Guards of the per-step capture path that run without a GPU (issue 33, item 4).

On an accelerator every host transfer the training thread makes is a synchronization, and
every per-tensor host call a launch-bound loop cannot afford. CI has no GPU, so the property
is checked on CPU by counting, on the training thread only, the calls that would be host
transfers or host work under CUDA: ``Tensor.cpu`` / ``.item`` / ``.tolist`` / ``.numpy``,
``Tensor.to`` a CPU device, numpy ``argsort`` / ``sort``, host allocations
(``torch.empty(..., pin_memory=...)``) and :class:`HostPool` misses. After warm-up the
count per step must not grow with the number of parameters: 4 and 64 parameters give the
same count, for dense and layer-wise capture and for every compressor. Only calls made by
the engine's code count (a ``lowdiff_store`` frame on the stack): torch's optimizers make
host calls of their own on CPU.

The same runs check that the log is right (each logged step replays to the live state),
so a capture that skipped work would fail here too. The CUDA counterparts (the hooks run
under ``torch.cuda.set_sync_debug_mode("error")``) are in ``test_cuda_capture.py``.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lowdiff_store import codecs
from lowdiff_store.codecs.batch import _sort_pairs
from lowdiff_store.torch import (
    DeMo,
    DeMoCompressor,
    DiffCheckpointer,
    QSGDCompressor,
    TernGradCompressor,
    TopKCompressor,
    restore,
)
from lowdiff_store.torch.compressors.topk import TopKMessage
from lowdiff_store.torch.core.step_batch import HostPool, StepBatch

WARMUP = 3
COUNTED = 3


class HostCalls:
    """Counts host calls made on one thread (the training thread) while active."""

    def __init__(self, engine_only: bool) -> None:
        self.thread = threading.get_ident()
        self.counts: Counter[str] = Counter()
        self.on = False
        self.engine_only = engine_only

    def hit(self, what: str) -> None:
        if self.on and threading.get_ident() == self.thread and (
                not self.engine_only or _by_the_engine()):
            self.counts[what] += 1


def _by_the_engine() -> bool:
    """The call comes (maybe through torch) from lowdiff_store's code: torch's own
    optimizers make host calls of their own (AdamW on CPU reads each ``step`` with
    ``.item()``), which are not the engine's."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_globals.get("__name__", "").startswith("lowdiff_store"):
            return True
        f = f.f_back
    return False


def _is_cpu(arg: Any) -> bool:
    return (isinstance(arg, str) and arg.startswith("cpu")) or (
        isinstance(arg, torch.device) and arg.type == "cpu")


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch, engine_only: bool = True
             ) -> Iterator[HostCalls]:
    """Patch the host calls (see the module docstring) to count into a HostCalls."""
    calls = HostCalls(engine_only)

    def wrap(owner: Any, name: str, label: str,
             when: Callable[..., bool] = lambda *a, **k: True) -> None:
        orig = getattr(owner, name)

        def patched(*args: Any, **kwargs: Any) -> Any:
            if when(*args, **kwargs):
                calls.hit(label)
            return orig(*args, **kwargs)

        monkeypatch.setattr(owner, name, patched)

    for name in ("cpu", "item", "tolist", "numpy"):
        wrap(torch.Tensor, name, f"Tensor.{name}")
    wrap(torch.Tensor, "to", "Tensor.to(cpu)",
         lambda self, *a, **k: any(_is_cpu(x) for x in a) or _is_cpu(k.get("device")))
    wrap(np, "argsort", "np.argsort")
    wrap(np, "sort", "np.sort")
    wrap(torch, "empty", "torch.empty(pin_memory=)", lambda *a, **k: "pin_memory" in k)
    orig_take = HostPool.take_shape

    def take_shape(self: HostPool, *args: Any) -> torch.Tensor:
        before = self.misses
        out = orig_take(self, *args)
        if self.misses != before:
            calls.hit("HostPool miss")
        return out

    monkeypatch.setattr(HostPool, "take_shape", take_shape)
    yield calls


class Net(torch.nn.Module):
    """``n`` parameters: n/2 linear layers of 24 -> 24 (weights large enough for the
    compressors' ``min_numel``)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(n // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


CASES: dict[str, Callable[[], tuple[Any, dict[str, Any], bool]]] = {
    # name -> (compressor or None, checkpointer options, DeMo optimizer)
    "dense": lambda: (None, {}, False),
    "layerwise": lambda: (None, {"capture": "layerwise"}, False),
    "topk": lambda: (TopKCompressor(0.05), {}, False),
    "topk-sampled": lambda: (TopKCompressor(0.05, selector="sampled"), {}, False),
    "topk-ef-step": lambda: (TopKCompressor(0.05), {"ef_state": "step"}, False),
    "terngrad": lambda: (TernGradCompressor(min_numel=16), {}, False),
    "terngrad-ef-step": lambda: (TernGradCompressor(min_numel=16, error_feedback=True),
                                 {"ef_state": "step"}, False),
    "qsgd": lambda: (QSGDCompressor(min_numel=16, bucket=64), {}, False),
    "demo": lambda: (DeMoCompressor(topk=4, chunk=8), {}, True),
    "demo-ef-step": lambda: (DeMoCompressor(topk=4, chunk=8), {"ef_state": "step"}, True),
}


def _run(case: str, nparams: int, path: Path, monkeypatch: pytest.MonkeyPatch
         ) -> tuple[Counter[str], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    comp, opts, demo = CASES[case]()
    model = Net(nparams)
    opt: torch.optim.Optimizer = DeMo(model.parameters(), lr=1e-3) if demo else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 24)
    with counting(monkeypatch) as calls:
        ck = DiffCheckpointer(path, model, opt, compressor=comp, snapshot_every=1000,
                              digest_every=0, **opts)
        for step in range(WARMUP + COUNTED):
            calls.on = step >= WARMUP
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
            # every record written before the next step takes buffers: the pool's reuse
            # does not depend on how fast the disk is (records in flight get their own)
            ck.flush()
        calls.on = False
        ck.close()
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return calls.counts, live


@pytest.mark.parametrize("case", list(CASES))
def test_host_calls_per_step_do_not_grow_with_the_parameters(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small, live_small = _run(case, 4, tmp_path / "small", monkeypatch)
    large, live_large = _run(case, 64, tmp_path / "large", monkeypatch)
    assert small == large, (small, large)
    # what remains is per step, not per tensor: the RNG state, one numpy view of a
    # hyperparameter, nothing per parameter (64 parameters x 3 steps would be 192)
    assert sum(large.values()) <= 6 * COUNTED, large
    for k in ("np.argsort", "np.sort", "HostPool miss", "torch.empty(pin_memory=)"):
        assert large[k] == 0, (k, large)
    # and what was logged replays to the live state
    for path, live, n in ((tmp_path / "small", live_small, 4),
                          (tmp_path / "large", live_large, 64)):
        model = Net(n)
        _c, _o, demo = CASES[case]()
        opt: torch.optim.Optimizer = DeMo(model.parameters(), lr=1e-3) if demo else \
            torch.optim.AdamW(model.parameters(), lr=1e-3)
        res = restore(path, model, opt)
        assert res.step == WARMUP + COUNTED
        for k, v in model.state_dict().items():
            assert torch.equal(v, live[k]), k


def test_the_counter_sees_per_tensor_host_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard can fail: a per-tensor ``.cpu().numpy()`` and an argsort are counted."""
    ts = [torch.randn(10) for _ in range(5)]
    with counting(monkeypatch, engine_only=False) as calls:
        calls.on = True
        for t in ts:
            np.argsort(t.cpu().numpy())
        torch.empty(3, pin_memory=False)
        HostPool().take(ts[0])
        calls.on = False
    assert calls.counts == Counter({"Tensor.cpu": 5, "Tensor.numpy": 5, "np.argsort": 5,
                                    "torch.empty(pin_memory=)": 2, "HostPool miss": 1})


class _LeakyTopK(TopKCompressor):
    """A top-k that reads its indices back per tensor, as the engine once did."""

    def _compress_param(self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any]
                        ) -> Any:
        msg = super()._compress_param(p, g, group)
        np.argsort(msg.idx.cpu().numpy())
        return msg


def test_the_guard_fails_on_a_per_tensor_readback(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(CASES, "leaky", lambda: (_LeakyTopK(0.05), {}, False))
    small, _ = _run("leaky", 4, tmp_path / "small", monkeypatch)
    large, _ = _run("leaky", 64, tmp_path / "large", monkeypatch)
    assert large["np.argsort"] == 64 * COUNTED
    assert small["np.argsort"] == 4 * COUNTED
    assert large["Tensor.cpu"] - small["Tensor.cpu"] == 60 * COUNTED


def test_calls_on_other_threads_are_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    with counting(monkeypatch, engine_only=False) as calls:
        calls.on = True
        th = threading.Thread(target=lambda: torch.ones(3).tolist())
        th.start()
        th.join()
        torch.ones(3).tolist()
    assert calls.counts == Counter({"Tensor.tolist": 1})


# ---------------------------------------------------------------------- the step batch


def _pairs(numels: list[int], k: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in numels:
        idx = torch.randperm(n, generator=g)[:k]
        out.append((idx, torch.randn(k, generator=g)))
    return out


@pytest.mark.parametrize("on_device", [False, True])
def test_step_batch_sparse_pairs_come_back_sorted(on_device: bool) -> None:
    """The batched sort (one sort of every tensor's pairs, indices offset by the tensors
    before) and the encoder's argsort give each tensor's pairs sorted by index."""
    pool = HostPool()
    numels = [50, 7, 300, 64]
    pairs = _pairs(numels, 5)
    batch = StepBatch(pool, sort_on_device=on_device)
    slots = [batch.add_sparse(i, v, n) for (i, v), n in zip(pairs, numels, strict=True)]
    batch.ship()
    assert len(batch.buffers) == 2  # one host buffer per dtype: indices, values
    for (idx, vals), slot in zip(pairs, slots, strict=True):
        got_i, got_v = batch.sparse(slot)
        order = torch.argsort(idx)
        assert np.array_equal(got_i, idx[order].numpy())
        assert np.array_equal(got_v, vals[order].numpy())


def test_step_batch_groups_by_dtype_and_keeps_slots() -> None:
    pool = HostPool()
    batch = StepBatch(pool)
    a, b = torch.arange(6, dtype=torch.int8), torch.randn(4, 3)
    c = torch.tensor([-1, 0, 1], dtype=torch.int8)
    bf = torch.randn(5).to(torch.bfloat16)
    sa, sb, sc, sbf = (batch.add(t) for t in (a, b, c, bf))
    assert (sa.offset, sc.offset) == (0, 6)  # offsets from shapes, as Python ints
    batch.ship()
    assert len(batch.buffers) == 3
    a[0] = 100  # the host copy is the step's (made at ship)
    assert np.array_equal(batch.array(sa), np.arange(6, dtype=np.int8))
    assert np.array_equal(batch.array(sb), b.reshape(-1).numpy())
    assert np.array_equal(batch.array(sc), c.numpy())
    assert np.array_equal(batch.array(sbf), bf.view(torch.int16).numpy())  # bits
    bufs = batch.buffers
    pool.give(bufs)  # the next step's batch reuses them: no allocation
    again = StepBatch(pool)
    for t in (a, b, c, bf):
        again.add(t)
    misses = pool.misses
    again.ship()
    assert pool.misses == misses
    assert {id(x) for x in again.buffers} == {id(x) for x in bufs}


def _encode_step(ntensors: int, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Encode a CPU step batch of ``ntensors`` top-k messages (half float32, half bf16
    values) as the encoder thread does; check each tensor's encoding; the host calls."""
    pool = HostPool()
    numels = [40 + 7 * i for i in range(ntensors)]
    pairs = _pairs(numels, 5, seed=ntensors)
    half = ntensors // 2  # two values dtypes: two sorts
    msgs = [TopKMessage(i, v if j < half else v.to(torch.bfloat16), n)
            for j, ((i, v), n) in enumerate(zip(pairs, numels, strict=True))]
    batch = StepBatch(pool)
    specs = [batch.spec(f"t{j}", m.tag, (m.numel,), m, None, m.nbytes)
             for j, m in enumerate(msgs)]
    batch.ship()
    assert len(batch.buffers) == 4  # indices and values per values dtype
    with counting(monkeypatch, engine_only=False) as calls:
        calls.on = True
        encoded = [s.enc.encode() for s in specs]  # type: ignore[union-attr]
        calls.on = False
    for (idx, _vals), m, enc in zip(pairs, msgs, encoded, strict=True):
        order = torch.argsort(idx)
        v = m.values[order]  # (bf16: its bits, as the log stores them)
        want = codecs.encode_sparse(idx[order].numpy(), (v.view(torch.int16).numpy().view(
            np.uint16) if v.dtype == torch.bfloat16 else v.numpy()), m.numel, m.tag,
            delta=True)
        assert enc.codec == want.codec
        assert enc.params == want.params
        for a, b in zip(enc.parts, want.parts, strict=True):
            assert a.dtype == b.dtype
            assert np.array_equal(a.data, b.data)
    return calls.counts


def test_the_encoder_sorts_a_steps_pairs_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the step's top-k pairs are sorted on the encoder thread all at once (per
    values dtype), whatever the number of tensors: small numpy calls per tensor hold the
    GIL the training thread waits for. Each tensor's pairs come back sorted."""
    small = _encode_step(4, monkeypatch)
    large = _encode_step(64, monkeypatch)
    assert small == large, (small, large)
    assert large["np.argsort"] == 0  # packed pairs: one np.sort per dtype, no argsort


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.uint8, np.float64])
@pytest.mark.parametrize("packed", [True, False])
def test_sort_pairs_orders_keys_and_carries_the_values_bits(dtype: Any, packed: bool
                                                            ) -> None:
    """Both ways of the host's batched sort (packed key and value bits in one uint64, or
    an argsort when they do not fit) give the pairs by ascending key, values' bits intact
    (NaN payloads and -0.0 included)."""
    rng = np.random.default_rng(3)
    n = 5000
    bound = (1 << 20) if packed else (1 << 60)
    keys = rng.choice(1 << 20, size=n, replace=False).astype(np.int64)
    if not packed:
        keys[::7] += 1 << 59  # beyond what fits beside the value bits
    width = np.dtype(dtype).itemsize
    vals = rng.integers(0, 256, size=n * width, dtype=np.uint8).view(dtype).copy()
    order = np.argsort(keys)
    want_k, want_v = keys[order], vals[order].view(f"u{width}")
    _sort_pairs(keys, vals, bound)
    assert np.array_equal(keys, want_k)
    assert np.array_equal(vals.view(f"u{width}"), want_v)
