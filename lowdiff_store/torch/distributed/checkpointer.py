"""Distributed training: one log per rank under one checkpoint directory.

``DiffCheckpointer(path, ...)`` and ``restore(path, ...)`` are called the same way on every
rank. When ``torch.distributed`` is initialized with more than one rank, the checkpointer is
a :class:`ShardedCheckpointer`: rank *r* writes its own log (a *shard*) under
``path/rank-0000r/`` and rank 0 publishes the top-level ``SHARDS`` manifest (world size,
layout). See ``docs/distributed.md``.

Layouts:

- ``"replicated"`` (DDP, a plain optimizer): parameters, gradients and optimizer state are
  the same on every rank, so the ranks split the parameters between them (a deterministic
  greedy partition balancing bytes) and each logs the gradients, optimizer state and base
  copies of its share, plus its own RNG states, module buffers, side channel
  (hyperparameters, scheduler, scaler, ``extra_state()``) and communication-hook state.
  Restore reads every shard: the shares of each step are merged into the full gradient and
  replayed through the rank's (full) optimizer.
- ``"zero"`` (:class:`torch.distributed.optim.ZeroRedundancyOptimizer`): each rank logs its
  own optimizer partition (the gradients its local optimizer consumes, its optimizer state,
  its parameters in bases). Each shard replays on its own; a rank restoring rebuilds the
  other partitions' parameters by replaying their shards through an optimizer of the
  recorded (allow-listed) class.

Coordination never uses the training process group: a dedicated gloo group made with
``dist.new_group(backend="gloo")`` the first time a checkpointer or restore needs it (a
collective call: every rank must create checkpointers and call restore in the same order).
It carries a handful of small messages: the outcome of setup (so a failure on one rank is
raised on all), and at restore each shard's durable step and bases, from which every rank
derives the same target: the newest step durable on **all** ranks.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError, LowdiffError, Reason
from ...log.shards import check_world_size, is_sharded, shard_path, write_shards_manifest
from ..capture.checkpointer import DiffCheckpointer
from ..capture.grad_capture import grad_ident
from ..capture.initial_base import as_initial_base
from ..capture.sink import manifest_exists
from ..core import schema as L
from ..core.hook_records import Hook
from ..core.partition import partition_by_bytes
from ..core.registry import restored
from .fsdp import check_fsdp_options, select_fsdp
from .tee import HookRestore, Tee

# ---------------------------------------------------------------------- process context


def rank_world() -> tuple[int, int]:
    """(rank, world size) from ``torch.distributed``; (0, 1) when it is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_GROUP: dict[str, Any] = {}


def coordination_group() -> Any:
    """The gloo group used for checkpoint coordination (created on first use, collectively:
    ``dist.new_group`` must be called by every rank in the same order)."""
    world = dist.group.WORLD
    if _GROUP.get("of") is not world or _GROUP.get("group") is None:
        _GROUP["group"] = dist.new_group(backend="gloo")
        _GROUP["of"] = world
    return _GROUP["group"]


def set_coordination_group(group: Any) -> None:
    """Use ``group`` (a gloo group over every rank, not the training group) for checkpoint
    coordination instead of creating one."""
    _GROUP["group"] = group
    _GROUP["of"] = dist.group.WORLD


def gather_objects(group: Any, obj: Any) -> list[Any]:
    world = dist.get_world_size(group)
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(group: Any, err: BaseException | None) -> None:
    """Collective: raise on every rank if any rank failed (its own error where it failed,
    a :class:`LowdiffError` naming the failing rank elsewhere). Also a barrier."""
    if group is None:
        if err is not None:
            raise err
        return
    mine = None
    if err is not None:
        reason = err.reason.value if isinstance(err, LowdiffError) else None
        mine = (type(err).__name__, str(err), reason)
    got = gather_objects(group, mine)
    if err is not None:
        raise err
    for r, m in enumerate(got):
        if m is not None:
            reason = Reason(m[2]) if m[2] is not None else Reason.INVALID_ARGUMENT
            raise LowdiffError(f"rank {r} failed: {m[0]}: {m[1]}", reason=reason)


