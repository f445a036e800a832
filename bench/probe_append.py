#!/usr/bin/env python3
"""How to write a record so that its sync waits least: the syscall-level experiment behind
the log's streamed appends (``LogWriter`` and ``WRITEBACK_RUN_BYTES``), with no log code in
the loop.

Each strategy writes the same record bytes to a fresh file of its own, interleaved record
by record with the baseline (``os.write`` + ``os.fsync`` to another fresh file, in
alternating order), one sync per record; it reports the median over records of
raw time / strategy time (above 1: faster than raw write+fsync):

  whole-hint   the log's path before 2026-11-24: the record with its first 64 bytes zero in
               one write, ``sync_file_range`` of the rest, the CRC, the 64 bytes, fdatasync
  crc-first    the CRC of the (cached) record, one write, fdatasync
  no-hint      the record with its first 64 bytes zero, the CRC, the 64 bytes, fdatasync
  runs-K       the record in runs ending at file offsets that are multiples of K KiB, each
               written, handed to the disk (``sync_file_range``) and added to the CRC while
               cached; the 64 bytes; fdatasync (the log's path since, with K = 256)

Linux only (``sync_file_range``). Each strategy runs against the baseline alone, so the
files do not share the journal's commits.

Run:  python bench/probe_append.py [--mib 1] [--records 200] [--dir DIR]
                                   [--strategies whole-hint,crc-first,...]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import crc32c
import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")
_WRITE = 2  # SYNC_FILE_RANGE_WRITE


def _sfr() -> Callable[[int, int, int, int], int]:
    fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return fn  # type: ignore[no-any-return]


def _hint(sfr: Callable[[int, int, int, int], int], fd: int, lo: int, hi: int) -> None:
    """Hand the whole pages of [lo, hi) to the disk (as AppendFile.start_writeback)."""
    head, tail = -(-lo // PAGE) * PAGE, hi // PAGE * PAGE
    if tail > head:
        sfr(fd, head, tail - head, _WRITE)


def strategy(name: str, sfr: Callable[[int, int, int, int], int]
             ) -> Callable[[int, int, memoryview], None]:
    """A function writing one record (``mv``) at offset ``off`` of ``fd`` and syncing."""
    if name == "whole-hint":
        def run(fd: int, off: int, mv: memoryview) -> None:
            os.pwritev(fd, [bytes(64), mv[64:]], off)
            _hint(sfr, fd, off + 64, off + len(mv))
            crc32c.crc32c(mv[8:])
            os.pwrite(fd, mv[:64], off)
            os.fdatasync(fd)
    elif name == "crc-first":
        def run(fd: int, off: int, mv: memoryview) -> None:
            crc32c.crc32c(mv[8:])
            os.pwrite(fd, mv, off)
            os.fdatasync(fd)
    elif name == "no-hint":
        def run(fd: int, off: int, mv: memoryview) -> None:
            os.pwritev(fd, [bytes(64), mv[64:]], off)
            crc32c.crc32c(mv[8:])
            os.pwrite(fd, mv[:64], off)
            os.fdatasync(fd)
    elif name.startswith("runs-"):
        k = int(name[5:]) << 10

        def run(fd: int, off: int, mv: memoryview) -> None:
            pos, crc = 0, crc32c.crc32c(mv[8:64])
            while pos < len(mv):
                end = min(len(mv), (off + pos) // k * k + k - off)
                lo = max(pos, 64)
                os.pwritev(fd, [bytes(64), mv[64:end]] if pos == 0 else [mv[pos:end]],
                           off + pos)
                crc = crc32c.crc32c(mv[lo:end], crc)
                _hint(sfr, fd, off + lo, off + end)
                pos = end
            os.pwrite(fd, mv[:64], off)
            os.fdatasync(fd)
    else:
        raise SystemExit(f"unknown strategy {name!r}")
    return run


def measure(directory: str, name: str, mv: memoryview, records: int) -> float:
    """Median over records of raw write+fsync time / ``name``'s time."""
    run = strategy(name, _sfr())
    raw = os.open(os.path.join(directory, "raw"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    ratios = []
    try:
        for i in range(records + 3):
            t = {}
            for which in (("raw", "it") if i % 2 else ("it", "raw")):
                t0 = time.perf_counter()
                if which == "raw":
                    os.write(raw, mv)
                    os.fsync(raw)
                else:
                    run(fd, i * len(mv), mv)
                t[which] = time.perf_counter() - t0
            if i >= 3:  # warm-up
                ratios.append(t["raw"] / t["it"])
    finally:
        os.close(raw)
        os.close(fd)
        os.unlink(os.path.join(directory, "raw"))
        os.unlink(os.path.join(directory, name))
    return statistics.median(ratios)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=1.0)
    ap.add_argument("--records", type=int, default=200)
    ap.add_argument("--dir", default=os.environ.get("BENCH_DIR"))
    ap.add_argument("--strategies",
                    default="whole-hint,crc-first,no-hint,runs-256,runs-512,runs-1024,runs-4096")
    args = ap.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("sync_file_range is Linux-only")
    n = int(args.mib * (1 << 20))
    mv = memoryview(np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes())
    print(f"{args.mib:g} MiB records, {args.records} per strategy; load average "
          f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for name in args.strategies.split(","):
            print(f"  {name:12s} raw / strategy, median per record: "
                  f"{measure(d, name, mv, args.records):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
