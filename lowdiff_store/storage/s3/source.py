"""Reading an object of an ``s3://`` store: :class:`S3Source`, ranged GETs with a block
cache, read-ahead and parallel ranges."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ...errors import FormatError, Reason, StorageError
from .client import ALIGN_GAP, POOL_PREFIX, READ_BLOCK_BYTES, READ_CACHE_BLOCKS
from .keys import Layout, piece_name
from .objects import Objects


class S3Source:
    """Random access to one object by ranged GETs.

    Reads of ``READ_BLOCK_BYTES`` or more are split into ``part_bytes`` ranges fetched in
    parallel into one buffer; one that continues the previous large read (a restore reading
    a base in order) fetches ``readahead_bytes`` at once instead, in ``concurrency`` ranges,
    and the reads that follow are served from that window. Smaller reads go through a cache of
    ``READ_BLOCK_BYTES`` blocks (bounded: at most ``READ_CACHE_BLOCKS``), so a scan of
    records in order costs one GET per block. The returned views own their memory (a fresh
    buffer, a cached block or a window, never written again).
    """

    def __init__(self, objects: Objects, name: str, layout: Layout,
                 length: int | None) -> None:
        self.objects = objects
        self.name = name
        self.path = objects.path_of(name)
        self._layout = layout
        full = layout.size
        if length is not None and not 0 <= length <= full:
            raise FormatError(f"cannot limit a source of {full} bytes to {length}",
                              reason=Reason.TRUNCATED, path=self.path)
        self.size = full if length is None else length
        self._blocks: OrderedDict[int, memoryview] = OrderedDict()
        self._lock = threading.Lock()
        self._next = 0  # end of the last read
        self._prev_large = False  # the last read was large: a large one at _next continues it
        self._ahead: tuple[int, memoryview] | None = None  # (offset, bytes) read ahead

    def read(self, offset: int, n: int) -> memoryview:
        """``n`` bytes at ``offset``; ``FormatError(truncated)`` past the end."""
        if offset < 0 or n < 0 or offset + n > self.size:
            raise FormatError(f"read of {n} bytes at {offset} past the end ({self.size} "
                              "bytes)", reason=Reason.TRUNCATED, path=self.path,
                              offset=offset)
        if n == 0:
            return memoryview(b"")
        # Two large reads in a row, the second where the first ended: a scan (a restore
        # reading a base). One large read after small ones (a record's header, then its
        # payload) is not: it must not fetch a window for one record.
        sequential = self._prev_large and 0 <= offset - self._next < ALIGN_GAP
        self._next = offset + n
        self._prev_large = n >= READ_BLOCK_BYTES
        ahead = self._ahead
        if ahead is not None and ahead[0] <= offset and offset + n <= ahead[0] + \
                ahead[1].nbytes:
            s = offset - ahead[0]
            return ahead[1][s:s + n]
        if n >= READ_BLOCK_BYTES:  # a tensor of a base: ranged GETs in parallel, no cache
            return self._read_large(offset, n, sequential)
        first, last = offset // READ_BLOCK_BYTES, (offset + n - 1) // READ_BLOCK_BYTES
        if first == last:
            b = self._block(first)
            s = offset - first * READ_BLOCK_BYTES
            return b[s:s + n]
        out = np.empty(n, dtype=np.uint8)
        pos = 0
        for i in range(first, last + 1):
            b = self._block(i)
            s = max(offset, i * READ_BLOCK_BYTES) - i * READ_BLOCK_BYTES
            e = min(offset + n, (i + 1) * READ_BLOCK_BYTES) - i * READ_BLOCK_BYTES
            out[pos:pos + e - s] = np.frombuffer(b[s:e], dtype=np.uint8)
            pos += e - s
        return memoryview(out.data).toreadonly()

    def _block(self, i: int) -> memoryview:
        with self._lock:
            b = self._blocks.get(i)
            if b is not None:
                self._blocks.move_to_end(i)
                return b
        start = i * READ_BLOCK_BYTES
        n = min(READ_BLOCK_BYTES, self._layout.size - start)
        b = memoryview(self._fetch(start, n))
        with self._lock:
            self._blocks[i] = b
            while len(self._blocks) > READ_CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        return b

    def _read_large(self, offset: int, n: int, sequential: bool) -> memoryview:
        """A large read: ranged GETs in parallel. A read that continues the previous large
        read fetches ``readahead_bytes`` at once, in ``concurrency``
        ranges: fewer, larger requests than one per tensor (a server that assembles the
        whole object for every ranged GET, as moto does, pays per request), all in flight
        together. Memory: one window per source, dropped when the next one is read.
        Views are read-only: a window serves several reads, so no caller may write in it
        (replay, seeing read-only memory, copies the gradients it would otherwise lend)."""
        opts = self.objects.options
        window = min(max(n, opts.readahead_bytes), self.size - offset)
        if not sequential or window <= n:
            return self._read_parallel(offset, n, opts.part_bytes)
        step = max(opts.part_bytes, -(-window // opts.concurrency))
        buf = self._read_parallel(offset, window, step)
        self._ahead = (offset, buf)
        return buf[:n]

    def _read_parallel(self, offset: int, n: int, step: int) -> memoryview:
        out = np.empty(n, dtype=np.uint8)

        def one(s: int) -> None:
            k = min(step, n - s)
            out[s:s + k] = np.frombuffer(self._fetch(offset + s, k), dtype=np.uint8)

        if threading.current_thread().name.startswith(POOL_PREFIX):
            for s in range(0, n, step):  # inside the pool: never wait on it
                one(s)
            return memoryview(out.data).toreadonly()
        futs = [self.objects.executor().submit(one, s) for s in range(0, n, step)]
        for f in futs:
            f.result()
        return memoryview(out.data).toreadonly()

    def _fetch(self, start: int, n: int) -> bytes:
        """Bytes ``[start, start + n)`` of the object, across pieces if it has them. If a
        piece is gone (replaced by a whole object meanwhile, as a rebuilt index is, or
        deleted by compaction past its grace period), the layout is read again once."""
        try:
            return self._fetch_from(self._layout, start, n)
        except StorageError as e:
            if e.reason is not Reason.MISSING_FILE:
                raise
            lay = self.objects.layout(self.name)
            if lay.size < start + n:
                raise
            self._layout = lay
            return self._fetch_from(lay, start, n)

    def _fetch_from(self, lay: Layout, start: int, n: int) -> bytes:
        key = self.objects.key(self.name)
        if lay.whole is not None:
            return self.objects.get(key, start, n, self.path)
        want = [(piece_name(key, off), max(start, off) - off,
                 min(start + n, off + size) - max(start, off))
                for off, size in lay.pieces if max(start, off) < min(start + n, off + size)]
        def get(w: tuple[str, int, int]) -> bytes:
            return self.objects.get(w[0], w[1], w[2], self.path)

        if len(want) == 1 or threading.current_thread().name.startswith(POOL_PREFIX):
            # (inside the pool already: waiting on it from one of its threads could
            # deadlock it)
            return b"".join(get(w) for w in want)
        # pieces in parallel (a segment uploaded one group commit at a time has many)
        return b"".join(self.objects.executor().map(get, want))

    def close(self) -> None:
        """Drop the cached blocks and the read-ahead window (views handed out stay valid:
        they own their memory)."""
        with self._lock:
            self._blocks.clear()
            self._ahead = None
