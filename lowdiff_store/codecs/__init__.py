"""Layer 2: array codecs with an exact-decode contract (numpy only; never imports torch).

A codec turns one tensor into an :class:`Encoded`: the codec name, msgpack-able params and
one or more :class:`Part` buffers. :func:`decode` is a pure function of those (plus ``ref``
for ``xor``). A second, optional stage, :func:`compress` / :func:`decompress`, turns one
part into a zstd frame and back. The normative description is ``format_spec/codecs.md``.

========  ===========================  ==========================================
codec     exactness                    dtypes
========  ===========================  ==========================================
raw       lossless                     all
sparse    lossless (lossy with ``k``)  all
sparse_ec lossless (lossy with ``k``)  all
xor       lossless, against ``ref``    all
q8        lossy, deterministic         F64, F32, F16, BF16
lowrank   lossy, BLAS-dependent bits   F64, F32, F16, BF16
tern      lossy, deterministic decode  F64, F32, F16, BF16
qsgd      lossy, deterministic decode  F64, F32, F16, BF16
sign      lossy, deterministic decode  F64, F32, F16, BF16
lcc       lossy, deterministic decode  F64, F32, F16, BF16
========  ===========================  ==========================================

Arrays are given and returned in the *storage* dtype of their tag
(``lowdiff_store.format.dtypes.storage_dtype``): uint16 bit patterns for BF16, uint8 for
F8. Every failure, on any input, is a :class:`~lowdiff_store.errors.CodecError` whose
``reason`` the spec's validation table names.

:func:`encode` and :func:`decode` dispatch through ``REGISTRY``. Each codec module exports
one ``Codec`` (``CODEC``; ``_bits`` exports ``RAW`` and ``XOR``) and checks its stored
params and parts with one ``Checks``. Adding a codec is one new module, imported here and
listed in ``REGISTRY``, after its stored form is a new section of ``format_spec/codecs.md``
(a new name is the only way to extend the format).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from ..errors import Reason
from . import _lcc, _lowrank, _q8, _qsgd, _sign, _sparse, _sparse_ec, _tern
from ._bits import RAW, XOR
from ._core import Codec, Encoded, NDArray, Part, check_array, check_shape, fail, storage_dtype_of
from ._zstd import compress as _compress
from ._zstd import decompress as _decompress

#: Every codec, by the name a record carries; each module exports its :class:`Codec`.
REGISTRY: Final[Mapping[str, Codec]] = {c.name: c for c in (
    RAW,
    _sparse.CODEC,
    XOR,
    _q8.CODEC,
    _lowrank.CODEC,
    _tern.CODEC,
    _qsgd.CODEC,
    _sign.CODEC,
    _sparse_ec.CODEC,
    _lcc.CODEC,
)}

#: The codec names a record may carry. Anything else is ``unknown_codec``.
CODECS: Final[frozenset[str]] = frozenset(REGISTRY)

#: The codecs that take a ``ref``, as the misuse message names them.
_REF_TAKERS: Final = " or ".join(repr(c.name) for c in REGISTRY.values() if c.ref)


def _codec(codec: object) -> Codec:
    c = REGISTRY.get(codec) if isinstance(codec, str) else None
    if c is None:
        fail(Reason.UNKNOWN_CODEC, f"unknown codec {codec!r} (known: {sorted(CODECS)})")
    return c


def _check_ref_use(c: Codec, ref: object) -> None:
    if ref is not None and not c.ref:
        fail(Reason.INVALID_ARGUMENT, f"codec {c.name!r} takes no ref (only {_REF_TAKERS} does)")


def encode(
    codec: str,
    array: NDArray,
    dtype: str,
    *,
    ref: NDArray | None = None,
    **options: Any,
) -> Encoded:
    """Encode ``array`` (storage dtype of ``dtype``, any shape) with ``codec``.

    Options: ``sparse``: ``delta`` (bool, default True), ``k`` (keep the k largest
    magnitudes; default: every non-zero bit pattern); ``q8``: ``block`` (default 256);
    ``lowrank``: ``rank`` (required); ``tern``: ``block`` (default: the whole tensor),
    ``seed`` (stochastic rounding; default nearest); ``qsgd``: ``levels`` (required),
    ``bucket`` (default: the whole tensor), ``seed``; ``sign``: ``scale`` (bool, default
    True: store mean |x|); ``sparse_ec``: ``k``, ``coding`` (``"auto"``: the smaller of
    ``"rice"`` and ``"ef"``), ``narrow`` (default True: store F32 values as BF16 or F16 when
    exact); ``lcc``: ``bits`` (default 3: 7 buckets), ``chunk`` (symbols per independently
    decodable chunk; default from the size). ``xor`` needs ``ref``, the
    reconstruction of the previous state, same shape and dtype; no other codec takes one.

    Parts may share memory with ``array`` (``raw`` of a contiguous array is a view): the
    caller must not modify ``array`` until the parts are written.
    """
    c = _codec(codec)
    arr = check_array(array, dtype)
    if options and not options.keys() <= c.options:
        unknown = sorted(options.keys() - c.options)
        fail(Reason.BAD_CODEC_PARAMS, f"codec {c.name!r} has no option(s) {unknown}")
    _check_ref_use(c, ref)
    if c.required and not options.keys() >= c.required:
        missing = ", ".join(sorted(c.required - options.keys()))
        fail(Reason.BAD_CODEC_PARAMS, f"codec {c.name!r} needs the option {missing}")
    if c.ref:
        return c.encode(arr, dtype, ref, **options)
    return c.encode(arr, dtype, **options)


def decode(
    codec: str,
    params: Mapping[str, Any],
    parts: Sequence[NDArray],
    dtype: str,
    shape: tuple[int, ...],
    *,
    ref: NDArray | None = None,
) -> NDArray:
    """Decode stored parts into an array of ``storage_dtype(dtype)`` and ``shape``.

    ``parts`` are 1-D arrays in the spec's order, each of its part's dtype (a 1-D uint8
    array is taken as that part's bytes; a :class:`Part` stands for its data). They may be
    read-only views of an mmap and are never written. ``raw`` returns a view of its part
    (read-only if the part is); every other codec returns a new array. Every param, part
    count, part dtype and part size is checked against ``shape`` and ``dtype`` before any
    output is allocated; failures raise ``CodecError``.
    """
    c = _codec(codec)
    dims, numel = check_shape(shape, storage_dtype_of(dtype).itemsize)
    _check_ref_use(c, ref)
    if c.ref:
        return c.decode(params, parts, dtype, dims, numel, ref)
    return c.decode(params, parts, dtype, dims, numel)


def encode_sparse(
    indices: NDArray,
    values: NDArray,
    numel: int,
    dtype: str,
    *,
    delta: bool = True,
    coding: str | None = None,
    narrow: bool = True,
) -> Encoded:
    """Store a precomputed sparse tensor (a top-k gradient) without re-running top-k.

    ``indices`` (any integer dtype) are flat C-order positions in ``[0, numel)``, unique,
    in any order; ``values`` (storage dtype of ``dtype``) match them one to one. With
    ``delta`` the pairs are sorted by index (values permuted alike) and the indices stored
    as first index + gaps. int32 indices already in the stored form are not copied.

    With ``coding`` (``"rice"``, ``"ef"`` or ``"auto"``, the smaller) the result is a
    ``sparse_ec`` tensor instead: pairs sorted, indices entropy coded (about 1 byte per entry
    at 1% density), F32 values stored as BF16/F16 when ``narrow`` and that is exact.
    """
    if coding is not None:
        if not delta:
            fail(Reason.INVALID_ARGUMENT, "sparse_ec always sorts: coding needs delta=True")
        return _sparse_ec.encode_pairs(indices, values, numel, dtype, coding=coding,
                                       narrow=narrow)
    return _sparse.encode_sparse(indices, values, numel, dtype, delta=delta)


def sparse_index_tag(numel: int) -> str:
    """The index dtype tag (``"I32"`` or ``"I64"``) that the ``sparse`` codec stores for a
    tensor of ``numel`` elements (``I32`` up to ``2**31 - 1`` elements)."""
    return _sparse.index_tag(numel)


def sparse_entries(
    params: Mapping[str, Any],
    parts: Sequence[NDArray],
    numel: int,
    *,
    codec: str = "sparse",
    dtype: str | None = None,
) -> tuple[NDArray, NDArray]:
    """The validated entries of a stored ``sparse`` or ``sparse_ec`` tensor, not densified.

    Returns ``(indices, values)``: int64 flat indices (ascending when stored with delta;
    always for ``sparse_ec``) and the values: for ``sparse`` the part as given (its own
    dtype; may be a read-only view), for ``sparse_ec`` in the storage dtype of ``dtype``
    (required there; narrowed values are widened). Applies every check :func:`decode`
    applies to the indices.
    """
    if codec == "sparse_ec":
        if dtype is None:
            fail(Reason.INVALID_ARGUMENT, "sparse_entries of sparse_ec needs dtype")
        storage_dtype_of(dtype)
        return _sparse_ec.entries(params, parts, dtype, numel)
    if codec != "sparse":
        fail(Reason.UNKNOWN_CODEC, f"sparse_entries reads sparse or sparse_ec, not {codec!r}")
    return _sparse.entries(params, parts, numel)


def encode_factors(p: NDArray, q: NDArray, dtype: str, shape: tuple[int, ...]) -> Encoded:
    """Store precomputed low-rank factors (PowerSGD's P and Q) as a ``lowrank`` tensor.

    ``p`` is (n, r), ``q`` is (m, r), both float32, for a tensor of ``shape`` seen as the
    (n, m) matrix ``(shape[0], prod(shape[1:]))`` (a 0-d tensor is 1 x 1). Stored as given.
    """
    return _lowrank.encode_factors(p, q, dtype, shape)


def encode_ternary(codes: NDArray, scales: NDArray, dtype: str, *, block: int) -> Encoded:
    """Store a precomputed ternary message (TernGrad) as a ``tern`` tensor.

    ``codes``: integers in {-1, 0, 1}, the tensor's shape; ``scales``: float32, finite,
    >= 0, one per block of ``block`` elements in C order (``ceil(numel / block)``; a
    ``block >= numel`` gives one scale for the tensor). Decodes to ``code * scale``.
    """
    return _tern.encode_codes(codes, scales, dtype, block=block)


def encode_qsgd(
    signed_levels: NDArray, norms: NDArray, dtype: str, *, levels: int, bucket: int
) -> Encoded:
    """Store a precomputed QSGD message as a ``qsgd`` tensor.

    ``signed_levels``: integers ``sign * level`` in ``[-levels, levels]``, the tensor's
    shape; ``norms``: float32, finite, >= 0, one per bucket of ``bucket`` elements in C order.
    Decodes to ``sign * fl32(norm * level / levels)``. 1 <= ``levels`` <= 65535.
    """
    return _qsgd.encode_levels(signed_levels, norms, dtype, levels=levels, bucket=bucket)


def encode_signs(negative: NDArray, dtype: str, *, scale: float | None = None) -> Encoded:
    """Store a precomputed sign message (DeMo's applied update) as a ``sign`` tensor.

    ``negative``: bool array of the tensor's shape (True: -scale). ``scale``: finite,
    >= 0, stored as float32 (rounded to nearest); ``None`` stores none and decodes to +-1.
    """
    return _sign.encode_signs(negative, dtype, scale=scale)


def compress(
    data: NDArray, *, level: int = 3, shuffle: bool = True
) -> tuple[bytes, dict[str, Any]]:
    """Compress one part into a zstd frame that declares its content size.

    With ``shuffle`` (ignored for 1-byte elements) byte k of every element is written
    together before compressing. Returns the frame and the params that
    :func:`decompress` needs (``compressor``, ``shuffle``). ``level`` is zstd's, -2**17..22.
    """
    return _compress(data, level=level, shuffle=shuffle)


def decompress(
    blob: bytes | memoryview | NDArray,
    params: Mapping[str, Any],
    *,
    dtype: str,
    count: int,
) -> NDArray:
    """Decompress one zstd frame into ``count`` elements of ``storage_dtype(dtype)``.

    The frame must declare a content size of exactly ``count * itemsize``; that is
    checked before anything is allocated (a zstd bomb is ``decode_size_mismatch``), and
    nothing larger is ever allocated. Trailing bytes or extra frames are refused. The
    result may be read-only.
    """
    return _decompress(blob, params, dtype=dtype, count=count)


__all__ = [
    "CODECS",
    "Encoded",
    "Part",
    "compress",
    "decode",
    "decompress",
    "encode",
    "encode_factors",
    "encode_qsgd",
    "encode_signs",
    "encode_sparse",
    "encode_ternary",
    "sparse_entries",
    "sparse_index_tag",
]
