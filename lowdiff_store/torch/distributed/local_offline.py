"""Checkpoints of local-update training without the training objects: one replica rebuilt
from its own shard (``lowdiff-store replay --rank R``, ``replay_state(path, rank=R)``) and
the base of one rank's shard made for compaction (``lowdiff-store compact``).

Each rank's log is the complete history of its own replica and a synchronization is an
event of its records (:mod:`.local_update`), so a shard replays alone: into blank objects
(the log's model tensors on the CPU, the inner optimizer rebuilt from the allow-list with
the base's hyperparameters) and the method rebuilt from the log's ``"local"`` section
(:func:`offline_update`: DiLoCo's outer SGD with the logged hyperparameters; post-local
SGD needs no averager, its events carry the averaged parameters). A base made here holds
what that rank's checkpointer writes at the same step: model, inner optimizer state, RNG,
residuals, the counters and, for DiLoCo, the global parameters and outer momentum.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError, FormatError, Reason
from ...log import LogReader
from ...log.reader import with_reader
from ...log.shards import check_member, is_sharded, read_shards_manifest, shard_path
from ...progress import ProgressFn
from ...torchmeta import LogMeta
from ..replay.engine import Objects, Outcome, base_hyper, log_meta, recorded, target_step
from ..replay.materialize import BaseTensors, base_meta, live_base_arrays
from ..replay.restore import blank_objects
from .diloco import DiLoCo
from .local_sgd import LAYOUT, LocalReplayer
from .local_update import DiLoCoUpdate, LocalUpdate, Logged, Replica


def local_world(path: str | os.PathLike[str]) -> int | None:
    """The number of replicas of the local-update checkpoint at ``path`` (its ``SHARDS``
    says layout ``"local"``), or None for any other log or checkpoint."""
    p = os.fspath(path)
    if not is_sharded(p):
        return None
    body = read_shards_manifest(p)
    return int(body["world_size"]) if body.get("layout") == LAYOUT else None


def check_rank(path: str | os.PathLike[str], rank: object) -> int:
    """The world size of the local-update checkpoint at ``path``, once ``rank`` is one of
    its ranks (``ConfigError(invalid_argument)`` otherwise, or when ``path`` is not one)."""
    p = os.fspath(path)
    world = local_world(p)
    if world is None:
        raise ConfigError(f"{p} is not a checkpoint of local-update training (no SHARDS of "
                          f"layout 'local'): a rank applies to those only, whose ranks hold "
                          f"divergent replicas", reason=Reason.INVALID_ARGUMENT, path=p)
    if type(rank) is not int or not 0 <= rank < world:
        raise ConfigError(f"rank {rank!r} is not a rank of this checkpoint (0..{world - 1})",
                          reason=Reason.INVALID_ARGUMENT, path=p)
    return world


def _number(logged: Mapping[str, Any], key: str, path: str) -> float:
    v = logged.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < 0:
        raise FormatError(f"the log's local section has {key}={v!r}, not a finite number "
                          f">= 0", reason=Reason.BAD_METADATA, path=path)
    return float(v)


def offline_update(logged: Mapping[str, Any], inner: torch.optim.Optimizer, path: str
                   ) -> LocalUpdate:
    """The method of a log's ``"local"`` section ``logged``, over the blank ``inner``
    optimizer of an offline replay; a section this build cannot replay is
    ``FormatError(bad_metadata)`` naming ``path``."""
    kind = logged.get("kind")
    method: LocalUpdate
    if kind == "diloco":
        if logged.get("outer") != "torch.optim.SGD" or logged.get("nesterov") is not True:
            raise FormatError(f"the log's DiLoCo outer optimizer {logged.get('outer')!r} "
                              f"(nesterov={logged.get('nesterov')!r}) is not the SGD with "
                              f"Nesterov momentum DiLoCo logs", reason=Reason.BAD_METADATA,
                              path=path)
        lr, mom = _number(logged, "outer_lr", path), _number(logged, "outer_momentum", path)
        with recorded("the outer optimizer", path):
            method = DiLoCoUpdate(DiLoCo(inner, outer_lr=lr, outer_momentum=mom, period=1))
    elif kind == "post_local_sgd":
        method = Logged(inner, logged)
    elif kind == "replica":
        method = Replica(inner)
    else:
        raise FormatError(f"unknown local-update method {kind!r} in the log's local section",
                          reason=Reason.BAD_METADATA, path=path)
    method.follow_log(logged)
    return method


def _local_section(meta: LogMeta, rank: int, world: int, path: str) -> Mapping[str, Any]:
    """The log's ``"local"`` section, once the log at ``path`` is rank ``rank`` of this
    ``world``-rank checkpoint (:func:`~lowdiff_store.log.shards.check_member`)."""
    check_member(path, meta.raw, rank, world, LAYOUT)
    if meta.mode != "grad":
        raise FormatError(f"a local-update log in mode {meta.mode!r} (only 'grad' is written)",
                          reason=Reason.BAD_METADATA, path=path)
    logged: Mapping[str, Any] = meta.raw["local"]  # check_member: the section is there
    return logged


def replay_replica(reader: LogReader, step: int | None, *, rank: int, world: int,
                   verify: bool = True, progress: ProgressFn | None = None
                   ) -> tuple[Outcome, LogMeta, Objects, LocalUpdate]:
    """Replay rank ``rank``'s shard (``reader``) of a ``world``-rank local-update
    checkpoint to ``step`` (None: the shard's newest durable step) into blank objects;
    the process's RNG is not changed. Returns the outcome, the log metadata, the objects
    and the method holding the replayed counters and outer state."""
    meta = log_meta(reader)
    logged = _local_section(meta, rank, world, reader.path)
    target = target_step(reader, step)
    hyper = base_hyper(reader, target, meta)  # checks shapes against the base first
    objs = blank_objects(meta, hyper, None, reader.path)
    assert objs.optimizer is not None  # grad mode
    local = offline_update(logged, objs.optimizer, reader.path)
    local.bind(objs.names, objs.params)
    rp = LocalReplayer(reader, meta, objs, local, verify=verify, progress=progress)
    rp.apply_rng = False  # the replica's RNG goes into a base, not into this process
    out = rp.run(target)
    if rp.counters is None:
        raise FormatError(f"no method counters (@local/counters) up to step {target}",
                          reason=Reason.BAD_METADATA, path=reader.path)
    local.set_counters(rp.counters)
    return out, meta, objs, local


def replica_state(path: str | os.PathLike[str], step: int | None = None, *, rank: int,
                  with_optimizer: bool = False, progress: ProgressFn | None = None,
                  verify: bool = True
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """:func:`~lowdiff_store.torch.replay_state` of replica ``rank`` of a local-update
    checkpoint: its model state (``state_dict`` names) and, with ``with_optimizer``, its
    inner optimizer's ``state_dict`` (``param_names`` per group), at ``step`` (default:
    the newest step durable on every rank; any step that shard holds may be asked)."""
    from ...log.latest import latest_step

    root = os.fspath(path)
    world = check_rank(root, rank)
    if step is None:
        step = latest_step(root)
        if step is None:
            raise ConfigError(f"{root}: no step is durable on every rank",
                              reason=Reason.NO_BASE, path=root)

    def replay(reader: LogReader) -> tuple[Outcome, LogMeta, Objects, LocalUpdate]:
        return replay_replica(reader, step, rank=rank, world=world, verify=verify,
                              progress=progress)

    _out, meta, objs, _local = with_reader(shard_path(root, rank), replay, mode="private")
    order = meta.state_dict or [n for n, _t, _s in meta.model] + list(meta.aliases)
    state = {n: objs.model[meta.aliases.get(n, n)] for n in order}
    if not with_optimizer:
        return state, None
    assert objs.optimizer is not None
    opt_state = objs.optimizer.state_dict()
    for g in opt_state["param_groups"]:  # torch's convention for naming group params
        g["param_names"] = [objs.names[i] for i in g["params"]]
    return state, opt_state


def materialize_replica(reader: LogReader, step: int, *, rank: int, world: int,
                        progress: ProgressFn | None = None
                        ) -> tuple[BaseTensors, dict[str, Any]]:
    """The base of ``step`` of rank ``rank``'s shard (``reader``), rebuilt from it alone:
    what that rank's checkpointer writes at ``step`` (its digests checked on the way)."""
    out, meta, objs, local = replay_replica(reader, step, rank=rank, world=world,
                                            progress=progress)
    fin = out.final
    assert fin is not None
    assert objs.optimizer is not None
    rng = {n: np.array(a, dtype=np.uint8) for n, a in fin.rng.items()}
    # the replica is private to this call: its tensors are written as they are
    tensors, layout = live_base_arrays(objs.model, objs.names, objs.params, objs.optimizer,
                                       out.residuals or {}, rng, copy=False)
    tensors.update(local.base_tensors())
    bm = base_meta(out.result.step, hyper=fin.hyper, sched=fin.sched, scaler=fin.scaler,
                   extra=fin.extra, opt=layout, log=meta.as_written(),
                   ef_approx=not out.result.exact)
    return tensors, bm


def replica_materializer(root: str | os.PathLike[str]) -> Callable[[int], Any]:
    """For compaction: ``for_rank(r)`` gives the materializer ``(reader, step, progress=)``
    of rank ``r``'s shard of the local-update checkpoint at ``root``
    (:func:`materialize_replica`)."""
    world = check_rank(root, 0)

    def for_rank(rank: int) -> Callable[..., tuple[BaseTensors, dict[str, Any]]]:
        check_rank(root, rank)

        def materialize(reader: LogReader, step: int, *, progress: ProgressFn | None = None
                        ) -> tuple[BaseTensors, dict[str, Any]]:
            return materialize_replica(reader, step, rank=rank, world=world,
                                       progress=progress)
        return materialize
    return for_rank


__all__ = ["check_rank", "local_world", "materialize_replica", "offline_update",
           "replay_replica", "replica_materializer", "replica_state"]
