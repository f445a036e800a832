"""The ``lcc`` codec: LC-Checkpoint's weight-delta message (Chen et al., ICML 2020).

Encoding (the reference writer; readers depend only on the decode rule):

1. every non-zero element falls in the bucket (sign, binade) of its value: the ``e`` of
   ``2**e <= |x| < 2**(e+1)``, subnormals included (each subnormal binade is a bucket);
2. priority promotion: the ``2**bits - 1`` non-empty buckets of largest exponent are kept
   (positive before negative at equal exponents), numbered 1, 2, ... in that order; each is
   represented by the mean of its elements, kept inside the bucket; every other element,
   and every zero of either sign, becomes symbol 0 (+0);
3. the per-element symbols are Huffman coded (canonical codes, at most 15 bits), in chunks
   of ``chunk`` symbols whose bit lengths are stored, so a reader decodes all chunks at once.

Decode is a table lookup: ``out[i] = rep[sym[i]]`` (``rep[0] = 0``), narrowed to the dtype.
The torch layer encodes each delta against the reconstruction (``decode(encode(d))``), so
the quantization error never accumulates.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from ..errors import Reason
from ._core import (
    ARITH_FLOAT_TAGS,
    INT32_MAX,
    Checks,
    Codec,
    Encoded,
    NDArray,
    Part,
    alloc,
    fail,
    narrow_f32,
    part_array,
    widen_float,
)
from ._pack import packed_size

#: Longest Huffman code: a decode table has 2**MAX_CODE_LEN entries.
MAX_CODE_LEN: Final = 15
MAX_BITS: Final = 8
MAX_SYMBOLS: Final = 1 << MAX_BITS
DEFAULT_BITS: Final = 3
MAX_CHUNK: Final = INT32_MAX
_CHECK: Final = Checks("lcc", frozenset({"symbols", "chunk", "nbits"}), nparts=4,
                       dtypes=ARITH_FLOAT_TAGS)


def default_chunk(numel: int) -> int:
    """Symbols per chunk: at least 512 (a chunk costs 4 bytes), at most about 8192 chunks
    (each decode step is one numpy pass over the chunks)."""
    return max(512, -(-numel // 8192))


# ----------------------------------------------------------------------------- Huffman


def huffman_lengths(freq: Sequence[int], limit: int = MAX_CODE_LEN) -> list[int]:
    """Code lengths of a Huffman code for ``freq`` (0 for unused symbols), at most ``limit``.

    Deterministic: ties merge the subtree created first. Over the limit, the frequencies
    are halved (kept >= 1) and the code rebuilt, until it fits.
    """
    f = [int(v) for v in freq]
    used = [i for i, v in enumerate(f) if v > 0]
    lengths = [0] * len(f)
    if len(used) < 2:
        return lengths
    while True:
        heap: list[tuple[int, int, list[int]]] = [(f[i], n, [i]) for n, i in enumerate(used)]
        heapq.heapify(heap)
        lengths = [0] * len(f)
        order = len(heap)
        while len(heap) > 1:
            wa, _, a = heapq.heappop(heap)
            wb, _, b = heapq.heappop(heap)
            for s in a + b:
                lengths[s] += 1
            heapq.heappush(heap, (wa + wb, order, a + b))
            order += 1
        if max(lengths) <= limit:
            return lengths
        f = [(v >> 1) | 1 if v else 0 for v in f]


def canonical_codes(lengths: Sequence[int]) -> list[int]:
    """DEFLATE's canonical codes (RFC 1951, 3.2.2): by (length, symbol), counting up."""
    codes = [0] * len(lengths)
    code = 0
    prev = 0
    for length, sym in sorted((n, s) for s, n in enumerate(lengths) if n):
        code <<= length - prev
        codes[sym] = code
        code += 1
        prev = length
    return codes


def _reverse(code: int, length: int) -> int:
    return int(format(code, f"0{length}b")[::-1], 2) if length else 0


