"""Measured costs for the tuner, and ``snapshot_every="auto"`` / ``batch="auto"``.

:class:`CostMeter` sits in :class:`DiffCheckpointer`'s hooks. Every step it measures, in the
training thread and at the cost of a few clock reads:

- the iteration time T: wall time between two post-step hooks, less the time spent in the
  checkpointer's own hooks, per step;
- the foreground cost of a step's checkpoint c_D (the hooks' time, less a base's copy);
- the diff size s (bytes of the records the writer wrote, per record; the encoded size of
  the step before the first write);
- the writer's batches (bytes, write + fsync seconds, fsync seconds, records, backlog) from
  the deltas of ``AsyncLogWriter.stats()`` since the previous step;
- each base's stall c_F (the time the training thread spends copying the state; with
  background bases, the request) and the copy bandwidth it shows;
- the replay cost per diff r: the time of ``optimizer.step()`` (between the pre- and
  post-step hooks) plus the copy of the diff at the measured copy bandwidth (grad mode), or
  the step's capture time (delta mode: decoding mirrors encoding); a background base worker
  replaces the estimate with its measured replay time per diff.

It feeds them to an :class:`~lowdiff_store.tuning.AutoTuner`. In auto mode the tuner's
decisions are applied at once (the writer's batch size through ``AsyncLogWriter.set_batch``;
the base interval counted from the last base) and each :class:`~lowdiff_store.tuning.Decision`
goes into the step's record (``extra["tuning"]``, read back by
:func:`lowdiff_store.tuning_from_log.recorded_decisions`). Whatever the mode, the
:class:`~lowdiff_store.tuning.Measurements` are published in the manifest's metadata under
``"measurements"`` at every base (from a helper thread: the training thread never waits on
that manifest write) and at close, so ``lowdiff-store tune`` works on every log the
checkpointer wrote.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import statistics
import weakref
from collections import deque
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError, LowdiffError
from ...log.manifest import update_manifest
from ...tuning import DEFAULT_MTBF, AutoTuner, Measurements

_log = logging.getLogger(__name__)

#: The base interval ``snapshot_every="auto"`` starts from, before anything is measured.
AUTO_INITIAL_SNAPSHOT_EVERY = 100
#: The batch ``batch="auto"`` starts from.
AUTO_INITIAL_BATCH = 1
#: Copy bandwidth assumed for the replay estimate until a base has been copied (bytes/s).
_DEFAULT_COPY_BW = 2e9
_WINDOW = 101


def _median(xs: deque[float]) -> float | None:
    return statistics.median(xs) if xs else None


class CostMeter:
    """Measurements of one checkpointer's run, and the online tuner (see the module
    docstring).

    Args:
        path: the log directory (its manifest receives the measurements).
        mode: the checkpointer's mode (``"grad"`` or ``"delta"``).
        snapshot_every: an int, or ``"auto"``.
        batch: an int, or ``"auto"``.
        mtbf: mean time between failures of the job in seconds (None: the tuner's default,
            :data:`lowdiff_store.tuning.DEFAULT_MTBF`).
        tuner_options: further keyword arguments of :class:`AutoTuner` (hysteresis
            thresholds, bounds).
    """

    def __init__(self, path: str, *, mode: str, snapshot_every: int | str, batch: int | str,
                 mtbf: float | None = None, tuner_options: Mapping[str, Any] | None = None
                 ) -> None:
        self.path = path
        self.mode = mode
        self.auto_snapshot = snapshot_every == "auto"
        self.auto_batch = batch == "auto"
        self.snapshot_every = (AUTO_INITIAL_SNAPSHOT_EVERY if self.auto_snapshot
                               else int(snapshot_every))
        self.batch = AUTO_INITIAL_BATCH if self.auto_batch else int(batch)
        self.mtbf = DEFAULT_MTBF if mtbf is None else float(mtbf)
        opts = dict(tuner_options or {})
        for k in ("snapshot_every", "batch", "mtbf", "tune_snapshot_every", "tune_batch"):
            if k in opts:
                raise ConfigError(f"tuner option {k!r} is set by the checkpointer's own "
                                  f"arguments")
        try:
            self.tuner = AutoTuner(snapshot_every=self.snapshot_every, batch=self.batch,
                                   mtbf=self.mtbf, tune_snapshot_every=self.auto_snapshot,
                                   tune_batch=self.auto_batch, **opts)
        except TypeError as e:
            raise ConfigError(f"bad tuner option: {e}") from None
        self._utilization = float(opts.get("utilization", 0.8))
        self._T: deque[float] = deque(maxlen=_WINDOW)
        self._s: deque[float] = deque(maxlen=_WINDOW)
        self._cd: deque[float] = deque(maxlen=_WINDOW)
        self._opt: deque[float] = deque(maxlen=_WINDOW)
        self._replay: deque[float] = deque(maxlen=_WINDOW)
        self._stalls: deque[float] = deque(maxlen=9)
        self._loads: deque[float] = deque(maxlen=9)
        self._writes: deque[tuple[float, float, float]] = deque(maxlen=64)
        self._last_post: tuple[float, float, int] | None = None
        self._stall_pending = 0.0
        self._bases_seen = 0
        self._bases_fed = 0
        self._sample: tuple[float, float] | None = None  # (T, c_D) of the newest step
        self._copy_bw: float | None = None
        self._record_bytes: float | None = None
        self._worker_replay = False
        self._worker_base_s: float | None = None   # worker load + write of one base
        self._prev: dict[str, float] | None = None
        self.decisions: list[dict[str, Any]] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._publishing: concurrent.futures.Future[None] | None = None

    @property
    def auto(self) -> bool:
        """Either value is tuned online."""
        return self.auto_snapshot or self.auto_batch

    # ------------------------------------------------------------------ observations

    def on_post(self, now: float, step: int, hooks_s: float, opt_step_s: float | None) -> None:
        """At the start of a post-step hook: ``now`` (perf_counter), the step it ends, the
        checkpointer's cumulative hook seconds, the ``optimizer.step()`` time if known."""
        last = self._last_post
        self._last_post = (now, hooks_s, step)
        if opt_step_s is not None and opt_step_s >= 0:
            self._opt.append(opt_step_s)
        if last is None or step <= last[2]:
            return
        n = step - last[2]
        hooks = hooks_s - last[1]
        fg = max(hooks - self._stall_pending, 0.0) / n
        self._stall_pending = 0.0
        T = (now - last[0] - hooks) / n
        self._sample = (max(T, 1e-9), fg)

    def on_base_staged(self, seconds: float, nbytes: int) -> None:
        """A base was taken in the training thread: its stall and the bytes copied
        (``nbytes`` 0 for a background request, which copies nothing)."""
        self._stalls.append(max(seconds, 0.0))
        self._bases_seen += 1
        self._stall_pending += max(seconds, 0.0)
        if nbytes and seconds > 0:
            self._copy_bw = nbytes / seconds
            self._loads.append(seconds)  # loading a base costs about one copy of it

    def on_worker_base(self, load_s: float, replay_s_per_diff: float | None,
                       write_s: float) -> None:
        """A background worker made a base: its measured load, replay per diff and write."""
        if load_s >= 0:
            self._loads.append(load_s)
        if replay_s_per_diff is not None and replay_s_per_diff > 0:
            if not self._worker_replay:
                self._replay.clear()
                self._worker_replay = True
            self._replay.append(replay_s_per_diff)
            self.tuner.observe_replay(replay_s_per_diff)
        self._worker_base_s = max(load_s, 0.0) + max(write_s, 0.0)

    def _poll_writer(self, stats: Mapping[str, float]) -> None:
        prev, self._prev = self._prev, dict(stats)
        if prev is None:
            return
        k = int(stats.get("batches", 0) - prev.get("batches", 0))
        if k <= 0:
            return
        nb = stats["bytes"] - prev["bytes"]
        recs = int(stats["records"] - prev["records"])
        sec = (stats["write_s"] - prev["write_s"]) + (stats["fsync_s"] - prev["fsync_s"])
        fs = stats["fsync_s"] - prev["fsync_s"]
        if recs > 0:
            self._record_bytes = nb / recs
        self._writes.append((nb / k, sec / k, fs / k))
        self.tuner.observe_write(nb / k, sec / k, fs / k, max(recs, 0),
                                 pending_records=max(int(stats.get("queued", 0)), 0))

    def on_record(self, step: int, encoded_bytes: int, writer_stats: Mapping[str, float]
                  ) -> dict[str, Any] | None:
        """A step's record is about to be handed to the writer: observe the step and the
        writer, and in auto mode let the tuner decide. Returns the decision (a dict for
        the record's ``extra["tuning"]``) when (F, B) changed, else None; the new values
        are then in :attr:`snapshot_every` and :attr:`batch` (the caller applies them)."""
        self._poll_writer(writer_stats)
        sample, self._sample = self._sample, None
        if sample is None:
            return None
        T, cd = sample
        s = self._record_bytes if self._record_bytes is not None else float(encoded_bytes)
        self._T.append(T)
        self._s.append(s)
        self._cd.append(cd)
        self.tuner.observe_step(T, s, cd)
        if not self._worker_replay:
            r = self._replay_estimate(encoded_bytes, cd)
            if r is not None:
                self._replay.append(r)
                self.tuner.observe_replay(r)
        if self._bases_fed != self._bases_seen:
            self._bases_fed = self._bases_seen
            self.tuner.observe_base(self._stalls[-1], self._loads[-1] if self._loads else None)
        if not self.auto:
            return None
        d = self.tuner.maybe_update(step)
        if d is None:
            return None
        out = d.to_dict()
        f = d.snapshot_every
        f_min = self.worker_min_interval()
        if self.auto_snapshot and f_min is not None and f < f_min:
            f = f_min
            out["applied_snapshot_every"] = f
            out["reason"] += (f"; snapshot_every raised to {f}: the background base worker "
                              f"needs that many steps per base")
        self.snapshot_every, self.batch = f, d.batch
        self.decisions.append(out)
        return out

    def _replay_estimate(self, encoded_bytes: int, cd: float) -> float | None:
        if self.mode == "delta":
            return cd if cd > 0 else None
        opt = _median(self._opt)
        if opt is None:
            return None
        return opt + encoded_bytes / (self._copy_bw or _DEFAULT_COPY_BW)

    def worker_min_interval(self) -> int | None:
        """With background bases: the smallest interval at which the worker keeps up
        (each base costs it a load and a write besides the replay of every diff), or None
        when unknown."""
        T, r = _median(self._T), _median(self._replay)
        if self._worker_base_s is None or T is None or r is None:
            return None
        margin = self._utilization * T - r
        if margin <= 0:
            return 100000
        return max(1, math.ceil(self._worker_base_s / margin))

    # ------------------------------------------------------------------ results

    def measurements(self) -> Measurements | None:
        """The tuner's robust estimates once it has enough, else medians of what was seen
        (None before one step and one write)."""
        m = self.tuner.measurements()
        T, s = _median(self._T), _median(self._s)
        if T is None or s is None or not self._writes:
            return m
        base = _median(self._stalls) or 0.0
        replay = _median(self._replay) or 0.0
        if m is not None:
            # the tuner reports 0 for what it has not fed on yet
            if m.base_cost == 0.0 and base > 0:
                m = m.replace(base_cost=base)
            if m.replay_cost == 0.0 and replay > 0:
                m = m.replace(replay_cost=replay)
            return m
        fs = statistics.median(w[2] for w in self._writes)
        nb = sum(w[0] for w in self._writes)
        transfer = sum(max(w[1] - w[2], 0.0) for w in self._writes)
        bw = nb / transfer if transfer > 0 and nb > 0 else 1e12
        try:
            return Measurements(iteration_time=T, diff_bytes=s, write_bandwidth=bw,
                                fsync_cost=fs, base_cost=base, replay_cost=replay,
                                base_load_time=_median(self._loads) or 0.0,
                                append_cost=_median(self._cd) or 0.0, mtbf=self.mtbf)
        except ConfigError:
            return None

    def publish(self, *, wait: bool = False) -> None:
        """Publish :meth:`measurements` in the manifest's metadata (``"measurements"``):
        from a helper thread unless ``wait`` (at close). A publish still running is not
        queued behind: the next base publishes fresher numbers."""
        m = self.measurements()
        if m is None:
            return
        data = m.to_dict()
        if wait:
            self._drain()
            self._write(data)
            return
        if self._publishing is not None and not self._publishing.done():
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="lowdiff-measurements")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        self._publishing = self._pool.submit(self._write, data)

    def _write(self, data: dict[str, float]) -> None:
        try:
            update_manifest(self.path, lambda m: m.meta.__setitem__("measurements", data))
        except (LowdiffError, OSError) as e:  # measurements are advisory: never fail a run
            _log.warning("could not record measurements in %s: %s", self.path, e)

    def _drain(self) -> None:
        if self._publishing is not None:
            self._publishing.result()
            self._publishing = None

    def close(self, writer_stats: Mapping[str, float] | None = None) -> None:
        """Publish the final measurements (synchronously) and stop the helper thread.
        ``writer_stats``: the writer's counters once everything is flushed, so the writes
        that finished after the last step count too (a short run on slow storage may have
        none before)."""
        try:
            if writer_stats is not None:
                self._poll_writer(writer_stats)
            self.publish(wait=True)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


__all__ = ["AUTO_INITIAL_BATCH", "AUTO_INITIAL_SNAPSHOT_EVERY", "CostMeter"]
