"""When a base is due, and finalized steps on their way out: the record to the writer (once
its device-to-host copies ended), then its staged base; the cost meter's accounting and the
auto-tuning decisions it makes on the way; and the background base worker, which is handed
the base requests once their steps are durable. The life of a base from start to end is
told in :mod:`lowdiff_store.torch.capture.bases`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ....errors import ConfigError, Reason
from ...core.specs import Spec
from ..cost_meter import CostMeter
from ..delta_capture import DeltaCapture
from ..grad_capture import GradCapture, HostPool
from ..in_flight import Ticket
from ..layout import Partition
from ..sink import LogSink
from .background import BackgroundBases
from .copy import Later
from .initial import InitialBase, StartingPoint, as_initial_base, crc_of, match_live
from .stager import BaseStager, StagedBase

_log = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A step whose optimizer work is done but whose scheduler/scaler may still run."""

    step: int
    skipped: bool
    specs: list[Spec] = field(default_factory=list)
    side: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    release: list[torch.Tensor] = field(default_factory=list)  # host buffers to give back
    base: StagedBase | None = None
    digest: Later | None = None  # the digest of the state after the step, being computed
    base_meta: dict[str, Any] | None = None  # set when finalized
    write_record: bool = True
    ticket: Ticket | None = None  # its place among the dense records in flight
    #: its base is one slice of a streamed base: the ``"slice"`` key of its metadata
    slice: dict[str, Any] | None = None
    refer: StartingPoint | None = None  # an external checkpoint of this step its base refers to


class LiveBase:
    """A base written in the background from views of the live tensors: the base a
    checkpointer starts with (``DiffCheckpointer(...)`` returns before it is durable; its
    CRCs are taken when it is staged, so bytes changed before the writer reads them can
    never pass as that state), or a slice of a streamed base written live
    (:meth:`~.streaming.Streamer.take_slice`). ``watch`` (name, tensor, version when
    staged) is compared when the writer is done (:meth:`release`, on the writer's
    thread)."""

    def __init__(self, step: int, watch: list[tuple[str, torch.Tensor, int]]) -> None:
        self.step = step
        self._watch = watch
        #: the writer reads live tensors (views of CPU tensors): the first optimizer step
        #: waits until it is done. False where every array is a private copy (a model on
        #: a GPU: its tensors were copied to the host when staged), then nothing waits.
        self.reads_live = bool(watch)
        self.done = threading.Event()
        #: tensors changed in place before the writer was done with them
        self.changed: list[str] = []

    def release(self) -> None:
        """The writer is done with the arrays (written, or failed); idempotent."""
        if self.done.is_set():
            return
        self.changed = [n for n, t, v in self._watch if t._version != v]
        self._watch = []
        self.done.set()


class SliceTaker(Protocol):
    """What a :class:`Handover` asks of the taker of its streamed bases
    (:class:`~.streaming.Streamer`, which imports this module)."""

    live: LiveBase | None
    deferred: bool

    def after_step(self, p: PendingStep) -> None:
        """After ``p``'s step: its slice, when one is due."""

    def settle_live(self) -> None:
        """Wait until the writer has read a slice written from the live tensors."""

    def abandon(self) -> None:
        """The base in progress cannot complete."""


