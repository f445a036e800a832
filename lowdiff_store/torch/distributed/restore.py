"""Restore, replay, description and compaction of sharded checkpoints (one log per rank).

The shards are read through :class:`~lowdiff_store.log.shardset.ShardSet`; a replicated job
step is the shards merged into one view
(:class:`~lowdiff_store.log.shardset.MergedReader`) replayed by the same engine as a single
log (:class:`~lowdiff_store.torch.replay.engine.Replayer`). Whether a path is sharded is decided
in :mod:`lowdiff_store.torch.api`. See ``docs/distributed.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np
import torch

from ...errors import ConfigError, FormatError, Reason
from ...log import LogReader
from ...log.reader import on_newest_manifest, with_reader
from ...log.shards import is_sharded, read_shards_manifest, shard_mismatch, shard_path
from ...log.shardset import MergedReader, ShardSet, check_chain, plan_job
from ...progress import ProgressFn
from ...torchmeta import BaseMeta, LogMeta, ShardMeta
from ..capture.sink import manifest_exists
from ..core import schema as L
from ..core.hook_records import HOOK_EF, HOOK_META, HOOK_Q, PSGD
from ..core.registry import RestoreInfo, remember
from ..core.tensors import DTYPE_OF, from_bits, model_entries, tag_of, to_bits
from ..replay.describe import describe_one_log
from ..replay.engine import (
    Replayer,
    base_hyper,
    base_torch_meta,
    log_meta,
    open_start,
    streamed_base,
)
from ..replay.restore import (
    RestoreResult,
    blank_objects,
    check_objects,
    hand_residuals,
    objects_for,
)
from .checkpointer import (
    agree,
    coordination_group,
    gather_objects,
    partition_by_bytes,
    rank_world,
    sync_groups,
    zero_of,
)
from .fsdp import fsdp_share, has_dtensor
from .ondemand import OnDemandShards, checked_meta, exchange_facts
from .reshard import ShardFacts, Source, replay_pieces, restore_pieces
from .tee import HookRestore

T = TypeVar("T")


class _Shards(ShardSet):
    """The shards with their torch metadata (``metas[r]``: rank r's), each checked to
    belong to this checkpoint. Mapped copy-on-write: replay lends the records' gradients
    to the optimizer without copying them."""

    def __init__(self, root: str) -> None:
        super().__init__(root, mode="private")
        try:
            self.metas = [checked_meta(r, s, self.world, self.layout, root)
                          for s, r in enumerate(self.readers)]
        except BaseException:
            self.close()
            raise

    def owned(self) -> list[set[str]]:
        """The parameters each shard logs."""
        return [set(_shard_of(m).owned) for m in self.metas]

    def merged_at(self, own: int, point: int) -> MergedReader:
        """The shards merged from rank ``own``'s point of view, replaying from the restore
        point ``point``: a streamed base of a shard is opened with its slices' metadata
        checked against that shard's (:func:`~..replay.engine.streamed_base`)."""
        return self.merged(own, point,
                           lambda s, reader, plan: streamed_base(reader, plan, self.metas[s]))


def _first_file(reader: LogReader, point: int) -> tuple[int, Any]:
    """(the step replay from the restore point ``point`` of a shard starts after, the file
    holding that shard's state that is no parameter's there): a consistent base's step and
    file, or a streamed base's first slice's."""
    plan = reader.start_for(point)
    if plan.streamed:
        return plan.first, reader.slice_file(plan.first)
    return point, reader.base(point)


def _placed(meta: LogMeta) -> tuple[int, int, str] | None:
    """(rank, world size, layout) a shard's metadata declares; None without a shard
    section."""
    sh = meta.shard
    return None if sh is None else (sh.rank, sh.world_size, sh.layout)


def _shard_of(meta: LogMeta) -> ShardMeta:
    """The shard section of a shard's metadata (every shard has one: :class:`_Shards`
    checks it against the SHARDS file)."""
    assert meta.shard is not None
    return meta.shard


def _shard_info(reader: LogReader) -> dict[str, Any]:
    return {"durable": reader.durable_step, "bases": list(reader.bases),
            "streamed": [[c, list(steps)] for c, steps in reader.streamed]}


def _plan(infos: Sequence[Mapping[str, Any]], step: int | None, layout: str, root: str
          ) -> tuple[int, list[int], int]:
    """(target step, base per shard, job durable step) from each shard's durable step and
    bases (gathered from every rank)."""
    p = plan_job([i["durable"] for i in infos], [i["bases"] for i in infos], step, layout,
                 root, [i.get("streamed", ()) for i in infos])
    return p.target, p.bases, p.job_durable


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
    first, opened = _first_file(own, bases[rank])
    with opened as bf:
        names = bf.names
        if HOOK_META in names:
            meta = msgpack.unpackb(bytes(bf.tensor(HOOK_META)), raw=False)
        for n in names:
            if n.startswith(HOOK_EF):
                assert ef is not None
                ef[n[len(HOOK_EF):]] = from_bits(bf.info(n)[0], bf.tensor(n))
                base_ef = True
    for t in range(first + 1, target + 1):
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
            start, opened = _first_file(reader, bases[s])
            with opened as bf:
                for n in bf.names:
                    if n.startswith(HOOK_Q):
                        q[n[len(HOOK_Q):]] = from_bits(bf.info(n)[0], bf.tensor(n))
            for t in range(start + 1, target + 1):   # the newest Q of each parameter
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
                    verify: bool = True, progress: ProgressFn | None = None) -> RestoreResult:
    """:func:`~lowdiff_store.torch.restore` of a sharded checkpoint (collective: every rank
    calls it). The target is ``step`` or, by default, the newest step durable on every
    rank; every rank gets its own RNG states, buffers, side channel and hook state, and
    the full parameters and optimizer state (its partition's, with ZeRO)."""
    root = os.fspath(path)
    rank, world = rank_world()
    zero = zero_of(optimizer)
    if world > 1:  # no rank reads a shard before every rank got here: one that closed its
        agree(coordination_group(), None)  # checkpointer just before has its steps durable
    if not is_sharded(root):
        if not manifest_exists(root):
            raise ConfigError(f"{root} holds no checkpoint (no SHARDS file)",
                              reason=Reason.NOT_A_LOG, path=root)
        return _restore_resharded(root, rank, world, model, optimizer, scheduler, scaler,
                                  step, verify, zero, compressor, progress)
    body = read_shards_manifest(root)
    if body.get("layout") == "fsdp" or body["world_size"] != world or (
            zero is None and has_dtensor(L.params_of(optimizer))):
        return _restore_resharded(root, rank, world, model, optimizer, scheduler, scaler,
                                  step, verify, zero, compressor, progress)
    group = coordination_group() if world > 1 else None
    shards: _Shards | None = None
    err: BaseException | None = None
    try:
        shards = _Shards(root)
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
    held = [shards]
    try:
        mine = _shard_info(shards.readers[rank])
        infos = gather_objects(group, mine) if group is not None else \
            [_shard_info(r) for r in shards.readers]
        res: RestoreResult | None = None
        try:
            target, bases, job = _plan(infos, step, shards.layout, root)

            def run(sh: _Shards, at: list[int]) -> RestoreResult:
                if zero is None:
                    return _restore_replicated(sh, rank, target, at, job, model, optimizer,
                                               scheduler, scaler, compressor, verify, progress)
                return _restore_zero(sh, rank, target, at, job, model, zero, scheduler,
                                     scaler, verify, progress)

            res = _on_newest_shards(held, target, bases, run)
        except Exception as e:
            err = e
        agree(group, err)
    finally:
        held[0].close()
    assert res is not None
    return res


