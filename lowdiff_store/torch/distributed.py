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
import struct
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from ..errors import ConfigError, LowdiffError, Reason, StepNotFoundError
from ..format.checksum import crc32c
from ..log import LogReader
from ..log.base import BaseFile
from ..log.shards import (
    check_world_size,
    is_sharded,
    read_shards_manifest,
    shard_path,
    write_shards_manifest,
)
from . import _layout as L
from ._registry import RestoreInfo, remember, restored
from ._replay import (
    RestoreResult,
    _build_optimizer,
    _check_objects,
    _dtype,
    _Objects,
    _Replayer,
    hand_residuals,
    log_meta,
    objects_for,
)
from ._sink import manifest_exists
from ._tensors import DTYPE_OF, bits_view, from_bits, model_entries, tag_of, to_bits
from .checkpointer import DiffCheckpointer
from .comm_hooks import (
    HOOK,
    HOOK_EF,
    HOOK_META,
    HOOK_Q,
    PSGD,
    Hook,
    HookRestore,
    Tee,
    narrow_decode,
    psgd_decode,
)

Progress = Callable[[int, int], None]

#: shard layouts: DDP with a replicated optimizer, or ZeroRedundancyOptimizer partitions
LAYOUTS = ("replicated", "zero")


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


def _gather(group: Any, obj: Any) -> list[Any]:
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
    got = _gather(group, mine)
    if err is not None:
        raise err
    for r, m in enumerate(got):
        if m is not None:
            reason = Reason(m[2]) if m[2] is not None else Reason.INVALID_ARGUMENT
            raise LowdiffError(f"rank {r} failed: {m[0]}: {m[1]}", reason=reason)


# ---------------------------------------------------------------------- partition


def partition_by_bytes(items: Sequence[tuple[str, int]], world: int) -> list[list[str]]:
    """Split named tensors of the given byte sizes between ``world`` ranks: largest first
    (ties: earlier first), each to the least loaded rank (ties: lowest rank). Deterministic;
    each rank's names keep their input order."""
    order = sorted(range(len(items)), key=lambda i: (-items[i][1], i))
    load = [0] * world
    owner: dict[int, int] = {}
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += items[i][1]
    return [[items[i][0] for i in range(len(items)) if owner[i] == r] for r in range(world)]


def _zero_of(optimizer: Any) -> Any:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None


def _has_dtensor(params: Sequence[torch.Tensor]) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in params)


def _sync_groups(src: Sequence[Mapping[str, Any]], dst: Sequence[dict[str, Any]]) -> None:
    for s, d in zip(src, dst, strict=True):
        for k, v in s.items():
            if k != "params":
                d[k] = v


def checkpointer_class(path: Any) -> type[DiffCheckpointer]:
    """The class ``DiffCheckpointer(path, ...)`` instantiates: :class:`ShardedCheckpointer`
    under ``torch.distributed`` with more than one rank; a single process refuses a sharded
    checkpoint (``ConfigError(world_size_mismatch)``)."""
    _rank, world = rank_world()
    if world > 1:
        return ShardedCheckpointer
    if path is not None and is_sharded(os.fspath(path)):
        check_world_size(os.fspath(path), 1)
        raise ConfigError(f"{os.fspath(path)} holds a sharded checkpoint; a single process "
                          f"cannot write into it", reason=Reason.WORLD_SIZE_MISMATCH,
                          path=os.fspath(path))
    return DiffCheckpointer


def wants_sharded(path: str) -> bool:
    """``restore(path)`` must take the sharded route (a sharded path, or a job of several
    ranks)."""
    return is_sharded(path) or rank_world()[1] > 1


def _check_root(root: str, world: int, layout: str) -> None:
    if manifest_exists(root):
        raise ConfigError(f"{root} holds an unsharded log (written by a single process); this "
                          f"job has {world} ranks: use another directory",
                          reason=Reason.WORLD_SIZE_MISMATCH, path=root)
    if is_sharded(root):
        body = check_world_size(root, world)
        if body.get("layout") != layout:
            raise ConfigError(f"{root} was written with layout {body.get('layout')!r}; this "
                              f"job's is {layout!r} (a ZeroRedundancyOptimizer or not)",
                              reason=Reason.STATE_MISMATCH, path=root)


