"""Training setups shared by the torch tests (also imported by the SIGKILL subprocess).

Every batch is a pure function of the step number (its own seeded generator), so a run
resumed at any step sees the same data; dropout draws from the global RNG, which is part of
the recorded state.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch

VOCAB = 32


class TinyLM(torch.nn.Module):
    """Embedding -> one transformer layer (dropout) -> head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1,
                                                      batch_first=True)
        self.head = torch.nn.Linear(16, VOCAB)
        self.head.weight = self.emb.weight  # tied: one tensor under two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(x)))


class MLPBN(torch.nn.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32),
                                       torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WideMLP(MLPBN):
    """MLPBN with a 64 x 1024 first layer (65536 weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0] = torch.nn.Linear(8, 8192)
        self.net[1] = torch.nn.BatchNorm1d(8192)
        self.net[4] = torch.nn.Linear(8192, 4)


@dataclass
class Objects:
    """Everything a training run mutates."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None
    compressor: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def _lm_loss(model: torch.nn.Module, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + t)
    x = torch.randint(0, VOCAB, (4, 9), generator=g)
    out = model(x[:, :-1])
    return torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _mlp_loss(model: torch.nn.Module, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + t)
    x = torch.randn(16, 8, generator=g)
    y = torch.randint(0, 4, (16,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


#: steps at which the AMP cases multiply the loss by inf (the scaler must skip them)
INF_STEPS = (4, 11, 18, 23)

CASES = ("adamw", "sgd_bn", "sgd_inplace", "adam_amp_fp16", "adam_amp_bf16",
         "adam_amp_fused", "topk", "topk_ef_step", "delta", "layerwise", "layerwise_clip")
#: the error-feedback case whose residuals are logged only in bases (restore semantics test)
EF_BASE = "topk_ef"
#: the other compressors (tests/torch/test_compressors.py)
COMPRESSOR_CASES = ("topk_sampled", "terngrad", "terngrad_ef_step", "qsgd", "demo")


def build(case: str) -> Objects:
    """Fresh objects for ``case`` (same initial state every time)."""
    torch.manual_seed(0)
    if case in ("adamw", "layerwise", "layerwise_clip"):
        m = TinyLM()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        sch = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, 30) / 30)))
        return Objects(m, opt, sch)
    if case in ("sgd_bn", "delta"):
        m = MLPBN()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                              weight_decay=1e-4)
        sch = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return Objects(m, opt, sch)
    if case == "sgd_inplace":
        # an optimizer whose step edits the gradients in place: foreach SGD with Nesterov
        # momentum and no weight decay adds the momentum into each .grad
        m = MLPBN()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                              foreach=True)
        return Objects(m, opt)
    if case.startswith("adam_amp"):
        m = MLPBN()
        # "adam_amp_fused": the scaler hands its scale to the fused step, which unscales
        # the gradients itself and stores them back
        opt = torch.optim.Adam(m.parameters(), lr=1e-2, fused=case.endswith("fused"))
        return Objects(m, opt, None, torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                                          growth_interval=3))
    if case == "topk_sampled":  # a layer large enough for the sampled selector
        from lowdiff_store.torch import TopKCompressor

        m = WideMLP()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        return Objects(m, opt, compressor=TopKCompressor(0.01, selector="sampled"))
    if case.startswith(("terngrad", "qsgd")):
        from lowdiff_store.torch import QSGDCompressor, TernGradCompressor

        m = MLPBN()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        comp = QSGDCompressor(levels=3, bucket=64, min_numel=64, seed=7) \
            if case == "qsgd" else \
            TernGradCompressor(min_numel=64, seed=7, error_feedback=case.endswith("ef_step"))
        return Objects(m, opt, compressor=comp)
    if case.startswith("demo"):
        from lowdiff_store.torch import DeMo, DeMoCompressor

        m = MLPBN()
        opt = DeMo(m.parameters(), lr=1e-2, weight_decay=0.01)
        sch = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
        return Objects(m, opt, sch, compressor=DeMoCompressor(decay=0.9, topk=4, chunk=8))
    if case.startswith("topk"):
        from lowdiff_store.torch import TopKCompressor

        m = MLPBN()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        # "topk": LowDiff's setting (no error feedback); "topk_ef*": with error feedback
        return Objects(m, opt, compressor=TopKCompressor(0.05, error_feedback=case != "topk"))
    raise ValueError(case)


