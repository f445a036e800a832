"""Copying a base beside the next forward and backward, into memory reused from base to base.

After the optimizer step of a base step t, parameters and optimizer state stay unchanged
until the next optimizer step (forward and backward read them; only the step writes them).
So the copy of a base does not have to stop training: :class:`CopyJob` copies the state in
pieces of at most :data:`PIECE` bytes on a helper thread (CUDA tensors: on a side stream
into pinned memory) while the training thread goes on, and the next optimizer step first
*settles* the job (:meth:`CopyJob.settle`): it copies the pieces nobody has started yet
itself, from the other end, and waits only for the pieces in progress. The writer is never
waited for.

The copies land in a :class:`StagingArea`: host buffers kept from one base to the next, so
only the first base pays for fresh pages (on the VM the benchmarks ran on, a copy into
fresh pages runs at ~0.44 GB/s, into touched ones at ~11 GB/s), within a byte budget. A
base that finds every buffer the budget allows still being written is put off to the next
step (:meth:`StagingArea.acquire` returns None) rather than waited for.

A tensor changed in place between the base step and the settle (a user's edit under
``torch.no_grad()``, a model averager run outside the optimizer step) could be copied half
before and half after the change. :meth:`CopyJob.settle` compares each tensor's version
counter with the one it had when the base was staged and reports such a base as not intact,
so the checkpointer drops it instead of writing a state that never existed. Changes that
bypass version counters (writes through ``.data`` or a NumPy view) are not seen; the
``base_staging="sync"`` option copies inside the step instead.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import mmap
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from ....errors import ConfigError, Reason
from ....format.checksum import crc32c, crc32c_combine
from ....format.framing import align_up

_log = logging.getLogger(__name__)

#: A copy is cut into pieces of at most this many bytes: the unit two threads share a
#: tensor in, and the longest a settle waits for a piece another thread started.
PIECE: Final = 16 << 20


#: With no budget given, bases smaller than this share it: several may be staged while
#: earlier ones are written (a larger state gets one buffer, one copy of the state).
SMALL_STATES: Final = 256 << 20


@dataclass(eq=False)  # (identity: two buffers are never "equal" by content)
class Slot:
    """One staging buffer: ``buf`` (uint8, ``capacity`` bytes; pinned when ``pinned``)."""

    buf: np.ndarray
    tensor: torch.Tensor
    capacity: int
    pinned: bool
    busy: bool = False
    touched: bool = False
    registered: list[int] = field(default_factory=list)  # pinned pieces' addresses
    #: unregisters ``registered`` if the buffer is freed without :func:`give_back`
    unpin_at_exit: weakref.finalize[Any, Any] | None = None


class StagingArea:
    """Host buffers for staged bases, reused from base to base, at most ``budget`` bytes in
    all (None: one buffer, as large as a base, or several within :data:`SMALL_STATES`).
    Thread-safe (the writer releases, the helper thread provides).

    The training thread never makes staging memory: :meth:`acquire` only hands out a
    buffer :meth:`provide` made (allocated, faulted in and, for device tensors,
    registered with the driver as pinned memory) on the helper thread beforehand. A
    base that finds none ready is put off, and the memory it needs is asked for
    (:meth:`want`)."""

    def __init__(self, budget: int | None = None) -> None:
        if budget is not None and budget < 1:
            raise ConfigError(f"staging_budget={budget} must be >= 1 byte or None",
                              reason=Reason.OUT_OF_BOUNDS)
        self.budget = budget
        self._slots: list[Slot] = []
        self._lock = threading.Condition()
        self.allocated = 0  # buffers allocated so far (fresh pages)
        #: the most bytes held at once, and of those registered as pinned
        self.peak = self.pinned_peak = 0
        #: moves whenever a buffer may have become available (made, released, or a
        #: request ended): see :meth:`wait_change`
        self.generation = 0
        self._wanted: tuple[int, bool] | None = None  # (bytes, pinned) asked for, not made
        #: buffers that could not be made (each time, the bases are put off)
        self.failures = 0
        self._said = False  # the last failure was said (until a buffer is made)

    def acquire(self, need: int, pinned: bool) -> Slot | None:
        """A free buffer of at least ``need`` bytes, ready (touched), now marked busy;
        None when there is none (the base waits for a later step: :meth:`want` says
        whether memory must be made for it). ``ConfigError`` when one base alone does not
        fit the budget. Never allocates."""
        self.check(need)
        with self._lock:
            fit = [s for s in self._slots if not s.busy and s.touched
                   and s.capacity >= need and s.pinned == pinned]
            if not fit:
                return None
            slot = min(fit, key=lambda s: s.capacity)
            slot.busy = True
            return slot

    def want(self, need: int, pinned: bool) -> bool:
        """Ask for a buffer of ``need`` bytes: True when a :meth:`provide` job must be
        queued on the helper thread (no free buffer fits and none is being made). While
        one is being made for less, the larger need is recorded and the job makes that
        too. False also when the budget is held by buffers still being written (a later
        release makes one free)."""
        self.check(need)
        with self._lock:
            if any(not s.busy and s.capacity >= need and s.pinned == pinned
                   for s in self._slots):
                return False
            if self._wanted is not None:
                if need > self._wanted[0] or pinned != self._wanted[1]:
                    self._wanted = (need, pinned)  # (the job running makes this one next)
                return False
            if self._room(need) is None:
                return False
            self._wanted = (need, pinned)
            return True

    def _room(self, need: int) -> int | None:
        """The capacity of a new buffer for ``need`` bytes beside the busy ones, or None
        when the budget has no room for it now (the caller holds the lock)."""
        held = sum(s.capacity for s in self._slots if s.busy)
        if self.budget is None:
            return None if held and held + grow(need) > SMALL_STATES else grow(need)
        return None if self.budget - held < need else min(grow(need), self.budget - held)

    def provide(self) -> None:
        """Make the buffer :meth:`want` asked for (call on the helper thread): free
        buffers too small or of the other kind are let go, a new one is allocated within
        the budget, faulted in and (``pinned``) registered; then it can be acquired. A
        buffer that cannot be made (the host is out of memory) is asked for again by the
        next base, which is put off meanwhile: said once in a warning (nobody waits for
        this job's result), counted in :attr:`failures`."""
        while True:
            with self._lock:
                wanted = self._wanted
                if wanted is None:
                    return
                need, pinned = wanted
                fits = any(not s.busy and s.capacity >= need and s.pinned == pinned
                           for s in self._slots)
                gone = [s for s in self._slots if not s.busy and not fits]
                for s in gone:
                    self._slots.remove(s)  # too small or of the other kind: let it go
                cap = None if fits else self._room(need)
                if cap is None:  # (a buffer fits, or the budget is held meanwhile)
                    self._wanted = None
                    self.generation += 1
                    self._lock.notify_all()
            if cap is None and not gone:
                return
            try:
                for s in gone:  # outside the lock, which the training thread takes
                    give_back(s)
                del gone
                if cap is None:
                    return
                slot = new_slot(cap, pinned)
                self.touch(slot)
                if pinned:
                    pin(slot)
            except BaseException as e:
                with self._lock:
                    self._wanted = None
                    self.failures += 1
                    self.generation += 1
                    self._lock.notify_all()
                if not isinstance(e, Exception):
                    raise
                if not self._said:
                    self._said = True
                    _log.warning("lowdiff-store: staging memory for a base (%d bytes) could "
                                 "not be made (%s: %s); bases are put off until it can (or let a "
                                 "worker process make them from the log: "
                                 "base_mode='background')",
                                 cap or need, type(e).__name__, e)
                return
            self._said = False
            with self._lock:
                self._slots.append(slot)
                self.allocated += 1
                self.peak = max(self.peak, self._held())
                self.pinned_peak = max(self.pinned_peak, self._pinned())
                self.generation += 1
                self._lock.notify_all()
                if self._wanted == wanted:
                    self._wanted = None
                    return

    def wait_made(self, timeout: float | None = None) -> bool:
        """Wait until no buffer asked for is still being made (tests and benchmarks that
        want every base on time); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._wanted is None, timeout)

    def waiting(self, need: int) -> bool:
        """No free, touched buffer holds ``need`` bytes and none can be asked for now: one
        for at least ``need`` bytes is being made, or the budget is held by buffers still
        being written. A base of at least ``need`` bytes can only be put off (the caller
        need not list its arrays to find that out)."""
        with self._lock:
            if any(not s.busy and s.touched and s.capacity >= need for s in self._slots):
                return False
            if self._wanted is not None:
                return self._wanted[0] >= need
            return self._room(need) is None

    def ready_for(self, need: int) -> bool:
        """Some buffer of at least ``need`` bytes exists (free or busy), or one is being
        made: nothing to ask for."""
        with self._lock:
            return (self._wanted is not None and self._wanted[0] >= need) or \
                any(s.capacity >= need for s in self._slots)

    def check(self, need: int) -> None:
        """``ConfigError`` when a base of ``need`` bytes alone does not fit the budget."""
        if self.budget is not None and need > self.budget:
            raise ConfigError(
                f"a base needs {need} bytes of staging but staging_budget={self.budget}: "
                f"raise staging_budget to at least {need} (one copy of the state), or let a "
                f"worker process make the bases from the log (base_mode='background')",
                reason=Reason.OUT_OF_BOUNDS)

    def release(self, slot: Slot) -> None:
        """``slot``'s base was written (or dropped): the buffer may be reused."""
        with self._lock:
            slot.busy = False
            self.generation += 1
            self._lock.notify_all()

    def wait_change(self, seen: int, timeout: float) -> bool:
        """Wait until :attr:`generation` is no longer ``seen`` (a buffer was made or
        released, or a request ended); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self.generation != seen, timeout)

    def close(self) -> None:
        """Let go of every buffer no base is being written from (:func:`give_back`)."""
        with self._lock:
            gone = [s for s in self._slots if not s.busy]
            self._slots = [s for s in self._slots if s.busy]
        for s in gone:
            give_back(s)

    @property
    def capacity(self) -> int:
        """Bytes held by the buffers now."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return sum(s.capacity for s in self._slots)

    def _pinned(self) -> int:
        """Bytes of the buffers registered with the CUDA driver (copies into them are
        asynchronous; a buffer the driver refused stays pageable)."""
        return sum(min(s.capacity, len(s.registered) * PIN_PIECE) for s in self._slots)

    @staticmethod
    def touch(slot: Slot) -> None:
        """Fault in ``slot``'s pages now (on the helper thread, before a base needs them,
        so its copy runs at the speed of touched memory): one
        ``madvise(MADV_POPULATE_WRITE)`` where the kernel has it (Linux >= 5.14, ~1.7x
        faster than faulting page by page), else a write to every page."""
        if not slot.touched:
            for lo, hi in pin_spans(0, slot.capacity):  # paced pieces (see PACE)
                t0 = time.perf_counter()
                if not populate(slot.buf[lo:hi]):
                    slot.buf[lo:hi:4096] = 0
                _pause(t0)
            slot.touched = True


_MADV_DONTNEED: Final = 4
_MADV_POPULATE_WRITE: Final = 23


def _madvise(start: int, length: int, advice: int) -> bool:
    """``madvise(start, length, advice) == 0`` through ctypes (which lets go of the GIL
    during the call); False where the platform has no such call."""
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    return int(libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)) == 0