class Handover:
    """The way out of one checkpointer's steps, and when its bases are due: ``sink`` (the
    writer), ``meter`` (measured costs, the intervals in force),
    ``stager`` (takes back handed-over bases), ``pool`` (takes back a record's host buffers
    once written); counters go to ``stats`` (``diff_bytes``, ``bases``, ``finalize_s``)."""

    def __init__(self, sink: LogSink, meter: CostMeter, stager: BaseStager, pool: HostPool,
                 stats: dict[str, float], mode: str, *, last_base: int,
                 start: StartingPoint | None = None) -> None:
        self.sink, self.meter, self.stager, self.pool = sink, meter, stager, pool
        self.stats, self.mode = stats, mode
        self.bg: BackgroundBases | None = None
        #: the step of the last base taken (or requested)
        self.last_base = last_base
        #: the finalized step waiting for :meth:`hand_over`
        self.ready: PendingStep | None = None
        #: ``initial_base``: the checkpoint the first base written refers to
        self.start = start
        #: a base is due but was not taken (staging memory busy, or a copy dropped)
        self.owed = False
        #: the first base, while the writer may still read the live tensors
        self.first: LiveBase | None = None
        #: a step whose base's device copies were still running when it was handed over
        #: (its record went out): the base goes at the next hand-over, not waited for now
        self.late: PendingStep | None = None
        stats.setdefault("first_base_wait_s", 0.0)
        self.deferred = 0
        self.first_step = last_base
        #: streamed bases (``base_slices``; :class:`~.streaming.Streamer`), or None
        self.streamer: SliceTaker | None = None

    def base_due(self, step: int) -> bool:
        """A base is taken after ``step``: every ``snapshot_every`` steps (counted from the
        last base when the interval is tuned, since it changes), and at every step after
        one whose base was put off or dropped, until one is taken."""
        if self.owed:
            return True
        if self.meter.auto_snapshot:
            return step - self.last_base >= self.meter.snapshot_every
        return step % self.meter.snapshot_every == 0

    def after_step(self, p: PendingStep) -> None:
        """After ``p``'s step: its base (:meth:`take_base`), or its slice of a streamed
        base (:class:`~.streaming.Streamer`), when one is due, else the next one's memory
        made when it is near (:meth:`prepare`)."""
        if self.streamer is not None:
            self.streamer.after_step(p)
        elif self.base_due(p.step):
            self.take_base(p)
        else:
            self.prepare(p.step)

    def start_background(self, path: str) -> None:
        """Start the background base worker (bases stay in the foreground if it cannot)."""
        try:
            self.bg = BackgroundBases(path)
        except OSError as e:  # no process to spare: bases stay in the foreground
            _log.warning("lowdiff-store: cannot start the background base worker (%s); "
                         "bases are taken in the foreground", e)

    def take_base(self, p: PendingStep, foreground: bool = False, views: bool = False
                  ) -> None:
        """Stage the state after ``p``'s step for a base, or (background bases, unless
        ``foreground``) ask the worker for one. ``views``: no copy, the caller writes the
        base before the state changes. A base the staging memory cannot hold yet (the
        previous one is still being written) is put off to the next step: training does
        not wait for the disk."""
        t0 = time.perf_counter()
        nbytes = 0
        if not foreground and self.bg is not None and self.bg.active:
            self.bg.request(p.step)
        else:
            base: StagedBase | None
            if views:
                base = self.stager.stage_views(p.step)
                if self.streamer is None:  # a budget that cannot hold a base (slices: one)
                    self.stager.area.check(base.nbytes)
            else:
                if self.stager.aligned:  # it may wait for memory an earlier base holds:
                    self.hand_over()        # every staged base goes to the writer first
                    self.write_late(force=True)
                base = self.stager.stage(p.step)
            if base is None:
                if not self.owed:
                    self.deferred += 1
                self.owed = True
                return
            p.base = base
            nbytes = base.nbytes
        self.owed = False
        self.last_base = p.step
        self.meter.on_base_staged(time.perf_counter() - t0, nbytes)

    def refer(self, ckpt: Any, checkpoint: Any) -> bool:
        """``ckpt.refer_base(checkpoint)`` (``ckpt``: the ``DiffCheckpointer`` this hands
        over for): the state after its last step was just saved to ``checkpoint`` (a DCP
        directory or safetensors, as for ``initial_base``) by another writer, after that
        step's scheduler step and before the next optimizer step: that step's base refers
        to it (format section 7.1) instead of holding a second copy. A trainer's own
        periodic checkpoint thus becomes the log's base.

        Every check of ``initial_base`` runs first (files present, metadata matching them,
        every tensor read for its CRC32C); nothing is loaded. A base of the step is taken
        if none was due (staged as any base, beside the next forward and backward); when
        it is written, each tensor found in ``checkpoint`` under a key of its dtype and
        global shape with the same bits (CRC32C of this rank's piece) is referenced, the
        rest (RNG states, tensors the writer renamed or converted) is stored. Returns False,
        the checkpoint unused, when the base could not be taken at this step (staging
        memory still held: with ``exact_bases`` it waits instead).
        ``ConfigError(invalid_argument)`` when no step is pending (before the first
        optimizer step after opening, after :meth:`flush`, after ``close``);
        ``ConfigError(not_allowed)``, nothing written, when the log streams its bases
        (``base_slices`` > 1, or the default on a CPU model: a slice may hold the step, and
        staging is sized for slices): open such a checkpointer with ``base_slices=1``."""
        p, part = ckpt._pending, ckpt._part
        if p is None or p.step != ckpt.step:
            raise ConfigError("refer_base() names the checkpoint of the step just taken: no "
                              "step is pending (call it after a step, before the next)",
                              reason=Reason.INVALID_ARGUMENT)
        if self.streamer is not None:   # (a slice may hold this step; the staging memory
            raise ConfigError(          # is sized for slices, not for a whole base)
                "refer_base() makes a consistent base of another writer's checkpoint; this "
                "log streams its bases (base_slices > 1, the default on a CPU model): open "
                "the checkpointer with base_slices=1 to refer to checkpoints",
                reason=Reason.NOT_ALLOWED, path=ckpt.path)
        init = as_initial_base(checkpoint)
        match = match_live(InitialBase(init.path, init.kind, init.model_prefix,
                                       init.optim_prefix, load=False),
                           part.model, ckpt._log_meta["aliases"], part.names, part.params,
                           ckpt.optimizer)
        if p.base is None:
            self.take_base(p, foreground=True)
        if p.base is None:
            return False
        p.refer = match
        return True

    def digest(self, p: PendingStep, part: Partition, optimizer: torch.optim.Optimizer,
               delta: DeltaCapture | None) -> None:
        """Record the digest of the state after ``p``'s step: ``delta``'s (delta mode), or
        the live parameters' and optimizer state's, computed beside the next step."""
        if delta is not None:
            p.extra["digest"] = delta.digest(part.names)
        else:
            p.digest = self.stager.digest(part.params, optimizer)

    def prepare(self, step: int) -> None:
        """After ``step``, which takes no base: after the first step (the optimizer state
        exists), and whenever the next base is near (within half an interval, or 3 steps),
        have its staging memory made and touched on the helper thread if none fits."""
        if self.bg is not None and self.bg.active:
            return
        every = int(self.meter.snapshot_every)
        nxt = self.last_base + every if self.meter.auto_snapshot else (step // every + 1) * every
        if nxt - step <= max(3, every // 2) or step == self.first_step + 1:
            self.stager.prepare()

    def settle(self, p: PendingStep) -> None:
        """Before anything changes the state again: finish the copy of ``p``'s base (and its
        digest); a base whose tensors changed in place meanwhile is dropped (the next step
        takes one, copied inside the step from then on), and so is such a digest."""
        if p.digest is not None:  # a digest of a changed state is left out
            intact, value = p.digest.settle()
            p.digest = None
            if intact:
                p.extra["digest"] = value
        base = p.base
        if base is None or self.stager.settle(base):
            return
        p.base = None
        self.stager.drop(base)
        self.owed = True
        if self.streamer is not None and p.slice is not None:
            self.streamer.abandon()  # (its other slices name a base that never completes)
            p.slice = None
        if not self.stager.sync:
            self.stager.sync = True
            _log.warning("lowdiff-store: %s changed in place between optimizer steps while "
                         "the base of step %d was being copied; that base is dropped, the "
                         "next step takes one, and bases are copied inside the optimizer "
                         "step from now on", ", ".join(base.job.changed[:3]) if base.job
                         else "a tensor", p.step)

    def finish(self, p: PendingStep, grads: GradCapture, complete: Callable[[], None]
               ) -> bool:
        """Settle ``p`` (:meth:`settle`; then the lent gradients training still holds are
        copied) and ``complete()`` it. False: ``p`` is dropped (:meth:`drop`), since a step
        was refused (``grads.refusal``: no later step may be logged). A step lost here
        (anything raised) is dropped and refuses every later one (the log would skip it:
        :meth:`GradCapture.lost`), then the error is raised."""
        if grads.refusal is not None:
            self.drop(p)
            return False
        try:
            self.settle(p)  # its base's copy ends before anything changes the state
            grads.lender.settle()
            complete()
        except BaseException as e:
            self.drop(p)
            grads.lost(p.step, e)
            raise
        return True

    def drop(self, p: PendingStep) -> None:
        """``p`` never reaches the writer (finalizing it failed, or its step was refused):
        its place in flight and its base's staging memory are given back. Its host
        buffers are left to the garbage collector (device copies into them may still
        run)."""
        if p.ticket is not None:
            p.ticket.leave()
            p.ticket = None
        base, p.base = p.base, None
        if base is not None:
            self.stager.drop(base)

    def hand_over(self, *, live: bool = True) -> None:
        """Give the finalized step (:attr:`ready`, if any) to the writer: its record, then
        its base. First wait until the writer has read a slice written from the live
        tensors, unless ``live`` is False (the post-step hook, which has just handed it
        over) and the streamer defers that wait to the next step (the writer reads it
        beside forward and backward: :attr:`~.streaming.Streamer.deferred`)."""
        if self.first is not None and (self.first.reads_live or self.first.done.is_set()):
            self.settle_first()
        streamer = self.streamer
        if streamer is not None and streamer.live is not None and (
                live or not streamer.deferred):
            streamer.settle_live()
        self.write_late(force=False)
        p = self.ready
        if p is None:
            return
        self.ready = None
        t0 = time.perf_counter()
        if p.write_record:
            decision = self.meter.on_record(p.step, sum(s.nbytes for s in p.specs),
                                            self.sink.stats())
            if decision is not None:  # auto mode changed (F, B): apply, record why
                p.extra["tuning"] = decision
                if self.sink.batch != self.meter.batch:
                    self.sink.set_batch(self.meter.batch)
            try:
                self.append(p)
            except BaseException:  # (a failed writer): its base is not written either
                self.drop(p)
                raise
        elif p.ticket is not None:
            p.ticket.leave()
        if p.base is not None:
            self.write_late(force=True)  # bases reach the writer in step order
            job = p.base.job
            if job is not None and not job.copied():
                self.late = p  # its device copies still run: written at the next hand-over
            else:
                self.write_base(p)
        if self.bg is not None:
            self.poll()
        self.stats["finalize_s"] += time.perf_counter() - t0

    def append(self, p: PendingStep) -> None:
        """Hand ``p``'s record to the writer; once the writer no longer reads it, its host
        buffers go back to the pool and its place in flight is given back."""
        bufs, pool, ticket = p.release, self.pool, p.ticket
        specs, p.specs = p.specs, []  # (p may wait as :attr:`late`: it keeps no gradient)
        p.release, p.ticket = [], None

        def done() -> None:
            try:
                if bufs:
                    pool.give(bufs)
            finally:
                if ticket is not None:
                    ticket.leave()
        try:
            self.sink.append(p.step, specs, kind=self.mode, side=p.side, extra=p.extra,
                             done=done if bufs or ticket is not None else None)
        except BaseException:
            if ticket is not None:  # (the buffers stay out of the pool: the writer may
                ticket.leave()      # have failed while reading them)
            raise
        self.stats["diff_bytes"] += sum(s.nbytes for s in specs)

    def write_late(self, force: bool) -> None:
        """Hand over the base put aside while its device copies ran (:attr:`late`), once
        they are complete, or now (``force``: a flush, or a newer base to write)."""
        late = self.late
        if late is None or late.base is None:
            self.late = None
            return
        job = late.base.job
        if force or job is None or job.copied():
            self.late = None
            self.write_base(late)

    def write_base(self, p: PendingStep) -> None:
        """Hand ``p``'s staged base to the writer (waiting for its device copies only when
        they are still running at a flush)."""
        assert p.base is not None
        assert p.base_meta is not None
        base, stager = p.base, self.stager
        try:
            stager.settle(base, on_device=False)  # (settled: waits only for device copies)
        except BaseException:
            self.owed = True  # never written: its staging memory is given back once no
            try:              # copy into it runs (else it stays held: one may still land)
                self.drop(p)
            except BaseException as e:
                _log.warning("lowdiff-store: the staging memory of the base of step %d is "
                             "kept (%s: %s)", p.step, type(e).__name__, e)
            raise
        tensors, meta = base.arrays, p.base_meta
        if p.slice is not None:  # one slice of a streamed base (spec section 7.2)
            meta = {**meta, "slice": p.slice}
        crcs = base.job.crcs() if base.job is not None else None  # (by the copy)
        first = None
        if base.job is None:  # views of the live tensors: checksummed as they are now
            first = LiveBase(p.step, base.watch)
        start = self.start if self.start is not None else p.refer
        if start is not None:  # base 0 refers to initial_base's tensors, a later base
            tensors, meta = start.base(tensors, meta, crcs)  # to its step's checkpoint
            self.start = None
        if first is not None:  # (several cores for a large array)
            crcs = {name: crc_of(arr) for name, (_tag, arr) in tensors.items()}
        self.send_base(p.step, base, tensors, meta, crcs, first)
        if first is not None:
            self.first = first
        if p.slice is None or p.slice["base"] == p.step:
            self.stats["bases"] += 1
        self.meter.publish()
        if first is not None and not (self.bg is not None and self.bg.active):
            stager.prepare(first=True)  # the first base: the next one's memory made now

    def send_base(self, step: int, base: StagedBase,
                  tensors: Mapping[str, tuple[str, np.ndarray]], meta: Mapping[str, Any],
                  crcs: Mapping[str, int] | None = None, live: LiveBase | None = None
                  ) -> None:
        """Hand ``tensors`` (``base``'s arrays, or what is left of them besides references)
        to the writer; once it is done with them (written, or failed) the stager takes
        ``base`` back and ``live`` compares its tensors' versions."""
        stager = self.stager

        def done() -> None:
            try:
                stager.release(base)
            finally:
                if live is not None:
                    live.release()
        try:
            self.sink.write_base(step, tensors, meta, release=done, crcs=crcs)
        except BaseException:
            done()  # (idempotent: the writer may have released it)
            raise

    def settle_first(self) -> None:
        """Before anything may change the state (the first optimizer step, ``flush``,
        ``close``): wait until the writer is done with the first base's live tensors, if
        it is not yet (a base 0 of private copies only is settled at the first hand-over
        after its write, or at ``flush``/``close``). A failure writing it is raised here;
        a base the store skipped, or one whose tensors were changed in place before the
        writer was done with them (its CRCs, taken when staged, then refuse the changed
        bytes), is replaced by a base at the next step."""
        first = self.first
        assert first is not None
        t0 = time.perf_counter()
        first.done.wait()
        self.first = None
        self.stats["first_base_wait_s"] = time.perf_counter() - t0
        if first.step not in self.sink.bases:
            self.sink.flush()  # raises what the writer raised
            self.owed = True  # (skipped by a store that does not answer)
            _log.warning("lowdiff-store: the base of step %d was not written; the next step "
                         "takes one", first.step)
        elif first.changed:
            self.owed = True
            _log.warning("lowdiff-store: %s changed in place before the base of step %d was "
                         "written (create the checkpointer after loading or editing the "
                         "state); that base holds the CRCs of the state at its step and "
                         "refuses other bytes; the next step takes a base",
                         ", ".join(first.changed[:3]), first.step)

    def poll(self, results: list[dict[str, Any]] | None = None) -> None:
        """Hand durable base requests to the worker; account for the bases it made."""
        bg = self.bg
        assert bg is not None
        if results is None:
            results = bg.poll(self.sink.durable_step)
        for r in results:
            n = float(r.get("replayed", 0.0))
            self.meter.on_worker_base(float(r.get("load_s", 0.0)),
                                      float(r["replay_s"]) / n if n else None,
                                      float(r.get("write_s", 0.0)))
            self.stats["bases"] += 1
        if results:
            self.meter.publish()

    def flush(self) -> None:
        """Wait until everything handed over is durable."""
        self.write_late(force=True)
        self.sink.flush()
        if self.first is not None:  # (private copies, not waited for by the steps)
            self.settle_first()
        if self.bg is not None:
            self.poll()

    def close(self) -> None:
        """Wait for the background bases of the steps so far, stop the worker, record the
        final measurements, close the writer and the stager's helper thread."""
        try:
            try:
                self.write_late(force=True)
                self.sink.flush()
                if self.first is not None:
                    self.settle_first()
                if self.bg is not None:
                    self.poll(self.bg.close(self.sink.durable_step))
                self.meter.close(self.sink.stats())
            finally:
                if self.bg is not None:
                    self.bg.abort()
        finally:
            try:
                self.sink.close()
            finally:
                self.stager.close()

    def add_stats(self, out: dict[str, float]) -> None:
        """The writer's counters prefixed ``writer_``, the worker's ``background_``."""
        out.update({f"writer_{k}": v for k, v in self.sink.stats().items()})
        out.update({f"base_{k}": v for k, v in self.stager.stats.items()})
        out["base_deferred"] = float(self.deferred)
        # (the most held at once: closing gives the memory back)
        out["base_staging_bytes"] = float(self.stager.area.peak)
        out["base_staging_pinned_bytes"] = float(self.stager.area.pinned_peak)
        if self.bg is not None:
            out.update({f"background_{k}": v for k, v in self.bg.stats().items()})


__all__ = ["Handover", "LiveBase", "PendingStep", "SliceTaker"]
