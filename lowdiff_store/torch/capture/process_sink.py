"""The writer as a process (``writer_process=True``): :class:`ProcessSink` is a :class:`~lowdiff_
store.torch.capture.sink.Sink` whose log is written by a writer process
(:class:`~lowdiff_store.writer.ring_client.RingClient`), fed through one shared ring.

What the training thread does per step at hand-over: one copy of the step into the ring
(the step batch's flat host buffers as they are; the dense gradients' bits with one
``torch.cat`` per dtype straight into the ring; the small tensors of the side channel),
one msgpack table (the *recipe* of every compressor message:
its op, the slots it reads, a few values; ``format_spec/ring.md``, section 3.1) and one
16-byte ``send``. The writer process runs the recipes (the batched sort of the step's top-k
pairs, the index gaps, bit packing: :mod:`lowdiff_store.codecs.batch`, the same functions
the encoder thread runs otherwise), then zstd, the CRCs, the writes, fsyncs and manifest
commits, off this process's GIL. The record's bytes are the in-thread writer's, byte for
byte.

That copy runs on this sink's step thread (``lowdiff-ring-step``), not on the training
thread: :meth:`ProcessSink.append` freezes the record's metadata, queues the copy and
returns. The step thread waits for the step's device-to-host copies (CUDA events: the
training thread never waits for them), copies into the ring and runs the record's
``done`` (its host buffers and place in flight go back). At most :data:`MAX_QUEUED`
records wait for that thread; the next hand-over waits for the oldest (counted:
``ring_append_waits``), so a full ring still makes training wait, never grows memory.
A copy that fails is raised by the next call, and every later record is refused (the
log would skip a step).

A base goes through the ring too: whole when it takes at most half the ring, else in
pieces that the writer process writes into the base file as they come
(``format_spec/ring.md``, section 3.2), copied on this sink's base thread
(``lowdiff-ring-base``), after the records handed over before it, so that neither the
hand-over nor the steps after it wait for the base (their records go into the ring between
its pieces). The ring is sized at open for two records in flight (:func:`ring_size`;
``ring_bytes`` overrides), never from the state.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError, LowdiffError, Reason
from ...format.dtypes import itemsize
from ...writer.async_writer import freeze_map, thaw_map
from ...writer.deferred import DeferredEncoding
from ...writer.ring import MAX_SLOT_SIZE, MAX_SLOTS, RingBatch, RingTensor
from ...writer.ring_client import RingClient
from ..core.specs import Spec
from ..core.step_batch import BatchEncoding, SparseSlot, StepBatch
from ..core.tensors import bits_tensor

#: records handed over whose copy into the ring has not ended, at most (the next
#: hand-over waits for the oldest)
MAX_QUEUED = 2
#: a ring holds at least this much, beside room for two records (see :func:`ring_size`)
MIN_RING_BYTES = 16 << 20
#: the slot size of a ring (larger where the ring would need more than the most slots)
SLOT_BYTES = 1 << 20

#: torch dtype of a tensor's bits (``bits_tensor``) -> the tag of its ring buffer
_TORCH_TAG = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
#: numpy dtype of a step batch's host buffer -> the tag the ring carries it as
_TAG_OF = {np.dtype(k): v for k, v in (
    ("<f8", "F64"), ("<f4", "F32"), ("<f2", "F16"), ("<i8", "I64"), ("<i4", "I32"),
    ("<i2", "I16"), ("i1", "I8"), ("<u8", "U64"), ("<u4", "U32"), ("<u2", "U16"),
    ("u1", "U8"), ("?", "BOOL"))}


def ring_size(meta: Mapping[str, Any], ring_bytes: int | None) -> tuple[int, int]:
    """(slots, slot size) of the ring for a log of ``meta`` (the torch metadata): room for
    two records in flight (:func:`record_bytes`) beside :data:`MIN_RING_BYTES`;
    ``ring_bytes`` when given. Bases are not counted: one larger than half the ring goes
    through it in pieces (``RingClient.put_base``), so no ring is sized by the state."""
    if ring_bytes is None:
        ring_bytes = MIN_RING_BYTES + 2 * record_bytes(meta)
    if ring_bytes > MAX_SLOTS * MAX_SLOT_SIZE:
        raise ConfigError(f"ring_bytes={ring_bytes} is more than the largest ring "
                          f"({MAX_SLOTS * MAX_SLOT_SIZE} bytes)", reason=Reason.LIMIT_EXCEEDED)
    slot = SLOT_BYTES
    while -(-ring_bytes // slot) > 65536:
        slot *= 2
    return max(2, -(-ring_bytes // slot)), slot


def record_bytes(meta: Mapping[str, Any]) -> int:
    """A bound on one record's bytes in the ring for a log of ``meta``: every tensor of the
    model, whole (a dense gradient or weight diff per parameter, and the buffers that
    changed); with a top-k compressor, its messages in place of the parameters' (int32
    indices and values of ``ratio`` of each parameter's elements, rounded up)."""
    sizes = {n: (math.prod(shape), itemsize(tag)) for n, tag, shape in meta["model"]}
    total = sum(n * b for n, b in sizes.values())
    comp = meta.get("compressor") or {}
    ratio = comp.get("ratio")
    if comp.get("kind") == "topk" and isinstance(ratio, (int, float)) and 0 < ratio <= 1:
        for name in meta["params"]:
            n, b = sizes.get(name, (0, 0))
            total += math.ceil(n * ratio) * (4 + b) + 256 - n * b
    return int(total)