def _on_newest_shards(held: list[_Shards], target: int, bases: list[int],
                      run: Callable[[_Shards, list[int]], T]) -> T:
    """``run(held[0], bases)``; if it found a base missing because a compaction published
    newer manifests meanwhile, again on every shard opened anew (``held[0]`` replaced: the
    caller closes it) with the bases planned anew for ``target``
    (:func:`~lowdiff_store.log.reader.on_newest_manifest`; not collective)."""
    tries = [0]

    def attempt() -> T:
        at = bases
        if tries[0]:
            root = held[0].root
            held[0].close()
            held[0] = _Shards(root)
            at = _plan([_shard_info(r) for r in held[0].readers], target, held[0].layout,
                       root)[1]
        tries[0] += 1
        return run(held[0], at)

    return on_newest_manifest(attempt, lambda: held[0].moved())


def _restore_resharded(root: str, rank: int, world: int, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                       step: int | None, verify: bool, zero: Any,
                       compressor: Any = None, progress: ProgressFn | None = None
                       ) -> RestoreResult:
    """Restore through :mod:`~lowdiff_store.torch.distributed.reshard`: an FSDP2 checkpoint at any
    world size, or any checkpoint (a single log included) into another world size or
    layout. Each rank opens about 1/W' of the shards to describe them to the others
    (:mod:`~lowdiff_store.torch.distributed.ondemand`), then opens and replays only the
    shards its pieces need; a base that a compaction deleted meanwhile is read again on
    the newer manifests (:func:`~lowdiff_store.log.reader.on_newest_manifest`)."""
    group = coordination_group() if world > 1 else None
    res: RestoreResult | None = None
    job = -1
    log_id = b""
    sharded = is_sharded(root)
    residuals: dict[torch.Tensor, torch.Tensor] | None = None
    err: BaseException | None = None
    shards = OnDemandShards(root) if sharded else None
    try:
        facts = exchange_facts(shards, rank, world, group) if shards is not None else None
        same = shards is not None and shards.world == world
        if zero is not None:
            raise ConfigError("a ZeroRedundancyOptimizer restores only a checkpoint of its own "
                              "layout and world size; restore into a plain optimizer (or "
                              "FSDP2) to reshard", reason=Reason.NOT_ALLOWED, path=root)

        def pieces(src: Source, at: int | None) -> Any:
            return restore_pieces(src, rank, world, model, optimizer, scheduler=scheduler,
                                  scaler=scaler, step=at, verify=verify, progress=progress)

        if shards is not None and facts is not None:
            res, job, residuals = _pieces_on_newest(shards, facts, step, pieces)
            if same:
                log_id = shards.readers[rank].log_id
        else:
            def one(reader: LogReader) -> Any:
                return pieces(Source(root, [reader], [log_meta(reader)], "single"), step)

            res, job, residuals = with_reader(root, one, mode="private")
        if residuals is not None and compressor is not None:
            compressor.residuals = residuals
            residuals = None
    except Exception as e:
        err = e
    finally:
        if shards is not None:
            shards.close()
    agree(group, err)
    assert res is not None
    path = shard_path(root, rank) if sharded else root
    digest = L.digest_objects(_owned_params(model, optimizer, rank, world), optimizer)
    res.info = RestoreInfo(os.path.realpath(path), log_id, res.step, digest, res.exact,
                           residuals, list(res.notes),
                           job_step=job if log_id and res.step == job else None)
    remember(optimizer, res.info)
    return res