# ---------------------------------------------------------------------- partition


def zero_of(optimizer: Any) -> Any:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None


def _has_dtensor(params: Sequence[torch.Tensor]) -> bool:
    from .fsdp import has_dtensor

    return has_dtensor(params)


def sync_groups(src: Sequence[Mapping[str, Any]], dst: Sequence[dict[str, Any]]) -> None:
    for s, d in zip(src, dst, strict=True):
        for k, v in s.items():
            if k != "params":
                d[k] = v


def _check_root(root: str, world: int, layout: str) -> None:
    if manifest_exists(root):
        raise ConfigError(f"{root} holds an unsharded log (written by a single process); this "
                          f"job has {world} ranks: use another directory",
                          reason=Reason.WORLD_SIZE_MISMATCH, path=root)
    if is_sharded(root):
        body = check_world_size(root, world)
        if body.get("layout") != layout:
            raise ConfigError(f"{root} was written with layout {body.get('layout')!r}; this "
                              f"job's is {layout!r} (ZeroRedundancyOptimizer, FSDP2 or DDP)",
                              reason=Reason.STATE_MISMATCH, path=root)


# what restore() left for the checkpointer created next on the same (local) optimizer
PENDING_HOOK: weakref.WeakKeyDictionary[Any, HookRestore] = weakref.WeakKeyDictionary()
JOB_STEP: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


@dataclass
class _ShardCfg:
    root: str
    rank: int
    world: int
    layout: str
    zero: Any


# ---------------------------------------------------------------------- the checkpointer