# what restore() left for the checkpointer created next on the same (local) optimizer
_PENDING_HOOK: weakref.WeakKeyDictionary[Any, HookRestore] = weakref.WeakKeyDictionary()
_JOB_STEP: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


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
        zero = _zero_of(optimizer)
        local = zero.optim if zero is not None else optimizer
        layout = "zero" if zero is not None else "replicated"
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
            if _has_dtensor(L.params_of(local)):
                raise ConfigError("DTensor parameters (FSDP2 fully_shard, tensor parallel) "
                                  "are not supported yet: use DDP, optionally with "
                                  "ZeroRedundancyOptimizer", reason=Reason.NOT_ALLOWED)
            if kwargs.get("base_mode", "foreground") != "foreground":
                raise ConfigError("base_mode='background' is not supported with several "
                                  "ranks (a shard alone cannot be replayed); bases are "
                                  "taken in the foreground", reason=Reason.NOT_ALLOWED)
            if kwargs.get("snapshot_every") == "auto":
                raise ConfigError("snapshot_every='auto' is not supported with several ranks "
                                  "(every rank must take its bases at the same steps); pass "
                                  "an int", reason=Reason.NOT_ALLOWED)
            _check_root(root, world, layout)
            if rank == 0 and not is_sharded(root):
                write_shards_manifest(root, world, layout=layout, meta={"writer": "torch"})
        except Exception as e:
            err = e
        agree(group, err)
        info = restored(local)
        if info is not None and _JOB_STEP.get(local) == info.step:
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
        _PENDING_HOOK.pop(local, None)
        _JOB_STEP.pop(local, None)

    # -- hooks into DiffCheckpointer

    def _select_shard(self) -> None:
        sh = self._shard
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
        self._tee.restored = _PENDING_HOOK.get(self.optimizer)

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
                self._grads[n] = (id(g), g._version)
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
            _sync_groups(zero.param_groups, zero.optim.param_groups)
        super()._finalize(*args, **kwargs)

    # -- public API

    def wrap_comm_hook(self, hook: Hook) -> Hook:
        """A DDP communication hook that runs ``hook`` and logs its post-communication
        result for this rank's parameters (see :mod:`lowdiff_store.torch.comm_hooks`):
        ``ddp.register_comm_hook(state, ckpt.wrap_comm_hook(hook))``."""
        assert self._tee is not None
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
        """``"replicated"`` or ``"zero"``."""
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


# ---------------------------------------------------------------------- reading shards


@dataclass
class _Shards:
    root: str
    world: int
    layout: str
    readers: list[LogReader]
    metas: list[dict[str, Any]]

    def close(self) -> None:
        for r in self.readers:
            r.close()


def _open_shards(root: str) -> _Shards:
    body = read_shards_manifest(root)
    world = body["world_size"]
    layout = body.get("layout", "replicated")
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown shard layout {layout!r}", reason=Reason.BAD_METADATA,
                          path=root)
    readers: list[LogReader] = []
    try:
        for r in range(world):
            readers.append(LogReader(shard_path(root, r)))  # noqa: PERF401 (closed on error)
        metas = [log_meta(r) for r in readers]
        for r, m in enumerate(metas):
            sh = m.get("shard")
            if not isinstance(sh, dict) or sh.get("rank") != r or sh.get("world_size") != world:
                raise ConfigError(f"shard {r} does not belong to this {world}-rank "
                                  f"checkpoint", reason=Reason.BAD_METADATA,
                                  path=shard_path(root, r))
    except BaseException:
        for x in readers:
            x.close()
        raise
    return _Shards(root, world, layout, readers, metas)


def _shard_info(reader: LogReader) -> dict[str, Any]:
    return {"durable": reader.durable_step, "bases": list(reader.bases)}


def _plan(infos: Sequence[Mapping[str, Any]], step: int | None, layout: str, root: str
          ) -> tuple[int, list[int], int]:
    """(target step, base per shard, job durable step) from each shard's durable step and
    bases."""
    for r, i in enumerate(infos):
        if i["durable"] is None:
            raise StepNotFoundError(f"rank {r}'s shard has no base yet: nothing to restore",
                                    reason=Reason.NO_BASE, path=shard_path(root, r))
    job = min(int(i["durable"]) for i in infos)
    if step is None:
        target = job
    else:
        if type(step) is not int or step < 0:
            raise ConfigError(f"step={step!r} must be a non-negative int")
        if step > job:
            raise StepNotFoundError(f"step {step} is not durable on every rank (the newest "
                                    f"step durable on all {len(infos)} ranks is {job})",
                                    path=root)
        target = step
    if layout == "replicated":
        common = set(infos[0]["bases"]).intersection(*[set(i["bases"]) for i in infos[1:]])
        cands = [b for b in common if b <= target]
        if not cands:
            raise StepNotFoundError(f"no base at or before step {target} is on every rank",
                                    reason=Reason.NO_BASE, path=root)
        return target, [max(cands)] * len(infos), job
    bases = []
    for r, i in enumerate(infos):
        cands = [b for b in i["bases"] if b <= target]
        if not cands:
            raise StepNotFoundError(f"rank {r}'s shard has no base at or before step "
                                    f"{target}", reason=Reason.NO_BASE,
                                    path=shard_path(root, r))
        bases.append(max(cands))
    return target, bases, job