def populate(buf: np.ndarray) -> bool:
    """Make the pages of ``buf`` resident and writable in one system call; False where
    the kernel (or platform) cannot, leaving them as they were."""
    if buf.nbytes < mmap.PAGESIZE:
        return False
    start = buf.ctypes.data & ~(mmap.PAGESIZE - 1)
    return _madvise(start, buf.ctypes.data + buf.nbytes - start, _MADV_POPULATE_WRITE)


def discard(buf: np.ndarray) -> bool:
    """Give the whole pages inside ``buf`` back to the kernel (``MADV_DONTNEED``: they
    read as zeros afterwards). Only for memory about to be freed: freeing a buffer of
    many gigabytes unmaps its pages inside one call that holds the GIL (the training
    thread waits ~90 ms per GB on the VM the benchmarks ran on, see
    ``bench/probe_free.py``), while this call lets go of it."""
    page = mmap.PAGESIZE
    start = (buf.ctypes.data + page - 1) & ~(page - 1)
    end = (buf.ctypes.data + buf.nbytes) & ~(page - 1)
    return _madvise(start, end - start, _MADV_DONTNEED)


def give_back(slot: Slot) -> None:
    """Let go of a staging buffer nobody reads any more, in paced pieces, as it was made:
    unregister its pinned pieces from the CUDA driver (each call holds the driver's
    lock, which the training thread's launches wait for: 12 GB unregistered back to back
    would stall them for seconds), then give its pages back to the kernel
    (:func:`discard`, one piece per call: each holds the process's memory-map lock only
    shortly, in read mode), so that the last reference dropped unmaps no page while
    holding the GIL. Call it outside any lock the training thread takes (and, during
    training, on another thread)."""
    unpin(slot)
    for lo, hi in pin_spans(0, slot.capacity):
        if not discard(slot.buf[lo:hi]):
            break
    slot.touched = False


