"""CRC32C (Castagnoli) with leveldb's masking. Hardware-accelerated through ``crc32c``."""

from __future__ import annotations

from collections.abc import Iterable

import crc32c as _crc32c

from .constants import CRC_MASK_DELTA

Buffer = bytes | bytearray | memoryview

_ZEROS = bytes(1 << 16)


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (0 to start)."""
    return int(_crc32c.crc32c(data, value))


def crc32c_chunks(chunks: Iterable[Buffer], value: int = 0) -> int:
    """CRC32C over several buffers, as if concatenated."""
    for c in chunks:
        value = int(_crc32c.crc32c(c, value))
    return value


def crc32c_zeros(n: int, value: int) -> int:
    """Continue a CRC32C over ``n`` zero bytes (the padding between payloads)."""
    while n > 0:
        k = min(n, len(_ZEROS))
        value = int(_crc32c.crc32c(memoryview(_ZEROS)[:k], value))
        n -= k
    return value


def mask(crc: int) -> int:
    """Mask a CRC before storing it (leveldb ``crc32c::Mask``)."""
    return (((crc >> 15) | (crc << 17)) + CRC_MASK_DELTA) & 0xFFFFFFFF


def unmask(masked: int) -> int:
    """Inverse of :func:`mask`."""
    rot = (masked - CRC_MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


__all__ = ["crc32c", "crc32c_chunks", "crc32c_zeros", "mask", "unmask"]
