"""Fixed-width bit packing shared by the packed codecs (``tern``, ``qsgd``, ``sign``,
``sparse_ec``, ``lcc``); ``format_spec/codecs.md``, section "Bit streams".

A stream of ``count`` values of ``width`` bits is the LSB-first concatenation of the values:
bit ``j`` of value ``i`` is bit ``i * width + j`` of the stream, and bit ``t`` of the stream is
bit ``t mod 8`` of byte ``t div 8``. The last byte's unused high bits are zero, and readers
refuse them otherwise, so every stream has exactly one encoding.

Eight values of ``width`` bits fill exactly ``width`` bytes: packing works on groups of eight,
OR-ing each value into ``ceil(width / 8)`` little-endian uint64 words, so every step is a
vectorised pass over ``count / 8`` groups.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from ..errors import Reason
from ._core import NDArray, alloc, fail

#: Widest value the packer handles (a QSGD entry or a sparse low part never needs more).
MAX_WIDTH: Final = 64


def packed_size(count: int, width: int) -> int:
    """Bytes of a stream of ``count`` values of ``width`` bits."""
    return (count * width + 7) // 8


def pack_bits(values: NDArray, width: int) -> NDArray:
    """Pack unsigned ``values`` (each ``< 2**width``; not checked) into a uint8 stream."""
    count = int(values.size)
    nbytes = packed_size(count, width)
    if width == 0 or count == 0:
        return np.zeros(nbytes, np.uint8)
    if width == 1:
        return np.packbits(values.astype(np.bool_, copy=False), bitorder="little")
    if width == 8:
        return np.ascontiguousarray(values, dtype=np.uint8)
    if width in (2, 4):
        per = 8 // width
        v8 = np.zeros(nbytes * per, np.uint8)
        v8[:count] = values
        grid = v8.reshape(nbytes, per)
        out8: NDArray = grid[:, 0].copy()
        for j in range(1, per):
            out8 |= grid[:, j] << np.uint8(j * width)
        return out8
    groups = -(-count // 8)
    flat = np.zeros(groups * 8, np.uint64)
    flat[:count] = values
    v = flat.reshape(groups, 8)
    nwords = -(-width // 8)
    words = np.zeros((groups, nwords), np.uint64)
    for j in range(8):
        shift = j * width
        w, off = divmod(shift, 64)
        col = v[:, j]
        words[:, w] |= col << np.uint64(off)
        if off + width > 64 and w + 1 < nwords:
            words[:, w + 1] |= col >> np.uint64(64 - off)
    out = words.view(np.uint8).reshape(groups, nwords * 8)[:, :width].reshape(-1)
    return np.ascontiguousarray(out[:nbytes])


def unpack_bits(stream: NDArray, width: int, count: int, what: str) -> NDArray:
    """The ``count`` values of a stream of exactly ``packed_size`` bytes (size checked by
    the caller): uint8 when ``width <= 8`` (may be ``stream`` itself, never to be written),
    else uint64. Refuses non-zero padding bits (``bad_codec_params``).
    """
    small = width <= 8
    if width == 0 or count == 0:
        if stream.size and bool(np.any(stream)):
            fail(Reason.BAD_CODEC_PARAMS, f"{what}: padding bits are not zero")
        return np.zeros(count, np.uint8 if small else np.uint64)
    tail_bits = (count * width) % 8
    if tail_bits and int(stream[-1]) >> tail_bits:
        fail(Reason.BAD_CODEC_PARAMS, f"{what}: padding bits are not zero")
    if width == 1:
        return np.unpackbits(stream, count=count, bitorder="little")
    if width == 8:
        return stream
    if width in (2, 4):
        per = 8 // width
        grid8 = alloc((stream.size, per), np.uint8, zero=False)
        for j in range(per):
            np.right_shift(stream, np.uint8(j * width), out=grid8[:, j])
        grid8 &= np.uint8((1 << width) - 1)
        return grid8.reshape(-1)[:count]
    groups = -(-count // 8)
    nwords = -(-width // 8)
    buf = alloc(groups * nwords * 8, np.uint8, zero=True)
    grid = buf.reshape(groups, nwords * 8)
    full = stream.size // width
    grid[:full, :width] = stream[: full * width].reshape(full, width)
    rest = stream[full * width :]
    if rest.size:
        grid[full, : rest.size] = rest
    words = buf.view(np.uint64).reshape(groups, nwords)
    mask = np.uint64((1 << width) - 1) if width < 64 else np.uint64(2**64 - 1)
    out = np.empty((groups, 8), np.uint64)
    for j in range(8):
        shift = j * width
        w, off = divmod(shift, 64)
        col = words[:, w] >> np.uint64(off)
        if off + width > 64 and w + 1 < nwords:
            col |= words[:, w + 1] << np.uint64(64 - off)
        out[:, j] = col & mask
    flat = out.reshape(-1)[:count]
    return flat.astype(np.uint8) if small else flat
