"""The compression stage: one zstd frame per part, optionally byte-shuffled first.

Shuffle writes byte k of every element together (all low bytes, then the next...), which
turns the slowly varying exponent bytes of floats into long runs. The frame always carries
its content size, so a reader checks the size it will allocate before decompressing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import zstandard

from ..errors import Reason
from ..format.dtypes import STORAGE_DTYPE
from ._core import (
    MAX_NUMEL,
    Checks,
    NDArray,
    check_bool_bytes,
    fail,
    is_int,
    storage_dtype_of,
)

#: zstd level when the caller gives none: fast, and most of zstd's ratio on these payloads.
DEFAULT_LEVEL: Final = 3
#: zstd's own range: negative levels are its fast modes (ZSTD_minCLevel() = -2**17).
MIN_LEVEL: Final = -(2**17)
MAX_LEVEL: Final = zstandard.MAX_COMPRESSION_LEVEL
#: the ``zstd`` map of a compressed part (``format_spec/codecs.md``, section 14)
_CHECK: Final = Checks("zstd", frozenset({"compressor", "shuffle"}))
_STORAGE_DTYPES: Final = frozenset(STORAGE_DTYPE.values())

# zstandard contexts are not safe to share between threads (the writer compresses in the
# background while training decodes), so each thread keeps its own.
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("compressors", {})
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=False
        )
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = _local.__dict__.get("decompressor")
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _unshuffle(planes: NDArray, width: int) -> NDArray:
    """Byte plane k back into byte k of each element: one plane per step, which numpy does
    about twice as fast as a transposed copy."""
    out = np.empty((planes.size // width, width), np.uint8)
    for k, plane in enumerate(planes.reshape(width, -1)):
        out[:, k] = plane
    return out


def compress(
    data: NDArray, *, level: int = DEFAULT_LEVEL, shuffle: bool = True
) -> tuple[bytes, dict[str, Any]]:
    """See :func:`lowdiff_store.codecs.compress`."""
    if not isinstance(data, np.ndarray) or data.dtype not in _STORAGE_DTYPES:
        fail(Reason.BAD_DTYPE, "compress takes a numpy array of a storage dtype (little-endian)")
    if not is_int(level) or not MIN_LEVEL <= level <= MAX_LEVEL:
        fail(Reason.BAD_CODEC_PARAMS, f"zstd level={level!r} not in [{MIN_LEVEL}, {MAX_LEVEL}]")
    if not isinstance(shuffle, (bool, np.bool_)):
        fail(Reason.BAD_CODEC_PARAMS, f"shuffle={shuffle!r} is not a bool")
    flat = np.ascontiguousarray(data).reshape(-1)
    width = flat.dtype.itemsize
    shuffled = bool(shuffle) and width > 1
    buf = flat.view(np.uint8)
    if shuffled:
        buf = np.ascontiguousarray(buf.reshape(-1, width).T)
    blob = _compressor(int(level)).compress(buf.data)
    return blob, {"compressor": "zstd", "shuffle": shuffled}


#: largest ratio of decoded to stored bytes a zstd frame can reach (with margin)
MAX_EXPANSION = 1 << 16


def decompress(
    blob: bytes | memoryview | NDArray,
    params: Mapping[str, Any],
    *,
    dtype: str,
    count: int,
) -> NDArray:
    """See :func:`lowdiff_store.codecs.decompress`."""
    _CHECK.params(params)
    name = params["compressor"]
    if not isinstance(name, str):
        fail(Reason.BAD_CODEC_PARAMS, f"zstd param compressor={name!r} is not a str")
    if name != "zstd":
        fail(Reason.UNKNOWN_CODEC, f"unknown compressor {name!r}")
    shuffle = _CHECK.bool_param(params, "shuffle")
    sdt = storage_dtype_of(dtype)
    if not is_int(count) or not 0 <= count <= MAX_NUMEL // sdt.itemsize:
        fail(Reason.BAD_CODEC_PARAMS, f"count={count!r} is not a valid element count")
    expected = int(count) * sdt.itemsize
    src: bytes | bytearray | memoryview
    if isinstance(blob, np.ndarray):
        src = np.ascontiguousarray(blob).data
    elif isinstance(blob, (bytes, bytearray, memoryview)):
        src = blob
    else:
        fail(Reason.INVALID_ARGUMENT, f"blob must be bytes-like, got {type(blob).__name__}")
    # Hostile-file defence: read the declared size from the frame header and refuse any
    # frame that does not declare exactly what we expect, before anything is allocated.
    try:
        declared = zstandard.frame_content_size(src)
    except (zstandard.ZstdError, ValueError, TypeError, BufferError) as e:
        fail(Reason.DECODE_SIZE_MISMATCH, f"not a zstd frame header: {e}")
    if declared != expected:
        what = "no content size" if declared < 0 else f"{declared} bytes"
        fail(Reason.DECODE_SIZE_MISMATCH, f"zstd frame declares {what}, expected {expected}")
    # zstd cannot expand beyond about 43,700:1 (a 3-byte RLE block header per 128 KiB block),
    # so a frame declaring more than 65,536 times its own size is forged: refuse it before
    # allocating, whatever the (already bounded) element count says.
    if expected > (len(memoryview(src).cast("B")) + 64) * MAX_EXPANSION:
        fail(Reason.DECODE_SIZE_MISMATCH,
             f"zstd frame of {memoryview(src).nbytes} bytes cannot hold {expected} bytes")
    try:
        raw = _decompressor().decompress(src, max_output_size=expected, allow_extra_data=False)
    except (zstandard.ZstdError, ValueError, TypeError, BufferError) as e:
        fail(Reason.DECODE_SIZE_MISMATCH, f"zstd frame does not decode to {expected} bytes: {e}")
    except MemoryError:
        fail(Reason.LIMIT_EXCEEDED, f"cannot allocate {expected} bytes to decompress")
    if len(raw) != expected:
        fail(Reason.DECODE_SIZE_MISMATCH, f"zstd frame gave {len(raw)} bytes, not {expected}")
    out = np.frombuffer(raw, np.uint8)
    width = sdt.itemsize
    if shuffle and width > 1:
        out = _unshuffle(out, width)
    arr = out.view(sdt).reshape(-1)
    if dtype == "BOOL":
        check_bool_bytes(arr, "zstd payload")
    return arr
