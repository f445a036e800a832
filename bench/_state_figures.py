"""State-sized figures for any device, as ratios against a bound measured in the same call
(issue 34, item 5): for ``bench/bench_gpu.py`` (CUDA objects) and ``bench/bench_scale.py``.

    from _state_figures import base0_vs_raw_write, restore_vs_cold_read
    f = base0_vs_raw_write(model, optimizer, root, rounds=3)
    # {"base0_return_s", "base0_durable_s", "raw_write_s", "base0_return_ratio",
    #  "base0_durable_ratio", "base_bytes"}
    g = restore_vs_cold_read(log_path, build, rounds=3)
    # build() -> (model, optimizer) fresh objects on the device to restore into;
    # {"restore_s", "cold_read_s", "restore_ratio", "step"}

Rounds are interleaved (the disk's mood is shared) and medians reported. The raw write is
the state's bytes (copied to host memory first, not timed) written and fsynced; the cold
read is every file of the log read with the page cache dropped (``POSIX_FADV_DONTNEED``).
On CUDA the restore is synchronized before the clock stops. Replayed optimizer steps are
not in this bound: add them (time ``optimizer.step()`` on the device) for restore's goal.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lowdiff_store.torch import DiffCheckpointer, restore


def _sync(objs: Any) -> None:
    if torch.cuda.is_available() and any(p.is_cuda for p in objs):
        torch.cuda.synchronize()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    out += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _raw_write(host: list[torch.Tensor], path: str) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for t in host:
            mv = t.reshape(-1).view(torch.uint8).numpy().data
            while mv.nbytes:
                mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def base0_vs_raw_write(model: torch.nn.Module, opt: torch.optim.Optimizer, root: str, *,
                       rounds: int = 3) -> dict[str, float]:
    """``DiffCheckpointer(...)`` on a fresh log (returned; then ``flush()``: base 0 durable)
    against a raw write + fsync of the state's bytes, interleaved ``rounds`` times."""
    host = [t.detach().cpu().contiguous() for t in _state(model, opt)]
    ret, dur, raw, size = [], [], [], 0
    for i in range(rounds):
        path = os.path.join(root, f"base0-{i}")
        _sync(model.parameters())
        t0 = time.perf_counter()
        ckpt = DiffCheckpointer(path, model, opt)
        ret.append(time.perf_counter() - t0)
        ckpt.flush()
        dur.append(time.perf_counter() - t0)
        ckpt.close()
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                   if f.startswith("base-"))
        shutil.rmtree(path)
        raw_path = os.path.join(root, f"raw-{i}")
        raw.append(_raw_write(host, raw_path))
        os.unlink(raw_path)
    r = {"base0_return_s": statistics.median(ret), "base0_durable_s": statistics.median(dur),
         "raw_write_s": statistics.median(raw), "base_bytes": float(size)}
    r["base0_return_ratio"] = r["base0_return_s"] / r["raw_write_s"]
    r["base0_durable_ratio"] = r["base0_durable_s"] / r["raw_write_s"]
    return r


def _evict(path: str) -> list[str]:
    files = []
    for d, _s, names in os.walk(path):
        for n in names:
            p = os.path.join(d, n)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            files.append(p)
    return files


def _cold_read(path: str) -> float:
    files = _evict(path)
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def restore_vs_cold_read(path: str, build: Callable[[], tuple[torch.nn.Module,
                                                              torch.optim.Optimizer]], *,
                         rounds: int = 3) -> dict[str, float]:
    """``restore()`` of the log at ``path`` into fresh objects from ``build()``, page cache
    dropped, against a cold read of the log's files, interleaved ``rounds`` times."""
    res_s, cold, step = [], [], -1
    for _ in range(rounds):
        model, opt = build()
        _evict(path)
        _sync(model.parameters())
        t0 = time.perf_counter()
        res = restore(path, model, opt)
        _sync(model.parameters())
        res_s.append(time.perf_counter() - t0)
        step = res.step
        del model, opt
        cold.append(_cold_read(path))
    r = {"restore_s": statistics.median(res_s), "cold_read_s": statistics.median(cold),
         "step": float(step)}
    r["restore_ratio"] = r["restore_s"] / r["cold_read_s"]
    return r


def test_smoke(tmp_path: Any) -> None:
    """Both figures on a tiny CPU model (CI)."""
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Linear(64, 64)
        return m, torch.optim.AdamW(m.parameters())

    model, opt = build()
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    f = base0_vs_raw_write(model, opt, str(tmp_path), rounds=1)
    assert f["base_bytes"] > 64 * 64 * 4 * 3
    assert f["base0_return_s"] <= f["base0_durable_s"]
    log = str(tmp_path / "log")
    with DiffCheckpointer(log, model, opt):
        opt.step()
    g = restore_vs_cold_read(log, build, rounds=1)
    assert g["step"] == 1
    assert g["restore_ratio"] > 0
