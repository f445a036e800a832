"""One rank of the FSDP2 / resharding tests, run as a subprocess by ``test_fsdp.py``.

Phases:

- ``train``: an uninterrupted reference run to ``--steps`` (the gathered state of every
  step saved by rank 0 to ``OUT/ref.pt``), then fresh objects trained with a checkpointer
  from step 0 to ``--stop``; then rank ``--kill-rank`` SIGKILLs itself (``--end kill``) or
  every rank closes (``--end close``); ``--end shards``: rank 0 SIGKILLs itself where its
  checkpointer opens its log (after the layout published ``SHARDS`` and passed its
  agreement), while the other ranks open theirs and fail out of the next agreement;
  ``--end shards-written``: rank 0 SIGKILLs itself as soon as ``SHARDS`` is written
  (before the layout's agreement, so no rank opens its log).
  ``OUT/train-<rank>.json``: whether the checkpointed run matched the reference at
  ``--stop``. ``--also-source LAYOUT`` (ddp, zero): first the same two runs of that layout
  into ``--dir-LAYOUT`` (reference ``OUT/ref-LAYOUT.pt``), closed, or with ``--also-end
  kill`` left open, so that they die with the process as the main run ends.
- ``resume``: fresh objects of ``--layout`` (fsdp, ddp or plain) at ``--world`` ranks,
  ``restore`` of ``--dir``, the gathered state compared with the reference at the restored
  step; with ``--continue``, a checkpointer on the same directory, training to ``--steps``
  and a comparison with the reference there. ``OUT/result-<rank>.json``.
  With ``--refusals``, what an FSDP2 job must refuse is tried too (the error reason of
  each attempt, None when it was accepted).

``--base-slices K`` streams every base over K steps (``DiffCheckpointer(base_slices=K)``,
``test_streamed_bases_ranks.py``); without it the bases are consistent, as before.

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
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from lowdiff_store.errors import LowdiffError  # noqa: E402
from lowdiff_store.torch import DiffCheckpointer, restore  # noqa: E402


class Net(torch.nn.Module):
    """Linear(12, 30) -> LayerNorm -> ReLU -> Dropout -> Linear(30, 7), and a buffer
    counting forwards. 30 and 7 rows split unevenly over 4 (and 3) ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 30)
        self.ln = torch.nn.LayerNorm(30)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(30, 7)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.fc2(self.drop(torch.relu(self.ln(self.fc1(x)))))


#: checkpointers left open (``--also-end kill``): held, so that none is collected (and
#: closed) before the process dies
KEPT: list[Any] = []


