"""Cost model and tuner for the snapshot interval F and the diff batch size B.

A run takes a *base* every F steps and logs one *diff* per step; diffs are written in
batches of B records per write+fsync. This module predicts the fraction of time such a
schedule wastes (checkpoint stalls plus failures) from measured costs, recommends (F, B),
and tunes them online (:class:`AutoTuner`). ``docs/tuning.md`` explains the model; the
Monte Carlo simulator ``tools/failure_sim.py`` checks it and shares no code with it.

Schedule semantics (the simulator plays the same rules, see ``docs/tuning.md``):

* every step costs ``tau = T + c_D`` of wall time (``c_D``: foreground append cost);
* after step ``i*B`` (relative to the last base, ``i*B < F``) a batch of B diffs is
  submitted; its write takes ``w = a + B*s/BW`` in the background and it becomes durable
  when the write ends; a fraction ``write_blocking`` of ``w`` also stalls training;
* after step F the run stalls ``c_F`` to take a base, durable when the stall ends; the base
  also makes the diffs still in the batch buffer obsolete (they are never written);
* failures form a Poisson process of mean ``M`` in wall time; they strike during steps,
  stalls and recovery alike. A failure costs a recovery ``R + L_F + r*k`` (k diffs replayed
  since the base; a failure during recovery restarts it) and loses everything after the
  last durable step.

Over one base cycle these rules give a sequence of durable points; the expected wall time
to pass each gap between them under Poisson failures has a closed form (the renewal
argument of Daly 2006), so :func:`waste_fraction` is the model's *exact* expectation, and
:func:`first_order_waste_fraction` is its first-order expansion in 1/M, the Young-style
formula ``c_F/(F T) + c_D/T + (R + L_F + r F/2 + tau B/2 + w)/M`` with its discrete terms
worked out.

Only the standard library and numpy are used; nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from lowdiff_store.errors import ConfigError, Reason

__all__ = [
    "DEFAULT_B_BOUNDS",
    "DEFAULT_F_BOUNDS",
    "DEFAULT_MTBF",
    "DEFAULT_RESTART_COST",
    "DEFAULT_UTILIZATION",
    "AutoTuner",
    "Decision",
    "Measurements",
    "Recommendation",
    "RecoveryTime",
    "expected_lost_work",
    "first_order_waste_fraction",
    "max_recovery_time",
    "min_feasible_batch",
    "overhead_fraction",
    "recommend",
    "recovery_breakdown",
    "recovery_time",
    "slices_for",
    "waste_fraction",
    "writer_feasible",
    "young_snapshot_every",
]

# --- tunables: every default lives here and is documented in docs/tuning.md ---------------

#: Mean time between failures of the *job* (s) when none is given: 24 h. Pessimistic for
#: one healthy node (Llama 3: 419 unexpected interruptions in 54 days on 2,048 8-GPU servers,
#: i.e. ~260 days per server), realistic for a job of a few hundred nodes or for a small job
#: that also counts software faults and preemptions. Set it to node_mtbf / n_nodes.
DEFAULT_MTBF = 24 * 3600.0
#: Restart cost R (s): process restart, distributed init, data-loader warm-up. It shifts
#: the predicted waste but not the optimum (F, B).
DEFAULT_RESTART_COST = 60.0
#: Largest fraction of the compute time the background writer may be busy. Headroom for
#: bandwidth jitter: a writer loaded to 100% builds a backlog on the first slow write.
DEFAULT_UTILIZATION = 0.8
#: Default search bounds (inclusive) for the snapshot interval F and the batch size B.
DEFAULT_F_BOUNDS = (1, 100_000)
DEFAULT_B_BOUNDS = (1, 1024)

_FloatArray = npt.NDArray[np.float64]
#: Bandwidth reported when writes show no measurable transfer time (bytes/s).
_MAX_BANDWIDTH = 1e15


def _invalid(detail: str) -> ConfigError:
    return ConfigError(detail, reason=Reason.INVALID_ARGUMENT)


def _number(
    name: str, value: object, *, positive: bool = False, upper: float | None = None
) -> float:
    """Validate a finite real number >= 0 (> 0 when ``positive``), <= ``upper`` if given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(f"{name} must be a number, got {type(value).__name__}")
    x = float(value)
    if not math.isfinite(x):
        raise _invalid(f"{name} must be finite, got {x!r}")
    if positive and x <= 0.0:
        raise _invalid(f"{name} must be > 0, got {x!r}")
    if x < 0.0:
        raise _invalid(f"{name} must be >= 0, got {x!r}")
    if upper is not None and x > upper:
        raise _invalid(f"{name} must be <= {upper}, got {x!r}")
    return x


