#!/usr/bin/env python3
"""The encoder thread's work for one top-k step, per-tensor codec vs the step batch's
batched encode (issue 33, item 2).

The step: one top-1% message per parameter of the benchmark LM of ``bench/_lm.py`` at
``bench/bench_gpu.py``'s size "940m" (dim 1536, 30 layers, vocab 32768, context 1024;
built on the meta device for its shapes) or with ``--dim`` / ``--layers`` / ``--vocab``
scaled down (the same number of tensors, fewer elements). CPU tensors, the CPU step batch
(the host's batched sort on the encoder thread), ``torch.set_num_threads(1)``.

Per step the pairs are shipped (the training thread's part, not timed), then the encoder's
work is timed on this thread, alternating in each round:

  per-tensor   ``batch.wait()``, then per message ``codecs.encode_sparse`` of its sorted
               pairs (validation: unique, in range, ascending; the gaps; the cast): the
               encoder before the batched encode
  batched      ``batch.wait()``, then ``TopKMessage.encode`` (the index parts of the whole
               step made with a few whole-array numpy calls; per tensor, views)

each followed by the record layout (``from_encoded``, ``LogWriter.build`` with its CRCs),
as on the writer's encoder thread. Reported: thread CPU seconds per step (encode alone and
the messages' codec alone, with the host's batched sort before it, and with the record
layout after it), and the Python-level calls per step of the messages' codec (Python
functions and C functions called from Python, counted with ``sys.setprofile`` in a
separate pass: each is a stretch that holds the GIL), medians over rounds; the two
records are checked byte for byte equal.

Run:   python bench/bench_encode_batch.py [--rounds 5] [--dim 1536] [--layers 30]
Smoke: python -m pytest bench/bench_encode_batch.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._lm import LM
from lowdiff_store import codecs
from lowdiff_store.format.dtypes import storage_dtype
from lowdiff_store.log.tensors import from_encoded
from lowdiff_store.log.writer import LogWriter
from lowdiff_store.torch.compressors.topk import TopKMessage
from lowdiff_store.torch.core.step_batch import HostPool, StepBatch


def shapes(vocab: int, ctx: int, dim: int, layers: int, heads: int) -> list[tuple[int, ...]]:
    """The parameter shapes of the benchmark LM (built on the meta device)."""
    with torch.device("meta"):
        model = LM(vocab, ctx, dim, layers, heads)
    return [tuple(p.shape) for p in model.parameters()]


def messages(shps: list[tuple[int, ...]], ratio: float, seed: int
             ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per shape: top-``ratio`` pairs (unique indices in random order, fp32 values)."""
    rng = np.random.default_rng(seed)
    out = []
    for s in shps:
        numel = int(np.prod(s))
        k = min(numel, max(1, int(numel * ratio)))
        idx = np.unique(rng.integers(0, numel, size=k + k // 4 + 8))
        if idx.size < k:
            idx = rng.permutation(numel)[:k]
        idx = rng.permutation(idx)[:k].astype(np.int64)
        vals = rng.standard_normal(k, dtype=np.float32)
        out.append((torch.from_numpy(idx), torch.from_numpy(vals), numel))
    return out


def old_encode(m: TopKMessage, batch: StepBatch) -> codecs.Encoded:
    """The encoder's per-tensor codec before the batched encode."""
    assert m.slot is not None
    idx, vals = batch.sparse(m.slot)
    want = storage_dtype(m.tag)
    return codecs.encode_sparse(idx, vals if vals.dtype == want else vals.view(want),
                                m.numel, m.tag, delta=True)


def new_encode(m: TopKMessage, batch: StepBatch) -> codecs.Encoded:
    """The batched encode (``TopKMessage.encode``)."""
    enc = m.encode(batch)
    assert enc is not None
    return enc


Encoder = Callable[[TopKMessage, StepBatch], codecs.Encoded]


def one_step(pool: HostPool, pairs: list[tuple[torch.Tensor, torch.Tensor, int]],
             encode: Encoder, profile: bool = False) -> dict[str, Any]:
    """Ship the step (untimed), then the encoder's work timed on this thread."""
    batch = StepBatch(pool)
    msgs = [TopKMessage(i, v, n) for i, v, n in pairs]
    for m in msgs:
        m.ship(batch)
    batch.ship()
    calls = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    t0 = time.thread_time()
    batch.wait()  # the host's batched sort (the same both ways)
    t1 = time.thread_time()
    if profile:
        sys.setprofile(count)
    encs = [encode(m, batch) for m in msgs]
    if profile:
        sys.setprofile(None)
    t2 = time.thread_time()
    inputs = [from_encoded(f"@grad/p{j}", m.tag, (m.numel,), e)
              for j, (m, e) in enumerate(zip(msgs, encs, strict=True))]
    rec = LogWriter.build(1, inputs, kind="grad")
    t3 = time.thread_time()
    data = b"".join(bytes(c) for c in rec.chunks) if not profile else b""
    pool.give(batch.buffers)
    return {"messages_s": t2 - t1, "encode_s": t2 - t0, "record_s": t3 - t0,
            "calls": calls[0], "bytes": data}


def run(rounds: int, vocab: int, dim: int, layers: int, ratio: float) -> dict[str, Any]:
    """Alternating per-tensor / batched steps; medians over ``rounds``."""
    torch.set_num_threads(1)
    shps = shapes(vocab, 1024, dim, layers, max(1, dim // 96))
    pairs = messages(shps, ratio, 0)
    pool = HostPool()
    ways: dict[str, Encoder] = {"per_tensor": old_encode, "batched": new_encode}
    for enc in ways.values():  # warm-up: the pool's buffers, the layout's constants
        one_step(pool, pairs, enc)
    metrics = ("messages_s", "encode_s", "record_s")
    got: dict[str, dict[str, list[float]]] = {w: {m: [] for m in metrics} for w in ways}
    for r in range(rounds):
        order = list(ways) if r % 2 == 0 else list(ways)[::-1]
        recs = {}
        for w in order:
            o = one_step(pool, pairs, ways[w])
            for m in metrics:
                got[w][m].append(o[m])
            recs[w] = o["bytes"]
        assert recs["per_tensor"] == recs["batched"], "records differ"
    calls = {w: one_step(pool, pairs, ways[w], profile=True)["calls"] for w in ways}
    med = {w: {m: statistics.median(v) for m, v in d.items()} for w, d in got.items()}
    return {
        "tensors": len(shps), "params": sum(int(np.prod(s)) for s in shps),
        "pairs": sum(int(i.numel()) for i, _v, _n in pairs), "rounds": rounds,
        "median_s": med, "runs_s": got, "python_calls_per_step": calls,
        "batched_over_per_tensor": {
            m: med["batched"][m] / med["per_tensor"][m] for m in metrics},
        "calls_ratio": calls["batched"] / calls["per_tensor"],
    }


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = run(args.rounds, args.vocab, args.dim, args.layers, args.ratio)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['tensors']} tensors, {out['params'] / 1e6:.1f}M params, "
          f"{out['pairs'] / 1e3:.0f}k pairs per step; medians of {out['rounds']} rounds")
    print("| | per-tensor | batched | batched / per-tensor |\n|---|---:|---:|---:|")
    for m, label in (("messages_s", "the messages' codec (ms CPU)"),
                     ("encode_s", "sort + codec (ms CPU)"),
                     ("record_s", "sort + codec + record layout and CRCs (ms CPU)")):
        a, b = out["median_s"]["per_tensor"][m], out["median_s"]["batched"][m]
        print(f"| {label} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} |")
    c = out["python_calls_per_step"]
    print(f"| Python calls per step in the codec | {c['per_tensor']} | {c['batched']} | "
          f"{out['calls_ratio']:.2f} |")
    return 0


def test_bench_encode_batch_smoke() -> None:
    """A tiny layout: the records are byte for byte equal and the batched encode makes
    fewer Python calls."""
    out = run(1, 64, 16, 2, 0.05)
    assert out["tensors"] == 2 + 12 * 2 + 4
    c = out["python_calls_per_step"]
    assert 0 < c["batched"] < c["per_tensor"]


if __name__ == "__main__":
    raise SystemExit(main())
