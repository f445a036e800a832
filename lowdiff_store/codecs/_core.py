"""Containers and validation shared by every codec (see ``format_spec/codecs.md``).

Everything a codec reads from a file (params, parts, shape, dtype tag) goes through the
checks here before it is used, so each violation raises :class:`CodecError` with the reason
listed in the spec's "Validation" table, and no other exception type escapes a decoder.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import numpy as np
import numpy.typing as npt

from ..errors import CodecError, Reason
from ..format.dtypes import STORAGE_DTYPE, bf16_to_f32, f32_to_bf16

NDArray = npt.NDArray[Any]

#: Largest element count (and byte size) a shape may describe: numpy's own limit.
MAX_NUMEL: Final = 2**63 - 1
#: numpy's limit on the number of dimensions.
MAX_NDIM: Final = 64
#: Largest value of an int32 (sparse index width rule, ranges of int params).
INT32_MAX: Final = 2**31 - 1

#: Unsigned tag of each element width: xor parts and bit-pattern views use these.
UNSIGNED_TAG: Final[dict[int, str]] = {1: "U8", 2: "U16", 4: "U32", 8: "U64"}

#: Float dtypes with a numpy arithmetic path (F8 has none): the lossy codecs accept these.
ARITH_FLOAT_TAGS: Final = ("F64", "F32", "F16", "BF16")
#: The largest finite float32: float32 scales and norms hold at most this.
F32_MAX: Final = float(np.finfo(np.float32).max)


@dataclass(frozen=True, eq=False)
class Part:
    """One stored buffer of an encoded tensor.

    ``data`` is 1-D, C-contiguous, little-endian, of dtype ``storage_dtype(self.dtype)``.
    It may share memory with the array given to the encoder (``raw``, ``sparse`` values):
    the caller stages (copies) what must not change before it is written.
    """

    dtype: str
    data: NDArray

    def __post_init__(self) -> None:
        want = storage_dtype_of(self.dtype)
        d = self.data
        if (
            not isinstance(d, np.ndarray)
            or d.ndim != 1
            or d.dtype != want
            or not d.flags.c_contiguous
        ):
            fail(
                Reason.INVALID_ARGUMENT,
                f"part data must be a 1-D C-contiguous {want} array, got "
                f"{type(d).__name__} {getattr(d, 'dtype', None)} ndim={getattr(d, 'ndim', None)}",
            )

    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return int(self.data.nbytes)


@dataclass(frozen=True, eq=False)
class Encoded:
    """An encoded tensor: the codec name, its params and its parts, in the spec's order.

    ``params`` holds only msgpack-able values (str keys; int, float, str, bool or list
    values); the log layer stores it next to each part's dtype tag.
    """

    codec: str
    params: dict[str, Any]
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        """Total size of the parts in bytes (before any compression stage)."""
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True, slots=True)
class Codec:
    """One codec as :mod:`lowdiff_store.codecs` dispatches to it: each codec module exports
    its own (``CODEC``; ``_bits`` exports ``RAW`` and ``XOR``), the package's registry lists it.

    ``encode(array, dtype, **options)`` receives an array already checked to be of the
    storage dtype of ``dtype`` and only option names in ``options``, each of ``required``
    present; it checks their values. ``decode(params, parts, dtype, shape, numel)`` receives
    a checked shape and its element count; it checks everything else (:class:`Checks`).
    With ``ref`` (``xor``) ``encode`` takes the reference right after ``dtype`` and
    ``decode`` right after ``numel``; no other codec is ever given one.
    """

    name: str
    options: frozenset[str]
    encode: Callable[..., Encoded]
    decode: Callable[..., NDArray]
    required: frozenset[str] = frozenset()
    ref: bool = False


@dataclass(frozen=True, slots=True)
class Checks:
    """The checks one codec applies to its options (encode) and to its stored params and
    parts (decode). Every message starts with the codec's name, so that name is given once.

    ``keys``: the params a stored tensor carries (exactly these); ``nparts``: how many parts
    it has; ``dtypes``: the tensor dtypes the codec accepts (``None``: every dtype).
    """

    codec: str
    keys: frozenset[str] = frozenset()
    nparts: int = 1
    dtypes: tuple[str, ...] | None = None

    def require_dtype(self, tag: str) -> None:
        """The codec accepts the tensor dtype ``tag`` (else ``bad_dtype``)."""
        if self.dtypes is not None and tag not in self.dtypes:
            fail(Reason.BAD_DTYPE,
                 f"codec {self.codec!r} does not accept dtype {tag} ({self.dtypes})")

    def params(self, params: object) -> Mapping[str, Any]:
        """``params`` is a mapping with exactly ``keys`` (unknown keys are refused)."""
        if not isinstance(params, Mapping):
            fail(Reason.BAD_CODEC_PARAMS, f"{self.codec} params must be a mapping")
        if params.keys() != self.keys:  # a set comparison: no copy of the keys
            have = set(params)
            extra = sorted(map(repr, have - self.keys))
            missing = sorted(self.keys - have)
            fail(Reason.BAD_CODEC_PARAMS,
                 f"{self.codec} params: unknown {extra}, missing {missing}")
        return params

    def int_param(self, params: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
        """A stored int param in ``[lo, hi]``."""
        v = params[key]
        if not is_int(v) or not lo <= v <= hi:
            fail(Reason.BAD_CODEC_PARAMS,
                 f"{self.codec} param {key}={v!r} is not an int in [{lo}, {hi}]")
        return int(v)

    def bool_param(self, params: Mapping[str, Any], key: str) -> bool:
        """A stored bool param."""
        v = params[key]
        if not isinstance(v, (bool, np.bool_)):
            fail(Reason.BAD_CODEC_PARAMS, f"{self.codec} param {key}={v!r} is not a bool")
        return bool(v)

    def choice_param(self, params: Mapping[str, Any], key: str, choices: Sequence[str]) -> str:
        """A stored str param among ``choices``."""
        v = params[key]
        if not isinstance(v, str) or v not in choices:
            fail(Reason.BAD_CODEC_PARAMS,
                 f"{self.codec} param {key}={v!r} is not one of {choices}")
        return v

    def parts(self, parts: object) -> Sequence[Any]:
        """``parts`` is a sequence of exactly ``nparts`` items."""
        if not isinstance(parts, Sequence) or isinstance(parts, (str, bytes)):
            fail(Reason.BAD_CODEC_PARAMS, f"{self.codec} parts must be a sequence of arrays")
        if len(parts) != self.nparts:
            fail(Reason.BAD_CODEC_PARAMS,
                 f"{self.codec} has {self.nparts} parts, got {len(parts)}")
        return parts

    def int_option(self, key: str, v: Any, lo: int, hi: int) -> int:
        """An encode option that must be an int in ``[lo, hi]``."""
        if not is_int(v) or not lo <= v <= hi:
            fail(Reason.BAD_CODEC_PARAMS, f"{self.codec} {key}={v!r} is not an int in [{lo}, {hi}]")
        return int(v)

    def bool_option(self, key: str, v: Any) -> bool:
        """An encode option that must be a bool."""
        if not isinstance(v, (bool, np.bool_)):
            fail(Reason.BAD_CODEC_PARAMS, f"{self.codec} {key}={v!r} is not a bool")
        return bool(v)

    def seed_option(self, seed: Any) -> int | None:
        """The ``seed`` option of a stochastic rounding: ``None`` or an int."""
        if seed is not None and not is_int(seed):
            fail(Reason.BAD_CODEC_PARAMS, f"{self.codec} seed={seed!r} is not an int")
        return None if seed is None else int(seed)

    def finite(self, x: NDArray) -> None:
        """Lossy encoders refuse NaN and infinities (``invalid_argument``)."""
        if x.size and not bool(np.all(np.isfinite(x))):
            fail(Reason.INVALID_ARGUMENT, f"{self.codec} input must be finite")


def fail(reason: Reason, detail: str) -> NoReturn:
    """Raise :class:`CodecError` with ``reason``."""
    raise CodecError(detail, reason=reason)


def is_int(v: object) -> bool:
    """True for Python and numpy integers, False for bools (a bool is never a count)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def storage_dtype_of(tag: object) -> np.dtype[Any]:
    """``storage_dtype`` that raises ``CodecError(bad_dtype)`` for unknown or non-str tags."""
    if isinstance(tag, str):
        dt = STORAGE_DTYPE.get(tag)
        if dt is not None:
            return dt
    fail(Reason.BAD_DTYPE, f"unknown dtype tag {tag!r}")


