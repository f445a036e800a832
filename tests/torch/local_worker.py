"""One rank of the local-update tests, run as a subprocess by ``test_local_update.py``.

Methods (``--method``): ``periodic`` (DDP + ``post_localSGD_hook`` +
``PostLocalSGDOptimizer(AdamW, PeriodicModelAverager)``), ``hier``
(``HierarchicalModelAverager``, 4 ranks), ``qsr`` (``QSRModelAverager``), ``diloco`` and
``diloco_qsr`` (the project's DiLoCo, fixed H or a QSR schedule).

Phases:

- ``ref``: the uninterrupted run to ``--steps``, no checkpointer; every step's state saved
  to ``OUT/ref-<rank>.pt``; ``--method a,b,...``: the runs of several methods in turn, in
  one job (its imports cost most of a short run's time), ``OUT/ref-<method>-<rank>.pt``;
- ``run``: restore if the checkpoint exists (comparing the restored state with the
  reference), train with a checkpointer to ``--steps`` or SIGKILL this rank at
  ``--kill-at`` (``--kill-where after``: after the wrapper's step and the scheduler;
  ``inner``: inside the inner optimizer's step, before any synchronization of that step;
  ``shards``: rank 0 at the moment its checkpointer would publish ``SHARDS``, after the
  layout's first agreement, ``--kill-at`` unused; ``open``: rank ``--kill-rank`` where its
  checkpointer opens its log, after rank 0 published ``SHARDS``, ``--kill-at`` unused);
  at the end compare with the reference; ``OUT/result-<rank>.json``;
- ``replica`` (one process): each rank's replica of the checkpoint (``replica``);
  ``--refusals-dir D``: then the refusals under ``D`` too (``refusals``, also a phase of
  its own);
- ``misplaced``: every checkpoint under ``--dir`` (rank directories swapped or copied)
  restored with ``restore`` and each replica with ``restore_replica``; what each attempt
  gave in ``OUT/misplaced-<rank>.json``.

Every batch is a pure function of (step, rank); dropout draws from the global RNG seeded
per rank, so each rank's RNG state is its own.

``python local_worker.py --serve``: a fork server (``tests/helpers/fork_server.py``) that
makes the imports of every phase once and forks a process for each run, which runs as the
script would (``test_local_update.py`` launches its ranks through one per rank).
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
    DeMo,
    DeMoCompressor,
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
    out: dict[str, Any] = {"model": model, "sched": sched, "net": model, "kw": {}}
    if method == "demo":   # FlexDeMo: no gradient all-reduce; DeMo exchanges coefficients
        opt = DeMo(model.parameters(), lr=0.01, weight_decay=0.01)
        comp = DeMoCompressor(decay=0.9, topk=4, chunk=8, process_group="world")
        out.update(opt=opt, comp=comp, kw={"compressor": comp, "ef_state": "step"},
                   sched=torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9))
        return out
    if method.startswith("diloco"):
        period: Any = 3 if method == "diloco" else QSRSchedule(inner, h_base=2, alpha=0.09)
        out["opt"] = DiLoCo(inner, outer_lr=0.7, outer_momentum=0.9, period=period)
        return out
    ddp = DDP(model)
    # the warmup's gradient all-reduce: with more than 2 ranks a restarted DDP's first
    # iteration may sum in another order (docs/distributed.md, "Guarantees"), so the 4-rank
    # runs go local from the start
    state = PL.PostLocalSGDState(process_group=None, subgroup=None,
                                 start_localSGD_iter=3 if world <= 2 else 0,
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


def inner_of(o: dict[str, Any]) -> Any:
    return o["opt"] if isinstance(o["opt"], DeMo) else o["opt"].optim


def counters(o: dict[str, Any]) -> list[int]:
    opt = o["opt"]
    if isinstance(opt, DeMo):
        return []
    if isinstance(opt, DiLoCo):
        return [opt.steps, opt.next_sync, opt.period, opt.syncs]
    av = opt.averager
    return [av.step, int(getattr(av, "next_sync", -1)), int(getattr(av, "period", -1)),
            o["state"].iter]


def snapshot(o: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"p/{n}": p.detach().clone() for n, p in o["model"].named_parameters()}
    opt = o["opt"]
    inner = inner_of(o)
    for i, p in enumerate(inner.param_groups[0]["params"]):
        if "comp" in o and p in o["comp"].residuals:
            out[f"ef/{i}"] = o["comp"].residuals[p].clone()
        for k, v in inner.state.get(p, {}).items():
            out[f"o/{i}/{k}"] = v.detach().clone()
    if isinstance(opt, DiLoCo):
        for i, g in enumerate(opt.global_params):
            out[f"g/{i}"] = g.detach().clone()
            buf = opt.outer.state.get(g, {}).get("momentum_buffer")
            if buf is not None:
                out[f"m/{i}"] = buf.clone()
    out["counters"] = torch.tensor(counters(o))
    out["lr"] = torch.tensor(float(inner.param_groups[0]["lr"]), dtype=torch.float64)
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


def reference(method: str, world: int, steps: int, rank: int, path: str) -> None:
    """The uninterrupted run of ``method`` to ``steps``, no checkpointer: every step's
    state saved to ``path``. The run starts as a process of its own would (the model built
    and the RNG seeded afresh), so one process may run several methods in turn."""
    o = build(method, world)
    torch.manual_seed(100 + rank)
    if "comp" in o:
        o["comp"].attach(o["opt"])
    snaps = [snapshot(o)]
    for t in range(steps):
        train_step(o, t, rank)
        snaps.append(snapshot(o))
    torch.save(snaps, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--phase", "--method", "--dir", "--out", "--kill-where"):
        ap.add_argument(a, default="after")
    for a in ("--rank", "--world", "--port", "--steps", "--kill-at", "--snapshot-every",
              "--kill-rank", "--from-world"):
        ap.add_argument(a, type=int, default=-1)
    ap.add_argument("--base-slices", type=int, default=1)
    ap.add_argument("--refusals-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    rank = args.rank
    if args.phase == "ref":
        methods = args.method.split(",")
        for method in methods:
            reference(method, args.world, args.steps, rank, os.path.join(
                args.out, f"ref-{rank}.pt" if len(methods) == 1 else f"ref-{method}-{rank}.pt"))
        dist.destroy_process_group()
        return
    o = build(args.method, args.world)
    torch.manual_seed(100 + rank)
    if args.phase == "replica":
        replica(args, o)
        if args.refusals_dir is not None:
            refusals(args, args.refusals_dir)
        return
    if args.phase == "refusals":
        refusals(args, args.dir)
        return
    if args.phase == "demo_reshard":
        demo_reshard(args, o)
        return
    if args.phase == "misplaced":
        misplaced(args)
        return
    ref = torch.load(os.path.join(args.out, f"ref-{rank}.pt"), weights_only=True)
    result: dict[str, Any] = {"rank": rank, "restored": None, "restored_bad": [],
                              "notes": [], "exact": True}
    start = 0
    if latest_step(args.dir) is not None:
        res = restore(args.dir, o["net"], o["opt"], scheduler=o["sched"],
                      compressor=o.get("comp"))
        start = res.step
        result.update(restored=start, restored_bad=diff(snapshot(o), ref[start]),
                      notes=res.notes, exact=res.exact)
    if args.kill_where == "shards" and rank == 0:
        # the seam is the layout's own name for the writer: killed before any byte of
        # SHARDS, while rank 1 goes on to open its log
        from lowdiff_store.torch.distributed import local_sgd

        def die_before_shards(*_a: Any, **_k: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)
        local_sgd.write_shards_manifest = die_before_shards  # type: ignore[assignment]
    if args.kill_where == "open" and rank == args.kill_rank:
        # the checkpointer's first step of opening: before any byte of this rank's log,
        # while rank 0 publishes SHARDS in select and opens its own
        from lowdiff_store.torch.capture import checkpointer

        def die_at_open(*_a: Any, **_k: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)
        checkpointer.resume_point = die_at_open  # type: ignore[assignment]
    ckpt = DiffCheckpointer(args.dir, o["net"], o["opt"], scheduler=o["sched"],
                            snapshot_every=args.snapshot_every, base_slices=args.base_slices,
                            **o["kw"])
    if args.kill_where == "inner" and args.kill_at >= 0:
        def die(*_a: Any) -> None:
            if ckpt.step + 1 == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        inner_of(o).register_step_post_hook(die)
    for t in range(start, args.steps):
        train_step(o, t, rank)
        if args.kill_where == "after" and t + 1 == args.kill_at \
                and args.kill_rank in (-1, rank):
            ckpt.flush() if rank % 2 == 0 else None   # rank parity: durable or not
            os.kill(os.getpid(), signal.SIGKILL)
    result["final_bad"] = diff(snapshot(o), ref[args.steps])
    result["base_slices"] = list(res.base_slices) if start else []
    result["stats"] = ckpt.stats()
    ckpt.close()
    with open(os.path.join(args.out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def replica(args: argparse.Namespace, o: dict[str, Any]) -> None:
    """One process: each rank's replica of a ``--from-world``-rank checkpoint, restored at
    the job's durable step with ``restore_replica``, against that rank's reference; and
    ``restore`` at this world size refused. ``OUT/replica.json``."""
    from lowdiff_store.errors import LowdiffError
    from lowdiff_store.torch import restore_replica

    out: dict[str, Any] = {"bad": {}, "steps": {}}
    job = latest_step(args.dir)
    for r in range(args.from_world):
        ref = torch.load(os.path.join(args.out, f"ref-{r}.pt"), weights_only=True)
        o = build(args.method, 1)
        res = restore_replica(args.dir, o["net"], o["opt"], rank=r, step=job,
                              scheduler=o["sched"])
        snap = snapshot(o)
        snap.pop("rng")   # the process's RNG is set to replica r's: compared below
        want = dict(ref[res.step])
        rng = want.pop("rng")
        out["bad"][r] = diff(snap, want) + ([] if torch.equal(torch.get_rng_state(), rng)
                                             else ["rng"])
        out["steps"][r] = res.step
    try:
        restore(args.dir, o["net"], o["opt"], scheduler=o["sched"])
        out["world_refused"] = None
    except LowdiffError as e:
        out["world_refused"] = [e.reason.value, str(e)]
    with open(os.path.join(args.out, "replica.json"), "w") as f:
        json.dump(out, f)


def misplaced(args: argparse.Namespace) -> None:
    """Every checkpoint under ``--dir`` restored collectively (``restore``) and each of its
    replicas with ``restore_replica``: per checkpoint and attempt, ``[reason, message]`` of
    the refusal, or ``[None, exact]`` of a restore that went through.
    ``OUT/misplaced-<rank>.json``."""
    from lowdiff_store.errors import LowdiffError
    from lowdiff_store.torch import restore_replica

    out: dict[str, Any] = {}

    def attempt(fn: Any) -> list[Any]:
        try:
            return [None, fn().exact]
        except LowdiffError as e:
            return [e.reason.value, str(e)]

    for name in sorted(os.listdir(args.dir)):
        root = os.path.join(args.dir, name)
        o = build(args.method, args.world)   # collective (DDP): every rank, same order
        got = {"restore": attempt(lambda o=o, root=root: restore(
            root, o["net"], o["opt"], scheduler=o["sched"]))}
        for r in range(2):
            o = build(args.method, args.world)
            got[f"replica-{r}"] = attempt(lambda o=o, r=r, root=root: restore_replica(
                root, o["net"], o["opt"], rank=r, scheduler=o["sched"]))
        out[name] = got
    with open(os.path.join(args.out, f"misplaced-{args.rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def demo_reshard(args: argparse.Namespace, o: dict[str, Any]) -> None:
    """A 2-rank DeMo (replica) checkpoint restored at this world size: one process (plain
    model, DeMo, a compressor) or FSDP2 over ``--world`` ranks (no compressor). The
    parameters and scheduler must equal the reference's at the job step (every rank's
    are the same); ``exact`` False with a note (momenta not carried).
    ``OUT/demo-reshard-<rank>.json``."""
    world = dist.get_world_size()
    model = o["model"]
    comp = o["comp"]
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        comp = None
    opt = DeMo(model.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    res = restore(args.dir, model, opt, scheduler=sched, compressor=comp)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}
    bad = []
    for r in range(2):
        ref = torch.load(os.path.join(args.out, f"ref-{r}.pt"), weights_only=True)[res.step]
        want = {k[2:]: v for k, v in ref.items() if k.startswith("p/")}
        bad += [f"{r}:{k}" for k in diff(full, want)]
        if float(ref["lr"]) != sched.get_last_lr()[0]:
            bad.append(f"{r}:lr")
    with open(os.path.join(args.out, f"demo-reshard-{args.rank}.json"), "w") as f:
        json.dump({"step": res.step, "bad": bad, "exact": res.exact, "notes": res.notes}, f)
    dist.destroy_process_group()


def refusals(args: argparse.Namespace, root: str) -> None:
    """One process: bad input under ``root`` refused with one line naming the file,
    nothing written. ``OUT/refusals.json``: per case, [reason, message, whether the
    directory exists]."""
    from torch.distributed.algorithms.model_averaging import averagers
    from torch.distributed.optim import PostLocalSGDOptimizer

    from lowdiff_store.errors import LowdiffError
    from lowdiff_store.torch import replay_state

    class MyAverager(averagers.ModelAverager):
        def average_parameters(self, params: Any) -> None:
            self.step += 1

    out: dict[str, Any] = {}

    def attempt(case: str, path: str, fn: Any) -> None:
        try:
            fn()
            out[case] = None
        except LowdiffError as e:
            out[case] = [e.reason.value, str(e), os.path.exists(path)]

    def plsgd(period: int) -> dict[str, Any]:
        o = build("periodic", 1)
        o["opt"] = PostLocalSGDOptimizer(optim=o["opt"].optim,
                                         averager=averagers.PeriodicModelAverager(
                                             period=period, warmup_steps=3))
        return o

    unknown = os.path.join(root, "unknown")
    o = build("periodic", 1)
    opt = PostLocalSGDOptimizer(optim=o["opt"].optim, averager=MyAverager())
    attempt("unknown_averager", unknown,
            lambda: DiffCheckpointer(unknown, o["net"], opt, snapshot_every=5))
    good = os.path.join(root, "good")
    o = plsgd(4)
    ck = DiffCheckpointer(good, o["net"], o["opt"], scheduler=o["sched"], snapshot_every=5)
    for t in range(6):
        train_step(o, t, 0)
    ck.close()
    o = plsgd(8)
    attempt("period_mismatch", good, lambda: restore(good, o["net"], o["opt"],
                                                     scheduler=o["sched"]))
    attempt("continued_other_period", good,
            lambda: DiffCheckpointer(good, o["net"], o["opt"], scheduler=o["sched"],
                                     snapshot_every=5))
    scaled = os.path.join(root, "scaled")
    o = plsgd(4)
    attempt("scaler", scaled,
            lambda: DiffCheckpointer(scaled, o["net"], o["opt"], snapshot_every=5,
                                     scaler=torch.amp.GradScaler("cpu")))
    o = build("periodic", 1)
    attempt("opened_as_ddp", good, lambda: restore(good, o["net"], o["opt"].optim))
    attempt("replay_state", good, lambda: replay_state(good))
    dd = build("diloco", 1)
    attempt("other_method", good, lambda: restore(good, dd["net"], dd["opt"]))
    plain = os.path.join(root, "plain")
    o = build("periodic", 1)
    DiffCheckpointer(plain, o["net"], o["opt"].optim, snapshot_every=5).close()
    o = plsgd(4)
    attempt("not_local", plain, lambda: restore(plain, o["net"], o["opt"]))
    attempt("log_into_plain", plain, lambda: DiffCheckpointer(plain, o["net"], o["opt"]))
    with open(os.path.join(args.out, "refusals.json"), "w") as f:
        json.dump(out, f)


def script() -> None:
    """The script: ``main`` on ``sys.argv``."""
    try:
        main()
    finally:
        # a rank failing out of a collective with a dead peer (the kill tests) destroys
        # its groups before the interpreter's teardown, as a well-behaved job does: torch
        # aborts a process (SIGABRT) whose gloo threads still hold failed work at exit
        if dist.is_initialized():
            dist.destroy_process_group()


def serve() -> None:
    """The fork server (``tests/helpers/fork_server.py``): every phase's imports made once,
    then a forked :func:`script` per run."""
    from tests.helpers.fork_server import serve_worker

    serve_worker(script, "safetensors.torch",
                 "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook",
                 "torch.distributed.algorithms.model_averaging.averagers",
                 "torch.distributed.algorithms.model_averaging.hierarchical_model_averager",
                 "torch.distributed.fsdp", "torch.distributed.optim", "torch.nn.parallel",
                 "lowdiff_store.torch.capture.checkpointer",
                 "lowdiff_store.torch.distributed.local_sgd")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        script()
