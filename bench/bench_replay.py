#!/usr/bin/env python3
"""Replay speed: the per-step cost of `restore()` against `optimizer.step()` alone.

A dense AdamW log of the ~20M-parameter LM of `bench_torch.py` is written once (a base at
step 0, a diff every step), then compacted so that it also has a base at step 4, which
holds the optimizer state, as every base after a job's first does. Each round, in one
process and interleaved (short and long in alternating order, after a warm-up restore):

  short   restore to step 4+2
  long    restore to step 4+2+N
  opt     `optimizer.step()` alone on the objects the long restore produced (the same
          state tensors) with the next step's gradients from the log (median of N/2 calls)

and the replay cost per step is the *marginal* one, (long - short) / N: what one more step
of the chain costs, without the one-off open and base load (reported separately). Ratios
are taken per round (same machine conditions) and reported as median, min and max.

A difference of two restores is noisy on a shared machine (each is ~1 s of a machine whose
step time moves by 30% from second to second), so each round also takes the *in-loop* cost
from inside the long restore: the time from its first to its last ``progress`` call over N
(every replayed step with its decode wait, digest checks and bookkeeping; not the open and
base load), against the *mean* of the N/2 ``optimizer.step()`` calls (mean against mean:
the digest steps are part of replay's cost).

`--from-zero` also measures the chain from the step-0 base to step 3 (three steps; the
first allocates the optimizer's state, as training's first step did), whole restore time
per step, open and base load included.

`--busy` starts one busy process beside the benchmark (a single-threaded matmul loop: a
second training job on the other core), the "busy machine" case.

`--malloc fixed` (the default) sets glibc's mmap and trim thresholds (``mallopt``: 32 MiB,
1 GiB) before anything is allocated, for the whole process, replay and baseline alike.
With glibc's dynamic defaults, whether a step's ~50 MB of optimizer temporaries are handed
back to the kernel at each free and faulted in again (~12,000 minor faults, +20 ms on a
42 ms AdamW step) depends on where they happen to sit in the heap, and flips from one
restore to the next: the figure then measures the heap's luck more than replay. `--malloc
default` leaves glibc as it is. Either way the main thread's minor faults per step are
reported for both sides (``faults_in_loop``, ``faults_opt``).

Run:   python bench/bench_replay.py [--rounds 5] [--steps 20] [--busy] [--malloc fixed|default]
       [--json]
Smoke: python -m pytest bench/bench_replay.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _lm import LM, batch_for, train_step

from lowdiff_store import LogReader
from lowdiff_store.compaction import compact
from lowdiff_store.torch import DiffCheckpointer, restore
from lowdiff_store.torch.api import TorchMaterializer

BASE = 4  # the compacted base (holding optimizer state) that short and long start from
SIZES = {"20m": (8192, 64, 384, 8, 6, 4), "tiny": (128, 8, 32, 1, 2, 2)}

BUSY = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\n"
        "while True:\n    a = torch.tanh(a @ a) \n")


def fix_allocator() -> bool:
    """glibc only: fixed mmap (32 MiB) and trim (1 GiB) thresholds for this process (see the
    module docstring). False where there is no glibc ``mallopt``."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def _faults() -> int:
    """Minor page faults of the calling thread so far."""
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


def _objects(size: str) -> tuple[LM, torch.optim.Optimizer]:
    vocab, ctx, dim, layers, heads, _batch = SIZES[size]
    torch.manual_seed(0)
    model = LM(vocab, ctx, dim, layers, heads)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def build_log(size: str, steps: int, path: str) -> None:
    """Train ``steps`` steps with a diff every step; then add a base at step 4."""
    vocab, ctx, _dim, _layers, _heads, batch = SIZES[size]
    model, opt = _objects(size)
    with DiffCheckpointer(path, model, opt, snapshot_every=10**9, batch=1):
        for s in range(steps):
            train_step(model, opt, batch_for(s, vocab, batch, ctx))
    compact(path, step=BASE, keep_bases=2, materializer=TorchMaterializer(path))


def _timed_restore(path: str, size: str, step: int
                   ) -> tuple[float, LM, torch.optim.Optimizer, float, float]:
    """(seconds, model, optimizer, in-loop seconds and minor faults per replayed step)."""
    model, opt = _objects(size)
    marks: list[tuple[float, int]] = []
    t = time.perf_counter()
    res = restore(path, model, opt, step=step,
                  progress=lambda done, total: marks.append((time.perf_counter(), _faults())))
    took = time.perf_counter() - t
    assert res.base_step == BASE, (res.base_step, step)
    assert res.replayed == step - BASE, (res.replayed, step)
    assert len(marks) == res.replayed + 1, len(marks)
    return (took, model, opt, (marks[-1][0] - marks[0][0]) / res.replayed,
            (marks[-1][1] - marks[0][1]) / res.replayed)


def _opt_step(path: str, model: LM, opt: torch.optim.Optimizer, step: int, calls: int
              ) -> tuple[float, float, float]:
    """Median and mean `optimizer.step()` time, and minor faults per call, on the objects
    replay just restored (the same state tensors, so the same memory) with the gradients of
    ``step`` from the log."""
    with LogReader(path) as r:
        rec = r.record(step)
        for n, p in model.named_parameters():
            p.grad = torch.from_numpy(rec.tensor("@grad/" + n).copy())
    times = []
    f0 = _faults()
    for _ in range(calls):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times), statistics.mean(times), (_faults() - f0) / calls


