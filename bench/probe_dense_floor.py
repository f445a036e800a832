#!/usr/bin/env python3
"""Where dense default / none goes above its floor (issue 49; bench/RESULTS.md, "eighth
session"): one process runs bench_torch's ``dense`` (no checkpointing), ``dense+ld`` (the
checkpointer, dense gradients every step) and ``dense+raw`` (the floor: the same bytes
written and fdatasynced by a plain thread), interleaved round by round, with one part of
the engine switched off in ``dense+ld`` by VARIANT:

  base     the engine as built
  post     a lent record handed to the writer after the optimizer step, not at the
           pre-step hook (as before fb1ecd2)
  nohint   no sync_file_range writeback hints while a record is written
  nocrc    no CRC computed (the records' CRC fields stay zero: the log is not for reading)
  switch   the engine as built, under ``sys.setswitchinterval(5e-4)`` (the GIL handed back
           to a waiting thread after 0.5 ms instead of 5 ms): whether the training thread
           waits for the GIL behind the writer's threads

Prints one JSON line: dense+ld / dense, dense+raw / dense and dense+ld / dense+raw, each
the median over ``--rounds`` rounds of ``--steps`` steps' median, and the load average.

Run:  PYTHONPATH=$PWD python bench/probe_dense_floor.py VARIANT [--rounds 9] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from bench_torch import Run

VARIANTS = ("base", "post", "nohint", "nocrc", "switch")


def switch_off(variant: str) -> None:
    """Patch the part of the engine ``variant`` names (module docstring)."""
    if variant == "switch":
        sys.setswitchinterval(5e-4)
    elif variant == "post":
        from lowdiff_store.torch.capture.grad_capture import GradCapture

        GradCapture.hand_over_now = lambda self: self.gate_full()  # type: ignore[method-assign]
    elif variant == "nohint":
        from lowdiff_store.storage.local import AppendFile

        AppendFile.start_writeback = lambda self, offset, n: False  # type: ignore[method-assign]
    elif variant == "nocrc":
        import lowdiff_store.log.writer as lw

        lw.crc32c_chunks = lambda chunks, value=0: 0  # type: ignore[assignment]
        lw.crc32c = lambda data, value=0: 0  # type: ignore[assignment]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant", choices=VARIANTS)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    switch_off(args.variant)
    torch.set_num_threads(1)
    d = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    try:
        names = ["dense", "dense+ld", "dense+raw"]
        runs = {c: Run(c, "20m", d) for c in names}
        for r in runs.values():
            for _ in range(3):
                r.step()
        per: dict[str, list[float]] = {c: [] for c in names}
        for _ in range(args.rounds):
            for c in names:
                per[c].append(statistics.median(runs[c].step() for _ in range(args.steps)))
        for r in runs.values():
            r.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(x / y for x, y in zip(per[a], per[b], strict=True)), 4)

    out: dict[str, Any] = {"variant": args.variant, "ld/dense": ratio("dense+ld", "dense"),
                           "raw/dense": ratio("dense+raw", "dense"),
                           "ld/raw": ratio("dense+ld", "dense+raw")}
    with open("/proc/loadavg") as fh:
        out["load"] = fh.read().split()[:3]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