def _check_lengths(lengths: NDArray) -> int:
    """Max code length of a stored table: each <= 15 and a complete code (Kraft sum 1),
    or all zero (every element is symbol 0)."""
    if lengths.size and int(lengths.max()) > MAX_CODE_LEN:
        fail(Reason.BAD_CODEC_PARAMS, f"lcc code length above {MAX_CODE_LEN}")
    used = lengths[lengths > 0].astype(np.int64)
    if used.size == 0:
        return 0
    kraft = int(np.sum(np.int64(1) << (MAX_CODE_LEN - used)))
    if kraft != 1 << MAX_CODE_LEN:
        fail(Reason.BAD_CODEC_PARAMS, "lcc code lengths do not form a complete prefix code")
    return int(used.max())


# ----------------------------------------------------------------------------- encode


#: Elements per encoder step: the int64/float64 temporaries of a step stay small.
_SEG: Final = 1 << 20


@dataclass(frozen=True)
class _Binades:
    """The buckets of a representative dtype: a non-zero value ``x`` lies in the binade
    ``[2^e, 2^(e+1))`` of ``e = frexp(x)[1] - 1``, subnormals included (each subnormal
    binade is its own bucket), ``least <= e <= least + count - 1``."""

    rep: type[np.floating[Any]]
    bits: type[np.unsignedinteger[Any]]  # the unsigned integer of the same width
    mant: int  # stored mantissa bits
    least: int  # the exponent of the least subnormal
    count: int  # binades, subnormal and normal
    scaled: bool  # sum x * 2^-(e+1): float64 sums of x itself could overflow

    def keys(self, x: NDArray, *, sums: bool = True) -> tuple[NDArray, NDArray]:
        """Per element the bucket key ``2 * (e - least) + sign bit`` (zeros of either sign:
        the sentinel ``2 * count``) and the value the bucket's sum adds: ``x * 2^-(e+1)``
        (exact, ``1/2 <= |.| < 1``) when ``scaled`` and ``sums``, else ``x``. From the bits
        for normal values (``e - least = E + mant - 1`` of the biased exponent ``E``);
        subnormals and zeros (``E = 0``) through ``frexp``."""
        scaled = self.scaled and sums
        u = x.view(self.bits)
        width = 8 * x.itemsize
        t = self.bits
        ekey = (u >> t(self.mant - 1)) & t(2 * ((1 << (width - 1 - self.mant)) - 1))
        key = (ekey | (u >> t(width - 1))).astype(np.intp)
        small = np.flatnonzero(ekey == 0)
        key += 2 * (self.mant - 1)
        add = x
        if scaled:  # the exponent field of 1/2, the sign and mantissa of x
            keep = t(((1 << width) - 1) ^ (((1 << (width - 1 - self.mant)) - 1) << self.mant))
            half = t((1 << (width - 2 - self.mant)) - 2) << t(self.mant)
            add = ((u & keep) | half).view(self.rep)
        if small.size:
            xs = x[small]
            frac, ex = np.frexp(xs)
            ks = (ex.astype(np.intp) - (self.least + 1)) * 2 + np.signbit(xs)
            key[small] = np.where(xs == 0, 2 * self.count, ks)
            if scaled:
                add[small] = frac
        return key, add

    def representatives(self, kept: NDArray, sums: NDArray, counts: NDArray) -> NDArray:
        """Each kept bucket's mean in float64 (``2^(e+1) * sum(x * 2^-(e+1)) / n`` when
        ``scaled``: the same value, as the scaling is exact, without overflow at the largest
        finites), rounded to ``rep`` and kept inside the bucket: magnitude in
        ``[2^e, the largest rep value below 2^(e+1)]``."""
        e = (kept >> 1) + self.least
        mean = sums[kept] / counts[kept]
        with np.errstate(over="ignore"):
            if self.scaled:
                mean = np.ldexp(mean, e + 1)
            rounded = mean.astype(self.rep)
            low = np.ldexp(self.rep(1), e)
            high = np.nextafter(np.ldexp(self.rep(1), e + 1), self.rep(0))
        mag = np.minimum(np.maximum(np.abs(rounded), low), high)
        out: NDArray = np.where(kept & 1, -mag, mag)
        return out


_F32_BINADES: Final = _Binades(np.float32, np.uint32, 23, -149, 277, scaled=False)
_F64_BINADES: Final = _Binades(np.float64, np.uint64, 52, -1074, 2098, scaled=True)