def _check_chain(reader: LogReader, base: int, target: int) -> None:
    steps = reader.steps
    lo = int(np.searchsorted(steps, base, side="right"))
    hi = int(np.searchsorted(steps, target, side="right"))
    have = [int(s) for s in steps[lo:hi]]
    want = list(range(base + 1, target + 1))
    if have != want:
        missing = sorted(set(want) - set(have))
        raise StepNotFoundError(f"cannot reach step {target} from base {base}: diff for step "
                                f"{missing[0]} is missing", path=reader.path)


def combine_digests(digests: Sequence[int]) -> int:
    """The digest of a job step: CRC32C over the shards' digests in rank order."""
    return crc32c(b"".join(struct.pack("<I", d & 0xFFFFFFFF) for d in digests))


@dataclass
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str = "raw"
    params: dict[str, Any] | None = None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _MergedBase:
    """The bases of one step of every shard, seen as one: a name comes from this rank's
    shard when it has it (RNG, buffers), else from the shard that owns it."""

    def __init__(self, files: list[BaseFile], own: int) -> None:
        self._files = files
        self._own = own
        self.path = files[own].path
        self._where: dict[str, BaseFile] = {}
        for i in [own] + [i for i in range(len(files)) if i != own]:
            for n in files[i].names:
                self._where.setdefault(n, files[i])

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self._where[name].info(name)

    def tensor(self, name: str) -> np.ndarray:
        return self._where[name].tensor(name)

    def meta(self) -> dict[str, Any]:
        m = self._files[self._own].meta()
        t = m.get("torch")
        if isinstance(t, dict):
            opt: dict[str, Any] = {"tensors": {}, "values": {}}
            for f in self._files:
                o = (f.meta().get("torch") or {}).get("opt") or {}
                opt["tensors"].update(o.get("tensors") or {})
                opt["values"].update(o.get("values") or {})
            t["opt"] = opt
        return m

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> _MergedBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _MergedRecord:
    """The records of one step of every shard, seen as one (side channel: this rank's).
    Gradients logged as a hook produced them are decoded here with the tee's decoders:
    fp16/bf16 widened, PowerSGD factors multiplied (``@grad/NAME`` then reads as a raw
    tensor of the parameter's dtype)."""

    def __init__(self, recs: list[Any], own: int,
                 params: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        r0 = recs[own]
        self.step, self.path, self.offset = r0.step, r0.path, r0.offset
        self.side = r0.side
        digests = [r.meta.get("digest") for r in recs]
        self.meta: dict[str, Any] = (
            {"digest": combine_digests(digests)}
            if all(isinstance(d, int) for d in digests) else {})
        self._params = params
        self._where: dict[str, Any] = {}
        for i in [own] + [i for i in range(len(recs)) if i != own]:
            for n in recs[i].names:
                self._where.setdefault(n, recs[i])
        self._synth: dict[str, tuple[str, str]] = {}
        names = [n for n in self._where if not n.startswith((PSGD, HOOK))]
        for n in list(self._where):
            if n.startswith(PSGD) and n.endswith("/P"):
                pname = n[len(PSGD):-2]
                if L.GRAD + pname not in self._where and \
                        PSGD + pname + "/Q" in self._where and pname in params:
                    self._synth[L.GRAD + pname] = ("psgd", pname)
                    names.append(L.GRAD + pname)
        for n in names:
            if n.startswith(L.GRAD) and n not in self._synth:
                pname = n[len(L.GRAD):]
                e = self._where[n].entry(n)
                want = params.get(pname)
                if want is not None and e.codec == "raw" and e.dtype != want[0] and \
                        e.dtype in ("F16", "BF16"):
                    self._synth[n] = ("narrow", pname)
        self.names = names

    def entry(self, name: str) -> Any:
        s = self._synth.get(name)
        if s is not None:
            tag, shape = self._params[s[1]]
            return _Entry(name, tag, shape)
        try:
            rec = self._where[name]
        except KeyError:
            raise LowdiffError(f"step {self.step} has no tensor {name!r}",
                               reason=Reason.INVALID_ARGUMENT, path=self.path) from None
        return rec.entry(name)

    def tensor(self, name: str, *, ref: np.ndarray | None = None) -> np.ndarray:
        s = self._synth.get(name)
        if s is None:
            return cast("np.ndarray", self._where[name].tensor(name, ref=ref))
        kind, pname = s
        tag, shape = self._params[pname]
        if kind == "psgd":
            pk, qk = PSGD + pname + "/P", PSGD + pname + "/Q"
            rp, rq = self._where[pk], self._where[qk]
            p = from_bits(rp.entry(pk).dtype, rp.tensor(pk))
            q = from_bits(rq.entry(qk).dtype, rq.tensor(qk))
            t = psgd_decode(p, q, shape)
        else:
            rec = self._where[name]
            t = narrow_decode(from_bits(rec.entry(name).dtype, rec.tensor(name)), DTYPE_OF[tag])
        if tag_of(t) != tag:
            raise ConfigError(f"step {self.step}: gradient {pname} decodes to {tag_of(t)}, "
                              f"the parameter is {tag}", reason=Reason.STATE_MISMATCH,
                              path=self.path)
        return bits_view(t)[1]

    def parts(self, name: str) -> list[np.ndarray]:
        return cast("list[np.ndarray]", self._where[name].parts(name))


class _MergedReader:
    """Every shard of a replicated checkpoint as one log, from ``own``'s point of view,
    replaying from the base ``base`` (present on every shard)."""

    def __init__(self, shards: _Shards, own: int, base: int) -> None:
        self.shards = shards
        self.own = own
        self._base = base
        self.path = shards.root
        self.readers = shards.readers
        meta = shards.metas[own]
        self.params = {n: (t, tuple(s)) for n, t, s in meta["model"]}

    def chain(self, step: int) -> tuple[int, list[int]]:
        for r in self.readers:
            _check_chain(r, self._base, step)
        return self._base, list(range(self._base + 1, step + 1))

    def base_for(self, step: int) -> int:
        return self._base

    def base(self, step: int) -> _MergedBase:
        files: list[BaseFile] = []
        try:
            for r in self.readers:
                files.append(r.base(step))  # noqa: PERF401 (closed on error)
        except BaseException:
            for f in files:
                f.close()
            raise
        return _MergedBase(files, self.own)

    def record(self, step: int) -> _MergedRecord:
        return _MergedRecord([r.record(step) for r in self.readers], self.own, self.params)


class _MergedReplayer(_Replayer):
    """Replay of merged records; the digest of a step is checked shard by shard (each
    shard's record holds the digest of its own parameters)."""

    def __init__(self, reader: _MergedReader, meta: Mapping[str, Any], objs: _Objects, *,
                 verify: bool, progress: Progress | None) -> None:
        super().__init__(cast("LogReader", reader), meta, objs, verify=verify,
                         progress=progress)
        pos = {n: i for i, n in enumerate(objs.names)}
        self._per_shard = []
        for m in reader.shards.metas:
            owned = set(m["shard"]["owned"])
            self._per_shard.append([objs.params[pos[n]] for n in objs.names if n in owned])

    def _digest(self, state: Any, layout: Any) -> int:
        opt = self.objs.optimizer
        assert opt is not None
        return combine_digests([L.digest_objects(ps, opt) for ps in self._per_shard])


# ---------------------------------------------------------------------- hook state


def _hook_state(shards: _Shards, rank: int, bases: Sequence[int], target: int
                ) -> tuple[HookRestore | None, list[str]]:
    """This rank's communication-hook state at ``target`` (and notes when part of it cannot
    be restored): its own shard's hook metadata and error feedback, and PowerSGD's
    warm-start Q from every shard (each logs the factors of the parameters it owns)."""
    own = shards.readers[rank]
    meta: dict[str, Any] | None = None
    ef: dict[str, torch.Tensor] | None = {}
    base_ef = False
    with own.base(bases[rank]) as bf:
        names = bf.names
        if HOOK_META in names:
            meta = msgpack.unpackb(bytes(bf.tensor(HOOK_META)), raw=False)
        for n in names:
            if n.startswith(HOOK_EF):
                assert ef is not None
                ef[n[len(HOOK_EF):]] = from_bits(bf.info(n)[0], bf.tensor(n))
                base_ef = True
    for t in range(bases[rank] + 1, target + 1):
        rec = own.record(t)
        h = rec.side.get("hook")
        if isinstance(h, dict):
            meta = {**(meta or {}), **h}
        step_ef = {n[len(HOOK_EF):]: from_bits(rec.entry(n).dtype, rec.tensor(n))
                   for n in rec.names if n.startswith(HOOK_EF)}
        if step_ef:
            ef = step_ef
        elif t == target and base_ef:
            ef = None
    if meta is None or not isinstance(meta.get("kind"), str):
        return None, []
    q: dict[str, torch.Tensor] = {}
    if meta["kind"] == "powersgd":
        for s, reader in enumerate(shards.readers):
            with reader.base(bases[s]) as bf:
                for n in bf.names:
                    if n.startswith(HOOK_Q):
                        q[n[len(HOOK_Q):]] = from_bits(bf.info(n)[0], bf.tensor(n))
            for t in range(bases[s] + 1, target + 1):   # the newest Q of each parameter
                rec = reader.record(t)
                for n in rec.names:
                    if n.startswith(PSGD) and n.endswith("/Q"):
                        q[n[len(PSGD):-2]] = from_bits(rec.entry(n).dtype, rec.tensor(n))
    notes: list[str] = []
    if ef is None:
        notes.append(
            f"the {meta['kind']} hook's error-feedback state of rank {rank} is logged only in "
            f"bases (ef_state='base') and step {target} is not a base (the newest is "
            f"{bases[rank]}): the hook restarts from zero error feedback. Weights and "
            f"optimizer state are exact; training continued from here is not bitwise the "
            f"original run")
    return HookRestore(meta["kind"], meta, ef, q), notes


# ---------------------------------------------------------------------- restore


def restore_sharded(path: str | os.PathLike[str], model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                    scaler: Any = None, step: int | None = None, compressor: Any = None,
                    verify: bool = True) -> RestoreResult:
    """:func:`~lowdiff_store.torch.restore` of a sharded checkpoint (collective: every rank
    calls it). The target is ``step`` or, by default, the newest step durable on every
    rank; every rank gets its own RNG states, buffers, side channel and hook state, and
    the full parameters and optimizer state (its partition's, with ZeRO)."""
    root = os.fspath(path)
    rank, world = rank_world()
    if not is_sharded(root):
        exists = manifest_exists(root)
        raise ConfigError(
            f"{root} holds an unsharded log written by a single process; this job has "
            f"{world} ranks" if exists else f"{root} holds no checkpoint (no SHARDS file)",
            reason=Reason.WORLD_SIZE_MISMATCH if exists else Reason.NOT_A_LOG, path=root)
    check_world_size(root, world)
    group = coordination_group() if world > 1 else None
    zero = _zero_of(optimizer)
    shards: _Shards | None = None
    err: BaseException | None = None
    try:
        shards = _open_shards(root)
        if (zero is not None) != (shards.layout == "zero"):
            raise ConfigError(f"the checkpoint's layout is {shards.layout!r}; the optimizer "
                              f"{'is' if zero is not None else 'is not'} a "
                              f"ZeroRedundancyOptimizer", reason=Reason.STATE_MISMATCH,
                              path=root)
    except Exception as e:
        err = e
    try:
        agree(group, err)   # no rank waits in the exchange below for one that failed
    except BaseException:
        if shards is not None:
            shards.close()
        raise
    assert shards is not None
    try:
        mine = _shard_info(shards.readers[rank])
        infos = _gather(group, mine) if group is not None else \
            [_shard_info(r) for r in shards.readers]
        res: RestoreResult | None = None
        try:
            target, bases, job = _plan(infos, step, shards.layout, root)
            if zero is None:
                res = _restore_replicated(shards, rank, target, bases, job, model, optimizer,
                                          scheduler, scaler, compressor, verify)
            else:
                res = _restore_zero(shards, rank, target, bases, job, model, zero, scheduler,
                                    scaler, verify)
        except Exception as e:
            err = e
        agree(group, err)
    finally:
        shards.close()
    assert res is not None
    return res


def _restore_replicated(shards: _Shards, rank: int, target: int, bases: list[int], job: int,
                        model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: Any, scaler: Any, compressor: Any, verify: bool
                        ) -> RestoreResult:
    root = shards.root
    meta = shards.metas[rank]
    objs = objects_for(model, optimizer, scheduler, scaler)
    _check_objects(meta, objs, root)
    merged = _MergedReader(shards, rank, bases[0])
    out = _MergedReplayer(merged, meta, objs, verify=verify, progress=None).run(target)
    res = out.result
    residuals = hand_residuals(out, objs, compressor)
    hook, notes = _hook_state(shards, rank, bases, target)
    if notes:
        res.exact = False
        res.notes += notes
    owned = set(meta["shard"]["owned"])
    mine = [p for n, p in zip(objs.names, objs.params, strict=True) if n in owned]
    _remember(shards, rank, optimizer, res, L.digest_objects(mine, optimizer), residuals, hook,
              job)
    return res


def _remember(shards: _Shards, rank: int, local: Any, res: RestoreResult, digest: int,
              residuals: Any, hook: HookRestore | None, job: int) -> None:
    remember(local, RestoreInfo(os.path.realpath(shard_path(shards.root, rank)),
                                shards.readers[rank].log_id, res.step, digest, res.exact,
                                residuals, list(res.notes)))
    if res.step == job:
        _JOB_STEP[local] = job
    else:
        _JOB_STEP.pop(local, None)
    if hook is not None:
        _PENDING_HOOK[local] = hook
    else:
        _PENDING_HOOK.pop(local, None)


def _restricted(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    owned = set(meta["shard"]["owned"])
    buffers = set(meta["buffers"])
    out = {}
    for n, tag, shape in meta["model"]:
        if n in owned or n in buffers:
            t = tensors.get(n)
            if t is None or tag_of(t, n) != tag or list(t.shape) != list(shape):
                raise ConfigError(f"the model does not match the log's ({n}: {tag}{shape})",
                                  reason=Reason.STATE_MISMATCH)
            out[n] = t
    return out


def _zero_order(shards: _Shards, rank: int) -> list[int]:
    return [s for s in range(shards.world) if s != rank] + [rank]


def _restore_zero(shards: _Shards, rank: int, target: int, bases: list[int], job: int,
                  model: torch.nn.Module, zero: Any, scheduler: Any, scaler: Any,
                  verify: bool) -> RestoreResult:
    root = shards.root
    local = zero.optim
    tensors = model_entries(model).tensors
    res: RestoreResult | None = None
    for s in _zero_order(shards, rank):   # this rank last: its RNG, buffers, side channel
        meta = shards.metas[s]
        reader = shards.readers[s]
        names = list(meta["params"])
        params = [tensors[n] for n in names]
        mdl = _restricted(meta, tensors)
        if s == rank:
            objs = objects_for(model, local, scheduler, scaler)
            if objs.names != names or [len(g["params"]) for g in local.param_groups] != \
                    list(meta["groups"]) or L.class_name(local) != meta["optimizer"]:
                raise ConfigError("the ZeroRedundancyOptimizer's partition of this rank "
                                  "differs from the log's", reason=Reason.STATE_MISMATCH,
                                  path=shard_path(root, s))
            objs.model = mdl
        else:
            with reader.base(bases[s]) as bf:
                hyper = bf.meta()["torch"]["hyper"]
            opt = _build_optimizer(meta, params, hyper, None, shard_path(root, s))
            objs = _Objects(names, params, mdl, opt)
        _check_chain(reader, bases[s], target)
        out = _Replayer(reader, meta, objs, verify=verify, progress=None).run(target)
        if s == rank:
            res = out.result
    assert res is not None
    _sync_groups(local.param_groups, zero.param_groups)
    hook, notes = _hook_state(shards, rank, bases, target)
    if notes:
        res.exact = False
        res.notes += notes
    _remember(shards, rank, local, res, L.digest_objects(L.params_of(local), local), None,
              hook, job)
    return res


# ---------------------------------------------------------------------- without the model


def job_durable_step(path: str | os.PathLike[str]) -> int | None:
    """The newest step durable on every shard of a sharded checkpoint (None: some shard has
    no base yet)."""
    shards = _open_shards(os.fspath(path))
    try:
        ds = [r.durable_step for r in shards.readers]
    finally:
        shards.close()
    return None if any(d is None for d in ds) else min(cast("list[int]", ds))


def replay_state_sharded(path: str | os.PathLike[str], step: int | None = None, *,
                         with_optimizer: bool = False,
                         optimizer_factory: Callable[[list[dict[str, Any]]],
                                                     torch.optim.Optimizer] | None = None,
                         progress: Progress | None = None, verify: bool = True
                         ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """:func:`~lowdiff_store.torch.replay_state` of a sharded checkpoint: the shards are
    merged into one state dict (buffers and RNG-dependent state as rank 0 holds them);
    ``step`` defaults to the newest step durable on every rank."""
    root = os.fspath(path)
    shards = _open_shards(root)
    try:
        infos = [_shard_info(r) for r in shards.readers]
        target, bases, _job = _plan(infos, step, shards.layout, root)
        meta = shards.metas[0]
        model = {n: torch.zeros(shape, dtype=_dtype(tag)) for n, tag, shape in meta["model"]}
        with torch.random.fork_rng(devices=[]):
            if shards.layout == "replicated":
                opt_state = _replay_replicated(shards, target, bases[0], model,
                                               optimizer_factory, progress, verify)
            else:
                opt_state = _replay_zero(shards, target, bases, model, optimizer_factory,
                                         progress, verify)
    finally:
        shards.close()
    aliases = meta.get("aliases") or {}
    order = meta.get("state_dict") or [n for n, _t, _s in meta["model"]] + list(aliases)
    state = {n: model[aliases.get(n, n)] for n in order}
    return state, (opt_state if with_optimizer else None)


def _replay_replicated(shards: _Shards, target: int, base: int,
                       model: dict[str, torch.Tensor], factory: Any,
                       progress: Progress | None, verify: bool) -> dict[str, Any]:
    meta = shards.metas[0]
    names = list(meta["params"])
    params = [model[n] for n in names]
    merged = _MergedReader(shards, 0, base)
    with merged.base(base) as mb:
        hyper = mb.meta()["torch"]["hyper"]
    opt = _build_optimizer(meta, params, hyper, factory, shards.root)
    objs = _Objects(names, params, model, opt)
    _MergedReplayer(merged, meta, objs, verify=verify, progress=progress).run(target)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g["param_names"] = [names[i] for i in g["params"]]
    return sd


def _replay_zero(shards: _Shards, target: int, bases: list[int],
                 model: dict[str, torch.Tensor], factory: Any, progress: Progress | None,
                 verify: bool) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    hyper0: list[Any] = []
    for s in _zero_order(shards, 0):   # rank 0 last: its buffers
        meta = shards.metas[s]
        reader = shards.readers[s]
        names = list(meta["params"])
        params = [model[n] for n in names]
        with reader.base(bases[s]) as bf:
            hyper = bf.meta()["torch"]["hyper"]
        opt = _build_optimizer(meta, params, hyper, factory, shard_path(shards.root, s))
        objs = _Objects(names, params, _restricted(meta, model), opt)
        _check_chain(reader, bases[s], target)
        _Replayer(reader, meta, objs, verify=verify, progress=progress).run(target)
        sd = opt.state_dict()
        for i, n in enumerate(names):
            if i in sd["state"]:
                state[n] = sd["state"][i]
        if s == 0:
            hyper0 = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    sh = shards.metas[0]["shard"]
    gnames = list(sh["global_params"])
    pos = {n: i for i, n in enumerate(gnames)}
    groups = []
    start = 0
    for n_in, h in zip(sh["global_groups"], hyper0, strict=True):
        g = dict(h)
        g["params"] = list(range(start, start + n_in))
        g["param_names"] = gnames[start:start + n_in]
        start += n_in
        groups.append(g)
    return {"state": {pos[n]: v for n, v in state.items()}, "param_groups": groups}


def describe_sharded(path: str | os.PathLike[str]) -> dict[str, Any]:
    """:func:`~lowdiff_store.torch.describe_log` of a sharded checkpoint: rank 0's torch
    metadata plus ``sharded``, ``world_size``, ``layout``, the job's step range (durable:
    the minimum over the shards) and per shard its owned parameters, bytes and steps."""
    from .describe import describe_log

    root = os.fspath(path)
    body = read_shards_manifest(root)
    out = describe_log(shard_path(root, 0))
    shards = []
    for r in range(body["world_size"]):
        d = out if r == 0 else describe_log(shard_path(root, r))
        with LogReader(shard_path(root, r)) as reader:
            sh = log_meta(reader).get("shard") or {}
        sizes = {t["name"]: t for t in d["model_tensors"]}
        owned = list(sh.get("owned") or [])
        shards.append({"rank": r, "owned_params": len(owned),
                       "owned_elements": sum(int(np.prod(sizes[n]["shape"], dtype=np.int64))
                                             for n in owned if n in sizes),
                       "steps": d["steps"]})
    durable = [s["steps"]["durable"] for s in shards]
    out = dict(out)
    out.update({"sharded": True, "world_size": body["world_size"],
                "layout": body.get("layout"), "shards": shards,
                "steps": {**out["steps"], "durable": None if None in durable
                          else min(durable)}})
    return out


# ---------------------------------------------------------------------- compaction


def shard_materializer(root: str | os.PathLike[str]) -> Callable[[int], Any]:
    """For compaction: ``for_rank(r)`` returns a materializer ``(reader, step) -> (tensors,
    meta)`` producing the base of rank ``r``'s shard at ``step``, exactly what that rank's
    checkpointer would have written (its share, its RNG, buffers, side channel and hook
    state). Refuses (``ConfigError(not_allowed)``) when per-rank state that replay cannot
    rebuild (error-feedback residuals kept only in bases) would be needed."""
    r = os.fspath(root)

    def for_rank(rank: int) -> Callable[[Any, int], Any]:
        def materialize(_reader: Any, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
            return _materialize(r, rank, step)
        return materialize
    return for_rank


def _materialize(root: str, rank: int, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    shards = _open_shards(root)
    try:
        meta = shards.metas[rank]
        if meta["mode"] != "grad":
            raise ConfigError("only grad-mode shards can be materialized",
                              reason=Reason.NOT_ALLOWED)
        comp = meta.get("compressor") or {}
        if comp.get("error_feedback") and comp.get("ef_state") != "step":
            raise ConfigError("compressor residuals are kept only in bases: a base at another "
                              "step cannot be made", reason=Reason.NOT_ALLOWED)
        infos = [_shard_info(x) for x in shards.readers]
        target, bases, _job = _plan(infos, step, shards.layout, root)
        hook, notes = _hook_state(shards, rank, bases, target)
        if notes:
            raise ConfigError(f"rank {rank}: {notes[0]}", reason=Reason.NOT_ALLOWED)
        model = {n: torch.zeros(shape, dtype=_dtype(tag)) for n, tag, shape in meta["model"]}
        names = list(meta["params"])
        params = [model[n] for n in names]
        with shards.readers[rank].base(bases[rank]) as bf:
            bmeta = bf.meta()["torch"]
        opt = _build_optimizer(meta, params, bmeta["hyper"], None, root)
        owned = set(meta["shard"]["owned"])
        with torch.random.fork_rng(devices=[]):
            if shards.layout == "replicated":
                objs = _Objects(names, params, model, opt)
                out = _MergedReplayer(_MergedReader(shards, rank, bases[0]), meta, objs,
                                      verify=True, progress=None).run(target)
            else:
                objs = _Objects(names, params, _restricted(meta, model), opt)
                out = _Replayer(shards.readers[rank], meta, objs, verify=True,
                                progress=None).run(target)
        side = _carried(shards.readers[rank], bases[rank], target, bmeta)
        tensors: dict[str, Any] = {}
        for n, _t, _s in meta["model"]:
            if n in owned or n in meta["buffers"]:
                tensors[n] = to_bits(model[n], n)
        opt_tensors: dict[str, list[str]] = {}
        opt_values: dict[str, Any] = {}
        for n, p in zip(names, params, strict=True):
            st = opt.state.get(p)
            if n not in owned or not st:
                continue
            ts, vs = L.split_state(st, n)
            for k, t in ts.items():
                tensors[L.opt_name(n, k)] = to_bits(t, n)
            opt_tensors[n] = sorted(ts)
            opt_values[n] = vs
        tensors.update(side.pop("rng"))
        for n, t in (out.residuals or {}).items():
            if n in owned:
                tensors[L.EF + n] = to_bits(t, n)
        if hook is not None:
            hmeta = {k: v for k, v in hook.meta.items()}
            tensors[HOOK_META] = ("U8", np.frombuffer(msgpack.packb(hmeta, use_bin_type=True),
                                                      dtype=np.uint8).copy())
            for n, t in (hook.ef or {}).items():
                tensors[HOOK_EF + n] = to_bits(t, n)
            for n, t in hook.q.items():
                if n in owned:
                    tensors[HOOK_Q + n] = to_bits(t, n)
        bm = {"torch": {"step": target, "hyper": L.hyper_of(opt), "sched": side["sched"],
                        "scaler": side["scaler"], "extra": side["extra"],
                        "opt": {"tensors": opt_tensors, "values": opt_values},
                        "log": meta}}
        return tensors, bm
    finally:
        shards.close()


def _carried(reader: LogReader, base: int, target: int, bmeta: Mapping[str, Any]
             ) -> dict[str, Any]:
    """This shard's side-channel values and RNG states after ``target``."""
    sched, scaler, extra = bmeta.get("sched"), bmeta.get("scaler"), bmeta.get("extra")
    rng: dict[str, tuple[str, np.ndarray]] = {}
    with reader.base(base) as bf:
        for n in bf.names:
            if n.startswith("@rng/"):
                rng[n] = ("U8", np.array(bf.tensor(n)))
    for t in range(base + 1, target + 1):
        rec = reader.record(t)
        side = rec.side
        sched = side.get("sched", sched)
        scaler = side.get("scaler", scaler)
        extra = side.get("extra", extra)
        for n in rec.names:
            if n.startswith("@rng/"):
                rng[n] = ("U8", np.array(rec.tensor(n)))
    return {"sched": sched, "scaler": scaler, "extra": extra, "rng": rng}


__all__ = [
    "LAYOUTS",
    "ShardedCheckpointer",
    "agree",
    "checkpointer_class",
    "combine_digests",
    "coordination_group",
    "describe_sharded",
    "job_durable_step",
    "partition_by_bytes",
    "rank_world",
    "replay_state_sharded",
    "restore_sharded",
    "set_coordination_group",
    "shard_materializer",
    "wants_sharded",
]
