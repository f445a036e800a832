#!/usr/bin/env python3
"""Where the test suite's CPU goes: the census ``LOWDIFF_TEST_CPU=FILE`` makes
(``tests/conftest.py``), summed by test file, most CPU first.

    LOWDIFF_TEST_CPU=/tmp/cpu.jsonl make test
    python tools/test_cpu.py /tmp/cpu.jsonl [--tests 20] [--json]

CPU seconds are the pytest worker's own and those of the processes a test started and
reaped; on a machine the suite saturates, they are what CI's wall time is made of (the
machine's cores divide them), where ``--durations`` counts whatever else ran meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def summarize(lines: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    """Per test file: tests, own CPU, children's CPU, wall (seconds)."""
    out: dict[str, dict[str, float]] = defaultdict(
        lambda: {"tests": 0, "own": 0.0, "children": 0.0, "wall": 0.0})
    for rec in lines:
        f = out[str(rec["test"]).split("::", 1)[0]]
        f["tests"] += 1
        for k in ("own", "children", "wall"):
            f[k] += float(rec[k])  # type: ignore[arg-type]
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("census", help="the FILE of LOWDIFF_TEST_CPU=FILE")
    ap.add_argument("--tests", type=int, default=15, help="also list the N costliest tests")
    ap.add_argument("--json", action="store_true", help="the per-file sums as JSON")
    a = ap.parse_args(argv)
    with open(a.census, encoding="utf-8") as f:
        lines = [json.loads(ln) for ln in f if ln.strip()]
    files = summarize(lines)
    if a.json:
        json.dump(files, sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    total = sum(v["own"] + v["children"] for v in files.values())
    print(f"{len(lines)} tests, {total:.0f} CPU s ({total / 60:.1f} min)\n")
    print(f"{'CPU s':>8} {'share':>6} {'own':>7} {'children':>8} {'tests':>5}  file")
    for name, v in sorted(files.items(), key=lambda kv: -(kv[1]["own"] + kv[1]["children"])):
        cpu = v["own"] + v["children"]
        print(f"{cpu:8.1f} {cpu / total:6.1%} {v['own']:7.1f} {v['children']:8.1f} "
              f"{int(v['tests']):5d}  {name}")
    if a.tests:
        print(f"\nthe {a.tests} costliest tests:")
        for rec in sorted(lines, key=lambda r: -(r["own"] + r["children"]))[:a.tests]:
            print(f"{rec['own'] + rec['children']:8.1f}  {rec['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
