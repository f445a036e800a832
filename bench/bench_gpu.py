#!/usr/bin/env python3
"""The per-step path on a GPU: training step times with and without the log, against the
peers, and the state-sized figures (bases, base 0, restore), in one prepared run.

Every configuration trains its own copy of the benchmark LM (``bench/_lm.py``; bf16 autocast
and AdamW on CUDA), interleaved round by round so that the machine's noise hits all alike;
each step time is CUDA-synchronized (``torch.cuda.synchronize()`` before and after), each
figure is the median over rounds of the mean step of a round (amortized: a save every 10
steps counts; use ``--steps 10`` or more for those), and every ratio is taken per round
against a baseline of the same round:

  bare            AdamW, no checkpointing                      (baseline)
  dense+log       DiffCheckpointer, dense gradient every step
  topk            top-1% compressed training (TopKCompressor), no log
  topk+log        the same with DiffCheckpointer logging the top-k diff every step (on
                  CUDA through a writer process, the default there: issue 49)
  topk+log-thread topk+log with the in-thread writer (writer_process=False): the path
                  the H100 figures of 2026-11-27 measured, beside the process in one run
  dcp.async/1     torch.distributed.checkpoint.async_save every step (waits for the last)
  dcp.async/10    the same every 10 steps
  torch.save/10   torch.save(model + optimizer) every 10 steps

Then, on a fresh top-1% + log run with a base every ``--every`` steps (issue 34):
  - the step that first meets the base staging memory, in warm device-to-host copies of
    the state (a copy of every parameter and moment into pinned memory, timed warm);
  - the slowest step after a base / the median step;
  - ``DiffCheckpointer(...)`` (base 0) / a raw write + fsync of as many bytes;
  - ``restore()`` / (a cold read of the log's files + the replayed optimizer steps);
  - with ``--slices K`` (issue 50: ``base_slices=K``, streamed bases; the checkpointer's
    default otherwise): the staging memory held (pinned on CUDA) / the state, the slowest
    step / the median, and with ``--configs topk`` its median step / top-1% alone.

Run (H100):  python bench/bench_gpu.py --size 370m --rounds 5 --steps 8 --json out.json
Smoke (CPU): python bench/bench_gpu.py --smoke   (seconds; also a pytest smoke test)
Prints a markdown table for bench/RESULTS.md ("GPU" section).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _lm import LM, batch_for

from lowdiff_store.torch import DiffCheckpointer, TopKCompressor, restore

#: name -> (vocab, ctx, dim, layers, heads, batch)
SIZES = {
    "tiny": (128, 8, 32, 1, 2, 2),
    "370m": (32768, 1024, 1024, 24, 16, 8),
    "940m": (32768, 1024, 1536, 30, 16, 4),
}
CONFIGS = ["bare", "dense+log", "topk", "topk+log", "topk+log-thread", "dcp.async/1",
           "dcp.async/10", "torch.save/10"]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Run:
    """One configuration: its own model, optimizer and checkpointing, stepped on demand."""

    def __init__(self, name: str, size: str, dev: torch.device, workdir: str,
                 every: int = 10**9, pre_steps: int = 0, slices: int | None = None) -> None:
        self.name, self.dev = name, dev
        vocab, ctx, dim, layers, heads, batch = SIZES[size]
        torch.manual_seed(0)
        self.model = LM(vocab, ctx, dim, layers, heads).to(dev)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.batch, self.ctx, self.vocab = batch, ctx, vocab
        self.dir = os.path.join(workdir, name.replace("+", "_").replace("/", "_")
                                .replace(".", "_"))
        os.makedirs(self.dir, exist_ok=True)
        self.step_no = 0
        self.pending: Any = None
        self.after: Callable[[], None] = lambda: None
        self.ckpt: DiffCheckpointer | None = None
        self.stream_s: list[float] = []
        #: per step, the seconds until ``optimizer.step()`` returned (the host's part)
        self.host_s: list[float] = []
        for _ in range(pre_steps):  # warm (kernels, optimizer state) before the log opens
            self.step()
        comp = TopKCompressor(ratio=0.01) if name.startswith("topk") else None
        t0 = time.perf_counter()
        if name.endswith(("+log", "+log-thread")):
            opts: dict[str, Any] = {} if slices is None else {"base_slices": slices}
            if name.endswith("-thread"):
                opts["writer_process"] = False
            self.ckpt = DiffCheckpointer(self.dir, self.model, self.opt, compressor=comp,
                                         snapshot_every=every, **opts)
        elif comp is not None:
            comp.attach(self.opt)
        #: seconds DiffCheckpointer(...) took (base 0)
        self.open_s = time.perf_counter() - t0
        if name.startswith("dcp.async"):
            import torch.distributed.checkpoint as dcp

            self._dcp, self._every = dcp, int(name.split("/")[1])
            self.after = self._dcp_async
        if name.startswith("torch.save"):
            self._every = int(name.split("/")[1])
            self.after = self._torch_save

    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def _torch_save(self) -> None:
        if self.step_no % self._every == 0:
            torch.save(self._state(), os.path.join(self.dir, "ckpt.pt"))

    def _dcp_async(self) -> None:
        if self.step_no % self._every:
            return
        if self.pending is not None:
            self.pending.result()  # one save in flight at a time, as DCP's docs advise
        self.pending = self._dcp.async_save(
            self._state(), checkpoint_id=os.path.join(self.dir, f"step-{self.step_no % 2}"))

    def step(self) -> float:
        """One CUDA-synchronized training step; its seconds."""
        self.step_no += 1
        x = batch_for(self.step_no, self.vocab, self.batch, self.ctx).to(self.dev)
        _sync(self.dev)
        t0 = time.perf_counter()
        with torch.autocast(self.dev.type, dtype=torch.bfloat16,
                            enabled=self.dev.type == "cuda"):
            out = self.model(x[:, :-1])
            loss = nn.functional.cross_entropy(out.reshape(-1, self.vocab).float(),
                                               x[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.host_s.append(time.perf_counter() - t0)  # (nothing synchronized yet)
        self.after()
        if self.dev.type == "cuda":  # what the training stream waits for, without the
            torch.cuda.current_stream(self.dev).synchronize()  # checkpointer's side streams
        self.stream_s.append(time.perf_counter() - t0)
        _sync(self.dev)
        return time.perf_counter() - t0

    def state_bytes(self) -> int:
        """Bytes of the parameters and optimizer moments."""
        n = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for st in self.opt.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
        return n

    def close(self, remove: bool = False) -> None:
        """Close the checkpointer (flushing it) and wait for a DCP save in flight; with
        ``remove``, delete this configuration's files (the disk of a GPU host is finite)."""
        if self.ckpt is not None:
            self.ckpt.close()
        if self.pending is not None:
            self.pending.result()
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)


