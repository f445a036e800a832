#!/usr/bin/env python3
"""How the engine's costs grow with the state (issue 24, item 3).

A synthetic model of N float32 parameters (tensors of 4M values) trained by AdamW on seeded
random gradients (``normal_`` into the existing ``.grad``: it stands in for backward), a
dense diff every step (the default capture), a base every 4 steps, torch threads 1. A
"step" below is that gradient fill plus ``optimizer.step()`` (the checkpointer's hooks
run inside it). Per size, in one process (memory figures in fresh child processes):

- ``step_ratio``: median checkpointed step that takes no base, after the first base (steps
  1-3 share the cores with the one-time touch of the staging memory) / median bare step
  (bare steps before and after the checkpointed ones, same objects);
- ``base_stall_s``: median over the bases at steps 4, 8 and 12 of (that step + the next -
  2 x that median checkpointed step), also ``base_stall_copies``: in
  units of ``warm_copy_s``, one copy of the state (parameters and both moments) into an
  already-touched 256 MiB buffer, piece by piece; ``base_thread_s`` / ``base_thread_copies``:
  what the training thread itself spent on each of those bases (staging in the post-step
  hook + settling the copy in the next pre-step hook: ``stats()["base_stage_s"]`` +
  ``["base_settle_s"]``), the stall without the noise of whole steps; ``base_deferred`` /
  ``base_dropped``: bases put off (staging memory still being written) or dropped;
  ``staging_per_state``: the staging memory held, per byte of state; ``writer_base_mbps``:
  the writer's own bandwidth over every base it wrote (beside training);
  ``base0_s`` / ``base0_copies``: ``DiffCheckpointer(...)`` returning (log created, base 0
  written from the live tensors and durable);
- ``base_write_ratio``: ``DiffCheckpointer(...)`` + ``flush()`` on a fresh log (base 0
  durable) over a raw ``write`` + ``fsync`` of as many bytes (the state's own memory),
  interleaved, median of 3 rounds each; ``base_write_mbps`` / ``raw_write_mbps``;
  ``base0_return_s`` / ``base0_return_ratio``: ``DiffCheckpointer(...)`` returning (base 0
  written in the background, not yet durable), and that over the same raw write;
- ``restore_ratio``: ``restore()`` of step 7 (base 4 + 3 diffs) with the log's files out
  of the page cache (``POSIX_FADV_DONTNEED``; median of three, interleaved with the cold
  reads) over its bound: a cold read of the base and of the 3 records (median of three)
  + 3 bare optimizer steps (``restore_bound_s``);
- ``train_anon_per_state``: peak growth of anonymous memory (``RssAnon``, sampled every
  2 ms) while training with bases, over the memory before the checkpointer was attached
  (model, moments and gradients already there), per byte of state; ``bare_anon_per_state``:
  the same over bare steps (the optimizer's own temporaries, which glibc maps and unmaps
  every step); ``engine_anon_per_state``: the difference, what the engine adds (its
  staging memory, ``staging_per_state``, plus the records in flight);
- ``restore_anon_per_state`` / ``restore_extra_per_state``: peak anonymous growth during
  ``restore()`` in a fresh process holding the model and an empty AdamW (the growth
  includes the moments ``restore`` creates), and that peak beyond what stays afterwards;
- ``replay_state_anon_per_state``: peak anonymous growth during ``replay_state()`` (which
  returns a new copy of the model state) in a fresh process;
- ``log_bytes``: the log after 13 steps (4 bases, 13 diffs).

Everything is written under a temp directory in /tmp, removed at the end.

Options: ``--slices K`` (streamed bases, ``base_slices=K``), ``--live``
(``base_staging="live"``), ``--grads dropped`` (lent records), ``--base-every F`` (bases
every F steps: 3F + 1 checkpointed steps, the restore of step 2F - 1), ``--topk RATIO``
(training compresses its gradients with a ``TopKCompressor``, error feedback, attached
for the bare steps too: its residuals are training's, not the engine's).

Run:   python bench/bench_scale.py [--sizes 25m 100m 300m] [--json out.json] [--plot DIR]
       (500m and 600m need --allow-large: 19 and 22 GiB at their peak: the state, its
       gradients, one staging copy and two dense records)
Smoke: python -m pytest bench/bench_scale.py (a tiny size with --smoke; every figure)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowdiff_store.torch import DiffCheckpointer, replay_state, restore

HERE = os.path.dirname(os.path.abspath(__file__))

SIZES = {"smoke": 2_000_000, "25m": 25_000_000, "100m": 100_000_000, "250m": 250_000_000,
         "300m": 300_000_000, "500m": 500_000_000, "600m": 600_000_000}
LARGE = ("500m", "600m")
CHUNK = 4 << 20          # values per parameter tensor
BARE = 3                 # bare steps before and after them
#: ``every``: the base interval (``--base-every F``, default 4); ``steps``: checkpointed
#: steps, 3F + 1 (bases at 0, 4, 8, 12 and step 13 after it); ``restore_step``: 2F - 1
#: (base 4 + diffs 5, 6, 7); ``topk``: ``--topk RATIO``, training compresses its
#: gradients with a ``TopKCompressor`` (error feedback), or None: dense
RUN: dict[str, Any] = {"every": 4, "steps": 13, "restore_step": 7, "topk": None}


def set_every(every: int) -> None:
    """The base interval and the steps that follow from it (see :data:`RUN`)."""
    RUN.update(every=every, steps=3 * every + 1, restore_step=2 * every - 1)


def compressor() -> Any:
    """Training's gradient compressor (``--topk``), or None."""
    if RUN["topk"] is None:
        return None
    from lowdiff_store.torch import TopKCompressor

    return TopKCompressor(RUN["topk"], selector="sampled")
