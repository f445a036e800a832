"""Local-update training (post-local SGD, QSR, DiLoCo): one complete log per replica.

Between synchronizations the ranks' replicas differ, so the DDP layout (ranks split one
replicated state) cannot hold them. Here each rank logs its own replica under
``path/rank-<r>/`` as a complete log (the gradients its inner optimizer consumed, its
optimizer state, RNG, buffers, side channel) and rank 0 writes ``SHARDS`` with layout
``"local"``; a synchronization is an event of the step it ends (:mod:`.local_update`).

``DiffCheckpointer(path, ddp_model, post_local_sgd_optimizer)`` gets a :class:`LocalLayout`
(:func:`local_layout`, installed with
:func:`~lowdiff_store.torch.capture.layout.set_wrapper_layout`: the capture room sees the
wrapper before unwrapping it) and a :class:`LocalSource` for the synchronization records;
``restore(path, ddp_model, that_optimizer)`` calls :func:`restore_local`. Every rank
restores the newest step durable on **all** ranks from its own shard alone (a shard replays
on its own: the sync events carry the averaged values). Another world size is refused:
the replicas and their optimizer states are each rank's own; :func:`restore_replica`
materializes one rank's replica in any process. See ``docs/local_update.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from ...errors import ConfigError, Reason
from ...log import LogReader
from ...log.latest import latest_step
from ...log.shards import (
    LOCAL_LAYOUT,
    check_member,
    check_world_size,
    is_sharded,
    read_shards_manifest,
    shard_path,
    write_shards_manifest,
)
from ...progress import ProgressFn
from ..capture.bases.initial import InitialBase
from ..capture.grad_capture import GradCapture, HostPool
from ..capture.layout import Layout, Partition, at_job_step, set_wrapper_layout
from ..capture.opening import unpublished_job
from ..capture.options import CheckpointerOptions
from ..capture.sink import manifest_exists
from ..compressors.topk import GradCompressor
from ..core import schema as L
from ..core.registry import RestoreInfo, remember, restored
from ..core.specs import raw_spec
from ..core.tensors import to_bits
from ..replay.engine import Objects, Replayer, log_meta, target_step
from ..replay.restore import check_objects, hand_residuals, objects_for
from ..replay.result import RestoreResult
from .checkpointer import agree, coordination_group, rank_world
from .local_update import (
    COUNTERS,
    LocalUpdate,
    is_local_update,
    local_update_of,
    rank_local_compressor,
)

LAYOUT = LOCAL_LAYOUT
T = TypeVar("T")


def _same_config(logged: Any, mine: Mapping[str, Any]) -> str | None:
    """None if the log's method configuration is this run's, else what differs."""
    if not isinstance(logged, dict):
        return "the log is not a log of local-update training"
    ignore = {"rank", "world_size", "digest_outer"}
    for k in sorted(set(logged) | set(mine)):
        if k in ignore:
            continue
        if logged.get(k) != mine.get(k):
            return f"the log's {k} is {logged.get(k)!r}, this run's {mine.get(k)!r}"
    return None


class LocalLayout(Layout):
    """The layout of one rank of local-update training (made by :func:`local_layout` for
    a ``PostLocalSGDOptimizer`` or a :class:`~.diloco.DiLoCo`; with several ranks, also
    for a plain optimizer with a rank-local compressor such as ``DeMoCompressor``, kind
    ``"replica"``): the rank's complete replica in its own log ``root/rank-<rank>``; the
    wrapper's inner optimizer is hooked. Each step's record holds the inner step's
    gradient and, when the step synchronized, the synchronization event (captured after
    the wrapper's ``step`` returns, so the step's digest and base are of the state after
    the synchronization; :class:`LocalSource`). The log metadata gets a ``"local"``
    section (the method's configuration), which an existing log must match.

    Refused: ``mode="delta"``, a compressor with a local-update optimizer, a ``scaler``,
    ``capture="layerwise"``, ``base_mode="background"``, ``snapshot_every="auto"``, an
    averager the log does not know; each before anything is written (rank 0 writes
    ``SHARDS`` in :meth:`select`, once its checks passed). Collective: every rank creates
    it, in the same order."""

    kind = LAYOUT

    def __init__(self, root: str, model: torch.nn.Module, optimizer: Any,
                 options: CheckpointerOptions, compressor: Any) -> None:
        rank, world = rank_world()
        err: BaseException | None = None
        local: LocalUpdate | None = None
        try:
            local = _at(root, lambda: local_update_of(
                optimizer, model, replica=rank_local_compressor(compressor)))
            _at(root, lambda: _check_options(options, compressor, local.kind == "replica"))
            _check_root(root, world)
            # read before the first agreement: no rank of this open has written yet
            self.unpublished = unpublished_job(root, shard_path(root, rank))
        except Exception as e:
            err = e
        agree(coordination_group() if world > 1 else None, err)
        assert local is not None
        super().__init__(shard_path(root, rank), local.inner)
        self.root, self.rank, self.world = root, rank, world
        #: the method: its configuration, counters, events and state
        self.local = local
        self.source = LocalSource(local, options.grad_zstd)
        self._in_outer = False
        self._deferred: Callable[[], None] | None = None

    def options_for(self, options: CheckpointerOptions,
                    info: RestoreInfo | None) -> CheckpointerOptions:
        """Restored at the job's durable step: this shard's later steps are cut."""
        return at_job_step(options, info)

    def select(self, names: list[str], params: list[torch.Tensor],
               model: dict[str, torch.Tensor], buffers: list[str], groups: list[int],
               meta: dict[str, Any]) -> Partition:
        """Every tensor (the rank's whole replica); the method is bound to the parameters
        and ``meta`` gets the ``"local"`` section, which an existing log must hold too
        (``ConfigError(state_mismatch)`` naming what differs). A ``scaler`` (in ``meta``)
        is refused: its skipped steps go through the wrapper's ``step``."""
        if meta.get("scaler") is not None:
            raise ConfigError("a scaler is not supported with local-update training",
                              reason=Reason.NOT_ALLOWED, path=self.root)
        self.local.bind(names, params)
        logged: Any = None
        if manifest_exists(self.path):
            with LogReader(self.path) as r:
                old = r.meta.get("torch")
            if isinstance(old, dict):  # a torch log: this rank's replica of this job
                check_member(self.path, old, self.rank, self.world, LAYOUT)
            logged = old.get("local") if isinstance(old, dict) else None
        if isinstance(logged, dict):  # continued: the log's digest definition holds
            self.local.follow_log(logged)
        meta["local"] = self.local.log_section(self.rank, self.world)
        if logged is not None:
            why = _same_config(logged, meta["local"])
            if why is not None:
                raise ConfigError(why, reason=Reason.STATE_MISMATCH, path=self.path)
        # the first write, once every check this layout makes has passed: a refusal
        # leaves the directory as it was
        if self.rank == 0 and not is_sharded(self.root):
            write_shards_manifest(self.root, self.world, layout=LAYOUT,
                                  meta={"writer": "torch", "kind": self.local.kind})
        return super().select(names, params, model, buffers, groups, meta)

    def grad_source(self, pool: HostPool, options: CheckpointerOptions,
                    info: RestoreInfo | None) -> LocalSource:
        """The source of the method's records (:class:`LocalSource`)."""
        return self.source

    def agree(self, err: BaseException | None) -> None:
        """Collective: raise on every rank if any rank failed to open its log (the group
        looked up, not kept, as :meth:`RankLayout.agree`)."""
        agree(coordination_group() if self.world > 1 else None, err)

    def attach(self) -> list[Any]:
        """The wrapper's ``step`` patched to bracket the inner step (its handle)."""
        self.source.reset_counters()
        return [self.local.wrap_step(self._before_outer, self._after_outer)]

    def post_step(self, capture: Callable[[], None]) -> None:
        """Inside the wrapper's ``step``: ``capture`` runs once the wrapper returns (after
        its synchronization), with the synchronization's records added."""
        if self._in_outer:
            self._deferred = capture
            return
        capture()

    def _before_outer(self) -> None:
        self._in_outer = True
        self._deferred = None

    def _after_outer(self) -> None:
        self._in_outer = False
        capture, self._deferred = self._deferred, None
        if capture is None:
            return
        self.source.add_sync()
        capture()

    def streamed_why(self) -> str | None:
        """Post-local SGD, QSR and DiLoCo stream their bases (a synchronization applies to
        a parameter only after its slice, the method's state is in the first slice); the
        replicas of a rank-local compressor (DeMo) do not."""
        if self.local.kind == "replica":
            return ("a rank-local compressor's replicas (DeMo) are not streamed: its state is "
                    "not vouched per parameter")
        return None

    def add_stats(self, out: dict[str, float], partition: Partition) -> None:
        """``syncs`` (steps that synchronized), ``sync_bytes`` (bytes of their events),
        ``rank`` and ``world_size``."""
        out.update(self.source.stats)
        out.update({"rank": self.rank, "world_size": self.world})


class LocalSource:
    """The records of a local-update method (a :class:`GradSource` that claims no
    gradient): after a wrapper's step, its synchronization event (``@sync/``,
    ``@outer/``) and the counters tensor when they changed, added to the step's record;
    in a base, the method's state (DiLoCo's global parameters and outer optimizer)."""

    def __init__(self, local: LocalUpdate, zstd: int | None) -> None:
        self.local, self.zstd = local, zstd
        #: ``syncs`` and ``sync_bytes`` so far
        self.stats: dict[str, float] = {"syncs": 0, "sync_bytes": 0}
        self._cap: GradCapture | None = None
        self._prev: list[int] = []

    def reset_counters(self) -> None:
        """The counters as they are now are the log's (no record for them)."""
        self._prev = self.local.counters()

    def claim(self, names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
        """No gradient: the inner optimizer's are copied densely."""
        return None

    def supply(self, cap: GradCapture, side: dict[str, Any]) -> None:
        """Remember the capture of the step about to run (its record gets the event)."""
        self._cap = cap

    def add_sync(self) -> None:
        """After the wrapper's step: the event and changed counters into its record."""
        specs = self.local.sync_specs(self.zstd)
        c = self.local.counters()
        if c != self._prev:
            tag, arr = to_bits(torch.tensor(c, dtype=torch.int64), COUNTERS)
            specs.append(raw_spec(COUNTERS, tag, arr))
            self._prev = c
        if self._cap is not None:
            self._cap.specs.extend(specs)
        self.stats["sync_bytes"] += sum(s.nbytes for s in specs if s.name != COUNTERS)
        self.stats["syncs"] += int(_synced(specs))

    def base_tensors(self) -> dict[str, tuple[str, np.ndarray]]:
        """The method's state, for a base."""
        return self.local.base_tensors()

    def digest(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
               ) -> int:
        """The step digest (:meth:`LocalUpdate.digest`: DiLoCo's outer state included)."""
        return self.local.digest(params, optimizer)

    def digest_tensors(self) -> list[torch.Tensor]:
        """The method's tensors the digest reads beyond the replica's."""
        return self.local.outer_tensors() if self.local.digest_outer else []


def local_layout(path: str, model: torch.nn.Module, optimizer: Any,
                 options: CheckpointerOptions, compressor: Any,
                 initial_base: InitialBase | None = None) -> LocalLayout | None:
    """The layout of a checkpointer of local-update training (collective), or None when
    ``optimizer`` is not a local-update wrapper (nor, with several ranks, a plain
    optimizer with a rank-local compressor)."""
    if not (is_local_update(optimizer)
            or (rank_world()[1] > 1 and rank_local_compressor(compressor))):
        return None
    return LocalLayout(path, model, optimizer, options, compressor)


set_wrapper_layout(local_layout)


def _at(path: str, fn: Callable[[], T]) -> T:
    """``fn()``, its :class:`ConfigError` naming ``path`` if it named no file."""
    try:
        return fn()
    except ConfigError as e:
        if e.path is not None:
            raise
        raise ConfigError(e.detail, reason=e.reason, path=path) from None


def _synced(specs: Sequence[Any]) -> bool:
    """Whether a step's method specs hold a synchronization event."""
    return any(s.name != COUNTERS for s in specs)


def _check_options(options: CheckpointerOptions, compressor: Any, replica: bool) -> None:
    refused = {"mode": ("grad", "mode='delta'"), "capture": ("dense", "capture='layerwise'"),
               "base_mode": ("foreground", "base_mode='background'")}
    for k, (ok, what) in refused.items():
        if getattr(options, k) != ok:
            raise ConfigError(f"{what} is not supported with local-update training",
                              reason=Reason.NOT_ALLOWED)
    if options.snapshot_every == "auto":
        raise ConfigError("snapshot_every='auto' is not supported with local-update "
                          "training (every rank takes its bases at the same steps); pass "
                          "an int", reason=Reason.NOT_ALLOWED)
    if not replica and compressor is not None:
        raise ConfigError("a compressor is not supported with local-update training",
                          reason=Reason.NOT_ALLOWED)


def _check_root(root: str, world: int) -> None:
    if manifest_exists(root):
        raise ConfigError(f"{root} holds an unsharded log: local-update training logs one "
                          f"replica per rank; use another directory",
                          reason=Reason.STATE_MISMATCH, path=root)
    if is_sharded(root):
        body = check_world_size(root, world)
        if body.get("layout") != LAYOUT:
            raise ConfigError(f"{root} was written with layout {body.get('layout')!r} (one "
                              f"replicated state); local-update training logs divergent "
                              f"replicas (layout 'local'): use another directory",
                              reason=Reason.STATE_MISMATCH, path=root)


# ---------------------------------------------------------------------- restore


class LocalReplayer(Replayer):
    """A replica's log replayed with its synchronization events and method state."""

    def __init__(self, reader: Any, meta: Any, objs: Objects,
                 local: LocalUpdate, **kwargs: Any) -> None:
        super().__init__(reader, meta, objs, **kwargs)
        self.local = local
        self.counters: list[int] | None = None

    def _load_base(self, base: Any, bmeta: Any) -> None:
        super()._load_base(base, bmeta)
        self.counters = self.local.load_base(base)

    def after_step(self, t: int, rec: Any, names: Sequence[str]) -> None:
        """Apply step ``t``'s synchronization event and counters (from a streamed base, to
        the parameters live at ``t`` only: :meth:`Replayer.live`)."""
        c = self.local.replay(rec, names, self.objs.model,
                              (lambda n: self.live(n, t)) if self.held else None)
        if c is not None:
            self.counters = c

    def _digest(self, state: Any, layout: Any) -> int:
        """The step digest as the log defines it (DiLoCo's outer state included when
        its ``"local"`` section says ``digest_outer``)."""
        opt = self.objs.optimizer
        assert opt is not None  # grad mode: the only mode of local-update logs
        return self.local.digest(self.objs.params, opt)


def _local_meta(meta: Any, local: LocalUpdate, path: str, rank: int, world: int
                ) -> dict[str, Any]:
    """The log's ``"local"`` section, once the log at ``path`` is rank ``rank`` of this
    ``world``-rank checkpoint (:func:`check_member`) and its method's configuration is
    ``local``'s."""
    logged = meta.raw.get("local")
    if not isinstance(logged, dict):
        raise ConfigError("not a log of local-update training (no 'local' section): restore "
                          "it with the optimizer it was written with",
                          reason=Reason.STATE_MISMATCH, path=path)
    check_member(path, meta.raw, rank, world, LAYOUT)
    why = _same_config(logged, local.config())
    if why is not None:
        raise ConfigError(why, reason=Reason.STATE_MISMATCH, path=path)
    return logged


def restore_replica(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any, *,
                    rank: int, step: int | None = None, scheduler: Any = None,
                    compressor: GradCompressor | None = None, verify: bool = True,
                    progress: ProgressFn | None = None) -> RestoreResult:
    """Put rank ``rank``'s replica at ``step`` (default: that shard's newest durable step)
    into ``model`` and the local-update ``optimizer`` (its inner optimizer, averager or
    outer state and counters): bitwise the state rank ``rank`` had. Reads only that
    shard; no collective (any process, any world size). A checkpointer cannot continue
    the log from it in a job of another world size (use a new directory)."""
    root = os.fspath(path)
    local = _at(root, lambda: local_update_of(optimizer, model, replica=True))
    if not is_sharded(root) or read_shards_manifest(root).get("layout") != LAYOUT:
        raise ConfigError(f"{root} is not a checkpoint of local-update training (no SHARDS "
                          f"file of layout 'local')", reason=Reason.STATE_MISMATCH, path=root)
    world = int(read_shards_manifest(root)["world_size"])
    if type(rank) is not int or not 0 <= rank < world:
        raise ConfigError(f"rank={rank!r}: the checkpoint has ranks 0..{world - 1}",
                          path=root)
    shard = shard_path(root, rank)
    inner = local.inner
    with LogReader(shard, mode="private") as reader:
        meta = log_meta(reader)
        local.follow_log(_local_meta(meta, local, shard, rank, world))
        target = target_step(reader, step)
        objs = objects_for(model, inner, scheduler, None)
        check_objects(meta, objs, shard)
        local.bind(objs.names, objs.params)
        rp = LocalReplayer(reader, meta, objs, local, verify=verify, progress=progress)
        out = rp.run(target)
        log_id = reader.log_id
    res = out.result
    residuals = hand_residuals(out, objs, compressor)
    if rp.counters is None:
        raise ConfigError(f"no method counters up to step {target}", path=shard,
                          reason=Reason.STATE_MISMATCH)
    notes = local.set_counters(rp.counters)
    if notes:
        res.notes += notes
        res.exact = False
    # what a checkpointer created next compares: the replica's digest alone
    digest = out.live_digest if out.live_digest is not None and not local.digest_outer \
        else L.digest_objects(objs.params, inner)
    remember(inner, RestoreInfo(os.path.realpath(shard), log_id, res.step, digest, res.exact,
                                residuals, list(res.notes)))
    return res


def restore_local(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any, *,
                  scheduler: Any = None, step: int | None = None,
                  compressor: GradCompressor | None = None, verify: bool = True,
                  progress: ProgressFn | None = None) -> RestoreResult:
    """:func:`~lowdiff_store.torch.restore` of local-update training, collectively: every
    rank restores its own replica at the newest step durable on **all** ranks (or
    ``step``); a checkpointer created next cuts steps some shards hold past it."""
    rank, world = rank_world()
    root = os.fspath(path)
    group = coordination_group() if world > 1 else None
    res: RestoreResult | None = None
    err: BaseException | None = None
    try:
        if not is_sharded(root):
            raise ConfigError(f"{root} holds no checkpoint of local-update training (no "
                              f"SHARDS file)", reason=Reason.NOT_A_LOG, path=root)
        body = read_shards_manifest(root)
        if body.get("layout") != LAYOUT:
            raise ConfigError(f"{root} was written with layout {body.get('layout')!r} (one "
                              f"replicated state), not by local-update training",
                              reason=Reason.STATE_MISMATCH, path=root)
        if int(body["world_size"]) != world:
            raise ConfigError(
                f"{root} holds {body['world_size']} divergent replicas; this job has {world} "
                f"ranks: each replica and its optimizer state is one rank's own, so no other "
                f"world size restores them exactly (restore at {body['world_size']} ranks, or "
                f"materialize one replica with restore_replica(..., rank=r))",
                reason=Reason.WORLD_SIZE_MISMATCH, path=root)
        job = latest_step(root) if step is None else step
        if job is None:
            raise ConfigError(f"{root}: no step is durable on every rank",
                              reason=Reason.NO_BASE, path=root)
        res = restore_replica(root, model, optimizer, rank=rank, step=job,
                              scheduler=scheduler, compressor=compressor, verify=verify,
                              progress=progress)
        info = restored(local_update_of(optimizer, model, replica=True).inner)
        if step is None and info is not None:  # a checkpointer next cuts later steps
            info.job_step = job
    except Exception as e:
        err = e
    agree(group, err)
    assert res is not None
    return res


def restore_replicas_resharded(path: str | os.PathLike[str], model: torch.nn.Module,
                               optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                               step: int | None = None, compressor: GradCompressor | None = None,
                               verify: bool = True, progress: ProgressFn | None = None
                               ) -> RestoreResult:
    """A checkpoint of replicas kept equal (kind ``"replica"``: FlexDeMo) restored at
    another world size or into FSDP2 parameters: the parameters, optimizer state and
    scheduler are every rank's, so rank 0's log is restored through the resharding
    engine (bitwise, cut to each rank's FSDP2 box); the compressor's momenta are each
    rank's own and have no counterpart in another partition of ranks: rank 0's go to the
    compressor (none into FSDP2), ``exact`` is False and ``notes`` say so. The step is
    ``step`` or the newest durable on every rank. Collective when the job has several
    ranks."""
    from .restore import restore_sharded

    root = os.fspath(path)
    target = latest_step(root) if step is None else step
    if target is None:
        raise ConfigError(f"{root}: no step is durable on every rank", reason=Reason.NO_BASE,
                          path=root)
    shard = shard_path(root, 0)
    if rank_world()[1] > 1:
        res = restore_sharded(shard, model, optimizer, scheduler=scheduler, step=target,
                              compressor=compressor, verify=verify, progress=progress)
    else:
        from ..replay.restore import restore_log

        res = restore_log(shard, model, optimizer, scheduler=scheduler, step=target,
                          compressor=compressor, verify=verify, progress=progress)
    world = read_shards_manifest(root)["world_size"]
    res.exact = False
    res.notes.append(
        f"{root} holds {world} replicas whose compressor momenta are each rank's own "
        f"(DeMo); restored at another world size or into FSDP2, parameters, optimizer "
        f"state and scheduler are exact (rank 0's log) but the momenta are not carried "
        f"(rank 0's are given to a compressor, if any; an FSDP2 job takes none)")
    return res


__all__ = ["LAYOUT", "LocalLayout", "LocalReplayer", "LocalSource", "local_layout", "restore_local",
           "restore_replica", "restore_replicas_resharded"]