RATIOS = [("dense+log", "bare"), ("topk", "bare"), ("topk+log", "topk"),
          ("topk+log-thread", "topk"),
          ("dcp.async/1", "bare"), ("dcp.async/10", "bare"), ("torch.save/10", "bare")]


def interleaved(size: str, dev: torch.device, rounds: int, steps: int, warmup: int,
                workdir: str, configs: list[str] | None = None) -> dict[str, Any]:
    """The step-time figures of ``configs`` (default :data:`CONFIGS`; module docstring)."""
    configs = configs or CONFIGS
    runs: dict[str, Run] = {}
    try:
        for c in configs:
            runs[c] = Run(c, size, dev, workdir)
        for r in runs.values():
            for _ in range(warmup):
                r.step()
        per_round: dict[str, list[float]] = {c: [] for c in configs}
        medians: dict[str, list[float]] = {c: [] for c in configs}
        for _ in range(rounds):
            for c in configs:
                ts = [runs[c].step() for _ in range(steps)]
                per_round[c].append(statistics.fmean(ts))
                medians[c].append(statistics.median(ts))
    finally:
        for r in runs.values():
            r.close(remove=True)
        _free(dev)

    def ratio(a: str, b: str) -> list[float]:
        rs = [x / y for x, y in zip(per_round[a], per_round[b], strict=True)]
        return [statistics.median(rs), min(rs), max(rs)]

    open_s = {c: r.open_s for c, r in runs.items() if r.ckpt is not None}
    return {"median_step_s": {c: statistics.median(v) for c, v in per_round.items()},
            "step_s_per_round": per_round, "checkpointer_open_s": open_s,
            "median_of_round_medians_s": {c: statistics.median(v) for c, v in medians.items()},
            "ratio": {f"{a} / {b}": ratio(a, b) for a, b in RATIOS
                      if a in per_round and b in per_round}}


