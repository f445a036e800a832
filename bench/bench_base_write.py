#!/usr/bin/env python3
"""A base written vs a raw write+fsync of the same bytes, interleaved (issue 24, item 2).

The synthetic AdamW state of ``bench_scale.py`` (N float32 parameters in tensors of 4M
values, both moments present). Each round, in one process and in alternating order:

- ``base0``: ``DiffCheckpointer(...)`` + ``flush()`` on a fresh log: base 0 written from
  the live tensors (no copy) and durable, plus the log's creation;
- ``writer``: ``AsyncLogWriter.write_base`` of the same arrays handed over as the
  checkpointer hands a staged base (``release=``, with the CRC32Cs its copy computed),
  waited for: the write path alone;
- ``raw``: ``os.write`` of the state's own memory in 64 MiB pieces, then ``os.fsync``.

Reported per round and as medians: seconds, MB/s and the ratios base0 / raw and writer /
raw (time; <= 1.11 is >= 0.9x of the raw bandwidth). The disk's speed drifts from minute
to minute on a shared VM, so only ratios within a round are compared. Everything is
written under a temp directory in /tmp and removed.

Run:   python bench/bench_base_write.py [--params 300m] [--rounds 5] [--json FILE]
Smoke: python -m pytest bench/bench_base_write.py
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
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scale import SIZES, base_write, objects, raw_write_s, state_tensors, train_step

from lowdiff_store.format.checksum import crc32c
from lowdiff_store.torch.core.tensors import bits_view
from lowdiff_store.writer import AsyncLogWriter


def writer(tensors: list[torch.Tensor], path: str) -> float:
    arrays = {f"t{i}": bits_view(t) for i, t in enumerate(tensors)}
    # as the checkpointer hands a staged base: its CRCs computed by the copy (untimed)
    crcs = {n: crc32c(a.reshape(-1).view("u1")) for n, (_t, a) in arrays.items()}
    w = AsyncLogWriter(path)
    try:
        t0 = time.perf_counter()
        w.write_base(0, arrays, {"bench": True}, owned=True, release=lambda: None,
                     crcs=crcs).result()
        dt = time.perf_counter() - t0
    finally:
        w.close()
    shutil.rmtree(path)
    return dt


def run(n: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, opt = objects(n)
    train_step(model, opt, 0)
    tensors = state_tensors(model, opt)
    root = tempfile.mkdtemp(prefix="lowdiff-basewrite-", dir="/tmp")
    rows = []
    try:
        size = base_write(model, opt, root, "size")[1]
        for i in range(rounds):
            r: dict[str, float] = {}
            order = [["base0", "writer", "raw"], ["raw", "base0", "writer"],
                     ["writer", "raw", "base0"]][i % 3]
            for what in order:
                p = os.path.join(root, f"{what}-{i}")
                if what == "base0":
                    r["base0_s"], r["bytes"] = base_write(model, opt, root, str(i))
                elif what == "writer":
                    r["writer_s"] = writer(tensors, p)
                else:  # as many bytes as the base (header and metadata included)
                    r["raw_s"] = raw_write_s(tensors, size, p)
                    os.unlink(p)
            r["base0_ratio"] = r["base0_s"] / r["raw_s"]
            r["writer_ratio"] = r["writer_s"] / r["raw_s"]
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"params": n, "rounds": rows}
    for k in ("base0_s", "writer_s", "raw_s", "base0_ratio", "writer_ratio"):
        out[k] = statistics.median(r[k] for r in rows)
    out["raw_mbps"] = rows[0]["bytes"] / out["raw_s"] / 1e6
    out["base0_mbps"] = rows[0]["bytes"] / out["base0_s"] / 1e6
    out["writer_mbps"] = rows[0]["bytes"] / out["writer_s"] / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="300m", choices=SIZES)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    out = run(SIZES[a.params], a.rounds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}))
    return 0


def test_smoke() -> None:
    out = run(SIZES["smoke"], 2)
    assert len(out["rounds"]) == 2
    for r in out["rounds"]:
        assert r["bytes"] > 3 * 4 * SIZES["smoke"]  # params and both moments, and a header
        assert min(r["base0_s"], r["writer_s"], r["raw_s"]) > 0


if __name__ == "__main__":
    sys.exit(main())
