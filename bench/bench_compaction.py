#!/usr/bin/env python3
"""Compaction and background bases on a ~9M-parameter transformer LM (AdamW, top-1% compressed
gradients as in LowDiff, one torch thread).

One run, every figure a median, every comparison a ratio within the run:

1. Training time per step, configurations interleaved round by round (same machine noise):

     none   top-1% training, no checkpointing                      (baseline)
     diffs  DiffCheckpointer, one diff per step, no base after step 0
     fg     the same with a base every F steps taken in the foreground (state copy in the
            training thread, written by the writer's base thread)
     bg     the same with base_mode="background" (a worker process replays the durable diffs
            onto the last base and writes the bases)

   Reported: mean step time (total / steps: what a run pays, stalls included), median, p95,
   the base overhead (fg - diffs, bg - diffs) and the training-time saving of bg over fg.
2. Compaction time (``compact``: replay from the base + write a new base + retention) vs a
   plain replay of the same steps (``replay_state``), and the replay after compaction.
3. Disk bytes before and after ``compact --keep-bases 1`` on the foreground log.

Run:   python bench/bench_compaction.py [--rounds 3] [--steps 100] [--every 20] [--json]
Smoke: python -m pytest bench/bench_compaction.py  (a tiny model; asserts it runs)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _lm import LM, batch_for, train_step

from lowdiff_store.compaction import compact, log_bytes
from lowdiff_store.log import LogReader
from lowdiff_store.torch import (
    DiffCheckpointer,
    TopKCompressor,
    materialize_base,
    replay_state,
)

#: vocab, context, width, layers, heads, batch
SIZES = {"9m": (8192, 64, 256, 6, 4, 2), "tiny": (128, 8, 32, 1, 2, 2)}
CONFIGS = ("none", "diffs", "fg", "bg")


class Run:
    """One configuration: its own model, optimizer, compressor and checkpointer."""

    def __init__(self, name: str, size: str, workdir: str, every: int) -> None:
        vocab, ctx, dim, layers, heads, batch = SIZES[size]
        torch.manual_seed(0)
        self.model = LM(vocab, ctx, dim, layers, heads)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.vocab, self.ctx, self.batch = vocab, ctx, batch
        self.dir = os.path.join(workdir, name)
        comp = TopKCompressor(ratio=0.01, error_feedback=False)
        self.ckpt: DiffCheckpointer | None = None
        if name == "none":
            comp.attach(self.opt)
        else:
            f = every if name in ("fg", "bg") else 10**9
            self.ckpt = DiffCheckpointer(self.dir, self.model, self.opt, compressor=comp,
                                         snapshot_every=f,
                                         base_mode="background" if name == "bg" else
                                         "foreground")
        self.step_no = 0
        self.every = every if name in ("fg", "bg") else 0
        self.times: list[float] = []
        self.base_steps: list[float] = []  # times of the steps that took a base

    def step(self) -> float:
        self.step_no += 1
        x = batch_for(self.step_no, self.vocab, self.batch, self.ctx)
        t0 = time.perf_counter()
        train_step(self.model, self.opt, x)
        dt = time.perf_counter() - t0
        self.times.append(dt)
        if self.every and self.step_no % self.every == 0:
            self.base_steps.append(dt)
        return dt

    def close(self) -> float:
        t0 = time.perf_counter()
        if self.ckpt is not None:
            self.ckpt.close()
        return time.perf_counter() - t0


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def training(size: str, rounds: int, steps: int, every: int, warmup: int, workdir: str
             ) -> tuple[dict[str, Any], str, str]:
    """Part 1. Returns the figures and the directories of one diffs and one fg log."""
    per: dict[str, dict[str, list[float]]] = {c: {"mean": [], "median": [], "p95": [],
                                                   "close": [], "base_step_stall": []}
                                               for c in CONFIGS}
    extra: dict[str, Any] = {}
    keep: dict[str, str] = {}
    for r in range(rounds):
        d = os.path.join(workdir, f"round{r}")
        for c in CONFIGS:  # one configuration at a time: no one's background work in
            run = Run(c, size, d, every)  # another's timing; rounds interleave them
            if run.ckpt is not None and run.ckpt._bg is not None:
                run.ckpt._bg.wait_ready(60)  # worker imports (~2 s), amortized in real runs
            for _ in range(warmup):
                run.step()
            run.times.clear()
            run.base_steps.clear()
            for _ in range(steps):
                run.step()
            t = run.times
            if run.base_steps:  # the pause at a base step, against a typical step
                per[c]["base_step_stall"].append(
                    statistics.median(run.base_steps) - statistics.median(t))
            per[c]["mean"].append(sum(t) / len(t))
            per[c]["median"].append(statistics.median(t))
            per[c]["p95"].append(_p(t, 0.95))
            if c == "bg":
                assert run.ckpt is not None
                per[c]["close"].append(run.close())
                st = run.ckpt.stats()
                extra = {"bg_bases_done": st["background_done"],
                         "bg_bases_skipped": st["background_skipped"],
                         "bg_worker_s": st["background_worker_s"]}
            else:
                per[c]["close"].append(run.close())
            if c in ("diffs", "fg"):
                keep[c] = run.dir
            elif r < rounds - 1 or c == "bg":
                shutil.rmtree(run.dir, ignore_errors=True)
    med = {c: {k: statistics.median(v) for k, v in m.items() if v} for c, m in per.items()}

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(per[a]["mean"], per[b]["mean"],
                                                        strict=True))

    fg_cost = [f - d for f, d in zip(per["fg"]["mean"], per["diffs"]["mean"], strict=True)]
    bg_cost = [b - d for b, d in zip(per["bg"]["mean"], per["diffs"]["mean"], strict=True)]
    saving = [(f - b) / f for f, b in zip(per["fg"]["mean"], per["bg"]["mean"], strict=True)]
    out = {
        "step_s": med,
        "ratio_to_none": {c: ratio(c, "none") for c in CONFIGS if c != "none"},
        "base_overhead_per_step_s": {"fg": statistics.median(fg_cost),
                                     "bg": statistics.median(bg_cost)},
        "training_time_saving_bg_vs_fg": statistics.median(saving),
        **extra,
    }
    return out, keep["diffs"], keep["fg"]


def compaction(diffs_log: str, fg_log: str, reps: int, workdir: str) -> dict[str, Any]:
    """Parts 2 and 3."""
    with LogReader(diffs_log) as r:
        n = len(r)
        last = r.durable_step
    replays, compacts, after = [], [], []
    for i in range(reps):
        t0 = time.perf_counter()
        replay_state(diffs_log)
        replays.append(time.perf_counter() - t0)
        work = os.path.join(workdir, f"compact{i}")
        shutil.copytree(diffs_log, work)
        t0 = time.perf_counter()
        res = compact(work, keep_bases=1, materializer=materialize_base)
        compacts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        replay_state(work)
        after.append(time.perf_counter() - t0)
        shutil.rmtree(work)
    work = os.path.join(workdir, "fgcompact")
    shutil.copytree(fg_log, work)
    before = log_bytes(work)
    with LogReader(work) as r:
        fg_bases, fg_steps = len(r.bases), len(r)
    res = compact(work, keep_bases=1, materializer=materialize_base)
    return {
        "replayed_steps": n, "compact_step": last,
        "replay_s": statistics.median(replays),
        "compact_s": statistics.median(compacts),
        "compact_over_replay": statistics.median(c / r for c, r in zip(compacts, replays,
                                                                         strict=True)),
        "materialize_s": res.materialize_s,
        "replay_after_compact_s": statistics.median(after),
        "disk_before_bytes": before, "disk_after_bytes": log_bytes(work),
        "disk_after_over_before": log_bytes(work) / before,
        "fg_log_bases": fg_bases, "fg_log_records": fg_steps,
    }


def run_all(size: str, rounds: int, steps: int, every: int, warmup: int, reps: int,
            workdir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    m = LM(*SIZES[size][:5])
    out: dict[str, Any] = {"size": size, "params": sum(p.numel() for p in m.parameters()),
                           "rounds": rounds, "steps": steps, "snapshot_every": every,
                           "cpus": os.cpu_count()}
    train, diffs_log, fg_log = training(size, rounds, steps, every, warmup, workdir)
    out["training"] = train
    out["compaction"] = compaction(diffs_log, fg_log, reps, workdir)
    return out


def test_bench_compaction_smoke(tmp_path: Any) -> None:
    """CI smoke: the benchmark runs end to end on a tiny model and reports sane numbers."""
    out = run_all("tiny", rounds=1, steps=12, every=4, warmup=1, reps=1, workdir=str(tmp_path))
    assert out["training"]["bg_bases_done"] >= 1
    assert out["compaction"]["disk_after_bytes"] < out["compaction"]["disk_before_bytes"]
    assert out["compaction"]["replay_after_compact_s"] > 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="9m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=20, help="snapshot_every of fg and bg")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="compaction / replay repetitions")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        out = run_all(args.size, args.rounds, args.steps, args.every, args.warmup, args.reps,
                      d)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    tr, co = out["training"], out["compaction"]
    print(f"model {args.size} ({out['params'] / 1e6:.1f}M params), AdamW, top-1% gradients, "
          f"1 torch thread, {out['cpus']} CPUs; {args.rounds} rounds x {args.steps} steps, "
          f"bases every {args.every} steps")
    print(f"  {'config':<6} {'mean ms':>8} {'median':>8} {'p95':>8} {'base +ms':>9} "
          f"{'close s':>8} {'/none':>7}")
    for c in CONFIGS:
        s = tr["step_s"][c]
        rat = tr["ratio_to_none"].get(c, 1.0)
        stall = f"{s['base_step_stall'] * 1e3:9.1f}" if "base_step_stall" in s else f"{'-':>9}"
        print(f"  {c:<6} {s['mean'] * 1e3:8.1f} {s['median'] * 1e3:8.1f} {s['p95'] * 1e3:8.1f} "
              f"{stall} {s['close']:8.2f} {rat:7.3f}")
    bo = tr["base_overhead_per_step_s"]
    print(f"  base overhead per step: fg {bo['fg'] * 1e3:.2f} ms, bg {bo['bg'] * 1e3:.2f} ms; "
          f"training time saved by bg vs fg: {100 * tr['training_time_saving_bg_vs_fg']:.1f}% "
          f"(bg bases made {tr['bg_bases_done']:.0f}, skipped {tr['bg_bases_skipped']:.0f})")
    print(f"  compaction of {co['replayed_steps']} steps: {co['compact_s']:.2f} s vs replay "
          f"{co['replay_s']:.2f} s = {co['compact_over_replay']:.2f}x; replay after compaction "
          f"{co['replay_after_compact_s']:.3f} s")
    print(f"  disk (fg log, {co['fg_log_bases']} bases, {co['fg_log_records']} records) "
          f"before {co['disk_before_bytes'] / 1e6:.1f} MB, after --keep-bases 1 "
          f"{co['disk_after_bytes'] / 1e6:.1f} MB = {co['disk_after_over_before']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
