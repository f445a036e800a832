"""One rank of the distributed tests, run as a subprocess by ``test_distributed*.py``.

Phases:

- ``train``: an uninterrupted reference run to ``--steps`` (snapshots of every step saved
  to ``OUT/ref-<rank>.pt``), then fresh objects trained with a checkpointer from step 0 to
  ``--stop``, ended by ``--end``: ``close`` (clean stop), ``crash`` (``os._exit`` without
  closing) or ``kill`` (rank ``--kill-rank`` SIGKILLs itself after step ``--stop``; the
  others die on the next collective or are killed by the test);
- ``resume``: fresh objects, ``restore``, compare with the reference at the restored step,
  continue with a checkpointer to ``--steps``, compare with the reference at the end;
  writes ``OUT/result-<rank>.json``;
- ``refusals``: what a multi-rank job must refuse (``OUT/refusals-<rank>.json``: the error
  reason of each attempt, None when it was accepted).

``--base-slices K`` streams every base over K steps (``DiffCheckpointer(base_slices=K)``,
``test_streamed_bases_ranks.py``); without it the bases are consistent, as before.

``dist_worker.py --serve`` is a fork server of these runs (:func:`serve`).

Every batch is a pure function of (step, rank); dropout draws from the global RNG, seeded
per rank, so each rank's RNG state differs and must be restored as its own.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from lowdiff_store.torch import (  # noqa: E402
    DiffCheckpointer,
    TopKAllGatherState,
    restore,
    topk_allgather_hook,
)
from lowdiff_store.torch.distributed.hooks import (  # noqa: E402
    QSGDState,
    TernGradState,
    qsgd_hook,
    terngrad_hook,
)


class Net(torch.nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear -> ReLU -> Dropout -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.bn = torch.nn.BatchNorm1d(64)
        self.fc2 = torch.nn.Linear(64, 64)
        self.drop = torch.nn.Dropout(0.1)
        self.fc3 = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.fc1(x)))
        return self.fc3(self.drop(torch.relu(self.fc2(h))))


@dataclass
class Objs:
    model: Net
    ddp: DDP
    opt: Any
    sched: Any
    hook: Any
    state: Any
    extra: dict[str, Any]


def build(a: argparse.Namespace, rank: int) -> Objs:
    torch.manual_seed(0)
    model = Net()
    # several buckets (DDP rebuilds them after iteration 0), except for PowerSGD: its
    # callbacks issue collectives from gloo's threads, so with several buckets in flight
    # the ranks may issue them in different orders (a torch limitation on CPU/gloo)
    ddp = DDP(model, bucket_cap_mb=25 if a.hook == "powersgd" else 0.004)
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: Any = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                           lr=1e-2, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    hook: Any
    state: Any = None
    if a.hook == "allreduce":
        hook = D.allreduce_hook
    elif a.hook == "fp16":
        hook = D.fp16_compress_hook
    elif a.hook == "bf16":
        hook = D.bf16_compress_hook
    elif a.hook == "powersgd":
        hook = P.powerSGD_hook
        state = P.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                start_powerSGD_iter=3, min_compression_rate=1.5,
                                use_error_feedback=not a.no_ef, warm_start=True,
                                random_seed=7)
    elif a.hook == "topk":
        hook = topk_allgather_hook
        state = TopKAllGatherState(ratio=0.1, error_feedback=True)
    elif a.hook == "terngrad":
        hook, state = terngrad_hook, TernGradState(min_numel=256, seed=3)
    elif a.hook == "qsgd":
        hook, state = qsgd_hook, QSGDState(min_numel=256, seed=3, levels=3, bucket=128)
    else:
        hook = None
    torch.manual_seed(100 + rank)
    return Objs(model, ddp, opt, sched, hook, state, {"batches": 0})


def train(o: Objs, start: int, stop: int, rank: int, snaps: dict[int, Any] | None = None,
          kill_at: int | None = None, ckpt: Any = None, flush: bool = False,
          flush_at: int | None = None) -> None:
    for t in range(start, stop):
        g = torch.Generator().manual_seed(1000 * (t + 1) + rank)
        x = torch.randn(32, 16, generator=g)
        y = torch.randint(0, 8, (32,), generator=g)
        o.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(o.ddp(x), y)
        loss.backward()
        o.opt.step()
        o.sched.step()
        o.extra["batches"] = t + 1
        if ckpt is not None and (flush or t + 1 == flush_at):
            ckpt.flush()
        if snaps is not None:
            snaps[t + 1] = snapshot(o)
        if kill_at is not None and t + 1 == kill_at:
            settle = getattr(getattr(ckpt, "_out", None), "sink", None)
            if hasattr(settle, "settle"):  # a writer process: what it was handed is in
                settle.settle()  # its ring, so it makes it durable (the kill's promise)
            os.kill(os.getpid(), signal.SIGKILL)


def snapshot(o: Objs) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in o.model.state_dict().items()}
    opt = getattr(o.opt, "optim", o.opt)  # ZeroRedundancyOptimizer: this rank's partition
    names = {id(p): n for n, p in o.model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{names[id(p)]}/{k}"] = v.detach().clone()
    out["rng"] = torch.get_rng_state()
    out["lr"] = torch.tensor([g["lr"] for g in o.opt.param_groups], dtype=torch.float64)
    return out


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.contiguous().reshape(-1).view(torch.uint8),
                y.contiguous().reshape(-1).view(torch.uint8)):
            bad.append(k)
    return bad


def make_ckpt(a: argparse.Namespace, o: Objs, rank: int) -> DiffCheckpointer:
    batch = a.batch_rank1 if rank == 1 and a.batch_rank1 else 1
    kw: dict[str, Any] = {"ef_state": a.ef_state, "digest_every": 3,
                          "writer_process": a.writer_process}
    if a.base_slices != 1:   # streamed bases (default: consistent ones, as before)
        kw["base_slices"] = a.base_slices
    if a.compressor:
        from lowdiff_store.torch import TopKCompressor

        kw["compressor"] = TopKCompressor(ratio=0.1, error_feedback=True)
    ckpt = DiffCheckpointer(a.dir, o.ddp, o.opt, scheduler=o.sched, snapshot_every=a.every,
                            batch=batch, extra_state=lambda: dict(o.extra), **kw)
    if o.hook is not None:
        o.ddp.register_comm_hook(o.state, ckpt.wrap_comm_hook(o.hook))
    return ckpt


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hook", default="allreduce")
    ap.add_argument("--zero", action="store_true")
    ap.add_argument("--no-ef", action="store_true")
    ap.add_argument("--ef-state", default="base")
    ap.add_argument("--writer-process", action="store_true")
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--stop", type=int, default=12)
    ap.add_argument("--end", default="close")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--batch-rank1", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=100.0)
    ap.add_argument("--flush-rank0", action="store_true")
    ap.add_argument("--flush-at", type=int, default=None,
                    help="flush after this step (a crash after --stop then loses only it)")
    ap.add_argument("--compressor", action="store_true", help="TopKCompressor, no hook")
    ap.add_argument("--base-slices", type=int, default=1,
                    help="DiffCheckpointer(base_slices=K): bases streamed over K steps")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    rank = a.rank
    faulthandler.dump_traceback_later(a.timeout, exit=True)  # a hung collective: fail loudly
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank),
                      WORLD_SIZE=str(a.world))
    dist.init_process_group("gloo")
    ref_path = os.path.join(a.out, f"ref-{rank}.pt")
    if a.phase == "train":
        o = build(a, rank)
        if o.hook is not None:
            o.ddp.register_comm_hook(o.state, o.hook)
        if a.compressor:
            from lowdiff_store.torch import TopKCompressor

            TopKCompressor(ratio=0.1, error_feedback=True).attach(o.opt)
        snaps: dict[int, Any] = {0: snapshot(o)}
        train(o, 0, a.steps, rank, snaps)
        torch.save(snaps, ref_path)
        del o
        o = build(a, rank)
        ckpt = make_ckpt(a, o, rank)
        mine: dict[int, Any] = {}
        kill = a.stop if a.end == "kill" and rank == a.kill_rank else None
        flush = a.flush_rank0 and rank == 0
        if a.end == "kill" and rank != a.kill_rank:
            # train on: the next collective after the kill fails (or the test kills us)
            with open(os.path.join(a.out, f"train-{rank}.json"), "w") as fh:
                json.dump({"perturbed": [], "durable": -1, "stats": {}}, fh)
            try:
                train(o, 0, a.steps, rank, mine, ckpt=ckpt, flush=flush)
            finally:
                os._exit(3)
        train(o, 0, a.stop, rank, mine, kill_at=kill, ckpt=ckpt, flush=flush,
              flush_at=a.flush_at)
        bad = [s for s in mine if differences(mine[s], snaps[s])]
        if a.end == "close":
            ckpt.close()
        with open(os.path.join(a.out, f"train-{rank}.json"), "w") as fh:
            json.dump({"perturbed": bad, "durable": ckpt.durable_step,
                       "stats": ckpt.stats()}, fh)
        if a.end == "kill":  # the other ranks: stop without closing, like a crash
            os._exit(0)
        if a.end == "crash":
            os._exit(0)
    elif a.phase == "refusals":
        got = {}
        o = build(a, rank)
        for name, kw in (("unsharded_log", {}), ("auto", {"snapshot_every": "auto"}),
                         ("delta", {"mode": "delta"}), ("layerwise", {"capture": "layerwise"})):
            path = a.dir if name == "unsharded_log" else os.path.join(a.out, f"x-{name}")
            try:
                DiffCheckpointer(path, o.ddp, o.opt, **kw).close()
                got[name] = None
            except Exception as e:
                got[name] = getattr(getattr(e, "reason", None), "value", repr(e))
        try:
            restore(a.dir, o.ddp, o.opt)
            got["restore_unsharded"] = None
        except Exception as e:
            got["restore_unsharded"] = getattr(getattr(e, "reason", None), "value", repr(e))
        from torch.distributed.fsdp import fully_shard

        m = Net()
        fully_shard(m)
        try:
            DiffCheckpointer(os.path.join(a.out, "x-fsdp"), m,
                             torch.optim.AdamW(m.parameters(), lr=1e-2)).close()
            got["fsdp2"] = None
        except Exception as e:
            got["fsdp2"] = getattr(getattr(e, "reason", None), "value", repr(e))
        with open(os.path.join(a.out, f"refusals-{rank}.json"), "w") as fh:
            json.dump(got, fh)
    else:
        snaps = torch.load(ref_path)
        o = build(a, rank)
        res = restore(a.dir, o.ddp, o.opt, scheduler=o.sched)
        o.extra.update(res.extra or {})
        restored_bad = differences(snapshot(o), snaps[res.step])
        ckpt = make_ckpt(a, o, rank)
        train(o, res.step, a.steps, rank, ckpt=ckpt)
        ckpt.close()
        final_bad = differences(snapshot(o), snaps[a.steps])
        with open(os.path.join(a.out, f"result-{rank}.json"), "w") as fh:
            json.dump({"step": res.step, "exact": res.exact, "notes": res.notes,
                       "base_step": res.base_step, "base_slices": list(res.base_slices),
                       "verified": res.verified,
                       "extra": res.extra, "restored_bad": restored_bad,
                       "final_bad": final_bad, "stats": ckpt.stats()}, fh)
    dist.barrier()  # every rank is done with every collective
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: destroying gloo's threads at exit can abort the process
    # ("terminate called without an active exception") after all the work succeeded
    os._exit(0)


def serve() -> None:
    """``dist_worker.py --serve``: a fork server (``tests/helpers/fork_server.py``) that
    makes every phase's imports once, then forks a :func:`main` per run
    (``test_distributed.py``'s launches)."""
    from tests.helpers.fork_server import serve_worker

    serve_worker(main, "torch.distributed.fsdp", "torch.distributed.optim",
                 "lowdiff_store.torch.capture.checkpointer")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main()