def check_shape(shape: object, itemsize: int) -> tuple[tuple[int, ...], int]:
    """Validate a tensor shape; return it as a tuple of ints and its element count.

    numpy refuses shapes whose byte size (zero dimensions skipped) exceeds ``2**63 - 1``;
    those are ``limit_exceeded`` here rather than a ``ValueError`` later.
    """
    if not isinstance(shape, (tuple, list)):
        fail(Reason.BAD_CODEC_PARAMS, f"shape must be a tuple of ints, got {type(shape).__name__}")
    if len(shape) > MAX_NDIM:
        fail(Reason.BAD_CODEC_PARAMS, f"shape has {len(shape)} dimensions (at most {MAX_NDIM})")
    dims: list[int] = []
    for d in shape:
        if not is_int(d) or d < 0:
            fail(Reason.BAD_CODEC_PARAMS, f"shape {shape!r} has an invalid dimension {d!r}")
        dims.append(int(d))
    if math.prod(max(d, 1) for d in dims) * itemsize > MAX_NUMEL:
        fail(Reason.LIMIT_EXCEEDED, f"shape {tuple(dims)} is too large")
    return tuple(dims), math.prod(dims)


def check_array(array: object, tag: str, what: str = "array") -> NDArray:
    """An encoder input must be an ndarray (or numpy scalar) of ``storage_dtype(tag)``."""
    want = storage_dtype_of(tag)
    if isinstance(array, np.generic):
        array = np.asarray(array)
    if not isinstance(array, np.ndarray):
        fail(Reason.INVALID_ARGUMENT, f"{what} must be a numpy array, got {type(array).__name__}")
    if array.dtype != want:
        fail(Reason.BAD_DTYPE, f"{what} has dtype {array.dtype}; dtype {tag} is stored as {want}")
    return array