def _integer(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise _invalid(f"{name} must be an integer, got {type(value).__name__}")
    n = int(value)
    if n < minimum:
        raise _invalid(f"{name} must be >= {minimum}, got {n}")
    return n


def _bounds(name: str, value: object) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise _invalid(f"{name} must be a (low, high) pair, got {value!r}")
    lo = _integer(f"{name}[0]", value[0])
    hi = _integer(f"{name}[1]", value[1])
    if lo > hi:
        raise _invalid(f"{name} is empty: low {lo} > high {hi}")
    return lo, hi


def _utilization(value: object) -> float:
    u = _number("utilization", value, positive=True, upper=1.0)
    return u


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


# --- measurements ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measurements:
    """The measured costs the model needs; all times in seconds, sizes in bytes.

    Attributes:
        iteration_time: T, compute time of one training step.
        diff_bytes: s, bytes of one diff record (on disk, after the codec).
        write_bandwidth: BW, sustained write bandwidth of the log's storage (bytes/s).
        fsync_cost: a, fixed cost of one write+fsync (the part that does not grow with size).
        base_cost: c_F, training stall caused by one base (capture plus whatever of the
            persist the run waits for).
        replay_cost: r, time to replay one diff (read + decode + optimizer step).
        base_load_time: L_F, time to load a base at recovery (default 0: unmeasured; it
            shifts the predicted waste, not the optimum).
        restart_cost: R, time to restart the job before loading (default
            :data:`DEFAULT_RESTART_COST`; shifts the waste, not the optimum).
        append_cost: c_D, foreground cost of appending one diff (default 0).
        mtbf: M, mean time between failures of the job (default :data:`DEFAULT_MTBF`).
        write_blocking: fraction of each write+fsync that stalls training (0: the
            asynchronous writer of lowdiff-store; 1: a synchronous writer).
    """

    iteration_time: float
    diff_bytes: float
    write_bandwidth: float
    fsync_cost: float
    base_cost: float
    replay_cost: float
    base_load_time: float = 0.0
    restart_cost: float = DEFAULT_RESTART_COST
    append_cost: float = 0.0
    mtbf: float = DEFAULT_MTBF
    write_blocking: float = 0.0

    _POSITIVE = frozenset({"iteration_time", "write_bandwidth", "mtbf"})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            upper = 1.0 if f.name == "write_blocking" else None
            value = _number(
                f.name, getattr(self, f.name), positive=f.name in self._POSITIVE, upper=upper
            )
            object.__setattr__(self, f.name, value)

    def to_dict(self) -> dict[str, float]:
        """Plain ``{name: float}`` mapping, JSON- and msgpack-friendly."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurements:
        """Inverse of :meth:`to_dict`: unknown keys are ignored, missing optional keys take
        their defaults; a missing required key or a bad value raises :class:`ConfigError`."""
        if not isinstance(data, Mapping):
            raise _invalid(f"measurements must be a mapping, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in data:
                kwargs[f.name] = data[f.name]
            elif f.default is dataclasses.MISSING:
                raise _invalid(f"measurements: missing required key {f.name!r}")
        return cls(**kwargs)

    def replace(self, **changes: float) -> Measurements:
        """A copy with some fields changed (validated like the constructor)."""
        return dataclasses.replace(self, **changes)


# --- the model -------------------------------------------------------------------------------


def _write_time(m: Measurements, batch: int) -> float:
    """w = a + B*s/BW: duration of one batch write+fsync."""
    return m.fsync_cost + batch * m.diff_bytes / m.write_bandwidth


def writer_feasible(
    m: Measurements, batch: int, *, utilization: float = DEFAULT_UTILIZATION
) -> bool:
    """Whether the background writer keeps up with batches of ``batch`` diffs.

    The non-blocking part of each write must fit in ``utilization`` of the compute time of
    the steps that fill the batch: ``(1 - write_blocking) * (a + B*s/BW) <= utilization*B*T``.
    """
    batch = _integer("batch", batch)
    u = _utilization(utilization)
    return (1.0 - m.write_blocking) * _write_time(m, batch) <= u * batch * m.iteration_time


def min_feasible_batch(m: Measurements, *, utilization: float = DEFAULT_UTILIZATION) -> int | None:
    """The smallest B for which :func:`writer_feasible` holds, or ``None`` when none does
    (``(1 - write_blocking) * s/BW >= utilization * T``: bandwidth, not fsync, is short)."""
    u = _utilization(utilization)
    q = 1.0 - m.write_blocking
    margin = u * m.iteration_time - q * m.diff_bytes / m.write_bandwidth
    if q == 0.0:
        return 1
    if margin <= 0.0:
        return None
    b = max(1, math.ceil(q * m.fsync_cost / margin))
    # ceil() on a ratio of floats can land one off; settle on the exact predicate.
    while b > 1 and writer_feasible(m, b - 1, utilization=u):
        b -= 1
    while not writer_feasible(m, b, utilization=u):
        b += 1
    return b


def young_snapshot_every(m: Measurements) -> float:
    """Young's interval transposed to diff + base schedules: ``sqrt(2 c_F M / (r T))`` steps.

    Young (1974) gives ``sqrt(2 delta M)`` seconds for a checkpoint of cost delta when each
    second since the checkpoint is lost work; here the growing cost per step since the base
    is the replay ``r`` (the diffs themselves are durable), so the interval in steps is
    ``sqrt(2 c_F M / (r T))``. ``inf`` when replay is free, 0 when bases are free.
    """
    if m.replay_cost == 0.0:
        return math.inf
    return math.sqrt(2.0 * m.base_cost * m.mtbf / (m.replay_cost * m.iteration_time))


@dataclasses.dataclass(frozen=True)
class _Cycle:
    """The durable points of one base cycle, for an array of F and one B.

    Segment j runs from durable point j to durable point j+1: ``a0`` is its length on the
    first pass, ``a1`` on a retry (a retry starts from the step after the durable one, which
    the run passed before the write ended), ``k`` the diffs replayed when it fails.
    The first segment starts at the base (no replay), the middle ones are all alike, the
    last one ends when the next base is durable. ``n`` is the number of diff batches that
    become durable in the cycle; with ``n == 0`` the cycle is a single segment.
    """

    F: _FloatArray
    n: _FloatArray
    cycle: _FloatArray  # L, failure-free wall time of one cycle
    first: float  # a0 = a1 of the first segment (n >= 1)
    mid_a0: float
    mid_a1: float
    last_a0: _FloatArray
    last_a1: _FloatArray
    batch: int


def _cycle(m: Measurements, snapshot_every: npt.ArrayLike, batch: int) -> _Cycle:
    F = np.asarray(snapshot_every, dtype=np.float64)
    B = float(batch)
    w = _write_time(m, batch)
    tau = m.iteration_time + m.append_cost
    q = 1.0 - m.write_blocking
    if q * w >= B * tau:
        # The writer cannot keep up: back-pressure stretches the steps until writes run back
        # to back. An estimate (the simulator rejects such schedules); see docs/tuning.md.
        tau = q * w / B
    sigma = m.write_blocking * w  # stall per submitted batch
    n_sub = np.floor((F - 1.0) / B)  # batches submitted per cycle (i*B < F)
    cycle = F * tau + n_sub * sigma + m.base_cost
    # The last submitted batch may end its write after the base is durable: it then counts
    # for nothing (at most that one, as long as writes do not overlap).
    d_last = n_sub * B * tau + (n_sub - 1.0) * sigma + w
    n = np.where((n_sub >= 1.0) & (d_last >= cycle), n_sub - 1.0, n_sub)
    d_n = n * B * tau + (n - 1.0) * sigma + w  # when batch n is durable
    p_n = n * B * tau + n * sigma  # where a run resumed from batch n starts again
    return _Cycle(
        F=F,
        n=n,
        cycle=cycle,
        first=B * tau + w,
        mid_a0=B * tau + sigma,
        mid_a1=B * tau + w,
        last_a0=cycle - d_n,
        last_a1=cycle - p_n,
        batch=batch,
    )


def _expected_cycle_time(m: Measurements, c: _Cycle) -> _FloatArray:
    """Expected wall time of one cycle with Poisson failures (failures during recovery too).

    A segment of first-pass length a0, retry length a1 and recovery D takes in expectation
    ``M e^(D/M) e^(a1/M) (1 - e^(-a0/M))`` (Daly 2006's renewal argument, generalized to
    a retry longer than the first pass). Summed over the segments of one cycle.
    """
    M = m.mtbf
    D = m.restart_cost + m.base_load_time
    rB = m.replay_cost * c.batch
    n = c.n
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        single = M * np.exp(D / M) * np.expm1(c.cycle / M)
        first = M * np.exp(D / M) * np.expm1(c.first / M)
        # sum_{j=1}^{n-1} e^(x j) with x = r B / M, in a form exact for small x
        x = rB / M
        if x > 0.0:
            geo = np.where(n >= 2.0, np.exp(x) * np.expm1(x * (n - 1.0)) / np.expm1(x), 0.0)
        else:
            geo = np.maximum(n - 1.0, 0.0)
        mid = M * np.exp((D + c.mid_a1) / M) * -np.expm1(-c.mid_a0 / M) * geo
        last = M * np.exp((D + rB * n + c.last_a1) / M) * -np.expm1(-c.last_a0 / M)
        total = np.where(n >= 1.0, first + mid + last, single)
    # Overflow (one recovery lasting hundreds of MTBFs) means the run never finishes.
    return np.asarray(np.where(np.isnan(total), np.inf, total), dtype=np.float64)


def _failure_cost_parts(m: Measurements, c: _Cycle) -> tuple[_FloatArray, _FloatArray]:
    """Time averages over one failure-free cycle of (diffs replayed, work lost) when a
    failure strikes at a uniformly random instant: the first-order cost of a failure."""
    n = c.n
    B = float(c.batch)
    a, m0, m1 = c.first, c.mid_a0, c.mid_a1
    mid_count = np.maximum(n - 1.0, 0.0)
    # sum over segments of a0 * k  and  a0 * (a1 - a0/2)
    replay = m0 * B * (n * (n - 1.0) / 2.0) + c.last_a0 * n * B
    lost_multi = (
        a * a / 2.0 + mid_count * m0 * (m1 - m0 / 2.0) + c.last_a0 * (c.last_a1 - c.last_a0 / 2.0)
    )
    lost = np.where(n >= 1.0, lost_multi, c.cycle * c.cycle / 2.0)
    replay = np.where(n >= 1.0, replay, 0.0)
    return replay / c.cycle, lost / c.cycle


def _waste_array(m: Measurements, snapshot_every: npt.ArrayLike, batch: int) -> _FloatArray:
    c = _cycle(m, snapshot_every, batch)
    return np.asarray(_expected_cycle_time(m, c) / (c.F * m.iteration_time) - 1.0, dtype=np.float64)


def _check_schedule(snapshot_every: int, batch: int) -> tuple[int, int]:
    return _integer("snapshot_every", snapshot_every), _integer("batch", batch)


def waste_fraction(m: Measurements, snapshot_every: int, batch: int) -> float:
    """Expected waste per unit of useful compute: ``(wall - N*T) / (N*T)`` for a long run.

    Exact for the schedule and failure model in the module docstring (stalls, lost work,
    recovery, and failures striking during recovery), steady state (the run is many
    cycles long). If the writer cannot keep up, back-pressure is assumed to stretch the
    steps until it does (an estimate; the schedule is then also not :func:`writer_feasible`).
    """
    F, B = _check_schedule(snapshot_every, batch)
    return float(_waste_array(m, [F], B)[0])


def first_order_waste_fraction(m: Measurements, snapshot_every: int, batch: int) -> float:
    """First-order expansion of :func:`waste_fraction` in 1/M.

    ``overhead + (L/(F T)) * (R + L_F + r*k_avg + lost_avg) / M`` where ``L/(F T) - 1`` is
    :func:`overhead_fraction`, ``k_avg`` the mean number of diffs replayed and ``lost_avg``
    :func:`expected_lost_work`. For F >> B and small writes this is the classic
    ``c_F/(F T) + c_D/T + (R + L_F + r F/2 + tau B/2 + w)/M``. Accurate while one failure's
    cost is small against M; it underestimates otherwise (failures during recovery, and
    the re-executed work being exposed again).
    """
    F, B = _check_schedule(snapshot_every, batch)
    c = _cycle(m, [F], B)
    replay, lost = _failure_cost_parts(m, c)
    cost = m.restart_cost + m.base_load_time + m.replay_cost * replay + lost
    L = c.cycle
    return float((L / (F * m.iteration_time) - 1.0 + L / (F * m.iteration_time) * cost / m.mtbf)[0])


def overhead_fraction(m: Measurements, snapshot_every: int, batch: int) -> float:
    """Failure-free slowdown: ``c_F/(F T) + c_D/T`` plus blocking write stalls, as a fraction
    of the compute time."""
    F, B = _check_schedule(snapshot_every, batch)
    c = _cycle(m, [F], B)
    return float((c.cycle / (F * m.iteration_time) - 1.0)[0])


def expected_lost_work(m: Measurements, snapshot_every: int, batch: int) -> float:
    """Mean wall time lost per failure (seconds): from the step after the last durable one
    to the failure. About ``tau*B/2 + w`` while diffs are batched (a batch is durable a write
    time w after it fills), up to half a cycle when ``B >= F`` (only bases are durable)."""
    F, B = _check_schedule(snapshot_every, batch)
    return float(_failure_cost_parts(m, _cycle(m, [F], B))[1][0])


@dataclasses.dataclass(frozen=True)
class RecoveryTime:
    """The mean recovery time per failure, by part (seconds): ``total_s = restart_s +
    base_read_s + replay_s``.

    Attributes:
        restart_s: R, restarting the job before the load (``Measurements.restart_cost``:
            no log can measure it; :data:`DEFAULT_RESTART_COST` unless given).
        base_read_s: L_F, loading the base (``Measurements.base_load_time``).
        replay_s: ``r * replay_diffs``, replaying the diffs since the base.
        replay_diffs: mean number of diffs replayed (about ``(F-1)/2`` for B = 1).
        total_s: the sum, :func:`recovery_time`.
    """

    restart_s: float
    base_read_s: float
    replay_s: float
    replay_diffs: float
    total_s: float

    def to_dict(self) -> dict[str, float]:
        """Plain ``{name: float}``."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}


def recovery_breakdown(m: Measurements, snapshot_every: int, batch: int = 1, *,
                       slices: int = 1) -> RecoveryTime:
    """:func:`recovery_time` by part: restart, base read, replay. ``slices``: bases
    streamed over that many steps (``base_slices``): a restore replays from the first
    slice, ``slices - 1`` diffs more than from a consistent base."""
    F, B = _check_schedule(snapshot_every, batch)
    diffs = float(_failure_cost_parts(m, _cycle(m, [F], B))[0][0]) + _extra(slices)
    replay = m.replay_cost * diffs
    return RecoveryTime(restart_s=m.restart_cost, base_read_s=m.base_load_time,
                        replay_s=replay, replay_diffs=diffs,
                        total_s=m.restart_cost + m.base_load_time + replay)


def _extra(slices: int) -> int:
    """The diffs a restore from a base streamed over ``slices`` steps replays beyond a
    consistent one's."""
    if type(slices) is not int or slices < 1:
        raise _invalid(f"slices={slices!r} must be an int >= 1")
    return slices - 1


def slices_for(m: Measurements, state_bytes: float, snapshot_every: int, *,
               utilization: float = DEFAULT_UTILIZATION) -> int:
    """The fewest slices (2 .. ``snapshot_every``) a base of ``state_bytes`` can be
    streamed over so that one slice and one diff a step fit the disk together: ``state /
    k / BW + s / BW <= utilization * T``. Fewer slices replay fewer extra steps at a
    restore (:func:`recovery_breakdown`); more hold less staging memory and write less
    per step. When even one slice per step of the whole interval does not fit beside the
    diff log, the most slices (``snapshot_every``)."""
    F = _integer("snapshot_every", snapshot_every)
    u = _utilization(utilization)
    room = u * m.iteration_time * m.write_bandwidth - m.diff_bytes
    if F < 2:
        return 1
    if room <= 0:
        return F
    return int(min(F, max(2, math.ceil(float(state_bytes) / room))))


def recovery_time(m: Measurements, snapshot_every: int, batch: int = 1) -> float:
    """Mean recovery time per failure (seconds): ``R + L_F + r * k_avg`` with ``k_avg`` the
    mean number of diffs since the base at the durable point (about ``(F-1)/2`` for B = 1).
    Failures during recovery are not included (they are in :func:`waste_fraction`). By
    part: :func:`recovery_breakdown`."""
    return recovery_breakdown(m, snapshot_every, batch).total_s


def max_recovery_time(m: Measurements, snapshot_every: int, batch: int = 1, *,
                      slices: int = 1) -> float:
    """Worst-case recovery time (seconds): restart, load and replay of the longest chain of
    durable diffs a cycle holds before its next base (from the first slice of a streamed
    base: ``slices - 1`` more)."""
    F, B = _check_schedule(snapshot_every, batch)
    n = float(_cycle(m, [F], B).n[0])
    return m.restart_cost + m.base_load_time + m.replay_cost * (n * B + _extra(slices))


# --- recommendation --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What :func:`recommend` found.

    Attributes:
        snapshot_every: F, steps between bases.
        batch: B, diffs per write+fsync.
        waste_fraction: predicted waste (stalls + failures) per unit of compute at (F, B).
        expected_overhead: the failure-free part of it (base stalls, append, blocking writes).
        expected_lost_work_s: mean work lost per failure (s).
        recovery_time_s: mean recovery time per failure (s).
        recovery: the same by part: restart (assumed unless given), base read, replay.
        max_recovery_time_s: worst-case recovery time (s).
        young_snapshot_every: the analytic ``sqrt(2 c_F M / (r T))`` (None when infinite).
        feasible: False when no batch size in bounds lets the writer keep up.
        reason: which constraints bind, in words.
        inputs: the measurements and search settings used.
        base_slices: streamed bases (``state_bytes`` given): the fewest slices whose write
            fits beside the diff log at F (:func:`slices_for`), whose extra replay the
            recovery figures include; 1: consistent bases.
    """

    snapshot_every: int
    batch: int
    waste_fraction: float
    expected_overhead: float
    expected_lost_work_s: float
    recovery_time_s: float
    max_recovery_time_s: float
    young_snapshot_every: float | None
    feasible: bool
    reason: str
    inputs: dict[str, Any]
    recovery: RecoveryTime
    base_slices: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (non-finite floats become None)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, RecoveryTime):
                v = {k: _finite_or_none(x) for k, x in v.to_dict().items()}
            out[f.name] = _finite_or_none(v) if isinstance(v, float) else v
        return out


def _best_snapshot_every(
    m: Measurements, batch: int, lo: int, hi: int, *, refine: bool
) -> tuple[int, float]:
    """Integer F in [lo, hi] minimizing the waste at this batch size: a log-spaced scan
    (which also contains Young's F) then, if ``refine``, every integer around its minimum."""
    young = young_snapshot_every(m)
    grid = np.geomspace(lo, hi, num=min(256, hi - lo + 1))
    seeds = [lo, hi] + ([min(max(young, lo), hi)] if math.isfinite(young) else [])
    cand = np.unique(
        np.clip(np.rint(np.concatenate([grid, np.asarray(seeds, dtype=np.float64)])), lo, hi)
    )
    waste = _waste_array(m, cand, batch)
    i = int(np.nanargmin(waste))
    best_f, best_w = float(cand[i]), float(waste[i])
    if refine:
        ratio = (hi / lo) ** (1.0 / max(len(grid) - 1, 1)) if hi > lo else 1.0
        span = max(best_f * (ratio**2 - 1.0), 2.0 * batch + 2.0)
        a, b = max(lo, math.floor(best_f - span)), min(hi, math.ceil(best_f + span))
        if b - a > 20_000:  # very flat, very large F: the scan step no longer matters
            a, b = max(lo, int(best_f) - 10_000), min(hi, int(best_f) + 10_000)
        dense = np.arange(a, b + 1, dtype=np.float64)
        waste = _waste_array(m, dense, batch)
        j = int(np.nanargmin(waste))
        if waste[j] < best_w:
            best_f, best_w = float(dense[j]), float(waste[j])
    return int(best_f), best_w


def _batch_candidates(m: Measurements, lo: int, hi: int) -> list[int]:
    cands = {lo, min(lo + 1, hi), min(lo + 2, hi), hi}
    cands.update(int(x) for x in np.unique(np.rint(np.geomspace(lo, hi, num=min(24, hi - lo + 1)))))
    if m.write_blocking > 0.0:
        # Blocking writes cost write_blocking*a/B per step against a lost work of ~tau*B/2
        # per failure: B* = sqrt(2 write_blocking a M / (T tau)), ~sqrt(2 a M)/T.
        tau = m.iteration_time + m.append_cost
        bstar = math.sqrt(2.0 * m.write_blocking * m.fsync_cost * m.mtbf / (m.iteration_time * tau))
        for k in (0.5, 0.7, 0.85, 1.0, 1.2, 1.4, 2.0):
            cands.add(min(max(round(bstar * k), lo), hi))
    return sorted(cands)


def recommend(
    m: Measurements,
    *,
    f_bounds: tuple[int, int] = DEFAULT_F_BOUNDS,
    b_bounds: tuple[int, int] = DEFAULT_B_BOUNDS,
    utilization: float = DEFAULT_UTILIZATION,
    state_bytes: float | None = None,
) -> Recommendation:
    """The (F, B) in bounds that minimizes :func:`waste_fraction`, with the writer feasible.
    ``state_bytes``: bases are streamed (``base_slices``): also the slices for F
    (:func:`slices_for`), and the recovery figures replay from the first slice.

    F starts from Young's ``sqrt(2 c_F M / (r T))`` and is optimized over the integers on
    the discrete model. B is the smallest batch the writer sustains at ``utilization``:
    with an asynchronous writer a larger B only adds lost work. When writes block training
    (``write_blocking > 0``), larger batches amortize the fsync and the optimum moves toward
    ``sqrt(2 a M)/T``; the search covers both. If no B in bounds is feasible the result has
    ``feasible=False`` and B at its upper bound, which minimizes the writer's backlog growth.
    """
    f_lo, f_hi = _bounds("f_bounds", f_bounds)
    b_lo, b_hi = _bounds("b_bounds", b_bounds)
    u = _utilization(utilization)
    b_min = min_feasible_batch(m, utilization=u)
    feasible = b_min is not None and b_min <= b_hi
    if b_min is not None and feasible:
        candidates = _batch_candidates(m, max(b_min, b_lo), b_hi)
    else:
        candidates = [b_hi]
    best: tuple[float, int, int] | None = None
    for b in candidates:  # ascending: ties keep the smaller batch
        f, w = _best_snapshot_every(m, b, f_lo, f_hi, refine=False)
        if best is None or w < best[0]:
            best = (w, f, b)
    assert best is not None
    batch = best[2]
    snapshot_every, waste = _best_snapshot_every(m, batch, f_lo, f_hi, refine=True)

    young = young_snapshot_every(m)
    k = 1 if state_bytes is None else slices_for(m, state_bytes, snapshot_every,
                                                 utilization=u)
    recovery = recovery_breakdown(m, snapshot_every, batch, slices=k)
    reasons = [_snapshot_reason(m, snapshot_every, young, f_lo, f_hi)]
    reasons.append(_batch_reason(m, batch, b_min, b_lo, b_hi, u, feasible))
    return Recommendation(
        snapshot_every=snapshot_every,
        batch=batch,
        waste_fraction=waste,
        expected_overhead=overhead_fraction(m, snapshot_every, batch),
        expected_lost_work_s=expected_lost_work(m, snapshot_every, batch),
        recovery_time_s=recovery.total_s,
        max_recovery_time_s=max_recovery_time(m, snapshot_every, batch, slices=k),
        young_snapshot_every=_finite_or_none(young),
        feasible=feasible,
        reason="; ".join(reasons),
        inputs={
            "measurements": m.to_dict(),
            "f_bounds": [f_lo, f_hi],
            "b_bounds": [b_lo, b_hi],
            "utilization": u,
        },
        recovery=recovery,
        base_slices=k,
    )


def _snapshot_reason(m: Measurements, f: int, young: float, lo: int, hi: int) -> str:
    y = "inf (replay is free)" if not math.isfinite(young) else f"{young:.0f}"
    text = f"snapshot_every={f}: minimizes the discrete model (Young's sqrt(2*c_F*M/(r*T)) = {y})"
    if f == hi:
        text += f", held at the upper bound {hi}"
    elif f == lo and lo < hi:
        text += f", held at the lower bound {lo}"
    return text


def _batch_reason(
    m: Measurements, b: int, b_min: int | None, lo: int, hi: int, u: float, feasible: bool
) -> str:
    per_step = (1.0 - m.write_blocking) * m.diff_bytes / m.write_bandwidth
    if not feasible:
        if b_min is None:
            return (
                f"infeasible: the writer needs {per_step:.4g} s per step for the bytes alone "
                f"(s/BW) but may use only {u * m.iteration_time:.4g} s ({u:.0%} of T); no batch "
                "size fixes that: shrink the diffs (codec), use faster storage, or raise the "
                f"utilization cap; batch={b} (upper bound) minimizes the backlog growth"
            )
        return (
            f"infeasible: the writer keeps up only from batch={b_min}, above the upper bound "
            f"{hi}; batch={b} minimizes the backlog growth"
        )
    budget = u * b * m.iteration_time
    busy = (1.0 - m.write_blocking) * _write_time(m, b)
    smallest = max(b_min if b_min is not None else lo, lo)
    if b > smallest and m.write_blocking > 0.0:
        return (
            f"batch={b}: above the smallest feasible batch ({smallest}) because "
            f"{m.write_blocking:.0%} of each write blocks training; larger batches amortize "
            "the fsync cost against the lost work (B* ~ sqrt(2*a*M)/T)"
            + (f", held at the upper bound {hi}" if b == hi else "")
        )
    if b > smallest:
        return f"batch={b}: lowest predicted waste (the writer keeps up from batch={smallest})"
    if b_min is not None and b_min < lo:
        return f"batch={b}: the lower bound (the writer would keep up from batch={b_min})"
    return (
        f"batch={b}: smallest batch the writer sustains at {u:.0%} utilization "
        f"((1-write_blocking)*(a + B*s/BW) = {busy:.4g} s <= {u:.0%}*B*T = {budget:.4g} s); "
        "larger batches only add lost work"
    )


# --- online tuner ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decision:
    """A change of (F, B) made by :class:`AutoTuner`, to be recorded in the log.

    Attributes:
        step: the step at which the change was decided.
        snapshot_every, batch: the new values.
        previous_snapshot_every, previous_batch: the values they replace.
        predicted_waste_before, predicted_waste_after: :func:`waste_fraction` of the old and
            new values under ``measurements``.
        reason: why (``"writer backlog"``, ``"writer infeasible"``, ``"model"``) and details.
        measurements: what the model was given (None for a backlog raise made before the
            tuner had estimates; the predicted wastes are then NaN).
    """

    step: int
    snapshot_every: int
    batch: int
    previous_snapshot_every: int
    previous_batch: int
    predicted_waste_before: float
    predicted_waste_after: float
    reason: str
    measurements: Measurements | None

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (non-finite floats become None)."""
        return {
            "step": self.step,
            "snapshot_every": self.snapshot_every,
            "batch": self.batch,
            "previous_snapshot_every": self.previous_snapshot_every,
            "previous_batch": self.previous_batch,
            "predicted_waste_before": _finite_or_none(self.predicted_waste_before),
            "predicted_waste_after": _finite_or_none(self.predicted_waste_after),
            "reason": self.reason,
            "measurements": None if self.measurements is None else self.measurements.to_dict(),
        }


class _Median:
    """Median of the last ``size`` samples: one outlier cannot move it."""

    def __init__(self, size: int) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, x: float) -> None:
        self._values.append(x)

    def __len__(self) -> int:
        return len(self._values)

    def get(self) -> float | None:
        return statistics.median(self._values) if self._values else None

    def clear(self) -> None:
        self._values.clear()


def _fit_write_cost(
    nbytes: Iterable[float], seconds: Iterable[float], fsync: Iterable[float]
) -> tuple[float, float]:
    """Estimate (a, BW) from recent writes: ``seconds = a + nbytes/BW``.

    With enough spread in write sizes, a Theil-Sen fit (median of pairwise slopes, then
    median intercept), robust to a few slow writes. Without spread the two parts cannot be
    told apart; the fixed part is then taken as the fsync time and the rest as transfer.
    That split errs toward a larger a, i.e. toward larger batches when B is lowered.
    """
    x = np.asarray(list(nbytes), dtype=np.float64)
    y = np.asarray(list(seconds), dtype=np.float64)
    f = np.asarray(list(fsync), dtype=np.float64)
    if len(x) >= 4 and x.min() > 0 and x.max() >= 1.2 * x.min():
        i, j = np.triu_indices(len(x), k=1)
        dx = x[j] - x[i]
        ok = np.abs(dx) >= 0.05 * x.min()
        if ok.sum() >= 3:
            slope = float(np.median((y[j] - y[i])[ok] / dx[ok]))
            if slope > 0.0:
                a = max(float(np.median(y - slope * x)), 0.0)
                return a, 1.0 / slope
    a = float(np.median(np.minimum(f, y)))
    transfer = float(np.median(y)) - a
    size = float(np.median(x))
    if transfer <= 0.0 or size <= 0.0:
        return a, _MAX_BANDWIDTH  # all of it in fsync: no measurable transfer time
    return a, min(size / transfer, _MAX_BANDWIDTH)


class AutoTuner:
    """Online tuning of (F, B) from measured costs, with hysteresis.

    Feed it observations as the run goes (``observe_*``) and call :meth:`maybe_update`
    (cheap; it re-runs the model at most every ``evaluate_every`` steps). A change is made
    only when the new value differs from the current one by at least ``min_relative_change``
    *and* the model predicts a waste lower by at least ``min_improvement`` (relative), after
    ``min_observations`` steps and at least ``min_steps_between_changes`` steps since the
    last change. Estimates are windowed medians, so a slow step or write does not move them.

    Two rules bypass the hysteresis, because a starved writer loses durability: if the
    current B is not :func:`writer_feasible` under the measured bandwidth, or the writer's
    backlog keeps growing, B is raised at once (to at least twice its value on a backlog).

    F is tuned only once a base and a replay cost have been observed (``observe_replay``
    takes a measured replay or an estimate from the optimizer step time); until then only B
    is. Not thread-safe: call it from one thread (the training loop or the writer's).
    """

    def __init__(
        self,
        *,
        snapshot_every: int,
        batch: int,
        mtbf: float = DEFAULT_MTBF,
        restart_cost: float = DEFAULT_RESTART_COST,
        write_blocking: float = 0.0,
        tune_snapshot_every: bool = True,
        tune_batch: bool = True,
        min_observations: int = 50,
        min_steps_between_changes: int = 1000,
        evaluate_every: int = 100,
        min_relative_change: float = 0.25,
        min_improvement: float = 0.03,
        window: int = 101,
        utilization: float = DEFAULT_UTILIZATION,
        f_bounds: tuple[int, int] = DEFAULT_F_BOUNDS,
        b_bounds: tuple[int, int] = DEFAULT_B_BOUNDS,
    ) -> None:
        self._f_bounds = _bounds("f_bounds", f_bounds)
        self._b_bounds = _bounds("b_bounds", b_bounds)
        self._F = _integer("snapshot_every", snapshot_every)
        self._B = _integer("batch", batch)
        self._mtbf = _number("mtbf", mtbf, positive=True)
        self._restart = _number("restart_cost", restart_cost)
        self._blocking = _number("write_blocking", write_blocking, upper=1.0)
        self._tune_f = bool(tune_snapshot_every)
        self._tune_b = bool(tune_batch)
        self._min_obs = _integer("min_observations", min_observations)
        self._min_gap = _integer("min_steps_between_changes", min_steps_between_changes, minimum=0)
        self._every = _integer("evaluate_every", evaluate_every)
        self._min_change = _number("min_relative_change", min_relative_change)
        self._min_improvement = _number("min_improvement", min_improvement)
        self._u = _utilization(utilization)
        w = _integer("window", window)
        self._T = _Median(w)
        self._s = _Median(w)
        self._cd = _Median(w)
        self._writes: deque[tuple[float, float, float]] = deque(maxlen=64)
        self._bases = _Median(9)
        self._loads = _Median(9)
        self._replay = _Median(w)
        self._steps = 0
        self._produced = 0  # steps observed
        self._written = 0  # diff records written
        self._backlog: deque[int] = deque(maxlen=8)  # backlog after each write since B changed
        # A raise of B is judged only once what was queued before it is written.
        self._drain_until = 0
        self._last_backlog: tuple[int, int] | None = None  # (backlog, steps observed then)
        self._last_change: int | None = None
        self._last_eval: int | None = None

    # observations

    def observe_step(
        self, iteration_time: float, diff_bytes: float, append_cost: float = 0.0
    ) -> None:
        """One training step: its compute time (s), its diff size (bytes) and the foreground
        time ``append`` took (s)."""
        self._T.add(_number("iteration_time", iteration_time, positive=True))
        self._s.add(_number("diff_bytes", diff_bytes))
        self._cd.add(_number("append_cost", append_cost))
        self._steps += 1
        self._produced += 1

    def observe_write(
        self,
        nbytes: float,
        seconds: float,
        fsync_seconds: float,
        records: int,
        pending_records: int | None = None,
    ) -> None:
        """One batch write finished: bytes written, wall time of write+fsync (s), the part of
        it spent in fsync (s), the diff records it made durable, and, if the writer knows, how
        many records still wait for a write (otherwise derived from the step count)."""
        nb = _number("nbytes", nbytes)
        sec = _number("seconds", seconds)
        fs = _number("fsync_seconds", fsync_seconds)
        n = _integer("records", records, minimum=0)
        self._writes.append((nb, sec, min(fs, sec)))
        fresh = self._written >= self._drain_until  # all of it queued after B last changed
        self._written += n
        if pending_records is not None:
            backlog = _integer("pending_records", pending_records, minimum=0)
        else:
            backlog = max(self._produced - self._written, 0)
        self._last_backlog = (backlog, self._produced)
        if fresh:
            self._backlog.append(backlog)

    def observe_base(self, stall_seconds: float, load_seconds: float | None = None) -> None:
        """One base: the training stall it caused (s) and, if known, the time to load it (s)."""
        self._bases.add(_number("stall_seconds", stall_seconds))
        if load_seconds is not None:
            self._loads.add(_number("load_seconds", load_seconds))

    def observe_replay(self, seconds_per_step: float) -> None:
        """Replay cost of one diff (s): measured on a recovery, or estimated from the time
        of ``optimizer.step()`` plus decode."""
        self._replay.add(_number("seconds_per_step", seconds_per_step))

    # state

    @property
    def current(self) -> tuple[int, int]:
        """The (snapshot_every, batch) in force."""
        return self._F, self._B

    def measurements(self) -> Measurements | None:
        """The robust estimates so far, or None before ``min_observations`` steps and three
        writes. Unobserved base or replay costs are reported as 0 (F is then not tuned)."""
        T, s = self._T.get(), self._s.get()
        if T is None or s is None or self._steps < self._min_obs or len(self._writes) < 3:
            return None
        nb, sec, fs = zip(*self._writes, strict=True)
        a, bw = _fit_write_cost(nb, sec, fs)
        return Measurements(
            iteration_time=T,
            diff_bytes=s,
            write_bandwidth=bw,
            fsync_cost=a,
            base_cost=self._bases.get() or 0.0,
            replay_cost=self._replay.get() or 0.0,
            base_load_time=self._loads.get() or 0.0,
            restart_cost=self._restart,
            append_cost=self._cd.get() or 0.0,
            mtbf=self._mtbf,
            write_blocking=self._blocking,
        )

    def writer_behind(self) -> bool:
        """True when the writer's backlog exceeds three batches and grew over the last four
        writes, counting only writes after the records queued when B last changed (a raise
        cannot show its effect before the backlog it inherited is written)."""
        b = self._backlog
        if len(b) < 4:
            return False
        return b[-1] > 3 * self._B and b[-1] > b[-4]

    # decisions

    def maybe_update(self, step: int) -> Decision | None:
        """Decide whether to change (F, B) at ``step``; returns the change, or None."""
        step = _integer("step", step, minimum=0)
        b_hi = self._b_bounds[1]
        if self._tune_b and self.writer_behind() and self._B < b_hi:
            m = self.measurements()
            target = 2 * self._B
            if m is not None:
                b_min = min_feasible_batch(m, utilization=self._u)
                target = max(target, b_min if b_min is not None else b_hi)
            return self._change(
                step, m, self._F, min(target, b_hi), "writer backlog: the writer falls behind"
            )
        if self._last_eval is not None and step - self._last_eval < self._every:
            return None
        m = self.measurements()
        if m is None:
            return None
        self._last_eval = step
        if self._tune_b and not writer_feasible(m, self._B, utilization=self._u) and self._B < b_hi:
            b_min = min_feasible_batch(m, utilization=self._u)
            # 25% headroom so that noise around the limit does not trigger again at once
            target = b_hi if b_min is None else min(b_hi, max(b_min, math.ceil(1.25 * b_min)))
            return self._change(
                step, m, self._F, target, "writer infeasible at the measured bandwidth"
            )
        if self._last_change is not None and step - self._last_change < self._min_gap:
            return None
        tune_f = self._tune_f and m.base_cost > 0.0 and m.replay_cost > 0.0
        rec = recommend(
            m,
            f_bounds=self._f_bounds if tune_f else (self._F, self._F),
            b_bounds=self._b_bounds if self._tune_b else (self._B, self._B),
            utilization=self._u,
        )
        new_f = (
            rec.snapshot_every
            if _differs(rec.snapshot_every, self._F, self._min_change)
            else self._F
        )
        new_b = rec.batch if _differs(rec.batch, self._B, self._min_change) else self._B
        if (new_f, new_b) == (self._F, self._B):
            return None
        before = waste_fraction(m, self._F, self._B)
        after = waste_fraction(m, new_f, new_b)
        if not after <= before * (1.0 - self._min_improvement):
            return None
        return self._change(step, m, new_f, new_b, f"model: {rec.reason}")

    def _change(self, step: int, m: Measurements | None, f: int, b: int, reason: str) -> Decision:
        before = after = math.nan  # a backlog can show before the model has estimates
        if m is not None:
            before, after = waste_fraction(m, self._F, self._B), waste_fraction(m, f, b)
        d = Decision(
            step=step,
            snapshot_every=f,
            batch=b,
            previous_snapshot_every=self._F,
            previous_batch=self._B,
            predicted_waste_before=before,
            predicted_waste_after=after,
            reason=reason,
            measurements=m,
        )
        if b != self._B:
            pending = self._produced - self._written
            if self._last_backlog is not None:  # the last sample, plus the steps since
                pending = self._last_backlog[0] + self._produced - self._last_backlog[1]
            self._drain_until = self._written + max(pending, 0)
            self._backlog.clear()
        self._F, self._B = f, b
        self._last_change = step
        return d


def _differs(new: int, old: int, threshold: float) -> bool:
    return abs(new - old) >= threshold * old