class ProcessSink:
    """Records and bases of one log, written by a writer process (module docstring); the
    interface of :class:`~lowdiff_store.torch.capture.sink.Sink`. ``existed``: the log
    may hold steps (else opening does not wait for the writer process to start)."""

    def __init__(self, path: str, *, meta: Mapping[str, Any], batch: int,
                 options: Mapping[str, Any], ring_bytes: int | None = None,
                 existed: bool = True, nice: int = 0) -> None:
        slots, slot_size = ring_size(meta["torch"], ring_bytes)
        # A new log: nothing to learn from it, so training starts while the writer process
        # imports and opens it (the first steps queue in the ring); an existing one is
        # waited for (its newest step and base decide what happens next).
        self._c = RingClient(path, slots=slots, slot_size=slot_size, meta=dict(meta),
                             batch=batch, wait_ready=existed, nice=nice, **options)
        self._batch = batch
        last = self._c.published_base if existed else -1
        self._found = [last] if last >= 0 else []  # (the log's newest base at open)
        self._put: list[int] = []
        self._bits: tuple[object, int] = (None, 0)  # the changed-bits state and its number
        self._owner = os.getpid()  # (a fork's copy has no copy threads)
        #: the thread copying bases into the ring, and the base it copies
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._copy: concurrent.futures.Future[None] | None = None
        #: the thread copying records into the ring, and the copies queued or running
        self._stepper: concurrent.futures.ThreadPoolExecutor | None = None
        self._steps: collections.deque[concurrent.futures.Future[None]] = collections.deque()
        self._handed = -1  # the newest step handed over
        #: the first copy that failed: raised by every later call (no step may be skipped)
        self._failure: BaseException | None = None
        self._waits = {"append_waits": 0.0, "append_wait_s": 0.0}

    @property
    def pid(self) -> int:
        """The writer process's id."""
        return self._c.pid

    @property
    def bases(self) -> list[int]:
        """Steps of the bases handed over (this run's, and the newest found at open), but
        for one the writer process skipped (the store did not answer). A base handed over
        counts at once: the writer process writes it unless it fails, which the next call
        raises; :attr:`durable_step` waits for a base actually published."""
        skipped = self._c.skipped_base
        return self._found + [b for b in self._put if b != skipped]

    @property
    def last_step(self) -> int:
        """Newest step appended (or base written); -1 for an empty log. A step counts once
        :meth:`append` returns, before its copy into the ring (:attr:`ring_step`)."""
        return max(self._c.last_step, self._handed)

    @property
    def ring_step(self) -> int:
        """Newest step (record or base) whose copy is in the ring; -1 for none. What the
        writer process still makes durable if this process is killed now: a step handed
        over after it (at most :data:`MAX_QUEUED` records, and a base being copied) is
        still in this process's memory, lost with it, never durable. :meth:`settle`
        waits until every step handed over is in the ring."""
        return self._c.last_step

    @property
    def durable_step(self) -> int | None:
        """Newest step durable with every step before it, and reachable from a base."""
        d = self._c.durable_step
        return None if d is None or self._c.published_base < 0 else d

    def append(self, step: int, specs: Sequence[Spec], *, kind: str, side: Mapping[str, Any],
               extra: Mapping[str, Any], done: Callable[[], None] | None = None) -> None:
        """Hand the record of ``step`` to the step thread, which copies it into the ring
        (module docstring); ``done`` runs once the copy is made or failed (the arrays of
        ``specs`` are free again). Waits while :data:`MAX_QUEUED` copies are queued."""
        def copy() -> None:
            try:
                if self._failure is None:
                    tensors, rb = self._layout(specs)
                    self._c.put_step(step, kind, tensors, side=thaw_map(frozen[0]) or {},
                                     extra=thaw_map(frozen[1]) or {}, batch=rb)
            except BaseException as e:
                if self._failure is None:
                    self._failure = e
                raise
            finally:
                if done is not None:
                    done()
        try:
            self._check_copy()
            frozen = freeze_map(side, "side"), freeze_map(extra, "extra")
            self._room()
            if self._stepper is None:
                self._stepper = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="lowdiff-ring-step")
            self._steps.append(self._stepper.submit(copy))
        except BaseException:  # (not queued: the arrays are free again)
            if done is not None:
                done()
            raise
        self._handed = max(self._handed, step)

    def _room(self) -> None:
        """Wait until fewer than :data:`MAX_QUEUED` record copies are queued (counted);
        raise a copy that failed meanwhile."""
        steps = self._steps
        while steps and steps[0].done():
            steps.popleft()
        if len(steps) >= MAX_QUEUED:
            t0 = time.perf_counter()
            self._waits["append_waits"] += 1
            while len(steps) >= MAX_QUEUED:
                concurrent.futures.wait([steps.popleft()])
            self._waits["append_wait_s"] += time.perf_counter() - t0
            self._raise_failed()

    def _layout(self, specs: Sequence[Spec]) -> tuple[list[RingTensor], RingBatch | None]:
        """The record's explicit tensors, and its step batches' buffers and recipes (per
        tensor: one tuple, packed by msgpack as it is; the per-batch work is done once)."""
        tensors: list[RingTensor] = []
        rb = RingBatch()
        keymaps: dict[int, dict[Any, int]] = {}  # batch -> its buffer keys' numbers
        dense: dict[torch.dtype, list[tuple[int, Spec, torch.Tensor]]] = {}
        recipes = rb.recipes
        at = 0
        for s in specs:
            enc = s.enc
            msg = enc.msg if isinstance(enc, BatchEncoding) else None
            how = _HOW.get(type(msg)) if msg is not None else None
            if how is None and msg is not None:
                how = _HOW[type(msg)] = ("dense" if hasattr(msg, "host_tensor") else
                                         "recipe" if hasattr(msg, "recipe") else "encode")
            if how == "recipe" and enc.batch is not None:  # type: ignore[union-attr]
                b = enc.batch  # type: ignore[union-attr]
                keymap = keymaps.get(id(b))
                if keymap is None:
                    keymap = keymaps[id(b)] = self._add_batch(rb, b)
                op, slots, params = msg.recipe()  # type: ignore[union-attr]
                if op == "changed":
                    self._changed(rb, getattr(msg, "last", None))
                recipes.append((at, s.name, s.tag, s.shape, s.zstd, op,
                                tuple(_wire(x, keymap) for x in slots), params))
                at += 1
                continue
            if how == "dense":
                b = enc.batch  # type: ignore[union-attr]
                if b is not None and id(b) not in keymaps:
                    keymaps[id(b)] = {}  # (CUDA: its copies into pinned memory)
                    b.wait_copies()
                t = bits_tensor(msg.host_tensor(), s.name)[1]  # type: ignore[union-attr]
                dense.setdefault(t.dtype, []).append((at, s, t))
                at += 1
                continue
            e = enc.encode() if isinstance(enc, DeferredEncoding) else enc
            if e is None:  # (left out of the record)
                continue
            tensors.append(RingTensor(s.name, s.tag, tuple(s.shape),
                                      tuple((p.dtype, p.data) for p in e.parts), e.codec,
                                      dict(e.params), s.zstd))
            at += 1
        for group in dense.values():
            self._add_dense(rb, group)
        return tensors, (rb if rb.recipes else None)

    @staticmethod
    def _add_dense(rb: RingBatch, group: list[tuple[int, Spec, torch.Tensor]]) -> None:
        """Host tensors logged ``raw`` (dense gradients), one dtype: ONE buffer of the
        ring, filled by one ``torch.cat`` straight into it when the message is written,
        and a ``bits`` recipe per tensor."""
        flats = [t.reshape(-1) for _a, _s, t in group]
        dtype = flats[0].dtype
        size = flats[0].element_size()
        buf = len(rb.buffers) + len(rb.fills)
        off = 0
        for (a, s, _t), f in zip(group, flats, strict=True):
            n = f.numel()
            rb.recipes.append((a, s.name, s.tag, s.shape, s.zstd, "bits", ((buf, off, n),),
                               (s.tag,)))
            off += n

        def fill(view: memoryview) -> None:
            dst = torch.frombuffer(view, dtype=torch.uint8).view(dtype)
            torch.cat(flats, out=dst)
            del dst  # (the ring's view is released once the tensor is gone)
        rb.fills.append((_TORCH_TAG[dtype], off * size, fill))

    def _add_batch(self, rb: RingBatch, b: StepBatch) -> dict[Any, int]:
        """Put the host buffers of ``b`` into ``rb`` (after its copies ended); returns
        the number of each buffer key."""
        arrays, sorts, layouts, _constants = b.layout(wait=True)
        keymap: dict[Any, int] = {}
        for key, arr in arrays.items():
            keymap[key] = len(rb.buffers)
            rb.buffers.append((_TAG_OF[arr.dtype], arr.reshape(-1)))
        rb.sorts.extend((keymap[i], keymap[v], lay) for i, v, lay in sorts)
        rb.layouts.extend((keymap[i], lay) for i, lay in layouts.items() if i in keymap)
        return keymap

    def _changed(self, rb: RingBatch, last: Any) -> None:
        """Number the changed-bits state ``last`` (a dict name -> (tag, bytes) the
        capture made); a new one is sent with what it holds (the bits the comparisons
        start from: the buffers as the first base has them), and the writer process
        forgets the previous one."""
        obj, gen = self._bits
        if last is not obj:
            gen += 1
            self._bits = (last, gen)
            for name, (tag, arr) in (last or {}).items():
                rb.seeds.append((name, tag, len(rb.buffers)))
                rb.buffers.append(("U8", np.ascontiguousarray(arr).reshape(-1).view(np.uint8)))
        rb.bits_gen = gen

    def write_base(self, step: int, tensors: Mapping[str, tuple[str, np.ndarray]],
                   meta: Mapping[str, Any], release: Callable[[], None],
                   crcs: Mapping[str, int] | None = None) -> None:
        """Copy the base of ``step`` into the ring (the writer process checksums it as it
        writes), on this sink's copy thread: the caller goes on (its steps go into the
        ring between the base's pieces), and ``release()`` runs once the copy is made,
        which is what a caller reading live tensors waits for before they change. One
        base at a time: a second waits for the first's copy. A failure of the copy is
        raised by the next call."""
        self._settle_base()
        self._raise_failed()
        arrays = {n: (tag, np.ascontiguousarray(a).reshape(a.shape))
                  for n, (tag, a) in tensors.items()}
        before = list(self._steps)  # the records handed over first go into the ring first

        def copy() -> None:
            try:
                concurrent.futures.wait(before)
                if self._failure is None:
                    self._c.put_base(step, arrays, meta)
            finally:
                release()
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="lowdiff-ring-base")
        try:
            self._copy = self._copier.submit(copy)
        except BaseException:
            release()
            raise
        self._put.append(step)

    def _settle_base(self) -> None:
        """Wait for the base being copied into the ring; raise its failure. (A fork's copy
        of this sink has no copy threads: nothing to wait for, and the client refuses it.)"""
        fut, self._copy = self._copy, None
        if fut is not None and os.getpid() == self._owner:
            fut.result()

    def settle(self) -> None:
        """Wait until every record and base handed over is in the ring (then the writer
        process makes them durable even if this process is killed; :attr:`ring_step` is
        :attr:`last_step`), without waiting for the disk; raise the first copy that
        failed."""
        if os.getpid() == self._owner:
            concurrent.futures.wait(self._steps)
        self._steps.clear()
        self._settle_base()
        self._raise_failed()

    def _raise_failed(self) -> None:
        """Raise the first copy that failed (in a fork's copy: nothing, the copies were
        the parent's)."""
        if self._failure is not None and os.getpid() == self._owner:
            raise self._failure

    def _check_copy(self) -> None:
        """Raise the failure of a copy that ended (without waiting for one)."""
        self._raise_failed()
        fut = self._copy
        if fut is not None and fut.done():
            self._settle_base()

    def flush(self) -> int | None:
        """Block until everything handed over is durable; returns the durable step."""
        self.settle()
        self._c.flush()
        return self.durable_step

    def truncate_after(self, step: int) -> int:
        """Discard every record and base after ``step``; returns the records dropped."""
        self.settle()
        out = self._c.put_meta(truncate_after=step)
        top = self._c.published_base
        self._found = [top] if top >= 0 else []
        self._put = [b for b in self._put if b <= step]
        return out

    def update_meta(self, meta: Mapping[str, Any]) -> None:
        """Merge keys into the log-level metadata."""
        self.settle()
        self._c.put_meta(meta=meta)

    def stats(self) -> dict[str, float]:
        """The writer process's counters (as last published), the ring's (``ring_puts``,
        ``ring_bytes``, ``ring_waits``, ``ring_wait_s``, ``ring_put_s``, ``ring_start_s``,
        ...), ``durable_step`` and ``process``: 1.0."""
        out = self._c.writer_stats()
        out.update({k if k.startswith("ring_") else f"ring_{k}": v
                    for k, v in self._c.stats().items() if k != "durable_step"})
        out.update({f"ring_{k}": v for k, v in self._waits.items()})
        d = self._c.durable_step
        out["durable_step"] = -1 if d is None else d
        out["process"] = 1.0
        return out

    def set_batch(self, batch: int) -> None:
        """Records per group commit from now on."""
        self._check_copy()
        self._c.put_meta(batch=batch)
        self._batch = batch

    @property
    def batch(self) -> int:
        """Records per group commit in force."""
        return self._batch

    def close(self) -> None:
        """Flush, close the log, wait for the writer process to exit. Idempotent."""
        if os.getpid() != self._owner:  # a fork's copy: the copy threads are the parent's
            self._copy = self._copier = self._stepper = None
            self._steps.clear()
            self._c.close()
            return
        try:
            self.settle()  # (a failed copy is raised here once: the next close is quiet)
        finally:
            self._stop_copier()
            self._failure = None
            self._c.close()

    def _stop_copier(self) -> None:
        for pool in (self._stepper, self._copier):
            if pool is not None:
                pool.shutdown(wait=True)
        self._stepper = self._copier = None

    def close_quietly(self) -> None:
        """Close after the owner was dropped without ``close()``: a failure is not raised."""
        try:
            self.close()
        except (LowdiffError, OSError):
            pass


def _wire(x: Any, keymap: Mapping[Any, int]) -> tuple[Any, ...]:
    """A slot (or sparse slot) as the ring carries it."""
    if type(x) is SparseSlot:
        i, v = x.idx, x.values
        return ((keymap[i.key], i.offset, i.numel), (keymap[v.key], v.offset, v.numel),
                x.base, x.sorted)
    return (keymap[x.key], x.offset, x.numel)


#: how a message type reaches the ring: "recipe", "dense" (bits of a host tensor) or
#: "encode" (encoded here)
_HOW: dict[type, str] = {}


__all__ = ["MAX_QUEUED", "MIN_RING_BYTES", "SLOT_BYTES", "ProcessSink", "record_bytes", "ring_size"]
