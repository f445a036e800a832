#!/usr/bin/env python3
"""Post-local SGD with the Quadratic Synchronization Rule, checkpointed every step.

Each of --ranks processes (gloo, CPU) trains its own replica of a small MLP with AdamW
(DDP + ``post_localSGD_hook``: gradients all-reduced for the first 4 steps, then local);
``PostLocalSGDOptimizer`` averages the replicas every H steps, H chosen at each averaging
by QSR from the cosine-decayed learning rate: H = max(2, floor((alpha / lr)^2)).
``DiffCheckpointer`` logs each replica's steps and every averaging; a run that finds the
checkpoint restores every rank at the newest step durable on all of them and goes on.

    python examples/local_sgd_qsr.py --dir /tmp/qsr --kill-at 37   # dies at step 37
    python examples/local_sgd_qsr.py --dir /tmp/qsr                # resumes, finishes
    python examples/local_sgd_qsr.py --check                       # both, then compares
                                                                   # with a run never killed

Each rank prints a SHA-256 of its final parameters, AdamW state, averager counters and RNG
state; ``--check`` asserts the resumed run's equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowdiff_store.torch import DiffCheckpointer, QSRModelAverager, QSRSchedule, restore


def train(rank: int, world: int, port: int, path: str, steps: int, kill_at: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as PL
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(128, 10))
    ddp = DDP(model)   # wrap first: DDP broadcasts rank 0's parameters when it is built
    state = PL.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=4,
                                 post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, PL.post_localSGD_hook)   # before restore: its counter
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=steps, eta_min=3e-4)
    averager = QSRModelAverager(QSRSchedule(inner, h_base=2, alpha=6e-3), warmup_steps=4)
    opt = PostLocalSGDOptimizer(optim=inner, averager=averager)
    torch.manual_seed(1 + rank)   # each replica's dropout stream is its own
    res = restore(path, ddp, opt, scheduler=sched, missing_ok=True)
    start = 0 if res is None else res.step
    if rank == 0:
        print(f"starting at step {start}" + ("" if res is None else " (restored)"))
    ckpt = DiffCheckpointer(path, ddp, opt, scheduler=sched, snapshot_every=20)
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step * 1009 + rank)
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if step + 1 == kill_at:
            ckpt.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    st = ckpt.stats()
    ckpt.close()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for s in inner.state.values():
        for _k, v in sorted(s.items()):   # key order differs after a restore
            h.update(v.numpy().tobytes())
    h.update(repr((averager.step, averager.next_sync, averager.period, state.iter)).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    print(f"rank {rank}: syncs {st['syncs']:.0f}, last H {averager.period}, "
          f"diff bytes {st['diff_bytes'] / 1e6:.2f} MB (of which sync "
          f"{st['sync_bytes'] / 1e6:.2f}), final state sha256 {h.hexdigest()[:16]}", flush=True)
    with open(f"{path}.final-{rank}.sha256", "w") as f:
        f.write(h.hexdigest())
    dist.destroy_process_group()


def launch(args: argparse.Namespace, path: str, kill_at: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--ranks",
                               str(args.ranks), "--port", str(port), "--dir", path,
                               "--steps", str(args.steps), "--kill-at", str(kill_at)])
             for r in range(args.ranks)]
    return max(abs(p.wait()) for p in procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        train(args.rank, args.ranks, args.port, args.dir, args.steps, args.kill_at)
        return
    if not args.check:
        sys.exit(launch(args, args.dir or "ckpt-qsr", args.kill_at))
    with tempfile.TemporaryDirectory() as tmp:
        killed, ref = os.path.join(tmp, "killed"), os.path.join(tmp, "ref")
        print("-- run killed at step", args.steps * 3 // 5)
        launch(args, killed, args.steps * 3 // 5)
        print("-- run again: resumes")
        assert launch(args, killed, -1) == 0
        print("-- uninterrupted run")
        assert launch(args, ref, -1) == 0
        for r in range(args.ranks):
            a = open(f"{killed}.final-{r}.sha256").read()
            b = open(f"{ref}.final-{r}.sha256").read()
            assert a == b, f"rank {r}: resumed run differs from the uninterrupted one"
        print("resumed run == uninterrupted run, bit for bit, on every rank")


if __name__ == "__main__":
    main()
