#!/usr/bin/env python3
"""Monte Carlo failure simulator for diff + base checkpoint schedules.

It plays a training run of N steps against Poisson failures and measures the waste
``(wall - N*T) / (N*T)``. It is the check on ``lowdiff_store.tuning``'s model and shares no
code with it: the model is a closed-form expectation; this is an explicit timeline.

Rules of the run (``docs/tuning.md`` states the same rules for the model):

* A step is ``T`` of compute plus ``c_D`` of foreground append: ``tau = T + c_D``.
* Diffs are grouped B per write, counted from the last base. When step ``i*B`` (``i*B < F``
  relative to the base) ends, its batch is submitted; the write takes
  ``w = a + B*s/BW`` and the batch is durable when it ends. A fraction ``write_blocking``
  of ``w`` also stalls training right after submission. Writes must not overlap (the
  simulator refuses schedules where they would: a writer that falls behind needs
  back-pressure, which is not simulated).
* After step ``F`` the run stalls ``c_F`` to take a base, durable when the stall ends. The
  base also makes the diffs still in the batch buffer obsolete (they are never written).
* Failures are a Poisson process of mean M in wall time. They strike anywhere: during
  steps, stalls, and recovery. After a failure the run restarts from the last durable step
  P: recovery takes ``R + L_F + r*k`` (k = diffs since the base at P); a failure during
  recovery restarts the recovery. The writer restarts empty; all work after P is redone.
* The run ends when step N and the stall that follows it (if any) are done.

Speed: the schedule of one base cycle is laid out once as a table of step start times and
durability events; between two failures the run is deterministic, so each failure is one
table lookup. Replicas (independent runs) are vectorized with numpy; failure gaps are drawn
from a seeded generator as a full (replica,) row per failure, so two schedules simulated
with the same seed see the same failure gaps (common random numbers).

CLI::

    python tools/failure_sim.py --T 0.2 --c-base 5 --replay 0.05 --mtbf 3600 --F 300 --B 4
    python tools/failure_sim.py --T 0.2 --c-base 5 --replay 0.05 --mtbf 3600 --grid --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import numpy as np
import numpy.typing as npt


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A workload and its checkpoint schedule (times in seconds, sizes in bytes)."""

    T: float  # compute time of one step
    c_base: float  # training stall per base
    replay: float  # replay time per diff
    mtbf: float  # mean time between failures
    F: int  # steps between bases
    B: int  # diffs per write
    append: float = 0.0  # foreground cost per step (c_D)
    fsync: float = 0.0  # fixed cost per write (a)
    diff_bytes: float = 0.0  # bytes per diff (s)
    bandwidth: float = 1e12  # write bandwidth (BW)
    load: float = 0.0  # time to load a base (L_F)
    restart: float = 60.0  # restart cost (R)
    write_blocking: float = 0.0  # fraction of each write that stalls training

    def __post_init__(self) -> None:
        if self.F < 1 or self.B < 1:
            raise ValueError("F and B must be >= 1")
        if self.T <= 0 or self.mtbf <= 0 or self.bandwidth <= 0:
            raise ValueError("T, mtbf and bandwidth must be > 0")
        if not 0.0 <= self.write_blocking <= 1.0:
            raise ValueError("write_blocking must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate` (means over replicas)."""

    waste: float  # (wall - N*T) / (N*T), pooled over replicas
    stderr: float  # standard error of ``waste`` (spread between replicas)
    failures: float  # mean number of failures per replica
    lost_work: float  # mean wall time lost per failure outside recovery (s)
    recovery: float  # mean length of one recovery without interruption (s)
    n_steps: int
    replicas: int

    def to_dict(self) -> dict[str, float | int]:
        """Plain-type view for --json."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Table:
    cycle: float  # wall time of one failure-free cycle
    step_start: npt.NDArray[np.float64]  # [j]: start of relative step j+1, j = 0..F-1
    event_time: npt.NDArray[np.float64]  # durability events within [0, cycle), ascending
    event_step: npt.NDArray[np.int64]  # steps (relative to the cycle's base) made durable
    end_offset: npt.NDArray[np.float64]  # [j]: when relative step j and its stall are done


def _lay_out_cycle(p: Schedule) -> _Table:
    """Walk one cycle step by step and record when each step starts and what becomes
    durable when. Offset 0 is the moment the previous base became durable."""
    tau = p.T + p.append
    w = p.fsync + p.B * p.diff_bytes / p.bandwidth
    stall = p.write_blocking * w
    step_start = np.empty(p.F, dtype=np.float64)
    end_offset = np.zeros(p.F, dtype=np.float64)
    times = [0.0]  # the base of the previous cycle
    steps = [0]
    t = 0.0
    writer_free = 0.0
    submitted: list[float] = []
    for j in range(1, p.F + 1):
        step_start[j - 1] = t
        t += tau
        if j < p.F and j % p.B == 0:
            if t < writer_free:
                raise ValueError(
                    f"writes overlap: a write takes {w:.4g} s but a batch fills every "
                    f"{p.B * tau + stall:.4g} s; the writer cannot keep up at B={p.B}"
                )
            writer_free = t + w
            submitted.append(t)
            times.append(t + w)
            steps.append(j)
            t += stall
        if j < p.F:
            end_offset[j] = t
    cycle = t + p.c_base
    if submitted and cycle + submitted[0] < writer_free:
        raise ValueError(
            f"writes overlap across a base: a write takes {w:.4g} s; the writer cannot keep up"
        )
    # A batch whose write ends after the base is durable adds nothing: the base covers it.
    keep = [i for i, x in enumerate(times) if x < cycle]
    return _Table(
        cycle=cycle,
        step_start=step_start,
        event_time=np.asarray([times[i] for i in keep], dtype=np.float64),
        event_step=np.maximum.accumulate(np.asarray([steps[i] for i in keep], dtype=np.int64)),
        end_offset=end_offset,
    )


def simulate(p: Schedule, n_steps: int, *, replicas: int = 128, seed: int = 0) -> SimResult:
    """Simulate ``replicas`` independent runs of ``n_steps`` steps; pooled waste."""
    if n_steps < 1 or replicas < 2:
        raise ValueError("n_steps >= 1 and replicas >= 2 required")
    tab = _lay_out_cycle(p)
    F = p.F
    rng = np.random.default_rng(seed)

    def position(step: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        """Where on the failure-free timeline a run resumed after ``step`` starts again."""
        k, j = np.divmod(step, F)
        return np.asarray(k * tab.cycle + tab.step_start[j], dtype=np.float64)

    k_end, j_end = divmod(n_steps, F)
    finish_at = k_end * tab.cycle + (tab.end_offset[j_end] if j_end else 0.0)

    durable = np.zeros(replicas, dtype=np.int64)  # last durable step
    wall = np.zeros(replicas)
    recovering = np.zeros(replicas, dtype=bool)
    running = np.ones(replicas, dtype=bool)
    failures = np.zeros(replicas, dtype=np.int64)
    lost = 0.0
    lost_n = 0
    recovery_total = 0.0
    recovery_n = 0
    while running.any():
        gap = rng.exponential(p.mtbf, size=replicas)  # drawn for all: common random numbers
        # Recovery (only replicas that are recovering): it completes unless the gap is shorter.
        need = p.restart + p.load + p.replay * (durable % F)
        rec = running & recovering
        interrupted = rec & (gap < need)
        wall[interrupted] += gap[interrupted]
        failures[interrupted] += 1
        done_rec = rec & ~interrupted
        wall[done_rec] += need[done_rec]
        recovery_total += float(need[done_rec].sum())
        recovery_n += int(done_rec.sum())
        recovering[done_rec] = False
        left = np.where(done_rec, gap - need, gap)
        # Forward: run from the resume point until the next failure or the end.
        fwd = running & ~recovering & ~interrupted
        start = position(durable)
        reach = start + left
        ends = fwd & (reach >= finish_at)
        wall[ends] += finish_at - start[ends]
        running[ends] = False
        crash = fwd & ~ends
        if crash.any():
            x = reach[crash]
            k = np.floor(x / tab.cycle)
            off = x - k * tab.cycle
            idx = np.searchsorted(tab.event_time, off, side="right") - 1
            now_durable = k.astype(np.int64) * F + tab.event_step[idx]
            new_durable = np.maximum(durable[crash], now_durable)
            wall[crash] += left[crash]
            lost += float((x - position(new_durable)).sum())
            lost_n += int(crash.sum())
            durable[crash] = new_durable
            recovering[crash] = True
            failures[crash] += 1
    useful = n_steps * p.T
    per_replica = wall / useful - 1.0
    return SimResult(
        waste=float(per_replica.mean()),
        stderr=float(per_replica.std(ddof=1) / math.sqrt(replicas)),
        failures=float(failures.mean()),
        lost_work=lost / lost_n if lost_n else 0.0,
        recovery=recovery_total / recovery_n if recovery_n else 0.0,
        n_steps=n_steps,
        replicas=replicas,
    )


def grid(
    p: Schedule,
    f_values: list[int],
    b_values: list[int],
    n_steps: int,
    *,
    replicas: int = 128,
    seed: int = 0,
) -> list[dict[str, float | int]]:
    """Simulate every (F, B) of the grid with common random numbers; schedules on which
    the writer cannot keep up are reported with ``waste = None``."""
    rows: list[dict[str, float | int]] = []
    for f in f_values:
        for b in b_values:
            q = dataclasses.replace(p, F=f, B=b)
            try:
                r = simulate(q, n_steps, replicas=replicas, seed=seed)
            except ValueError:
                rows.append({"F": f, "B": b, "waste": math.nan, "stderr": math.nan})
                continue
            rows.append({"F": f, "B": b, "waste": r.waste, "stderr": r.stderr})
    return rows


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=float, required=True, help="compute time per step (s)")
    ap.add_argument("--c-base", type=float, required=True, help="training stall per base (s)")
    ap.add_argument("--replay", type=float, required=True, help="replay time per diff (s)")
    ap.add_argument("--mtbf", type=float, default=86400.0, help="mean time between failures (s)")
    ap.add_argument("--F", type=int, default=1000, help="steps between bases")
    ap.add_argument("--B", type=int, default=1, help="diffs per write")
    ap.add_argument("--append", type=float, default=0.0, help="foreground append per step (s)")
    ap.add_argument("--fsync", type=float, default=0.0, help="fixed cost per write (s)")
    ap.add_argument("--diff-bytes", type=float, default=0.0, help="bytes per diff")
    ap.add_argument("--bandwidth", type=float, default=1e12, help="write bandwidth (bytes/s)")
    ap.add_argument("--load", type=float, default=0.0, help="time to load a base (s)")
    ap.add_argument("--restart", type=float, default=60.0, help="restart cost (s)")
    ap.add_argument("--write-blocking", type=float, default=0.0, help="blocking part of a write")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: ~200 MTBF)")
    ap.add_argument("--replicas", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", action="store_true", help="sweep F and B around --F and --B")
    ap.add_argument("--json", action="store_true", help="print JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    a = _parser().parse_args(argv)
    try:
        p = Schedule(
            T=a.T,
            c_base=a.c_base,
            replay=a.replay,
            mtbf=a.mtbf,
            F=a.F,
            B=a.B,
            append=a.append,
            fsync=a.fsync,
            diff_bytes=a.diff_bytes,
            bandwidth=a.bandwidth,
            load=a.load,
            restart=a.restart,
            write_blocking=a.write_blocking,
        )
    except ValueError as e:
        print(f"failure_sim: {e}", file=sys.stderr)
        return 2
    n = a.steps or max(10 * a.F, math.ceil(200 * a.mtbf / a.T))
    if a.grid:
        fs = sorted({max(1, round(a.F * 2 ** (k / 4))) for k in range(-8, 9)})
        bs = sorted({max(1, round(a.B * 2 ** (k / 2))) for k in range(-4, 5)})
        rows = grid(p, fs, bs, n, replicas=a.replicas, seed=a.seed)
        if a.json:
            print(json.dumps([{k: (None if v != v else v) for k, v in r.items()} for r in rows]))
        else:
            print(f"{'F':>8} {'B':>6} {'waste':>10} {'stderr':>10}")
            for r in rows:
                print(f"{r['F']:>8} {r['B']:>6} {r['waste']:>10.5f} {r['stderr']:>10.5f}")
        return 0
    try:
        res = simulate(p, n, replicas=a.replicas, seed=a.seed)
    except ValueError as e:
        print(f"failure_sim: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(res.to_dict()))
    else:
        for k, v in res.to_dict().items():
            print(f"{k:>10}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
