"""Benchmarks of the 1.1 codecs (:mod:`lowdiff_store.codecs`): stored bytes per entry and
encode / decode throughput, on normal float32 tensors of 1M and 20M elements.

Throughput is input bytes per second, the median of several runs: for the dense codecs the
float32 tensor (``numel * 4`` bytes), for the sparse ones LowDiff's message (``8 * k``: int32
index + fp32 value per entry). Sparse codecs encode precomputed top-1% pairs (as a
compressor hands them over: selection is not counted) and decode to their entries, without
densifying (as replay reads them). "given" rows store a compressor's own message; "from
fp32" rows run the reference quantizer too. Baseline in the same run: LowDiff's ``sparse``.

Also measured: Golomb-Rice vs Elias-Fano index coding at 0.1%, 1% and 10% density (bits per
index and speed), and, for ``qsgd``, Elias-gamma-coded levels (computed, not a codec) vs
the zstd stage on the fixed-width entries.

Run as a script for the tables (figures in ``bench/RESULTS.md``)::

    .venv/bin/python bench/bench_codecs.py [--quick] [--json]

or as pytest-benchmark tests: ``.venv/bin/pytest bench/bench_codecs.py -m bench`` (full
sizes) or with ``--benchmark-disable`` (a smoke run on 100,000 elements).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowdiff_store import codecs

MB = 1e6


def _timed(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times)), out


def _topk(g: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.sort(np.argpartition(np.abs(g), g.size - k)[g.size - k :]).astype(np.int32)
    return idx, g[idx]


def _configs(g: np.ndarray) -> list[tuple[str, Callable[[], codecs.Encoded], int, int]]:
    """(label, encoder, entries the bytes are counted per, input bytes of the throughput)."""
    n = g.size
    k = max(1, n // 100)
    idx, vals = _topk(g, k)
    bf = (vals.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    rng = np.random.default_rng(3)
    codes = rng.integers(-1, 2, n).astype(np.int8)
    one = np.ones(1, np.float32)
    levels = rng.integers(-4, 5, n)
    norms = np.ones(-(-n // 512), np.float32)
    neg = g < 0
    d = g * np.float32(1e-3)
    sp = 8 * k  # a sparse message's input: int32 index + fp32 value per entry
    return [
        ("sparse top-1% (int32 + fp32, LowDiff)",
         lambda: codecs.encode_sparse(idx, vals, n, "F32"), k, sp),
        ("sparse_ec top-1% rice", lambda: codecs.encode_sparse(idx, vals, n, "F32",
                                                               coding="rice"), k, sp),
        ("sparse_ec top-1% ef", lambda: codecs.encode_sparse(idx, vals, n, "F32",
                                                             coding="ef"), k, sp),
        ("sparse_ec top-1% auto, bf16-exact values",
         lambda: codecs.encode_sparse(idx, bf, n, "F32", coding="auto"), k, sp),
        ("tern, given codes (encode_ternary)",
         lambda: codecs.encode_ternary(codes, one, "F32", block=n), n, 4 * n),
        ("tern, from fp32 (stochastic, one scale)",
         lambda: codecs.encode("tern", g, "F32", seed=1), n, 4 * n),
        ("qsgd s=4 d=512, given levels (encode_qsgd)",
         lambda: codecs.encode_qsgd(levels, norms, "F32", levels=4, bucket=512), n, 4 * n),
        ("qsgd s=4 d=512, from fp32 (stochastic)",
         lambda: codecs.encode("qsgd", g, "F32", levels=4, bucket=512, seed=1), n, 4 * n),
        ("qsgd s=255 d=512, from fp32 (stochastic)",
         lambda: codecs.encode("qsgd", g, "F32", levels=255, bucket=512, seed=1), n, 4 * n),
        ("sign, given signs (encode_signs)",
         lambda: codecs.encode_signs(neg, "F32", scale=0.5), n, 4 * n),
        ("lcc bits=3 (weight delta)", lambda: codecs.encode("lcc", d, "F32", bits=3), n, 4 * n),
        ("lcc bits=4 (weight delta)", lambda: codecs.encode("lcc", d, "F32", bits=4), n, 4 * n),
    ]


def _decoder(enc: codecs.Encoded, n: int) -> Callable[[], Any]:
    """Dense codecs decode to the tensor; sparse ones to their entries (what replay uses)."""
    parts = [p.data for p in enc.parts]
    if enc.codec in ("sparse", "sparse_ec"):
        return lambda: codecs.sparse_entries(enc.params, parts, n, codec=enc.codec,
                                             dtype="F32")
    return lambda: codecs.decode(enc.codec, enc.params, parts, "F32", (n,))


def bench_codecs(n: int, runs: int, seed: int = 0) -> list[dict[str, Any]]:
    """One row per codec configuration on ``n`` normal float32 values."""
    g = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    rows = []
    for label, enc_fn, entries, basis in _configs(g):
        t_enc, enc = _timed(enc_fn, runs)
        t_dec, _out = _timed(_decoder(enc, n), runs)
        per = enc.nbytes / entries
        row = {"codec": label, "numel": n, "entries": entries,
               "bytes_per_entry": round(per, 4),
               "bits_per_element": round(enc.nbytes * 8 / n, 4),
               "encode_MBps": round(basis / MB / t_enc, 1),
               "decode_MBps": round(basis / MB / t_dec, 1)}
        if label.startswith("sparse"):
            row["vs_int32_fp32"] = round(per / 8.0, 4)
        rows.append(row)
    return rows


def bench_index_coding(n: int, runs: int, seed: int = 1) -> list[dict[str, Any]]:
    """Rice vs Elias-Fano: bits per index and M indices/s, uniform positions."""
    rng = np.random.default_rng(seed)
    rows = []
    for density in (0.001, 0.01, 0.1):
        k = int(n * density)
        idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int32)
        vals = np.ones(k, np.float32)
        entropy = _log2_binom(n, k) / k
        for coding in ("rice", "ef"):
            t_enc, enc = _timed(lambda c=coding: codecs.encode_sparse(idx, vals, n, "F32",
                                                                      coding=c), runs)
            parts = [p.data for p in enc.parts]
            t_dec, got = _timed(lambda enc=enc, parts=parts: codecs.sparse_entries(
                enc.params, parts, n, codec="sparse_ec", dtype="F32"), runs)
            assert np.array_equal(got[0], idx)
            bits = (enc.parts[0].nbytes + enc.parts[1].nbytes) * 8 / k
            rows.append({"density": density, "coding": coding, "k": k,
                         "bits_per_index": round(bits, 3),
                         "entropy_bits": round(entropy, 3),
                         "encode_Mentries_s": round(k / 1e6 / t_enc, 1),
                         "decode_Mentries_s": round(k / 1e6 / t_dec, 1)})
    return rows


def _log2_binom(n: int, k: int) -> float:
    from math import lgamma, log
    return (lgamma(n + 1) - lgamma(k + 1) - lgamma(n - k + 1)) / log(2)


def _qsgd_levels(stream: np.ndarray, width: int, n: int) -> np.ndarray:
    """The level of each of ``n`` qsgd entries (``level << 1 | sign`` in ``width`` bits, LSB
    first: format_spec/codecs.md, "Bit streams"), read with numpy alone."""
    bits = np.unpackbits(stream, bitorder="little")[: n * width].reshape(n, width)
    lv = np.zeros(n, np.int64)
    for j in range(1, width):
        lv |= bits[:, j].astype(np.int64) << (j - 1)
    return lv


def bench_qsgd_elias(n: int, seed: int = 2) -> list[dict[str, Any]]:
    """Bits per element of qsgd entries: fixed width, zstd stage on them, Elias gamma."""
    g = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    rows = []
    for s, d in ((1, 512), (4, 128), (4, 512), (15, 512), (127, 512), (255, n)):
        enc = codecs.encode("qsgd", g, "F32", levels=s, bucket=d, seed=1)
        w = 1 + s.bit_length()
        lv = _qsgd_levels(enc.parts[1].data, w, n)
        gamma = float((2 * np.floor(np.log2(lv + 1)) + 1).sum() + (lv > 0).sum())
        blob, _ = codecs.compress(enc.parts[1].data, level=3)
        rows.append({"levels": s, "bucket": d, "fixed_bits": w,
                     "zstd_bits": round(len(blob) * 8 / n, 3),
                     "elias_gamma_bits": round(gamma / n, 3)})
    return rows


# ------------------------------------------------------------------- pytest-benchmark


def _disabled(benchmark: Any) -> bool:
    return bool(getattr(benchmark, "disabled", False))


def _once(benchmark: Any, fn: Callable[[], Any]) -> Any:
    return benchmark.pedantic(fn, rounds=1, iterations=1)


@pytest.mark.bench
@pytest.mark.parametrize("numel", [1_000_000, 20_000_000])
def test_bench_codecs(benchmark: Any, numel: int) -> None:
    n, runs = (100_000, 1) if _disabled(benchmark) else (numel, 3)
    rows = _once(benchmark, lambda: bench_codecs(n, runs))
    benchmark.extra_info["rows"] = rows
    by = {r["codec"]: r for r in rows}
    assert by["sparse top-1% (int32 + fp32, LowDiff)"]["bytes_per_entry"] == 8.0
    assert by["sparse_ec top-1% rice"]["vs_int32_fp32"] <= 0.65
    assert by["tern, given codes (encode_ternary)"]["bits_per_element"] < 2.01
    assert all(r["decode_MBps"] > 0 for r in rows)


@pytest.mark.bench
def test_bench_index_coding(benchmark: Any) -> None:
    n, runs = (200_000, 1) if _disabled(benchmark) else (20_000_000, 3)
    rows = _once(benchmark, lambda: bench_index_coding(n, runs))
    benchmark.extra_info["rows"] = rows
    for r in rows:
        assert r["bits_per_index"] >= r["entropy_bits"] - 0.01


@pytest.mark.bench
def test_bench_qsgd_elias(benchmark: Any) -> None:
    n = 50_000 if _disabled(benchmark) else 1_000_000
    rows = _once(benchmark, lambda: bench_qsgd_elias(n))
    benchmark.extra_info["rows"] = rows
    assert all(r["zstd_bits"] > 0 for r in rows)


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
           f"numpy {np.__version__}"


def _table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    for r in rows[1:]:
        keys += [k for k in r if k not in keys]
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--runs", type=int, default=3, help="runs per figure (median)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = ap.parse_args(argv)
    sizes = [100_000] if args.quick else [1_000_000, 20_000_000]
    res: dict[str, Any] = {"machine": _machine()}
    res["codecs"] = [r for n in sizes for r in bench_codecs(n, 1 if args.quick else args.runs)]
    res["index_coding"] = bench_index_coding(sizes[-1], 1 if args.quick else args.runs)
    res["qsgd_elias"] = bench_qsgd_elias(100_000 if args.quick else 1_000_000)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(res["machine"])
    for key in ("codecs", "index_coding", "qsgd_elias"):
        print(f"\n{key}\n")
        print(_table(res[key]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
