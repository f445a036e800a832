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

The load's record is ``--tensors`` top-k messages (default 300, a step of a model of 300
parameters): the encoder thread's work is then a Python loop over tensors, which holds
the GIL, besides the numpy/zstd/crc32c calls on whole buffers, which release it.

Reported: p50, p90, p99 and max step time of each, and the ratios for each percentile
(medians over rounds). A writer that held the GIL for long stretches shows in p99 / max.

Run:   python bench/bench_jitter.py [--rounds 5] [--steps 200] [--record-mib 16]
                                    [--tensors 300] [--switch-interval 0.0005]
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
from lowdiff_store.log.tensors import from_encoded
from lowdiff_store.log.writer import LogWriter
from lowdiff_store.torch import DiffCheckpointer
from lowdiff_store.torch.compressors.topk import TopKMessage
from lowdiff_store.torch.core.step_batch import HostPool, StepBatch
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
    """A writer kept busy: one record of top-k messages per :meth:`feed`. With
    ``tensors`` > 1 the record is what a checkpointer's step makes: that many top-k
    messages (``record_mib`` in all) in one :class:`StepBatch`, sorted and gap-encoded on
    the encoder thread, one tensor after the other."""

    def __init__(self, path: str, record_mib: float, tensors: int = 1) -> None:
        self.w = AsyncLogWriter(path, memory_budget=1 << 30)
        k = int(record_mib * (1 << 20) / 12)  # int64 index + float32 value
        rng = np.random.default_rng(0)
        self.tensors = tensors
        self.numel = 100 * k
        self.idx = rng.choice(self.numel, size=k, replace=False).astype(np.int64)
        self.vals = rng.standard_normal(k).astype(np.float32)
        per = max(1, k // tensors)
        self.msgs = [TopKMessage(torch.from_numpy(rng.choice(100 * per, size=per,
                                                             replace=False)),
                                 torch.from_numpy(self.vals[:per].copy()), 100 * per)
                     for _ in range(tensors)] if tensors > 1 else []
        self.pool = HostPool()
        self.step = 0

    def _encode(self) -> codecs.Encoded:
        order = np.argsort(self.idx)  # what the step batch's encoder does on CPU
        return codecs.encode_sparse(self.idx[order], self.vals[order], self.numel, "F32")

    def _specs(self) -> tuple[list[TensorSpec], Any]:
        if not self.msgs:
            return [TensorSpec("g", "F32", encoded=DeferredEncoding(
                self._encode, self.idx.nbytes), shape=(self.numel,))], None
        batch = StepBatch(self.pool)
        specs = [batch.spec(f"g{i}", "F32", (m.numel,), m, None, m.nbytes)
                 for i, m in enumerate(self.msgs)]
        batch.ship()
        bufs = batch.buffers
        return [TensorSpec(s.name, s.tag, encoded=s.enc, shape=s.shape) for s in specs], \
            lambda: self.pool.give(bufs)

    def feed(self) -> None:
        """Queue one record unless two are already waiting (the training loop's pace)."""
        if self.w.stats()["queued"] >= 2:
            return
        self.step += 1
        specs, done = self._specs()
        self.w.append(self.step, specs, kind="grad", owned=True, on_release=done)

    def close(self) -> None:
        self.w.close()


def run(rounds: int, steps: int, record_mib: float, workdir: str, tensors: int = 1
        ) -> dict[str, Any]:
    """Interleaved rounds of ``idle`` (no checkpointer) and ``busy`` (a checkpointer and
    the load)."""
    torch.set_num_threads(1)
    x = torch.randn(16, 256)
    runs: dict[str, list[list[float]]] = {"idle": [], "busy": []}
    idle_model, idle_opt = _model()
    busy_model, busy_opt = _model()
    ck = DiffCheckpointer(os.path.join(workdir, "ckpt"), busy_model, busy_opt,
                          snapshot_every=10**9)
    load = Load(os.path.join(workdir, "load"), record_mib, tensors)

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
        if busy:
            load.w.flush()  # the idle round starts with no record in flight
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
    return {"rounds": rounds, "steps": steps, "record_mib": record_mib, "tensors": tensors,
            "records_written": load.step,
            "step_s": {n: dict(zip([f"p{p}" for p in PCTS], v, strict=True))
                       for n, v in med.items()},
            "busy_over_idle": ratio}


def encode_s(record_mib: float, tensors: int, reps: int = 7) -> float:
    """The encoder thread's work for one load record (the step batch's sort, the codecs,
    the record layout and CRCs), run on this thread: median seconds over ``reps``."""
    with tempfile.TemporaryDirectory() as d:
        load = Load(os.path.join(d, "log"), record_mib, tensors)
        try:
            out = []
            for _ in range(reps + 1):
                specs, done = load._specs()
                t0 = time.perf_counter()
                inputs = [from_encoded(s.name, s.dtype, tuple(map(int, s.shape or ())),
                                       s.encoded.encode() if isinstance(
                                           s.encoded, DeferredEncoding) else s.encoded)
                          for s in specs]
                LogWriter.build(1, inputs, kind="grad")
                out.append(time.perf_counter() - t0)
                if done is not None:
                    done()
        finally:
            load.close()
    return statistics.median(out[1:])


@pytest.mark.bench
def test_bench_jitter_smoke(tmp_path: Any) -> None:
    out = run(rounds=1, steps=10, record_mib=0.5, workdir=str(tmp_path), tensors=50)
    assert out["records_written"] >= 1
    assert encode_s(0.5, 50, reps=1) > 0
    assert all(v > 0 for v in out["busy_over_idle"].values())
    assert out["step_s"]["idle"]["p50"] <= out["step_s"]["idle"]["p100"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--record-mib", type=float, default=16.0)
    ap.add_argument("--tensors", type=int, default=300,
                    help="top-k messages per load record (1: one big tensor)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run (seconds; default: Python's, "
                         "5 ms)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        out = run(args.rounds, args.steps, args.record_mib, d, args.tensors)
    out["encode_ms"] = encode_s(args.record_mib, args.tensors) * 1e3
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{args.rounds} rounds x {args.steps} steps, {args.record_mib} MiB records of "
          f"{args.tensors} tensors, {out['records_written']} written; encoding one "
          f"record: {out['encode_ms']:.1f} ms")
    print("| | p50 | p90 | p99 | max |\n|---|---:|---:|---:|---:|")
    for n in ("idle", "busy"):
        v = out["step_s"][n]
        print(f"| {n} (ms) | " + " | ".join(f"{v[f'p{p}'] * 1e3:.2f}" for p in PCTS) + " |")
    r = out["busy_over_idle"]
    print("| busy / idle | " + " | ".join(f"{r[f'p{p}']:.2f}" for p in PCTS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