COPY_BUF = 64 << 20      # values of the warm copy buffer (256 MiB)
FIGURES = ("step_ratio", "slowest_per_median", "base_stall_s", "base_stall_copies",
           "warm_copy_s", "base0_s",
           "base0_copies", "base_thread_s", "base_thread_copies", "base_deferred",
           "base_dropped", "staging_per_state", "writer_base_mbps", "bare_anon_per_state",
           "engine_anon_per_state", "records_in_flight_max", "record_waits",
           "base_write_ratio", "base0_return_s", "base0_return_ratio", "base_write_mbps",
           "raw_write_mbps", "restore_s",
           "restore_bound_s", "restore_ratio", "train_anon_per_state",
           "restore_anon_per_state", "restore_extra_per_state",
           "replay_state_anon_per_state", "log_bytes", "state_bytes")


class Synthetic(torch.nn.Module):
    """N float32 parameters in tensors of at most :data:`CHUNK` values."""

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for i, lo in enumerate(range(0, n, CHUNK)):
            size = min(CHUNK, n - lo)
            self.register_parameter(f"w{i}", torch.nn.Parameter(
                torch.randn(size, generator=g) * 0.02))


def objects(n: int) -> tuple[Synthetic, torch.optim.AdamW]:
    model = Synthetic(n)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


#: how training clears its gradients between steps: "kept" (filled in place: each record
#: is a copy) or "dropped" (``zero_grad(set_to_none=True)`` then new ones, as backward
#: makes them: lent to the record, no copy); set by ``--grads``
GRADS = {"mode": "kept"}
#: ``--slices K``: bases streamed over K steps (``base_slices=K``; 1: consistent bases)
SLICES: dict[str, Any] = {"k": 1, "staging": "overlap", "in_flight": 2}
#: ``--writer-process``: the log written by a writer process, and its pid while it runs
WRITER: dict[str, Any] = {"on": False, "pid": 0, "ring_peak": 0, "writer_peak": 0}


def fill_grads(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    drop = GRADS["mode"] == "dropped"
    for p in model.parameters():
        if drop:
            p.grad = None
        if p.grad is None:  # restore() leaves none
            p.grad = torch.empty_like(p)
        p.grad.normal_(0.0, 1e-3, generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    t0 = time.perf_counter()
    fill_grads(model, step)
    opt.step()
    return time.perf_counter() - t0


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(model, opt))


# ------------------------------------------------------------------ memory and files


def rss_anon(pid: int | str = "self", field: str = "RssAnon") -> int:
    """``field`` of ``/proc/PID/status`` in bytes (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return 0
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def engine_memory() -> int:
    """This process's anonymous memory; with ``--writer-process``, beside it the ring (its
    shared pages mapped here) and the writer process's anonymous memory (:data:`WRITER`)."""
    out = rss_anon()
    if WRITER["on"]:
        ring = rss_anon("self", "RssShmem")
        writer = rss_anon(WRITER["pid"]) if WRITER["pid"] else 0
        WRITER["ring_peak"] = max(WRITER["ring_peak"], ring)
        WRITER["writer_peak"] = max(WRITER["writer_peak"], writer)
        out += ring + writer
    return out


