"""The ``sign`` codec: one bit per element (1 = negative) and an optional float32 scale.

DeMo's applied update is ``sign(u)``; signSGD-style messages carry a scale. Decode is
``+scale`` or ``-scale`` (``+1`` / ``-1`` without a scale): zeros are not representable,
a message with zeros is a ``tern`` message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from ..errors import Reason
from ._core import (
    ARITH_FLOAT_TAGS,
    F32_MAX,
    Checks,
    Codec,
    Encoded,
    NDArray,
    Part,
    check_scales,
    check_shape,
    fail,
    narrow_f32,
    part_array,
    storage_dtype_of,
    widen_float,
)
from ._pack import pack_bits, packed_size

_CHECK: Final = Checks("sign", frozenset({"scaled"}), nparts=2, dtypes=ARITH_FLOAT_TAGS)
#: byte -> its eight bits, LSB first
_BYTE_BITS: Final = ((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1).astype(np.bool_)


def _pack(negative: NDArray, scale: float | None) -> Encoded:
    bits = pack_bits(negative.reshape(-1), 1)
    scales = np.zeros(0 if scale is None else 1, np.float32)
    if scale is not None:
        scales[0] = scale
        check_scales(scales, "sign scale")
    return Encoded("sign", {"scaled": scale is not None}, (Part("U8", bits), Part("F32", scales)))


def encode(array: NDArray, dtype: str, *, scale: bool = True) -> Encoded:
    """Signs of ``array`` (the IEEE sign bit: ``-0.0`` is negative) and, with ``scale``, the
    mean of ``|x|`` (computed in float64, rounded to float32). Non-finite input is refused."""
    _CHECK.require_dtype(dtype)
    scale = _CHECK.bool_option("scale", scale)
    x = widen_float(array.reshape(-1), dtype)
    _CHECK.finite(x)
    s = None
    if scale:
        with np.errstate(over="ignore"):  # F64: a sum past float64's range is past F32_MAX
            s = float(np.abs(x).mean(dtype=np.float64)) if x.size else 0.0
            if not np.isfinite(np.float32(s)):
                fail(Reason.INVALID_ARGUMENT, f"sign scale (mean |x| = {s:.9g}) must round "
                                              f"to a float32 (at most {F32_MAX:.9g})")
    return _pack(np.signbit(x), s)


def encode_signs(negative: object, dtype: str, *, scale: float | None = None) -> Encoded:
    """See :func:`lowdiff_store.codecs.encode_signs`."""
    _CHECK.require_dtype(dtype)
    if not isinstance(negative, np.ndarray) or negative.dtype != np.bool_:
        fail(Reason.BAD_DTYPE, "sign: negative must be a numpy bool array")
    check_shape(negative.shape, storage_dtype_of(dtype).itemsize)
    if scale is not None and (not isinstance(scale, (float, int, np.floating, np.integer))
                              or isinstance(scale, (bool, np.bool_))):
        fail(Reason.INVALID_ARGUMENT, f"sign scale={scale!r} is not a number")
    return _pack(negative, None if scale is None else float(scale))


def decode(
    params: Mapping[str, Any],
    parts: Sequence[Any],
    dtype: str,
    shape: tuple[int, ...],
    numel: int,
) -> NDArray:
    """``-scale`` where the bit is 1, ``+scale`` where it is 0 (scale 1 when unscaled)."""
    _CHECK.require_dtype(dtype)
    _CHECK.params(params)
    scaled = _CHECK.bool_param(params, "scaled")
    _CHECK.parts(parts)
    packed = part_array(parts[0], "U8", packed_size(numel, 1), "sign part 0 (bits)")
    scales = part_array(parts[1], "F32", 1 if scaled else 0, "sign part 1 (scale)")
    check_scales(scales, "sign scale")
    tail = numel % 8
    if tail and int(packed[-1]) >> tail:
        fail(Reason.BAD_CODEC_PARAMS, "sign part 0 (bits): padding bits are not zero")
    wide = np.float64 if dtype == "F64" else np.float32
    s = scales.astype(wide)[0] if scaled else wide(1.0)
    # one gather of eight values per stored byte
    table = np.where(_BYTE_BITS, -s, s).astype(wide)
    out: NDArray = table[packed].reshape(-1)[:numel]
    if dtype == "F64":
        return out.reshape(shape)
    return narrow_f32(out, dtype).reshape(shape)


CODEC: Final = Codec("sign", frozenset({"scale"}), encode, decode)
