"""The ``qsgd`` codec: QSGD's message, a float32 norm per bucket and, per element, a sign
and a level in ``[0, s]``, packed as ``1 + bit_length(s)`` bits per element.

Entry ``e = level << 1 | sign`` in the bit-stream layout of :mod:`._pack`. Decode::

    v = fl32(float64(norm[b]) * level / s)      (exact product, one float64 rounding, then
    out = -v if sign else v                      one RNE rounding to float32; F64: the
                                                 float64 quotient), then narrowed to the dtype
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from ..errors import Reason
from ._core import (
    ARITH_FLOAT_TAGS,
    F32_MAX,
    MAX_NUMEL,
    Checks,
    Codec,
    Encoded,
    NDArray,
    Part,
    alloc,
    block_steps,
    check_array,
    check_scales,
    check_shape,
    fail,
    narrow_f32,
    part_array,
    storage_dtype_of,
    widen_float,
)
from ._pack import pack_bits, packed_size, unpack_bits

#: ``norm * level`` stays exact in float64 (24 + 16 bits); QSGD uses s <= 256 in practice.
MAX_LEVELS: Final = 2**16 - 1
MAX_BUCKET: Final = MAX_NUMEL
_CHECK: Final = Checks("qsgd", frozenset({"levels", "bucket"}), nparts=2,
                       dtypes=ARITH_FLOAT_TAGS)


def entry_width(levels: int) -> int:
    """Bits per element: one sign bit plus ``bit_length(levels)`` level bits."""
    return 1 + int(levels).bit_length()


def _check(levels: Any, bucket: Any) -> tuple[int, int]:
    return (_CHECK.int_option("levels", levels, 1, MAX_LEVELS),
            _CHECK.int_option("bucket", bucket, 1, MAX_BUCKET))


def _pack(signed: NDArray, norms: NDArray, levels: int, bucket: int) -> Encoded:
    """``signed``: int64 ``sign * level`` per element (C order); float32 ``norms``."""
    ut = np.uint8 if levels < 128 else (np.uint16 if levels < 2**15 else np.uint32)
    entries = np.abs(signed).astype(ut)
    entries <<= ut(1)
    entries |= signed < 0
    parts = (Part("F32", np.ascontiguousarray(norms, np.float32)),
             Part("U8", pack_bits(entries, entry_width(levels))))
    return Encoded("qsgd", {"levels": levels, "bucket": bucket}, parts)


def encode(array: NDArray, dtype: str, *, levels: int, bucket: int | None = None,
           seed: int | None = None) -> Encoded:
    """Quantize: norm = the L2 norm of each bucket (float64, rounded up to float32); level =
    ``rint(|x| / norm * s)`` (ties to even), or with ``seed`` QSGD's unbiased stochastic
    rounding ``floor(|x| / norm * s + u)`` (numpy PCG64). ``bucket`` defaults to the tensor.
    """
    _CHECK.require_dtype(dtype)
    x = widen_float(array.reshape(-1), dtype)
    n = x.size
    s, d = _check(levels, bucket if bucket is not None else max(n, 1))
    seed = _CHECK.seed_option(seed)
    _CHECK.finite(x)
    if n == 0:
        return _pack(np.zeros(0, np.int64), np.zeros(0, np.float32), s, d)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):  # F64: x * x past float64's range is past F32_MAX
        sq = np.add.reduceat(x64 * x64, np.arange(0, n, d))
    norm64 = np.sqrt(sq)
    if not bool(np.all(norm64 <= F32_MAX)):
        fail(Reason.INVALID_ARGUMENT, "qsgd bucket norm overflows float32")
    norms = norm64.astype(np.float32)
    low = norms.astype(np.float64) < norm64
    if low.any():
        norms[low] = np.nextafter(norms[low], np.float32(np.inf))
    nb = np.repeat(norms.astype(np.float64), d)[:n] if norms.size > 1 else float(norms[0])
    t = np.divide(np.abs(x64) * s, nb, out=np.zeros(n, np.float64), where=np.asarray(nb) > 0)
    if seed is None:
        lv = np.rint(t)
    else:
        lv = np.floor(t + np.random.Generator(np.random.PCG64(seed)).random(n))
    lv = np.minimum(lv, s).astype(np.int64)
    return _pack(np.where(x64 < 0, -lv, lv), norms, s, d)


def encode_levels(signed: object, norms: object, dtype: str, *, levels: int,
                  bucket: int) -> Encoded:
    """See :func:`lowdiff_store.codecs.encode_qsgd`."""
    _CHECK.require_dtype(dtype)
    s, d = _check(levels, bucket)
    if not isinstance(signed, np.ndarray) or signed.dtype.kind not in "iu":
        fail(Reason.BAD_DTYPE, "qsgd levels must be a numpy integer array")
    check_shape(signed.shape, storage_dtype_of(dtype).itemsize)
    flat = signed.reshape(-1).astype(np.int64)
    nm = check_array(norms, "F32", "qsgd norms").reshape(-1)
    if nm.size != -(-flat.size // d):
        fail(Reason.INVALID_ARGUMENT, f"qsgd: {nm.size} norms for {flat.size} entries in "
             f"buckets of {d}")
    check_scales(nm, "qsgd norms")
    if flat.size and (int(flat.min()) < -s or int(flat.max()) > s):
        fail(Reason.INVALID_ARGUMENT, f"qsgd levels must lie in [-{s}, {s}]")
    return _pack(flat, nm, s, d)


def decode(
    params: Mapping[str, Any],
    parts: Sequence[Any],
    dtype: str,
    shape: tuple[int, ...],
    numel: int,
) -> NDArray:
    """The dequantized tensor (module docstring) as a new array of ``dtype``."""
    _CHECK.require_dtype(dtype)
    _CHECK.params(params)
    s = _CHECK.int_param(params, "levels", 1, MAX_LEVELS)
    d = _CHECK.int_param(params, "bucket", 1, MAX_BUCKET)
    _CHECK.parts(parts)
    width = entry_width(s)
    norms = part_array(parts[0], "F32", -(-numel // d), "qsgd part 0 (norms)")
    packed = part_array(parts[1], "U8", packed_size(numel, width), "qsgd part 1 (entries)")
    check_scales(norms, "qsgd norms")
    e = unpack_bits(packed, width, numel, "qsgd part 1 (entries)")
    one = e.dtype.type(1)
    if numel and (int(e.max()) >> 1 > s or bool(np.any(e == one))):
        fail(Reason.BAD_CODEC_PARAMS, f"qsgd level above {s} or a negative zero level")
    nm = norms.astype(np.float64)
    out = alloc(numel, np.float64 if dtype == "F64" else np.float32, zero=False)
    for e0, e1, b0, b1 in block_steps(numel, d):  # float64 temporaries stay in cache
        seg = e[e0:e1]
        t = (seg >> one).astype(np.float64).reshape(b1 - b0, -1)
        t *= nm[b0:b1, None]
        t /= s
        np.negative(t, out=t, where=(seg & one).astype(np.bool_).reshape(t.shape))
        out[e0:e1] = t.reshape(-1)  # F32: one RNE rounding
    if dtype == "F64":
        res: NDArray = out.reshape(shape)
        return res
    return narrow_f32(out, dtype).reshape(shape)


CODEC: Final = Codec("qsgd", frozenset({"levels", "bucket", "seed"}), encode, decode,
                     required=frozenset({"levels"}))