def _segments(n: int) -> range:
    return range(0, n, _SEG)


def encode(array: NDArray, dtype: str, *, bits: int = DEFAULT_BITS,
           chunk: int | None = None) -> Encoded:
    """Quantize and Huffman-code a weight delta (module docstring). Non-finite: refused."""
    _CHECK.require_dtype(dtype)
    bits = _CHECK.int_option("bits", bits, 1, MAX_BITS)
    x = widen_float(array.reshape(-1), dtype)
    n = x.size
    ch = _CHECK.int_option("chunk", default_chunk(n) if chunk is None else chunk, 1, MAX_CHUNK)
    _CHECK.finite(x)
    bins = _F64_BINADES if dtype == "F64" else _F32_BINADES
    nkeys = 2 * bins.count + 1
    counts = np.zeros(nkeys, np.int64)
    sums = np.zeros(nkeys, np.float64)
    for a in _segments(n):
        key, add = bins.keys(x[a : a + _SEG])
        counts += np.bincount(key, minlength=nkeys)
        sums += np.bincount(key, weights=add.astype(np.float64, copy=False),
                            minlength=nkeys)
    nonempty = np.flatnonzero(counts[: 2 * bins.count])
    # largest exponent first; at one exponent the positive bucket (even key) first
    order = nonempty[np.lexsort((nonempty & 1, -(nonempty >> 1)))]
    kept = order[: (1 << bits) - 1]
    reps = bins.representatives(kept, sums, counts)
    lut = np.zeros(nkeys, np.uint8)
    lut[kept] = np.arange(1, kept.size + 1, dtype=np.uint8)
    sym = np.empty(n, np.uint8)
    for a in _segments(n):
        sym[a : a + _SEG] = lut[bins.keys(x[a : a + _SEG], sums=False)[0]]
    nsym = kept.size + 1
    freq = np.bincount(sym, minlength=nsym)
    lengths = huffman_lengths(freq.tolist())
    if int(np.count_nonzero(freq)) == 1 and int(sym[0]) != 0:
        lengths[0] = lengths[int(sym[0])] = 1  # one bucket holds everything: 1 bit each
    stream, chunk_bits, nbits = _write_stream(sym, lengths, ch)
    params = {"symbols": nsym, "chunk": ch, "nbits": nbits}
    parts = (Part("F64" if dtype == "F64" else "F32", reps),
             Part("U8", np.array(lengths, np.uint8)),
             Part("U32", chunk_bits),
             Part("U8", stream))
    return Encoded("lcc", params, parts)