def run(size: str, rounds: int, steps: int, workdir: str, *, from_zero: bool = False,
        busy: bool = False, malloc: str = "default") -> dict[str, Any]:
    fixed = malloc == "fixed" and fix_allocator()
    torch.set_num_threads(1)
    path = os.path.join(workdir, "log")
    build_log(size, BASE + steps + 4, path)
    proc = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    load0 = os.getloadavg()
    try:
        if proc is not None:
            time.sleep(2.0)  # let it reach full speed
        per: dict[str, list[float]] = {k: [] for k in
                                       ("short", "long", "opt", "marginal", "ratio",
                                        "in_loop", "opt_mean", "in_loop_ratio",
                                        "faults_in_loop", "faults_opt",
                                        "zero_per_step", "zero_ratio")}
        _timed_restore(path, size, BASE + 2)  # warm-up: page cache, allocator
        for i in range(rounds):
            if i % 2:
                long_, model, optim, in_loop, flt = _timed_restore(path, size,
                                                                   BASE + 2 + steps)
                short = _timed_restore(path, size, BASE + 2)[0]
            else:
                short = _timed_restore(path, size, BASE + 2)[0]
                long_, model, optim, in_loop, flt = _timed_restore(path, size,
                                                                   BASE + 2 + steps)
            opt, opt_mean, opt_flt = _opt_step(path, model, optim, BASE + 3 + steps,
                                               max(5, steps // 2))
            del model, optim
            marginal = (long_ - short) / steps
            per["short"].append(short)
            per["long"].append(long_)
            per["opt"].append(opt)
            per["marginal"].append(marginal)
            per["ratio"].append(marginal / opt)
            per["in_loop"].append(in_loop)
            per["opt_mean"].append(opt_mean)
            per["in_loop_ratio"].append(in_loop / opt_mean)
            per["faults_in_loop"].append(flt)
            per["faults_opt"].append(opt_flt)
            if from_zero:
                model, o = _objects(size)
                t = time.perf_counter()
                res = restore(path, model, o, step=BASE - 1)  # from base 0: allocation
                z = time.perf_counter() - t
                assert res.base_step == 0
                assert res.replayed == BASE - 1
                per["zero_per_step"].append(z / (BASE - 1))
                per["zero_ratio"].append(z / (BASE - 1) / opt)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    load1 = os.getloadavg()

    def mmm(v: list[float]) -> dict[str, float]:
        return {"median": statistics.median(v), "min": min(v), "max": max(v)} if v else {}

    return {"size": size, "rounds": rounds, "steps": steps, "busy": busy,
            "malloc": "fixed" if fixed else "glibc default",
            "loadavg_start": load0, "loadavg_end": load1,
            **{k: mmm(v) for k, v in per.items()}, "per_round": per}


def test_bench_replay_smoke(tmp_path: Any) -> None:
    out = run("tiny", 1, 3, str(tmp_path), from_zero=True)
    # a difference of two timings: on a busy machine it can come out negative (the smoke
    # checks the measurement runs and is a number; bench/RESULTS.md has the figures)
    assert math.isfinite(out["marginal"]["median"])
    assert out["opt"]["median"] > 0
    assert len(out["per_round"]["ratio"]) == 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="20m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--from-zero", action="store_true")
    ap.add_argument("--busy", action="store_true")
    ap.add_argument("--malloc", choices=("fixed", "default"), default="fixed",
                    help="glibc thresholds fixed for the whole process, or glibc's dynamic "
                         "defaults (see the module docstring)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        out = run(args.size, args.rounds, args.steps, d, from_zero=args.from_zero,
                  busy=args.busy, malloc=args.malloc)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    r, m, o = out["ratio"], out["marginal"], out["opt"]
    print(f"model {args.size}, {args.rounds} rounds, {args.steps} replayed steps"
          f"{', beside one busy process' if args.busy else ''}; malloc {out['malloc']}; load "
          f"{out['loadavg_start'][0]:.2f} -> {out['loadavg_end'][0]:.2f}")
    print(f"  replay per step (marginal) {m['median'] * 1000:.1f} ms; optimizer.step() "
          f"{o['median'] * 1000:.1f} ms; ratio median {r['median']:.2f} "
          f"(min {r['min']:.2f}, max {r['max']:.2f})")
    il = out["in_loop_ratio"]
    print(f"  in-loop per step {out['in_loop']['median'] * 1000:.1f} ms; optimizer.step() mean "
          f"{out['opt_mean']['median'] * 1000:.1f} ms; ratio median {il['median']:.2f} "
          f"(min {il['min']:.2f}, max {il['max']:.2f})")
    print(f"  minor faults per step (main thread): in the loop "
          f"{out['faults_in_loop']['median']:.0f}, optimizer.step() "
          f"{out['faults_opt']['median']:.0f}")
    print(f"  restore of base {BASE} + 2 steps (open, base load, 2 steps): "
          f"{out['short']['median'] * 1000:.0f} ms")
    if args.from_zero:
        z = out["zero_ratio"]
        print(f"  from the step-0 base (state allocated by the first step): "
              f"{out['zero_per_step']['median'] * 1000:.1f} ms/step = {z['median']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
