"""The ``tern`` codec: TernGrad's message, codes in {-1, 0, +1} times a float32 scale.

Codes are packed 2 bits each (0 = 0, 1 = +1, 2 = -1; 3 is refused) in the bit-stream
layout of :mod:`._pack`, one scale per block of ``block`` elements (``block >= numel``: one
scale for the tensor). Decode is ``code * scale`` in float32, then narrowed to the dtype.
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
    block_reduce_max,
    block_scale,
    check_array,
    check_scales,
    check_shape,
    fail,
    narrow_f32,
    part_array,
    storage_dtype_of,
    widen_float,
)
from ._pack import pack_bits, packed_size

MAX_BLOCK: Final = MAX_NUMEL
_CHECK: Final = Checks("tern", frozenset({"block"}), nparts=2, dtypes=ARITH_FLOAT_TAGS)
#: byte -> its four codes' values (code 0 -> 0, 1 -> +1, 2 -> -1, 3 -> 0 and refused)
_BYTE_CODES: Final = (np.arange(256)[:, None] >> (2 * np.arange(4))[None, :]) & 3
_BYTE_VALUES: Final = np.array([0.0, 1.0, -1.0, 0.0], np.float32)[_BYTE_CODES]
_BYTE_HAS_3: Final = np.any(_BYTE_CODES == 3, axis=1)


def _scales_count(numel: int, block: int) -> int:
    return -(-numel // block)


def _pack(codes: NDArray, scales: NDArray, block: int) -> Encoded:
    """``codes`` int8 in {-1, 0, 1} (C order), float32 ``scales``: the stored form."""
    u = codes.view(np.uint8) & np.uint8(3)  # int8 -1 -> 3; 3 ^ 1 = 2, 1 ^ 0 = 1, 0 ^ 0 = 0
    u ^= u >> np.uint8(1)
    parts = (Part("U8", pack_bits(u, 2)), Part("F32", np.ascontiguousarray(scales, np.float32)))
    return Encoded("tern", {"block": block}, parts)


def encode(array: NDArray, dtype: str, *, block: int | None = None,
           seed: int | None = None) -> Encoded:
    """Ternarize ``array``: scale = max |x| per block (rounded up to float32).

    Without ``seed`` a code is ``sign(x)`` when ``2|x| > scale`` (nearest); with ``seed`` it is
    ``sign(x)`` with probability ``|x| / scale`` (TernGrad's unbiased stochastic rounding,
    numpy PCG64). ``block`` defaults to the whole tensor. Non-finite input: ``invalid_argument``.
    """
    _CHECK.require_dtype(dtype)
    x = widen_float(array.reshape(-1), dtype)
    n = x.size
    blk = _CHECK.int_option("block", block if block is not None else max(n, 1), 1, MAX_BLOCK)
    seed = _CHECK.seed_option(seed)
    _CHECK.finite(x)
    a = np.abs(x)
    if n == 0:
        return _pack(np.zeros(0, np.int8), np.zeros(0, np.float32), blk)
    amax = block_reduce_max(a, blk).astype(np.float64)
    if float(amax.max()) > F32_MAX:  # F64 input: no float32 scale covers it
        fail(Reason.INVALID_ARGUMENT, f"tern input must have |x| <= {F32_MAX:.9g} (the "
                                      "largest float32: the scales are float32)")
    scales = amax.astype(np.float32)
    low = scales.astype(np.float64) < amax  # F64 input: round the scale up
    if low.any():
        scales[low] = np.nextafter(scales[low], np.float32(np.inf))
    s = np.repeat(scales.astype(np.float64), blk)[:n] if scales.size > 1 else scales[0]
    ratio = np.divide(a, s, out=np.zeros(n, np.float64), where=np.asarray(s) > 0)
    if seed is None:
        keep = ratio > 0.5
    else:
        keep = np.random.Generator(np.random.PCG64(seed)).random(n) < ratio
    codes = np.where(keep, np.where(x < 0, -1, 1), 0).astype(np.int8)
    return _pack(codes, scales, blk)


def encode_codes(codes: object, scales: object, dtype: str, *, block: int) -> Encoded:
    """See :func:`lowdiff_store.codecs.encode_ternary`."""
    _CHECK.require_dtype(dtype)
    if not isinstance(codes, np.ndarray) or codes.dtype.kind not in "iu":
        fail(Reason.BAD_DTYPE, "tern codes must be a numpy integer array")
    flat = codes.reshape(-1)
    check_shape(codes.shape, storage_dtype_of(dtype).itemsize)
    blk = _CHECK.int_option("block", block, 1, MAX_BLOCK)
    sc = check_array(scales, "F32", "tern scales").reshape(-1)
    if sc.size != _scales_count(flat.size, blk):
        fail(Reason.INVALID_ARGUMENT,
             f"tern: {sc.size} scales for {flat.size} codes in blocks of {blk}")
    check_scales(sc, "tern scales")
    if flat.size and (int(flat.min()) < -1 or int(flat.max()) > 1):
        fail(Reason.INVALID_ARGUMENT, "tern codes must lie in {-1, 0, 1}")
    return _pack(flat.astype(np.int8, copy=False), sc, blk)


def decode(
    params: Mapping[str, Any],
    parts: Sequence[Any],
    dtype: str,
    shape: tuple[int, ...],
    numel: int,
) -> NDArray:
    """``code * scale`` per element into a new array of ``dtype``."""
    _CHECK.require_dtype(dtype)
    _CHECK.params(params)
    block = _CHECK.int_param(params, "block", 1, MAX_BLOCK)
    _CHECK.parts(parts)
    packed = part_array(parts[0], "U8", packed_size(numel, 2), "tern part 0 (codes)")
    scales = part_array(parts[1], "F32", _scales_count(numel, block), "tern part 1 (scales)")
    check_scales(scales, "tern scales")
    tail = (numel * 2) % 8
    if tail and int(packed[-1]) >> tail:
        fail(Reason.BAD_CODEC_PARAMS, "tern part 0 (codes): padding bits are not zero")
    if numel and bool(np.any(_BYTE_HAS_3[packed])):
        fail(Reason.BAD_CODEC_PARAMS, "tern code 3 is not a ternary value")
    wide = np.float64 if dtype == "F64" else np.float32
    # one gather of four values per stored byte, then the scales
    base = _BYTE_VALUES.astype(wide, copy=False)[packed].reshape(-1)[:numel]
    out = block_scale(base, scales.astype(wide, copy=False), block, base)
    if dtype == "F64":
        return out.reshape(shape)
    return narrow_f32(out, dtype).reshape(shape)


CODEC: Final = Codec("tern", frozenset({"block", "seed"}), encode, decode)
