"""Streamed bases (``base_slices=k``, issue 50): a base spread over the k steps that end at
its step, one slice of the state per step, so no step copies the whole state and no buffer
is the size of the state.

The slices are a pure function of the log's parameter names, their global element counts
and k (:func:`slice_groups`): the same on every rank, so the pieces of one parameter are
taken at the same step everywhere. Slice i holds the parameters of group i with their
optimizer state and error-feedback residuals; the first slice also holds everything that is
not a parameter's (buffers, RNG states, a gradient source's state) and the non-tensor state
(hyperparameters, scheduler, scaler, ``extra_state``) that replay starts from.

The schedule (:class:`SliceSchedule`): with ``snapshot_every=F`` a base completes at every
multiple of F, its slices taken after the steps ``F*j - k + 1 .. F*j`` (k is at most F). A
slice that cannot be taken (a tensor changed in place while it was copied) abandons the
base; a new one starts at the next step, its k slices ending k - 1 steps later.

Why replay from such a base is exact (``docs/torch.md``, "Streamed bases"): every step's
diff is in the log; a tensor whose slice was taken after step s replays the steps after s
only, with the training's own optimizer (a parameter whose gradient is None is not touched
by a torch optimizer's step: neither its value nor its state). This holds for optimizers
whose step treats each parameter on its own (:data:`PER_TENSOR_OPTIMIZERS`); for any other
the checkpointer takes consistent bases and says why.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ....errors import ConfigError

_log = logging.getLogger(__name__)

#: torch optimizers whose ``step`` updates each parameter from its own gradient and state
#: only (foreach, fused and single-tensor implementations alike): a step with some
#: gradients None leaves those parameters and their state untouched and computes the
#: others bit for bit as a step with every gradient would. ``LBFGS`` (one closure, flat
#: state) and optimizers not listed here are not vouched for.
PER_TENSOR_OPTIMIZERS = frozenset({
    "torch.optim.sgd.SGD", "torch.optim.adam.Adam", "torch.optim.adamw.AdamW",
    "torch.optim.adagrad.Adagrad", "torch.optim.rmsprop.RMSprop",
    "torch.optim.adamax.Adamax", "torch.optim.nadam.NAdam", "torch.optim.radam.RAdam",
    "torch.optim.adadelta.Adadelta", "torch.optim.rprop.Rprop", "torch.optim.asgd.ASGD",
})


def slice_groups(names: Sequence[str], sizes: Sequence[int], k: int) -> list[list[str]]:
    """The parameters ``names`` (the log's order) with global element counts ``sizes`` cut
    into at most ``k`` contiguous runs of near equal size: parameter i goes to run
    ``floor(k * before_i / total)`` (``before_i``: the elements of the parameters before
    it). Empty runs are left out, so there may be fewer than k (one parameter larger than
    the rest). A pure function: the same on every rank."""
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(k)]
    before = 0
    for n, size in zip(names, sizes, strict=True):
        i = min(k - 1, (k * before) // total) if total else 0
        groups[i].append(n)
        before += size
    return [g for g in groups if g]


@dataclass(frozen=True)
class Window:
    """One streamed base in progress: it is complete after ``steps[-1]``; slice i is taken
    after ``steps[i]`` and holds ``groups[i]`` (the first also the rest of the state)."""

    steps: tuple[int, ...]
    groups: tuple[frozenset[str], ...]

    @property
    def complete(self) -> int:
        """The step after which the base is complete."""
        return self.steps[-1]

    def meta(self) -> dict[str, object]:
        """The ``"slice"`` key of each slice's base metadata (spec section 7.2)."""
        return {"base": self.complete, "steps": list(self.steps)}


class SliceSchedule:
    """When slices are taken: ``groups_for(k)`` gives the parameter groups for k slices;
    :meth:`due` says, after each step, which slice of which base that step takes."""

    def __init__(self, names: Sequence[str], sizes: Sequence[int], k: int) -> None:
        self.names, self.sizes, self.k = list(names), list(sizes), k
        #: ``base_slices="auto"``: :meth:`tune` sets k before each base
        self.auto = False
        #: the first slice holds no parameter (slices written from the live tensors: the
        #: first, whose non-tensor state is known only when its step is finalized, is the
        #: one copied, so it holds the rank-local state alone and the parameters are cut
        #: into k - 1 groups); set before the first :meth:`groups_for`
        self.lead_empty = False
        self.window: Window | None = None
        self.started = -1  # the step the last base started was due at
        self._groups: dict[int, tuple[frozenset[str], ...]] = {}

    def groups_for(self, k: int) -> tuple[frozenset[str], ...]:
        """The parameter groups of a base streamed over (at most) ``k`` steps."""
        got = self._groups.get(k)
        if got is None:
            if self.lead_empty and k > 1:
                got = (frozenset(), *(frozenset(g) for g in
                                      slice_groups(self.names, self.sizes, k - 1)))
            else:
                got = tuple(frozenset(g) for g in slice_groups(self.names, self.sizes, k))
            self._groups[k] = got
        return got

    def due(self, step: int, every: int, last_base: int, auto: bool) -> tuple[Window, int] | None:
        """After ``step``: (the base in progress, the index of the slice to take now), or
        None. ``every``: the base interval in force; ``last_base``: the step of the last
        complete base; ``auto``: the interval is counted from ``last_base`` (tuned).

        A base due at ``target`` starts k - 1 steps before it; where that moment has
        passed (a log resumed inside the window, an interval tuned down) it starts now and
        completes up to k - 1 steps late (with as many slices: fewer would each need more
        staging memory than the two largest slices it was sized for)."""
        w = self.window
        if w is not None:
            i = step - w.steps[0]
            if 0 <= i < len(w.steps):
                return w, i
            self.window = None  # (steps skipped by a resume: start over)
        k = len(self.groups_for(max(1, min(self.k, every))))
        target = last_base + every if auto else -(-step // every) * every
        if auto and target < step:
            target = step + k - 1  # (an interval tuned down past this base)
        left = target - step + 1
        if target == self.started or left > k:
            return None
        groups = self.groups_for(max(1, min(self.k, every)))
        self.window = Window(tuple(range(step, step + len(groups))), groups)
        self.started = target
        return self.window, 0

    def tune(self, m: Any, state_bytes: int, every: int) -> None:
        """``base_slices="auto"``, between bases: k from the measurements ``m`` (a
        :class:`~lowdiff_store.tuning.Measurements`, or None before any): the fewest
        slices whose write fits beside the diff log in a step
        (:func:`~lowdiff_store.tuning.slices_for`)."""
        if self.auto and self.window is None and m is not None:
            from ....tuning import slices_for

            self.k = slices_for(m, state_bytes, every)

    def restart(self) -> None:
        """The base in progress is abandoned: the next step starts a new one."""
        self.window = None

    def restart_now(self, step: int, every: int) -> Window:
        """Start a base whose first slice is taken after ``step`` (a base owed)."""
        groups = self.groups_for(max(1, min(self.k, every)))
        self.window = Window(tuple(range(step, step + len(groups))), groups)
        self.started = self.window.complete
        return self.window


#: ``base_slices="auto"``: the slices of the first base, before anything is measured
AUTO_INITIAL_SLICES = 4


def streaming(k: int, log_meta: Mapping[str, Any], *, layout_why: str | None,
              base_mode: str, delta_codec: str, quiet: bool = False) -> tuple[int, str | None]:
    """``base_slices=k`` for a log with torch metadata ``log_meta``: (the k in force, why
    it is 1 when ``k`` asked for more). Streamed bases need a replay that moves each tensor
    on its own: an optimizer of :data:`PER_TENSOR_OPTIMIZERS` (grad mode), lossless weight
    diffs (delta mode: a lossy codec's diffs are taken against the state it tracks, which
    a slice does not hold), a layout whose restore replays them (``layout_why``: the
    layout's reason when it cannot, ``Layout.streamed_why``), bases made in
    the foreground. The reason is logged as a warning unless ``quiet`` (the default
    ``base_slices=None``, which asked for nothing)."""
    if k < 2:
        return 1, None
    why = None
    if log_meta["mode"] == "grad" and log_meta["optimizer"] not in PER_TENSOR_OPTIMIZERS:
        why = (f"the optimizer {log_meta['optimizer']} is not known to step each parameter "
               f"on its own (a replay moving some parameters only could differ)")
    elif log_meta["mode"] == "delta" and delta_codec != "xor":
        why = f"delta_codec={delta_codec!r} is lossy (streamed bases need 'xor')"
    elif layout_why is not None:
        why = layout_why
    elif base_mode == "background":
        why = "base_mode='background' makes bases from the log, with no staging"
    if why is not None and not quiet:
        _log.warning("lowdiff-store: base_slices=%d: consistent bases are taken instead, "
                     "since %s", k, why)
    return (1, why) if why is not None else (k, None)


#: the environment variable that sets ``base_slices`` where the code leaves the default
#: (None): ``1`` (consistent bases), ``auto`` or k, for every checkpointer of the process
#: and the processes it starts (a job keeps consistent bases without a code change)
ENV_DEFAULT = "LOWDIFF_BASE_SLICES"


def default_from_env() -> int | str | None:
    """``base_slices`` from :data:`ENV_DEFAULT`, or None when it is not set;
    ``ConfigError`` naming it when it is neither an int >= 1 nor ``auto``."""
    raw = os.environ.get(ENV_DEFAULT, "").strip()
    if not raw:
        return None
    if raw == "auto":
        return raw
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    raise ConfigError(f"{ENV_DEFAULT}={raw!r} must be an int >= 1 (1: consistent bases) or "
                      f"'auto'")


def asked_slices(options: Any) -> tuple[int | str, bool]:
    """(``base_slices`` asked for, whether it is the quiet default): ``options.base_slices``
    (1 without options), else the environment's (:func:`default_from_env`), else
    ``("auto", True)``: the default, which asked for nothing."""
    asked = getattr(options, "base_slices", 1)
    if asked is None:
        asked = default_from_env()
    return ("auto", True) if asked is None else (asked, False)


def plan_slices(log_meta: dict[str, Any], options: Any, layout_why: str | None) -> int:
    """:func:`streaming` of ``options.base_slices``, recorded in the log's metadata
    (``base_slices``: ``{"k": asked, "in_force": k, "why": reason or None}``, only when
    more than one slice was asked for). Returns the k in force (1: consistent bases).

    The default, ``base_slices=None``, is the environment's :data:`ENV_DEFAULT` when set
    (as if given), else ``"auto"`` without the warning for a model on the CPU (recorded as
    ``"auto"``, with the reason where consistent bases are taken), and consistent bases,
    recorded as nothing, for a model on an accelerator: streamed bases there wait for
    their measurements on a GPU (docs/torch.md, "Streamed bases")."""
    asked, quiet = asked_slices(options)
    if quiet and log_meta.get("device", "cpu") != "cpu":
        return 1
    k = AUTO_INITIAL_SLICES if asked == "auto" else int(asked)
    in_force, why = streaming(k, log_meta, layout_why=layout_why, base_mode=options.base_mode,
                              delta_codec=options.delta_codec, quiet=quiet)
    if k > 1:
        log_meta["base_slices"] = {"k": asked, "in_force": in_force, "why": why}
    return in_force


def schedule_for(log_meta: Mapping[str, Any], k: int, options: Any = None) -> SliceSchedule:
    """The slice schedule of a log with torch metadata ``log_meta``: the job's parameters
    in the optimizer's order, each sized by its global shape, so the schedule is the same
    on every rank (one log per rank: the ``shard`` section's ``global_params`` and, under
    FSDP2, ``global_model``; each rank's slice of a group holds the parameters of it the
    rank logs). With ``options.base_slices == "auto"`` k is chosen again before each base
    from what the cost meter measured (:meth:`SliceSchedule.tune`)."""
    shard = log_meta.get("shard") or {}
    shapes = {n: shape for n, _tag, shape in shard.get("global_model") or log_meta["model"]}
    names = list(shard.get("global_params") or log_meta["params"])
    out = SliceSchedule(names, [math.prod(shapes.get(n, [0])) for n in names], k)
    # (several ranks: k stays the one chosen at open, AUTO_INITIAL_SLICES; a k tuned by
    # each rank from its own measurements would put the shards' slices at different
    # steps, and replicated shards replay merged from slices taken at the same steps)
    out.auto = asked_slices(options)[0] == "auto" and not shard
    return out


__all__ = ["AUTO_INITIAL_SLICES", "ENV_DEFAULT", "PER_TENSOR_OPTIMIZERS", "SliceSchedule",
           "Window", "asked_slices", "default_from_env", "plan_slices", "schedule_for",
           "slice_groups", "streaming"]
