"""Element types (dtype tags) used in records and bases.

The tags are the safetensors spellings, so a base file is readable by safetensors tools.
numpy has no bfloat16 or float8: those tags are stored and handled as unsigned integers of
the same width (their bit patterns), and only the torch layer reinterprets them.
See ``format_spec/log_format.md``, section "Element types".
"""

from __future__ import annotations

from typing import Final

import numpy as np

from ..errors import FormatError, Reason

#: tag -> numpy dtype used to hold the bits (little-endian).
STORAGE_DTYPE: Final[dict[str, np.dtype[np.generic]]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

#: tags whose values are floating point (bit patterns for BF16/F8).
FLOAT_TAGS: Final[frozenset[str]] = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})

_NUMPY_TO_TAG: Final[dict[np.dtype[np.generic], str]] = {
    np.dtype("<f8"): "F64",
    np.dtype("<f4"): "F32",
    np.dtype("<f2"): "F16",
    np.dtype("<i8"): "I64",
    np.dtype("<i4"): "I32",
    np.dtype("<i2"): "I16",
    np.dtype("i1"): "I8",
    np.dtype("<u8"): "U64",
    np.dtype("<u4"): "U32",
    np.dtype("<u2"): "U16",
    np.dtype("u1"): "U8",
    np.dtype("?"): "BOOL",
}


def storage_dtype(tag: str) -> np.dtype[np.generic]:
    """The numpy dtype holding the bits of ``tag``; raises ``FormatError(bad_dtype)``."""
    try:
        return STORAGE_DTYPE[tag]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype tag {tag!r}", reason=Reason.BAD_DTYPE) from None


def itemsize(tag: str) -> int:
    """Bytes per element of ``tag``."""
    return storage_dtype(tag).itemsize


def tag_of(dtype: np.dtype[np.generic] | type) -> str:
    """The tag for a native numpy dtype (bf16/f8 have none: pass their tag explicitly)."""
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    try:
        return _NUMPY_TO_TAG[dt]
    except KeyError:
        raise FormatError(f"numpy dtype {dt} has no tag", reason=Reason.BAD_DTYPE) from None


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32 exactly."""
    out: np.ndarray = (bits.astype("<u4") << np.uint32(16)).view("<f4")
    return out


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Narrow float32 to bfloat16 bit patterns with round-to-nearest-even (torch's rule).

    NaNs stay NaNs (quiet bit set) instead of rounding into infinity.
    """
    u = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounding = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    out = ((u + rounding) >> np.uint32(16)).astype("<u2")
    nan = np.isnan(values)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype("<u2")
    result: np.ndarray = out
    return result


__all__ = [
    "FLOAT_TAGS",
    "STORAGE_DTYPE",
    "bf16_to_f32",
    "f32_to_bf16",
    "itemsize",
    "storage_dtype",
    "tag_of",
]
