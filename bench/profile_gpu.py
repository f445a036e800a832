#!/usr/bin/env python3
"""Where the log's per-step cost goes on a GPU (issue 33): top-1% + log against top-1% alone.

Two copies of the benchmark LM (``bench/bench_gpu.py``'s ``Run``), warmed, then for each:

1. step times split into the host's part (until ``optimizer.step()`` returns, nothing
   synchronized) and the whole step (the training stream synchronized): a host part that
   grows with the log means the training thread itself is slowed (hooks, the GIL, a hidden
   synchronization); a whole step that grows with a flat host part means device work;
2. the same with ``sys.setswitchinterval(5e-4)`` (the writer's threads cut into short GIL
   turns): a gain means the GIL is the cost;
3. ``torch.profiler`` of ``--prof-steps`` steps: the CPU ops by self time (synchronizing
   calls, host allocations) and the CUDA kernels by device time;
4. ``cProfile`` of the training thread over ``--prof-steps`` steps (top-1% + log).

Run (H100):  python bench/profile_gpu.py --size 940m --out DIR
Smoke (CPU): python bench/profile_gpu.py --size tiny --out DIR
Writes ``DIR/profile_gpu.txt`` and ``DIR/profile_gpu.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu import Run


def split_step(run: Run) -> tuple[float, float]:
    """One step: (seconds until ``optimizer.step()`` returned, seconds until the training
    stream was done)."""
    run.step()
    return run.host_s[-1], run.stream_s[-1]


def timed(runs: dict[str, Run], steps: int, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of ``steps`` split steps per run: medians of host and whole."""
    host: dict[str, list[float]] = {c: [] for c in runs}
    whole: dict[str, list[float]] = {c: [] for c in runs}
    for _ in range(rounds):
        for c, r in runs.items():
            for _ in range(steps):
                h, w = split_step(r)
                host[c].append(h)
                whole[c].append(w)
    return {c: {"host_median_s": statistics.median(host[c]),
                "step_median_s": statistics.median(whole[c]),
                "step_mean_s": statistics.fmean(whole[c]),
                "host_s": host[c], "step_s": whole[c]} for c in runs}


def torch_prof(run: Run, steps: int, rows: int) -> str:
    """``torch.profiler`` tables of ``steps`` steps of ``run``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if run.dev.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            split_step(run)
    ka = prof.key_averages()
    out = [f"--- {run.name}: CPU ops by self CPU time ({steps} steps)",
           ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)]
    if run.dev.type == "cuda":
        out += [f"--- {run.name}: by device time",
                ka.table(sort_by="self_device_time_total", row_limit=rows,
                         max_name_column_width=60)]
    return "\n".join(out)


def c_prof(run: Run, steps: int, rows: int) -> str:
    """``cProfile`` of the training thread over ``steps`` steps."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        split_step(run)
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(rows)
    st.sort_stats("cumulative").print_stats(rows)
    return f"--- {run.name}: cProfile, training thread ({steps} steps)\n" + s.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="940m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prof-steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    res: dict[str, Any] = {"size": args.size, "device": torch.cuda.get_device_name(dev)
                           if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    txt: list[str] = []

    def save() -> None:
        with open(os.path.join(args.out, "profile_gpu.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        with open(os.path.join(args.out, "profile_gpu.txt"), "w") as fh:
            fh.write("\n\n".join(txt))

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        runs = {c: Run(c, args.size, dev, d, pre_steps=2) for c in ("topk", "topk+log")}
        for r in runs.values():
            for _ in range(2):
                split_step(r)
        for label, si in (("default", None), ("switch5e-4", 5e-4)):
            old = sys.getswitchinterval()
            if si is not None:
                sys.setswitchinterval(si)
            t0 = time.perf_counter()
            res[label] = timed(runs, args.steps, args.rounds)
            sys.setswitchinterval(old)
            a, b = res[label]["topk+log"], res[label]["topk"]
            line = (f"{label}: topk+log/topk whole {a['step_median_s'] / b['step_median_s']:.3f}"
                    f" (mean {a['step_mean_s'] / b['step_mean_s']:.3f}), host "
                    f"{a['host_median_s']:.4f} vs {b['host_median_s']:.4f} s, whole "
                    f"{a['step_median_s']:.4f} vs {b['step_median_s']:.4f} s "
                    f"({time.perf_counter() - t0:.0f} s)")
            print(line, flush=True)
            txt.append(line)
            save()
        for c in ("topk+log", "topk"):
            txt.append(torch_prof(runs[c], args.prof_steps, args.rows))
            save()
            print(f"torch.profiler {c} done", flush=True)
        txt.append(c_prof(runs["topk+log"], args.prof_steps, args.rows))
        ck = runs["topk+log"].ckpt
        if ck is not None:
            res["checkpointer_stats"] = {k: v for k, v in ck.stats().items()
                                         if isinstance(v, (int, float, str))} \
                if hasattr(ck, "stats") else None
        save()
        for r in runs.values():
            r.close(remove=True)
    print("\n\n".join(txt[:2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
