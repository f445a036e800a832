"""Training-safe staging for the writer: writer-owned copies of the caller's arrays, kept
within a memory budget, in recycled buffers.

A :class:`StagingPool` is the first stage of :class:`~lowdiff_store.writer.AsyncLogWriter`:
``stage`` copies a record's arrays into one writer-owned buffer (64-byte aligned slices) before
``append`` returns, so later changes to the caller's tensors cannot reach the log; ``release``
gives the bytes back once they are written. Staged bytes plus the free list stay within
``memory_budget``: ``stage`` blocks while admitting a request would exceed it (back-pressure,
counted in ``blocked_s``). The budget in force for a request is at least twice the request
(:func:`budget_for`): a record larger than half the budget is admitted beside one other
record in flight, so records larger than the budget still overlap (the training thread
hands over step t+1 while step t is written) and never more than two such records are
held.

Buffers are recycled, most recently freed first, in size classes of 1/8 of a power of two:
the first touch of fresh pages adds ~70 % to the copy of a 32 MiB record, and a recently used
buffer is still in cache. Thread-safe: ``stage`` runs on the training thread, ``release`` on
the writer's background threads.
"""

from __future__ import annotations

import threading
import time
from typing import Final

import numpy as np

from ..format.framing import align_up

#: Staging copies hold the GIL for at most this many bytes at a time.
_COPY_CHUNK: Final = 16 << 20


def budget_for(memory_budget: int, need: int) -> int:
    """The staged bytes allowed while admitting a request of ``need`` bytes: the budget,
    or room for two such requests when that is more (two large records in flight)."""
    return max(memory_budget, 2 * need)


def size_class(n: int) -> int:
    """Round a staging size up to 1/8 of its power of two (at least a page): recycled
    buffers then fit records whose size varies a little from step to step."""
    q = max(4096, 1 << max(0, n.bit_length() - 4))
    return -(-n // q) * q


class StagingPool:
    """Writer-owned staging copies within ``memory_budget`` bytes (see the module
    docstring)."""

    def __init__(self, memory_budget: int) -> None:
        self.memory_budget = memory_budget
        self._mem = threading.Condition(threading.Lock())
        self._staged = 0
        self._pooled = 0
        self._pool: dict[int, list[np.ndarray]] = {}
        self._closed = False
        self._blocked_s = 0.0
        self._peak = 0
        self._allocs = 0

    def _admit(self, need: int, pooled: bool) -> np.ndarray | None:
        """Count ``need`` staged bytes, blocking while that would exceed the budget (a
        request alone is always admitted). Returns a recycled buffer of ``need`` bytes
        when ``pooled`` and one is free."""
        limit = budget_for(self.memory_budget, need)
        with self._mem:
            if self._staged and self._staged + need > limit:
                t0 = time.perf_counter()
                while self._staged and self._staged + need > limit:
                    self._mem.wait()
                self._blocked_s += time.perf_counter() - t0
            self._staged += need
            self._peak = max(self._peak, self._staged)
            buf = None
            if pooled:
                free = self._pool.get(need)
                if free:
                    buf = free.pop()
                    self._pooled -= need
            while self._pooled and self._staged + self._pooled > self.memory_budget:
                self._evict_one()
            return buf

    def _evict_one(self) -> None:
        size = max(s for s, bufs in self._pool.items() if bufs)
        self._pool[size].pop()
        self._pooled -= size

    def release(self, cost: int, buffer: np.ndarray | None) -> None:
        """Return ``cost`` staged bytes (and recycle ``buffer`` while within the budget)."""
        with self._mem:
            self._staged -= cost
            if buffer is not None and not self._closed and \
                    self._staged + self._pooled + cost <= self.memory_budget:
                self._pool.setdefault(cost, []).append(buffer)
                self._pooled += cost
            self._mem.notify_all()

    def stage(self, arrays: list[np.ndarray], owned: bool, held: int = 0
              ) -> tuple[list[np.ndarray], int, np.ndarray | None]:
        """Admit and copy ``arrays`` into one pool-owned buffer (64-byte aligned slices).
        With ``owned`` the arrays themselves are kept (no copy: the caller handed them
        over). ``held``: further bytes the caller holds for the record until it is
        released (deferred encodings), admitted with it. Returns (staged arrays, bytes to
        release, buffer to recycle)."""
        if owned or (held and not arrays):
            cost = sum(a.nbytes for a in arrays) + held
            self._admit(cost, pooled=False)
            return arrays, cost, None
        offsets = []
        total = 0
        for a in arrays:
            offsets.append(total)
            total = align_up(total + a.nbytes)
        if total == 0:  # (empty arrays; the deferred encodings' bytes still count)
            if held:
                self._admit(held, pooled=False)
            return [a.copy() for a in arrays], held, None
        size = size_class(total)
        cost = size + held
        # (with held bytes the buffer is not recycled: the pool keys buffers by their cost)
        buf = self._admit(cost, pooled=not held)
        try:
            if buf is None:
                buf = np.empty(size, np.uint8)
                with self._mem:
                    self._allocs += 1
            out = []
            mv = buf.data
            for a, off in zip(arrays, offsets, strict=True):
                n = a.nbytes
                dst = buf[off:off + n].view(a.dtype).reshape(a.shape)
                if a.flags.c_contiguous and n:
                    # memoryview copies keep the GIL (np.copyto drops it): the committer
                    # cannot slip in mid-append and make the caller wait to get it back.
                    src = a.data.cast("B")
                    for lo in range(0, n, _COPY_CHUNK):  # let other threads in between
                        hi = min(n, lo + _COPY_CHUNK)
                        mv[off + lo:off + hi] = src[lo:hi]
                else:
                    np.copyto(dst, a, casting="no")
                out.append(dst)
        except BaseException:
            self.release(cost, None)
            raise
        return out, cost, None if held else buf

    def stats(self) -> dict[str, float]:
        """``staged_bytes`` (now), ``staged_bytes_peak``, ``pooled_bytes``,
        ``memory_budget``, ``staging_allocs`` (buffers allocated rather than recycled),
        ``blocked_s`` (seconds ``stage`` waited for memory)."""
        with self._mem:
            return {"staged_bytes": self._staged, "staged_bytes_peak": self._peak,
                    "pooled_bytes": self._pooled, "memory_budget": self.memory_budget,
                    "staging_allocs": self._allocs, "blocked_s": self._blocked_s}

    def close(self) -> None:
        """Drop the free list; buffers released from now on are not recycled."""
        with self._mem:
            self._closed = True
            self._pool.clear()
            self._pooled = 0


__all__ = ["StagingPool", "budget_for", "size_class"]
