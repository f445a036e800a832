"""The ``lowrank`` codec: float32 factors P (n x r) and Q (m x r) with tensor ~ P @ Q.T.

A tensor of shape ``(n, *rest)`` is the matrix ``(n, prod(rest))``; a 0-d tensor is 1 x 1.
Decode is one float32 matrix product (BLAS): deterministic on one machine, but the
summation order, hence the last bits, may differ across BLAS builds and CPUs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from ..errors import Reason
from ..format.dtypes import f32_to_bf16
from ._core import (
    ARITH_FLOAT_TAGS,
    F32_MAX,
    INT32_MAX,
    Checks,
    Codec,
    Encoded,
    NDArray,
    Part,
    alloc,
    check_shape,
    fail,
    part_array,
    storage_dtype_of,
    widen_float,
)

MAX_FACTOR_RANK: Final = INT32_MAX
_CHECK: Final = Checks("lowrank", frozenset({"rank"}), nparts=2, dtypes=ARITH_FLOAT_TAGS)


def matrix_dims(shape: tuple[int, ...]) -> tuple[int, int]:
    """(n, m): the tensor seen as a matrix of its first dimension by the rest."""
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def _pack(p: NDArray, q: NDArray) -> Encoded:
    parts = (
        Part("F32", np.ascontiguousarray(p, np.float32).reshape(-1)),
        Part("F32", np.ascontiguousarray(q, np.float32).reshape(-1)),
    )
    return Encoded("lowrank", {"rank": int(p.shape[1])}, parts)


def encode(array: NDArray, dtype: str, *, rank: int) -> Encoded:
    """Truncated SVD: the best rank-``min(rank, n, m)`` approximation, as P = U S, Q = V.

    Costs a full thin SVD of the matrix; PowerSGD users pass their factors to
    :func:`encode_factors` instead. Non-finite input raises ``invalid_argument``.
    """
    _CHECK.require_dtype(dtype)
    rank = _CHECK.int_option("rank", rank, 0, MAX_FACTOR_RANK)
    n, m = matrix_dims(array.shape)
    a = widen_float(array.reshape(-1), dtype).reshape(n, m)
    if not bool(np.all(np.isfinite(a))):
        fail(Reason.INVALID_ARGUMENT, "lowrank input must be finite")
    r = min(rank, n, m)
    if r == 0:
        return _pack(np.zeros((n, 0), np.float32), np.zeros((m, 0), np.float32))
    # a finite matrix can have singular values (and so P = U S) past float32's range: the
    # factors would be stored as inf and decode to inf/NaN, so that is refused
    with np.errstate(over="ignore", invalid="ignore"):
        try:
            u, s, vt = np.linalg.svd(a, full_matrices=False)
        except np.linalg.LinAlgError as e:
            fail(Reason.INVALID_ARGUMENT, f"lowrank SVD failed: {e}")
        p = np.ascontiguousarray(u[:, :r] * s[:r], np.float32)
        q = np.ascontiguousarray(vt[:r].T, np.float32)
    if not (bool(np.all(np.isfinite(p))) and bool(np.all(np.isfinite(q)))):
        fail(Reason.INVALID_ARGUMENT, f"lowrank factors overflow float32: a singular value "
                                      f"of this matrix is not below {F32_MAX:.9g}")
    return _pack(p, q)


def _factor(f: object, name: str, rows: int) -> NDArray:
    if not isinstance(f, np.ndarray) or f.dtype != np.float32:
        fail(Reason.BAD_DTYPE, f"lowrank factor {name} must be a float32 numpy array")
    if f.ndim != 2 or f.shape[0] != rows:
        fail(Reason.INVALID_ARGUMENT, f"lowrank factor {name} is {f.shape}, needs ({rows}, r)")
    return f


def encode_factors(p: object, q: object, dtype: str, shape: object) -> Encoded:
    """See :func:`lowdiff_store.codecs.encode_factors`."""
    _CHECK.require_dtype(dtype)
    dims, _ = check_shape(shape, storage_dtype_of(dtype).itemsize)
    n, m = matrix_dims(dims)
    pf, qf = _factor(p, "p", n), _factor(q, "q", m)
    if pf.shape[1] != qf.shape[1]:
        fail(Reason.INVALID_ARGUMENT, f"lowrank factors have ranks {pf.shape[1]} and {qf.shape[1]}")
    return _pack(pf, qf)


def decode(
    params: Mapping[str, Any],
    parts: Sequence[Any],
    dtype: str,
    shape: tuple[int, ...],
    numel: int,
) -> NDArray:
    """``P @ Q.T`` in float32 into a new array, then cast to ``dtype`` (RNE)."""
    _CHECK.require_dtype(dtype)
    _CHECK.params(params)
    r = _CHECK.int_param(params, "rank", 0, MAX_FACTOR_RANK)
    _CHECK.parts(parts)
    n, m = matrix_dims(shape)
    p = part_array(parts[0], "F32", n * r, "lowrank part 0 (P)").reshape(n, r)
    q = part_array(parts[1], "F32", m * r, "lowrank part 1 (Q)").reshape(m, r)
    out = alloc((n, m), np.float32, zero=False)
    # Stored factors may hold inf/NaN (or overflow, or exceed F16): the result is then what
    # IEEE arithmetic and the casts give, without numpy's warnings.
    with np.errstate(all="ignore"):
        np.matmul(p, q.T, out=out)
        if dtype == "F16":
            return out.astype(np.float16).reshape(shape)
    if dtype == "F64":
        return out.astype(np.float64).reshape(shape)
    if dtype == "BF16":
        return f32_to_bf16(out).reshape(shape)
    return out.reshape(shape)


CODEC: Final = Codec("lowrank", frozenset({"rank"}), encode, decode,
                     required=frozenset({"rank"}))
