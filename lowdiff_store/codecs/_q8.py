"""The ``q8`` codec: int8 values with one float32 scale per block of ``block`` elements.

Encode (x widened exactly to float32, or float64 for F64)::

    scale_b = the least float32 s with 127 * s >= max |x| over block b   (0 for a zero block)
    q_i     = rint(x_i / scale_b)            # float64 quotient, ties to even, |q_i| <= 127

Decode: ``fl32(q_i * scale_b)`` (float64 for F64), then one RNE narrowing to F16 or BF16.
For F32, F16 and BF16 inputs the float64 quotient rounds exactly like the real quotient,
so ``|x - q * scale| <= scale / 2`` holds exactly; see ``format_spec/codecs.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from ..errors import Reason
from ..format.dtypes import f32_to_bf16
from ._core import (
    ARITH_FLOAT_TAGS,
    INT32_MAX,
    Checks,
    Codec,
    Encoded,
    NDArray,
    Part,
    alloc,
    block_steps,
    fail,
    part_array,
    widen_float,
)

#: Elements per block when the caller gives no ``block``.
DEFAULT_BLOCK: Final = 256
MAX_BLOCK: Final = INT32_MAX
#: The encoder refuses |x| >= 2**127, so scales stay below 2**121 and q * scale below the
#: float32 maximum; the reader refuses any scale outside [0, 2**121].
MAX_ABS: Final = 2.0**127
MAX_SCALE: Final = 2.0**121
_CHECK: Final = Checks("q8", frozenset({"block"}), nparts=2, dtypes=ARITH_FLOAT_TAGS)


def encode(array: NDArray, dtype: str, *, block: int = DEFAULT_BLOCK) -> Encoded:
    """Quantize; raises ``invalid_argument`` for NaN, infinities or ``|x| >= 2**127``."""
    _CHECK.require_dtype(dtype)
    block = _CHECK.int_option("block", block, 1, MAX_BLOCK)
    x = widen_float(array.reshape(-1), dtype)
    n = x.size
    if n:
        amax = np.maximum.reduceat(np.abs(x), np.arange(0, n, block)).astype(np.float64)
    else:
        amax = np.empty(0, np.float64)
    if not bool(np.all(amax < MAX_ABS)):
        fail(Reason.INVALID_ARGUMENT, "q8 input must be finite with |x| < 2**127")
    scales = (amax / 127.0).astype(np.float32)
    low = scales.astype(np.float64) * 127.0 < amax  # exact product: round the scale up
    if low.any():
        scales[low] = np.nextafter(scales[low], np.float32(np.inf))
    divisor = np.where(scales == 0, np.float32(1), scales).astype(np.float64)
    q = np.empty(n, np.int8)
    for e0, e1, b0, b1 in block_steps(n, block):
        t = np.divide(x[e0:e1].reshape(b1 - b0, -1), divisor[b0:b1, None])
        np.rint(t, out=t)
        q[e0:e1] = t.reshape(-1)
    return Encoded("q8", {"block": block}, (Part("I8", q), Part("F32", scales)))


def decode(
    params: Mapping[str, Any],
    parts: Sequence[Any],
    dtype: str,
    shape: tuple[int, ...],
    numel: int,
) -> NDArray:
    """Dequantize into a new array; a pure function of the parts (bit-reproducible)."""
    _CHECK.require_dtype(dtype)
    _CHECK.params(params)
    block = _CHECK.int_param(params, "block", 1, MAX_BLOCK)
    _CHECK.parts(parts)
    q = part_array(parts[0], "I8", numel, "q8 part 0 (values)")
    scales = part_array(parts[1], "F32", -(-numel // block), "q8 part 1 (scales)")
    if not bool(np.all((scales >= 0) & (scales <= MAX_SCALE))):  # NaN fails both
        fail(Reason.BAD_CODEC_PARAMS, f"q8 scales must lie in [0, {MAX_SCALE}]")
    wide = np.float64 if dtype == "F64" else np.float32
    s = scales.astype(wide)
    out = alloc(numel, wide, zero=False)
    for e0, e1, b0, b1 in block_steps(numel, block):
        rows = b1 - b0
        np.multiply(q[e0:e1].reshape(rows, -1), s[b0:b1, None], out=out[e0:e1].reshape(rows, -1))
    if dtype == "F16":
        with np.errstate(over="ignore"):  # a hostile scale may overflow F16: inf, as cast
            return out.astype(np.float16).reshape(shape)
    if dtype == "BF16":
        return f32_to_bf16(out).reshape(shape)
    return out.reshape(shape)


CODEC: Final = Codec("q8", frozenset({"block"}), encode, decode)