def _free(dev: torch.device) -> None:
    """Give the device memory of finished configurations back before the next part."""
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def warm_copy_s(run: Run) -> float:
    """Seconds of a warm copy of the state (parameters and moments) to pinned host memory
    (CPU: to a second host buffer), the unit of the base figures."""
    src = [p.detach() for p in run.model.parameters()]
    for st in run.opt.state.values():
        src += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    pin = run.dev.type == "cuda"
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in src]
    best = float("inf")
    for _ in range(3):
        _sync(run.dev)
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, src, non_blocking=pin)
        _sync(run.dev)
        best = min(best, time.perf_counter() - t0)
    return best


def raw_write_s(path: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file and fsync it (the disk's bound)."""
    chunk = bytes(16 << 20)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[:min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
    t = time.perf_counter() - t0
    os.unlink(path)
    return t


def cold_read_s(root: str) -> float:
    """Seconds to read every file under ``root`` after dropping it from the page cache."""
    files = [os.path.join(d, f) for d, _s, fs in os.walk(root) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass
    return time.perf_counter() - t0


def _profiler(dev: torch.device) -> Any:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    return profile(activities=acts)


def _write_profile(prof: Any, dev: torch.device, path: str | None, what: str) -> None:
    """The ``torch.profiler`` tables of ``prof`` (CPU ops by self time; device ops by
    device time) to ``path`` (default: stdout)."""
    ka = prof.key_averages()
    text = [f"--- {what}: CPU ops by self CPU time",
            ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)]
    if dev.type == "cuda":
        text += [f"--- {what}: by device time",
                 ka.table(sort_by="self_device_time_total", row_limit=30,
                          max_name_column_width=60)]
    if path:
        with open(path, "w") as fh:
            fh.write("\n".join(text))
    else:
        print("\n".join(text))


def state_sized(size: str, dev: torch.device, every: int, steps: int, workdir: str,
                pre_steps: int = 0, prof: tuple[int, int] | None = None,
                prof_out: str | None = None, slices: int | None = None) -> dict[str, Any]:
    """The issue-34 figures on a top-1% + log run with a base every ``every`` steps
    (``slices``: ``base_slices``, streamed bases; None: the checkpointer's default);
    ``pre_steps`` plain steps first (a warm model: kernels loaded, optimizer state made,
    as when a log is opened on a resumed run), so the figures are the log's alone.
    ``prof`` (first, end): ``torch.profiler`` over those steps of the base run, its tables
    to ``prof_out``."""
    run = Run("topk+log", size, dev, os.path.join(workdir, "bases"), every=every,
              pre_steps=pre_steps, slices=slices)
    times: list[float] = []
    per_step: list[dict[str, float]] = []  # what each step moved in the checkpointer's stats
    prev = _num_stats(run)
    prof_ctx: Any = None
    for i in range(steps):
        if prof is not None and i == prof[0]:
            prof_ctx = _profiler(dev)
            prof_ctx.__enter__()
        times.append(run.step())
        if prof_ctx is not None and (i + 1 == prof[1] or i + 1 == steps):
            prof_ctx.__exit__(None, None, None)
            _write_profile(prof_ctx, dev, prof_out, f"base-run steps {prof[0]}..{i}")
            prof_ctx = None
        now = _num_stats(run)
        per_step.append({k: round(v - prev.get(k, 0.0), 4) for k, v in now.items()
                         if v != prev.get(k)})
        prev = now
    stream_times = run.stream_s[pre_steps:]
    run.close()
    copy_s = warm_copy_s(run)
    nbytes = run.state_bytes()
    write_s = raw_write_s(os.path.join(workdir, "raw.bin"), nbytes)
    med = statistics.median(times)
    after = [times[i] for i in range(len(times)) if i > 0 and (i % every) in (0, 1)]
    # restore into fresh objects, against a cold read of the log and the optimizer steps
    fresh = Run("bare", size, dev, os.path.join(workdir, "fresh"))
    read_s = cold_read_s(run.dir)
    _sync(dev)
    t0 = time.perf_counter()
    res = restore(run.dir, fresh.model, fresh.opt)
    _sync(dev)
    restore_s = time.perf_counter() - t0
    replayed = res.replayed  # (a streamed base: from its first slice's step)
    for p in fresh.model.parameters():
        p.grad = torch.zeros_like(p)
    opt_s = []
    for _ in range(3):
        _sync(dev)
        t1 = time.perf_counter()
        fresh.opt.step()
        _sync(dev)
        opt_s.append(time.perf_counter() - t1)
    bound = read_s + replayed * statistics.median(opt_s)
    host_stats: dict[str, Any] = {}
    if dev.type == "cuda" and hasattr(torch.cuda, "host_memory_stats"):
        hs = torch.cuda.host_memory_stats()
        host_stats = {k: v for k, v in hs.items() if ("bytes" in k and "current" in k)
                      or k.endswith("peak")}
    open_s = run.open_s
    ck_stats = _num_stats(run)
    shutil.rmtree(run.dir, ignore_errors=True)
    del fresh, run
    _free(dev)
    return {"host_memory_stats": host_stats, "per_step_stats": per_step,
            "base_slices": slices, "base_slices_taken": ck_stats.get("base_slices", 0.0),
            "base_staging_bytes": ck_stats.get("base_staging_bytes"),
            "base_staging_pinned_bytes": ck_stats.get("base_staging_pinned_bytes"),
            "slowest_over_median": max(times) / med,
            "optimizer_step_s": statistics.median(opt_s),
            "pre_steps": pre_steps, "stream_steps": stream_times,
            "stream_first_base_step_in_copies": stream_times[every - 1] / copy_s
            if len(stream_times) >= every else None,
            "stream_max_after_base_over_median": max(
                stream_times[i] for i in range(len(stream_times))
                if i > 0 and (i % every) in (0, 1)) / statistics.median(stream_times)
            if len(stream_times) > every else None,
            "rss_peak_bytes": _rss_peak(), "max_step_in_copies": max(times) / copy_s,
            "every": every, "steps": times, "median_step_s": med,
            "state_bytes": nbytes, "warm_copy_s": copy_s,
            "first_base_step_in_copies": times[every - 1] / copy_s if len(times) >= every
            else None,
            "max_after_base_over_median": max(after) / med if after else None,
            "base0_s": open_s, "raw_write_s": write_s,
            "base0_over_raw_write": open_s / write_s,
            "restore_s": restore_s, "cold_read_s": read_s, "replayed_steps": replayed,
            "restore_over_bound": restore_s / bound}


def _num_stats(run: Run) -> dict[str, float]:
    """The checkpointer's numeric stats now (with its step as ``log_step``)."""
    if run.ckpt is None:
        return {}
    out = {k: float(v) for k, v in run.ckpt.stats().items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out["log_step"] = float(run.ckpt.step)
    return out


def _rss_peak() -> int | None:
    """The process's peak resident memory in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def table(out: dict[str, Any]) -> str:
    """The markdown table of a run."""
    rows = ["| figure | median | min | max |", "|---|---:|---:|---:|"]
    for c, v in out.get("median_step_s", {}).items():
        rows.append(f"| step s: {c} | {v:.4f} | | |")
    for k, (m, lo, hi) in out["ratio"].items():
        rows.append(f"| {k} | {m:.3f} | {lo:.3f} | {hi:.3f} |")
    s = out.get("state_sized")
    if s:
        for k in ("first_base_step_in_copies", "max_step_in_copies", "max_after_base_over_median",
                  "stream_first_base_step_in_copies", "stream_max_after_base_over_median",
                  "base0_over_raw_write", "restore_over_bound", "slowest_over_median",
                  "median_over_topk"):
            v = s.get(k)
            rows.append(f"| {k} | {'n/a' if v is None else f'{v:.3f}'} | | |")
        rows.append(f"| base run median step s | {s['median_step_s']:.4f} | "
                    f"{min(s['steps']):.4f} | {max(s['steps']):.4f} |")
        rows.append(f"| warm copy of the state s | {s['warm_copy_s']:.4f} | | |")
        for k in ("base_staging_bytes", "base_staging_pinned_bytes"):
            if s.get(k) is not None:
                rows.append(f"| {k} / state | {s[k] / s['state_bytes']:.3f} | | |")
        rows.append(f"| base_slices asked / slices taken | {s.get('base_slices')} / "
                    f"{s.get('base_slices_taken', 0):g} | | |")
        slow = max(range(len(s["steps"])), key=s["steps"].__getitem__)
        moved = ", ".join(f"{k} {v:g}" for k, v in s["per_step_stats"][slow].items()
                          if k.endswith("_s") or k in ("log_step", "bases",
                                                       "base_deferred"))
        rows.append(f"| slowest base-run step ({slow}): {moved} | {s['steps'][slow]:.3f} | | |")
    return "\n".join(rows)


def device_info(dev: torch.device) -> dict[str, Any]:
    """The machine the figures come from."""
    info: dict[str, Any] = {"device": str(dev), "torch": torch.__version__,
                            "cuda": torch.version.cuda}
    if dev.type == "cuda":
        info["name"] = torch.cuda.get_device_name(dev)
        info["driver"] = torch.cuda.driver_version() if hasattr(
            torch.cuda, "driver_version") else None
    return info


def run_all(size: str, dev: torch.device, rounds: int, steps: int, warmup: int, every: int,
            base_steps: int, workdir: str, configs: list[str] | None = None,
            json_path: str | None = None, pre_steps: int = 0,
            prof: tuple[int, int] | None = None, prof_out: str | None = None,
            slices: int | None = None) -> dict[str, Any]:
    """Both parts of the benchmark (module docstring); with ``json_path`` the results so
    far are written after each part (a part that fails leaves the others)."""
    out: dict[str, Any] = {"size": size, "rounds": rounds, "steps_per_round": steps,
                           **device_info(dev)}

    def save() -> None:
        if json_path:
            with open(json_path, "w") as fh:
                json.dump(out, fh, indent=1)

    out.update(interleaved(size, dev, rounds, steps, warmup, workdir, configs))
    save()
    if base_steps > 0:  # (the interleaved part may be one config for a state-only run)
        out["state_sized"] = s = state_sized(size, dev, every, base_steps, workdir,
                                             pre_steps, prof, prof_out, slices)
        if "topk" in out.get("median_step_s", {}):  # (with bases / top-1% alone)
            s["median_over_topk"] = s["median_step_s"] / out["median_step_s"]["topk"]
        save()
    return out


@pytest.mark.bench
def test_bench_gpu_smoke(tmp_path: Any) -> None:
    """CI smoke (CPU, seconds): every configuration runs and every figure is a number."""
    torch.set_num_threads(1)
    out = run_all("tiny", torch.device("cpu"), rounds=1, steps=2, warmup=1, every=3,
                  base_steps=7, workdir=str(tmp_path))
    assert set(out["median_step_s"]) == set(CONFIGS)
    assert all(v > 0 for v in out["median_step_s"].values())
    assert all(m > 0 for m, _lo, _hi in out["ratio"].values())
    s = out["state_sized"]
    assert s["replayed_steps"] >= 7 - 6  # (a streamed base replays from its first slice)
    assert s["base0_over_raw_write"] > 0
    assert s["restore_over_bound"] > 0
    assert s["first_base_step_in_copies"] > 0
    assert "| topk+log / topk |" in table(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="370m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--every", type=int, default=6, help="base interval of the base run")
    ap.add_argument("--base-steps", type=int, default=20,
                    help="steps of the base run (0: skip the state-sized part)")
    ap.add_argument("--pre-steps", type=int, default=0,
                    help="plain steps of the base run before its log opens (warm model)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated subset of the configurations")
    ap.add_argument("--profile-steps", default=None, metavar="FIRST:END",
                    help="torch.profiler over these steps of the base run (e.g. 9:12)")
    ap.add_argument("--profile-out", default=None, help="the profile's tables (a file)")
    ap.add_argument("--slices", type=int, default=None, metavar="K",
                    help="base run: base_slices=K (streamed bases; 1: consistent; "
                         "default: the checkpointer's default)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, seconds")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.smoke:
        args.size, args.rounds, args.steps, args.warmup, args.base_steps = "tiny", 1, 2, 1, 8
        args.every = 3
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        configs = [c for c in args.configs.split(",") if c]
        unknown = sorted(set(configs) - set(CONFIGS))
        if unknown:
            ap.error(f"unknown configurations {unknown}; choose from {CONFIGS}")
        prof = None
        if args.profile_steps:
            a, b = args.profile_steps.split(":")
            prof = (int(a), int(b))
        out = run_all(args.size, dev, args.rounds, args.steps, args.warmup, args.every,
                      args.base_steps, d, configs, args.json, args.pre_steps, prof,
                      args.profile_out, args.slices)
    print(f"{out['device']} {out.get('name', '')} torch {out['torch']} cuda {out['cuda']}, "
          f"model {args.size}, {args.rounds} rounds x {args.steps} steps")
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
