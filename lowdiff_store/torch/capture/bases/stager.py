"""Staging a base from the live objects: the full state after a step, laid out as
:func:`~lowdiff_store.torch.replay.materialize.materialize_base` lays out a base made from
the log, copied beside the next forward and backward (:mod:`.copy`) and handed to the
writer, which gives the staging memory back once the base is written."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ....format.dtypes import storage_dtype
from ....format.framing import align_up
from ...core import schema as L
from ...core.state_digest import digest_state
from ...core.tensors import bits_tensor, bits_view, local_of, shares_memory
from ...replay.materialize import live_base_arrays, residual_tensors
from ..grad_capture import DigestSource, GradSource
from ..layout import Partition
from ..options import CheckpointerOptions
from .copy import (
    CopyJob,
    CopyThread,
    Later,
    Piece,
    Slot,
    StagingArea,
    grow,
    pin_spans,
    plan_pieces,
)

_log = logging.getLogger(__name__)


@dataclass
class StagedBase:
    """The state after ``step``: ``arrays`` (name -> (dtype tag, array)), ``opt`` (the
    optimizer's layout and non-tensor state for the base metadata), ``nbytes``; ``job``
    (the copy, settled before the state changes) and ``slot`` (its staging buffer), None
    for a base of views of the live tensors, written before training goes on."""

    step: int
    arrays: dict[str, tuple[str, np.ndarray]]
    opt: dict[str, Any]
    nbytes: int
    job: CopyJob | None = None
    slot: Slot | None = None
    released: bool = False
    #: a base of views: (name, live tensor, its version counter when staged)
    watch: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Slice:
    """What one slice of a streamed base holds: the parameters ``params`` (with their
    optimizer state and residuals) and, for the ``first``, everything that is not a
    parameter's (buffers, RNG states, a gradient source's state)."""

    params: frozenset[str]
    first: bool


class _Live:
    """The ``bits`` callback of :func:`live_base_arrays` for a staged base: views of the
    live tensors (placeholders for device tensors), remembered so they can be copied."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[torch.Tensor, np.ndarray, torch.Tensor | None]] = {}

    def bits(self, t: torch.Tensor, what: str) -> tuple[str, np.ndarray]:
        if local_of(t).device.type == "cpu":
            tag, arr = bits_view(t, what)
            if shares_memory(arr, t):
                self.seen[id(arr)] = (t, arr, None)
            return tag, arr
        tag, bt = bits_tensor(t, what)
        if bt.is_contiguous():
            ph = np.lib.stride_tricks.as_strided(np.zeros(1, storage_dtype(tag)),
                                                 tuple(bt.shape), (0,) * bt.dim())
            self.seen[id(ph)] = (t, ph, bt)
            return tag, ph
        return bits_view(t, what)  # a private copy

    def need(self, arrays: Mapping[str, tuple[str, np.ndarray]]) -> tuple[int, bool]:
        """(bytes of staging memory, whether pinned) for the arrays of ``arrays`` seen
        here: the ones a staged base copies (the rest are private copies already)."""
        seen = [a for _t, a in arrays.values() if id(a) in self.seen]
        return (sum(align_up(a.nbytes) for a in seen),
                any(self.seen[id(a)][2] is not None for a in seen))


#: how long a base that must fall on its step (``aligned``) waits for staging memory
ALIGNED_WAIT_S = 600.0
#: how long a slice of a streamed base waits, at least, for staging memory still held by
#: the slices before it (a disk slower than a slice per step makes training wait for it;
#: a store that does not answer, an outage, must not hold training): then the base is
#: abandoned, and the next slices are put off without waiting while memory is held
SLICE_WAIT_S = 5.0

#: bytes up to which a host tensor of a model on a device is copied into base 0 rather than
#: read live by the writer (see :meth:`BaseStager.stage_views`)
SMALL_COPY = 1 << 16


