#!/usr/bin/env python3
"""The writer process's start (issue 49's goal: checkpointer open to the end of the first
step at most 0.5 s beyond the in-thread writer's), measured side by side in one process:
``DiffCheckpointer(...)`` then one training step, with ``writer_process=False`` and
``True`` alternating, ``--runs`` times each after one warm-up of each (the first open
imports the modules). A new log does not wait for the writer process to open it: the
first steps queue in the ring meanwhile. Also the spawn-to-ready time the ring client
notes (``stats()["writer_ring_start_s"]``, seen while a flush after the step waits).

Run:  python bench/bench_writer_process.py [--runs 7] [--json]
Smoke: python -m pytest bench/bench_writer_process.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowdiff_store.torch import DiffCheckpointer, TopKCompressor


def _open_and_step(path: str, process: bool) -> tuple[float, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 256)
    t0 = time.perf_counter()
    ck = DiffCheckpointer(path, model, opt, compressor=TopKCompressor(0.01),
                          snapshot_every=100, writer_process=process)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    took = time.perf_counter() - t0
    ck.flush()  # (the ring client notes the writer's start while it waits)
    start = float(ck.stats().get("writer_ring_start_s", 0.0))
    ck.close()
    return took, start


def run(runs: int, workdir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    times: dict[bool, list[float]] = {False: [], True: []}
    spawn: list[float] = []
    for i in range(runs + 1):
        for process in (False, True):
            took, start = _open_and_step(os.path.join(workdir, f"{i}-{process}"), process)
            if i:  # (run 0 warms the imports up)
                times[process].append(took)
                if process:
                    spawn.append(start)
    thread, proc = (statistics.median(times[p]) for p in (False, True))
    return {"runs": runs, "open_to_first_step_s": {"thread": thread, "process": proc},
            "beyond_thread_s": proc - thread,
            "beyond_thread_s_per_run": [p - t for p, t in zip(times[True], times[False],
                                                               strict=True)],
            "spawn_to_ready_s": statistics.median(spawn),
            "spawn_to_ready_min_max_s": [min(spawn), max(spawn)],
            "loadavg": os.getloadavg()}


def test_bench_writer_process_smoke(tmp_path: Any) -> None:
    """CI smoke: it runs and measures both paths."""
    out = run(1, str(tmp_path))
    assert out["open_to_first_step_s"]["process"] > 0
    assert out["spawn_to_ready_s"] > 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        out = run(args.runs, d)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    o = out["open_to_first_step_s"]
    print(f"open + first step, median of {args.runs}: in-thread writer {o['thread']:.3f} s, "
          f"writer process {o['process']:.3f} s: {out['beyond_thread_s']:+.3f} s "
          f"(per run {min(out['beyond_thread_s_per_run']):+.3f} .. "
          f"{max(out['beyond_thread_s_per_run']):+.3f})")
    lo, hi = out["spawn_to_ready_min_max_s"]
    print(f"spawn to ready (ring client): median {out['spawn_to_ready_s']:.3f} s "
          f"({lo:.3f} .. {hi:.3f}); load average {out['loadavg']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
