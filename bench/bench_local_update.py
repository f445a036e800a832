#!/usr/bin/env python3
"""Local-update training checkpointed every step: bytes, step overhead, replay time.

Two ranks (gloo, CPU, ``torch.set_num_threads(1)``) train an MLP with AdamW under each
method: post-local SGD with ``PeriodicModelAverager(period=8)``, post-local SGD with
``QSRModelAverager`` (H from the cosine-decayed lr), and DiLoCo (H = 8, outer SGD with
Nesterov momentum). Every rank alternates, round by round, a block of steps without
checkpointing (the baseline) and a block with ``DiffCheckpointer`` (a diff every step, a
base every ``--every`` steps; fresh directory each block), so machine noise hits both
alike. Reported (rank 0; rank 1 is alike):

  B/step     bytes logged per step that did not synchronize (the inner gradient, side
             channel, counters; before zstd)
  B/sync     bytes of one synchronization's event (@sync or @outer tensors)
  ratio      median step time with / without checkpointing, medians over the rounds
  replay     restore time per replayed step (from the base at step 0 by default:
             ``--every`` is larger than ``--steps``, so the blocks measure diffs alone)

Run:   python bench/bench_local_update.py [--rounds 5] [--steps 40] [--hidden 1024]
Smoke: python -m pytest bench/bench_local_update.py -m bench
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
METHODS = ("periodic", "qsr", "diloco")


def build(method: str, hidden: int, steps: int) -> dict[str, Any]:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as PL
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lowdiff_store.torch import DiLoCo, QSRModelAverager, QSRSchedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, 256))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=steps, eta_min=3e-4)
    if method == "diloco":
        return {"net": model, "opt": DiLoCo(inner, period=8), "sched": sched}
    ddp = DDP(model)
    state = PL.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0,
                                 post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, PL.post_localSGD_hook)
    av: Any = PeriodicModelAverager(period=8) if method == "periodic" else \
        QSRModelAverager(QSRSchedule(inner, h_base=4, alpha=1.2e-2))
    return {"net": ddp, "opt": PostLocalSGDOptimizer(optim=inner, averager=av),
            "sched": sched}


def block(o: dict[str, Any], steps: int, rank: int, ckpt: Any) -> list[float]:
    import torch

    times = []
    for t in range(steps):
        g = torch.Generator().manual_seed(t * 7919 + rank)
        x = torch.randn(32, 256, generator=g)
        t0 = time.perf_counter()
        loss = o["net"](x).square().mean()
        loss.backward()
        o["opt"].step()
        o["sched"].step()
        o["opt"].zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lowdiff_store.torch import DiffCheckpointer, restore

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=2)
    out: dict[str, Any] = {}
    for method in METHODS:
        base: list[float] = []
        ckpt_t: list[float] = []
        stats: dict[str, float] = {}
        replay: list[float] = []
        for r in range(args.rounds):
            o = build(method, args.hidden, args.steps)
            base.append(statistics.median(block(o, args.steps, args.rank, None)))
            o = build(method, args.hidden, args.steps)
            path = os.path.join(args.dir, f"{method}-{r}")
            ck = DiffCheckpointer(path, o["net"], o["opt"], scheduler=o["sched"],
                                  snapshot_every=args.every)
            ckpt_t.append(statistics.median(block(o, args.steps, args.rank, ck)))
            ck.close()   # the last step's record is handed to the writer at close
            stats = ck.stats()
            o = build(method, args.hidden, args.steps)
            t0 = time.perf_counter()
            res = restore(path, o["net"], o["opt"], scheduler=o["sched"])
            if res.replayed:
                replay.append((time.perf_counter() - t0) / res.replayed)
        steps, syncs = stats["steps"], max(1.0, stats["syncs"])
        out[method] = {
            "B_per_step": (stats["diff_bytes"] - stats["sync_bytes"]) / steps,
            "B_per_sync": stats["sync_bytes"] / syncs, "syncs": stats["syncs"],
            "steps": steps, "base_ms": 1e3 * statistics.median(base),
            "ckpt_ms": 1e3 * statistics.median(ckpt_t),
            "ratio": statistics.median(c / b for c, b in zip(ckpt_t, base, strict=True)),
            "ratio_range": [min(c / b for c, b in zip(ckpt_t, base, strict=True)),
                            max(c / b for c, b in zip(ckpt_t, base, strict=True))],
            "replay_ms_per_step": 1e3 * statistics.median(replay) if replay else None}
    if args.rank == 0:
        with open(os.path.join(args.dir, "result.json"), "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def run(rounds: int, steps: int, hidden: int, every: int, d: str) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(HERE)}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port",
                               str(port), "--dir", d, "--rounds", str(rounds), "--steps",
                               str(steps), "--hidden", str(hidden), "--every", str(every)],
                              env=env) for r in range(2)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a rank exited {p.returncode}")
    with open(os.path.join(d, "result.json")) as f:
        return json.load(f)   # type: ignore[no-any-return]


def report(res: dict[str, Any], hidden: int) -> str:
    lines = [f"MLP 256-{hidden}-{hidden}-256, AdamW, 2 ranks gloo, rank 0:", "",
             "| method | B/step | B/sync | syncs/steps | step ms off / on | ratio (min-max) | "
             "replay ms/step |", "|---|---|---|---|---|---|---|"]
    for m, r in res.items():
        rp = "-" if r["replay_ms_per_step"] is None else f"{r['replay_ms_per_step']:.2f}"
        lines.append(f"| {m} | {r['B_per_step']:,.0f} | {r['B_per_sync']:,.0f} | "
                     f"{r['syncs']:.0f}/{r['steps']:.0f} | {r['base_ms']:.2f} / "
                     f"{r['ckpt_ms']:.2f} | {r['ratio']:.3f} ({r['ratio_range'][0]:.2f}-"
                     f"{r['ratio_range'][1]:.2f}) | {rp} |")
    return "\n".join(lines)


@pytest.mark.bench
def test_bench_local_update_smoke(tmp_path: Any) -> None:
    """One round of 10 steps on a small MLP: every figure is produced and sane."""
    res = run(1, 10, 64, 1000, str(tmp_path))
    for m in METHODS:
        r = res[m]
        assert r["syncs"] >= 1
        assert r["B_per_step"] > 0
        assert r["B_per_sync"] > 0
        assert r["ratio"] > 0
        assert r["replay_ms_per_step"] is not None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    if args.rank >= 0:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as d:
        res = run(args.rounds, args.steps, args.hidden, args.every, d)
    print(report(res, args.hidden))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