class ShardedCheckpointer(DiffCheckpointer):
    """The per-rank checkpointer of a job with several ranks (what ``DiffCheckpointer``
    returns then). Same arguments as :class:`DiffCheckpointer`; ``path`` is the job's
    checkpoint directory, this rank's log is ``path/rank-<rank>``.

    ``optimizer`` may be a :class:`~torch.distributed.optim.ZeroRedundancyOptimizer`
    (layout ``"zero"``: its local optimizer is hooked and logged). Refused with several
    ranks: ``mode="delta"`` with a replicated optimizer and ``capture="layerwise"``.
    """

    def __init__(self, path: str | os.PathLike[str], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        rank, world = rank_world()
        root = os.fspath(path)
        zero = zero_of(optimizer)
        local = zero.optim if zero is not None else optimizer
        layout = "zero" if zero is not None else \
            "fsdp" if _has_dtensor(L.params_of(local)) else "replicated"
        self._shard = _ShardCfg(root, rank, world, layout, zero)
        self._tee: Tee | None = None
        self._tee_stats: dict[str, float] = {"tee_params": 0, "tee_fallbacks": 0,
                                             "tee_bytes": 0}
        self.root = root
        group = coordination_group()
        err: BaseException | None = None
        try:
            if layout == "replicated" and kwargs.get("mode", "grad") != "grad":
                raise ConfigError("mode='delta' is not supported with several ranks and a "
                                  "replicated optimizer; use mode='grad'",
                                  reason=Reason.NOT_ALLOWED)
            if kwargs.get("capture", "dense") != "dense":
                raise ConfigError("capture='layerwise' is not supported with several ranks "
                                  "(DDP writes gradients from its buckets); use the default "
                                  "dense capture", reason=Reason.NOT_ALLOWED)
            if layout == "fsdp":
                check_fsdp_options(local, kwargs)
            elif zero is not None and _has_dtensor(L.params_of(local)):
                raise ConfigError("DTensor parameters under a ZeroRedundancyOptimizer are "
                                  "not supported", reason=Reason.NOT_ALLOWED)
            if kwargs.get("base_mode", "foreground") != "foreground":
                raise ConfigError("base_mode='background' is not supported with several "
                                  "ranks (a shard alone cannot be replayed); bases are "
                                  "taken in the foreground", reason=Reason.NOT_ALLOWED)
            if kwargs.get("snapshot_every") == "auto":
                raise ConfigError("snapshot_every='auto' is not supported with several ranks "
                                  "(every rank must take its bases at the same steps); pass "
                                  "an int", reason=Reason.NOT_ALLOWED)
            if kwargs.get("initial_base") is not None:  # checked whole before SHARDS exists
                kwargs["initial_base"] = as_initial_base(kwargs["initial_base"])
                kwargs["initial_base"].scan()
            _check_root(root, world, layout)
            if rank == 0 and not is_sharded(root):
                write_shards_manifest(root, world, layout=layout, meta={"writer": "torch"})
        except Exception as e:
            err = e
        agree(group, err)
        info = restored(local)
        if info is not None and JOB_STEP.get(local) == info.step:
            # restored at the job's durable step: steps this shard holds beyond it are not
            # durable on every rank, so they are not part of the job's history
            kwargs = {**kwargs, "resume": "truncate"}
        err = None
        try:
            super().__init__(shard_path(root, rank), model, local, **kwargs)
        except Exception as e:
            err = e
        try:
            agree(group, err)
        except LowdiffError:
            if err is None:   # another rank failed: give this rank's log back untouched
                self._detach()
                self._finalizer.detach()
                self._sink.close_quietly()
            raise
        PENDING_HOOK.pop(local, None)
        JOB_STEP.pop(local, None)

    # -- hooks into DiffCheckpointer

    def _select_shard(self) -> None:
        sh = self._shard
        if sh.layout == "fsdp":
            select_fsdp(self)
            return
        buffers = set(self._buffers)
        model_params = [n for n in self._model if n not in buffers]
        names = list(self._names)
        if sh.layout == "replicated":
            known = set(names)
            order = names + [n for n in model_params if n not in known]
            sizes = [(n, self._model[n].numel() * self._model[n].element_size())
                     for n in order]
            owned = partition_by_bytes(sizes, sh.world)[sh.rank]
            global_params, global_groups = names, list(self._groups)
        else:
            zero = sh.zero
            by_id = {id(t): n for n, t in self._model.items()}
            global_params = [by_id[id(p)] for g in zero.param_groups for p in g["params"]]
            global_groups = [len(g["params"]) for g in zero.param_groups]
            in_zero = set(global_params)
            owned = names + ([n for n in model_params if n not in in_zero]
                             if sh.rank == 0 else [])
        owned_set = set(owned)
        self._log_meta["shard"] = {
            "rank": sh.rank, "world_size": sh.world, "layout": sh.layout, "owned": owned,
            "global_params": global_params, "global_groups": global_groups}
        self._all_params = list(self._params)
        keep = [i for i, n in enumerate(names) if n in owned_set]
        self._names = [names[i] for i in keep]
        self._params = [self._params[i] for i in keep]
        all_model = self._model
        self._model = {n: t for n, t in all_model.items() if n in owned_set or n in buffers}
        ids = {id(t): n for n, t in all_model.items() if n not in buffers}
        self._tee = Tee(ids, {n: all_model[n] for n in ids.values()}, owned_set,
                        ef_step=self.opts["ef_state"] == "step", take=self._pool.take)
        self._scratch: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self._tee.restored = PENDING_HOOK.get(self.optimizer)

    def _capture_grads(self) -> None:
        tee = self._tee
        teed = tee.take() if tee is not None else {}
        if not teed:
            super()._capture_grads()
        else:
            use: dict[str, tuple[Any, torch.Tensor]] = {}
            extra = []
            for n, p in zip(self._names, self._params, strict=True):
                t = teed.pop(n, None)
                g = p.grad
                if t is None:
                    continue
                if g is not None and t.matches(g, self._scratch_like):
                    use[n] = (t, g)
                    continue
                if g is not None:
                    self._tee_stats["tee_fallbacks"] += 1
                    extra.extend(t.fallback_specs(n))
                self._pool.give(list(t.pooled))
            for t in teed.values():   # not an optimizer parameter of this rank
                self._pool.give(list(t.pooled))
            names, params = self._names, self._params
            self._names = [n for n in names if n not in use]
            self._params = [p for n, p in zip(names, params, strict=True) if n not in use]
            try:
                super()._capture_grads()
            finally:
                self._names, self._params = names, params
            zstd = self.opts["grad_zstd"]
            for n, (t, g) in use.items():
                specs = t.specs(n, zstd)
                self._grad_specs.extend(specs)
                self._grad_bufs.extend(t.pooled)   # back to the pool once written
                self._grads[n] = grad_ident(g)
                self._tee_stats["tee_params"] += 1
                self._tee_stats["tee_bytes"] += sum(s.nbytes for s in specs)
            self._grad_specs.extend(extra)
        if tee is not None:
            side = tee.step_side()
            if side is not None:
                self._step_side["hook"] = side
            self._grad_specs.extend(tee.step_specs(self.opts["ef_zstd"]))

    def _scratch_like(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, tuple(like.shape))
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty(like.shape, dtype=like.dtype)
        return buf

    def _stage_base(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._stage_base(*args, **kwargs)
        if self._tee is not None:
            extra = self._tee.base_tensors()
            if extra:
                out[0].update(extra)
        return out

    def _finalize(self, *args: Any, **kwargs: Any) -> None:
        zero = self._shard.zero
        if zero is not None:  # the exposed groups carry the scheduler's changes
            sync_groups(zero.param_groups, zero.optim.param_groups)
        super()._finalize(*args, **kwargs)

    # -- public API

    def wrap_comm_hook(self, hook: Hook) -> Hook:
        """A DDP communication hook that runs ``hook`` and logs its post-communication
        result for this rank's parameters (see :mod:`lowdiff_store.torch.distributed.hooks`):
        ``ddp.register_comm_hook(state, ckpt.wrap_comm_hook(hook))``."""
        if self._tee is None:
            raise ConfigError("communication hooks are DDP's: an FSDP2 job has none to wrap",
                              reason=Reason.NOT_ALLOWED)
        return self._tee.wrap(hook, self.compressor)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None
                        ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter of the optimizer."""
        return torch.nn.utils.clip_grad_norm_(self._all_params, max_norm, norm_type,
                                              error_if_nonfinite, foreach)

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._shard.rank

    @property
    def world_size(self) -> int:
        """Number of ranks (shards)."""
        return self._shard.world

    @property
    def layout(self) -> str:
        """``"replicated"``, ``"zero"`` or ``"fsdp"``."""
        return self._shard.layout

    @property
    def owned(self) -> list[str]:
        """The parameters whose gradients, optimizer state and base copies this rank logs."""
        return list(self._log_meta["shard"]["owned"])

    def stats(self) -> dict[str, float]:
        """:meth:`DiffCheckpointer.stats` plus ``rank``, ``world_size``, ``owned_params``
        and the hook tee's counters: ``tee_params`` (gradients logged as the hook produced
        them), ``tee_fallbacks`` (logged densely because the optimizer consumed something
        else, or fp16/bf16 was not exact), ``tee_bytes``, ``tee_buckets``."""
        out = super().stats()
        out.update(self._tee_stats)
        if self._tee is not None:
            out.update(self._tee.stats)
        out.update({"rank": self.rank, "world_size": self.world_size,
                    "owned_params": len(self._names)})
        return out


__all__ = [
    "ShardedCheckpointer",
    "agree",
    "coordination_group",
    "partition_by_bytes",
    "rank_world",
    "set_coordination_group",
]
