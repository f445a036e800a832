#!/usr/bin/env python3
"""FSDP2 logs per rank and resharded restore time (CPU, gloo).

The same MLP is trained for ``--steps`` steps (a base every ``--every``) as a 1-rank job
(plain model, unsharded log) and as FSDP2 jobs of 2 and 4 ranks (``fully_shard`` per layer
and at the root, one log per rank). Reported:

  log B/step/rank   encoded bytes each rank logs per step (its sharded gradient)
  base B/rank       bytes of each rank's largest base (its pieces + optimizer state)
  ratio             vs the 1-rank job

Then the 4-rank log is restored at W' = 4, 2 and 1 (FSDP2 at W' > 1, the plain model at
1), and, as the reference for each W', the log written by W' ranks at its own world size
(a *same-size* restore), both in the same W'-rank job, interleaved round by round. Each
rank times its own ``restore()`` call (started after a barrier; the newest step, replaying
``--steps - base`` diffs); the table gives the slowest rank's time (median over
``--rounds`` rounds) and the median of the per-round ratios resharded / same-size (goal
<= 1.2; also of the slowest rank's CPU times), each rank's own median wall and CPU time
(process time: the work a rank does, which contention on a small VM does not inflate),
and the bytes each rank read through the storage
interface (every ranged read of a source the local store opens, counted in the rank's
process). ``--restore-only 8`` also restores the largest log at 8 ranks (no reference).
The 2-vCPU development VM runs a W'-rank job's processes on two cores, so
times at W' = 4 include contention; the ratios compare jobs of the same W'.

Run:   OMP_NUM_THREADS=1 python bench/bench_reshard.py [--rounds 3] [--width 1024]
Smoke: python -m pytest bench/bench_reshard.py -m bench
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


# ---------------------------------------------------------------------- one rank


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from lowdiff_store.torch import DiffCheckpointer, restore

    torch.set_num_threads(1)
    if a.world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port),
                          RANK=str(a.rank), WORLD_SIZE=str(a.world))
        dist.init_process_group("gloo")

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(a.layers):
            layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(a.width, 10))
        if a.world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (a.world,))
            for m in model:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    out: dict[str, Any] = {"rank": a.rank, "world": a.world}
    if a.phase == "write":
        model, opt = build()
        ck = DiffCheckpointer(a.dir, model, opt, snapshot_every=a.every, digest_every=0)
        for t in range(a.steps):
            g = torch.Generator().manual_seed(1000 * t + a.rank)
            x = torch.randn(a.batch, a.width, generator=g)
            y = torch.randint(0, 10, (a.batch,), generator=g)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        ck.close()
        st = ck.stats()
        shard = ck.path
        out.update(log_b_step=st["diff_bytes"] / st["steps"],
                   base_b=max(os.path.getsize(os.path.join(shard, f))
                              for f in os.listdir(shard) if f.startswith("base-")))
    else:   # interleaved, round by round: every log of --dir (comma-separated)
        counter = _count_reads()
        times: dict[str, list[float]] = {d: [] for d in a.dir.split(",")}
        nbytes: dict[str, list[int]] = {d: [] for d in times}
        cpu: dict[str, list[float]] = {d: [] for d in times}
        order = list(times)
        for d in order:  # warm-up, not timed: page cache, allocator, first-call costs
            model, opt = build()
            if a.world > 1:
                dist.barrier()
            restore(d, model, opt, verify=False)
        for i in range(a.rounds):
            for d in order if i % 2 == 0 else order[::-1]:  # alternate which goes first
                model, opt = build()
                if a.world > 1:
                    dist.barrier()
                counter[0] = 0
                c0 = time.process_time()
                t0 = time.perf_counter()
                res = restore(d, model, opt, verify=False)
                times[d].append(time.perf_counter() - t0)
                cpu[d].append(time.process_time() - c0)
                nbytes[d].append(counter[0])
                out["step"] = res.step
        out["restore_s"] = times
        out["read_b"] = nbytes
        out["cpu_s"] = cpu
    with open(os.path.join(a.out, f"{a.tag}-{a.rank}.json"), "w") as fh:
        json.dump(out, fh)
    if a.world > 1:
        dist.barrier()  # every rank is done with every collective
        sys.stdout.flush()
        sys.stderr.flush()
        # no interpreter teardown: destroying gloo's threads at exit can abort the process
        # ("terminate called without an active exception") after all the work succeeded
        os._exit(0)


def _count_reads() -> list[int]:
    """Count, in ``out[0]``, the bytes this process reads through the storage interface
    (every ranged read of a source a local store opens, and whole-object reads)."""
    from lowdiff_store.storage.local import LocalStore

    out = [0]
    opened, whole = LocalStore.open, LocalStore.read

    class Counted:
        def __init__(self, inner: Any) -> None:
            self._inner, self.path, self.size = inner, inner.path, inner.size

        def read(self, offset: int, n: int) -> memoryview:
            out[0] += n
            got: memoryview = self._inner.read(offset, n)
            return got

        def close(self) -> None:
            self._inner.close()

    def open_(self: Any, name: str, mode: Any = "mmap", **kw: Any) -> Any:
        return Counted(opened(self, name, mode, **kw))

    def read_(self: Any, name: str, **kw: Any) -> bytes:
        data: bytes = whole(self, name, **kw)
        out[0] += len(data)
        return data

    LocalStore.open = open_  # type: ignore[method-assign]
    LocalStore.read = read_  # type: ignore[method-assign]
    return out


# ---------------------------------------------------------------------- the driver


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(a: argparse.Namespace, phase: str, world: int, d: str, out: str, tag: str
         ) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    port = _port()
    args = ["--phase", phase, "--world", str(world), "--port", str(port), "--dir", d,
            "--out", out, "--tag", tag, "--rounds", str(a.rounds), "--steps", str(a.steps),
            "--every", str(a.every), "--width", str(a.width), "--layers", str(a.layers),
            "--batch", str(a.batch)]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r), *args],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    for r, p in enumerate(procs):
        o, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{phase} world {world} rank {r} failed:\n"
                               f"{o.decode(errors='replace')[-3000:]}")
    rows = []
    for r in range(world):
        with open(os.path.join(out, f"{tag}-{r}.json")) as fh:
            rows.append(json.load(fh))
    return rows


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Write a log at every world size of ``a.worlds``, then restore the largest one at
    each of them and each log at its own world size."""
    res: dict[str, Any] = {"write": {}, "restore": {}}
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        for w in a.worlds:
            res["write"][w] = _job(a, "write", w, os.path.join(tmp, f"w{w}"), out, f"write{w}")
        big = max(a.worlds)
        for w in sorted({*a.worlds, *a.restore_only}):
            srcs = [w, big] if w in a.worlds else [big]
            dirs = [os.path.join(tmp, f"w{src}") for src in dict.fromkeys(srcs)]
            rows = _job(a, "restore", w, ",".join(dirs), out, f"restore{w}")
            slowest = {d: [max(r["restore_s"][d][i] for r in rows) for i in range(a.rounds)]
                       for d in dirs}
            same, resharded = slowest[dirs[0]], slowest[dirs[-1]]
            mine = [statistics.median(r["restore_s"][dirs[-1]]) for r in rows]
            read = [max(r["read_b"][dirs[-1]]) for r in rows]
            cpu = [statistics.median(r["cpu_s"][dirs[-1]]) for r in rows]
            res["restore"][w] = {
                "resharded_s": statistics.median(resharded),
                "rank_s": {"min": min(mine), "median": statistics.median(mine),
                           "max": max(mine)},
                "read_b": {"min": min(read), "mean": sum(read) / len(read),
                           "max": max(read)},
                "cpu_s": {"min": min(cpu), "median": statistics.median(cpu),
                          "max": max(cpu)}}
            if w in a.worlds:
                busy = {d: [max(r["cpu_s"][d][i] for r in rows) for i in range(a.rounds)]
                        for d in dirs}
                res["restore"][w].update(
                    same_s=statistics.median(same),
                    ratio=statistics.median(x / y for x, y in zip(resharded, same,
                                                                  strict=True)),
                    cpu_ratio=statistics.median(
                        x / y for x, y in zip(busy[dirs[-1]], busy[dirs[0]], strict=True)))
    return res


