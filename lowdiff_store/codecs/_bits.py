"""The lossless bit codecs: ``raw`` (the elements as stored) and ``xor`` (bits ^ ref bits).

The one module with two codecs (they share their helpers): it exports ``RAW`` and ``XOR``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from ._core import (
    UNSIGNED_TAG,
    Checks,
    Codec,
    Encoded,
    NDArray,
    Part,
    check_bool_bytes,
    check_ref,
    part_array,
    unsigned_view,
)

_RAW: Final = Checks("raw")
_XOR: Final = Checks("xor")


def encode_raw(array: NDArray, dtype: str) -> Encoded:
    """One part: the elements in C order. A view of ``array`` when it is contiguous."""
    return Encoded("raw", {}, (Part(dtype, np.ascontiguousarray(array).reshape(-1)),))


def decode_raw(
    params: Mapping[str, Any],
    parts: Sequence[Any],
    dtype: str,
    shape: tuple[int, ...],
    numel: int,
) -> NDArray:
    """A reshape of the part: zero-copy (and read-only if the part is)."""
    _RAW.params(params)
    data = part_array(_RAW.parts(parts)[0], dtype, numel, "raw part 0")
    if dtype == "BOOL":
        check_bool_bytes(data, "raw part 0")
    return data.reshape(shape)


def encode_xor(array: NDArray, dtype: str, ref: object) -> Encoded:
    """One part: the bit patterns of ``array`` XOR those of ``ref``, as unsigned ints."""
    base = check_ref(ref, dtype, array.shape)
    bits = np.bitwise_xor(unsigned_view(array), unsigned_view(base), order="C")
    return Encoded("xor", {}, (Part(UNSIGNED_TAG[array.dtype.itemsize], bits.reshape(-1)),))


def decode_xor(
    params: Mapping[str, Any],
    parts: Sequence[Any],
    dtype: str,
    shape: tuple[int, ...],
    numel: int,
    ref: object,
) -> NDArray:
    """``ref`` bits XOR the stored bits, seen as ``dtype``: a new array."""
    _XOR.params(params)
    base = check_ref(ref, dtype, shape)
    tag = UNSIGNED_TAG[base.dtype.itemsize]
    bits = part_array(_XOR.parts(parts)[0], tag, numel, "xor part 0")
    # np.asarray: for 0-d inputs numpy ufuncs return a scalar, not a 0-d array
    out = np.asarray(np.bitwise_xor(unsigned_view(base), bits.reshape(shape), order="C")
                     ).view(base.dtype)
    if dtype == "BOOL":
        check_bool_bytes(out, "xor result")
    return out


RAW: Final = Codec("raw", frozenset(), encode_raw, decode_raw)
XOR: Final = Codec("xor", frozenset(), encode_xor, decode_xor, ref=True)