def grow(need: int) -> int:
    """The capacity of a staging buffer made for ``need`` bytes."""
    # room for a little growth (a buffer resized, a late optimizer state) without a new
    # buffer; the memory is asked for once the state is complete (BaseStager.prepare), so
    # 1/64 (was 1/16: 0.7 GB of pinned memory at 0.94B parameters with AdamW and top-k)
    return align_up(need + need // 64)


def new_slot(capacity: int, pinned: bool) -> Slot:
    """A staging buffer of ``capacity`` bytes, pageable host memory (not touched yet).
    Made on the helper thread only; a pinned one is registered after its first touch
    (:func:`pin`), not allocated by the CUDA host allocator (which would round 11.3 GB up
    to 16 GB and hold the driver's lock for the whole allocation)."""
    t = torch.empty(capacity, dtype=torch.uint8)
    return Slot(t.numpy(), t, capacity, pinned)


#: staging memory is faulted in and registered with the driver in pieces of this many
#: bytes: each ``madvise`` holds the process's memory-map lock, each ``cudaHostRegister``
#: the driver's, and the training thread's allocations and launches wait for them. On an
#: H100 two steps stalled for 5-12 s while 12 GB buffers were made in 256 MiB pieces back
#: to back; a 64 MiB piece takes tens of milliseconds, which the GPU's queue of launched
#: work hides.
PIN_PIECE = 64 << 20
#: after each piece the helper thread pauses this many times the piece's own time, so the
#: locks are free at least half the time while a buffer is made (it is made ahead of the
#: base that needs it; a base due meanwhile is put off)
PACE = 1.0


def _pause(t0: float) -> None:
    """Sleep :data:`PACE` times the time since ``t0`` (the piece just done)."""
    if PACE > 0:
        time.sleep(PACE * (time.perf_counter() - t0))


def pin(slot: Slot) -> None:
    """Register ``slot``'s (touched) memory as pinned with the CUDA driver, in paced pieces
    of :data:`PIN_PIECE` bytes (``cudaHostRegister``; unregistered when the buffer is freed),
    so copies from the device into it run asynchronously at full speed. Where the driver
    refuses, the buffer stays pageable: copies into it are correct, only synchronous."""
    cudart = torch.cuda.cudart()
    base = slot.tensor.data_ptr()
    done: list[int] = []
    for lo, hi in pin_spans(0, slot.capacity):
        t0 = time.perf_counter()
        if int(cudart.cudaHostRegister(base + lo, hi - lo, 0)) != 0:
            break
        done.append(base + lo)
        _pause(t0)
    if done:
        slot.registered = done
        slot.unpin_at_exit = weakref.finalize(slot.tensor, _unpin, done)


def unpin(slot: Slot) -> None:
    """Unregister ``slot``'s pinned pieces from the CUDA driver, one piece at a time with
    a pause after each (see :data:`PACE`); copies into it are synchronous from then on."""
    done, slot.registered = slot.registered, []
    if slot.unpin_at_exit is not None:
        slot.unpin_at_exit.detach()  # (never unregistered twice)
        slot.unpin_at_exit = None
    if not done:
        return
    cudart = torch.cuda.cudart()
    for p in done:
        t0 = time.perf_counter()
        cudart.cudaHostUnregister(p)
        _pause(t0)


def pin_spans(lo: int, n: int, piece: int | None = None) -> list[tuple[int, int]]:
    """Bytes ``lo:lo + n`` of a staging buffer cut at the boundaries of its pinned pieces
    (multiples of ``piece``): the driver refuses an asynchronous copy whose host range
    spans two ``cudaHostRegister`` registrations ("invalid argument", seen on an H100),
    so each device copy into a buffer pinned by :func:`pin` stays inside one piece."""
    piece = piece or PIN_PIECE
    spans = []
    hi = lo + n
    while lo < hi:
        end = min(hi, (lo // piece + 1) * piece)
        spans.append((lo, end))
        lo = end
    return spans


def _unpin(ptrs: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for p in ptrs:
        cudart.cudaHostUnregister(p)


@dataclass
class Piece:
    """Bytes ``lo:hi`` of ``src`` copied to ``dst`` (flat uint8 arrays); ``crc``: the
    CRC32C of the copied bytes, computed right after the copy (they are in cache)."""

    src: Any
    dst: Any
    lo: int
    hi: int
    crc: int = 0


@dataclass
class CopyJob:
    """The copy of one base: ``pieces`` (host to host, shared by the helper thread from the
    front and the settling thread from the back), ``events`` (CUDA copies already queued on
    a side stream) and ``watch`` (each live tensor with its version counter when staged)."""

    pieces: list[Piece]
    watch: list[tuple[str, torch.Tensor, int]]
    events: list[Any] = field(default_factory=list)
    #: tensor name -> its pieces in order (for its CRC32C)
    groups: dict[str, list[Piece]] = field(default_factory=dict)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _front: int = 0
    _back: int = -1
    _busy: int = 0
    _error: BaseException | None = None
    _settled: bool | None = None
    changed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._back = len(self.pieces) - 1

    def _claim(self, front: bool) -> Piece | None:
        with self._cond:
            if self._front > self._back:
                return None
            if front:
                i, self._front = self._front, self._front + 1
            else:
                i, self._back = self._back, self._back - 1
            self._busy += 1
            return self.pieces[i]

    def _done(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._busy -= 1
            if error is not None and self._error is None:
                self._error = error
            self._cond.notify_all()

    def work(self, front: bool = True) -> None:
        """Copy unclaimed pieces (from the front or the back) until none is left."""
        while (p := self._claim(front)) is not None:
            try:
                np.copyto(p.dst[p.lo:p.hi], p.src[p.lo:p.hi])
                p.crc = crc32c(p.dst[p.lo:p.hi])
            except BaseException as e:
                self._done(e)
                raise
            self._done()

    def crcs(self) -> dict[str, int]:
        """The CRC32C of each tensor in :attr:`groups` (call after :meth:`settle`)."""
        out = {}
        for name, ps in self.groups.items():
            value = 0
            for p in ps:
                value = crc32c_combine(value, p.crc, p.hi - p.lo)
            out[name] = value
        return out

    def copied(self) -> bool:
        """The device copies queued on the side stream are complete (no wait)."""
        return all(ev.query() for ev in self.events)

    @property
    def pending(self) -> bool:
        """Some piece is not copied yet."""
        with self._cond:
            return self._busy > 0 or self._front <= self._back

    def settle(self, on_device: bool = True) -> bool:
        """Finish the copy (helping, then waiting for pieces in progress), make the device
        copies ordered before what the current stream runs next (``on_device``; else wait
        for them on the host), and say whether every tensor is as it was when staged.
        Idempotent; raises what a copy raised."""
        if self._settled is None:
            self.work(front=False)
            with self._cond:
                while self._busy:
                    self._cond.wait()
                if self._error is not None:
                    raise self._error
            self.changed = [n for n, t, v in self.watch if t._version != v]
            self._settled = not self.changed
        if self.events:
            if on_device:
                stream = torch.cuda.current_stream()
                for ev in self.events:
                    stream.wait_event(ev)
            else:
                for ev in self.events:
                    ev.synchronize()
        return self._settled

    def abandon(self) -> None:
        """Nobody will read this copy: the pieces not started are not copied, and this
        returns once the pieces in progress and the device copies (waited for on the host)
        ended, so its staging memory can be reused or let go."""
        with self._cond:
            self._front = self._back + 1
            while self._busy:
                self._cond.wait()
        for ev in self.events:
            ev.synchronize()


class Later:
    """``fn()`` computed on the helper thread from ``tensors`` that nothing may change
    until :meth:`settle` (a digest of the state after a step)."""

    def __init__(self, fn: Callable[[], Any], tensors: list[torch.Tensor],
                 thread: CopyThread | None) -> None:
        # computed now (no thread): what changes later is not in it
        self.watch = [(t, t._version) for t in tensors] if thread is not None else []
        self._fn = fn
        self._fut = thread.submit(fn) if thread is not None else None
        self._value: Any = None if self._fut is not None else fn()

    def settle(self) -> tuple[bool, Any]:
        """(nothing in ``tensors`` changed meanwhile, the value); raises what ``fn`` did."""
        value = self._fut.result() if self._fut is not None else self._value
        return all(t._version == v for t, v in self.watch), value


class CopyThread:
    """The helper thread that runs copy jobs (and first touches of staging buffers)."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the helper thread (started on first use)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="lowdiff-stage")
        return self._pool.submit(fn)

    def close(self) -> None:
        """Stop the thread once its queue is done (without waiting)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def plan_pieces(src: np.ndarray, dst: np.ndarray) -> list[Piece]:
    """The pieces of copying flat uint8 ``src`` into ``dst``."""
    n = src.nbytes
    return [Piece(src, dst, lo, min(n, lo + PIECE)) for lo in range(0, n, PIECE)]


__all__ = ["PIECE", "PIN_PIECE", "SMALL_STATES", "CopyJob", "CopyThread", "Later", "Piece",
           "Slot", "StagingArea", "discard", "give_back", "grow", "new_slot", "pin",
           "plan_pieces", "populate", "unpin"]
