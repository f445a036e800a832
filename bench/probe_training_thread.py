#!/usr/bin/env python3
"""Where the training thread's time goes per step (issue 49; bench/RESULTS.md, "ninth
session"): one process runs bench_torch's configurations interleaved round by round and,
per step of each, reads the training thread's own clocks and counters:

  wall_ms     the step (``Run.step``: its batch, train_step, the after-step work)
  cpu_ms      the thread's CPU time in it (``time.thread_time``)
  off_cpu_ms  wall - CPU, per step: waiting (the GIL, a lock, the writer) or preempted
  minflt      minor page faults of the thread (``getrusage(RUSAGE_THREAD)``): memory
              the heap gave back to the kernel and the step touched again
  sys_ms      the thread's kernel time (page faults are most of it)

Each figure is the median over every measured step. Counts, not ratios: a minor fault is
a fault on any machine, which is why it found what five rounds of noisy ratios did not
(``lowdiff_store/torch/capture/heap.py``).

Run:  PYTHONPATH=$PWD python bench/probe_training_thread.py [--configs dense,dense+ld]
      [--rounds 6] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from bench_torch import CONFIGS, Run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="dense,dense+ld,dense+raw",
                    help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--size", default="20m")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.configs.split(",")
    d = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    keys = ("wall", "cpu", "off", "flt", "sys")
    per: dict[str, dict[str, list[float]]] = {c: {k: [] for k in keys} for c in names}
    try:
        runs = {c: Run(c, args.size, d) for c in names}
        for r in runs.values():
            for _ in range(3):
                r.step()
        for _ in range(args.rounds):
            for c in names:
                r, out = runs[c], per[c]
                for _ in range(args.steps):
                    u0 = resource.getrusage(resource.RUSAGE_THREAD)
                    w0, c0 = time.perf_counter(), time.thread_time()
                    r.step()
                    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
                    u1 = resource.getrusage(resource.RUSAGE_THREAD)
                    out["wall"].append(wall * 1e3)
                    out["cpu"].append(cpu * 1e3)
                    out["off"].append((wall - cpu) * 1e3)
                    out["flt"].append(u1.ru_minflt - u0.ru_minflt)
                    out["sys"].append((u1.ru_stime - u0.ru_stime) * 1e3)
        for r in runs.values():
            r.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    names_out = {"wall": "wall_ms", "cpu": "cpu_ms", "off": "off_cpu_ms", "flt": "minflt",
                 "sys": "sys_ms"}
    result = {c: {names_out[k]: round(statistics.median(v), 1) for k, v in per[c].items()}
              for c in names}
    with open("/proc/loadavg") as fh:
        result["load"] = fh.read().split()[:3]  # type: ignore[assignment]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
