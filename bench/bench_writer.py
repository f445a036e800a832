"""Benchmarks of the asynchronous writer (:mod:`lowdiff_store.writer`), as ratios against a
baseline measured in the same run, medians of several interleaved runs.

1. throughput: large raw records (16 MiB) through ``AsyncLogWriter(batch=1)`` vs ``os.write`` +
   ``os.fsync`` of the same bytes, one fsync per record in both (goal >= 0.9).
2. foreground: cost of ``append`` of a top-1% sparse diff of a 25M-parameter model (250k
   int32 indices + 250k fp32 values, given ``encoded`` from ``codecs.encode_sparse``) vs one
   ``np.copyto`` of the same 2 MB, inside a loop that computes between steps (goal <= 1.2).
3. amortization: records/s and fsyncs/s at batch 1, 8, 32 (64 KiB records).
4. thread vs process (``--thread-vs-process``): a GIL-bound training loop with a thread
   writer vs a prototype writer process fed through shared memory and a pipe.

Run as a script for the table (the figures in ``bench/RESULTS_writer.md``)::

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_writer.py [--quick] [--thread-vs-process]

or as pytest-benchmark smoke tests: ``.venv/bin/pytest bench/bench_writer.py -m bench``.
Everything runs with one numpy thread; no torch.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from multiprocessing import shared_memory  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from lowdiff_store import codecs  # noqa: E402
from lowdiff_store.log import LogWriter  # noqa: E402
from lowdiff_store.log.tensors import from_encoded  # noqa: E402
from lowdiff_store.writer import AsyncLogWriter, TensorSpec  # noqa: E402

MiB = 1 << 20


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# ---------------------------------------------------------------------------- 1. throughput

def raw_write(directory: str, data: np.ndarray, n: int) -> float:
    """Seconds to write ``n`` copies of ``data`` with os.write + os.fsync after each."""
    path = os.path.join(directory, "raw.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    mv = memoryview(data).cast("B")
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            done = 0
            while done < len(mv):
                done += os.write(fd, mv[done:])
            os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def writer_write(directory: str, data: np.ndarray, n: int, *, batch: int = 1,
                 owned: bool = False, memory_budget: int = 64 * MiB) -> float:
    """Seconds to append ``n`` raw records of ``data`` and have them durable. The budget
    keeps a few records in flight, as in a sustained run: staging buffers are recycled
    (fresh pages are expensive, in a VM above all)."""
    path = os.path.join(directory, "log")
    try:
        with AsyncLogWriter(path, batch=batch, segment_bytes=1 << 30,
                        memory_budget=memory_budget) as w:
            t0 = time.perf_counter()
            for s in range(1, n + 1):
                # owned: hand over a fresh view each time (as the torch layer does with
                # its staging copies); the same bytes either way
                w.append(s, [TensorSpec("w", "U8", data)], kind="weight", owned=owned)
            w.flush()
            return time.perf_counter() - t0
    finally:
        shutil.rmtree(path, ignore_errors=True)


def bench_throughput(directory: str, *, record_mib: int = 16, n: int = 32, runs: int = 5
                     ) -> dict[str, float]:
    """Interleaved runs of raw, writer and writer with ``owned``; MB/s medians and the
    median of the per-run ratios (writer / raw)."""
    data = np.random.default_rng(0).integers(0, 256, record_mib * MiB, dtype=np.uint8)
    raw, wr, ow = [], [], []
    for _ in range(runs):
        raw.append(raw_write(directory, data, n))
        wr.append(writer_write(directory, data, n))
        ow.append(writer_write(directory, data, n, owned=True))
    mb = record_mib * MiB * n / 1e6
    return {"raw_MBps": mb / _median(raw), "writer_MBps": mb / _median(wr),
            "owned_MBps": mb / _median(ow),
            "ratio": _median([r / w for r, w in zip(raw, wr, strict=True)]),
            "owned_ratio": _median([r / w for r, w in zip(raw, ow, strict=True)]),
            # the disk's bad moments hit the raw loop more often: best against best too
            "best_ratio": min(raw) / min(wr), "best_owned_ratio": min(raw) / min(ow)}


# ---------------------------------------------------------------------------- 2. foreground

def sparse_diff(numel: int = 25_000_000, k: int = 250_000) -> codecs.Encoded:
    """A top-1% gradient as a compressor gives it: int32 indices and fp32 values."""
    rng = np.random.default_rng(1)
    idx = np.sort(rng.choice(numel, k, replace=False)).astype(np.int32)
    val = rng.standard_normal(k).astype(np.float32)
    return codecs.encode_sparse(idx, val, numel, "F32")


def bench_foreground(directory: str, *, steps: int = 200, runs: int = 5, batch: int = 1,
                     compute: int = 30) -> dict[str, float]:
    """Median append time vs median copyto time of the same bytes, with the background
    busy (one append per step) and ``compute`` rounds of numpy work between steps (~10 ms,
    so that the disk keeps up: s / BW < T; an fdatasync costs >= 4 ms on the development
    VM). Both operations run every step; their order alternates and only the first one of
    each step is kept, so both are measured with the same (cold) cache state."""
    enc = sparse_diff()
    numel = 25_000_000
    flat = np.concatenate([p.data.view(np.uint8) for p in enc.parts])
    dst = np.empty_like(flat)
    work = np.random.default_rng(2).standard_normal(300_000).astype(np.float32)
    app_med, cp_med, app_mean, ratios, allocs, lag = [], [], [], [], [], []
    for r in range(runs):
        path = os.path.join(directory, f"fg{r}")
        ta: list[float] = []
        tc: list[float] = []
        with AsyncLogWriter(path, batch=batch) as w:
            for s in range(1, steps + 1):
                for _ in range(compute):  # "training" between steps; evicts caches
                    work *= 1.0000001
                    np.sqrt(np.abs(work))
                spec = [TensorSpec("grad", "F32", encoded=enc, shape=(numel,))]
                if s % 2:
                    t0 = time.perf_counter()
                    w.append(s, spec, kind="grad")
                    ta.append(time.perf_counter() - t0)
                    np.copyto(dst, flat)
                else:
                    t0 = time.perf_counter()
                    np.copyto(dst, flat)
                    tc.append(time.perf_counter() - t0)
                    w.append(s, spec, kind="grad")
            w.flush()
            st = w.stats()
        shutil.rmtree(path, ignore_errors=True)
        app_med.append(_median(ta))
        app_mean.append(statistics.fmean(ta))
        cp_med.append(_median(tc))
        ratios.append(_median(ta) / _median(tc))
        allocs.append(st["staging_allocs"])
        lag.append(st["ack_latency_s"] / st["records"])
    return {"append_us": _median(app_med) * 1e6, "append_mean_us": _median(app_mean) * 1e6,
            "copyto_us": _median(cp_med) * 1e6, "ratio": _median(ratios),
            "staging_allocs": _median(allocs), "ack_ms": _median(lag) * 1e3}


# ---------------------------------------------------------------------------- 3. amortization

def bench_amortization(directory: str, *, batches: tuple[int, ...] = (1, 8, 32),
                       record_kib: int = 64, n: int = 512, runs: int = 5
                       ) -> dict[int, dict[str, float]]:
    """records/s and fsyncs/s of back-to-back appends at several batch sizes."""
    data = np.random.default_rng(3).integers(0, 256, record_kib * 1024, dtype=np.uint8)
    res: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    for r in range(runs):
        for b in batches:
            path = os.path.join(directory, f"am{r}_{b}")
            with AsyncLogWriter(path, batch=b, max_delay_s=1.0) as w:
                t0 = time.perf_counter()
                for s in range(1, n + 1):
                    w.append(s, [TensorSpec("w", "U8", data)], kind="weight")
                w.flush()
                dt = time.perf_counter() - t0
                res[b].append((n / dt, w.stats()["batches"] / dt))
            shutil.rmtree(path, ignore_errors=True)
    return {b: {"records_per_s": _median([x[0] for x in v]),
                "fsyncs_per_s": _median([x[1] for x in v])} for b, v in res.items()}


# ---------------------------------------------------------------------------- 4. thread vs process

def _gil_bound_step(params: list[np.ndarray], grads: list[np.ndarray]) -> None:
    """~10 ms of Python-bound work: many tiny tensors, the GIL is never released."""
    for _ in range(20):
        for p, g in zip(params, grads, strict=True):
            g *= 0.9
            g += 0.01
            p -= 0.001 * g


def _gil_free_step(big: np.ndarray) -> None:
    """~10 ms of work on large arrays, which numpy (like torch ops) runs without the GIL."""
    for _ in range(12):
        np.sqrt(np.abs(big), out=big)
        big *= 1.0000001


def _proc_writer(path: str, conn: Any, shm_name: str, slot_bytes: int) -> None:
    """Prototype writer process: records arrive in shared-memory slots, steps by pipe."""
    shm = shared_memory.SharedMemory(shm_name)
    buf = np.ndarray((shm.size,), np.uint8, shm.buf)
    log = LogWriter(path)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            step, slot, parts, params, numel = msg
            base = slot * slot_bytes
            arrs, off = [], base
            for dt, count, itemsize in parts:
                arrs.append(codecs.Part(dt, buf[off:off + count * itemsize]
                                        .view(np.int32 if dt == "I32" else np.float32)))
                off += -(-(count * itemsize) // 64) * 64
            enc = codecs.Encoded("sparse", params, tuple(arrs))
            rec = LogWriter.build(step, [from_encoded("grad", "F32", (numel,), enc)],
                                  kind="grad")
            log.write_records([rec])
            log.sync()
            del rec, enc, arrs
            conn.send((step, slot))
    finally:
        log.close()
        del buf
        shm.close()


class _ProcWriter:
    """The foreground half of the process prototype: copy into a free slot, send."""

    def __init__(self, path: str, slot_bytes: int, nslots: int) -> None:
        ctx = mp.get_context("spawn")
        self.shm = shared_memory.SharedMemory(create=True, size=slot_bytes * nslots)
        self.buf = np.ndarray((self.shm.size,), np.uint8, self.shm.buf)
        self.slot_bytes = slot_bytes
        self.free = list(range(nslots))
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_proc_writer, args=(path, child, self.shm.name,
                                                           slot_bytes))
        self.proc.start()

    def append(self, step: int, enc: codecs.Encoded, numel: int) -> None:
        while self.conn.poll() or not self.free:
            _s, slot = self.conn.recv()
            self.free.append(slot)
        slot = self.free.pop()
        off = slot * self.slot_bytes
        parts = []
        for p in enc.parts:
            n = p.data.nbytes
            self.buf[off:off + n] = p.data.view(np.uint8)
            parts.append((p.dtype, p.data.size, p.data.itemsize))
            off += -(-n // 64) * 64
        self.conn.send((step, slot, parts, dict(enc.params), numel))

    def close(self) -> None:
        self.conn.send(None)
        try:
            while True:
                self.conn.recv()  # drain acks until the child closes its end
        except EOFError:
            pass
        self.proc.join()
        del self.buf
        self.shm.close()
        self.shm.unlink()


def bench_thread_vs_process(directory: str, *, steps: int = 150, runs: int = 3
                            ) -> dict[str, dict[str, float]]:
    """Per training loop (GIL released in compute, like torch ops; or GIL-bound Python),
    the step time without a writer and the slowdown and foreground append cost with the
    thread writer (batch 1), the thread writer with ``sys.setswitchinterval(5e-4)``, and a
    writer process fed through shared memory and a pipe (16 slots of 4 MiB)."""
    enc = sparse_diff()
    numel = 25_000_000
    rng = np.random.default_rng(4)
    params = [rng.standard_normal(64).astype(np.float32) for _ in range(300)]
    grads = [rng.standard_normal(64).astype(np.float32) for _ in range(300)]
    big = rng.standard_normal(2_000_000).astype(np.float32)
    loops: dict[str, Callable[[], None]] = {
        "gil-free": lambda: _gil_free_step(big),
        "gil-bound": lambda: _gil_bound_step(params, grads)}

    def run(step: Callable[[], None], append: Callable[[int], None] | None
            ) -> tuple[float, float]:
        fg = 0.0
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            step()
            if append is not None:
                t1 = time.perf_counter()
                append(s)
                fg += time.perf_counter() - t1
        return time.perf_counter() - t0, fg

    out: dict[str, dict[str, float]] = {}
    for name, step in loops.items():
        res: dict[str, list[float]] = {}
        for r in range(runs):
            res.setdefault("none", []).append(run(step, None)[0])
            for mode in ("thread", "thread-si", "process"):
                path = os.path.join(directory, f"{name}-{mode}-{r}")
                if mode == "process":
                    pw = _ProcWriter(path, 4 * MiB, 16)
                    try:
                        pw.append(0, enc, numel)  # the child has started and opened the log
                        total, fg = run(step, lambda s: pw.append(s, enc, numel))
                    finally:
                        pw.close()
                else:
                    old = sys.getswitchinterval()
                    if mode == "thread-si":
                        sys.setswitchinterval(5e-4)
                    try:
                        with AsyncLogWriter(path, batch=1) as w:

                            def thread_append(s: int) -> None:
                                w.append(s, [TensorSpec("grad", "F32", encoded=enc,
                                                        shape=(numel,))], kind="grad")

                            total, fg = run(step, thread_append)
                            w.flush()
                            st = w.stats()
                        res.setdefault(mode + "_ack_ms", []).append(
                            st["ack_latency_s"] / st["records"] * 1e3)
                    finally:
                        sys.setswitchinterval(old)
                res.setdefault(mode, []).append(total)
                res.setdefault(mode + "_append_us", []).append(fg / steps * 1e6)
                shutil.rmtree(path, ignore_errors=True)
        base = _median(res["none"])
        o = {"step_ms": base / steps * 1e3}
        for mode in ("thread", "thread-si", "process"):
            o[mode + "_slowdown_pct"] = (_median(res[mode]) / base - 1) * 100
            o[mode + "_append_us"] = _median(res[mode + "_append_us"])
            if mode + "_ack_ms" in res:
                o[mode + "_ack_ms"] = _median(res[mode + "_ack_ms"])
        out[name] = o
    return out


# ---------------------------------------------------------------------------- pytest smoke

@pytest.mark.bench
def test_bench_throughput(benchmark: Any, tmp_path: Any) -> None:
    """Smoke: the writer sustains a sensible fraction of raw write+fsync bandwidth."""
    res = benchmark.pedantic(lambda: bench_throughput(str(tmp_path), record_mib=4, n=4,
                                                      runs=1), rounds=1, iterations=1)
    assert res["writer_MBps"] > 0
    assert res["ratio"] > 0


@pytest.mark.bench
def test_bench_foreground(benchmark: Any, tmp_path: Any) -> None:
    """Smoke: append of a sparse diff costs about one copy of its bytes."""
    res = benchmark.pedantic(lambda: bench_foreground(str(tmp_path), steps=40, runs=1,
                                                      compute=2),
                             rounds=1, iterations=1)
    assert res["append_us"] > 0
    assert res["ratio"] > 0


@pytest.mark.bench
def test_bench_amortization(benchmark: Any, tmp_path: Any) -> None:
    """Smoke: a larger batch means fewer fsyncs per record."""
    res = benchmark.pedantic(lambda: bench_amortization(str(tmp_path), batches=(1, 8), n=64,
                                                        runs=1), rounds=1, iterations=1)
    assert res[8]["fsyncs_per_s"] / res[8]["records_per_s"] <= 1 / 4


# ---------------------------------------------------------------------------- script

def main(argv: list[str] | None = None) -> int:
    """Print the table of figures quoted in bench/RESULTS_writer.md."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to measure")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke)")
    ap.add_argument("--thread-vs-process", action="store_true")
    args = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="bench_writer_", dir=args.dir)
    q = args.quick
    try:
        print(f"# python {sys.version.split()[0]}, numpy {np.__version__}, "
              f"{os.cpu_count()} cpus, dir {d}, runs {args.runs}, load {_load()}")
        t = bench_throughput(d, record_mib=4 if q else 16, n=4 if q else 32, runs=args.runs)
        print(f"throughput  raw write+fsync {t['raw_MBps']:6.0f} MB/s | AsyncLogWriter "
              f"{t['writer_MBps']:6.0f} MB/s, ratio {t['ratio']:.3f} (best runs "
              f"{t['best_ratio']:.3f}) | owned {t['owned_MBps']:6.0f} MB/s, ratio "
              f"{t['owned_ratio']:.3f} (best runs {t['best_owned_ratio']:.3f})  (goal >= 0.9)")
        for batch in (1, 8):
            f = bench_foreground(d, steps=60 if q else 200, runs=args.runs, batch=batch)
            print(f"foreground  batch {batch}: append {f['append_us']:6.1f} us (mean "
                  f"{f['append_mean_us']:.1f}) | np.copyto 2 MB {f['copyto_us']:6.1f} us | "
                  f"ratio {f['ratio']:.3f} (goal <= 1.2) | staging allocs "
                  f"{f['staging_allocs']:.0f}, append-to-durable {f['ack_ms']:.1f} ms")
        a = bench_amortization(d, n=128 if q else 512, runs=args.runs)
        for b, v in a.items():
            print(f"batch {b:3d}   {v['records_per_s']:9.0f} records/s  "
                  f"{v['fsyncs_per_s']:8.0f} fsyncs/s  (64 KiB records)")
        if args.thread_vs_process:
            tv = bench_thread_vs_process(d, steps=40 if q else 150, runs=args.runs)
            for loop, x in tv.items():
                print(f"{loop:9s} step {x['step_ms']:5.2f} ms | slowdown: thread "
                      f"{x['thread_slowdown_pct']:5.1f} %, thread+si "
                      f"{x['thread-si_slowdown_pct']:5.1f} %, process "
                      f"{x['process_slowdown_pct']:5.1f} % | append: thread "
                      f"{x['thread_append_us']:4.0f} us, process {x['process_append_us']:4.0f} us "
                      f"| append-to-durable: thread {x['thread_ack_ms']:.1f} ms, thread+si "
                      f"{x['thread-si_ack_ms']:.1f} ms")
        print(f"# load at the end {_load()}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


def _load() -> str:
    """The 1-minute load average (other work on the machine skews every figure)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
