"""Distributed training: one log per rank under one checkpoint directory.

``DiffCheckpointer(path, ...)`` and ``restore(path, ...)`` are called the same way on every
rank. When ``torch.distributed`` is initialized with more than one rank, the checkpointer's
layout is a :class:`RankLayout` (made by :func:`rank_layout`, the factory
:func:`~lowdiff_store.torch.capture.layout.layout_for` calls): rank *r* writes its own log (a
*shard*) under ``path/rank-0000r/``, and rank 0 publishes the top-level ``SHARDS`` manifest
(world size, layout). The layout hands the checkpointer a partition of the tensors this
rank logs and, under DDP, a gradient source that logs what the communication hook produced
(:class:`TeeSource`). See ``docs/distributed.md``.

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
from collections.abc import Container, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...errors import ConfigError, LowdiffError, Reason
from ...log.shards import check_world_size, is_sharded, shard_path, write_shards_manifest
from ..capture.bases.initial import InitialBase
from ..capture.grad_capture import GradCapture, HostPool, grad_ident
from ..capture.layout import Layout, Partition, at_job_step, rank_world, set_per_rank_layout
from ..capture.opening import unpublished_job
from ..capture.options import CheckpointerOptions
from ..capture.sink import manifest_exists
from ..core import schema as L
from ..core.hook_records import Hook
from ..core.optimizers import imported_classes
from ..core.partition import partition_by_bytes
from ..core.registry import RestoreInfo
from ..core.specs import Spec
from .fsdp import check_fsdp_options, select_fsdp
from .tee import Tee, Teed

# ---------------------------------------------------------------------- process context


#: The coordination group and the WORLD group it was made for, held by *weak* reference:
#: torch's registry owns both, so ``dist.destroy_process_group()`` frees them while the
#: interpreter is alive. A strong reference here kept them (and gloo's threads) alive until
#: interpreter teardown, where destroying them can abort the process (SIGABRT) after its
#: work succeeded; it also handed a destroyed group to a job that initialized again.
_GROUP: dict[str, weakref.ref[Any]] = {}


def _cached_group() -> Any:
    world, group = _GROUP.get("of"), _GROUP.get("group")
    if world is None or group is None or world() is not dist.group.WORLD:
        return None
    return group()


def coordination_group() -> Any:
    """The gloo group used for checkpoint coordination (created on first use, collectively:
    ``dist.new_group`` must be called by every rank in the same order)."""
    group = _cached_group()
    if group is None:
        group = dist.new_group(backend="gloo")
        set_coordination_group(group)
    return group


def set_coordination_group(group: Any) -> None:
    """Use ``group`` (a gloo group over every rank, not the training group) for checkpoint
    coordination instead of creating one. It is not kept alive here: its owner (torch's
    registry, or the caller) decides when it is destroyed."""
    _GROUP["group"] = weakref.ref(group)
    _GROUP["of"] = weakref.ref(dist.group.WORLD)


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
    """``optimizer`` if it is a ``ZeroRedundancyOptimizer``, else None, without importing
    ``torch.distributed.optim`` (see
    :func:`~lowdiff_store.torch.core.optimizers.imported_classes`)."""
    zero = imported_classes("torch.distributed.optim", "ZeroRedundancyOptimizer")
    return optimizer if zero and isinstance(optimizer, zero) else None


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


# ---------------------------------------------------------------------- the layout


class RankLayout(Layout):
    """The layout of one rank of a job with several ranks: its log is
    ``root/rank-<rank>``; it logs a share of the tensors (a greedy partition by bytes of
    DDP's replicated parameters, a ZeroRedundancyOptimizer's own partition, or FSDP2's
    pieces) and, under DDP, what the wrapped communication hook produced.

    Made collectively by :func:`rank_layout` (every rank, same order): the options a job of
    several ranks refuses are refused on every rank (``mode="delta"`` with a replicated
    optimizer, ``capture="layerwise"``, background bases, ``snapshot_every="auto"``)."""

    def __init__(self, root: str, optimizer: Any, options: CheckpointerOptions,
                 compressor: Any, initial_base: InitialBase | None = None) -> None:
        self.rank, self.world = rank_world()
        self.zero = zero_of(optimizer)
        local = self.zero.optim if self.zero is not None else optimizer
        self.kind = "zero" if self.zero is not None else \
            "fsdp" if _has_dtensor(L.params_of(local)) else "replicated"
        super().__init__(shard_path(root, self.rank), local)
        self.root = root
        self.tee: Tee | None = None
        self.tee_stats: dict[str, float] = {"tee_params": 0, "tee_fallbacks": 0,
                                            "tee_bytes": 0}
        self._all_params: list[torch.Tensor] = []
        self._model: dict[str, torch.Tensor] = {}
        self._buffers: set[str] = set()
        err: BaseException | None = None
        try:
            self._check(local, options, compressor)
            if initial_base is not None:  # checked whole before SHARDS exists
                initial_base.scan()
            _check_root(root, self.world, self.kind)
            # read before the first agreement: no rank of this open has written its log
            self.unpublished = unpublished_job(root, self.path)
            if self.rank == 0 and not is_sharded(root):
                write_shards_manifest(root, self.world, layout=self.kind,
                                      meta={"writer": "torch"})
        except Exception as e:
            err = e
        agree(coordination_group(), err)

    def _check(self, local: Any, options: CheckpointerOptions, compressor: Any) -> None:
        if self.kind == "replicated" and options.mode != "grad":
            raise ConfigError("mode='delta' is not supported with several ranks and a "
                              "replicated optimizer; use mode='grad'",
                              reason=Reason.NOT_ALLOWED)
        if options.capture != "dense":
            raise ConfigError("capture='layerwise' is not supported with several ranks "
                              "(DDP writes gradients from its buckets); use the default "
                              "dense capture", reason=Reason.NOT_ALLOWED)
        if self.kind == "fsdp":
            check_fsdp_options(local, {"mode": options.mode, "compressor": compressor})
        elif self.zero is not None and _has_dtensor(L.params_of(local)):
            raise ConfigError("DTensor parameters under a ZeroRedundancyOptimizer are "
                              "not supported", reason=Reason.NOT_ALLOWED)
        if options.base_mode != "foreground":
            raise ConfigError("base_mode='background' is not supported with several "
                              "ranks (a shard alone cannot be replayed); bases are "
                              "taken in the foreground", reason=Reason.NOT_ALLOWED)
        if options.snapshot_every == "auto":
            raise ConfigError("snapshot_every='auto' is not supported with several ranks "
                              "(every rank must take its bases at the same steps); pass "
                              "an int", reason=Reason.NOT_ALLOWED)

    def options_for(self, options: CheckpointerOptions,
                    info: RestoreInfo | None) -> CheckpointerOptions:
        """Restored at the job's durable step: steps this shard holds beyond it are not
        durable on every rank, so they are not part of the job's history (truncated)."""
        return at_job_step(options, info)

    def select(self, names: list[str], params: list[torch.Tensor],
               model: dict[str, torch.Tensor], buffers: list[str], groups: list[int],
               meta: dict[str, Any]) -> Partition:
        """This rank's share; the log metadata gets the job's layout under ``shard``."""
        self._all_params, self._model, self._buffers = list(params), model, set(buffers)
        if self.kind == "fsdp":
            part = select_fsdp(self.rank, self.world, names, params, model, buffers, groups,
                               meta)
            self.owned = list(meta["shard"]["owned"])
            return part
        model_params = [n for n in model if n not in self._buffers]
        if self.kind == "replicated":
            known = set(names)
            order = names + [n for n in model_params if n not in known]
            sizes = [(n, model[n].numel() * model[n].element_size()) for n in order]
            owned = partition_by_bytes(sizes, self.world)[self.rank]
            global_params, global_groups = names, list(groups)
        else:
            zero = self.zero
            by_id = {id(t): n for n, t in model.items()}
            global_params = [by_id[id(p)] for g in zero.param_groups for p in g["params"]]
            global_groups = [len(g["params"]) for g in zero.param_groups]
            in_zero = set(global_params)
            owned = names + ([n for n in model_params if n not in in_zero]
                             if self.rank == 0 else [])
        self.owned = list(owned)
        meta["shard"] = {
            "rank": self.rank, "world_size": self.world, "layout": self.kind, "owned": owned,
            "global_params": global_params, "global_groups": global_groups}
        mine = set(owned)
        keep = [i for i, n in enumerate(names) if n in mine]
        return Partition([names[i] for i in keep], [params[i] for i in keep],
                         {n: t for n, t in model.items() if n in mine or n in self._buffers})

    def grad_source(self, pool: HostPool, options: CheckpointerOptions,
                    info: RestoreInfo | None) -> TeeSource | None:
        """DDP: the tee of the wrapped communication hook (the hook state ``info`` holds
        waits for its first call); FSDP2 has no communication hook (None)."""
        if self.kind == "fsdp":
            return None
        model = self._model
        ids = {id(t): n for n, t in model.items() if n not in self._buffers}
        self.tee = Tee(ids, {n: model[n] for n in ids.values()}, set(self.owned),
                       ef_step=options.ef_state == "step", take=pool.take)
        self.tee.restored = info.hook if info is not None else None
        return TeeSource(self.tee, pool, options, self.tee_stats)

    def agree(self, err: BaseException | None) -> None:
        """Collective: raise on every rank if any rank failed to open its log. The group
        is looked up, not kept: a layout lives as long as its checkpointer, which a script
        may hold past ``dist.destroy_process_group()`` (see :data:`_GROUP`)."""
        agree(coordination_group(), err)

    def before_finalize(self) -> None:
        """ZeroRedundancyOptimizer: the exposed groups carry the scheduler's changes."""
        zero = self.zero
        if zero is not None:
            sync_groups(zero.param_groups, zero.optim.param_groups)

    def wrap_comm_hook(self, hook: Hook, compressor: Any) -> Hook:
        """``hook`` wrapped by the tee (see :mod:`lowdiff_store.torch.distributed.hooks`)."""
        if self.tee is None:
            raise ConfigError("communication hooks are DDP's: an FSDP2 job has none to wrap",
                              reason=Reason.NOT_ALLOWED)
        return self.tee.wrap(hook, compressor)

    def clip_params(self) -> list[torch.Tensor]:
        """Clipping spans every parameter of the optimizer, not only this rank's share."""
        return self._all_params

    def add_stats(self, out: dict[str, float], partition: Partition) -> None:
        """The tee's counters (``tee_params``: gradients logged as the hook produced them;
        ``tee_fallbacks``: logged densely because the optimizer consumed something else, or
        fp16/bf16 was not exact; ``tee_bytes``, ``tee_buckets``), then ``rank``,
        ``world_size`` and ``owned_params``."""
        out.update(self.tee_stats)
        if self.tee is not None:
            out.update(self.tee.stats)
        out.update({"rank": self.rank, "world_size": self.world,
                    "owned_params": len(partition.names)})


