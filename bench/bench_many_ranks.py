#!/usr/bin/env python3
"""Many ranks: a sharded checkpoint of W ranks restored at W' = 3W/4, W/4 and 1
(issue 24, item 4).

For each W of ``--worlds`` (default 8, 16, 32): W gloo processes on 127.0.0.1 (one torch
thread each) train a tiny MLP under FSDP2 (``fully_shard`` per Linear and at the root:
each rank holds a row block of every parameter and of its AdamW state) for ``--steps``
steps with a :class:`~lowdiff_store.torch.DiffCheckpointer` (a dense gradient diff every
step, a base every ``--every`` steps, one log per rank), then close it and write the
reference: the gathered parameters and optimizer state after the last step, as raw bytes
(``ref.bin``, and ``ref.json`` naming each tensor's dtype, shape and offset; no pickle).
Then, as new jobs, the checkpoint is restored

- at W' = 3W/4 and W/4 ranks: FSDP2 objects at W', ``restore()`` on every rank; each rank
  compares its own row blocks (parameters, every optimizer state tensor) with the same
  rows of the reference, byte for byte;
- at W' = 1 through ``replay_state(with_optimizer=True)`` in one process, compared whole.

Per restore, every rank reports the wall and CPU time of its ``restore()`` call (started
after a barrier), its peak RSS (``ru_maxrss``, torch and gloo included) and its anonymous
RSS after the restore, the files it opened and the bytes it read through the local store
(every ranged read of a source, and whole-file reads). The table gives the slowest rank
and the max over ranks; ``job_s`` is the whole job (process start to exit, torch import
included), which on a small VM is what a user waits for.

Every file is written under a temporary directory (``--tmp``), removed at the end.
Before each job the available memory is checked against ``--mb-per-rank`` per process.

Run:   OMP_NUM_THREADS=1 python bench/bench_many_ranks.py [--worlds 8 16 32] [--json]
Smoke: python -m pytest bench/bench_many_ranks.py (W = 2 at W' = 2 and 1, bitwise; the
       W = 4 case at 3, 2 and 1 is tests/torch/test_many_ranks.py; ``-m slow``: W = 32)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---------------------------------------------------------------------- one rank


def build_model(a: argparse.Namespace, world: int) -> tuple[Any, Any]:
    """The MLP (FSDP2 over ``world`` ranks when distributed) and its AdamW."""
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(a.width, 10))
    if world > 0:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def state_of(model: Any, opt: Any, full: bool) -> dict[str, Any]:
    """Parameters (``model/NAME``) and optimizer state tensors (``opt/NAME/KEY``): gathered
    (``full``, collective) or this rank's local pieces."""
    from torch.distributed.tensor import DTensor

    def get(t: Any) -> Any:
        if isinstance(t, DTensor):
            t = t.full_tensor() if full else t.to_local()
        return t.detach()

    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{n}": get(p) for n, p in model.named_parameters()}
    for g in opt.param_groups:
        for p in g["params"]:
            for k, v in sorted(opt.state.get(p, {}).items()):
                out[f"opt/{names[id(p)]}/{k}"] = get(v)
    return out


def _bits(t: Any) -> bytes:
    data: bytes = t.contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes()
    return data


def _write_ref(state: dict[str, Any], out: str) -> None:
    """``state`` as raw bytes (``ref.bin``) and an index (``ref.json``)."""
    index: dict[str, Any] = {}
    with open(os.path.join(out, "ref.bin"), "wb") as fh:
        for n, t in state.items():
            b = _bits(t)
            index[n] = [str(t.dtype).removeprefix("torch."), list(t.shape), fh.tell(), len(b)]
            fh.write(b)
    with open(os.path.join(out, "ref.json"), "w") as fh:
        json.dump(index, fh)


def read_reference(out: str) -> dict[str, Any]:
    """The reference state the training job wrote to ``out`` (see :func:`_write_ref`)."""
    import torch

    with open(os.path.join(out, "ref.json")) as fh:
        index = json.load(fh)
    with open(os.path.join(out, "ref.bin"), "rb") as fh:
        raw = fh.read()
    ref = {}
    for n, (dt, shape, off, nb) in index.items():
        buf = bytearray(raw[off:off + nb])
        ref[n] = torch.frombuffer(buf, dtype=getattr(torch, dt)).reshape(shape) if nb else \
            torch.empty(shape, dtype=getattr(torch, dt))
    return ref


