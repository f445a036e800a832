#!/usr/bin/env python3
"""The headline figures as min / median / max over several *separate* runs.

Each benchmark below runs ``--runs`` times, each time in a fresh process, one after the
other; the load average (1 / 5 / 15 min) is recorded before and after every run, so a
reader can tell a figure from noise. Every figure inside one run is already a ratio
measured against a baseline in that same run (see each script's docstring).

  bench_torch.py    dense default / none, dense layer-wise / none, top-1% + log / top-1%,
                    torch.save / none, DCP async_save / none, and the floor of a dense
                    record per step (its gradient bytes written + fdatasync by a plain
                    thread) / none
  bench_replay.py   replay per step / optimizer.step(), quiet and beside one busy process
                    (glibc's malloc thresholds fixed for the process; and, quiet, with
                    glibc's dynamic defaults, with the minor faults per step of both sides)
  bench_log.py      append of 1-64 MiB records + fdatasync / raw os.write + os.fsync

Run:  python bench/headline.py [--runs 3] [--only torch,replay,log] [--json FILE]
Prints a markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

#: name -> (command line after the script, figures: label -> (getter, goal))
Getter = Callable[[dict[str, Any]], float]


def _append_figures(out: dict[str, Any]) -> dict[str, float]:
    figs: dict[str, float] = {}
    for a in out["append"]:
        figs[f"append {a['record_mib']} MiB + fdatasync / raw write + fsync, per record"] = \
            a["record_ratio"]
        figs[f"append {a['record_mib']} MiB + fdatasync / raw write + fsync, per run"] = \
            a["ratio"]
    return figs


BENCHES: dict[str, tuple[list[str], Callable[[dict[str, Any]], dict[str, float]],
                         dict[str, str]]] = {
    "torch": (["bench_torch.py", "--rounds", "5", "--steps", "8", "--warmup", "3", "--json"],
              lambda o: {"dense default / none": o["ratio"]["dense+ld / dense"],
                         "dense layer-wise / none": o["ratio"]["dense+ld-lw / dense"],
                         "top-1% + log / top-1%": o["ratio"]["topk+ld / topk"],
                         "dense, writer process / none": o["ratio"]["dense+ldp / dense"],
                         "dense floor (raw write + fdatasync) / none":
                             o["ratio"]["dense+raw / dense"],
                         "top-1% + log, writer process / top-1%":
                             o["ratio"]["topk+ldp / topk"],
                         "torch.save / none": o["ratio"]["torch.save / dense"],
                         "DCP async_save / none": o["ratio"]["dcp.async / dense"],
                         "top-1% bytes per step / fp32 params":
                             o["topk_bytes_fraction_of_fp32_params"]},
              {"dense default / none": "<= 1.05", "top-1% + log / top-1%": "<= 1.03"}),
    "replay": (["bench_replay.py", "--rounds", "6", "--steps", "16", "--from-zero",
                "--malloc", "fixed", "--json"],
               lambda o: {"replay per step / optimizer.step() (quiet)": o["ratio"]["median"],
                          "replay per step in-loop / optimizer.step() mean (quiet)":
                              o["in_loop_ratio"]["median"],
                          "replay from the step-0 base, per step / optimizer.step()":
                              o["zero_ratio"]["median"]},
               {"replay per step / optimizer.step() (quiet)": "<= 1.1",
                "replay per step in-loop / optimizer.step() mean (quiet)": "<= 1.1"}),
    "replay-glibc": (["bench_replay.py", "--rounds", "6", "--steps", "16", "--malloc",
                      "default", "--json"],
                     lambda o: {"replay per step / optimizer.step(), quiet, glibc's dynamic "
                                "malloc thresholds": o["ratio"]["median"],
                                "replay in-loop / optimizer.step() mean, same":
                                    o["in_loop_ratio"]["median"],
                                "minor faults per replayed step (main thread), same":
                                    o["faults_in_loop"]["median"],
                                "minor faults per optimizer.step() alone, same":
                                    o["faults_opt"]["median"]},
                     {}),
    "replay-busy": (["bench_replay.py", "--rounds", "6", "--steps", "16", "--busy",
                     "--malloc", "fixed", "--json"],
                    lambda o: {"replay per step / optimizer.step(), one busy process beside":
                               o["ratio"]["median"],
                               "replay per step in-loop / optimizer.step() mean, one busy "
                               "process beside": o["in_loop_ratio"]["median"]},
                    {"replay per step / optimizer.step(), one busy process beside": "<= 1.5",
                     "replay per step in-loop / optimizer.step() mean, one busy "
                     "process beside": "<= 1.5"}),
    "log": (["bench_log.py", "--append-only", "--json"], _append_figures,
            {f"append {m} MiB + fdatasync / raw write + fsync, per record": ">= 0.95"
             for m in (1, 4, 8, 16, 32, 64)}),
}


def run_once(name: str) -> tuple[dict[str, float], dict[str, Any]]:
    args, figures, _goals = BENCHES[name]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    before = os.getloadavg()
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(HERE, args[0]), *args[1:]],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    return figures(out), {"bench": name, "seconds": round(time.time() - t0, 1),
                          "loadavg_before": before, "loadavg_after": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default=",".join(BENCHES))
    ap.add_argument("--json", default=None, help="also write every value to this file")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    for n in names:
        if n not in BENCHES:
            raise SystemExit(f"unknown benchmark {n!r} (one of {', '.join(BENCHES)})")
    values: dict[str, list[float]] = {}
    goals: dict[str, str] = {}
    runs: list[dict[str, Any]] = []
    for n in names:
        goals.update(BENCHES[n][2])
        for i in range(args.runs):
            figs, info = run_once(n)
            runs.append(info)
            for k, v in figs.items():
                values.setdefault(k, []).append(v)
            print(f"# {n} run {i + 1}/{args.runs}: {info['seconds']} s, load "
                  f"{'/'.join(f'{x:.2f}' for x in info['loadavg_before'])} -> "
                  f"{'/'.join(f'{x:.2f}' for x in info['loadavg_after'])}",
                  file=sys.stderr, flush=True)
    print(f"| figure | {' | '.join(f'run {i + 1}' for i in range(args.runs))} "
          f"| min | median | max | goal |")
    print("|---|" + "---:|" * (args.runs + 3) + "---|")
    for k, vals in values.items():
        cells = " | ".join(f"{x:.3f}" for x in vals)
        print(f"| {k} | {cells} | {min(vals):.3f} | {statistics.median(vals):.3f} "
              f"| {max(vals):.3f} | {goals.get(k, '')} |")
    print()
    print("| run | seconds | load average before (1/5/15 min) | after |")
    print("|---|---:|---|---|")
    for r in runs:
        print(f"| {r['bench']} | {r['seconds']} | "
              f"{' / '.join(f'{x:.2f}' for x in r['loadavg_before'])} | "
              f"{' / '.join(f'{x:.2f}' for x in r['loadavg_after'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"values": values, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
