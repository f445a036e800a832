#!/usr/bin/env python3
"""Step-time jitter of a launch-bound training thread while the writer's threads are busy
(issue 33, item 2): the writer shares the GIL with training, so what matters is how long
it holds it at a time, not its total work.

The training thread runs small steps (a 6-layer MLP of width 256, batch 16: forward,
backward, AdamW; ~1-3 ms of many short torch calls, each needing the GIL back), torch
threads 1. Interleaved by rounds, in one process:

  idle     the steps alone (no checkpointer)
  busy     the same steps, a DiffCheckpointer on them, and beside them a second log whose
           writer gets, every step, a record of ``--record-mib`` MiB of top-k messages
           (sparse pairs sorted and gap-encoded on the encoder thread, CRC32C, write,
           fdatasync): the encoder and committer threads are busy all the time

Reported: p50, p90, p99 and max step time of each, and busy / idle for each percentile
(medians over rounds). A writer that held the GIL for long stretches shows in p99 / max.

Run:   python bench/bench_jitter.py [--rounds 5] [--steps 200] [--record-mib 16]
Smoke: python -m pytest bench/bench_jitter.py
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

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowdiff_store import codecs
from lowdiff_store.torch import DiffCheckpointer
from lowdiff_store.writer import AsyncLogWriter, TensorSpec
from lowdiff_store.writer.deferred import DeferredEncoding

PCTS = (50, 90, 99, 100)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


class Load:
    """A writer kept busy: one record of top-k messages per :meth:`feed`."""

    def __init__(self, path: str, record_mib: float) -> None:
        self.w = AsyncLogWriter(path, memory_budget=1 << 30)
        k = int(record_mib * (1 << 20) / 12)  # int64 index + float32 value
        rng = np.random.default_rng(0)
        self.numel = 100 * k
        self.idx = rng.choice(self.numel, size=k, replace=False).astype(np.int64)
        self.vals = rng.standard_normal(k).astype(np.float32)
        self.step = 0

    def _encode(self) -> codecs.Encoded:
        order = np.argsort(self.idx)  # what the step batch's encoder does on CPU
        return codecs.encode_sparse(self.idx[order], self.vals[order], self.numel, "F32")

    def feed(self) -> None:
        """Queue one record unless two are already waiting (the training loop's pace)."""
        if self.w.stats()["queued"] >= 2:
            return
        self.step += 1
        spec = TensorSpec("g", "F32", encoded=DeferredEncoding(self._encode, self.idx.nbytes),
                          shape=(self.numel,))
        self.w.append(self.step, [spec], kind="grad", owned=True)

    def close(self) -> None:
        self.w.close()


def run(rounds: int, steps: int, record_mib: float, workdir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    x = torch.randn(16, 256)
    runs: dict[str, list[list[float]]] = {"idle": [], "busy": []}
    idle_model, idle_opt = _model()
    busy_model, busy_opt = _model()
    ck = DiffCheckpointer(os.path.join(workdir, "ckpt"), busy_model, busy_opt,
                          snapshot_every=10**9)
    load = Load(os.path.join(workdir, "load"), record_mib)

    def steps_of(model: torch.nn.Module, opt: torch.optim.Optimizer, busy: bool
                 ) -> list[float]:
        out = []
        for _ in range(steps):
            if busy:
                load.feed()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
            out.append(time.perf_counter() - t0)
        return out

    try:
        steps_of(idle_model, idle_opt, False)  # warm-up
        steps_of(busy_model, busy_opt, True)
        for _ in range(rounds):
            runs["idle"].append(steps_of(idle_model, idle_opt, False))
            runs["busy"].append(steps_of(busy_model, busy_opt, True))
    finally:
        ck.close()
        load.close()
    pct = {name: [[float(np.percentile(r, p)) for p in PCTS] for r in rs]
           for name, rs in runs.items()}
    med = {name: [statistics.median(r[i] for r in v) for i in range(len(PCTS))]
           for name, v in pct.items()}
    ratio = {f"p{p}": statistics.median(b[i] / a[i] for a, b in
                                        zip(pct["idle"], pct["busy"], strict=True))
             for i, p in enumerate(PCTS)}
    return {"rounds": rounds, "steps": steps, "record_mib": record_mib,
            "records_written": load.step,
            "step_s": {n: dict(zip([f"p{p}" for p in PCTS], v, strict=True))
                       for n, v in med.items()},
            "busy_over_idle": ratio}


@pytest.mark.bench
def test_bench_jitter_smoke(tmp_path: Any) -> None:
    out = run(rounds=1, steps=10, record_mib=0.5, workdir=str(tmp_path))
    assert out["records_written"] >= 1
    assert all(v > 0 for v in out["busy_over_idle"].values())
    assert out["step_s"]["idle"]["p50"] <= out["step_s"]["idle"]["p100"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--record-mib", type=float, default=16.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        out = run(args.rounds, args.steps, args.record_mib, d)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{args.rounds} rounds x {args.steps} steps, {args.record_mib} MiB records, "
          f"{out['records_written']} written")
    print("| | p50 | p90 | p99 | max |\n|---|---:|---:|---:|---:|")
    for n in ("idle", "busy"):
        v = out["step_s"][n]
        print(f"| {n} (ms) | " + " | ".join(f"{v[f'p{p}'] * 1e3:.2f}" for p in PCTS) + " |")
    r = out["busy_over_idle"]
    print("| busy / idle | " + " | ".join(f"{r[f'p{p}']:.2f}" for p in PCTS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