def ckpt_kwargs(case: str) -> dict[str, Any]:
    """DiffCheckpointer options for ``case`` (besides the objects). ``exact_bases``: the
    tests built on these cases assert bases on their exact steps, which a loaded machine
    would otherwise put off a step now and then (staging memory still being made)."""
    kw: dict[str, Any] = {"snapshot_every": 10, "digest_every": 1, "exact_bases": True}
    if case == "delta":
        kw["mode"] = "delta"
    if case.endswith("ef_step") or case in ("demo", "topk_sampled"):
        kw["ef_state"] = "step"
    if case.startswith("layerwise"):
        kw["capture"] = "layerwise"
    return kw


def train_step(case: str, o: Objects, t: int, ckpt: Any = None) -> None:
    """One iteration (step t) of ``case``."""
    o.extra["batches"] = t  # like a data loader's position: batch t has been drawn
    o.optimizer.zero_grad()
    if case.startswith("adam_amp"):
        dtype = torch.float16 if case.endswith("fp16") else torch.bfloat16
        with torch.autocast("cpu", dtype=dtype):
            loss = _mlp_loss(o.model, t)
        if t in INF_STEPS:
            loss = loss * float("inf")
        o.scaler.scale(loss).backward()
        if not case.endswith("fused"):
            o.scaler.unscale_(o.optimizer)
            torch.nn.utils.clip_grad_norm_(o.model.parameters(), 1.0)
        o.scaler.step(o.optimizer)
        o.scaler.update()
    else:
        loss = (_lm_loss if isinstance(o.model, TinyLM) or isinstance(
            getattr(o.model, "module", None), TinyLM) else _mlp_loss)(o.model, t)
        loss.backward()
        if case == "layerwise_clip":
            ckpt.clip_grad_norm_(0.5) if ckpt is not None else \
                torch.nn.utils.clip_grad_norm_(o.model.parameters(), 0.5)
        elif isinstance(o.model, TinyLM):
            torch.nn.utils.clip_grad_norm_(o.model.parameters(), 0.5)
        o.optimizer.step()
    if o.scheduler is not None:
        o.scheduler.step()


def run(case: str, o: Objects, start: int, stop: int, ckpt: Any = None) -> None:
    """Steps ``start+1 .. stop``."""
    for t in range(start + 1, stop + 1):
        train_step(case, o, t, ckpt)


def reference(case: str, steps: int = 30, at: tuple[int, ...] = ()) -> tuple[Objects, dict[
        int, Any]]:
    """An uninterrupted run without any checkpointer; snapshots at ``at`` and at the end."""
    o = build(case)
    if o.compressor is not None:
        o.compressor.attach(o.optimizer)
    snaps = {}
    for t in range(1, steps + 1):
        train_step(case, o, t)
        if t in at or t == steps:
            snaps[t] = snapshot(o)
    return o, snaps


def snapshot(o: Objects) -> dict[str, Any]:
    """A deep copy of every piece of state a run carries."""
    return copy.deepcopy({
        "model": dict(o.model.state_dict()),
        "optimizer": o.optimizer.state_dict(),
        "scheduler": o.scheduler.state_dict() if o.scheduler is not None else None,
        "scaler": o.scaler.state_dict() if o.scaler is not None else None,
        "rng": torch.get_rng_state(),
    })


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Bitwise equality of nested state (tensors with torch.equal and equal dtypes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype, (path, a.dtype, b.dtype)
        assert a.shape == b.shape, (path, a.shape, b.shape)
        assert torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                           b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)
                           ), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (path, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), (path, a, b)
        assert len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif callable(a):
        pass
    else:
        assert a == b, (path, a, b)
