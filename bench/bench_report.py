#!/usr/bin/env python3
"""``lowdiff-store report`` on long logs: the time to read what the page shows and to
write the page, at 10k, 100k and 1M records (issue 36).

The logs are ``bench_long_log.py``'s (tiny records of 16 float32, 192 bytes on disk, a
base every 1,000 steps, segments of 16 MiB, written with the core ``LogWriter`` in group
commits of 1,000). Per size, page cache warm, median of ``--repeat`` runs:

- ``open_s``: ``LogReader(path)`` alone, the floor every reader pays (the baseline of the
  ratio);
- ``collect_s``: :func:`lowdiff_store.report.collect` (index arrays, every base header,
  record metadata of every record up to 20,000 and of an even sample of 2,000 beyond, the
  full ``verify`` check up to 20,000 records);
- ``render_s``: the HTML with its plots (matplotlib, Agg) from the collected report, the
  series binned to at most 2,000 points;
- ``report_s``: ``report_log`` end to end (collect, render, write), and ``page_bytes``;
- ``ratio``: ``report_s / open_s``.

Run:   python bench/bench_report.py [--records 10000 100000 1000000] [--repeat 3] [--json]
Smoke: python -m pytest bench/bench_report.py (a tiny size; asserts every figure)
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_long_log import write_log

from lowdiff_store import LogReader
from lowdiff_store.report import collect, render, report_log

COLUMNS = [("records", "{:,}"), ("write_s", "{:.1f} s"), ("open_s", "{:.3f} s"),
           ("collect_s", "{:.3f} s"), ("render_s", "{:.3f} s"), ("report_s", "{:.3f} s"),
           ("ratio", "{:.1f}x"), ("page_bytes", "{:,}"), ("full_check", "{}"),
           ("meta_read", "{:,}")]


def _median(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(path: str, n: int, repeat: int, width: int = 16, base_every: int = 1000,
            segment_bytes: int = 16 << 20) -> dict[str, Any]:
    t0 = time.perf_counter()
    write_log(path, n, width, base_every, segment_bytes)
    row: dict[str, Any] = {"records": n - 1, "write_s": time.perf_counter() - t0}
    render(collect(path))  # warm: page cache, matplotlib's import and font cache

    def open_close() -> None:
        LogReader(path, strict=False).close()

    row["open_s"] = _median(open_close, repeat)
    rep = collect(path)
    row["collect_s"] = _median(lambda: collect(path), repeat)
    row["render_s"] = _median(lambda: render(rep), repeat)
    page = os.path.join(os.path.dirname(path), "page.html")
    row["report_s"] = _median(lambda: report_log(path, page), repeat)
    row["ratio"] = row["report_s"] / row["open_s"]
    row["page_bytes"] = os.path.getsize(page)
    row["full_check"] = rep.full_check
    row["meta_read"] = rep.logs[0].meta_read
    assert rep.health == "ok", rep.summary()
    assert rep.logs[0].records == n - 1
    return row


def run(sizes: list[int], repeat: int, **kw: Any) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        d = tempfile.mkdtemp(prefix="lowdiff-report-bench-")
        try:
            rows.append(measure(os.path.join(d, "log"), n, repeat, **kw))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = run(args.records, args.repeat)
    if args.json:
        print(json.dumps(rows))
    print("| " + " | ".join(k for k, _f in COLUMNS) + " |")
    print("|" + "---:|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(f.format(row[k]) for k, f in COLUMNS) + " |")
    return 0


def test_smoke() -> None:
    (row,) = run([2_000], 1, base_every=100, segment_bytes=64 << 10)
    assert {k for k, _f in COLUMNS} <= set(row)
    assert row["records"] == 1_999
    assert row["full_check"] is True
    assert row["meta_read"] == 1_999
    assert row["page_bytes"] > 10_000


if __name__ == "__main__":
    sys.exit(main())