def _pieces_on_newest(shards: OnDemandShards, facts: list[ShardFacts], step: int | None,
                      pieces: Callable[[Source, int | None], T]) -> T:
    """``pieces(source, target)`` over the shards described by ``facts``, the target
    fixed by them; if a shard's base went missing because a compaction published a newer
    manifest since, again with the shards this rank opened read on their newest manifests
    (:func:`~lowdiff_store.log.reader.on_newest_manifest`; not collective)."""
    target = plan_job([f.durable for f in facts], [list(f.bases) for f in facts], step,
                      "pieces", shards.root).target
    tries = [0]

    def attempt() -> T:
        if tries[0]:
            for s in shards.reopen():
                facts[s] = shards.facts(s)
        tries[0] += 1
        src = Source(shards.root, shards.readers, shards.metas, shards.layout, facts=facts)
        return pieces(src, target)

    return on_newest_manifest(attempt, shards.moved)


def _owned_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                  world: int) -> list[torch.Tensor]:
    """The parameters a checkpointer created next on these objects logs (its digest is
    checked against the restored one): FSDP2's share, DDP's partition, or all."""
    params = L.params_of(optimizer)
    if world == 1:
        return params
    objs = objects_for(model, optimizer, None, None)
    if has_dtensor(params):
        owned = set(fsdp_share(objs.names, params).owned)
    else:
        known = set(objs.names)
        buffers = set(model_entries(model).buffers)
        order = objs.names + [n for n in objs.model if n not in buffers and n not in known]
        sizes = [(n, objs.model[n].numel() * objs.model[n].element_size()) for n in order]
        owned = set(partition_by_bytes(sizes, world)[rank])
    return [p for n, p in zip(objs.names, params, strict=True) if n in owned]


