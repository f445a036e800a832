#!/usr/bin/env python3
"""The gradient compressors on the ~20M-parameter benchmark LM (bench/_lm.py).

For each compressor, in one process, interleaved round by round:

  X      compressed training, no checkpointing (the baseline of its row)
  X+ld   the same with a DiffCheckpointer logging every step (snapshot_every=10**9)

and per compressor: bits per parameter per step logged (record bytes before zstd / number
of parameters), the step-time ratio X+ld / X (median over rounds of the per-round ratio of
median step times), the checkpointer's foreground seconds per step (its hooks' time in the
training thread: less sensitive to machine load than the ratio), replay time per step
(restore through the logged steps), and the loss after ``--loss-steps`` steps against
uncompressed AdamW on the same batches (separate runs).
Also the top-k selector alone: per-tensor ``torch.topk`` vs the sampled selector at 1% on
the LM's gradients (summed over tensors, median of repeats).

Compressors: topk (1%, error feedback, torch.topk), topk-sampled (the same, sampled
selector), terngrad (clip 2.5 sigma), qsgd (s=7, d=512: 4 bits), demo (DeMo optimizer,
decay 0.999, top-32 of 64x64 DCT chunks). All but demo train with AdamW (lr 1e-3); demo
with DeMo (lr 1e-3 signum; its loss is not expected to match AdamW's in few steps).

Run:   python bench/bench_compressors.py [--rounds 3] [--steps 6] [--loss-steps 40]
Smoke: python -m pytest bench/bench_compressors.py --benchmark-disable  (a tiny model)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _lm import LM, batch_for, train_step

from lowdiff_store.torch import (
    DeMo,
    DeMoCompressor,
    DiffCheckpointer,
    QSGDCompressor,
    TernGradCompressor,
    TopKCompressor,
    restore,
)
from lowdiff_store.torch.compressors.select import exact_topk, sampled_topk
from lowdiff_store.torch.compressors.topk import GradCompressor

SIZES = {"20m": (8192, 64, 384, 8, 6, 4), "tiny": (128, 8, 32, 1, 2, 2)}
KINDS = ["topk", "topk-sampled", "terngrad", "qsgd", "demo"]


def make(kind: str, size: str) -> tuple[LM, torch.optim.Optimizer, GradCompressor | None]:
    """Fresh model (same init every time), optimizer and compressor for ``kind``."""
    vocab, ctx, dim, layers, heads, _batch = SIZES[size]
    torch.manual_seed(0)
    model = LM(vocab, ctx, dim, layers, heads)
    if kind == "demo":
        return model, DeMo(model.parameters(), lr=1e-3), DeMoCompressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    comp: GradCompressor | None = {
        "none": lambda: None,
        "topk": lambda: TopKCompressor(0.01),
        "topk-sampled": lambda: TopKCompressor(0.01, selector="sampled"),
        "terngrad": lambda: TernGradCompressor(),
        "qsgd": lambda: QSGDCompressor(levels=7, bucket=512),
    }[kind]()
    return model, opt, comp


class Run:
    """One configuration stepped on demand."""

    def __init__(self, kind: str, logged: bool, size: str, workdir: str) -> None:
        self.model, self.opt, comp = make(kind, size)
        vocab, ctx, _d, _l, _h, batch = SIZES[size]
        self.vocab, self.ctx, self.batch = vocab, ctx, batch
        self.dir = os.path.join(workdir, f"{kind}{'_ld' if logged else ''}")
        self.ckpt = None
        if logged:
            self.ckpt = DiffCheckpointer(self.dir, self.model, self.opt, compressor=comp,
                                         snapshot_every=10**9, digest_every=0)
        elif comp is not None:
            comp.attach(self.opt)
        self.step_no = 0

    def step(self) -> float:
        self.step_no += 1
        x = batch_for(self.step_no, self.vocab, self.batch, self.ctx)
        t0 = time.perf_counter()
        train_step(self.model, self.opt, x)
        return time.perf_counter() - t0


def _loss(model: LM, vocab: int, batch: int, ctx: int) -> float:
    with torch.no_grad():
        model.eval()
        tot = 0.0
        for s in range(4):  # held-out batches (seeds never used for training)
            x = batch_for(10**6 + s, vocab, batch, ctx)
            out = model(x[:, :-1])
            tot += float(nn.functional.cross_entropy(out.reshape(-1, vocab),
                                                     x[:, 1:].reshape(-1)))
        model.train()
    return tot / 4


def losses(size: str, steps: int) -> dict[str, float]:
    """Held-out loss after ``steps`` steps, per compressor and uncompressed ("none")."""
    out = {}
    vocab, ctx, _d, _l, _h, batch = SIZES[size]
    for kind in ["none", *KINDS]:
        model, opt, comp = make(kind, size)
        if comp is not None:
            comp.attach(opt)
        for t in range(1, steps + 1):
            train_step(model, opt, batch_for(t, vocab, batch, ctx))
        out[kind] = _loss(model, vocab, batch, ctx)
    return out


def selector_time(size: str, repeats: int = 5) -> dict[str, float]:
    """Seconds per step spent selecting the top 1% of every gradient tensor of the LM."""
    vocab, ctx, _d, _l, _h, batch = SIZES[size]
    model, opt, _c = make("none", size)
    train_step(model, opt, batch_for(1, vocab, batch, ctx))
    mags = [p.grad.reshape(-1).abs() for p in model.parameters() if p.grad is not None]
    out = {}
    for name, fn in (("exact", exact_topk), ("sampled", sampled_topk)):
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for m in mags:
                fn(m, max(1, int(m.numel() * 0.01)))
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts)
    return out


def run(size: str, rounds: int, steps: int, warmup: int, loss_steps: int, workdir: str
        ) -> dict[str, Any]:
    torch.set_num_threads(1)
    runs = {(k, ld): Run(k, ld, size, workdir) for k in KINDS for ld in (False, True)}
    for r in runs.values():
        for _ in range(warmup):
            r.step()
    per_round: dict[tuple[str, bool], list[float]] = {c: [] for c in runs}
    for _ in range(rounds):
        for c, r in runs.items():
            per_round[c].append(statistics.median(r.step() for _ in range(steps)))
    result: dict[str, Any] = {"size": size, "rounds": rounds, "steps_per_round": steps,
                              "compressors": {}}
    for k in KINDS:
        r = runs[(k, True)]
        assert r.ckpt is not None
        r.ckpt.close()  # first: the last step's record is written at close
        st = r.ckpt.stats()
        nparams = sum(p.numel() for p in r.model.parameters())
        ratio = statistics.median(a / b for a, b in zip(per_round[(k, True)],
                                                        per_round[(k, False)], strict=True))
        model, opt, comp = make(k, size)
        t0 = time.perf_counter()
        res = restore(r.dir, model, opt, compressor=comp)
        replay = (time.perf_counter() - t0) / max(res.step, 1)
        result["compressors"][k] = {
            "step_s": statistics.median(per_round[(k, False)]),
            "step_s_logged": statistics.median(per_round[(k, True)]),
            "ratio_logged": ratio,
            "ratio_per_round": [a / b for a, b in zip(per_round[(k, True)],
                                                      per_round[(k, False)], strict=True)],
            "bits_per_param_step": 8.0 * st["diff_bytes"] / st["steps"] / nparams,
            # the checkpointer's own time in the training thread (its hooks), per step
            "foreground_s_per_step": (st["capture_s"] + st["finalize_s"]) / st["steps"],
            "replay_s_per_step": replay,
        }
    result["selector_s_per_step"] = selector_time(size)
    result["loss_steps"] = loss_steps
    if loss_steps:
        result["loss"] = losses(size, loss_steps)
    return result


def test_bench_compressors_smoke(tmp_path: Any) -> None:
    """CI smoke: every compressor trains, logs, restores and reports sane numbers."""
    out = run("tiny", rounds=1, steps=1, warmup=1, loss_steps=2, workdir=str(tmp_path))
    for k, v in out["compressors"].items():
        assert 0 < v["bits_per_param_step"] < 64, k
        assert v["ratio_logged"] > 0
        assert v["replay_s_per_step"] > 0
    assert set(out["loss"]) == {"none", *KINDS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="20m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loss-steps", type=int, default=40, help="0: no loss runs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        out = run(args.size, args.rounds, args.steps, args.warmup, args.loss_steps, d)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"model {args.size}, {args.rounds} rounds x {args.steps} steps, 1 torch thread")
    print(f"  {'compressor':<13}{'bits/param':>11}{'step ms':>9}{'+ld ms':>9}{'ratio':>7}"
          f"{'replay ms':>10}{'loss':>7}")
    for k, v in out["compressors"].items():
        print(f"  {k:<13}{v['bits_per_param_step']:11.3f}{v['step_s'] * 1e3:9.1f}"
              f"{v['step_s_logged'] * 1e3:9.1f}{v['ratio_logged']:7.3f}"
              f"{v['replay_s_per_step'] * 1e3:10.1f}{out.get('loss', {}).get(k, math.nan):7.3f}")
    if "loss" in out:
        print(f"  uncompressed AdamW loss after {out['loss_steps']} steps: "
              f"{out['loss']['none']:.3f}")
    s = out["selector_s_per_step"]
    print(f"  top-1% selection per step: torch.topk {s['exact'] * 1e3:.1f} ms, sampled "
          f"{s['sampled'] * 1e3:.1f} ms ({s['exact'] / s['sampled']:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
