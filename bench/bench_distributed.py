#!/usr/bin/env python3
"""Per-rank cost of per-iteration checkpointing with 2 ranks vs 1 (DDP on CPU, gloo).

For each communication hook (plain all-reduce, fp16 compression, PowerSGD rank 4, the
project's top-1% all-gather) the same training runs as a 1-rank and as a 2-rank job,
launched from this one run. Every rank alternates, round by round, a block of steps without
checkpointing (its baseline) and a block with ``DiffCheckpointer`` + ``wrap_comm_hook``
(fresh objects each block), so machine noise hits both alike. Reported per rank:

  log B/step       encoded bytes logged per step (the rank's share; before zstd)
  largest base B   bytes of the rank's largest base (one with optimizer state)
  fg ms/step       foreground time in the checkpointer's hooks per step (capture +
                   finalize, bases every ``--every`` steps included)
  step ms          median step time without / with checkpointing; overhead = ratio - 1

and the ratios 2-rank/1-rank of the bytes and foreground time. The development VM has 2
vCPUs, so a 2-rank job's processes compete for them: the time ratios are taken against a
control of two independent 1-rank jobs running at once (``1x2``), which loads the machine
alike. With one rank the layout is the unsharded one and the wrapped hook runs unchanged
(the gradient it produced is logged densely, in fp32); with two, each rank logs its share
as the hook produced it.

Run:   OMP_NUM_THREADS=1 python bench/bench_distributed.py [--rounds 3] [--steps 20]
Smoke: python -m pytest bench/bench_distributed.py -m bench
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
ROOT = os.path.dirname(HERE)
HOOKS = ("allreduce", "fp16", "powersgd", "topk")


# ---------------------------------------------------------------------- one rank


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, ROOT)
    from lowdiff_store.torch import DiffCheckpointer, TopKAllGatherState, topk_allgather_hook

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(a.rank),
                      WORLD_SIZE=str(a.world))
    dist.init_process_group("gloo")

    def build() -> tuple[Any, Any, Any, Any]:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(a.layers):
            layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(a.width, 10))
        # one bucket: PowerSGD issues collectives from gloo's callback threads, which with
        # several buckets in flight may reach the ranks in different orders
        ddp = DDP(model, bucket_cap_mb=1024)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        if a.hook == "allreduce":
            return ddp, opt, None, D.allreduce_hook
        if a.hook == "fp16":
            return ddp, opt, None, D.fp16_compress_hook
        if a.hook == "powersgd":
            return ddp, opt, P.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                             start_powerSGD_iter=2), P.powerSGD_hook
        return ddp, opt, TopKAllGatherState(ratio=0.01), topk_allgather_hook

    def block(ckpt_dir: str | None) -> tuple[list[float], dict[str, float]]:
        ddp, opt, state, hook = build()
        ckpt = None
        if ckpt_dir is not None:
            ckpt = DiffCheckpointer(ckpt_dir, ddp, opt, snapshot_every=a.every)
            ddp.register_comm_hook(state, ckpt.wrap_comm_hook(hook))
        else:
            ddp.register_comm_hook(state, hook)
        times = []
        for t in range(a.warmup + a.steps):
            g = torch.Generator().manual_seed(t * 7 + a.rank)
            x = torch.randn(a.batch, a.width, generator=g)
            y = torch.randint(0, 10, (a.batch,), generator=g)
            dist.barrier()  # the coordination-free part is what is timed
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            if t >= a.warmup:
                times.append(time.perf_counter() - t0)
        st: dict[str, float] = {}
        if ckpt is not None and ckpt_dir is not None:
            ckpt.close()
            st = ckpt.stats()
            shard = getattr(ckpt, "path", ckpt_dir)
            st["max_base_bytes"] = max(os.path.getsize(os.path.join(shard, f))
                                       for f in os.listdir(shard) if f.startswith("base-"))
        return times, st

    out: dict[str, Any] = {"rank": a.rank, "world": a.world, "hook": a.hook, "base": [],
                           "ckpt": [], "stats": []}
    for r in range(a.rounds):
        tb, _ = block(None)
        d = tempfile.mkdtemp(dir=a.tmp, prefix=f"r{r}-")
        dist.barrier()
        tc, st = block(d)
        out["base"].append(statistics.median(tb))
        out["ckpt"].append(statistics.median(tc))
        out["stats"].append(st)
    with open(os.path.join(a.out, f"{a.hook}-{a.tag}-{a.rank}.json"), "w") as fh:
        json.dump(out, fh)
    dist.barrier()  # every rank is done with every collective
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: destroying gloo's threads at exit can abort the process
    # ("terminate called without an active exception") after all the work succeeded
    os._exit(0)


# ---------------------------------------------------------------------- the driver


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(a: argparse.Namespace, hook: str, world: int, out: str, tmp: str,
         copies: int = 1) -> None:
    """A ``world``-rank job; ``copies`` independent ones at once (the control: two 1-rank
    jobs load the machine like one 2-rank job)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    procs = []
    for c in range(copies):
        port = _port()
        tag = f"{world}" if copies == 1 else f"{world}x{copies}.{c}"
        args = ["--hook", hook, "--world", str(world), "--port", str(port), "--out", out,
                "--tmp", tmp, "--rounds", str(a.rounds), "--steps", str(a.steps),
                "--warmup", str(a.warmup), "--width", str(a.width), "--layers",
                str(a.layers), "--batch", str(a.batch), "--every", str(a.every), "--tag", tag]
        procs += [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r),
                                    *args], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT) for r in range(world)]
    for r, p in enumerate(procs):
        o, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{hook} world {world} process {r} failed:\n"
                               f"{o.decode(errors='replace')[-3000:]}")


