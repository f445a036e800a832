"""The ``sparse`` codec: unique flat indices plus the values at them; the rest is zero.

Indices are int32 when ``numel <= 2**31 - 1``, else int64. With ``delta`` they are sorted
ascending and stored as the first index followed by the gaps (all >= 1), which makes them
small and well compressible; the values are permuted to match.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from ..errors import Reason
from ..format.dtypes import STORAGE_DTYPE, bf16_to_f32
from ._core import (
    INT32_MAX,
    MAX_NUMEL,
    Checks,
    Codec,
    Encoded,
    NDArray,
    Part,
    alloc,
    as_array,
    check_array,
    check_bool_bytes,
    fail,
    is_int,
    part_array,
    unsigned_view,
)

_CHECK: Final = Checks("sparse", frozenset({"count", "index_dtype", "delta"}), nparts=2)
_INDEX_TAGS: Final = ("I32", "I64")
_STORAGE_DTYPES: Final = frozenset(STORAGE_DTYPE.values())


def index_tag(numel: int) -> str:
    """The index dtype the writer must use for a tensor of ``numel`` elements."""
    return "I32" if numel <= INT32_MAX else "I64"


def _strictly_ascending(idx: NDArray) -> bool:
    return idx.size < 2 or bool(np.all(idx[1:] > idx[:-1]))


def _pack(idx: NDArray, values: NDArray, numel: int, dtype: str, delta: bool) -> Encoded:
    """Store validated indices (unique, in range; sorted when ``delta``) and their values."""
    tag = index_tag(numel)
    itype = STORAGE_DTYPE[tag]
    if delta and idx.size:
        # The gaps of sorted indices below numel fit the index dtype: cast while subtracting.
        stored = np.empty(idx.size, itype)
        stored[0] = idx[0]
        np.subtract(idx[1:], idx[:-1], out=stored[1:], casting="unsafe")
    else:
        stored = np.ascontiguousarray(idx.astype(itype, copy=False))
    params = {"count": int(idx.size), "index_dtype": tag, "delta": bool(delta)}
    parts = (Part(tag, stored), Part(dtype, np.ascontiguousarray(values)))
    return Encoded("sparse", params, parts)


def _magnitude(flat: NDArray, dtype: str) -> NDArray:
    """What top-k ranks by: |value| (NaN ranks above everything, as numpy sorts it)."""
    if dtype in ("F8_E4M3", "F8_E5M2"):
        fail(Reason.BAD_DTYPE, f"sparse top-k has no magnitude for {dtype}")
    mag: NDArray
    if dtype == "BF16":
        mag = np.abs(bf16_to_f32(flat))
    elif dtype in ("F64", "F32", "F16"):
        mag = np.abs(flat)
    elif dtype.startswith("I"):
        mag = np.abs(flat.astype(np.float64))  # no overflow at the most negative int
    else:
        mag = flat  # unsigned, BOOL
    return mag


def select(array: NDArray, dtype: str, k: int | None) -> NDArray:
    """Ascending flat indices a dense encoding keeps: every non-zero bit pattern, or the
    ``k`` largest magnitudes."""
    flat = array.reshape(-1)
    numel = flat.size
    if k is None:
        return np.flatnonzero(unsigned_view(flat))
    k = _CHECK.int_option("k", k, 0, numel)
    mag = _magnitude(flat, dtype)
    return np.sort(np.argpartition(mag, numel - k)[numel - k :]) if k else np.empty(0, np.intp)


def encode_dense(
    array: NDArray, dtype: str, *, delta: bool = True, k: int | None = None
) -> Encoded:
    """Sparse encoding of a dense tensor.

    Without ``k`` every element whose bit pattern is non-zero is kept (lossless: ``-0.0`` and
    NaNs stay). With ``k`` only the ``k`` largest magnitudes are kept (lossy top-k); ties are
    broken by numpy's selection, deterministically for a given numpy build.
    """
    delta = _CHECK.bool_option("delta", delta)
    flat = array.reshape(-1)
    idx = select(array, dtype, k)
    return _pack(idx, flat[idx], flat.size, dtype, delta)


def prepare(
    indices: object, values: object, numel: Any, dtype: str, *, sort: bool
) -> tuple[NDArray, NDArray, int]:
    """Validate precomputed pairs: (indices, values, numel), the pairs sorted by index when
    ``sort`` (else in the caller's order, proven unique)."""
    if not is_int(numel) or not 0 <= numel <= MAX_NUMEL:
        fail(Reason.INVALID_ARGUMENT, f"numel={numel!r} is not a non-negative int")
    n = int(numel)
    vals = check_array(values, dtype, "values").reshape(-1)
    if not isinstance(indices, np.ndarray) or indices.dtype.kind not in "iu":
        fail(Reason.BAD_DTYPE, "indices must be a numpy integer array")
    idx = indices.reshape(-1)
    if idx.size != vals.size:
        fail(Reason.INVALID_ARGUMENT, f"{idx.size} indices for {vals.size} values")
    if idx.size:
        if (idx.dtype.kind == "i" and int(idx.min()) < 0) or int(idx.max()) >= n:
            fail(Reason.BAD_CODEC_PARAMS, f"sparse index out of range [0, {n})")
    if not _strictly_ascending(idx):
        if sort:
            order = np.argsort(idx, kind="stable")
            idx, vals = idx[order], vals[order]
            ascending = idx
        else:
            ascending = np.sort(idx)
        if not _strictly_ascending(ascending):
            fail(Reason.BAD_CODEC_PARAMS, "sparse indices are not unique")
    return idx, vals, n


def encode_sparse(
    indices: NDArray, values: NDArray, numel: int, dtype: str, *, delta: bool = True
) -> Encoded:
    """See :func:`lowdiff_store.codecs.encode_sparse`."""
    delta = _CHECK.bool_option("delta", delta)
    idx, vals, n = prepare(indices, values, numel, dtype, sort=delta)
    return _pack(idx, vals, n, dtype, delta)


def _header(params: Mapping[str, Any], numel: int) -> tuple[int, str, bool]:
    _CHECK.params(params)
    count = _CHECK.int_param(params, "count", 0, numel)
    return (
        count,
        _CHECK.choice_param(params, "index_dtype", _INDEX_TAGS),
        _CHECK.bool_param(params, "delta"),
    )


def _indices(stored: NDArray, delta: bool, numel: int) -> NDArray:
    """Validated flat indices (int64 for delta; the stored array otherwise, never written)."""
    if stored.size == 0:
        return stored.astype(np.int64)
    if delta:
        head = int(stored[0])
        if head < 0 or (stored.size > 1 and int(stored[1:].min()) < 1):
            fail(Reason.BAD_CODEC_PARAMS, "sparse delta indices must start >= 0 with gaps >= 1")
        if int(stored.max()) >= numel:
            fail(Reason.BAD_CODEC_PARAMS, f"sparse index out of range [0, {numel})")
        idx = np.cumsum(stored, dtype=np.int64)
        # Gaps >= 1 make idx strictly increasing unless the int64 sum wrapped, which needs
        # count * numel >= 2**63; only then is a full range check needed.
        if stored.size * numel < 2**63:
            in_range = int(idx[-1]) < numel
        else:
            in_range = int(idx.min()) >= 0 and int(idx.max()) < numel and _strictly_ascending(idx)
        if not in_range:
            fail(Reason.BAD_CODEC_PARAMS, f"sparse index out of range [0, {numel})")
        return idx
    if int(stored.min()) < 0 or int(stored.max()) >= numel:
        fail(Reason.BAD_CODEC_PARAMS, f"sparse index out of range [0, {numel})")
    if not _strictly_ascending(stored) and not _strictly_ascending(np.sort(stored)):
        fail(Reason.BAD_CODEC_PARAMS, "sparse indices are not unique")
    return stored


def decode(
    params: Mapping[str, Any],
    parts: Sequence[Any],
    dtype: str,
    shape: tuple[int, ...],
    numel: int,
) -> NDArray:
    """Zeros of ``shape``, then the stored values at the stored indices: a new array."""
    count, itag, delta = _header(params, numel)
    _CHECK.parts(parts)
    stored = part_array(parts[0], itag, count, "sparse part 0 (indices)")
    values = part_array(parts[1], dtype, count, "sparse part 1 (values)")
    if dtype == "BOOL":
        check_bool_bytes(values, "sparse part 1 (values)")
    idx = _indices(stored, delta, numel)
    out = alloc(numel, values.dtype, zero=True)
    out[idx] = values
    return out.reshape(shape)


def entries(params: Mapping[str, Any], parts: Sequence[Any], numel: int) -> tuple[NDArray, NDArray]:
    """See :func:`lowdiff_store.codecs.sparse_entries`."""
    if not is_int(numel) or not 0 <= numel <= MAX_NUMEL:
        fail(Reason.INVALID_ARGUMENT, f"numel={numel!r} is not a non-negative int")
    numel = int(numel)
    count, itag, delta = _header(params, numel)
    _CHECK.parts(parts)
    values = as_array(parts[1])
    if not isinstance(values, np.ndarray) or values.dtype not in _STORAGE_DTYPES:
        fail(Reason.BAD_DTYPE, "sparse part 1 (values) must be an array of a storage dtype")
    if values.ndim != 1:
        fail(Reason.BAD_CODEC_PARAMS, f"sparse part 1 (values) must be 1-D, got {values.shape}")
    if values.size != count:
        fail(Reason.DECODE_SIZE_MISMATCH, f"sparse part 1 (values) must hold {count} elements")
    if values.dtype == np.bool_:
        check_bool_bytes(values, "sparse part 1 (values)")
    stored = part_array(parts[0], itag, count, "sparse part 0 (indices)")
    return _indices(stored, delta, numel).astype(np.int64, copy=False), values


CODEC: Final = Codec("sparse", frozenset({"delta", "k"}), encode_dense, decode)