def differences(got: dict[str, Any], ref: dict[str, Any], boxes: dict[str, Any]
                 ) -> list[str]:
    """Names whose bytes differ from the reference's (cut to ``boxes[name]``, the rows
    this rank holds, for tensors of its parameter's shape)."""
    bad = sorted(set(got) ^ set(ref))
    for n in sorted(set(got) & set(ref)):
        want = ref[n]
        box = boxes.get(n)
        if box is not None and want.dim() > 0:
            want = want[tuple(slice(o, o + k) for o, k in zip(*box, strict=True))]
        if got[n].dtype != want.dtype or tuple(got[n].shape) != tuple(want.shape) or \
                _bits(got[n]) != _bits(want):
            bad.append(n)
    return bad


def _count_io() -> dict[str, int]:
    """Count, in the returned dict, the files this process opens and the bytes it reads
    through the local store (ranged reads of an opened source, and whole-file reads)."""
    from lowdiff_store.storage.local import LocalStore

    out = {"opened": 0, "read_b": 0}
    opened, whole = LocalStore.open, LocalStore.read

    class Counted:
        def __init__(self, inner: Any) -> None:
            self._inner, self.path, self.size = inner, inner.path, inner.size

        def read(self, offset: int, n: int) -> memoryview:
            out["read_b"] += n
            got: memoryview = self._inner.read(offset, n)
            return got

        def close(self) -> None:
            self._inner.close()

    def open_(self: Any, name: str, mode: Any = "mmap", **kw: Any) -> Any:
        out["opened"] += 1
        return Counted(opened(self, name, mode, **kw))

    def read_(self: Any, name: str, **kw: Any) -> bytes:
        data: bytes = whole(self, name, **kw)
        out["opened"] += 1
        out["read_b"] += len(data)
        return data

    LocalStore.open = open_  # type: ignore[method-assign]
    LocalStore.read = read_  # type: ignore[method-assign]
    return out


def _profile_report(prof: Any, path: str) -> None:
    """The profile of rank 0's restore as text: the top functions by cumulative and by
    own time."""
    import io
    import pstats

    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(25)
    with open(path, "w") as fh:
        fh.write(buf.getvalue())


def _anon_rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from lowdiff_store.torch import DiffCheckpointer, replay_state, restore
    from lowdiff_store.torch.distributed.reshard import box_of

    torch.set_num_threads(1)
    distributed = a.phase != "replay"
    if distributed:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port),
                          RANK=str(a.rank), WORLD_SIZE=str(a.world))
        dist.init_process_group("gloo")
    row: dict[str, Any] = {"rank": a.rank}
    if a.phase == "train":
        model, opt = build_model(a, a.world)
        ck = DiffCheckpointer(a.dir, model, opt, snapshot_every=a.every, digest_every=0)
        for t in range(a.steps):
            g = torch.Generator().manual_seed(1000 * t + a.rank)
            x = torch.randn(a.batch, a.width, generator=g)
            y = torch.randint(0, 10, (a.batch,), generator=g)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        ck.close()
        full = state_of(model, opt, full=True)   # collective
        if a.rank == 0:
            _write_ref(full, a.out)
    else:
        io = _count_io()
        ref = read_reference(a.out)
        if distributed:
            model, opt = build_model(a, a.world)
            dist.barrier()
        prof = None
        if a.profile and a.rank == 0:
            import cProfile

            prof = cProfile.Profile(time.process_time)   # CPU: contention-free
            prof.enable()
        c0, t0 = time.process_time(), time.perf_counter()
        if distributed:
            res = restore(a.dir, model, opt)
            step = res.step
        else:
            sd, osd = replay_state(a.dir, with_optimizer=True)
            assert osd is not None
            step = a.steps
        if prof is not None:
            _profile_report(prof, os.path.join(a.profile, f"{a.tag}-w{a.world}.txt"))
        row.update(restore_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0, **io)
        if distributed:
            got = state_of(model, opt, full=False)
            boxes = {}
            for n, p in model.named_parameters():
                boxes[f"model/{n}"] = box_of(p)
                boxes.update({f"opt/{n}/{k}": box_of(p) for k in opt.state.get(p, {})})
        else:
            got = {f"model/{n}": t for n, t in sd.items()}
            for g in osd["param_groups"]:
                for i, n in zip(g["params"], g["param_names"], strict=True):
                    got.update({f"opt/{n}/{k}": v for k, v in osd["state"].get(i, {}).items()})
            boxes = {}
        row.update(step=step, bad=differences(got, ref, boxes), anon_b=_anon_rss())
    row["maxrss_b"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(a.out, f"{a.tag}-{a.rank}.json"), "w") as fh:
        json.dump(row, fh)
    if distributed:
        dist.barrier()   # every rank is done with every collective
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