def check_ref(ref: object, tag: str, shape: tuple[int, ...]) -> NDArray:
    """The ``ref`` of xor: same storage dtype and shape as the tensor."""
    if ref is None:
        fail(Reason.INVALID_ARGUMENT, "codec 'xor' needs ref (the previous reconstruction)")
    arr = check_array(ref, tag, "ref")
    if arr.shape != shape:
        fail(Reason.INVALID_ARGUMENT, f"ref has shape {arr.shape}, tensor has {shape}")
    return arr


def as_array(part: object) -> object:
    """A :class:`Part` stands for its data, so ``decode(e.codec, e.params, e.parts, ...)`` works."""
    return part.data if isinstance(part, Part) else part


def part_array(arr: object, tag: str, count: int, what: str) -> NDArray:
    """Validate one stored part: 1-D, dtype ``storage_dtype(tag)``, ``count`` elements.

    A 1-D ``uint8`` array is taken as the part's raw bytes and reinterpreted (copied only
    when misaligned). The result is never written to: it may be a read-only mmap view.
    """
    want = STORAGE_DTYPE[tag]
    arr = as_array(arr)
    if not isinstance(arr, np.ndarray):
        fail(Reason.BAD_CODEC_PARAMS, f"{what} must be a numpy array, got {type(arr).__name__}")
    out: NDArray = arr
    if out.ndim != 1:
        fail(Reason.BAD_CODEC_PARAMS, f"{what} must be 1-D, got shape {out.shape}")
    if out.dtype != want:
        if out.dtype != np.uint8:
            fail(Reason.BAD_DTYPE, f"{what} has dtype {out.dtype}, expected {tag} ({want})")
        if out.size != count * want.itemsize:
            fail(
                Reason.DECODE_SIZE_MISMATCH,
                f"{what} has {out.size} bytes, expected {count} x {want.itemsize}",
            )
        out = np.ascontiguousarray(out).view(want)
        if not out.flags.aligned:
            out = out.copy()
    if out.size != count:
        fail(Reason.DECODE_SIZE_MISMATCH, f"{what} has {out.size} elements, expected {count}")
    return out