def _restore_replicated(shards: _Shards, rank: int, target: int, bases: list[int], job: int,
                        model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: Any, scaler: Any, compressor: Any, verify: bool,
                        progress: ProgressFn | None = None) -> RestoreResult:
    root = shards.root
    meta = shards.metas[rank]
    objs = objects_for(model, optimizer, scheduler, scaler)
    check_objects(meta, objs, root)
    out = Replayer(shards.merged_at(rank, bases[0]), meta, objs, verify=verify,
                   progress=progress, shard_owned=shards.owned()).run(target)
    res = out.result
    residuals = hand_residuals(out, objs, compressor)
    hook, notes = _hook_state(shards, rank, bases, target)
    if notes:
        res.exact = False
        res.notes += notes
    owned = set(_shard_of(meta).owned)
    mine = [p for n, p in zip(objs.names, objs.params, strict=True) if n in owned]
    _remember(shards, rank, optimizer, res, L.digest_objects(mine, optimizer), residuals, hook,
              job)
    return res


def _remember(shards: _Shards, rank: int, local: Any, res: RestoreResult, digest: int,
              residuals: Any, hook: HookRestore | None, job: int) -> None:
    res.info = RestoreInfo(os.path.realpath(shard_path(shards.root, rank)),
                           shards.readers[rank].log_id, res.step, digest, res.exact,
                           residuals, list(res.notes), hook=hook,
                           job_step=job if res.step == job else None)
    remember(local, res.info)


