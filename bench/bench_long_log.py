#!/usr/bin/env python3
"""Long logs: how opening, verifying, compacting and replaying one step grow with the number
of records (issue 24, item 4).

A log of N tiny records (one float32 tensor of ``--width`` values per step, written with
:class:`LogWriter` in group commits of 1,000 records) with a base every ``--base-every``
steps, in segments of ``--segment-bytes``. Per N:

- ``write_s``: writing the log (context; not a claim);
- ``open_s``: ``LogReader(path)`` (manifest, every index, the scan of unindexed bytes),
  median of 3 opens, page cache warm; ``index_bytes``: the reader's step index arrays;
  ``open_peak_py_bytes``: tracemalloc peak of one open (Python and numpy allocations);
  ``open_rss_bytes``: RSS growth of the first open (mapped index pages included);
- ``durable_step_s``: ``reader.durable_step`` (what ``compact`` and ``replay`` ask first);
- ``replay_step_s``: the state at the last step from the newest base and the diffs after
  it (``chain``, base read, every record read with its CRC checked), median of 3;
- ``verify_s``: ``verify_log`` (every byte read and checked);
- ``compact_s``: ``compact(keep_bases=1)`` with a numpy materializer (new base at the last
  step, every older base and segment deleted), and ``reopen_s`` after it.

The spec (``format_spec/log_format.md``, sections 5 and 9) makes open linear in the
number of index entries with a small constant (vector checks, no per-record Python),
a step's lookup O(log n), its replay proportional to the diffs since its base (constant
here), verify linear in bytes, and compaction linear in the files it deletes plus the
diffs it replays. ``per_record_us`` columns make a linear cost a flat line.

Run:   python bench/bench_long_log.py [--records 10000 100000 1000000] [--json]
Smoke: python -m pytest bench/bench_long_log.py (two tiny sizes; asserts every figure)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowdiff_store import LogReader, LogWriter, tensor_input
from lowdiff_store.compaction import compact
from lowdiff_store.verify import verify_log

NAME = "w"
BATCH = 1000


def write_log(path: str, n: int, width: int, base_every: int, segment_bytes: int) -> None:
    """Steps 0..n-1: a base at every multiple of ``base_every``, a diff at every other step
    (diff of step t: the values t, so the state at t is the base plus their sum)."""
    state = np.zeros(width, np.float32)
    with LogWriter(path, segment_bytes=segment_bytes) as w:
        w.write_base(0, {NAME: ("F32", state)})
        for lo in range(1, n, BATCH):
            recs = []
            for t in range(lo, min(n, lo + BATCH)):
                d = np.full(width, t % 7, np.float32)
                state += d
                recs.append(LogWriter.build(t, [tensor_input(NAME, d, "F32")], kind="grad"))
                if t % base_every == 0:
                    w.write_records(recs)
                    recs = []
                    w.write_base(t, {NAME: ("F32", state)})
            if recs:
                w.write_records(recs)
            w.sync()


def state_at(reader: LogReader, step: int) -> np.ndarray:
    """The state at ``step``: newest base at or before it plus every diff after it."""
    b, diffs = reader.chain(step)
    with reader.base(b) as base:
        state = np.array(base.tensor(NAME))
    for t in diffs:
        state += reader.record(t).tensor(NAME)
    return state


def materialize(reader: LogReader, step: int
                ) -> tuple[Mapping[str, tuple[str, np.ndarray]], Mapping[str, Any]]:
    """The compaction materializer of these logs."""
    return {NAME: ("F32", state_at(reader, step))}, {}


def expected(step: int, width: int) -> np.ndarray:
    total = sum(t % 7 for t in range(1, step + 1))
    return np.full(width, total, np.float32)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(fn: Callable[[], Any], repeat: int = 3) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(root: str, n: int, width: int, base_every: int, segment_bytes: int
            ) -> dict[str, Any]:
    path = os.path.join(root, f"log{n}")
    t0 = time.perf_counter()
    write_log(path, n, width, base_every, segment_bytes)
    r: dict[str, Any] = {"records": n, "write_s": time.perf_counter() - t0}
    gc.collect()
    before = rss()
    reader = LogReader(path)
    r["open_rss_bytes"] = rss() - before
    last = reader.last_step
    r["segments"] = len(reader.manifest.segments)
    r["bases"] = len(reader.bases)
    # the reader's index: four int64 arrays (step, segment, offset, length), as this table
    r["index_bytes"] = int(reader.record_table().nbytes)
    assert last == n - 1
    assert len(reader) == n - 1
    r["durable_step_s"] = timed(lambda: reader.durable_step)
    assert reader.durable_step == last
    r["replay_step_s"] = timed(lambda: state_at(reader, last))
    assert np.array_equal(state_at(reader, last), expected(last, width))
    reader.close()
    r["open_s"] = timed(lambda: LogReader(path).close())
    tracemalloc.start()
    LogReader(path).close()
    r["open_peak_py_bytes"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    t0 = time.perf_counter()
    rep = verify_log(path)
    r["verify_s"] = time.perf_counter() - t0
    assert rep.ok, rep.problems[:3]
    assert rep.records == n - 1
    r["log_bytes"] = sum(e.stat().st_size for e in os.scandir(path))
    t0 = time.perf_counter()
    res = compact(path, keep_bases=1, materializer=materialize)
    r["compact_s"] = time.perf_counter() - t0
    r["compact_deleted_files"] = len(res.plan.delete_bases) + 2 * len(res.plan.delete_segments)
    r["reopen_s"] = timed(lambda: LogReader(path).close())
    with LogReader(path) as reader:
        assert reader.bases == [last]
        assert np.array_equal(state_at(reader, last), expected(last, width))
    shutil.rmtree(path)
    for k in ("open_s", "verify_s", "compact_s", "write_s"):
        r[k.replace("_s", "_per_record_us")] = r[k] / n * 1e6
    return r


def run(sizes: list[int], width: int, base_every: int, segment_bytes: int
        ) -> list[dict[str, Any]]:
    """Measure every size in a temp directory under /tmp, removed afterwards."""
    root = tempfile.mkdtemp(prefix="lowdiff-long-log-", dir="/tmp")
    try:
        return [measure(root, n, width, base_every, segment_bytes) for n in sizes]
    finally:
        shutil.rmtree(root, ignore_errors=True)


COLUMNS = [("records", "{:>9}"), ("segments", "{:>4}"), ("bases", "{:>5}"),
           ("open_s", "{:>8.4f}"), ("open_per_record_us", "{:>7.2f}"),
           ("index_bytes", "{:>10}"), ("open_peak_py_bytes", "{:>10}"),
           ("open_rss_bytes", "{:>10}"), ("durable_step_s", "{:>8.5f}"),
           ("replay_step_s", "{:>8.4f}"),
           ("verify_s", "{:>8.2f}"), ("verify_per_record_us", "{:>7.2f}"),
           ("compact_s", "{:>8.3f}"), ("reopen_s", "{:>8.4f}"), ("write_s", "{:>7.1f}")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--width", type=int, default=16, help="float32 values per record")
    ap.add_argument("--base-every", type=int, default=1000)
    ap.add_argument("--segment-bytes", type=int, default=16 << 20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = run(a.records, a.width, a.base_every, a.segment_bytes)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(" ".join(k for k, _ in COLUMNS))
    for row in rows:
        print(" ".join(f.format(row[k]) for k, f in COLUMNS))
    return 0


def test_smoke() -> None:
    rows = run([300, 3000], width=4, base_every=100, segment_bytes=64 << 10)
    for row in rows:
        assert {k for k, _ in COLUMNS} <= set(row)
    assert rows[1]["segments"] > 1
    assert rows[1]["bases"] == 30


if __name__ == "__main__":
    sys.exit(main())
