"""The page's per-step series, computed in numpy from a log's index arrays.

- :func:`recovery_curve`: for every restorable step, what a restore of that step reads
  (the newest base at or before it, plus every diff after that base: after its first
  slice for a streamed base) and how many diffs it replays; the time from the log's
  measured costs (``base_load_time + replay_cost * replayed``) where the checkpointer
  recorded them. The saw-tooth between bases.
- :func:`binned`: a series of any length reduced to at most :data:`MAX_POINTS` points
  (min, mean and max per bin of consecutive steps), so a plot or a table of a
  1,000,000-step log stays small; the page says when a series was binned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: A per-step series longer than this is drawn from bins of consecutive steps.
MAX_POINTS = 2_000


@dataclass
class Curve:
    """A recovery curve: per restorable step, the bytes read, the diffs replayed, the
    base a restore starts from (its step: a streamed base's complete step) and the step
    its replay starts after (a streamed base's first slice's; else the base's)."""

    steps: np.ndarray
    bytes_read: np.ndarray
    replayed: np.ndarray
    seconds: np.ndarray | None
    base: np.ndarray
    start: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)


def recovery_curve(steps: np.ndarray, lengths: np.ndarray, bases: list[tuple[int, int]],
                   *, replay_cost: float | None = None, base_load_time: float = 0.0,
                   starts: Sequence[int] | None = None) -> Curve:
    """The recovery curve of one log: ``steps``/``lengths`` are its diff records (step
    order), ``bases`` its (step, bytes) pairs in step order (on a tie, the base a restore
    uses last); ``starts``: for each base, the step its replay starts after (a streamed
    base's first slice's, spec section 7.2; default: the base's own step). A step is
    restorable when a base is at or before it and every diff after its start is present;
    the curve stops at the first gap after the newest base (the durable step) and skips
    steps a gap makes unreachable."""
    empty = np.zeros(0, np.int64)
    if not bases:
        return Curve(empty, empty, empty, None, empty, empty)
    b_steps = np.array([b for b, _n in bases], dtype=np.int64)
    b_bytes = np.array([n for _b, n in bases], dtype=np.int64)
    b_start = b_steps if starts is None else np.array(starts, dtype=np.int64)
    # the steps at or after the first base, and the bases with no diff of their own step;
    # both sorted, so a search and a stable sort merge them (np.union1d hashes: seconds
    # at 1,000,000 steps)
    at = np.minimum(np.searchsorted(steps, b_steps), max(len(steps) - 1, 0))
    alone = b_steps[steps[at] != b_steps] if len(steps) else b_steps
    x = np.sort(np.concatenate([steps[steps >= b_steps[0]], alone]), kind="stable")
    cum = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    bi = np.searchsorted(b_steps, x, side="right") - 1
    lo = np.searchsorted(steps, b_start[bi], side="right")
    hi = np.searchsorted(steps, x, side="right")
    replayed = hi - lo
    ok = replayed == x - b_start[bi]  # every diff after the base's start is present
    x, bi, lo, hi, replayed = x[ok], bi[ok], lo[ok], hi[ok], replayed[ok]
    read = b_bytes[bi] + cum[hi] - cum[lo]
    seconds = None
    if replay_cost is not None:
        seconds = base_load_time + replay_cost * replayed.astype(np.float64)
    return Curve(x, read, replayed, seconds, b_steps[bi], b_start[bi])


@dataclass
class Binned:
    """A series reduced to bins of ``width`` consecutive points (``width`` 1: exact)."""

    x: np.ndarray
    lo: np.ndarray
    mean: np.ndarray
    hi: np.ndarray
    width: int


def binned(x: np.ndarray, y: np.ndarray, max_points: int | None = None) -> Binned:
    """``y`` over ``x`` in at most ``max_points`` (default :data:`MAX_POINTS`) bins of
    consecutive points: per bin its first ``x`` and the min, mean and max of ``y``."""
    if max_points is None:
        max_points = MAX_POINTS
    yf = y.astype(np.float64)
    n = len(x)
    if n <= max_points:
        return Binned(x, yf, yf, yf, 1)
    width = -(-n // max_points)
    starts = np.arange(0, n, width)
    counts = np.diff(np.append(starts, n))
    return Binned(x[starts], np.minimum.reduceat(yf, starts),
                  np.add.reduceat(yf, starts) / counts, np.maximum.reduceat(yf, starts),
                  width)


__all__ = ["MAX_POINTS", "Binned", "Curve", "binned", "recovery_curve"]