class TeeSource:
    """The gradients a wrapped DDP communication hook produced (:class:`Tee`), logged in
    their compressed form when the optimizer consumed exactly them; the others are copied
    densely (counted as ``tee_fallbacks``). Also logs the hook's own state each step."""

    def __init__(self, tee: Tee, pool: HostPool, options: CheckpointerOptions,
                 counters: dict[str, float]) -> None:
        self.tee, self.pool, self.counters = tee, pool, counters
        self.zstd, self.ef_zstd = options.grad_zstd, options.ef_zstd
        self._use: dict[str, tuple[Teed, torch.Tensor]] = {}
        self._fallback: list[Spec] = []
        self._scratch: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def claim(self, names: Sequence[str], params: Sequence[torch.Tensor]
              ) -> Container[str] | None:
        """The parameters whose teed gradient is what the optimizer is about to consume."""
        teed = self.tee.take()
        self._use, self._fallback = {}, []
        if not teed:
            return None
        use: dict[str, tuple[Teed, torch.Tensor]] = {}
        for n, p in zip(names, params, strict=True):
            t = teed.pop(n, None)
            g = p.grad
            if t is None:
                continue
            if g is not None and t.matches(g, self._scratch_like):
                use[n] = (t, g)
                continue
            if g is not None:
                self.counters["tee_fallbacks"] += 1
                self._fallback.extend(t.fallback_specs(n))
            self.pool.give(list(t.pooled))
        for t in teed.values():   # not an optimizer parameter of this rank
            self.pool.give(list(t.pooled))
        self._use = use
        return use

    def supply(self, cap: GradCapture, side: dict[str, Any]) -> None:
        """The claimed gradients, the fallbacks' records, then the hook's state."""
        for n, (t, g) in self._use.items():
            specs = t.specs(n, self.zstd)
            cap.specs.extend(specs)
            cap.bufs.extend(t.pooled)   # back to the pool once written
            cap.seen[n] = grad_ident(g)
            self.counters["tee_params"] += 1
            self.counters["tee_bytes"] += sum(s.nbytes for s in specs)
        cap.specs.extend(self._fallback)
        self._use, self._fallback = {}, []
        hook = self.tee.step_side()
        if hook is not None:
            side["hook"] = hook
        cap.specs.extend(self.tee.step_specs(self.ef_zstd))

    def base_tensors(self) -> dict[str, tuple[str, np.ndarray]]:
        """The hook's state, for a base."""
        return self.tee.base_tensors()

    def _scratch_like(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, tuple(like.shape))
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty(like.shape, dtype=like.dtype)
        return buf


def rank_layout(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                options: CheckpointerOptions, compressor: Any,
                initial_base: InitialBase | None = None) -> RankLayout:
    """The layout of this rank's checkpointer (collective); ``path`` is the job's
    checkpoint directory; ``initial_base`` is scanned before anything is written."""
    return RankLayout(os.fspath(path), optimizer, options, compressor, initial_base)


set_per_rank_layout(rank_layout)


__all__ = [
    "RankLayout",
    "TeeSource",
    "agree",
    "coordination_group",
    "partition_by_bytes",
    "rank_layout",
    "rank_world",
    "set_coordination_group",
]
