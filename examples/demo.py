#!/usr/bin/env python3
"""lowdiff-store demo: per-step checkpoints, a real crash, exact recovery.

1. Train a small transformer language model on synthetic data for N steps without
   checkpointing: the reference run (and the baseline step time).
2. Train it again in a child process with DiffCheckpointer (a diff every step, a base every
   F steps) and kill that process with SIGKILL partway through.
3. Restore from the log into fresh objects, finish the run, and check that parameters,
   optimizer state, scheduler and RNG are bit-for-bit those of the reference run.
4. Print bytes per step against a full checkpoint, the overhead, and the recovery time.
5. Write each log's report page (``lowdiff-store report``) and print its path.

It runs twice: with dense gradients, and with top-1% compressed gradients (LowDiff: the
log reuses the compressed gradient training already produced).

Usage: python examples/demo.py [--steps 60] [--kill-at 37] [--every 25] [--dir DIR]
                               [--only dense|topk]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowdiff_store.report import report_log
from lowdiff_store.torch import DiffCheckpointer, TopKCompressor, restore
from lowdiff_store.verify import inspect_log

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


def make_objects(steps: int, topk: bool) -> tuple[nn.Module, torch.optim.Optimizer, object,
                                                  TopKCompressor | None]:
    torch.manual_seed(0)
    model = TinyLM()
    # fused=True: AdamW's CPU step reaches no MKL op, so the log restores bitwise on every
    # x86-64 CPU vendor (docs/torch.md, "Exactness across machines"); it is also the
    # fastest CPU step
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    # LowDiff's setting: training consumes the top-1% gradient (no error feedback, so any
    # step, not only a base, restores bit for bit; see docs on error_feedback=True).
    comp = TopKCompressor(ratio=0.01, error_feedback=False) if topk else None
    return model, opt, sched, comp


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
    return float(loss.detach())


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer, sched: object) -> dict[str, bytes]:
    """Everything that must match bit for bit, as bytes."""
    out = {}
    for k, v in model.state_dict().items():
        out["model/" + k] = _bits(v)
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{i}/{k}"] = _bits(v if torch.is_tensor(v) else torch.tensor(v))
    out["sched"] = repr(sched.state_dict()).encode()  # type: ignore[attr-defined]
    out["rng"] = torch.get_rng_state().numpy().tobytes()
    return out


def child(args: argparse.Namespace) -> None:
    """The training process that gets killed. Prints each step, its time, the durable step."""
    torch.set_num_threads(1)
    model, opt, sched, comp = make_objects(args.steps, args.topk)
    ckpt = DiffCheckpointer(args.dir, model, opt, scheduler=sched, snapshot_every=args.every,
                            batch=1, compressor=comp, extra_state=lambda: {"epoch": 0})
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        train_step(model, opt, sched, step)
        print(f"step {step} {time.perf_counter() - t0:.6f} durable {ckpt.durable_step}",
              flush=True)
    ckpt.close()


def scenario(args: argparse.Namespace, topk: bool, workdir: str) -> tuple[bool, list[str]]:
    """Reference run, killed run, restore and finish, compare. Returns (identical, lines)."""
    label = "top-1% compressed gradients (LowDiff)" if topk else "dense gradients"
    log = os.path.join(workdir, "ckpt-topk" if topk else "ckpt-dense")
    print(f"== {label}")
    print(f"1) reference run: {args.steps} steps, no checkpointing")
    model, opt, sched, comp = make_objects(args.steps, topk)
    if comp is not None:
        comp.attach(opt)
    times = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        train_step(model, opt, sched, step)
        times.append(time.perf_counter() - t0)
    base_time = statistics.median(times)
    reference = state_bytes(model, opt, sched)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    full_ckpt = buf.tell()

    print(f"2) train with a diff every step in a child process; SIGKILL it after step "
          f"{args.kill_at}")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", log,
           "--steps", str(args.steps), "--every", str(args.every)] + (
        ["--topk"] if topk else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen, durable, ckpt_times = 0, -1, []
    for line in proc.stdout:
        _s, step_s, t_s, _d, durable_s = line.split()
        seen, durable = int(step_s), int(durable_s)
        ckpt_times.append(float(t_s))
        if seen >= args.kill_at:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    print(f"   killed after step {seen} (exit status {proc.returncode}); the last durable step "
          f"it reported was {durable}")

    print("3) restore into fresh objects, reopen the log, finish the run")
    model, opt, sched, comp = make_objects(args.steps, topk)
    t0 = time.perf_counter()
    res = restore(log, model, opt, scheduler=sched)
    recovery = time.perf_counter() - t0
    print(f"   restored step {res.step} (base {res.base_step} + {res.replayed} diffs replayed, "
          f"{len(res.verified)} digests checked) in {recovery * 1000:.0f} ms")
    assert res.step >= durable, "a step reported durable was lost"
    ckpt = DiffCheckpointer(log, model, opt, scheduler=sched, snapshot_every=args.every,
                            compressor=comp, extra_state=lambda: {"epoch": 0})
    for step in range(res.step + 1, args.steps + 1):
        train_step(model, opt, sched, step)
    ckpt.close()
    recovered = state_bytes(model, opt, sched)
    mismatched = sorted(k for k in reference if reference[k] != recovered.get(k))
    info = inspect_log(log)
    ckpt_time = statistics.median(ckpt_times[1:] or ckpt_times)
    lines = [
        f"{label}:",
        f"  bitwise identical to the uninterrupted run: {'YES' if not mismatched else 'NO'} "
        f"({len(reference)} tensors and states compared: parameters, buffers, optimizer "
        "state, scheduler, RNG)",
        f"  bytes per step: {info['bytes_per_step'] / 1024:.1f} KiB, "
        f"{100 * info['bytes_per_step'] / full_ckpt:.1f}% of a full checkpoint "
        f"({full_ckpt / 1024:.0f} KiB)",
        f"  median step time: {base_time * 1000:.1f} ms without checkpointing, "
        f"{ckpt_time * 1000:.1f} ms with a diff every step (separate processes; see "
        "bench/RESULTS.md for measured overheads)",
        f"  recovery: {recovery * 1000:.0f} ms",
        f"  inspect it: {os.path.relpath(sys.executable)} -m lowdiff_store inspect {log}",
    ]
    if mismatched:
        lines.append(f"  differing: {mismatched[:5]}")
    return not mismatched, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=37)
    ap.add_argument("--every", type=int, default=25, help="base every F steps")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--only", choices=["dense", "topk"], default=None,
                    help="run one scenario (default: both)")
    ap.add_argument("--topk", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    torch.set_num_threads(1)
    workdir = args.dir or os.path.join(tempfile.gettempdir(), "lowdiff-demo")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    ok = True
    summary: list[str] = []
    for topk in ([False, True] if args.only is None else [args.only == "topk"]):
        same, lines = scenario(args, topk, workdir)
        ok &= same
        summary += lines
    print("\n== summary")
    print("\n".join(summary))
    print("\n== report")
    for name in ("ckpt-dense", "ckpt-topk"):
        log = os.path.join(workdir, name)
        if os.path.isdir(log):
            page = os.path.join(workdir, f"report-{name[5:]}.html")
            report_log(log, page)
            print(f"  {name}: open file://{os.path.abspath(page)} in a browser")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