def table(res: dict[str, Any], big: int) -> str:
    """Markdown tables: bytes per rank vs 1 rank; restore time resharded vs same-size."""
    one = res["write"][1][0]
    lines = ["| ranks | log B/step/rank | ratio to 1 rank | base B/rank (max) | ratio |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for w, rows in sorted(res["write"].items()):
        lb = max(r["log_b_step"] for r in rows)
        bb = max(r["base_b"] for r in rows)
        lines.append(f"| {w} | {lb:,.0f} | {lb / one['log_b_step']:.3f} | {bb:,.0f} | "
                     f"{bb / one['base_b']:.3f} |")
    lines += ["", f"| W' | restore of the {big}-rank log (s, slowest rank) | wall s per "
              f"rank (min / median / max) | CPU s per rank (min / median / max) | MB read "
              f"per rank (min / mean / max) | same-size restore (s) | ratio | CPU ratio |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for w, r in sorted(res["restore"].items()):
        rk, rb, rc = r["rank_s"], r["read_b"], r["cpu_s"]
        same = f"{r['same_s']:.3f} | {r['ratio']:.2f} | {r['cpu_ratio']:.2f}" \
            if "ratio" in r else "- | - | -"
        lines.append(f"| {w} | {r['resharded_s']:.3f} | {rk['min']:.3f} / "
                     f"{rk['median']:.3f} / {rk['max']:.3f} | {rc['min']:.3f} / "
                     f"{rc['median']:.3f} / {rc['max']:.3f} | {rb['min'] / 1e6:,.1f} / "
                     f"{rb['mean'] / 1e6:,.1f} / {rb['max'] / 1e6:,.1f} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command line: run the benchmark (or, with ``--worker``, one rank of a job)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="write", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--restore-only", type=int, nargs="*", default=[],
                    help="world sizes the largest log is also restored at (no log of "
                         "their own, no same-size reference), e.g. 8")
    ap.add_argument("--rounds", type=int, default=3, help="timed restores per rank")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--every", type=int, default=10, help="snapshot_every")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tmp", default=None, help="where the logs go (default: the temp dir)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return
    params = a.layers * (a.width * a.width + a.width) + a.width * 10 + 10
    with open("/proc/loadavg") as fh:
        load0 = fh.read().split()[0]
    t0 = time.time()
    res = run(a)
    with open("/proc/loadavg") as fh:
        load1 = fh.read().split()[0]
    if a.json:
        print(json.dumps(res))
    print(f"# {params:,} parameters, {a.steps} steps, snapshot_every {a.every}, "
          f"{a.rounds} restores per rank, load {load0}-{load1}, {time.time() - t0:.0f} s")
    print(table(res, max(a.worlds)))


@pytest.mark.bench
def test_bench_reshard_smoke(tmp_path: Any) -> None:
    """CI smoke: 1- and 2-rank logs of a tiny model, restored at both world sizes."""
    a = argparse.Namespace(worlds=[1, 2], restore_only=[], rounds=1, steps=3, every=2,
                           width=16, layers=1, batch=4, tmp=str(tmp_path))
    res = run(a)
    one, two = res["write"][1][0], res["write"][2]
    assert all(r["log_b_step"] < one["log_b_step"] for r in two)   # each logs its shard
    assert set(res["restore"]) == {1, 2}
    assert all(r["resharded_s"] > 0 and r["same_s"] > 0 for r in res["restore"].values())
    assert res["restore"][2]["ratio"] == 1.0   # at the largest W' the same log
    # each of the 2 ranks reads about half of what the one rank reads
    assert res["restore"][2]["read_b"]["max"] < 0.75 * res["restore"][1]["read_b"]["max"]
    assert "| 2 |" in table(res, 2)


if __name__ == "__main__":
    main()