class PeakAnon:
    """The peak of ``RssAnon`` while the block runs, sampled every 2 ms."""

    def __init__(self) -> None:
        self.start = self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, engine_memory())

    @contextlib.contextmanager
    def measure(self) -> Iterator[PeakAnon]:
        gc.collect()
        self.start = self.peak = engine_memory()
        self._stop.clear()
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join()
            self.peak = max(self.peak, engine_memory())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def evict(path: str) -> None:
    """Drop the files under ``path`` from the page cache (they are durable already)."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cold_read(paths: list[tuple[str, int, int]]) -> float:
    """Seconds to read (file, offset, length) ranges from disk into one reused buffer."""
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for path, off, length in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            end = off + length
            while off < end:
                k = os.preadv(fd, [view[:min(len(buf), end - off)]], off)
                if k <= 0:
                    break
                off += k
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------------ training side


def warm_copy_s(tensors: list[torch.Tensor]) -> float:
    """One copy of ``tensors`` into a touched buffer, piece by piece (median of 3)."""
    buf = torch.ones(COPY_BUF)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for t in tensors:
            flat = t.view(-1)
            for lo in range(0, flat.numel(), COPY_BUF):
                piece = flat[lo:lo + COPY_BUF]
                buf[:piece.numel()].copy_(piece)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def raw_write_s(tensors: list[torch.Tensor], nbytes: int, path: str) -> float:
    """``write`` the tensors' bytes (then zeros up to ``nbytes``) and ``fsync``."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        for t in tensors:
            mv = memoryview(t.view(-1).numpy()).cast("B")
            for lo in range(0, len(mv), 64 << 20):
                done += os.write(fd, mv[lo:lo + (64 << 20)])
        if nbytes > done:
            os.write(fd, bytes(nbytes - done))
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def base_write(model: torch.nn.Module, opt: torch.optim.Optimizer, root: str, tag: str,
               returned: list[float] | None = None) -> tuple[float, int]:
    """``DiffCheckpointer(...)`` + ``flush()`` on a fresh log: (seconds, base bytes);
    the seconds until the constructor returned (base 0 not yet durable) are appended to
    ``returned``."""
    path = os.path.join(root, f"bw-{tag}")
    t0 = time.perf_counter()
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=RUN["every"])
    if returned is not None:
        returned.append(time.perf_counter() - t0)
    ckpt.flush()
    dt = time.perf_counter() - t0
    ckpt.close()
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.startswith("base-"))
    shutil.rmtree(path)
    return dt, size