def _restricted(meta: LogMeta, tensors: Mapping[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    owned = set(_shard_of(meta).owned)
    buffers = set(meta.buffers)
    out = {}
    for n, tag, shape in meta.model:
        if n in owned or n in buffers:
            t = tensors.get(n)
            if t is None or tag_of(t, n) != tag or list(t.shape) != list(shape):
                raise ConfigError(f"the model does not match the log's ({n}: {tag}"
                                  f"{list(shape)})",
                                  reason=Reason.STATE_MISMATCH)
            out[n] = t
    return out


def _zero_order(shards: _Shards, rank: int) -> list[int]:
    return [s for s in range(shards.world) if s != rank] + [rank]


def _restore_zero(shards: _Shards, rank: int, target: int, bases: list[int], job: int,
                  model: torch.nn.Module, zero: Any, scheduler: Any, scaler: Any,
                  verify: bool, progress: ProgressFn | None = None) -> RestoreResult:
    root = shards.root
    local = zero.optim
    tensors = model_entries(model).tensors
    res: RestoreResult | None = None
    for s in _zero_order(shards, rank):   # this rank last: its RNG, buffers, side channel
        meta = shards.metas[s]
        reader = shards.readers[s]
        mdl = _restricted(meta, tensors)
        if s == rank:
            objs = objects_for(model, local, scheduler, scaler)
            groups = [len(g["params"]) for g in local.param_groups]
            if objs.names != list(meta.params) or groups != list(meta.groups) or \
                    L.class_name(local) != meta.optimizer:
                raise ConfigError("the ZeroRedundancyOptimizer's partition of this rank "
                                  "differs from the log's", reason=Reason.STATE_MISMATCH,
                                  path=shard_path(root, s))
        else:
            objs = blank_objects(meta, base_hyper(reader, bases[s], meta), None,
                                 shard_path(root, s), model=tensors)
        objs.model = mdl
        check_chain(reader, bases[s], target)
        out = Replayer(reader, meta, objs, verify=verify,
                        progress=progress if s == rank else None).run(target)
        if s == rank:
            res = out.result
    assert res is not None
    sync_groups(local.param_groups, zero.param_groups)
    hook, notes = _hook_state(shards, rank, bases, target)
    if notes:
        res.exact = False
        res.notes += notes
    _remember(shards, rank, local, res, L.digest_objects(L.params_of(local), local), None,
              hook, job)
    return res


# ---------------------------------------------------------------------- without the model


def replay_state_sharded(path: str | os.PathLike[str], step: int | None = None, *,
                         with_optimizer: bool = False,
                         optimizer_factory: Callable[[list[dict[str, Any]]],
                                                     torch.optim.Optimizer] | None = None,
                         progress: ProgressFn | None = None, verify: bool = True
                         ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """:func:`~lowdiff_store.torch.replay_state` of a sharded checkpoint: the shards are
    merged into one state dict (buffers and RNG-dependent state as rank 0 holds them);
    ``step`` defaults to the newest step durable on every rank."""
    root = os.fspath(path)
    held = [_Shards(root)]
    try:
        infos = [_shard_info(r) for r in held[0].readers]
        target, bases, _job = _plan(infos, step, held[0].layout, root)

        def run(shards: _Shards, at: list[int]) -> tuple[Any, Any, LogMeta]:
            meta = shards.metas[0]
            model = {n: torch.zeros(shape, dtype=DTYPE_OF[tag]) for n, tag, shape in meta.model}
            opt_state: dict[str, Any] | None
            # no replay here sets the process's generators (apply_rng off): the state is
            # returned, the caller's CPU and CUDA generators are its own
            if shards.layout == "fsdp":
                model, opt_state = replay_pieces(
                    Source(root, shards.readers, shards.metas, shards.layout), target,
                    factory=optimizer_factory, progress=progress, verify=verify)
            elif shards.layout == "replicated":
                opt_state = _replay_replicated(shards, target, at[0], model,
                                               optimizer_factory, progress, verify)
            else:
                opt_state = _replay_zero(shards, target, at, model, optimizer_factory,
                                         progress, verify)
            return model, opt_state, meta

        # again on the newer manifests if a compaction deleted a base meanwhile
        model, opt_state, meta = _on_newest_shards(held, target, bases, run)
    finally:
        held[0].close()
    sh = meta.shard
    aliases = (sh.global_aliases if sh is not None and sh.global_aliases is not None
               else meta.aliases)
    order = (sh.global_state_dict if sh is not None and sh.global_state_dict is not None
             else meta.state_dict) or [n for n, _t, _s in meta.model] + list(aliases)
    state = {n: model[aliases.get(n, n)] for n in order}
    return state, (opt_state if with_optimizer else None)


def _replay_replicated(shards: _Shards, target: int, base: int,
                       model: dict[str, torch.Tensor], factory: Any,
                       progress: ProgressFn | None, verify: bool) -> dict[str, Any]:
    meta = shards.metas[0]
    merged = shards.merged_at(0, base)
    objs = blank_objects(meta, base_hyper(merged, base, meta), factory, shards.root,
                         model=model)
    rp = Replayer(merged, meta, objs, verify=verify, progress=progress,
                  shard_owned=shards.owned())
    rp.apply_rng = False
    out = rp.run(target)
    sd = _opt_state(objs, out, shards.root)
    for g in sd["param_groups"]:
        g["param_names"] = [objs.names[i] for i in g["params"]]
    return sd


def _opt_state(objs: Any, out: Any, path: str) -> dict[str, Any]:
    """The optimizer state after a replay: the rebuilt optimizer's (grad mode), or the one
    the replay carried from the base and the records (delta mode, no optimizer)."""
    if objs.optimizer is not None:
        return dict(objs.optimizer.state_dict())
    if out.opt_state is None:
        raise FormatError(f"{path}: the replay of step {out.result.step} holds no optimizer "
                          "state",
                          reason=Reason.BAD_METADATA)
    return dict(out.opt_state)


def _replay_zero(shards: _Shards, target: int, bases: list[int],
                 model: dict[str, torch.Tensor], factory: Any, progress: ProgressFn | None,
                 verify: bool) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    hyper0: list[Any] = []
    for s in _zero_order(shards, 0):   # rank 0 last: its buffers
        meta = shards.metas[s]
        reader = shards.readers[s]
        objs = blank_objects(meta, base_hyper(reader, bases[s], meta), factory,
                             shard_path(shards.root, s), model=model)
        objs.model = _restricted(meta, model)
        check_chain(reader, bases[s], target)
        rp = Replayer(reader, meta, objs, verify=verify, progress=progress)
        rp.apply_rng = False
        out = rp.run(target)
        sd = _opt_state(objs, out, shard_path(shards.root, s))
        for i, n in enumerate(objs.names):
            if i in sd["state"]:
                state[n] = sd["state"][i]
        if s == 0:
            hyper0 = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    sh = _shard_of(shards.metas[0])
    gnames = list(sh.global_params or ())
    pos = {n: i for i, n in enumerate(gnames)}
    groups = []
    start = 0
    for n_in, h in zip(sh.global_groups or (), hyper0, strict=True):
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
    root = os.fspath(path)
    body = read_shards_manifest(root)
    out = describe_one_log(shard_path(root, 0))
    shards = []
    mesh0: dict[str, Any] = {}
    placements: dict[str, Any] = {}
    for r in range(body["world_size"]):
        d = out if r == 0 else describe_one_log(shard_path(root, r))
        with LogReader(shard_path(root, r)) as reader:
            meta = log_meta(reader)
        layout = body.get("layout", "replicated")
        why = shard_mismatch(_placed(meta), r, body["world_size"], layout) \
            if layout == "fsdp" else None
        if why is not None:
            raise ConfigError(why, reason=Reason.BAD_METADATA, path=shard_path(root, r))
        sh = meta.shard
        sizes = {t["name"]: t for t in d["model_tensors"]}
        owned = list(sh.owned) if sh is not None else []
        entry = {"rank": r, "owned_params": len(owned),
                 "owned_elements": sum(int(np.prod(sizes[n]["shape"], dtype=np.int64))
                                       for n in owned if n in sizes),
                 "steps": d["steps"]}
        if layout == "fsdp" and sh is not None and sh.mesh is not None:
            # where this rank sits and the boxes it holds
            entry["mesh_coord"] = list(sh.mesh.coord)
            entry["pieces"] = {n: {"offset": list(p.offset), "shape": list(p.shape)}
                               for n, p in sh.pieces.items()}
            mesh0 = mesh0 or {"shape": list(sh.mesh.shape),
                              "dim_names": list(sh.mesh.dim_names)}
            for n, p in sh.pieces.items():
                placements.setdefault(n, {"placements": [list(x) for x in p.placements],
                                          "global_shape": list(p.global_shape)})
        shards.append(entry)
    durable = [s["steps"]["durable"] for s in shards]
    out = dict(out)
    if body.get("layout") == "fsdp":
        out["mesh"] = {"shape": mesh0.get("shape", []),
                       "dim_names": mesh0.get("dim_names", [])}
        out["placements"] = placements
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
    shards = _Shards(root)
    try:
        meta = shards.metas[rank]
        if meta.mode != "grad":
            raise ConfigError("only grad-mode shards can be materialized",
                              reason=Reason.NOT_ALLOWED)
        comp = meta.compressor
        if comp is not None and comp.error_feedback and comp.ef_state != "step":
            raise ConfigError("compressor residuals are kept only in bases: a base at another "
                              "step cannot be made", reason=Reason.NOT_ALLOWED)
        infos = [_shard_info(x) for x in shards.readers]
        target, bases, _job = _plan(infos, step, shards.layout, root)
        hook, notes = _hook_state(shards, rank, bases, target)
        if notes:
            raise ConfigError(f"rank {rank}: {notes[0]}", reason=Reason.NOT_ALLOWED)
        reader = shards.readers[rank]
        with open_start(reader, reader.start_for(bases[rank]), meta) as bf:
            bmeta = base_torch_meta(bf, meta)
        objs = blank_objects(meta, bmeta.hyper, None, root)
        model, names, params, opt = objs.model, objs.names, objs.params, objs.optimizer
        assert opt is not None
        owned = set(_shard_of(meta).owned)
        if shards.layout == "replicated":
            rp = Replayer(shards.merged_at(rank, bases[0]), meta, objs, verify=True,
                          progress=None, shard_owned=shards.owned())
        else:
            objs.model = _restricted(meta, model)
            rp = Replayer(shards.readers[rank], meta, objs, verify=True, progress=None)
        rp.apply_rng = False  # the RNG states go into the base (_carried), not this process
        out = rp.run(target)
        side = _carried(shards.readers[rank], bases[rank], target, bmeta)
        tensors: dict[str, Any] = {}
        for n, _t, _s in meta.model:
            if n in owned or n in meta.buffers:
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
                        "log": meta.as_written()}}
        return tensors, bm
    finally:
        shards.close()


def _carried(reader: LogReader, base: int, target: int, bmeta: BaseMeta
             ) -> dict[str, Any]:
    """This shard's side-channel values and RNG states after ``target``."""
    sched, scaler, extra = bmeta.sched, bmeta.scaler, bmeta.extra
    rng: dict[str, tuple[str, np.ndarray]] = {}
    first, opened = _first_file(reader, base)
    with opened as bf:
        for n in bf.names:
            if n.startswith(L.RNG):
                rng[n] = ("U8", np.array(bf.tensor(n)))
    for t in range(first + 1, target + 1):
        rec = reader.record(t)
        side = rec.side
        sched = side.get("sched", sched)
        scaler = side.get("scaler", scaler)
        extra = side.get("extra", extra)
        for n in rec.names:
            if n.startswith(L.RNG):
                rng[n] = ("U8", np.array(rec.tensor(n)))
    return {"sched": sched, "scaler": scaler, "extra": extra, "rng": rng}


__all__ = ["describe_sharded", "replay_state_sharded", "restore_sharded", "shard_materializer"]