def build(a: argparse.Namespace, rank: int, world: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model: Any = Net()
    if a.layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")) \
            if a.hsdp else init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if a.mp else MixedPrecisionPolicy()
        raf = not a.keep_unsharded
        for m in (model.fc1, model.fc2):
            fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    elif a.layout in ("ddp", "zero"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    if a.layout == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: Any = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                           lr=1e-2, weight_decay=0.01)
    elif a.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    elif a.optimizer == "adafactor":
        opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01,
                                foreach=a.foreach or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    torch.manual_seed(100 + rank)
    return model, opt, sched


def inner(model: Any) -> Any:
    return getattr(model, "module", model)


def train(a: argparse.Namespace, model: Any, opt: Any, sched: Any, start: int, stop: int,
          rank: int, extra: dict[str, Any], snaps: dict[int, Any] | None = None,
          ckpt: Any = None) -> None:
    for t in range(start, stop):
        opt.zero_grad(set_to_none=True)
        for micro in range(a.accum):
            g = torch.Generator().manual_seed(1000 * (t + 1) + 10 * rank + micro)
            x = torch.randn(8, 12, generator=g)
            y = torch.randint(0, 7, (8,), generator=g)
            if a.layout == "fsdp" and a.accum > 1:
                model.set_requires_gradient_sync(micro == a.accum - 1)
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
        if a.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        sched.step()
        extra["batches"] = t + 1
        if ckpt is not None and t + 1 == a.flush_at:
            ckpt.flush()
        if snaps is not None:
            snaps[t + 1] = gathered(model, opt)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    return t.detach().clone()


def gathered(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """The global state (collective with FSDP2): parameters, buffers, optimizer state."""
    m = inner(model)
    out = {f"model/{k}": _full(v) for k, v in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    state = getattr(opt, "optim", opt).state   # ZeRO: this rank's partition's
    for p in [p for g in opt.param_groups for p in g["params"]]:
        for k, v in sorted(state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                out[f"opt/{names[id(p)]}/{k}"] = _full(v)
    out["lr"] = torch.tensor([g["lr"] for g in opt.param_groups], dtype=torch.float64)
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


def reference_and_checkpointed(a: argparse.Namespace, rank: int, world: int, ref: str
                               ) -> Any:
    """The reference run to ``a.steps`` (saved by rank 0 as ``ref``; for ZeRO the same
    run with DDP and a plain AdamW, which updates every element the same way), then a
    checkpointed run to ``a.stop``; returns its checkpointer (closed unless ``a.end`` is
    ``kill``)."""
    b = argparse.Namespace(**{**vars(a), "layout": "ddp" if a.layout == "zero" else a.layout})
    model, opt, sched = build(b, rank, world)
    extra: dict[str, Any] = {"batches": 0}
    snaps: dict[int, Any] = {0: gathered(model, opt)}
    train(b, model, opt, sched, 0, a.steps, rank, extra, snaps)
    if rank == 0:
        torch.save(snaps, os.path.join(a.out, ref))
    model, opt, sched = build(a, rank, world)
    extra = {"batches": 0}
    if a.end.startswith("shards") and rank == 0:
        die_after_shards(a.end == "shards-written")
    ckpt = make_ckpt(a, model, opt, sched, extra)
    train(a, model, opt, sched, 0, a.stop, rank, extra, ckpt=ckpt)
    now = gathered(model, opt)
    keys = [k for k in now if a.layout != "zero" or k.startswith("model/")]
    bad = differences({k: now[k] for k in keys}, {k: snaps[a.stop][k] for k in keys})
    with open(os.path.join(a.out, f"train-{a.layout}-{rank}.json"), "w") as f:
        json.dump({"perturbed": bad, "stats": ckpt.stats()}, f)
    if a.end != "kill":
        ckpt.close()
    return ckpt


def die_after_shards(written: bool) -> None:
    """SIGKILL this process (rank 0) between publishing ``SHARDS`` and opening its log:
    where its checkpointer opens its log (the seam is the checkpointer's own name for its
    first step of opening, ``resume_point``, reached once every rank passed the layout's
    agreement, before any byte of this rank's log), or, ``written``, as soon as the
    layout's ``write_shards_manifest`` returned (before that agreement)."""
    from lowdiff_store.torch.capture import checkpointer
    from lowdiff_store.torch.distributed import checkpointer as per_rank

    def die(*_a: Any, **_k: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    write = per_rank.write_shards_manifest

    def write_then_die(*args: Any, **kw: Any) -> None:
        write(*args, **kw)
        die()
    if written:
        per_rank.write_shards_manifest = write_then_die
    else:
        checkpointer.resume_point = die  # type: ignore[assignment]


def reference_of(layout: str, now: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """``ref`` as ``gathered`` holds it for ``layout``: under ZeRO only this rank's
    partition has optimizer state (the reference is DDP with a plain AdamW, which updates
    every element the same way)."""
    if layout != "zero":
        return ref
    return {k: v for k, v in ref.items() if not k.startswith("opt/") or k in now}


def refusals(a: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """What an FSDP2 job refuses: the error reason of each attempt (None: accepted)."""
    out: dict[str, Any] = {}

    def attempt(key: str, fn: Any) -> None:
        try:
            fn()
            out[key] = None
        except LowdiffError as e:
            out[key] = e.reason.value

    sub = a.dir + "-refused"
    b = argparse.Namespace(**{**vars(a), "layout": "fsdp", "optimizer": "adafactor"})
    model, opt, _sched = build(b, rank, world)
    attempt("adafactor", lambda: DiffCheckpointer(sub + "1", model, opt))
    b.optimizer = "adamw"
    model, opt, _sched = build(b, rank, world)
    attempt("delta", lambda: DiffCheckpointer(sub + "2", model, opt, mode="delta"))
    from torch.distributed.optim import ZeroRedundancyOptimizer

    plain = Net()
    zero = ZeroRedundancyOptimizer(plain.parameters(), optimizer_class=torch.optim.AdamW)
    attempt("zero_target", lambda: restore(a.dir, plain, zero))
    return out


def make_ckpt(a: argparse.Namespace, model: Any, opt: Any, sched: Any,
              extra: dict[str, Any]) -> Any:
    kw: dict[str, Any] = {}
    if a.base_slices != 1:   # streamed bases (default: consistent ones, as before)
        kw["base_slices"] = a.base_slices
    return DiffCheckpointer(a.dir, model, opt, scheduler=sched, snapshot_every=a.every,
                            digest_every=2, extra_state=lambda: dict(extra), **kw)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="fsdp")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--foreach", action="store_true")
    ap.add_argument("--hsdp", action="store_true")
    ap.add_argument("--mp", action="store_true", help="bf16 MixedPrecisionPolicy")
    ap.add_argument("--keep-unsharded", action="store_true",
                    help="reshard_after_forward=False")
    ap.add_argument("--clip", action="store_true")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--stop", type=int, default=9)
    ap.add_argument("--flush-at", type=int, default=None)
    ap.add_argument("--end", default="close")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--tag", default="result")
    ap.add_argument("--base-slices", type=int, default=1,
                    help="DiffCheckpointer(base_slices=K): bases streamed over K steps")
    ap.add_argument("--refusals", action="store_true", help="resume phase: refusals too")
    ap.add_argument("--continue", dest="cont", action="store_true")
    ap.add_argument("--restore", action="append", default=[],
                    help="SOURCE:LAYOUT (resume phase, repeatable)")
    ap.add_argument("--also-source", action="append", default=[],
                    help="train phase: first a checkpointed run of this layout (ddp, zero) "
                         "into --dir-LAYOUT")
    ap.add_argument("--also-end", default="close", choices=["close", "kill"],
                    help="kill: the --also-source checkpointers are never closed (flushed at "
                         "--flush-at); they die with the process, as the main run ends")
    ap.add_argument("--timeout", type=float, default=100.0)
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    rank, world = a.rank, a.world
    faulthandler.dump_traceback_later(a.timeout, exit=True)  # a hung collective: fail loudly
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    extra: dict[str, Any] = {"batches": 0}
    if a.phase == "train":
        for src in a.also_source:   # other layouts' checkpoints first (closed: --also-end)
            b = argparse.Namespace(**{**vars(a), "layout": src, "dir": a.dir + "-" + src,
                                      "end": a.also_end})
            also = reference_and_checkpointed(b, rank, world, f"ref-{src}.pt")
            if a.also_end == "kill":   # left open: it dies with this process
                KEPT.append(also)
        if a.end.startswith("shards") and rank != 0:
            try:   # fails out of the checkpointer's agreement with the dead rank 0
                reference_and_checkpointed(a, rank, world, "ref.pt")
            finally:
                os._exit(3)
        ckpt = reference_and_checkpointed(a, rank, world, "ref.pt")
        if a.end == "kill":
            dist.barrier()
            if rank == a.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt.flush()
            os._exit(0)   # the others stop without closing, as a failing job does
    elif a.phase == "resume":
        # each --restore SOURCE:LAYOUT restores the checkpoint of SOURCE ("" for --dir,
        # else --dir-SOURCE) into fresh LAYOUT objects and compares with its reference;
        # --continue then trains the first one on (same directory) to --steps
        out: dict[str, Any] = {}
        first: Any = None
        for spec in a.restore:
            src, layout = spec.split(":")
            b = argparse.Namespace(**{**vars(a), "layout": layout})
            model, opt, sched = build(b, rank, world)
            res = restore(a.dir + ("-" + src if src else ""), model, opt, scheduler=sched)
            ref = torch.load(os.path.join(a.out, f"ref-{src}.pt" if src else "ref.pt"))
            now = gathered(model, opt)
            keys = [k for k in now if src != "zero" or k.startswith(("model/", "opt/"))]
            want = reference_of(layout, now, ref[res.step])
            out[spec] = {"step": res.step, "base_step": res.base_step,
                         "base_slices": list(res.base_slices), "exact": res.exact,
                         "notes": res.notes, "extra": res.extra,
                         "restored_bad": differences({k: now[k] for k in keys},
                                                     {k: want[k] for k in keys})}
            if first is None:   # the later restores set the RNG to their logs' states
                first = (b, model, opt, sched, res, ref, torch.get_rng_state())
        if a.cont:
            b, model, opt, sched, res, ref, rng = first
            torch.set_rng_state(rng)
            extra.update(res.extra or {})
            ckpt = make_ckpt(b, model, opt, sched, extra)
            train(b, model, opt, sched, res.step, a.steps, rank, extra, ckpt=ckpt)
            ckpt.close()
            now = gathered(model, opt)
            out["final_bad"] = differences(now, reference_of(b.layout, now, ref[a.steps]))
        if a.refusals:
            out["refusals"] = refusals(a, rank, world)
        with open(os.path.join(a.out, f"{a.tag}-{rank}.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()  # every rank is done with every collective
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: destroying gloo's threads at exit can abort the process
    # ("terminate called without an active exception") after all the work succeeded
    os._exit(0)


def serve() -> None:
    """``fsdp_worker.py --serve``: a fork server (``tests/helpers/fork_server.py``) that
    makes every phase's imports once, then forks a :func:`main` per run."""
    from tests.helpers.fork_server import serve_worker

    serve_worker(main, "torch.distributed.fsdp", "torch.distributed.optim",
                 "torch.distributed.checkpoint", "lowdiff_store.torch.capture.checkpointer")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main()
