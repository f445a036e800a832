"""Benchmarks of the log layer (:mod:`lowdiff_store.log`), as ratios against baselines measured
in the same run; every figure is the median of several interleaved runs.

1. append: large raw records (1, 4, 8, 16, 32 and 64 MiB of incompressible bytes) through
   ``LogWriter.append`` + ``LogWriter.sync`` (one fdatasync per record), vs ``os.write`` +
   ``os.fsync`` of the very same record bytes into a file on the same disk, the two
   interleaved record by record (goal >= 0.95 at every size). For context, also against
   the same bytes written the way the log streams a large record (runs of 256 KiB or
   more, each handed to the disk with ``sync_file_range``, then ``os.fsync``; no CRC):
   how far the log is from the best this disk does with its own technique.
2. open: ``LogReader(path)`` of a log of 100,000 small records, through its index (goal
   <= 100 ms; the report must say nothing was scanned).
3. read one step: ``reader.record(step).tensor(name)`` at random steps of that log (goal
   <= 1 ms).
4. mmap vs pread: reading every large record (CRC checked) with ``mode="mmap"`` and
   ``mode="pread"``, with the page cache warm and cold (``POSIX_FADV_DONTNEED``).

Run as a script for the table (figures in ``bench/RESULTS_log.md``)::

    .venv/bin/python bench/bench_log.py [--quick] [--dir DIR] [--json] [--sizes 1,8]
                                        [--append-only]

or as pytest-benchmark tests: ``.venv/bin/pytest bench/bench_log.py -m bench`` (full sizes)
or with ``--benchmark-disable`` (a tiny smoke version: 1 MiB records, a 2,000-record log).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogReader, LogWriter, tensor_input
from lowdiff_store.format.record import build_record
from lowdiff_store.log import writer as writer_mod
from lowdiff_store.storage import AppendFile
from lowdiff_store.storage import local as local_storage

MiB = 1 << 20

#: Record sizes (MiB) of the append figure.
APPEND_SIZES = (1, 4, 8, 16, 32, 64)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _record_of(arr: np.ndarray, step: int = 1) -> bytes:
    rec = build_record(step, [tensor_input("x", arr, "U8")], kind="grad")
    return b"".join(bytes(c) for c in rec.chunks)


# ----------------------------------------------------------------------------- 1. append


def _write_all(fd: int, mv: memoryview) -> None:
    done = 0
    while done < len(mv):
        done += os.write(fd, mv[done:])


def _write_streamed(f: AppendFile, mv: memoryview) -> None:
    """Raw bytes written the way the log streams a large write (the log's own cutting and
    storage calls: runs of ``writeback_run_bytes``, each handed to the disk as written),
    with no CRC and no framing, then synced."""
    for off, views in writer_mod._runs([mv], f.size, writer_mod.writeback_run_bytes(len(mv))):
        f.append(views)
        f.start_writeback(off, sum(v.nbytes for v in views))
    f.sync()


def append_run(directory: str, arr: np.ndarray, data: bytes, n: int,
               per_record: dict[str, list[float]] | None = None) -> dict[str, float]:
    """One run: ``n`` records appended to a fresh log (``LogWriter.append`` + ``sync``), to a
    second fresh log with the writeback hint off (the path of another OS: the CRC on the
    write path below 16 MiB, on a helper thread during the write from 16 MiB), the same
    ``n`` record bytes to a fresh raw file (``os.write`` + ``os.fsync``: the baseline), and
    where Linux offers ``sync_file_range``, to another fresh raw file written in streamed
    runs as the log writes them (``_write_streamed``, then fdatasync: the best this disk does
    with the log's technique, no CRC), record by record in rotating order, so all of them
    see the same disk. Returns the seconds of each (``raw``, ``log``, ``old``,
    ``streamed``); ``per_record`` (if given) gets each record's seconds appended under the
    same keys."""
    raw_path = os.path.join(directory, "raw.bin")
    streamed_path = os.path.join(directory, "raw-streamed.bin")
    log_path = os.path.join(directory, "log")
    old_path = os.path.join(directory, "log-nohint")
    fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    f_s = AppendFile(streamed_path, create=True)
    w = LogWriter(log_path, segment_bytes=1 << 40)
    w_old = LogWriter(old_path, segment_bytes=1 << 40)
    mv = memoryview(data)
    hint = local_storage._sync_file_range
    order = ["raw", "log", "old"] + (["streamed"] if hint is not None else [])
    times = dict.fromkeys(order, 0.0)
    try:
        for step in range(1, n + 1):
            for which in order[step % len(order):] + order[:step % len(order)]:
                t0 = time.perf_counter()
                if which == "raw":
                    _write_all(fd, mv)
                    os.fsync(fd)
                elif which == "streamed":
                    _write_streamed(f_s, mv)
                elif which == "log":
                    w.append(step, [tensor_input("x", arr, "U8")], kind="grad")
                    w.sync()
                else:
                    local_storage._sync_file_range = None
                    try:
                        w_old.append(step, [tensor_input("x", arr, "U8")], kind="grad")
                        w_old.sync()
                    finally:
                        local_storage._sync_file_range = hint
                dt = time.perf_counter() - t0
                times[which] += dt
                if per_record is not None:
                    per_record.setdefault(which, []).append(dt)
    finally:
        os.close(fd)
        f_s.close()
        w.close()
        w_old.close()
        os.unlink(raw_path)
        os.unlink(streamed_path)
        shutil.rmtree(log_path)
        shutil.rmtree(old_path)
    return times


def bench_append(directory: str, record_mib: int, n: int, runs: int) -> dict[str, Any]:
    """Throughput of the log vs raw write+fsync of the same bytes: medians over ``runs``
    runs of ``n`` records each, the two writers interleaved record by record."""
    arr = np.random.default_rng(record_mib).integers(0, 256, record_mib * MiB, dtype=np.uint8)
    data = _record_of(arr)  # exactly the bytes the log writes for one record
    append_run(directory, arr, data, 2)  # warm up every path once
    raw_mbps, log_mbps, ratios, old_ratios, streamed_ratios = [], [], [], [], []
    per: dict[str, list[float]] = {}
    for _ in range(runs):
        t = append_run(directory, arr, data, n, per)
        raw_mbps.append(len(data) * n / t["raw"] / 1e6)
        log_mbps.append(len(data) * n / t["log"] / 1e6)
        ratios.append(t["raw"] / t["log"])
        old_ratios.append(t["raw"] / t["old"])
        if "streamed" in t:
            streamed_ratios.append(t["streamed"] / t["log"])
    streamed: dict[str, Any] = {}
    if streamed_ratios:
        # the log against raw bytes written its own way: what the CRC, the framing and the
        # Python cost on top of the disk's best (1.0 = nothing)
        streamed = {"streamed_ratio": _median(streamed_ratios),
                    "record_ratio_streamed": _median(
                        [a / b for a, b in zip(per["streamed"], per["log"])])}
    return {"record_mib": record_mib, "records_per_run": n, "runs": runs,
            "record_bytes": len(data), "raw_MBps": _median(raw_mbps),
            "log_MBps": _median(log_mbps), "ratio": _median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratios": [round(r, 3) for r in ratios],
            # the same record's raw time over its log time (the three adjacent in time),
            # median over every record of every run: robust to a few slow fdatasyncs
            "record_ratio": _median([a / b for a, b in zip(per["raw"], per["log"])]),
            "record_ratio_nohint": _median([a / b for a, b in zip(per["raw"], per["old"])]),
            "nohint_ratio": _median(old_ratios),
            "nohint_ratios": [round(r, 3) for r in old_ratios], **streamed}


# ------------------------------------------------------------------- 2-3. open, read one


def build_many(path: str, n: int, batch: int = 1000) -> float:
    """A log of ``n`` small records (one 16-float tensor each), written in group commits
    of ``batch`` records. Returns the seconds it took."""
    t0 = time.perf_counter()
    with LogWriter(path) as w:
        w.write_base(0, {"w": ("F32", np.zeros(16, "<f4"))})
        for lo in range(1, n + 1, batch):
            recs = [build_record(s, [tensor_input("g", _small(s), "F32")], kind="grad",
                                 side={"step": s})
                    for s in range(lo, min(lo + batch, n + 1))]
            w.write_records(recs)
            w.sync()
    return time.perf_counter() - t0


def _small(step: int) -> np.ndarray:
    return np.arange(16, dtype="<f4") + np.float32(step)


def bench_open(path: str, runs: int) -> dict[str, Any]:
    """Milliseconds to open the log (median of ``runs``); checks nothing was scanned."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = LogReader(path)
        times.append(time.perf_counter() - t0)
        n, unindexed = len(r), r.report.unindexed_records
        r.close()
        assert unindexed == 0, "the index should cover every record"
    return {"records": n, "runs": runs, "open_ms": _median(times) * 1e3,
            "open_ms_max": max(times) * 1e3, "unindexed_records": unindexed}


def bench_read_one(path: str, samples: int) -> dict[str, Any]:
    """Microseconds to read the record of one random step and decode its tensor."""
    rng = np.random.default_rng(7)
    with LogReader(path) as r:
        steps = rng.integers(1, len(r) + 1, samples)
        times = []
        for s in steps:
            t0 = time.perf_counter()
            t = r.record(int(s)).tensor("g")
            times.append(time.perf_counter() - t0)
            assert t.tobytes() == _small(int(s)).tobytes()
    return {"samples": samples, "read_one_us": _median(times) * 1e6,
            "read_one_us_p99": float(np.percentile(times, 99)) * 1e6}


# -------------------------------------------------------------------- 4. mmap vs pread


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_all(path: str, mode: str) -> tuple[float, int]:
    """(seconds, bytes) to read every record and tensor of the log (CRC checked)."""
    total = 0
    t0 = time.perf_counter()
    with LogReader(path, mode=mode) as r:  # type: ignore[arg-type]
        for s in r.steps:
            t = r.record(int(s)).tensor("x")
            total += t.nbytes
            del t
    return time.perf_counter() - t0, total


def bench_read(directory: str, record_mib: int, n: int, runs: int) -> dict[str, Any]:
    path = os.path.join(directory, "readlog")
    arr = np.random.default_rng(3).integers(0, 256, record_mib * MiB, dtype=np.uint8)
    with LogWriter(path, segment_bytes=1 << 40) as w:
        for s in range(1, n + 1):
            w.append(s, [tensor_input("x", arr, "U8")], kind="grad")
        w.sync()
    seg = os.path.join(path, "seg-0000000000000000.ldlog")
    out: dict[str, Any] = {"record_mib": record_mib, "records": n, "runs": runs}
    try:
        for cache in ("warm", "cold"):
            rates: dict[str, list[float]] = {"mmap": [], "pread": []}
            for run in range(runs):
                for mode in (("mmap", "pread") if run % 2 == 0 else ("pread", "mmap")):
                    if cache == "cold":
                        _drop_cache(seg)
                    else:
                        read_all(path, mode)  # make sure every page is cached
                    t, nbytes = read_all(path, mode)
                    rates[mode].append(nbytes / t / 1e6)
            for mode, xs in rates.items():
                out[f"{mode}_{cache}_MBps"] = _median(xs)
            out[f"mmap_over_pread_{cache}"] = _median(
                [a / b for a, b in zip(rates["mmap"], rates["pread"])])
    finally:
        shutil.rmtree(path)
    return out


# ------------------------------------------------------------------- pytest-benchmark


def _disabled(benchmark: Any) -> bool:
    return bool(getattr(benchmark, "disabled", False))


@pytest.fixture(scope="session")
def many_records_log(tmp_path_factory: pytest.TempPathFactory,
                     request: pytest.FixtureRequest) -> tuple[str, int]:
    """The log of many small records, built once per session: 100,000 records, or 2,000
    when benchmarks are disabled (the CI smoke run)."""
    smoke = bool(request.config.getoption("benchmark_disable", False))
    n = 2_000 if smoke else 100_000
    path = str(tmp_path_factory.mktemp("bench") / "many")
    build_many(path, n)
    return path, n


def _once(benchmark: Any, fn: Callable[[], Any]) -> Any:
    return benchmark.pedantic(fn, rounds=1, iterations=1)


@pytest.mark.bench
@pytest.mark.parametrize("record_mib", APPEND_SIZES)
def test_bench_append(benchmark: Any, tmp_path: Any, record_mib: int) -> None:
    if _disabled(benchmark):
        res = _once(benchmark, lambda: bench_append(str(tmp_path), 1, 2, 1))
    else:
        res = _once(benchmark, lambda: bench_append(str(tmp_path), record_mib,
                                                    max(4, 256 // record_mib), 5))
    benchmark.extra_info.update(res)
    assert res["raw_MBps"] > 0
    assert res["ratio"] > 0


@pytest.mark.bench
def test_bench_open_many(benchmark: Any, many_records_log: tuple[str, int]) -> None:
    path, n = many_records_log
    res = _once(benchmark, lambda: bench_open(path, 1 if _disabled(benchmark) else 7))
    benchmark.extra_info.update(res)
    assert res["records"] == n
    assert res["unindexed_records"] == 0


@pytest.mark.bench
def test_bench_read_one(benchmark: Any, many_records_log: tuple[str, int]) -> None:
    path, _n = many_records_log
    res = _once(benchmark, lambda: bench_read_one(path, 20 if _disabled(benchmark) else 1000))
    benchmark.extra_info.update(res)
    assert res["read_one_us"] > 0


@pytest.mark.bench
def test_bench_mmap_vs_pread(benchmark: Any, tmp_path: Any) -> None:
    if _disabled(benchmark):
        res = _once(benchmark, lambda: bench_read(str(tmp_path), 1, 2, 1))
    else:
        res = _once(benchmark, lambda: bench_read(str(tmp_path), 32, 8, 5))
    benchmark.extra_info.update(res)
    assert res["mmap_warm_MBps"] > 0
    assert res["pread_cold_MBps"] > 0


# ------------------------------------------------------------------------------ script


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            names = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, " \
           f"{platform.system()} {platform.release()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure "
                    "(default: a temporary directory)")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs per figure (>= 5)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--sizes", default=",".join(map(str, APPEND_SIZES)),
                    help="append record sizes in MiB, comma-separated")
    ap.add_argument("--append-only", action="store_true", help="only the append figure")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench_log_", dir=args.dir)
    runs = 1 if args.quick else max(args.runs, 5)
    results: dict[str, Any] = {"machine": _machine(), "dir": root, "runs": runs,
                               "loadavg_start": _loadavg()}
    try:
        results["append"] = [bench_append(root, mib, 2 if args.quick else max(4, 256 // mib),
                                          runs) for mib in map(int, args.sizes.split(","))]
        results["loadavg_after_append"] = _loadavg()
        if args.append_only:
            return _report(results, runs, root, args.json)
        n = 2_000 if args.quick else 100_000
        many = os.path.join(root, "many")
        results["build_many_s"] = build_many(many, n)
        results["open"] = bench_open(many, max(runs, 7))
        results["read_one"] = bench_read_one(many, 100 if args.quick else 1000)
        results["read"] = bench_read(root, 4 if args.quick else 32, 2 if args.quick else 8, runs)
        results["loadavg_end"] = _loadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _report(results, runs, root, args.json)


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def _report(results: dict[str, Any], runs: int, root: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"machine: {results['machine']}")
    print(f"directory: {root} (removed), medians of {runs} interleaved runs")
    print(f"load average (1/5/15 min): {results['loadavg_start']} at the start, "
          f"{results['loadavg_after_append']} after the append figure\n")
    print("| measure | lowdiff-store | baseline | ratio (median of runs) | min-max | "
          "per-record median | without the writeback hint: runs / per record | "
          "against raw bytes streamed the log's way: runs / per record | goal |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|")
    for a in results["append"]:
        streamed = (f"{a['streamed_ratio']:.3f} / {a['record_ratio_streamed']:.3f}"
                    if "streamed_ratio" in a else "n/a")
        print(f"| append {a['record_mib']} MiB records + fdatasync each "
              f"({a['records_per_run']}/run) | {a['log_MBps']:.0f} MB/s | "
              f"{a['raw_MBps']:.0f} MB/s (os.write+os.fsync) | {a['ratio']:.3f} | "
              f"{a['ratio_min']:.3f}-{a['ratio_max']:.3f} | {a['record_ratio']:.3f} | "
              f"{a['nohint_ratio']:.3f} / {a['record_ratio_nohint']:.3f} | {streamed} "
              f"| >= 0.95 |")
    if "open" not in results:
        print("per-run append ratios: " + "; ".join(
            f"{a['record_mib']} MiB {a['ratios']}" for a in results["append"]))
        print("without the hint: " + "; ".join(
            f"{a['record_mib']} MiB {a['nohint_ratios']}" for a in results["append"]))
        return 0
    o, r1 = results["open"], results["read_one"]
    print(f"| open a log of {o['records']:,} records (nothing scanned) | {o['open_ms']:.1f} ms "
          f"(max {o['open_ms_max']:.1f}) | | | | | | <= 100 ms |")
    print(f"| read one step's record + decode | {r1['read_one_us']:.1f} us "
          f"(p99 {r1['read_one_us_p99']:.1f}) | | | | | | <= 1 ms |")
    rd = results["read"]
    for cache in ("warm", "cold"):
        print(f"| read {rd['record_mib']} MiB records, CRC checked, {cache} cache | "
              f"mmap {rd[f'mmap_{cache}_MBps']:.0f} MB/s | pread {rd[f'pread_{cache}_MBps']:.0f}"
              f" MB/s | {rd[f'mmap_over_pread_{cache}']:.2f} | | | | |")
    print(f"\nload average at the end: {results['loadavg_end']}")
    print(f"(building the {o['records']:,}-record log took {results['build_many_s']:.1f} s)")
    print("per-run append ratios: " + "; ".join(
        f"{a['record_mib']} MiB {a['ratios']}" for a in results["append"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
