"""Taking streamed bases (``base_slices=k``, issue 50): one slice of the state after each
step of a base's window, handed to the writer through the checkpointer's
:class:`~.handover.Handover`.

What is sliced and when is :mod:`.slices` (a pure schedule); the copy of a slice is a base
limited to one group (:class:`~.stager.Slice`), staged as any base and written by the
hand-over with its ``"slice"`` metadata. With ``base_staging="live"`` (a model on the CPU)
the slices after the first are handed to the writer at once, in the post-step hook of their
step, as views of the live tensors: no staging memory for them, and the next hand-over (the
one that ends that post-step hook) waits until the writer has read them
(:meth:`Streamer.settle_live`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .handover import Handover, LiveBase, PendingStep
from .slices import SliceSchedule, Window, schedule_for
from .stager import SLICE_WAIT_S, Slice, StagedBase

_log = logging.getLogger(__name__)


class Streamer:
    """The streamed bases of one checkpointer: ``out`` (its hand-over), ``stream`` (the
    slice schedule), ``meta_now(step, opt)`` (the metadata of a slice written at its own
    step: the values the side channel carries then)."""

    def __init__(self, out: Handover, stream: SliceSchedule,
                 meta_now: Callable[[int, dict[str, Any]], dict[str, Any]]) -> None:
        self.out, self.stream, self._meta_now = out, stream, meta_now
        stager = out.stager
        #: the slices after the first are written from views of the live tensors (and
        #: the first, copied, holds no parameter: :attr:`SliceSchedule.lead_empty`)
        self.views = stager.live and stager.all_on_host()
        stream.lead_empty = self.views
        #: such a slice is waited for at the next step's pre-step hook, so the writer
        #: reads it beside forward and backward; with error-feedback residuals in it, at
        #: once (the compressor's pre-step hook, which runs before the checkpointer's,
        #: changes them)
        self.deferred = self.views and not stager.holds_residuals
        #: such a slice, while the writer may still read the live tensors
        self.live: LiveBase | None = None
        self._slice_s, self._slice_bytes = 0.0, 0  # the base in progress's staging
        self._tuned = -2  # ``stream.started`` when k was last tuned (``"auto"``)
        #: a slice found no staging memory in time (the writer holds it: a store in an
        #: outage): the slices after it are put off at once until one finds memory
        self.starved = False
        #: seconds a slice of the base in progress waits for staging memory (``_wait_s``)
        self._wait_limit = SLICE_WAIT_S
        stager.set_slices(_slices(stream.groups_for(
            max(1, min(stream.k, int(out.meter.snapshot_every))))))

    @classmethod
    def attach(cls, out: Handover, log_meta: dict[str, Any], options: Any, side: Any) -> None:
        """Give ``out`` a streamer when the log's metadata says its bases are streamed
        (``base_slices.in_force`` > 1, recorded by :func:`~.slices.plan_slices`)."""
        k = int((log_meta.get("base_slices") or {}).get("in_force", 1))
        if k > 1:
            out.streamer = cls(out, schedule_for(log_meta, k, options),
                               lambda step, opt: side.base_meta(step, opt, log_meta))

    def after_step(self, p: PendingStep) -> None:
        """After ``p``'s step: its slice when one is due (a base owed starts a window
        now), else the next slice's memory made when it is near."""
        out, stream = self.out, self.stream
        every = int(out.meter.snapshot_every)
        if stream.auto and stream.window is None and self._tuned != stream.started:
            self._tuned = stream.started  # (once between two bases: the state is listed)
            stream.tune(out.meter.measurements(), out.stager.state_bytes(), every)
        if out.owed:  # (a slice could not be taken, or the first base was not)
            due: tuple[Window, int] | None = (stream.restart_now(p.step, every), 0)
        else:
            due = stream.due(p.step, every, out.last_base, out.meter.auto_snapshot)
        if due is not None:
            self.take_slice(p, *due)
        else:
            out.prepare(p.step)

    def take_slice(self, p: PendingStep, w: Window, i: int) -> None:
        """Slice ``i`` of the streamed base ``w`` from the state after ``p``'s step: staged
        (waiting for staging memory; the slices before it are handed to the writer
        first) and written with the step, or written now from the live tensors. One that
        cannot be staged abandons the base, and a new one starts at the next step."""
        out, stager = self.out, self.out.stager
        t0 = time.perf_counter()
        if i == 0:  # (a window's groups hold for all of its slices)
            stager.set_slices(_slices(w.groups))
            self._wait_limit = self._wait_s(len(w.groups))
        out.hand_over()
        out.write_late(force=True)
        only = Slice(w.groups[i], i == 0)
        base: StagedBase | None
        if self.views and i > 0:
            base = stager.stage_views(p.step, only)
            self._write_live(p.step, base, w)
        else:
            # (after a slice found no memory in time, none waits until memory is free)
            base = stager.stage(p.step, only, None if self.starved else self._wait_limit)
            out.owed = self.starved = base is None
            if base is None:  # (put off: no staging memory free, the writer holds it)
                out.deferred += 1
                self.stream.restart()
                return
            p.base, p.slice = base, w.meta()
        self._slice_s += time.perf_counter() - t0
        self._slice_bytes += base.nbytes
        out.stats["base_slices"] = out.stats.get("base_slices", 0.0) + 1
        if i == len(w.steps) - 1:
            out.last_base = p.step
            out.meter.on_base_staged(self._slice_s, self._slice_bytes)
            self._slice_s, self._slice_bytes = 0.0, 0

    def _wait_s(self, slices: int) -> float:
        """How long a slice of a base of ``slices`` waits for staging memory (worked out
        once, at its first slice): at least :data:`~.stager.SLICE_WAIT_S`, and four
        writes of the two slices held at the measured bandwidth (a slow disk is waited
        for, an outage is not)."""
        m = self.out.meter.measurements()
        if m is None or m.write_bandwidth <= 0:
            return SLICE_WAIT_S
        held = 2 * self.out.stager.state_bytes() / max(1, slices)
        return max(SLICE_WAIT_S, 4 * held / m.write_bandwidth)

    def _write_live(self, step: int, base: StagedBase, w: Window) -> None:
        """A slice after the first, handed to the writer now from views of the live
        tensors: the next hand-over (the one that ends this post-step hook) waits until
        the writer is done reading them (:meth:`settle_live`). Its metadata holds
        the values carried now: only the first slice's non-tensor state is read by a
        restore."""
        out = self.out
        live = LiveBase(step, base.watch)
        meta = {**self._meta_now(step, base.opt or {}), "slice": w.meta()}
        out.send_base(step, base, base.arrays, meta, live=live)
        self.live = live
        if step == w.complete:
            out.stats["bases"] += 1

    def settle_live(self) -> None:
        """Before anything may change the state: wait until the writer is done reading the
        live tensors of the slice written from them (counted in ``slice_wait_s``). A
        tensor of it changed in place meanwhile makes that slice unusable: its base is
        abandoned (never named) and the next one starts at the next step."""
        live, out = self.live, self.out
        assert live is not None
        t0 = time.perf_counter()
        live.done.wait()
        self.live = None
        out.stats["slice_wait_s"] = out.stats.get("slice_wait_s", 0.0) + (
            time.perf_counter() - t0)
        if live.changed:
            self.abandon()
            out.owed = True
            _log.warning("lowdiff-store: %s changed in place while the slice of step %d was "
                         "written from it; that streamed base is abandoned and the next "
                         "step starts another", ", ".join(live.changed[:3]), live.step)

    def abandon(self) -> None:
        """The base in progress cannot complete (a slice was dropped): the next starts
        anew."""
        self.stream.restart()


def _slices(groups: tuple[frozenset[str], ...]) -> tuple[Slice, ...]:
    """The stager's slices of a base of ``groups`` (the first holds the rest of the state)."""
    return tuple(Slice(g, j == 0) for j, g in enumerate(groups))


__all__ = ["Streamer"]