def _write_stream(sym: NDArray, lengths: list[int], ch: int) -> tuple[NDArray, NDArray, int]:
    """The Huffman bit stream of ``sym``, each chunk's bit length, the total bit count."""
    n = sym.size
    nchunks = -(-n // ch)
    if max(lengths) == 0:
        return np.zeros(0, np.uint8), np.zeros(nchunks, np.uint32), 0
    codes = canonical_codes(lengths)
    len8 = np.array(lengths, np.uint8)
    rev = np.array([_reverse(c, k) for c, k in zip(codes, lengths, strict=True)], np.uint32)
    total = int(np.dot(np.bincount(sym, minlength=len(lengths)), len8.astype(np.int64)))
    stream = np.zeros(packed_size(total, 1) + 3, np.uint8)
    chunk_ends = np.zeros(nchunks, np.int64)  # cumulative bits at each chunk's end
    last_elem = np.minimum(np.arange(1, nchunks + 1, dtype=np.int64) * ch, n) - 1
    base = 0
    for a in _segments(n):
        ss = sym[a : a + _SEG]
        ls = len8[ss].astype(np.int64)
        ends = np.cumsum(ls)
        offs = ends - ls + (base & 7)  # bit offsets from the byte holding bit ``base``
        val = rev[ss] << (offs & 7).astype(np.uint32)  # a code spans at most 3 bytes
        byte = offs >> 3
        # codes starting in one byte are consecutive: OR each run into one 24-bit word
        heads = np.flatnonzero(np.diff(byte, prepend=-1))
        word = np.bitwise_or.reduceat(val, heads)
        at = byte[heads] + (base >> 3)
        for j in range(3):  # each statement writes distinct bytes
            stream[at + j] |= ((word >> np.uint32(8 * j)) & np.uint32(0xFF)).astype(np.uint8)
        lo, hi = np.searchsorted(last_elem, [a, a + ss.size])
        chunk_ends[lo:hi] = ends[last_elem[lo:hi] - a] + base
        base += int(ends[-1])
    chunk_bits = np.diff(chunk_ends, prepend=0).astype(np.uint32)
    return stream[: packed_size(total, 1)].copy(), chunk_bits, total


# ----------------------------------------------------------------------------- decode


def _table(lengths: NDArray, maxlen: int) -> NDArray:
    """uint16 ``length << 8 | symbol`` for every ``maxlen``-bit window (LSB-first)."""
    ls = lengths.astype(np.int64).tolist()
    codes = canonical_codes(ls)
    table = np.zeros(1 << maxlen, np.uint16)
    for sym, (length, code) in enumerate(zip(ls, codes, strict=True)):
        if length:
            fill = np.arange(1 << (maxlen - length), dtype=np.int64) << length
            table[_reverse(code, length) + fill] = (length << 8) | sym
    return table


def decode(
    params: Mapping[str, Any],
    parts: Sequence[Any],
    dtype: str,
    shape: tuple[int, ...],
    numel: int,
) -> NDArray:
    """``rep[sym[i]]`` for every element, chunks decoded in lockstep: a new array."""
    _CHECK.require_dtype(dtype)
    _CHECK.params(params)
    nsym = _CHECK.int_param(params, "symbols", 1, MAX_SYMBOLS)
    ch = _CHECK.int_param(params, "chunk", 1, MAX_CHUNK)
    nbits = _CHECK.int_param(params, "nbits", 0, numel * MAX_CODE_LEN)
    _CHECK.parts(parts)
    rtag = "F64" if dtype == "F64" else "F32"
    reps = part_array(parts[0], rtag, nsym - 1, "lcc part 0 (representatives)")
    lengths = part_array(parts[1], "U8", nsym, "lcc part 1 (code lengths)")
    nchunks = -(-numel // ch)
    cbits = part_array(parts[2], "U32", nchunks, "lcc part 2 (chunk bits)")
    stream = part_array(parts[3], "U8", packed_size(nbits, 1), "lcc part 3 (stream)")
    if reps.size and not bool(np.all(np.isfinite(reps))):
        fail(Reason.BAD_CODEC_PARAMS, "lcc representatives must be finite")
    maxlen = _check_lengths(lengths)
    counts = np.full(nchunks, ch, np.int64)
    if nchunks:
        counts[-1] = numel - (nchunks - 1) * ch
    cb = cbits.astype(np.int64)
    used = lengths[lengths > 0]
    minlen = int(used.min()) if used.size else 0
    if int(cb.sum()) != nbits or bool(np.any(cb < counts * minlen)) or \
            bool(np.any(cb > counts * maxlen)):
        fail(Reason.BAD_CODEC_PARAMS, "lcc chunk bit lengths do not match the stream")
    tail = nbits % 8
    if tail and int(stream[-1]) >> tail:
        fail(Reason.BAD_CODEC_PARAMS, "lcc stream padding bits are not zero")
    wide = np.float64 if dtype == "F64" else np.float32
    values = np.zeros(nsym, wide)
    values[1:] = reps
    if maxlen == 0 or numel == 0:
        out = alloc(numel, wide, zero=True)
    else:
        sym = _decode_symbols(stream, cb, counts, nchunks, maxlen, _table(lengths, maxlen))
        out = values[sym]
    if dtype == "F64":
        res: NDArray = out.reshape(shape)
        return res
    return narrow_f32(out, dtype).reshape(shape)


#: Two symbols per decode step when both fit a window of at most this many bits.
_PAIR_BITS: Final = 20


def _decode_symbols(stream: NDArray, cb: NDArray, counts: NDArray, nchunks: int,
                    maxlen: int, table: NDArray) -> NDArray:
    """Every chunk's symbols, all chunks in lockstep (one lane each); each lane must end
    exactly where its chunk ends. When two codes always fit the window (``2 * maxlen <= 20``)
    and the tensor is large enough to pay for the table, each step decodes two symbols."""
    starts = np.concatenate([[0], np.cumsum(cb)[:-1]]).astype(np.int64)
    ends = starts + cb
    # a lying stream can run a lane up to counts * maxlen bits past its start: pad so every
    # window read stays inside (at most 2 bytes per element, bounded by the output)
    reach = int(np.max(starts + counts * maxlen)) + 2 * maxlen
    nbytes = max(stream.size, (reach + 7) // 8) + 4
    buf = alloc(nbytes, np.uint8, zero=True)
    buf[: stream.size] = stream
    win = buf[:-3].astype(np.uint32)
    win |= buf[1:-2].astype(np.uint32) << np.uint32(8)
    win |= buf[2:-1].astype(np.uint32) << np.uint32(16)
    win[:-1] |= buf[3:-1].astype(np.uint32) << np.uint32(24)
    ptype = np.uint32 if reach < 2**32 - 64 else np.int64
    sym1 = (table & np.uint16(0xFF)).astype(np.uint8)
    len1 = (table >> np.uint16(8)).astype(ptype)
    mask1 = np.uint32((1 << maxlen) - 1)
    steps = int(counts.max())  # <= numel, whatever chunk says
    last = int(counts[-1])
    numel = int(counts.sum())
    pair = 2 * maxlen <= _PAIR_BITS and numel >= 4 << (2 * maxlen)
    per = 2 if pair else 1
    if pair:
        w_all = np.arange(1 << (2 * maxlen), dtype=np.int64)
        e1 = table[w_all & int(mask1)].astype(np.int64)
        e2 = table[(w_all >> (e1 >> 8)) & int(mask1)].astype(np.int64)
        sym2 = ((e1 & 0xFF) | ((e2 & 0xFF) << 8)).astype(np.uint16)
        len2 = ((e1 >> 8) + (e2 >> 8)).astype(ptype)
        mask2 = np.uint32((1 << (2 * maxlen)) - 1)
        grid = alloc((-(-steps // 2), nchunks), np.uint16, zero=False)
    else:
        grid = alloc((steps, nchunks), np.uint8, zero=False)
    sym1_out = sym1.astype(grid.dtype)  # a single step in pair mode fills the low byte
    pos = starts.astype(ptype)
    ends = ends.astype(ptype)
    seven, three = ptype(7), ptype(3)

    def run(pos: NDArray, first: int, rows: range, single: bool) -> None:
        """Decode ``rows`` steps of the lanes ``first .. first + pos.size``."""
        tsym, tlen, mask = (sym1_out, len1, mask1) if single else (sym2, len2, mask2)
        for r in rows:
            w = win[pos >> three]
            w >>= (pos & seven).astype(np.uint32, copy=False)
            w &= mask
            np.take(tsym, w, out=grid[r, first : first + pos.size])
            pos += tlen[w]

    def bad() -> None:
        fail(Reason.BAD_CODEC_PARAMS, "lcc stream does not end where its chunk does")

    run(pos, 0, range(last // per), not pair)
    if last < steps:  # the short last chunk: finish, check and drop its lane
        if pair and last % 2:
            run(pos[-1:], nchunks - 1, range(last // 2, last // 2 + 1), True)
        if int(pos[-1]) != int(ends[-1]):
            bad()
        pos, ends = pos[:-1], ends[:-1]
        run(pos, 0, range(last // per, steps // per), not pair)
    if pair and steps % 2:
        run(pos, 0, range(steps // 2, steps // 2 + 1), True)
    if not np.array_equal(pos, ends):
        bad()
    # lanes in order; the last lane's row holds ``last`` symbols, then unwritten bytes
    lanes = np.ascontiguousarray(grid.T).view(np.uint8)[:, :steps]
    sym: NDArray = lanes.reshape(-1)[:numel]
    return sym


CODEC: Final = Codec("lcc", frozenset({"bits", "chunk"}), encode, decode)
