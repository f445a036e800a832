"""CRC32C (Castagnoli) with leveldb's masking. Hardware-accelerated through ``crc32c``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import crc32c as _crc32c

from ..threads import HelperPool
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


# -- combining CRCs (zlib's crc32_combine, for the Castagnoli polynomial)

_POLY = 0x82F63B78  # CRC32C, reflected


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the polynomial, in the reflected bit order of the CRC."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)  # x^(2^k)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of ``A + B`` from ``crc1 = crc32c(A)``, ``crc2 = crc32c(B)`` and
    ``len2 = len(B)``, in O(log len2) (zlib's ``crc32_combine``, same conditioning)."""
    if len2 < 0:
        raise ValueError("negative length")
    p, k = 1 << 31, 3  # x^0; the length counts bytes: x^(8 * len2)
    while len2:
        if len2 & 1:
            p = _multmodp(_X2N[k & 31], p)
        len2 >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


#: below this many bytes a CRC is computed on the calling thread alone
PARALLEL_MIN_BYTES = 8 << 20

#: helper threads for the runs after the first (the caller computes the first)
_HELPERS = HelperPool("lowdiff-crc32c", lambda cores: min(cores, 4) - 1)


def crc32c_parallel(chunks: Sequence[Buffer], value: int = 0) -> int:
    """:func:`crc32c_chunks`, on up to four cores when the chunks hold at least
    :data:`PARALLEL_MIN_BYTES`: the byte stream is cut into equal runs, each run's CRC is
    computed on its own thread (the CRC releases the GIL) and the results are combined
    with :func:`crc32c_combine`. Same value as :func:`crc32c_chunks`, bit for bit; on the
    calling thread alone where helper threads cannot run (one core, interpreter exit)."""
    views = [memoryview(c).cast("B") for c in chunks]
    total = sum(v.nbytes for v in views)
    helpers = _HELPERS.get() if total >= PARALLEL_MIN_BYTES else None
    if helpers is None:
        return crc32c_chunks(views, value)
    pool, threads = helpers
    nrun = threads + 1
    runs: list[list[memoryview]] = [[] for _ in range(nrun)]
    per, i, room = -(-total // nrun), 0, -(-total // nrun)
    for v in views:
        while v.nbytes:
            if room == 0:
                i, room = i + 1, per
            take = min(room, v.nbytes)
            runs[i].append(v[:take])
            v, room = v[take:], room - take
    try:
        futures: list[Future[int]] = [pool.submit(crc32c_chunks, r) for r in runs[1:]]
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        return crc32c_chunks(views, value)
    crc = crc32c_chunks(runs[0], value)
    for r, f in zip(runs[1:], futures, strict=True):
        crc = crc32c_combine(crc, f.result(), sum(v.nbytes for v in r))
    return crc


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


__all__ = ["PARALLEL_MIN_BYTES", "crc32c", "crc32c_chunks", "crc32c_combine", "crc32c_parallel",
           "crc32c_zeros", "mask", "unmask"]
