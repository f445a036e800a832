#!/usr/bin/env python3
"""The training thread's share of a top-k step's capture, per message (issue 33).

Per parameter, a top-k checkpointer's pre-step hook makes a ``TopKMessage`` and asks the
step batch for its record tensor (``StepBatch.spec``: ships the pair into the batch,
builds the deferred encoding). On a launch-bound GPU loop those microseconds add to the
step one for one (366 parameters at 940M). This times that per message, on the device-sort
path (what a CUDA step takes; here on CPU tensors, nothing copied), ``--rounds`` batches
of ``--params`` messages, and prints the median and minimum microseconds per message.

Run:   python bench/bench_capture_path.py [--params 366] [--rounds 30]
Smoke: python -m pytest bench/bench_capture_path.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from lowdiff_store.torch.compressors.topk import TopKMessage
from lowdiff_store.torch.core.step_batch import HostPool, StepBatch


def run(params: int = 366, rounds: int = 30, numel: int = 4096, k: int = 40
        ) -> dict[str, float]:
    """Microseconds per message over ``rounds`` step batches (median, minimum)."""
    torch.set_num_threads(1)
    pairs = []
    for _ in range(params):
        g = torch.randn(numel)
        idx = torch.topk(g.abs(), k, sorted=False).indices
        pairs.append((idx, g.index_select(0, idx)))
    pool = HostPool()
    per: list[float] = []
    for _ in range(rounds):
        batch = StepBatch(pool, sort_on_device=True)
        t0 = time.perf_counter()
        for i, (idx, vals) in enumerate(pairs):
            m = TopKMessage(idx, vals, numel)
            batch.spec(f"@grad/p{i}", m.tag, (numel,), m, None, m.nbytes)
        per.append((time.perf_counter() - t0) / params * 1e6)
    return {"median_us": statistics.median(per), "min_us": min(per)}


def test_bench_capture_path_smoke() -> None:
    out = run(params=8, rounds=2)
    assert 0 < out["min_us"] <= out["median_us"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=366)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    out = run(args.params, args.rounds)
    print(f"us per message: median {out['median_us']:.2f}, min {out['min_us']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
