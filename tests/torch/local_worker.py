"""One rank of the local-update tests, run as a subprocess by ``test_local_update.py``.

Methods (``--method``): ``periodic`` (DDP + ``post_localSGD_hook`` +
``PostLocalSGDOptimizer(AdamW, PeriodicModelAverager)``), ``hier``
(``HierarchicalModelAverager``, 4 ranks), ``qsr`` (``QSRModelAverager``), ``diloco`` and
``diloco_qsr`` (the project's DiLoCo, fixed H or a QSR schedule).

Phases:

- ``ref``: the uninterrupted run to ``--steps``, no checkpointer; every step's state saved
  to ``OUT/ref-<rank>.pt``;
- ``run``: restore if the checkpoint exists (comparing the restored state with the
  reference), train with a checkpointer to ``--steps`` or SIGKILL this rank at
  ``--kill-at`` (``--kill-where after``: after the wrapper's step and the scheduler;
  ``inner``: inside the inner optimizer's step, before any synchronization of that step);
  at the end compare with the reference; ``OUT/result-<rank>.json``.

Every batch is a pure function of (step, rank); dropout draws from the global RNG seeded
per rank, so each rank's RNG state is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from lowdiff_store import latest_step  # noqa: E402
from lowdiff_store.torch import (  # noqa: E402
    DiffCheckpointer,
    DiLoCo,
    QSRModelAverager,
    QSRSchedule,
    restore,
)


def build(method: str, world: int) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as PL
    from torch.distributed.algorithms.model_averaging import averagers
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager,
    )
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.ExponentialLR(inner, gamma=0.9)
    out: dict[str, Any] = {"model": model, "sched": sched, "net": model}
    if method.startswith("diloco"):
        period: Any = 3 if method == "diloco" else QSRSchedule(inner, h_base=2, alpha=0.09)
        out["opt"] = DiLoCo(inner, outer_lr=0.7, outer_momentum=0.9, period=period)
        return out
    ddp = DDP(model)
    state = PL.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=3,
                                 post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, PL.post_localSGD_hook)
    if method == "periodic":
        av: Any = averagers.PeriodicModelAverager(period=4, warmup_steps=3)
    elif method == "qsr":
        av = QSRModelAverager(QSRSchedule(inner, h_base=2, alpha=0.09), warmup_steps=3)
    else:
        av = HierarchicalModelAverager(OrderedDict([(2, 2), (4, world)]), warmup_steps=3)
    out.update(net=ddp, state=state,
               opt=PostLocalSGDOptimizer(optim=inner, averager=av))
    return out


def counters(o: dict[str, Any]) -> list[int]:
    opt = o["opt"]
    if isinstance(opt, DiLoCo):
        return [opt.steps, opt.next_sync, opt.period, opt.syncs]
    av = opt.averager
    return [av.step, int(getattr(av, "next_sync", -1)), int(getattr(av, "period", -1)),
            o["state"].iter]


def snapshot(o: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"p/{n}": p.detach().clone() for n, p in o["model"].named_parameters()}
    opt = o["opt"]
    inner = opt.optim
    for i, p in enumerate(inner.param_groups[0]["params"]):
        for k, v in inner.state.get(p, {}).items():
            out[f"o/{i}/{k}"] = v.detach().clone()
    if isinstance(opt, DiLoCo):
        for i, g in enumerate(opt.global_params):
            out[f"g/{i}"] = g.detach().clone()
            buf = opt.outer.state.get(g, {}).get("momentum_buffer")
            if buf is not None:
                out[f"m/{i}"] = buf.clone()
    out["counters"] = torch.tensor(counters(o))
    out["lr"] = torch.tensor(inner.param_groups[0]["lr"], dtype=torch.float64)
    out["rng"] = torch.get_rng_state()
    return out


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.reshape(-1).view(torch.uint8) if x.numel() else x,
                y.reshape(-1).view(torch.uint8) if y.numel() else y):
            bad.append(k)
    return bad


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def train_step(o: dict[str, Any], step: int, rank: int) -> None:
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(o["net"](x), y)
    loss.backward()
    o["opt"].step()
    o["sched"].step()
    o["opt"].zero_grad()


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--phase", "--method", "--dir", "--out", "--kill-where"):
        ap.add_argument(a, default="after")
    for a in ("--rank", "--world", "--port", "--steps", "--kill-at", "--snapshot-every"):
        ap.add_argument(a, type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    rank = args.rank
    o = build(args.method, args.world)
    torch.manual_seed(100 + rank)
    if args.phase == "ref":
        snaps = [snapshot(o)]
        for t in range(args.steps):
            train_step(o, t, rank)
            snaps.append(snapshot(o))
        torch.save(snaps, os.path.join(args.out, f"ref-{rank}.pt"))
        dist.destroy_process_group()
        return
    ref = torch.load(os.path.join(args.out, f"ref-{rank}.pt"), weights_only=True)
    result: dict[str, Any] = {"rank": rank, "restored": None, "restored_bad": [],
                              "notes": [], "exact": True}
    start = 0
    if latest_step(args.dir) is not None:
        res = restore(args.dir, o["net"], o["opt"], scheduler=o["sched"])
        start = res.step
        result.update(restored=start, restored_bad=diff(snapshot(o), ref[start]),
                      notes=res.notes, exact=res.exact)
    ckpt = DiffCheckpointer(args.dir, o["net"], o["opt"], scheduler=o["sched"],
                            snapshot_every=args.snapshot_every)
    if args.kill_where == "inner" and args.kill_at >= 0:
        def die(*_a: Any) -> None:
            if ckpt.step + 1 == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        o["opt"].optim.register_step_post_hook(die)
    for t in range(start, args.steps):
        train_step(o, t, rank)
        if args.kill_where == "after" and t + 1 == args.kill_at:
            ckpt.flush() if rank % 2 == 0 else None   # rank parity: durable or not
            os.kill(os.getpid(), signal.SIGKILL)
    result["final_bad"] = diff(snapshot(o), ref[args.steps])
    result["stats"] = ckpt.stats()
    ckpt.close()
    with open(os.path.join(args.out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