def check_bool_bytes(arr: NDArray, what: str) -> None:
    """A BOOL buffer must hold only bytes 0 and 1 (numpy would keep any other byte as is)."""
    if arr.size and bool(np.any(arr.view(np.uint8) > 1)):
        fail(Reason.BAD_CODEC_PARAMS, f"{what} holds a BOOL byte other than 0 or 1")


def alloc(shape: int | tuple[int, ...], dtype: npt.DTypeLike, *, zero: bool) -> NDArray:
    """Allocate a decode output sized from a shape read from a file.

    The caller (log layer) caps shapes; this turns what slips through into ``limit_exceeded``
    instead of a ``MemoryError``.
    """
    try:
        return np.zeros(shape, dtype) if zero else np.empty(shape, dtype)
    except (MemoryError, ValueError) as e:
        fail(Reason.LIMIT_EXCEEDED, f"cannot allocate a decode output of shape {shape}: {e}")


def narrow_f32(values: NDArray, dtype: str) -> NDArray:
    """Float32 decode results as ``dtype`` (section 1's rounding rules): F32 as is, F64
    widened exactly, F16 IEEE RNE (overflow to inf, no warning), BF16 RNE bit patterns."""
    if dtype == "F64":
        return values.astype(np.float64)
    if dtype == "F16":
        with np.errstate(over="ignore"):
            return values.astype(np.float16)
    if dtype == "BF16":
        return f32_to_bf16(values)
    return values


def widen_float(flat: NDArray, dtype: str) -> NDArray:
    """Encoder input as float32 (float64 for F64), exactly; BF16 bit patterns widened."""
    if dtype == "BF16":
        return bf16_to_f32(flat)
    if dtype == "F16":
        return flat.astype(np.float32)
    return flat


def check_scales(scales: NDArray, what: str) -> None:
    """Stored float32 scales/norms must be finite and >= 0 (a NaN fails)."""
    if scales.size and not bool(np.all((scales >= 0) & (scales <= F32_MAX))):
        fail(Reason.BAD_CODEC_PARAMS, f"{what} must be finite and >= 0")


#: Elements per vectorized step of :func:`block_steps`: float64 temporaries stay in cache.
_STEP: Final = 1 << 16


def block_steps(n: int, block: int) -> Iterator[tuple[int, int, int, int]]:
    """(first element, end element, first block, end block) of each step.

    Whole blocks come in runs of about ``_STEP`` elements; a short last block comes alone.
    Each step is a (blocks, width) matrix, so one scale broadcasts along each row.
    """
    full = n // block
    step = max(1, _STEP // block)
    for b0 in range(0, full, step):
        b1 = min(full, b0 + step)
        yield b0 * block, b1 * block, b0, b1
    if full * block < n:
        yield full * block, n, full, full + 1


def block_scale(base: NDArray, scales: NDArray, block: int, out: NDArray) -> NDArray:
    """``out[i] = base[i] * scales[i // block]`` (IEEE products in ``out``'s dtype)."""
    n = base.size
    full = n // block
    if full:
        np.multiply(base[: full * block].reshape(full, block), scales[:full, None],
                    out=out[: full * block].reshape(full, block))
    if full * block < n:
        np.multiply(base[full * block :], scales[full], out=out[full * block :])
    return out


def block_reduce_max(x: NDArray, block: int) -> NDArray:
    """max(x) over each block of ``block`` elements (the last may be short); x non-empty."""
    return np.maximum.reduceat(x, np.arange(0, x.size, block))


def unsigned_view(arr: NDArray) -> NDArray:
    """The same memory seen as unsigned integers of the same width (bit patterns)."""
    return arr.view(STORAGE_DTYPE[UNSIGNED_TAG[arr.dtype.itemsize]])