def _available_mb() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def job(a: argparse.Namespace, phase: str, world: int, d: str, out: str, tag: str
         ) -> tuple[list[dict[str, Any]], float]:
    """Run ``world`` processes of ``phase``; their rows and the job's wall time."""
    need = world * a.mb_per_rank + 1024
    if _available_mb() < need:
        raise RuntimeError(f"{world} processes need about {need} MB; "
                           f"{_available_mb()} MB are available")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    args = ["--phase", phase, "--world", str(world), "--port", str(_port()), "--dir", d,
            "--out", out, "--tag", tag, "--steps", str(a.steps), "--every", str(a.every),
            "--width", str(a.width), "--layers", str(a.layers), "--batch", str(a.batch)]
    if a.profile:
        args += ["--profile", a.profile]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r), *args],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            o, _ = p.communicate()
        outs.append(o)
    wall = time.perf_counter() - t0
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise RuntimeError(f"{phase} at {world} rank(s), rank {r} exited {p.returncode}:"
                               f"\n{outs[r].decode(errors='replace')[-3000:]}")
    rows = []
    for r in range(world):
        with open(os.path.join(out, f"{tag}-{r}.json")) as fh:
            rows.append(json.load(fh))
    return rows, wall


def targets(w: int) -> list[int]:
    """The world sizes a W-rank checkpoint is restored at: 3W/4, W/4 (at least 2) and 1."""
    return list(dict.fromkeys([max(1, w * 3 // 4), max(min(2, w), w // 4), 1]))


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Train, then restore, every W of ``a.worlds``; per W and W', the figures (see the
    module docstring). Raises if any restored state differs from the reference."""
    res: dict[str, Any] = {}
    tmp = tempfile.mkdtemp(prefix="lowdiff-many-ranks-", dir=a.tmp)
    try:
        for w in a.worlds:
            d, out = os.path.join(tmp, f"ck{w}"), os.path.join(tmp, f"out{w}")
            os.makedirs(out)
            _rows, train_s = job(a, "train", w, d, out, "train")
            log_b = sum(os.path.getsize(os.path.join(dp, f))
                        for dp, _dn, fs in os.walk(d) for f in fs)
            per: dict[str, Any] = {"train_job_s": train_s, "log_bytes": log_b, "restore": {}}
            for w2 in targets(w):
                phase = "restore" if w2 > 1 else "replay"
                rows, job_s = job(a, phase, w2, d, out, f"{phase}{w2}")
                bad = {r["rank"]: r["bad"] for r in rows if r["bad"]}
                if bad or any(r["step"] != a.steps for r in rows):
                    raise AssertionError(f"W={w} restored at {w2}: not the reference state "
                                         f"(step {[r['step'] for r in rows]}, differing "
                                         f"tensors by rank {bad})")
                per["restore"][w2] = {
                    "how": "restore" if w2 > 1 else "replay_state",
                    "restore_s": max(r["restore_s"] for r in rows),
                    "cpu_s_max": max(r["cpu_s"] for r in rows),
                    "cpu_s_sum": sum(r["cpu_s"] for r in rows),
                    "maxrss_b": max(r["maxrss_b"] for r in rows),
                    "anon_b_max": max(r["anon_b"] for r in rows),
                    "anon_b_sum": sum(r["anon_b"] for r in rows),
                    "opened_max": max(r["opened"] for r in rows),
                    "opened_sum": sum(r["opened"] for r in rows),
                    "read_b_max": max(r["read_b"] for r in rows),
                    "read_b_sum": sum(r["read_b"] for r in rows),
                    "job_s": job_s, "bitwise": True}
            res[w] = per
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def table(res: dict[str, Any]) -> str:
    """One markdown row per (W, W')."""
    lines = ["| W | W' | how | restore s (slowest rank) | CPU s (max / sum over ranks) | "
             "peak RSS MB (max) | anon RSS MB (max / sum) | files opened (max / sum) | "
             "MB read (max / sum) | job s | bitwise |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    mb = 1 << 20
    for w, per in res.items():
        for w2, r in per["restore"].items():
            lines.append(
                f"| {w} | {w2} | {r['how']} | {r['restore_s']:.3f} | {r['cpu_s_max']:.3f} / "
                f"{r['cpu_s_sum']:.2f} | {r['maxrss_b'] / mb:.0f} | {r['anon_b_max'] / mb:.0f} "
                f"/ {r['anon_b_sum'] / mb:,.0f} | {r['opened_max']} / {r['opened_sum']} | "
                f"{r['read_b_max'] / mb:.2f} / {r['read_b_sum'] / mb:.1f} | {r['job_s']:.1f} "
                f"| {'yes' if r['bitwise'] else 'NO'} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="train", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=3, help="snapshot_every")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mb-per-rank", type=int, default=300,
                    help="memory one process is assumed to need (checked before a job)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    ap.add_argument("--tmp", default=None, help="where the files go (default: the temp dir)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="write a cProfile report of rank 0's restore of each job to DIR")
    return ap


def main(argv: list[str] | None = None) -> None:
    """Command line: run the benchmark (or, with ``--worker``, one rank of a job)."""
    a = _parser().parse_args(argv)
    if a.worker:
        _worker(a)
        return
    with open("/proc/loadavg") as fh:
        load0 = " ".join(fh.read().split()[:3])
    t0 = time.time()
    res = run(a)
    with open("/proc/loadavg") as fh:
        load1 = " ".join(fh.read().split()[:3])
    if a.json:
        print(json.dumps(res))
        return
    params = a.layers * (a.width * a.width + a.width) + a.width * 10 + 10
    print(f"# {params:,} parameters, {a.steps} steps, snapshot_every {a.every}, "
          f"load average {load0} -> {load1}, {time.time() - t0:.0f} s")
    print(table(res))


def small_args(tmp: str, worlds: list[int]) -> argparse.Namespace:
    """The options of a quick run (a 1-layer MLP of width 16, 5 steps, a base every 2)."""
    return _parser().parse_args(["--worlds", *map(str, worlds), "--steps", "5", "--every",
                                 "2", "--width", "16", "--layers", "1", "--batch", "4",
                                 "--tmp", tmp])


def _check(res: dict[str, Any], w: int) -> None:
    per = res[w]
    assert list(per["restore"]) == targets(w)
    for w2, r in per["restore"].items():
        assert r["bitwise"], (w, w2)
        assert r["restore_s"] > 0, (w, w2)
        assert r["read_b_max"] > 0, (w, w2)
    assert per["restore"][1]["how"] == "replay_state"


@pytest.mark.bench
def test_bench_many_ranks_smoke(tmp_path: Any) -> None:
    """Benchmark smoke: a 2-rank checkpoint restored at 2 ranks and by replay_state,
    bitwise; nothing is left in the temporary directory. (The 4-rank case at 3, 2 and 1
    ranks is ``tests/torch/test_many_ranks.py``'s.)"""
    res = run(small_args(str(tmp_path), [2]))
    _check(res, 2)
    assert "| 2 | 2 | restore |" in table(res)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_bench_many_ranks_32(tmp_path: Any) -> None:
    """The 32-rank case end to end, at the benchmark's sizes: restored at 24 and 8 ranks
    and by replay_state, every rank's state bitwise the reference's; a rank at W' = 24
    opens under a quarter of the files that replaying all 32 shards in one process opens
    (it describes about 32/24 shards and replays the few its rows overlap)."""
    res = run(_parser().parse_args(["--worlds", "32", "--tmp", str(tmp_path)]))
    _check(res, 32)
    got = res[32]["restore"]
    assert got[24]["opened_max"] * 4 < got[1]["opened_max"], got
    assert os.listdir(tmp_path) == []


if __name__ == "__main__":
    main()
