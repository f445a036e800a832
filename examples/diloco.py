#!/usr/bin/env python3
"""DiLoCo (inner AdamW, outer SGD with Nesterov momentum), checkpointed every step.

Each of --ranks processes (gloo, CPU) trains its own replica of a small MLP for H inner
AdamW steps; then the replicas all-reduce their pseudo-gradients (global - local) and one
outer SGD(lr=0.7, momentum=0.9, nesterov) step moves the global parameters, which every
replica restarts from (Douillard et al. 2023). With --qsr, H follows the Quadratic
Synchronization Rule from the inner learning rate instead of a fixed --period.
``DiffCheckpointer`` logs each replica's inner steps and, at every outer step, the
all-reduced pseudo-gradient; a run that finds the checkpoint restores every rank at the
newest step durable on all of them (inner and outer state) and goes on.

    python examples/diloco.py --dir /tmp/dl --kill-at 37   # dies at step 37
    python examples/diloco.py --dir /tmp/dl                # resumes, finishes
    python examples/diloco.py --check                      # both, then compares with a
                                                           # run never killed

Each rank prints a SHA-256 of its final parameters, AdamW state, global parameters, outer
momentum, counters and RNG state; ``--check`` asserts the resumed run's equal the
uninterrupted run's.
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

from lowdiff_store.torch import DiffCheckpointer, DiLoCo, QSRSchedule, restore


def train(rank: int, world: int, port: int, path: str, steps: int, kill_at: int,
          period: int, qsr: bool) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)   # the same initial model on every replica
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(128, 10))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=steps, eta_min=3e-4)
    h: int | QSRSchedule = QSRSchedule(inner, h_base=4, alpha=6e-3) if qsr else period
    opt = DiLoCo(inner, outer_lr=0.7, outer_momentum=0.9, period=h)
    torch.manual_seed(1 + rank)   # each replica's dropout stream is its own
    res = restore(path, model, opt, scheduler=sched, missing_ok=True)
    start = 0 if res is None else res.step
    if rank == 0:
        print(f"starting at step {start}" + ("" if res is None else " (restored)"))
    ckpt = DiffCheckpointer(path, model, opt, scheduler=sched, snapshot_every=20)
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step * 1009 + rank)
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if step + 1 == kill_at:
            ckpt.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    st = ckpt.stats()
    ckpt.close()
    digest = hashlib.sha256()
    for p in [*model.parameters(), *opt.global_params]:
        digest.update(p.detach().numpy().tobytes())
    for s in [*inner.state.values(), *opt.outer.state.values()]:
        for _k, v in sorted(s.items()):   # key order differs after a restore
            digest.update(v.numpy().tobytes())
    digest.update(repr((opt.steps, opt.next_sync, opt.period, opt.syncs)).encode())
    digest.update(torch.get_rng_state().numpy().tobytes())
    print(f"rank {rank}: outer steps {opt.syncs}, last H {opt.period}, diff bytes "
          f"{st['diff_bytes'] / 1e6:.2f} MB (of which outer {st['sync_bytes'] / 1e6:.2f}), "
          f"final state sha256 {digest.hexdigest()[:16]}", flush=True)
    with open(f"{path}.final-{rank}.sha256", "w") as f:
        f.write(digest.hexdigest())
    dist.destroy_process_group()


def launch(args: argparse.Namespace, path: str, kill_at: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--ranks",
                               str(args.ranks), "--port", str(port), "--dir", path,
                               "--steps", str(args.steps), "--kill-at", str(kill_at),
                               "--period", str(args.period)] + (["--qsr"] if args.qsr else []))
             for r in range(args.ranks)]
    return max(abs(p.wait()) for p in procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--period", type=int, default=8)
    ap.add_argument("--qsr", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        train(args.rank, args.ranks, args.port, args.dir, args.steps, args.kill_at,
              args.period, args.qsr)
        return
    if not args.check:
        sys.exit(launch(args, args.dir or "ckpt-diloco", args.kill_at))
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
