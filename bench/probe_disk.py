#!/usr/bin/env python3
"""What the disk charges for a file's *first* write to its blocks: a noise source of the
append figure (``bench_log.py``), not a property of the log.

Four files, written record by record in rotating order with one sync per record:

  append        os.write at the end of a fresh file + os.fsync (bench_log's baseline)
  append-data   the same with os.fdatasync
  fallocate     a file whose blocks were reserved with posix_fallocate (unwritten extents)
  overwrite     a file whose blocks were written (zeros) and synced before the run

On a thin-provisioned virtual disk (this VM) a block's first write makes the host
allocate it; "overwrite" avoids that, "fallocate" does not. The log and raw baselines of
``bench_log.py`` each get fresh blocks wherever ext4 puts their file, so a run's ratio moves
with how many of each file's blocks the disk had seen before. Prints the median time per
record of each file and its ratio to "append".

Run:  python bench/probe_disk.py [--mib 1] [--records 150] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

MODES = ("append", "append-data", "fallocate", "overwrite")


def probe(directory: str, mib: int, records: int) -> dict[str, float]:
    """Median seconds per record for each mode (see the module docstring)."""
    size = mib << 20
    data = os.urandom(size)
    fds: dict[str, int] = {}
    try:
        for m in MODES:
            fd = fds[m] = os.open(os.path.join(directory, m), os.O_RDWR | os.O_CREAT
                                  | os.O_TRUNC, 0o644)
            if m == "fallocate":
                os.posix_fallocate(fd, 0, records * size)
            elif m == "overwrite":
                zeros = bytes(size)
                for i in range(records):
                    os.pwrite(fd, zeros, i * size)
                os.fsync(fd)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(records):
            for m in MODES[i % 4:] + MODES[:i % 4]:
                t0 = time.perf_counter()
                os.pwrite(fds[m], data, i * size)
                (os.fsync if m == "append" else os.fdatasync)(fds[m])
                times[m].append(time.perf_counter() - t0)
    finally:
        for m, fd in fds.items():
            os.close(fd)
            os.unlink(os.path.join(directory, m))
    return {m: statistics.median(v) for m, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1, help="record size in MiB")
    ap.add_argument("--records", type=int, default=150)
    ap.add_argument("--dir", default=None, help="a directory on the disk to probe")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        med = probe(d, args.mib, args.records)
    print(f"{args.mib} MiB records, {args.records} per file, median per record:")
    for m, t in med.items():
        print(f"  {m:12s} {t * 1e6:8.0f} us   append / this {med['append'] / t:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
