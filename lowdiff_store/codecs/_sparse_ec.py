"""The ``sparse_ec`` codec: a sparse tensor whose ascending indices are entropy coded.

Both codings split each number into ``shift`` low bits, packed at a fixed width, and a high
part written in unary into one bit vector (a 1 ends each entry's zeros):

* ``rice`` (Golomb-Rice): the numbers are ``c[i] = idx[i] - idx[i-1] - 1`` (``idx[-1] = -1``),
  so the high parts are ``c[i] >> shift`` and their unary codes follow one another;
* ``ef`` (Elias-Fano): the numbers are the indices themselves; entry ``i``'s 1 sits at bit
  ``(idx[i] >> shift) + i``.

Either way entry ``i``'s 1 is the ``i``-th set bit of the vector, so decoding is one
``flatnonzero`` plus a cumulative sum: vectorised, no per-entry Python. Values may be stored
narrower than the tensor's dtype when that is exact (F32 values that are all BF16 or F16).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from ..errors import Reason
from ..format.dtypes import STORAGE_DTYPE, bf16_to_f32
from ._core import (
    MAX_NUMEL,
    Checks,
    Codec,
    Encoded,
    NDArray,
    Part,
    alloc,
    as_array,
    check_bool_bytes,
    fail,
    is_int,
    part_array,
)
from ._pack import pack_bits, packed_size, unpack_bits
from ._sparse import prepare, select

CODINGS: Final = ("rice", "ef")
MAX_SHIFT: Final = 62
_CHECK: Final = Checks(
    "sparse_ec", frozenset({"count", "coding", "shift", "hbits", "value_dtype"}), nparts=3
)
#: lossless narrower value dtypes per tensor dtype (widening rules: section 6 of the spec)
NARROWER: Final[dict[str, tuple[str, ...]]] = {"F32": ("BF16", "F16")}


def _numbers(idx: NDArray, coding: str) -> NDArray:
    """The non-negative numbers the coding splits (int64): gaps - 1, or the indices."""
    i64 = idx.astype(np.int64, copy=False)
    if coding == "ef":
        return i64
    c = np.empty(i64.size, np.int64)
    if i64.size:
        c[0] = i64[0]
        np.subtract(i64[1:], i64[:-1], out=c[1:])
        c[1:] -= 1
    return c


def _high_bits(c: NDArray, shift: int, coding: str) -> int:
    """Length of the unary vector: the position of the last 1, plus one."""
    if c.size == 0:
        return 0
    if coding == "ef":
        return int(c[-1] >> shift) + c.size
    return int((c >> shift).sum()) + c.size


def _best_shift(c: NDArray, coding: str, numel: int) -> tuple[int, int]:
    """(shift, hbits) with the fewest total bits; near log2 of the mean step, ties to the
    smaller shift."""
    k = c.size
    if k == 0:
        return 0, 0
    span = (int(c[-1]) + 1) if coding == "ef" else int(c.sum()) + k
    guess = max(0, int(math.log2(max(span / k, 1.0) * math.log(2))))
    best: tuple[int, int, int] | None = None
    for s in range(max(0, guess - 2), min(MAX_SHIFT, guess + 3) + 1):
        hb = _high_bits(c, s, coding)
        total = k * s + hb
        if best is None or total < best[0]:
            best = (total, s, hb)
    assert best is not None
    return best[1], best[2]


def _narrow(values: NDArray, dtype: str) -> tuple[NDArray, str]:
    """The narrowest exact value dtype (BF16, then F16, for F32 values without NaN in F16)."""
    if dtype != "F32" or values.size == 0:
        return values, dtype
    bits = values.view(np.uint32)
    if not bool(np.any(bits & np.uint32(0xFFFF))):
        return (bits >> np.uint32(16)).astype(np.uint16), "BF16"
    with np.errstate(over="ignore"):
        h = values.astype(np.float16)
    if not bool(np.any(np.isnan(h))) and np.array_equal(
            h.astype(np.float32).view(np.uint32), bits):
        return h, "F16"
    return values, dtype


def pack(idx: NDArray, values: NDArray, numel: int, dtype: str, *, coding: str = "auto",
         narrow: bool = True) -> Encoded:
    """Ascending unique ``idx`` (< numel) and their ``values`` (dtype ``dtype``)."""
    if coding not in ("auto", *CODINGS):
        fail(Reason.BAD_CODEC_PARAMS, f"sparse_ec coding={coding!r} is not auto, rice or ef")
    narrow = _CHECK.bool_option("narrow", narrow)
    choices = CODINGS if coding == "auto" else (coding,)
    best: tuple[int, str, int, int, NDArray] | None = None
    for name in choices:
        c = _numbers(idx, name)
        shift, hbits = _best_shift(c, name, numel)
        total = c.size * shift + hbits
        if best is None or total < best[0]:
            best = (total, name, shift, hbits, c)
    assert best is not None
    _, name, shift, hbits, c = best
    k = c.size
    mask = np.int64((1 << shift) - 1)
    low = pack_bits((c & mask).astype(np.uint64), shift)
    ones = (c >> shift) + np.arange(k, dtype=np.int64) if name == "ef" else \
        np.cumsum((c >> shift) + 1) - 1
    unary = np.zeros(hbits, np.bool_)
    unary[ones] = True
    high = np.packbits(unary, bitorder="little")
    vals, vtag = _narrow(values, dtype) if narrow else (values, dtype)
    params = {"count": int(k), "coding": name, "shift": shift, "hbits": hbits,
              "value_dtype": vtag}
    parts = (Part("U8", low), Part("U8", high), Part(vtag, np.ascontiguousarray(vals)))
    return Encoded("sparse_ec", params, parts)


def encode_dense(array: NDArray, dtype: str, *, k: int | None = None, coding: str = "auto",
                 narrow: bool = True) -> Encoded:
    """Every non-zero bit pattern (or the ``k`` largest magnitudes) of a dense tensor."""
    flat = array.reshape(-1)
    idx = select(array, dtype, k)
    return pack(idx, flat[idx], flat.size, dtype, coding=coding, narrow=narrow)


def encode_pairs(indices: object, values: object, numel: object, dtype: str, *,
                 coding: str = "auto", narrow: bool = True) -> Encoded:
    """Precomputed pairs, any order (sorted here)."""
    idx, vals, n = prepare(indices, values, numel, dtype, sort=True)
    return pack(idx, vals, n, dtype, coding=coding, narrow=narrow)


def _header(params: Mapping[str, Any], dtype: str, numel: int) -> tuple[int, str, int, int, str]:
    _CHECK.params(params)
    count = _CHECK.int_param(params, "count", 0, numel)
    coding = _CHECK.choice_param(params, "coding", CODINGS)
    shift = _CHECK.int_param(params, "shift", 0, MAX_SHIFT)
    # every high part is at most numel >> shift in total (see the spec): this bounds the
    # vector, and so every allocation, by the tensor's own size
    hbits = _CHECK.int_param(params, "hbits", count, count + (numel >> shift))
    vtag = _CHECK.choice_param(params, "value_dtype", (dtype, *NARROWER.get(dtype, ())))
    return count, coding, shift, hbits, vtag


def _indices(params: Mapping[str, Any], parts: Sequence[Any], dtype: str, numel: int
             ) -> tuple[NDArray, str]:
    """Validated ascending int64 indices, and the value dtype tag."""
    count, coding, shift, hbits, vtag = _header(params, dtype, numel)
    _CHECK.parts(parts)
    lowp = part_array(parts[0], "U8", packed_size(count, shift), "sparse_ec part 0 (low bits)")
    highp = part_array(parts[1], "U8", packed_size(hbits, 1), "sparse_ec part 1 (high bits)")
    low = unpack_bits(lowp, shift, count, "sparse_ec part 0 (low bits)").astype(np.uint64)
    unary = unpack_bits(highp, 1, hbits, "sparse_ec part 1 (high bits)")
    ones = np.flatnonzero(unary)
    if ones.size != count or (count and int(ones[-1]) != hbits - 1):
        fail(Reason.BAD_CODEC_PARAMS,
             f"sparse_ec high bits hold {ones.size} entries ending at bit "
             f"{int(ones[-1]) if ones.size else -1}, expected {count} ending at {hbits - 1}")
    if count == 0:
        return np.zeros(0, np.int64), vtag
    if coding == "ef":
        high = (ones - np.arange(count)).astype(np.uint64)
        idx = (high << np.uint64(shift)) | low
        if int(idx[-1]) >= numel or (count > 1 and not bool(np.all(idx[1:] > idx[:-1]))):
            fail(Reason.BAD_CODEC_PARAMS, f"sparse_ec indices not strictly ascending in "
                 f"[0, {numel})")
        return idx.astype(np.int64), vtag
    q = np.diff(ones, prepend=-1).astype(np.uint64) - np.uint64(1)
    # q <= numel >> shift (hbits is bounded), so each gap is below numel + 2**shift + 1
    steps = ((q << np.uint64(shift)) | low) + np.uint64(1)
    acc = np.cumsum(steps, dtype=np.uint64)
    if count * (numel + (1 << shift) + 1) < 2**64:  # no wrap: gaps >= 1 keep it ascending
        ok = int(acc[-1]) <= numel
    else:
        ok = int(steps.max()) <= numel and bool(np.all(acc[1:] > acc[:-1])) and \
            int(acc[-1]) <= numel
    if not ok:
        fail(Reason.BAD_CODEC_PARAMS, f"sparse_ec index out of range [0, {numel})")
    return (acc - np.uint64(1)).astype(np.int64), vtag


def _widen_values(vals: NDArray, vtag: str, dtype: str) -> NDArray:
    if vtag == dtype:
        return vals
    if vtag == "BF16":
        return bf16_to_f32(vals)
    if bool(np.any(np.isnan(vals))):
        fail(Reason.BAD_CODEC_PARAMS, "sparse_ec F16 values hold a NaN")
    return vals.astype(np.float32)


def decode(
    params: Mapping[str, Any],
    parts: Sequence[Any],
    dtype: str,
    shape: tuple[int, ...],
    numel: int,
) -> NDArray:
    """Zeros of ``shape``, then the values at the decoded indices: a new array."""
    idx, vtag = _indices(params, parts, dtype, numel)
    vals = part_array(parts[2], vtag, idx.size, "sparse_ec part 2 (values)")
    if dtype == "BOOL":
        check_bool_bytes(vals, "sparse_ec part 2 (values)")
    wide = _widen_values(vals, vtag, dtype)
    out = alloc(numel, STORAGE_DTYPE[dtype], zero=True)
    out[idx] = wide
    return out.reshape(shape)


def entries(params: Mapping[str, Any], parts: Sequence[Any], dtype: str, numel: int
            ) -> tuple[NDArray, NDArray]:
    """(int64 ascending indices, values widened to ``dtype``), validated, not densified."""
    if not is_int(numel) or not 0 <= numel <= MAX_NUMEL:
        fail(Reason.INVALID_ARGUMENT, f"numel={numel!r} is not a non-negative int")
    idx, vtag = _indices(params, parts, dtype, int(numel))
    vals = part_array(as_array(parts[2]), vtag, idx.size, "sparse_ec part 2 (values)")
    if dtype == "BOOL":
        check_bool_bytes(vals, "sparse_ec part 2 (values)")
    return idx, _widen_values(vals, vtag, dtype)


CODEC: Final = Codec("sparse_ec", frozenset({"k", "coding", "narrow"}), encode_dense, decode)