class BaseStager:
    """Stages bases of the tensors one checkpointer logs: ``model`` (its model tensors),
    ``names``/``params`` (its optimizer parameters), the compressor's residuals and the
    gradient source's state.

    :meth:`stage` starts the copy of the state into a :class:`~.copy.StagingArea` of
    ``budget`` bytes (None: one copy of the state) and returns at once; :meth:`settle`
    finishes it before anything may change the state (the next optimizer step, or the
    capture that updates the residuals). With ``sync`` the copy is made inside
    :meth:`stage`. Model tensors that are not parameters (buffers, changed by forward) and,
    with ``layerwise`` capture, the residuals (changed during backward) are always copied
    inside :meth:`stage`. :meth:`release` is called once the writer is done with a base;
    :attr:`in_flight` counts bases staged and not yet released."""

    def __init__(self, model: Mapping[str, torch.Tensor], names: list[str],
                 params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 compressor: Any, source: GradSource | None, *, sync: bool = False,
                 budget: int | None = None, layerwise: bool = False,
                 aligned: bool = False, live: bool = False) -> None:
        self._model, self._names, self._params = model, names, params
        self._param_names = frozenset(names)
        #: streamed bases: the slices of a base (sizes staging memory)
        self.slices: tuple[Slice, ...] = ()
        self._budget_given = budget
        self._auto_budget = False  # the budget is to be sized from the slices
        #: bases must fall on the same step on every rank (a sharded restore plans from a
        #: base all shards hold; a rank that put its base off holds none there), or on
        #: their exact steps (``exact_bases``): a base meeting staging memory still being
        #: made waits for it instead of being put off
        self.aligned = aligned
        self._optimizer, self._compressor, self._source = optimizer, compressor, source
        self.sync, self._layerwise = sync, layerwise
        #: slices of a streamed base after the first are written from the live tensors of a
        #: model on the CPU (``base_staging="live"``: no staging memory for them)
        self.live = live
        self.area = StagingArea(budget)
        self._thread = CopyThread()
        self._streams: dict[torch.device, Any] = {}
        self.in_flight = 0
        self._lock = threading.Lock()
        #: ``stage_s`` (training thread, staging), ``settle_s`` (training thread, waiting
        #: for or finishing copies), ``dropped`` (bases changed while being copied),
        #: ``wait_s`` (training thread, an ``aligned`` base waiting for staging memory)
        self.stats = {"stage_s": 0.0, "settle_s": 0.0, "dropped": 0.0, "wait_s": 0.0}
        #: staging bytes the last base listed needed: a base owed while memory for that
        #: much is being made (or the budget is held) is put off without listing the
        #: state again. Not :meth:`_rough`, an upper bound: with a budget between the two,
        #: every base would be put off for good (tensors copied at once, such as
        #: non-contiguous ones, need no staging)
        self._need: int | None = None

    @classmethod
    def for_options(cls, part: Partition, optimizer: torch.optim.Optimizer, compressor: Any,
                    source: GradSource | None, options: CheckpointerOptions, *,
                    world: int = 1) -> BaseStager:
        """The stager of a checkpointer logging ``part`` with ``options``, one of ``world``
        ranks (several, or ``options.exact_bases``: bases wait for staging memory still
        being made, see ``aligned``)."""
        return cls(part.model, part.names, part.params, optimizer, compressor, source,
                   sync=options.base_staging == "sync", budget=options.staging_budget,
                   live=options.base_staging == "live",
                   layerwise=options.capture == "layerwise",
                   aligned=world > 1 or options.exact_bases)

    def _residuals(self, only: Slice | None = None) -> dict[str, torch.Tensor]:
        comp = self._compressor
        if comp is None or not comp.error_feedback:
            return {}
        res = residual_tensors(self._names, self._params, comp.residuals)
        return res if only is None else {n: r for n, r in res.items() if n in only.params}

    def _arrays(self, res: Mapping[str, torch.Tensor], live: _Live | None,
                only: Slice | None = None
                ) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, Any]]:
        """The base's arrays (``only``: one slice's): views of the live CPU tensors
        (``live``: also remembered, with placeholders for device tensors)."""
        model, names, params = self._model, self._names, self._params
        if only is not None:
            pairs = [(n, p) for n, p in zip(names, params, strict=True) if n in only.params]
            names, params = [n for n, _p in pairs], [p for _n, p in pairs]
            model = {n: t for n, t in model.items() if n in only.params
                     or (only.first and n not in self._param_names)}
        arrays, opt = live_base_arrays(model, names, params, self._optimizer, res, copy=False,
                                       bits=None if live is None else live.bits,
                                       rng=None if only is None or only.first else {})
        if self._source is not None and (only is None or only.first):
            arrays.update(self._source.base_tensors())
        return arrays, opt

    def stage_views(self, step: int, only: Slice | None = None) -> StagedBase:
        """The state after ``step`` as views of the live tensors (no copy; the base a
        checkpointer starts with, or ``only`` one slice of a streamed base of a model on
        the CPU): nothing may change the state until the writer is done with it. ``watch``
        lists each live tensor with its version counter now."""
        res = self._residuals(only)
        arrays, opt = self._arrays(res, None, only)
        with self._lock:
            self.in_flight += 1
        # changed by forward (buffers) or backward (layer-wise residuals): copied now
        now = {n for n, t in self._model.items() if not isinstance(t, torch.nn.Parameter)}
        watch = [(n, t, t._version) for n, t in self._model.items()
                 if n not in now and n in arrays]
        for n, p in zip(self._names, self._params, strict=True):
            if only is not None and n not in only.params:
                continue
            watch += [(f"{n} ({k})", v, v._version)
                      for k, v in self._optimizer.state.get(p, {}).items()
                      if isinstance(v, torch.Tensor)]
        if self._layerwise:
            now |= {L.EF + n for n in res}
        else:
            watch += [(f"{n} (residual)", r, r._version) for n, r in res.items()]
        watch = [w for w in watch if not self.on_device(w[1])]  # (else copied)
        if any(self.on_device(t) for t in self._model.values()):
            # a model on a device, whose tensors were copied: its small host tensors (an
            # optimizer's step counts) are copied too, so that nothing waits for base 0
            now |= {n for n, (_t, a) in arrays.items() if a.nbytes <= SMALL_COPY}
            watch = [w for w in watch if local_of(w[1]).nbytes > SMALL_COPY]
        for n in now & arrays.keys():
            tag, arr = arrays[n]
            arrays[n] = (tag, arr.copy())
        return StagedBase(step, arrays, opt, sum(a.nbytes for _t, a in arrays.values()),
                          watch=watch)

    @property
    def holds_residuals(self) -> bool:
        """A base holds error-feedback residuals, which the compressor changes in its own
        step pre-hook, before the checkpointer's."""
        return self._compressor is not None and bool(self._compressor.error_feedback)

    def all_on_host(self) -> bool:
        """Every tensor a base holds is host memory (a slice can be written from views)."""
        return not any(self.on_device(t) for t in self._model.values()) and not any(
            self.on_device(p) for p in self._params)

    @staticmethod
    def on_device(t: torch.Tensor) -> bool:
        """Whether ``t`` (its local shard) lives on a device (its base arrays are copies)."""
        return local_of(t).device.type != "cpu"

    def stage(self, step: int, only: Slice | None = None,
              wait_s: float | None = SLICE_WAIT_S) -> StagedBase | None:
        """Start copying the state after ``step`` (call it between the step and the next);
        None when the staging budget is held by bases still being written (try again
        after a later step). ``only``: one slice of a streamed base, which waits for
        staging memory rather than be put off, for ``wait_s`` seconds at most (None: put
        off at once, as a whole base is); an ``aligned`` base or slice waits
        :data:`ALIGNED_WAIT_S`."""
        t0 = time.perf_counter()
        wait = self.aligned or (only is not None and wait_s is not None)
        if not wait and self._need is not None and self.area.waiting(self._need):
            # put off without listing the state's arrays (at 940M, 1,100 tensors: 0.02-0.2 s
            # on every step a base was owed while its memory was made)
            self.stats["stage_s"] += time.perf_counter() - t0
            return None
        res = self._residuals(only)
        live = _Live()
        arrays, opt = self._arrays(res, live, only)
        copies = [(name, tag, arr) for name, (tag, arr) in arrays.items()
                  if id(arr) in live.seen]
        need, pinned = live.need(arrays)
        self._need = need
        slot = self.area.acquire(need, pinned) if need else None
        if need:  # the next base's memory (where the budget has room for another)
            self._provide(need, pinned)
        if need and slot is None and wait:  # (see `aligned`)
            slot = self._wait_for_slot(need, pinned, ALIGNED_WAIT_S if self.aligned
                                       or wait_s is None else wait_s)
        if need and slot is None:  # none ready: made on the helper thread, base put off
            self.stats["stage_s"] += time.perf_counter() - t0
            return None
        # changed by forward (buffers) or backward (layer-wise residuals): copied now
        now = {id(t) for t in self._model.values() if not isinstance(t, torch.nn.Parameter)}
        if self._layerwise:
            now |= {id(r) for r in res.values()}
        pieces: list[Piece] = []
        groups: dict[str, list[Piece]] = {}
        watch: list[tuple[str, torch.Tensor, int]] = []
        devices: set[torch.device] = set()
        off = 0
        for name, tag, arr in copies:
            assert slot is not None
            t, _view, dev = live.seen[id(arr)]
            dst = slot.buf[off:off + arr.nbytes]
            arrays[name] = (tag, dst.view(arr.dtype).reshape(arr.shape))
            if dev is not None:
                self._device_copy(devices, dev, slot.tensor, off)
            elif id(t) in now:
                np.copyto(dst, arr.reshape(-1).view(np.uint8))
            else:
                groups[name] = plan_pieces(arr.reshape(-1).view(np.uint8), dst)
                pieces += groups[name]
            if id(t) not in now:
                watch.append((name, t, t._version))
            off = align_up(off + arr.nbytes)
        job = CopyJob(pieces, watch, [self._record(d) for d in devices], groups=groups)
        if self.sync:  # complete now: what changes later is not in this base
            job.work()
            job.watch = []
        elif job.pieces:
            self._thread.submit(job.work)
        with self._lock:
            self.in_flight += 1
        self.stats["stage_s"] += time.perf_counter() - t0
        return StagedBase(step, arrays, opt, sum(a.nbytes for _t, a in arrays.values()),
                          job, slot)

    def _wait_for_slot(self, need: int, pinned: bool, limit: float) -> Slot | None:
        """(``aligned`` bases, slices) Wait for staging memory rather than put the base
        off: for a buffer being made, and for one the previous base or slice is still
        written from (the writer releases it, written or failed). The caller hands any
        base still waiting for its device copies to the writer first
        (:meth:`Handover.take_base`). None after ``limit`` seconds (a writer that never
        lets go, a store in an outage): then the base is put off (abandoned)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + limit
        try:
            while True:
                seen = self.area.generation
                slot = self.area.acquire(need, pinned)
                if slot is not None:
                    return slot
                self._provide(need, pinned)  # (made once the budget has room)
                left = deadline - time.monotonic()
                if left <= 0 or not self.area.wait_change(seen, left):
                    _log.warning("lowdiff-store: no staging memory for a base on its exact "
                                 "step or for a slice after %.0f s (the writer still holds "
                                 "it); the base is put off", limit)
                    return None
        finally:
            self.stats["wait_s"] += time.perf_counter() - t0

    def _device_copy(self, devices: set[torch.device], src: torch.Tensor,
                     buf: torch.Tensor, off: int) -> None:
        """Queue the copy of device tensor ``src``'s bytes into pinned staging ``buf`` at
        byte ``off`` on the device's side stream, which first waits for the work queued so
        far (the step); one copy per pinned piece the bytes fall in (:func:`pin_spans`)."""
        dev = src.device
        stream = self._streams.get(dev)
        if stream is None:
            stream = self._streams[dev] = torch.cuda.Stream(device=dev)
        if dev not in devices:
            stream.wait_stream(torch.cuda.current_stream(dev))
            devices.add(dev)
        flat = src.reshape(-1).view(torch.uint8)
        with torch.cuda.stream(stream):
            for lo, hi in pin_spans(off, flat.numel()):
                buf[lo:hi].copy_(flat[lo - off:hi - off], non_blocking=True)

    def _record(self, device: torch.device) -> Any:
        ev = torch.cuda.Event()
        ev.record(self._streams[device])
        return ev

    def later(self, fn: Callable[[], Any], tensors: list[torch.Tensor]) -> Later:
        """``fn()`` of the state after a step (nothing in ``tensors`` changes until the
        result is settled), on the helper thread; computed now with ``sync``."""
        return Later(fn, tensors, None if self.sync else self._thread)

    def digest(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> Later:
        """The digest of ``params`` and their optimizer state after a step (see
        :meth:`later`), queued after the copy of that step's base."""
        state = [v for p in params for v in optimizer.state.get(p, {}).values()
                 if isinstance(v, torch.Tensor)]
        src = self._source
        if isinstance(src, DigestSource):  # its state is in the digest too
            return self.later(lambda: src.digest(params, optimizer),
                              [*params, *state, *src.digest_tensors()])
        after = None  # device tensors: copied on a side stream after the step's work
        cuda = [local_of(p).device for p in params if local_of(p).device.type == "cuda"]
        if cuda:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(cuda[0]))
        return self.later(lambda: digest_state(params, optimizer, after=after),
                          [*params, *state])

    def settle(self, base: StagedBase, on_device: bool = True) -> bool:
        """Finish ``base``'s copy before the state changes; False when a tensor was changed
        in place since :meth:`stage` (the copy may mix two states: drop the base)."""
        if base.job is None:
            return True
        t0 = time.perf_counter()
        ok = base.job.settle(on_device)
        self.stats["settle_s"] += time.perf_counter() - t0
        if not ok:
            self.stats["dropped"] += 1
        return ok

    def prepare(self, first: bool = False) -> None:
        """Have the staging memory of the next base made and touched on the helper thread
        (if there is none that fits yet), so the base copies into touched memory and the
        training thread never allocates or faults in staging memory. ``first``: after the
        base a checkpointer starts with, only once the state is :meth:`complete` (else
        after the first step). On an H100 at 0.94B parameters, a 12 GB buffer made at
        base 0 (no top-k residuals yet) was let go and a 16 GB one made beside training
        when the first periodic base found it too small: one step took 15-20 s."""
        if first and not self.complete():
            return
        if self.slices and self._auto_budget and self.complete():
            self._budget_for_slices()
        # (live slices: only the first is copied, see _budget_for_slices)
        copied = self.slices[:1] if self.live and self.all_on_host() else self.slices
        only = max(copied, key=self._rough, default=None)
        rough = self._rough(only)
        if self.area.ready_for(rough):
            return
        need, pinned = self._staging_need(only)
        self._need = need
        if need:
            self._provide(need, pinned)

    def _staging_need(self, only: Slice | None) -> tuple[int, bool]:
        """(bytes of staging memory, whether pinned) a base (``only``: one slice) of the
        state now needs: the state listed as :meth:`stage` lists it (:meth:`_Live.need`)."""
        live = _Live()
        arrays, _opt = self._arrays(self._residuals(only), live, only)
        return live.need(arrays)

    def _budget_for_slices(self) -> None:
        """Staging memory for streamed bases with no ``staging_budget``: room for the two
        largest slices (one copied while the one before it is written), never the state;
        with live slices, for the first slice only (the others are not copied)."""
        needs = [self._staging_need(only)[0] for only in self.slices]
        # live slices (a CPU model, base_staging="live"): only the first is copied
        top = needs[:1] if self.live and self.all_on_host() else sorted(needs)[-2:]
        self.area.budget = sum(grow(n) for n in top) or None
        self._auto_budget = False

    def set_slices(self, slices: tuple[Slice, ...]) -> None:
        """The slices of the streamed bases from now on (their staging memory is sized
        from the largest two, unless a ``staging_budget`` was given)."""
        if slices != self.slices:
            self.slices = slices
            self._auto_budget = self._auto_budget or self._budget_given is None
        if self._auto_budget and self.complete():
            self._budget_for_slices()

    def complete(self) -> bool:
        """Every parameter that trains has its optimizer state and (error feedback) its
        residual: bases have the size they will keep. Memory made for a base before that
        (a fresh optimizer, a compressor that has not compressed yet) would be too small
        for the next one, and letting it go and making a larger one beside training is
        what stalled an H100 run (see :meth:`prepare`)."""
        comp = self._compressor
        res = comp.residuals if comp is not None and comp.error_feedback else None
        return all(self._optimizer.state.get(p) and (res is None or p in res)
                   for p in self._params if p.requires_grad)

    def state_bytes(self) -> int:
        """Roughly the bytes of a base now (:meth:`_rough` of the whole state)."""
        return self._rough()

    def _rough(self, only: Slice | None = None) -> int:
        """Bytes of the parameters, their optimizer state and the compressor's residuals
        now (``only``: of one slice): roughly what a base stages (which adds buffers and
        alignment, and leaves out tensors copied at once, such as non-contiguous ones),
        cheap to compute."""
        res = self._residuals(only)
        params = self._params if only is None else [
            p for n, p in zip(self._names, self._params, strict=True) if n in only.params]
        return sum(local_of(t).nbytes for t in params) + sum(
            local_of(v).nbytes for p in params
            for v in self._optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)
        ) + sum(local_of(r).nbytes for r in res.values())

    def _provide(self, need: int, pinned: bool) -> None:
        if self.area.want(need, pinned):
            self._thread.submit(self.area.provide)

    def release(self, base: StagedBase) -> None:
        """The writer is done with ``base`` (written, failed or dropped); idempotent, and
        called from the writer's thread."""
        with self._lock:
            if base.released:
                return
            base.released = True
            self.in_flight -= 1
        if base.slot is not None:
            self.area.release(base.slot)

    def drop(self, base: StagedBase) -> None:
        """``base`` is not written (its copy saw a change, or its step was lost): once no
        copy into its staging memory runs any more (:meth:`CopyJob.abandon`), it may be
        reused, or let go (its pages discarded)."""
        if base.job is not None:
            base.job.abandon()
        self.release(base)

    def close(self) -> None:
        """Stop the helper thread once the jobs queued are done, the last of them letting
        go of the staging memory (in pieces, see :func:`~.copy.give_back`)."""
        self._thread.submit(self.area.close)
        self._thread.close()


__all__ = ["BaseStager", "Slice", "StagedBase"]
