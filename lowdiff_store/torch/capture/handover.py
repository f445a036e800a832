"""Finalized steps on their way out: the record to the writer (once its device-to-host
copies ended), then its staged base; the cost meter's accounting and the auto-tuning
decisions it makes on the way; and the background base worker, which is handed the base
requests once their steps are durable."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.specs import Spec
from .background import BackgroundBases
from .base_stager import BaseStager, StagedBase
from .cost_meter import CostMeter
from .grad_capture import HostPool
from .initial_base import StartingPoint
from .sink import Sink

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
    copied: list[Any] = field(default_factory=list)  # CUDA events: copies complete
    base_meta: dict[str, Any] | None = None  # set when finalized
    write_record: bool = True


class Handover:
    """The way out of one checkpointer's steps, and when its bases are due: ``sink`` (the
    writer), ``meter`` (measured costs, the intervals in force),
    ``stager`` (takes back handed-over bases), ``pool`` (takes back a record's host buffers
    once written); counters go to ``stats`` (``diff_bytes``, ``bases``, ``finalize_s``)."""

    def __init__(self, sink: Sink, meter: CostMeter, stager: BaseStager, pool: HostPool,
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

    def base_due(self, step: int) -> bool:
        """A base is taken after ``step``: every ``snapshot_every`` steps (counted from the
        last base when the interval is tuned, since it changes)."""
        if self.meter.auto_snapshot:
            return step - self.last_base >= self.meter.snapshot_every
        return step % self.meter.snapshot_every == 0

    def start_background(self, path: str) -> None:
        """Start the background base worker (bases stay in the foreground if it cannot)."""
        try:
            self.bg = BackgroundBases(path)
        except OSError as e:  # no process to spare: bases stay in the foreground
            _log.warning("lowdiff-store: cannot start the background base worker (%s); "
                         "bases are taken in the foreground", e)

    def take_base(self, p: PendingStep, foreground: bool = False) -> None:
        """Stage the state after ``p``'s step for a base, or (background bases, unless
        ``foreground``) ask the worker for one."""
        t0 = time.perf_counter()
        nbytes = 0
        if not foreground and self.bg is not None and self.bg.active:
            self.bg.request(p.step)
        else:
            p.base = self.stager.stage(p.step)
            nbytes = p.base.nbytes
        self.last_base = p.step
        self.meter.on_base_staged(time.perf_counter() - t0, nbytes)

    def hand_over(self) -> None:
        """Give the finalized step (:attr:`ready`, if any) to the writer: its record, then
        its base."""
        p = self.ready
        if p is None:
            return
        self.ready = None
        t0 = time.perf_counter()
        if p.write_record:
            for ev in p.copied:
                ev.synchronize()
            decision = self.meter.on_record(p.step, sum(s.nbytes for s in p.specs),
                                            self.sink.stats())
            if decision is not None:  # auto mode changed (F, B): apply, record why
                p.extra["tuning"] = decision
                if self.sink.batch != self.meter.batch:
                    self.sink.set_batch(self.meter.batch)
            bufs = p.release
            pool = self.pool
            self.sink.append(p.step, p.specs, kind=self.mode, side=p.side, extra=p.extra,
                             done=(lambda: pool.give(bufs)) if bufs else None)
            self.stats["diff_bytes"] += sum(s.nbytes for s in p.specs)
        if p.base is not None:
            assert p.base_meta is not None
            tensors, meta = p.base.arrays, p.base_meta
            if self.start is not None:  # base 0 refers to initial_base's tensors
                tensors, meta = self.start.base(tensors, meta)
                self.start = None
            self.sink.write_base(p.step, tensors, meta)
            self.stager.release(p.base)
            self.stats["bases"] += 1
            self.meter.publish()
        if self.bg is not None:
            self.poll()
        self.stats["finalize_s"] += time.perf_counter() - t0

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
        self.sink.flush()
        if self.bg is not None:
            self.poll()

    def close(self) -> None:
        """Wait for the background bases of the steps so far, stop the worker, record the
        final measurements, close the writer."""
        try:
            try:
                self.sink.flush()
                if self.bg is not None:
                    self.poll(self.bg.close(self.sink.durable_step))
                self.meter.close(self.sink.stats())
            finally:
                if self.bg is not None:
                    self.bg.abort()
        finally:
            self.sink.close()

    def add_stats(self, out: dict[str, float]) -> None:
        """The writer's counters prefixed ``writer_``, the worker's ``background_``."""
        out.update({f"writer_{k}": v for k, v in self.sink.stats().items()})
        if self.bg is not None:
            out.update({f"background_{k}": v for k, v in self.bg.stats().items()})


__all__ = ["Handover", "PendingStep"]