def train(n: int, root: str, log: str) -> dict[str, Any]:
    """The training-side figures; leaves the log at ``log``."""
    model, opt = objects(n)
    train_step(model, opt, 0)  # the moments exist from here on
    tensors = state_tensors(model, opt)
    r: dict[str, Any] = {"params": n, "state_bytes": state_bytes(model, opt)}
    r["warm_copy_s"] = warm_copy_s(tensors)
    comp = compressor()  # training's own (its residuals exist before the checkpointer)
    if comp is not None:
        comp.attach(opt)
        train_step(model, opt, 999)
    bare_mem = PeakAnon()
    with bare_mem.measure():  # what training alone allocates per step (optimizer temporaries)
        bare = [train_step(model, opt, 1000 + i) for i in range(BARE)]
    r["bare_anon_per_state"] = bare_mem.growth / r["state_bytes"]
    if comp is not None:
        comp.detach()  # (the checkpointer attaches it)
    mem = PeakAnon()
    with mem.measure():
        t0 = time.perf_counter()
        ckpt = DiffCheckpointer(log, model, opt, snapshot_every=RUN["every"],
                                base_slices=SLICES["k"], base_staging=SLICES["staging"],
                                records_in_flight=SLICES["in_flight"],
                                compressor=comp, writer_process=WRITER["on"])
        r["base0_s"] = time.perf_counter() - t0
        WRITER["pid"] = getattr(ckpt._out.sink, "pid", 0)
        times = {t: train_step(model, opt, t) for t in range(1, RUN["steps"] + 1)}
        ckpt.flush()
        st = ckpt.stats()
        ckpt.close()
        WRITER["pid"] = 0
    r["writer_process"] = WRITER["on"]
    if WRITER["on"]:  # (the peaks of the ring's pages and of the writer process's memory)
        r["ring_per_state"] = WRITER["ring_peak"] / r["state_bytes"]
        r["writer_anon_per_state"] = WRITER["writer_peak"] / r["state_bytes"]
    r["train_anon_per_state"] = mem.growth / r["state_bytes"]
    r["engine_anon_per_state"] = r["train_anon_per_state"] - r["bare_anon_per_state"]
    # the profile of what the engine adds: beyond its base staging, in gradients (one dense
    # record each), next to the most records in flight and the captures that waited
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    r["grads"] = GRADS["mode"]
    r["engine_beyond_staging_grads"] = (
        (r["engine_anon_per_state"] * r["state_bytes"] - st["base_staging_bytes"]) / grad_bytes)
    r["records_in_flight_max"] = st["records_in_flight_max"]
    r["record_waits"] = st["record_waits"]
    r["lent_grads"] = st["lent_grads"]
    if comp is not None:
        comp.attach(opt)
    bare += [train_step(model, opt, 2000 + i) for i in range(BARE)]
    if comp is not None:
        comp.detach()
    r["topk"] = RUN["topk"]
    r["base_every"] = RUN["every"]
    # a base's cost may land in its step or the next one (a step's record, and so its
    # base, is finished when the next step starts): both are its window
    window = {t + k for t in times if t % RUN["every"] == 0 for k in (0, 1)}
    # (steps 1-3 share the cores with the one-time touch of the staging memory)
    plain = statistics.median(v for t, v in times.items()
                              if t not in window and t > RUN["every"])
    r["step_s"] = [times[t] for t in sorted(times)]
    r["bare_step_s"] = statistics.median(bare)
    r["ckpt_step_s"] = plain
    r["step_ratio"] = plain / r["bare_step_s"]
    r["slices"] = SLICES["k"]
    r["staging"] = SLICES["staging"]
    r["records_in_flight"] = SLICES["in_flight"]
    # every step after the first base's window (streamed: every step takes a slice)
    later = [v for t, v in times.items() if t > RUN["every"]]
    r["slowest_per_median"] = max(later) / statistics.median(later)
    r["base_stall_s"] = statistics.median(times[t] + times[t + 1] - 2 * plain
                                          for t in times if t % RUN["every"] == 0)
    r["base_stall_copies"] = r["base_stall_s"] / r["warm_copy_s"]
    staged = max(1, RUN["steps"] // RUN["every"])  # bases after base 0 (copied beside the steps)
    r["base_thread_s"] = (st["base_stage_s"] + st["base_settle_s"]) / staged
    r["base_thread_copies"] = r["base_thread_s"] / r["warm_copy_s"]
    r["base_deferred"] = st["base_deferred"]
    r["base_dropped"] = st["base_dropped"]
    r["staging_per_state"] = st["base_staging_bytes"] / r["state_bytes"]
    r["writer_base_mbps"] = st["writer_base_bytes"] / max(st["writer_base_s"], 1e-9) / 1e6
    # where a checkpointed step's extra time goes, per step: the hooks on the training
    # thread, and appends waiting for the writer's memory budget (a disk behind)
    r["hooks_s_per_step"] = (st["capture_s"] + st["finalize_s"]) / RUN["steps"]
    r["writer_wait_s_per_step"] = st.get("writer_blocked_s", 0.0) / RUN["steps"]
    r["base0_copies"] = r["base0_s"] / r["warm_copy_s"]
    r["log_bytes"] = dir_bytes(log)
    bw, raw, returned = [], [], []
    for i in range(3):  # interleaved: the disk's mood is shared
        dt, size = base_write(model, opt, root, str(i), returned)
        bw.append((dt, size))
        raw_path = os.path.join(root, f"raw-{i}")
        raw.append(raw_write_s(tensors, size, raw_path))
        os.unlink(raw_path)
    size = bw[0][1]
    r["base_bytes"] = size
    r["base_write_s"] = statistics.median(d for d, _ in bw)
    r["raw_write_s"] = statistics.median(raw)
    r["base_write_mbps"] = size / r["base_write_s"] / 1e6
    r["raw_write_mbps"] = size / r["raw_write_s"] / 1e6
    r["base_write_ratio"] = r["base_write_s"] / r["raw_write_s"]
    r["base0_return_s"] = statistics.median(returned)
    r["base0_return_ratio"] = r["base0_return_s"] / r["raw_write_s"]
    return r


# ------------------------------------------------------------------ restore side (child)


def warm_imports() -> None:
    """What a first ``load_state_dict`` of an optimizer imports (``torch._dynamo``: seconds,
    once per process), done before any timing."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p])
    opt.load_state_dict(opt.state_dict())


def child_restore(n: int, log: str) -> dict[str, Any]:
    """In a fresh process: restore() of RUN["restore_step"], cold (first, so that its memory is
    not served from what an earlier phase freed: the memory figures are of this one), then
    its bound: a cold read of what it reads (median of three, each after dropping the files
    from the page cache) interleaved with two more cold restores into fresh objects (the
    time is the median of the three restores), and as many optimizer steps on the restored
    objects as it replayed."""
    torch.set_num_threads(1)
    warm_imports()
    from lowdiff_store.log import LogReader

    with LogReader(log) as r:
        plan, diffs = r.chain_from(RUN["restore_step"])
        files = [r.slice_path(s) for s in plan.slices] if plan.streamed \
            else [r.base_path(plan.first)]
        ranges = [(f, 0, os.path.getsize(f)) for f in files]
        ranges += [r.record_location(t) for t in diffs]
    model, opt = objects(n)
    evict(log)
    out: dict[str, Any] = {"replayed": len(diffs)}
    mem = PeakAnon()
    with mem.measure():
        t0 = time.perf_counter()
        res = restore(log, model, opt, step=RUN["restore_step"], compressor=compressor())
        out["restore_s"] = time.perf_counter() - t0
        kept = rss_anon() - mem.start
    assert res.step == RUN["restore_step"]
    # (--topk: the residuals are logged in bases only, ef_state="base", the default: a
    # step between bases restores weights and optimizer state exactly, residuals not)
    assert res.exact or RUN["topk"] is not None, res.notes
    out["restore_anon"] = mem.growth
    out["restore_extra"] = max(0, mem.peak - mem.start - kept)  # (samples may miss it)
    reads, restores = [], [out["restore_s"]]
    for i in range(3):  # the disk below the VM caches too, and its mood drifts: the
        evict(log)      # cold reads interleaved with two more restores, medians
        reads.append(cold_read(ranges))
        if i < 2:
            del model, opt, res
            gc.collect()
            model, opt = objects(n)
            evict(log)
            t0 = time.perf_counter()
            res = restore(log, model, opt, step=RUN["restore_step"], compressor=compressor())
            restores.append(time.perf_counter() - t0)
    out["restores_s"] = restores
    out["restore_s"] = statistics.median(restores)
    out["cold_reads_s"] = reads
    out["cold_read_s"] = statistics.median(reads)
    ts = []
    for t in range(len(diffs)):
        fill_grads(model, 10 + t)
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0)
    out["opt_steps_s"] = sum(ts)
    return out


def child_replay(log: str) -> dict[str, Any]:
    """In a fresh process: replay_state() of RUN["restore_step"], cold."""
    torch.set_num_threads(1)
    warm_imports()
    evict(log)
    mem = PeakAnon()
    with mem.measure():
        t0 = time.perf_counter()
        state, _ = replay_state(log, RUN["restore_step"])
        dt = time.perf_counter() - t0
    assert len(state) > 0
    return {"replay_state_s": dt, "replay_state_anon": mem.growth}


def in_child(args: list[str]) -> dict[str, Any]:
    args = [*args, "--base-every", str(RUN["every"])]
    if RUN["topk"] is not None:
        args += ["--topk", str(RUN["topk"])]
    r = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                       capture_output=True, text=True, check=False,
                       env={**os.environ, "PYTHONPATH": os.path.join(HERE, "..")})
    if r.returncode != 0:
        raise RuntimeError(f"child {args[:2]} failed:\n{r.stderr[-3000:]}")
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def measure(name: str, n: int) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="lowdiff-scale-", dir="/tmp")
    try:
        log = os.path.join(root, "log")
        r = {"size": name, **train(n, root, log)}
        gc.collect()
        c = in_child(["--child", "restore", "--params", str(n), "--log", log])
        r.update(c)
        r["restore_bound_s"] = c["cold_read_s"] + c["opt_steps_s"]
        r["restore_ratio"] = c["restore_s"] / r["restore_bound_s"]
        r["restore_anon_per_state"] = c["restore_anon"] / r["state_bytes"]
        r["restore_extra_per_state"] = c["restore_extra"] / r["state_bytes"]
        c = in_child(["--child", "replay", "--params", str(n), "--log", log])
        r.update(c)
        r["replay_state_anon_per_state"] = c["replay_state_anon"] / r["state_bytes"]
        return r
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ report


PLOTS = [("step_ratio", "checkpointed step / bare step", None),
         ("base_stall_copies", "base stall (warm copies of the state)", 0.5),
         ("base_thread_copies", "training-thread time per base (warm copies)", 0.5),
         ("base0_copies", "DiffCheckpointer() with base 0 (warm copies)", None),
         ("base_write_ratio", "base write / raw write+fsync", 0.9),
         ("base0_return_ratio", "DiffCheckpointer() returns / raw write+fsync", 1.1),
         ("restore_ratio", "restore() / (cold read + replayed steps)", 1.2),
         ("train_anon_per_state", "peak anon memory growth, training / state", None),
         ("engine_anon_per_state", "anon memory the engine adds, training / state", 1.1),
         ("restore_anon_per_state", "peak anon growth, restore() / state", 0.5),
         ("replay_state_anon_per_state", "peak anon growth, replay_state() / state", 1.3),
         ("log_bytes", "log bytes after 13 steps", None)]


def plot(rows: list[dict[str, Any]], out_dir: str) -> list[str]:
    """One PNG per figure against the state size (needs matplotlib): every run a dot, the
    line through the medians per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, title, goal in PLOTS:
        have = [r for r in rows if key in r]  # (a figure older runs did not have)
        if not have:
            continue
        sizes = sorted({r["state_bytes"] for r in have})
        xs = [b / 2**30 for b in sizes]
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        runs = {b: [r[key] for r in have if r["state_bytes"] == b] for b in sizes}
        ax.plot(xs, [statistics.median(runs[b]) for b in sizes], "-", color="C0")
        for x, b in zip(xs, sizes, strict=True):
            ax.plot([x] * len(runs[b]), runs[b], "o", color="C0", ms=4)
            name = next(r["size"] for r in rows if r["state_bytes"] == b)
            ax.annotate(name, (x, max(runs[b])), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        if goal is not None:
            ax.axhline(goal, color="grey", ls="--", lw=1, label=f"goal {goal}")
            ax.legend(fontsize=8)
        ax.set_xlabel("state (params + AdamW moments), GiB")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=min(0.0, 1.1 * min(min(v) for v in runs.values())))
        fig.tight_layout()
        path = os.path.join(out_dir, f"scale_{key}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("size", "{}"), ("grads", "{}"), ("writer_process", "{}"), ("state_bytes", "{:.2e}"),
            ("step_ratio", "{:.3f}"),
            ("base_stall_s", "{:.2f}"), ("base_stall_copies", "{:.1f}"),
            ("base_thread_copies", "{:.2f}"), ("base_deferred", "{:.0f}"),
            ("base0_copies", "{:.1f}"),
            ("base_write_ratio", "{:.2f}"), ("base0_return_ratio", "{:.2f}"),
            ("restore_ratio", "{:.2f}"),
            ("train_anon_per_state", "{:.2f}"), ("engine_anon_per_state", "{:.2f}"),
            ("staging_per_state", "{:.2f}"), ("engine_beyond_staging_grads", "{:.2f}"),
            ("records_in_flight_max", "{:.0f}"), ("record_waits", "{:.0f}"),
            ("restore_anon_per_state", "{:.2f}"),
            ("restore_extra_per_state", "{:.2f}"), ("replay_state_anon_per_state", "{:.2f}"),
            ("log_bytes", "{:.2e}")]
    lines = [" | ".join(k for k, _ in cols)]
    lines += [" | ".join(f.format(r[k]) if k in r else "-" for k, f in cols) for r in rows]
    return "\n".join(lines)


def measure_sizes(ap: argparse.ArgumentParser, sizes: list[str], allow_large: bool
                  ) -> list[dict[str, Any]]:
    big = [s for s in sizes if s in LARGE]
    if big and not allow_large:
        ap.error(f"{big} need --allow-large (the machine's memory is shared)")
    rows = []
    for s in sizes:
        rows.append(measure(s, SIZES[s]))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["25m", "100m", "300m"], choices=SIZES)
    ap.add_argument("--smoke", action="store_true", help="one tiny size (CI)")
    ap.add_argument("--allow-large", action="store_true",
                    help=f"allow {', '.join(LARGE)} (19-22 GiB at the peak)")
    ap.add_argument("--grads", choices=["kept", "dropped"], default="kept",
                    help="training keeps its gradients (copied records) or drops them "
                    "(zero_grad(set_to_none=True): lent records)")
    ap.add_argument("--slices", type=int, default=1, metavar="K",
                    help="stream every base over K steps (base_slices=K; at most F)")
    ap.add_argument("--base-every", type=int, default=4, metavar="F",
                    help="a base every F steps (3F + 1 checkpointed steps; restore of 2F - 1)")
    ap.add_argument("--topk", type=float, metavar="RATIO",
                    help="training compresses its gradients (TopKCompressor(RATIO), error "
                    "feedback): sparse records")
    ap.add_argument("--records-in-flight", type=int, choices=(1, 2), default=2,
                    help="dense gradient records in flight (records_in_flight)")
    ap.add_argument("--writer-process", action="store_true",
                    help="writer_process=True (memory: this process's anonymous memory, the "
                    "ring and the writer process's anonymous memory)")
    ap.add_argument("--live", action="store_true", help="with --slices: base_staging='live' "
                    "(the slices after the first written from the live tensors)")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    ap.add_argument("--plot", metavar="DIR", help="write one PNG per figure there")
    ap.add_argument("--from-json", metavar="FILE", nargs="+", help="report (and plot) "
                    "the rows of runs written by --json instead of measuring")
    ap.add_argument("--child", choices=["restore", "replay"], help=argparse.SUPPRESS)
    ap.add_argument("--params", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    GRADS["mode"] = a.grads
    set_every(a.base_every)
    RUN["topk"] = a.topk
    SLICES["k"] = a.slices
    SLICES["staging"] = "live" if a.live else "overlap"
    SLICES["in_flight"] = a.records_in_flight
    WRITER["on"] = a.writer_process
    if a.child is not None:
        out = child_restore(a.params, a.log) if a.child == "restore" else child_replay(a.log)
        print(json.dumps(out))
        return 0
    if a.from_json:
        rows = []
        for path in a.from_json:
            with open(path) as f:
                rows += list(json.load(f))
    else:
        rows = measure_sizes(ap, ["smoke"] if a.smoke else a.sizes, a.allow_large)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    if a.plot:
        for p in plot(rows, a.plot):
            print("wrote", p)
    return 0


def test_smoke(tmp_path: Any) -> None:
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--smoke", "--json",
                        str(out)], capture_output=True, text=True, check=False,
                       env={**os.environ, "PYTHONPATH": os.path.join(HERE, "..")})
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    missing = [k for k in FIGURES if k not in row]
    assert not missing, missing
    for k in FIGURES:  # a stall can be below the noise of a tiny step: any real number
        assert isinstance(row[k], (int, float)), (k, row[k])
        assert k.startswith("base_stall") or row[k] >= 0, (k, row[k])
    assert row["state_bytes"] == 3 * 4 * SIZES["smoke"]
    assert row["log_bytes"] > 3 * row["state_bytes"]  # three bases at least


if __name__ == "__main__":
    sys.exit(main())
