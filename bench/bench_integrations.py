#!/usr/bin/env python3
"""Trainer integrations: lines of glue, and the step time of a Hugging Face Trainer run with
``LowDiffCallback`` against the same run without it.

Step time: two configurations of the same run (a randomly initialised GPT-2, AdamW, linear
warmup/decay, dropout on, logging every 10 steps), ``plain`` and ``+lowdiff`` (the callback,
grad mode, ``snapshot_every=100``), each round training ``--steps`` steps with a fresh
Trainer, in alternating order round by round in one process with
``torch.set_num_threads(1)``. A step is the wall time between two ``on_step_end`` events
(data, forward, backward, clipping, optimizer, callbacks, logging); the first ``--warmup``
steps of a round are dropped. Each round gives the ratio of the medians; the figure is the
median of the per-round ratios.

Glue: the lines marked ``# lowdiff`` in ``examples/hf_trainer.py``,
``examples/lightning_fit.py`` and ``examples/accelerate_loop.py`` (the scripts the README
shows), i.e. what a user adds to a training script that has no checkpointing.

Run:   python bench/bench_integrations.py [--rounds 5] [--steps 40] [--json]
Smoke: python -m pytest bench/bench_integrations.py  (a tiny model, a few steps)
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

EXAMPLES = {"transformers": "hf_trainer.py", "lightning": "lightning_fit.py",
            "accelerate": "accelerate_loop.py"}

#: (vocab, context, width, layers, heads, batch)
SIZES = {"5m": (4096, 64, 256, 4, 4, 8), "tiny": (64, 16, 16, 2, 2, 4)}


def glue_lines() -> dict[str, int]:
    """Lines marked ``# lowdiff`` in each integration's example script."""
    out = {}
    for name, f in EXAMPLES.items():
        with open(os.path.join(ROOT, "examples", f)) as fh:
            out[name] = sum(1 for line in fh if line.rstrip().endswith("# lowdiff"))
    return out


def _trainer(size: str, steps: int, ckpt: str | None, workdir: str, bare: bool = False
             ) -> tuple[Any, list[tuple[float, float]]]:
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.trainer_callback import PrinterCallback

    vocab, ctx, dim, layers, heads, batch = SIZES[size]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch * steps, ctx), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=ctx, n_embd=dim,
                                       n_layer=layers, n_head=heads))
    times: list[tuple[float, float]] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        last = (0.0, 0.0)

        def on_step_end(self, *a: Any, **k: Any) -> None:
            now = (time.perf_counter(), time.thread_time())
            if self.last[0]:
                times.append((now[0] - self.last[0], now[1] - self.last[1]))
            self.last = now

    cbs: list[Any] = [Clock()]
    if ckpt is not None and bare:
        cbs.append(_bare(ckpt))
    elif ckpt is not None:
        from lowdiff_store.integrations.transformers import LowDiffCallback

        cbs.append(LowDiffCallback(ckpt, snapshot_every=100))
    args = TrainingArguments(output_dir=workdir, per_device_train_batch_size=batch,
                             max_steps=steps, learning_rate=1e-3, warmup_steps=5,
                             logging_steps=10, save_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True, max_grad_norm=1.0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=cbs)
    trainer.remove_callback(PrinterCallback)  # keep stdout for the report
    return trainer, times


def _bare(path: str) -> Any:
    """A callback that runs a ``DiffCheckpointer`` on the trainer's objects and nothing else
    (no trainer state, no resume): the core checkpointer's cost, to separate the
    integration's own."""
    from transformers import TrainerCallback

    from lowdiff_store.torch import DiffCheckpointer

    class Bare(TrainerCallback):  # type: ignore[misc]
        ckpt: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                           optimizer: Any = None, lr_scheduler: Any = None, **k: Any) -> None:
            self.ckpt = DiffCheckpointer(path, model, optimizer, scheduler=lr_scheduler,
                                         snapshot_every=100)

        def on_train_end(self, *a: Any, **k: Any) -> None:
            self.ckpt.close()

    return Bare()


CONFIGS = ("plain", "+checkpointer", "+lowdiff")


def run(size: str, rounds: int, steps: int, warmup: int, workdir: str) -> dict[str, Any]:
    """Interleaved rounds of both configurations; see the module docstring."""
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    medians: dict[str, list[float]] = {c: [] for c in CONFIGS}
    cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}
    ratios: dict[str, list[float]] = {"+lowdiff / plain": [], "+checkpointer / plain": [],
                                      "+lowdiff / +checkpointer": []}
    cpu_ratios: dict[str, list[float]] = {k: [] for k in ratios}
    for r in range(rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        got = {}
        for name in order:
            ckpt = os.path.join(workdir, f"ckpt-{r}-{name[1:]}") if name != "plain" else None
            trainer, times = _trainer(size, steps, ckpt, workdir, bare=name == "+checkpointer")
            trainer.train()
            kept = times[warmup:] or times
            got[name] = statistics.median(w for w, _c in kept)
            got["cpu" + name] = statistics.median(c for _w, c in kept)
            medians[name].append(got[name])
            cpu[name].append(got["cpu" + name])
        for k in ratios:
            a, b = k.split(" / ")
            ratios[k].append(got[a] / got[b])
            cpu_ratios[k].append(got["cpu" + a] / got["cpu" + b])
    return {
        "size": size, "rounds": rounds, "steps": steps,
        "median_step_s": {k: statistics.median(v) for k, v in medians.items()},
        "ratio_per_round": ratios,
        "ratio": {k: statistics.median(v) for k, v in ratios.items()},
        # CPU time of the training thread per step: the foreground cost, what the step
        # time is when the background writer has a core of its own; other processes'
        # load does not inflate it
        "train_thread_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "train_thread_cpu_ratio": {k: statistics.median(v) for k, v in cpu_ratios.items()},
        "train_thread_cpu_ratio_per_round": cpu_ratios,
        "glue_lines": glue_lines(),
        "load_average": os.getloadavg(),
    }


def test_bench_integrations_smoke(tmp_path: Any) -> None:
    """CI smoke: both configurations train and the ratio and glue counts are sane."""
    import pytest

    pytest.importorskip("transformers")
    out = run("tiny", rounds=1, steps=4, warmup=1, workdir=str(tmp_path))
    assert all(v > 0 for v in out["ratio"].values())
    assert all(v > 0 for v in out["train_thread_cpu_ratio"].values())
    assert all(v > 0 for v in out["median_step_s"].values())
    glue = out["glue_lines"]
    assert 1 <= glue["transformers"] <= 3, glue
    assert 1 <= glue["lightning"] <= 3, glue
    assert 1 <= glue["accelerate"] <= 4, glue  # a plain loop also starts at the restored step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="5m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        out = run(args.size, args.rounds, args.steps, args.warmup, d)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"GPT-2 {args.size}, {args.rounds} rounds x {args.steps} steps, 1 torch thread")
    for k, v in out["median_step_s"].items():
        print(f"  {k:<14} {v * 1000:8.1f} ms/step")
    for k, v in out["ratio"].items():
        per = ", ".join(f"{x:.3f}" for x in out["ratio_per_round"][k])
        print(f"  {k:<26} {v:.3f} (per round: {per})")
    print("  training thread CPU time per step:")
    for k, v in out["train_thread_cpu_ratio"].items():
        per = ", ".join(f"{x:.3f}" for x in out["train_thread_cpu_ratio_per_round"][k])
        print(f"  {k:<26} {v:.3f} (per round: {per})")
    print(f"  lines of glue: {out['glue_lines']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
