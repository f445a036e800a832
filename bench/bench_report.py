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

``--problems N`` (issue 42): instead, a log of N tiny records each of which is a problem
(``tests/helpers/problems.py``: ``decision``, a tuner decision whose step is a string, found
by ``verify`` and by the report's own read; or ``checksum``, every record's CRC broken),
and per run, alternating, ``verify_log`` (the baseline) and ``report_log`` end to end
(``--check auto``: verify's full check included); medians of ``--repeat`` and
``ratio = report_s / verify_s``. The report's duplicate checks were quadratic in the
problems (8k problems: 17.8 s against verify's 0.8 s).

Run:   python bench/bench_report.py [--records 10000 100000 1000000] [--repeat 3] [--json]
       python bench/bench_report.py --problems 8000 [--damage decision] [--repeat 5]
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # + tests
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_long_log import write_log

from lowdiff_store import LogReader
from lowdiff_store.report import collect, render, report_log
from lowdiff_store.verify import verify_log
from tests.helpers.problems import damaged_log

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


PROBLEM_COLUMNS = [("records", "{:,}"), ("problems", "{:,}"), ("verify_s", "{:.2f} s"),
                   ("report_s", "{:.2f} s"), ("ratio", "{:.2f}x")]


def measure_problems(path: str, n: int, repeat: int, damage: str) -> dict[str, Any]:
    """``verify_log`` and ``report_log`` on a log of ``n`` damaged records, alternating
    (a load that changes between runs moves both), medians of ``repeat``."""
    damaged_log(path, n, damage)
    page = os.path.join(os.path.dirname(path), "page.html")
    rep = report_log(path, page)  # warm: page cache, matplotlib's import and font cache
    verify_s, report_s = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        verify_log(path)
        t1 = time.perf_counter()
        report_log(path, page)
        verify_s.append(t1 - t0)
        report_s.append(time.perf_counter() - t1)
    row = {"records": n, "problems": len(rep.all_problems()),
           "verify_s": statistics.median(verify_s), "report_s": statistics.median(report_s)}
    row["ratio"] = row["report_s"] / row["verify_s"]
    assert rep.full_check
    return row


def _each(sizes: list[int], fn: Callable[[str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """``fn(log path, size)`` per size, each in a temporary directory removed after."""
    rows = []
    for n in sizes:
        d = tempfile.mkdtemp(prefix="lowdiff-report-bench-")
        try:
            rows.append(fn(os.path.join(d, "log"), n))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return rows


def run(sizes: list[int], repeat: int, **kw: Any) -> list[dict[str, Any]]:
    """:func:`measure` per size."""
    return _each(sizes, lambda path, n: measure(path, n, repeat, **kw))


def run_problems(sizes: list[int], repeat: int, damage: str) -> list[dict[str, Any]]:
    """:func:`measure_problems` per size."""
    return _each(sizes, lambda path, n: measure_problems(path, n, repeat, damage))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--problems", type=int, nargs="+", metavar="N",
                    help="instead: logs of N records, each a problem (issue 42)")
    ap.add_argument("--damage", choices=("decision", "checksum"), default="decision")
    args = ap.parse_args(argv)
    if args.problems:
        rows, columns = run_problems(args.problems, args.repeat, args.damage), PROBLEM_COLUMNS
    else:
        rows, columns = run(args.records, args.repeat), COLUMNS
    if args.json:
        print(json.dumps(rows))
    print("| " + " | ".join(k for k, _f in columns) + " |")
    print("|" + "---:|" * len(columns))
    for row in rows:
        print("| " + " | ".join(f.format(row[k]) for k, f in columns) + " |")
    return 0


def test_smoke() -> None:
    (row,) = run([2_000], 1, base_every=100, segment_bytes=64 << 10)
    assert {k for k, _f in COLUMNS} <= set(row)
    assert row["records"] == 1_999
    assert row["full_check"] is True
    assert row["meta_read"] == 1_999
    assert row["page_bytes"] > 10_000


def test_smoke_problems() -> None:
    (row,) = run_problems([200], 1, "decision")
    assert {k for k, _f in PROBLEM_COLUMNS} <= set(row)
    assert row["problems"] == 200
    assert row["ratio"] > 0


if __name__ == "__main__":
    sys.exit(main())
