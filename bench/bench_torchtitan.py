#!/usr/bin/env python3
"""torchtitan (0.3.0) with ``LowDiffCheckpointManager`` against torchtitan's own
checkpointing: step time, bytes written per step, and recovery after a kill in the middle
of a checkpoint interval.

The debug model (6.2M parameters, ``ScaledDotProductAttention``, AdamW fused, seq_len 64,
batch 2) trained by torchtitan's own ``Trainer`` on one CPU rank (the CPU adjustments of
``tests/integrations/titan_cpu.py``), one subprocess per run, in these configurations:

- ``none``: checkpointing off (the bare step);
- ``dcp``: torchtitan's ``CheckpointManager``, a synchronous DCP save every ``--interval``
  steps;
- ``log``: ``LowDiffCheckpointManager`` (a record every step, its bases torchtitan's DCP
  saves every ``--interval`` steps, by reference);
- ``async-interval``: torchtitan's ``async_mode="async"`` every ``--interval`` steps;
- ``async-every``: ``async_mode="async"`` every step (torchtitan's own per-step
  checkpoint);
- ``dcp-every``: a synchronous DCP save every step.

A step is the wall time between two returns of ``checkpointer.save`` (data, forward,
backward, clipping, optimizer, the save), the first ``--warmup`` dropped. Each round runs
every configuration once, in rotated order; a round gives each configuration's mean step
(amortized: the interval saves included) and median step over ``none``'s of the same
round, and its mean CPU time a step over ``none``'s, of the training thread
(``time.thread_time()``: the foreground cost, the step time when background work has a
core of its own) and of the process (user + system seconds, every thread: all the work
checkpointing adds); CPU times are less sensitive than wall time to what else runs on a
shared machine. The figures are the medians over rounds. For ``log``, also the
time of ``refer_base`` (torchtitan's checkpoint read back for its CRCs), median over the
run's saves. Bytes written: the process's ``wchar`` (``/proc/self/io``) over the steps
run, minus that of ``none``.

Recovery: ``dcp`` and ``log`` are SIGKILLed inside step ``--kill-at + 1`` (after its
backward, before its optimizer step; ``--kill-at`` in the middle of an interval) and run
again: the steps lost (the killed step's predecessor minus the step resumed at), the
time of ``load()`` (torchtitan's DCP load, or the log's restore: its base, a DCP
checkpoint, read and the records after it replayed), and the time to be back at the
killed step (``load()`` plus the lost steps at the median step time).

Run (torchtitan installed):  python bench/bench_torchtitan.py [--rounds 3] [--steps 30]
    [--interval 10] [--kill-at 15] [--json]
Smoke: python -m pytest bench/bench_torchtitan.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("none", "dcp", "log", "async-interval", "async-every", "dcp-every")


def _checkpoint(config: str, interval: int) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager

    from lowdiff_store.integrations.torchtitan import LowDiffCheckpointManager

    common = {"enable": config != "none", "last_save_model_only": False, "keep_latest_k": 2,
              "interval": 1 if config.endswith("every") else interval}
    if config == "log":
        return LowDiffCheckpointManager.Config(**common)
    if config.startswith("async"):
        return CheckpointManager.Config(**common, async_mode="async")
    return CheckpointManager.Config(**common)


def worker(args: argparse.Namespace) -> None:
    """One run (in its own process): times per step, ``load()`` time, bytes written."""
    import torch

    from tests.integrations import titan_cpu

    torch.set_num_threads(1)
    assets = Path(args.assets)
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "HF_DATASETS_CACHE": str(assets / "hf-cache")})
    titan_cpu.adjust(1)
    titan_cpu.rank_env(args.port)
    cfg = titan_cpu.debug_config(assets=assets, dump=Path(args.dump), steps=args.steps,
                                 checkpoint=_checkpoint(args.config, args.interval))
    cfg.metrics.log_freq = 1000
    trainer = cfg.build()
    stamps: list[float] = []
    cpu: list[float] = []  # the process's CPU seconds (every thread), at the same points
    fg: list[float] = []  # the training thread's CPU seconds
    out: dict[str, Any] = {"config": args.config}
    ck = trainer.checkpointer
    save, load = ck.save, ck.load

    def timed_load(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return load(*a, **k)
        finally:
            out["load_s"] = time.perf_counter() - t0
            out["start_step"] = trainer.step
            inner = getattr(ck, "checkpointer", None)
            if inner is not None:  # the log's DiffCheckpointer: time each refer_base
                refer, out["refer_s"] = inner.refer_base, []

                def timed_refer(path: Any) -> bool:
                    t1 = time.perf_counter()
                    try:
                        return bool(refer(path))
                    finally:
                        out["refer_s"].append(time.perf_counter() - t1)

                inner.refer_base = timed_refer
            stamps.append(time.perf_counter())
            cpu.append(sum(os.times()[:2]))
            fg.append(time.thread_time())

    def timed_save(*a: Any, **k: Any) -> Any:
        r = save(*a, **k)
        stamps.append(time.perf_counter())
        cpu.append(sum(os.times()[:2]))
        fg.append(time.thread_time())
        return r

    ck.load, ck.save = timed_load, timed_save
    if args.kill_at >= 0:
        wait = trainer.checkpointer.maybe_wait_for_staging

        def dying() -> None:  # inside step kill_at + 1, after its backward
            if trainer.step == args.kill_at + 1:
                os.kill(os.getpid(), signal.SIGKILL)
            wait()

        trainer.checkpointer.maybe_wait_for_staging = dying
    try:
        trainer.train()
        trainer.checkpointer.maybe_wait_for_saving()
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()
    with open("/proc/self/io") as fh:
        io = dict(line.split(": ") for line in fh.read().splitlines())
    out.update(steps=[b - a for a, b in itertools.pairwise(stamps)],
               cpu=[b - a for a, b in itertools.pairwise(cpu)],
               fg=[b - a for a, b in itertools.pairwise(fg)],
               wchar=int(io["wchar"]), resumed=getattr(ck, "resumed_step", None))
    Path(args.out).write_text(json.dumps(out))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(config: str, *, assets: Path, dump: Path, steps: int, interval: int,
        kill_at: int = -1) -> dict[str, Any] | None:
    """One run in a subprocess; None when it was killed (``kill_at``)."""
    out = dump.with_suffix(".json")
    argv = [sys.executable, __file__, "--worker", "--config", config, "--assets",
            str(assets), "--dump", str(dump), "--out", str(out), "--steps", str(steps),
            "--interval", str(interval), "--kill-at", str(kill_at),
            "--port", str(_free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    if kill_at >= 0 and proc.returncode == -signal.SIGKILL:
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"{config}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def step_rounds(configs: list[str], rounds: int, steps: int, interval: int, warmup: int,
                work: Path, assets: Path) -> dict[str, Any]:
    """Per configuration: the medians over rounds of (mean step / none's mean step,
    median step / none's median step), mean and median step times, bytes per step."""
    per: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        got = {}
        for c in order:
            res = run(c, assets=assets, dump=work / f"r{r}-{c}", steps=steps,
                      interval=interval)
            assert res is not None
            t = res["steps"][warmup + 1:]  # (the first: load() to the first save)
            got[c] = {"mean": statistics.fmean(t), "median": statistics.median(t),
                      "cpu": statistics.fmean(res["cpu"][warmup + 1:]),
                      "fg": statistics.fmean(res["fg"][warmup + 1:]),
                      "wchar": res["wchar"], "n": len(res["steps"]) - 1,
                      "refer_s": statistics.median(res.get("refer_s") or [0.0])}
            print(f"round {r} {c}: mean {got[c]['mean'] * 1e3:.1f} ms, median "
                  f"{got[c]['median'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
        for c in configs:
            g = got[c]
            per[c].append({**g, "mean_ratio": g["mean"] / got["none"]["mean"],
                           "median_ratio": g["median"] / got["none"]["median"],
                           "cpu_ratio": g["cpu"] / got["none"]["cpu"],
                           "fg_ratio": g["fg"] / got["none"]["fg"],
                           "bytes_per_step": (g["wchar"] - got["none"]["wchar"]) / steps})
    return {c: {k: statistics.median(x[k] for x in v) for k in v[0]} for c, v in per.items()}


def recovery(config: str, steps: int, interval: int, kill_at: int, work: Path,
             assets: Path) -> dict[str, Any]:
    """Kill inside step ``kill_at + 1``, run again: steps lost, ``load()`` time."""
    dump = work / f"kill-{config}"
    run(config, assets=assets, dump=dump, steps=steps, interval=interval, kill_at=kill_at)
    res = run(config, assets=assets, dump=dump, steps=steps, interval=interval)
    assert res is not None
    start = int(res["start_step"])
    t = res["steps"][2:]
    return {"resumed_at": start, "lost_steps": kill_at - start, "load_s": res["load_s"],
            "back_s": res["load_s"] + (kill_at - start) * statistics.median(t),
            "disk_bytes": _dir_bytes(dump / "checkpoint") + (
                _dir_bytes(dump / "lowdiff") if (dump / "lowdiff").exists() else 0)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; prints a table (or JSON) and returns the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=15)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--no-recovery", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--config", "--assets", "--dump", "--out", "--port"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    sys.path.insert(0, str(ROOT))
    from tests.integrations import titan_cpu

    configs = args.configs.split(",")
    if "none" not in configs:
        configs.insert(0, "none")
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        titan_cpu.make_assets(work / "assets")
        out: dict[str, Any] = {"steps": step_rounds(configs, args.rounds, args.steps,
                                                    args.interval, args.warmup, work,
                                                    work / "assets")}
        if not args.no_recovery:
            out["recovery"] = {c: recovery(c, args.steps, args.interval, args.kill_at, work,
                                           work / "assets") for c in ("dcp", "log")}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print(out)
    return out


def _print(out: dict[str, Any]) -> None:
    print("| configuration | mean step / none | median step / none | training thread CPU / "
          "none | process CPU / none | mean step | median step | bytes written / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for c, v in out["steps"].items():
        print(f"| {c} | {v['mean_ratio']:.3f} | {v['median_ratio']:.3f} | "
              f"{v['fg_ratio']:.3f} | {v['cpu_ratio']:.3f} | {v['mean'] * 1e3:.1f} ms | "
              f"{v['median'] * 1e3:.1f} ms | {v['bytes_per_step'] / 1e6:.1f} MB |")
    refer = out["steps"].get("log", {}).get("refer_s", 0.0)
    print(f"log: refer_base (the checkpoint read back), median {refer * 1e3:.0f} ms a save")
    for c, v in out.get("recovery", {}).items():
        print(f"recovery {c}: resumed at step {v['resumed_at']}, {v['lost_steps']} steps "
              f"lost, load() {v['load_s']:.2f} s, back at the killed step after "
              f"{v['back_s']:.2f} s; on disk at the end {v['disk_bytes'] / 1e6:.0f} MB")


@pytest.mark.slow  # (68 s of CPU; tests/integrations/test_torchtitan.py covers the manager in CI)
def test_bench_torchtitan_smoke() -> None:
    """The benchmark end to end on a few steps (skipped without torchtitan)."""
    pytest.importorskip("torchtitan")
    out = main(["--rounds", "1", "--steps", "6", "--interval", "3", "--warmup", "1",
                "--kill-at", "4", "--configs", "none,log", "--json"])
    assert set(out["steps"]) == {"none", "log"}
    assert out["steps"]["none"]["mean_ratio"] == 1.0
    assert out["steps"]["log"]["bytes_per_step"] > 6_000_000 * 4  # a dense gradient
    assert out["recovery"]["log"]["lost_steps"] <= 2
    assert out["recovery"]["dcp"]["lost_steps"] == 4 - 3


if __name__ == "__main__":
    main()
