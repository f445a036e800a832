#!/usr/bin/env python3
"""Side-by-side benchmark of per-iteration checkpointing on a ~20M-parameter transformer LM.

Every configuration runs in the same process, interleaved round by round, so machine noise
hits all of them alike; each figure is the median over rounds of the median step time, and
ratios are taken against the baseline measured in the same run:

  dense          AdamW, no checkpointing                       (baseline for dense rows)
  dense+ld       DiffCheckpointer, mode="grad", dense capture at the pre-step hook
  dense+ld-lw    DiffCheckpointer, mode="grad", capture="layerwise" (LowDiff+)
  torch.save     torch.save(model + optimizer state) every step
  dcp.async      torch.distributed.checkpoint.async_save every step (waits for the previous)
  topk           top-1% compressed training (TopKCompressor), no checkpointing (baseline)
  topk+ld        the same with DiffCheckpointer logging the top-k diff every step
  dense+ldp      dense+ld with writer_process=True: encoding, writes and fsyncs in a writer
                 process fed through a shared ring (issue 49)
  topk+ldp       topk+ld with writer_process=True
  dense+raw      the floor of dense+ld on this machine: a plain thread writes the step's
                 gradient bytes (held by reference, no copy, as lending does) with
                 os.write and one fdatasync per step, at most two steps in flight; no
                 checksum, framing, index or manifest (a segment file reused past 1 GiB)
  dense+rawd     dense+raw through O_DIRECT: the bytes copied into a 4 KiB-aligned buffer
                 and written past the page cache (whether it lowers the floor)

Also: bytes per step of the top-1% log against the fp32 parameter bytes, and replay time per
step against optimizer.step() alone.

Run:   python bench/bench_torch.py [--rounds 5] [--steps 12]
Smoke: python -m pytest bench/bench_torch.py  (a tiny model, 2 steps; asserts it runs)
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _lm import LM, batch_for, train_step

from lowdiff_store.torch import DiffCheckpointer, TopKCompressor, restore
from lowdiff_store.verify import inspect_log

SIZES = {"20m": (8192, 64, 384, 8, 6, 4), "tiny": (128, 8, 32, 1, 2, 2)}


class RawFloor:
    """What persisting a dense gradient every step costs at the least: the step's gradients,
    held by reference (training replaces them at its next ``zero_grad``), written by a
    plain thread with ``os.write`` and one ``os.fdatasync``; at most two steps in flight
    (the next waits for the oldest), as the checkpointer bounds its dense records."""

    SEGMENT = 1 << 30

    def __init__(self, directory: str, model: torch.nn.Module) -> None:
        import concurrent.futures

        os.makedirs(directory, exist_ok=True)
        self.params = list(model.parameters())
        self.fd = os.open(os.path.join(directory, "raw.bin"),
                          os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.at = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raw-floor")
        self.pending: list[Any] = []

    def _write(self, grads: list[torch.Tensor]) -> None:
        if self.at > self.SEGMENT:
            os.lseek(self.fd, 0, os.SEEK_SET)
            self.at = 0
        for g in grads:
            self.at += os.write(self.fd, memoryview(g.detach().numpy()).cast("B"))
        os.fdatasync(self.fd)

    def after_step(self) -> None:
        if len(self.pending) >= 2:
            self.pending.pop(0).result()
        grads = [p.grad for p in self.params if p.grad is not None]
        self.pending.append(self.pool.submit(self._write, grads))

    def close(self) -> None:
        for f in self.pending:
            f.result()
        self.pool.shutdown()
        os.close(self.fd)


class DirectFloor(RawFloor):
    """:class:`RawFloor` through ``O_DIRECT``: the writer thread copies the step's gradients
    into one of two 4 KiB-aligned buffers (anonymous ``mmap``), which go to the disk by DMA
    with one ``os.write`` each, bypassing the page cache, then one ``os.fdatasync``. The
    probe of whether skipping the page cache (its copy, dirty pages and writeback) lowers
    the floor on this machine (bench/RESULTS.md, "ninth session")."""

    ALIGN = 4096

    def __init__(self, directory: str, model: torch.nn.Module) -> None:
        import mmap

        super().__init__(directory, model)
        os.close(self.fd)
        self.fd = os.open(os.path.join(directory, "raw.bin"),
                          os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        n = sum(p.numel() * p.element_size() for p in self.params)
        self.size = -(-n // self.ALIGN) * self.ALIGN
        self.bufs = [mmap.mmap(-1, self.size) for _ in range(2)]
        self.turn = 0

    def _write(self, grads: list[torch.Tensor]) -> None:
        buf = self.bufs[self.turn]
        self.turn ^= 1
        dst = torch.frombuffer(buf, dtype=torch.uint8)
        at = 0
        for g in grads:
            b = g.detach().reshape(-1).view(torch.uint8)
            dst[at:at + b.numel()].copy_(b)
            at += b.numel()
        del dst
        if self.at > self.SEGMENT:
            self.at = 0
        self.at += os.pwrite(self.fd, buf, self.at)
        os.fdatasync(self.fd)


class Run:
    """One configuration: its own model, optimizer and checkpointing, stepped on demand."""

    def __init__(self, name: str, size: str, workdir: str) -> None:
        self.name = name
        vocab, ctx, dim, layers, heads, batch = SIZES[size]
        torch.manual_seed(0)
        self.model = LM(vocab, ctx, dim, layers, heads)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.batch, self.ctx, self.vocab = batch, ctx, vocab
        self.dir = os.path.join(workdir, name.replace("+", "_").replace(".", "_"))
        self.step_no = 0
        self.ckpt: DiffCheckpointer | None = None
        self.pending: Any = None
        self.times: list[float] = []
        self.after: Callable[[], None] = lambda: None
        topk = name.startswith("topk")
        comp = TopKCompressor(ratio=0.01, error_feedback=True) if topk else None
        if name.endswith(("+ld", "+ld-lw", "+ldp")):
            opts: dict[str, Any] = {"capture": "layerwise"} if name.endswith("-lw") else {}
            if name.endswith("+ldp"):
                opts["writer_process"] = True
            self.ckpt = DiffCheckpointer(self.dir, self.model, self.opt, snapshot_every=10**9,
                                         batch=1, compressor=comp, **opts)
        elif comp is not None:
            comp.attach(self.opt)
        floor = {"dense+raw": RawFloor, "dense+rawd": DirectFloor}.get(name)
        self.raw = floor(self.dir, self.model) if floor is not None else None
        if self.raw is not None:
            self.after = self.raw.after_step
        if name == "torch.save":
            os.makedirs(self.dir, exist_ok=True)
            self.after = self._torch_save
        if name == "dcp.async":
            import torch.distributed.checkpoint as dcp

            self._dcp = dcp
            self.after = self._dcp_async

    def _torch_save(self) -> None:
        p = os.path.join(self.dir, "ckpt.pt")
        torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, p)

    def _dcp_async(self) -> None:
        if self.pending is not None:
            self.pending.result()  # one save in flight at a time, as DCP's docs advise
        sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        self.pending = self._dcp.async_save(
            sd, checkpoint_id=os.path.join(self.dir, f"step-{self.step_no % 2}"))

    def step(self) -> float:
        self.step_no += 1
        x = batch_for(self.step_no, self.vocab, self.batch, self.ctx)
        t0 = time.perf_counter()
        train_step(self.model, self.opt, x)
        self.after()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.pending is not None:
            self.pending.result()
        if self.raw is not None:
            self.raw.close()


CONFIGS = ["dense", "dense+ld", "dense+ld-lw", "torch.save", "dcp.async", "topk", "topk+ld",
           "dense+ldp", "topk+ldp", "dense+raw", "dense+rawd"]


def run(size: str, rounds: int, steps: int, warmup: int, workdir: str,
        configs: list[str] | None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    names = configs or CONFIGS
    runs = {c: Run(c, size, workdir) for c in names}
    for r in runs.values():
        for _ in range(warmup):
            r.step()
    per_round: dict[str, list[float]] = {c: [] for c in names}
    for _ in range(rounds):
        for c in names:
            per_round[c].append(statistics.median(runs[c].step() for _ in range(steps)))
    for r in runs.values():
        r.close()
    med = {c: statistics.median(v) for c, v in per_round.items()}
    # ratios per round (same round = same machine conditions), then the median
    def ratio(a: str, b: str) -> float:
        if a not in per_round or b not in per_round:
            return float("nan")
        return statistics.median(x / y for x, y in zip(per_round[a], per_round[b], strict=True))

    def spread(a: str, b: str) -> list[float]:
        if a not in per_round or b not in per_round:
            return [float("nan"), float("nan")]
        rs = [x / y for x, y in zip(per_round[a], per_round[b], strict=True)]
        return [min(rs), max(rs)]

    result: dict[str, Any] = {
        "size": size, "rounds": rounds, "steps_per_round": steps,
        "median_step_s": med,
        "ratio": {
            "dense+ld / dense": ratio("dense+ld", "dense"),
            "dense+ld-lw / dense": ratio("dense+ld-lw", "dense"),
            "torch.save / dense": ratio("torch.save", "dense"),
            "dcp.async / dense": ratio("dcp.async", "dense"),
            "topk+ld / topk": ratio("topk+ld", "topk"),
            "dense+ldp / dense": ratio("dense+ldp", "dense"),
            "topk+ldp / topk": ratio("topk+ldp", "topk"),
            "dense+raw / dense": ratio("dense+raw", "dense"),
            "dense+ld / dense+raw": ratio("dense+ld", "dense+raw"),
            "dense+rawd / dense": ratio("dense+rawd", "dense"),
        },
        "ratio_min_max": {
            "dense+ld / dense": spread("dense+ld", "dense"),
            "dense+ld-lw / dense": spread("dense+ld-lw", "dense"),
            "topk+ld / topk": spread("topk+ld", "topk"),
            "dense+ldp / dense": spread("dense+ldp", "dense"),
            "topk+ldp / topk": spread("topk+ldp", "topk"),
            "dense+raw / dense": spread("dense+raw", "dense"),
            "dense+rawd / dense": spread("dense+rawd", "dense"),
        },
        "step_s_per_round": per_round,
    }
    if "topk+ld" in runs:
        model = runs["topk+ld"].model
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        info = inspect_log(runs["topk+ld"].dir)
        result["topk_bytes_per_step"] = info["bytes_per_step"]
        result["topk_bytes_fraction_of_fp32_params"] = info["bytes_per_step"] / param_bytes
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": runs["topk+ld"].opt.state_dict()},
                   buf)
        result["full_checkpoint_bytes"] = buf.tell()
    if "dense+ld" in runs:
        result.update(replay_cost(size, runs["dense+ld"], workdir))
    return result


def replay_cost(size: str, src: Run, workdir: str) -> dict[str, float]:
    """Replay time per step (restore through the diffs) vs optimizer.step() alone."""
    fresh = Run("dense", size, workdir)
    t0 = time.perf_counter()
    res = restore(src.dir, fresh.model, fresh.opt)
    total = time.perf_counter() - t0
    n = max(res.step, 1)
    # optimizer.step() alone, same optimizer and state size, grads present
    for p in fresh.model.parameters():
        p.grad = torch.zeros_like(p)
    times = []
    for _ in range(max(5, min(n, 20))):
        t = time.perf_counter()
        fresh.opt.step()
        times.append(time.perf_counter() - t)
    opt_step = statistics.median(times)
    return {"replayed_steps": float(n), "replay_s_per_step": total / n,
            "optimizer_step_s": opt_step, "replay_ratio_to_optimizer_step": total / n / opt_step}


def test_bench_torch_smoke(tmp_path: Any) -> None:
    """CI smoke: the benchmark runs end to end on a tiny model and reports sane numbers."""
    out = run("tiny", rounds=1, steps=2, warmup=1, workdir=str(tmp_path),
              configs=[c for c in CONFIGS if c != "dense+rawd"])
    assert set(out["ratio"]) >= {"topk+ld / topk", "dense+ld / dense", "topk+ldp / topk",
                                 "dense+ldp / dense", "dense+raw / dense"}
    raw = os.path.join(tmp_path, "dense_raw", "raw.bin")  # (every step's gradients written)
    grads = sum(p.numel() * 4 for p in LM(*SIZES["tiny"][:5]).parameters())
    assert os.path.getsize(raw) == grads * (1 + 2)  # warmup 1, then 1 round x 2 steps
    assert all(v > 0 for v in out["median_step_s"].values())
    assert 0 < out["topk_bytes_fraction_of_fp32_params"] < 1
    assert out["replayed_steps"] >= 1


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def test_direct_floor_smoke(tmp_path: Any) -> None:
    """CI smoke of ``dense+rawd`` where the file system takes O_DIRECT (not tmpfs): every
    step's gradients are in its file, in 4 KiB-aligned writes."""
    try:
        out = run("tiny", rounds=1, steps=2, warmup=1, workdir=str(tmp_path),
                  configs=["dense", "dense+rawd"])
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        pytest.skip(f"no O_DIRECT on {tmp_path}: {e}")
    grads = sum(p.numel() * 4 for p in LM(*SIZES["tiny"][:5]).parameters())
    size = os.path.getsize(os.path.join(tmp_path, "dense_rawd", "raw.bin"))
    assert size == -(-grads // DirectFloor.ALIGN) * DirectFloor.ALIGN * (1 + 2)
    assert out["ratio"]["dense+rawd / dense"] > 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="20m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated subset of " + ",".join(CONFIGS))
    args = ap.parse_args()
    load_start = _loadavg()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        out = run(args.size, args.rounds, args.steps, args.warmup, d,
                  args.configs.split(","))
    out["loadavg"] = {"start": load_start, "end": _loadavg()}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"model {args.size}, {args.rounds} rounds x {args.steps} steps, 1 torch thread")
    for c, v in out["median_step_s"].items():
        print(f"  {c:<12} {v * 1000:8.1f} ms/step")
    for k, v in out["ratio"].items():
        if v != v:  # (nan: a configuration not run)
            continue
        lo_hi = out["ratio_min_max"].get(k)
        span = f"  (per round {lo_hi[0]:.3f}-{lo_hi[1]:.3f})" if lo_hi else ""
        print(f"  {k:<22} {v:6.3f}x{span}")
    print(f"  load average {out['loadavg']['start']} at the start, {out['loadavg']['end']} "
          "at the end")
    if "topk_bytes_per_step" in out:
        print(f"  top-1% bytes/step: {out['topk_bytes_per_step'] / 1e6:.3f} MB = "
              f"{100 * out['topk_bytes_fraction_of_fp32_params']:.2f}% of fp32 params "
              f"(full checkpoint {out['full_checkpoint_bytes'] / 1e6:.1f} MB)")
    if "replay_s_per_step" in out:
        print(f"  replay: {out['replay_s_per_step'] * 1000:.1f} ms/step vs optimizer.step() "
              f"{out['optimizer_step_s'] * 1000:.1f} ms = "
              f"{out['replay_ratio_to_optimizer_step']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

