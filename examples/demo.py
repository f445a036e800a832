#!/usr/bin/env python3
"""lowdiff-store demo: per-step checkpoints, a real crash, exact recovery.

1. Train a small transformer language model on synthetic data for N steps without
   checkpointing: the reference run (and the baseline step time).
2. Train it again in a child process with DiffCheckpointer (a diff every step, a base every
   F steps) and kill that process with SIGKILL partway through.
3. Restore from the log into fresh objects, finish the run, and check that parameters,
   optimizer state, scheduler and RNG are bit-for-bit those of the reference run.
4. Print bytes per step against a full checkpoint, the overhead, and the recovery time.

Usage: python examples/demo.py [--steps 60] [--kill-at 37] [--dir DIR] [--topk]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowdiff_store.torch import DiffCheckpointer, TopKCompressor, restore

VOCAB, CTX, DIM, LAYERS, HEADS, BATCH = 512, 32, 128, 2, 4, 8


class TinyLM(nn.Module):
    """A small decoder-only transformer LM (about 0.5M parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(CTX, DIM))
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CTX))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def make_objects(steps: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    return model, opt, sched


def batch_for(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic data: the data loader position is the step itself."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (BATCH, CTX + 1), generator=g)
    x[:, 1::2] = (x[:, 0::2][:, : x[:, 1::2].shape[1]] * 7 + 3) % VOCAB  # learnable pattern
    return x[:, :-1], x[:, 1:]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: object, step: int) -> float:
    x, y = batch_for(step)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    return float(loss)


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer, sched: object) -> dict[str, bytes]:
    """Everything that must match bit for bit, as bytes."""
    out = {}
    for k, v in model.state_dict().items():
        out["model/" + k] = v.detach().contiguous().view(torch.uint8).numpy().tobytes()
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            t = v if torch.is_tensor(v) else torch.tensor(v)
            out[f"optim/{i}/{k}"] = t.contiguous().view(torch.uint8).numpy().tobytes()
    out["sched"] = repr(sched.state_dict()).encode()  # type: ignore[attr-defined]
    out["rng"] = torch.get_rng_state().numpy().tobytes()
    return out


def child(args: argparse.Namespace) -> None:
    """The training process that gets killed."""
    torch.set_num_threads(1)
    model, opt, sched = make_objects(args.steps)
    comp = TopKCompressor(ratio=0.01) if args.topk else None
    ckpt = DiffCheckpointer(args.dir, model, opt, scheduler=sched, snapshot_every=args.every,
                            batch=1, compressor=comp, extra_state=lambda: {"epoch": 0})
    for step in range(1, args.steps + 1):
        train_step(model, opt, sched, step)
        print(f"step {step} durable {ckpt.durable_step}", flush=True)
    ckpt.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=37)
    ap.add_argument("--every", type=int, default=25, help="base every F steps")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--topk", action="store_true", help="train with top-1%% compression")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    torch.set_num_threads(1)
    workdir = args.dir or os.path.join(tempfile.gettempdir(), "lowdiff-demo")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    log = os.path.join(workdir, "ckpt")

    print(f"1) reference run: {args.steps} steps, no checkpointing")
    model, opt, sched = make_objects(args.steps)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        train_step(model, opt, sched, step)
    base_time = (time.perf_counter() - t0) / args.steps
    reference = state_bytes(model, opt, sched)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    full_ckpt = buf.tell()

    print(f"2) training with a diff every step, killed with SIGKILL after step {args.kill_at}")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", log,
           "--steps", str(args.steps), "--every", str(args.every)] + (
        ["--topk"] if args.topk else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    t0 = time.perf_counter()
    seen = 0
    for line in proc.stdout:
        seen = int(line.split()[1])
        if seen >= args.kill_at:
            proc.send_signal(signal.SIGKILL)
            break
    ckpt_time = (time.perf_counter() - t0) / max(seen, 1)
    proc.wait()
    print(f"   killed at step {seen} (exit status {proc.returncode})")

    print("3) restore into fresh objects and finish the run")
    model, opt, sched = make_objects(args.steps)
    t0 = time.perf_counter()
    res = restore(log, model, opt, scheduler=sched)
    recovery = time.perf_counter() - t0
    print(f"   restored step {res.step} in {recovery * 1000:.0f} ms")
    ckpt = DiffCheckpointer(log, model, opt, scheduler=sched, snapshot_every=args.every,
                            compressor=TopKCompressor(ratio=0.01) if args.topk else None,
                            extra_state=lambda: {"epoch": 0})
    for step in range(res.step + 1, args.steps + 1):
        train_step(model, opt, sched, step)
    ckpt.close()
    recovered = state_bytes(model, opt, sched)
    mismatched = sorted(k for k in reference if reference[k] != recovered.get(k))
    from lowdiff_store.verify import inspect_log

    info = inspect_log(log)
    print("4) summary")
    print(f"   bitwise identical to the uninterrupted run: {'YES' if not mismatched else 'NO'}"
          f" ({len(reference)} tensors and states compared)")
    print(f"   bytes per step: {info['bytes_per_step'] / 1024:.1f} KiB vs a full checkpoint of "
          f"{full_ckpt / 1024:.1f} KiB ({100 * info['bytes_per_step'] / full_ckpt:.1f}%)")
    print(f"   step time: {base_time * 1000:.1f} ms without checkpointing, "
          f"{ckpt_time * 1000:.1f} ms with a diff every step (child process, noisy)")
    print(f"   recovery: {recovery * 1000:.0f} ms (base + {res.step % args.every} diffs replayed)")
    print(f"   inspect it: lowdiff-store inspect {log}")
    if mismatched:
        print(f"   differing: {mismatched[:5]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