def _per_rank(out: str, hook: str, tag: str, ranks: int) -> list[dict[str, float]]:
    rows = []
    for r in range(ranks):
        with open(os.path.join(out, f"{hook}-{tag}-{r}.json")) as fh:
            d = json.load(fh)
        sts = d["stats"]
        steps = sum(s["steps"] for s in sts)
        rows.append({
            "log_b_step": sum(s["diff_bytes"] for s in sts) / steps,
            "base_b": max(s["max_base_bytes"] for s in sts),
            "fg_ms": 1e3 * sum(s["capture_s"] + s["finalize_s"] for s in sts) / steps,
            "base_ms": 1e3 * statistics.median(d["base"]),
            "ckpt_ms": 1e3 * statistics.median(d["ckpt"]),
            "overhead": statistics.median(c / b for c, b in zip(d["ckpt"], d["base"],
                                                                strict=True)) - 1,
            "tee": sum(s.get("tee_params", 0) for s in sts) / steps,
            "fallbacks": sum(s.get("tee_fallbacks", 0) for s in sts),
        })
    return rows


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every hook as a 1-rank job, two concurrent 1-rank jobs (``"1x2"``, the control
    for the machine's load) and a 2-rank job; one row per (hook, job, rank)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        for hook in a.hooks:
            _job(a, hook, 1, out, tmp)
            rows += [{"hook": hook, "world": "1", "rank": 0, **x}
                     for x in _per_rank(out, hook, "1", 1)]
            if a.control:
                _job(a, hook, 1, out, tmp, copies=2)
                rows += [{"hook": hook, "world": "1x2", "rank": 0, **x}
                         for x in _per_rank(out, hook, "1x2.0", 1)]
            _job(a, hook, 2, out, tmp)
            rows += [{"hook": hook, "world": "2", "rank": r, **x}
                     for r, x in enumerate(_per_rank(out, hook, "2", 2))]
    return rows


def table(rows: list[dict[str, Any]], params: int) -> str:
    """Markdown table of the rows, with the 2-rank / 1-rank ratios (time ratios against
    the ``1x2`` control when it ran)."""
    one = {r["hook"]: r for r in rows if r["world"] == "1"}
    ctl = {r["hook"]: r for r in rows if r["world"] == "1x2"}
    lines = [f"fp32 parameter bytes: {4 * params:,}", "",
             "| hook | job | rank | log B/step | vs fp32 params | largest base B | fg ms/step | "
             "step ms (no ckpt -> ckpt) | overhead | log B 2r/1r | base B 2r/1r | "
             "fg 2r/1r |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ref = one[r["hook"]]
        tref = ctl.get(r["hook"], ref)
        two = r["world"] == "2"
        rb = f"{r['log_b_step'] / ref['log_b_step']:.3f}" if two else ""
        rbb = f"{r['base_b'] / ref['base_b']:.3f}" if two else ""
        rt = f"{r['fg_ms'] / tref['fg_ms']:.2f}" if two and tref["fg_ms"] else ""
        lines.append(
            f"| {r['hook']} | {r['world']} | {r['rank']} | {r['log_b_step']:,.0f} | "
            f"{r['log_b_step'] / (4 * params):.4f} | {r['base_b']:,.0f} | {r['fg_ms']:.2f} | "
            f"{r['base_ms']:.1f} -> {r['ckpt_ms']:.1f} | {100 * r['overhead']:+.1f}% | "
            f"{rb} | {rbb} | {rt} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command line: run the benchmark (or, with ``--worker``, one rank of a job)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--hook", default="allreduce", help=argparse.SUPPRESS)
    ap.add_argument("--hooks", nargs="+", default=list(HOOKS), choices=HOOKS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--every", type=int, default=10, help="snapshot_every")
    ap.add_argument("--tmp", default=None, help="where the logs go (default: the temp dir)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="skip the two concurrent 1-rank jobs (the load control)")
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return
    params = a.layers * (a.width * a.width + a.width) + a.width * 10 + 10
    with open("/proc/loadavg") as fh:
        load0 = fh.read().split()[0]
    t0 = time.time()
    rows = run(a)
    with open("/proc/loadavg") as fh:
        load1 = fh.read().split()[0]
    if a.json:
        print(json.dumps(rows))
    print(f"# {params:,} parameters, {a.rounds} rounds x {a.steps} steps, snapshot_every "
          f"{a.every}, load {load0}-{load1}, {time.time() - t0:.0f} s")
    print(table(rows, params))


@pytest.mark.bench
def test_bench_distributed_smoke(tmp_path: Any) -> None:
    """CI smoke: both layouts run on a tiny model and report sane numbers."""
    a = argparse.Namespace(hooks=["fp16"], rounds=1, steps=2, warmup=1, width=32, layers=1,
                           batch=8, every=2, tmp=str(tmp_path), control=False)
    rows = run(a)
    assert [(r["world"], r["rank"]) for r in rows] == [("1", 0), ("2", 0), ("2", 1)]
    one, two = rows[0], rows[1:]
    assert sum(r["log_b_step"] for r in two) < one["log_b_step"]   # fp16 and split
    assert all(r["fallbacks"] == 0 and r["tee"] > 0 for r in two)
    assert "| fp16 | 2 |" in table(rows, 32 * 33 + 330)


if __name__ == "__main__":
    main()
