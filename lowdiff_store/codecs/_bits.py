"""The lossless bit codecs: ``raw`` (the elements as stored) and ``xor`` (bits ^ ref bits)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._core import (
    UNSIGNED_TAG,
    Encoded,
    NDArray,
    Part,
    check_bool_bytes,
    check_params,
    check_parts,
    check_ref,
    part_array,
    unsigned_view,
)

_NO_PARAMS: frozenset[str] = frozenset()


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
    check_params(params, "raw", _NO_PARAMS)
    data = part_array(check_parts(parts, 1, "raw")[0], dtype, numel, "raw part 0")
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
    check_params(params, "xor", _NO_PARAMS)
    base = check_ref(ref, dtype, shape)
    tag = UNSIGNED_TAG[base.dtype.itemsize]
    bits = part_array(check_parts(parts, 1, "xor")[0], tag, numel, "xor part 0")
    # np.asarray: for 0-d inputs numpy ufuncs return a scalar, not a 0-d array
    out = np.asarray(np.bitwise_xor(unsigned_view(base), bits.reshape(shape), order="C")
                     ).view(base.dtype)
    if dtype == "BOOL":
        check_bool_bytes(out, "xor result")
    return out
