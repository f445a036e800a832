#!/usr/bin/env python3
"""What letting go of a staging buffer costs the other threads (issue 34, item 1: the
15-20 s step of the H100 runs, where a 12 GB pinned staging buffer was let go and a 16 GB
one made beside training; bench/RESULTS.md, "GPU, second session").

A buffer of ``--gib`` GiB (``torch.empty`` as the staging area makes it, every page
touched) is let go on a helper thread while the main thread runs a Python loop, as a
launch-bound training thread does, and records the longest gap between two of its turns
(the longest it waited for the GIL). Two ways, alternating, ``--rounds`` rounds each:

  drop        the last reference dropped: the free unmaps every page inside one call that
              holds the GIL (what the staging area did)
  give_back   ``lowdiff_store.torch.capture.bases.copy.give_back``: its pages given back to
              the kernel in 64 MiB ``madvise(MADV_DONTNEED)`` calls (ctypes lets go of the
              GIL), then the last reference dropped

and, for comparison, ``make``: the buffer made as the staging area makes it (allocated,
faulted in with ``madvise(MADV_POPULATE_WRITE)`` and, with CUDA, registered with the driver,
both in paced 64 MiB pieces).

With CUDA (``--cuda``), the buffer is also registered with the driver in 64 MiB pieces
first (as the staging area does for a model on a GPU) and the main thread launches a small
kernel per turn instead of a Python loop: ``drop`` then unregisters every piece back to
back (the finalizer), ``give_back`` unregisters them paced; every 16th turn also queues a
2048^2 matmul, so the device has work queued as in training (a driver call that waits for
the device shows as a long gap).

Reported (one JSON object): per way, the median over rounds of the time to let go and of
the main thread's longest gap, and the ratio of the gaps.

Run: ``python bench/probe_free.py --gib 2 --rounds 3`` (CPU), ``--cuda`` on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowdiff_store.torch.capture.bases import copy as base_copy


def _make(nbytes: int, cuda: bool) -> base_copy.Slot:
    slot = base_copy.new_slot(nbytes, pinned=cuda)
    base_copy.StagingArea.touch(slot)
    if cuda:
        base_copy.pin(slot)
    return slot


def _turns(stop: threading.Event, gaps: list[float], cuda: bool) -> None:
    x = torch.zeros(16, device="cuda" if cuda else "cpu")
    m = torch.ones(2048, 2048, device="cuda") if cuda else None
    last = time.perf_counter()
    n = 0
    while not stop.is_set():
        if cuda:
            x.add_(1.0)  # a launch: the driver's lock and the GIL
            n += 1
            if m is not None and n % 16 == 0:  # work queued on the device, as in training
                m = m @ m * (1.0 / 2048)
        else:
            sum(range(50))
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def one(way: str, nbytes: int, cuda: bool) -> tuple[float, float]:
    """(seconds to make or let go of the buffer, the main thread's longest gap
    meanwhile)."""
    holder = [] if way == "make" else [_make(nbytes, cuda)]
    stop = threading.Event()
    gaps: list[float] = []
    took: list[float] = []

    def let_go() -> None:
        time.sleep(0.1)  # the main thread is turning
        t0 = time.perf_counter()
        if way == "make":  # as the staging area makes one: paced pieces
            holder.append(_make(nbytes, cuda))
            took.append(time.perf_counter() - t0)
            time.sleep(0.05)
            stop.set()
            return
        slot = holder.pop()
        if way == "give_back":
            base_copy.give_back(slot)
        del slot
        took.append(time.perf_counter() - t0)
        time.sleep(0.05)
        stop.set()

    th = threading.Thread(target=let_go)
    th.start()
    _turns(stop, gaps, cuda)
    th.join()
    if cuda:
        torch.cuda.synchronize()
    for slot in holder:  # (a made one, given back outside the measurement)
        base_copy.give_back(slot)
    return took[0], max(gaps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cuda", action="store_true")
    a = ap.parse_args()
    if a.cuda and not torch.cuda.is_available():
        print("--cuda: no CUDA device", file=sys.stderr)
        return 2
    nbytes = int(a.gib * (1 << 30))
    res: dict[str, list[tuple[float, float]]] = {"make": [], "drop": [], "give_back": []}
    for _ in range(a.rounds):
        for way in res:
            res[way].append(one(way, nbytes, a.cuda))
    out: dict[str, Any] = {"gib": a.gib, "rounds": a.rounds, "cuda": a.cuda,
                           "torch": torch.__version__}
    for way, rows in res.items():
        out[f"{way}_s"] = statistics.median(r[0] for r in rows)
        out[f"{way}_max_gap_ms"] = statistics.median(r[1] for r in rows) * 1e3
        out[f"{way}_max_gap_ms_all"] = [round(r[1] * 1e3, 2) for r in rows]
    out["gap_ratio_drop_over_give_back"] = out["drop_max_gap_ms"] / out["give_back_max_gap_ms"]
    print(json.dumps(out, indent=1))
    return 0


def test_smoke() -> None:
    """CI smoke: a small buffer let go both ways."""
    for way in ("make", "drop", "give_back"):
        took, gap = one(way, 8 << 20, cuda=False)
        assert took >= 0
        assert gap > 0


if __name__ == "__main__":
    sys.exit(main())
