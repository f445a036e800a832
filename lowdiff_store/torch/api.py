"""The front of the torch layer: the one module that decides whether a path is a single log
or a sharded checkpoint (one log per rank), and routes every entry point accordingly (the
checkpointer asks :func:`~lowdiff_store.torch.capture.layout.layout_for` for its layout).

Single logs are handled in :mod:`~lowdiff_store.torch.replay.restore` and
:mod:`~lowdiff_store.torch.replay.describe`; sharded checkpoints in
:mod:`~lowdiff_store.torch.distributed.restore` and
:mod:`~lowdiff_store.torch.distributed.checkpointer`. Neither
side imports this module or the other side's front: they share the replay engine below them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, overload

import torch

from ..errors import ConfigError, Reason
from ..log import LogReader
from ..log.latest import latest_step
from ..log.shards import is_sharded, read_shards_manifest, replay_source
from ..progress import ProgressFn
from ..storage.orphans import wait_for_orphaned_writer
from ..torchmeta.checks import Ctx
from ..torchmeta.numerics import CBWR_NAMES, parse_runs, vml_name
from .capture.stateful import load_stateful
from .compressors.topk import GradCompressor
from .core import schema as L
from .core.numerics import mkl_vml_branch, pin_mkl
from .core.optimizers import unwrap_optimizer
from .distributed.checkpointer import rank_world
from .distributed.fsdp import has_dtensor
from .distributed.local_offline import local_world, replica_materializer, replica_state
from .distributed.local_sgd import LAYOUT as LOCAL_LAYOUT
from .distributed.local_sgd import (
    restore_local,
    restore_replica,
    restore_replicas_resharded,
)
from .distributed.local_update import is_local_update
from .distributed.restore import (
    describe_sharded,
    replay_state_sharded,
    restore_sharded,
    shard_materializer,
)
from .replay.describe import describe_one_log
from .replay.materialize import BaseTensors, materialize_base
from .replay.restore import RestoreResult, replay_log_state, restore_log


@overload
def restore(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any, *,
            scheduler: Any = ..., scaler: Any = ..., step: int | None = ...,
            compressor: GradCompressor | None = ..., verify: bool = ...,
            extra_state: Mapping[str, Any] | None = ..., missing_ok: Literal[False] = ...,
            progress: ProgressFn | None = ...) -> RestoreResult: ...


@overload
def restore(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any, *,
            scheduler: Any = ..., scaler: Any = ..., step: int | None = ...,
            compressor: GradCompressor | None = ..., verify: bool = ...,
            extra_state: Mapping[str, Any] | None = ..., missing_ok: bool,
            progress: ProgressFn | None = ...) -> RestoreResult | None: ...


def restore(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any, *,
            scheduler: Any = None, scaler: Any = None, step: int | None = None,
            compressor: GradCompressor | None = None, verify: bool = True,
            extra_state: Mapping[str, Any] | None = None, missing_ok: bool = False,
            progress: ProgressFn | None = None) -> RestoreResult | None:
    """Put the state of ``step`` (default: the newest durable step) into the objects.

    Loads the nearest base at or before ``step`` and replays the diffs after it through
    ``optimizer`` itself (grad mode) or applies them (delta mode). Parameters, buffers,
    optimizer state, scheduler, scaler and RNG states are set bit for bit; gradients are
    left as None. Every recorded digest on the way is checked (``verify``); a mismatch
    raises ``ReplayError(replay_diverged)`` naming the step. The log is only read; a
    :class:`DiffCheckpointer` created next on the same objects continues it from ``step``.
    A sharded checkpoint (or a job of several ranks) is restored collectively: every rank
    calls this.

    ``optimizer`` may be a trainer's wrapper (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``): the optimizer inside is used. ``extra_state``: the
    dict of stateful objects given to the checkpointer; each gets ``load_state_dict`` of
    its recorded state. ``missing_ok=True``: a missing or empty directory, or a log with
    no base yet, returns None instead of raising, so a script needs no existence check.
    ``progress``: called as ``(done, total)`` as the restore goes: after each replayed
    step of a log (or of this rank's own shard), or each shard, for a resharded restore.

    Error-feedback residuals of a compressor go to ``compressor`` if given, otherwise to
    the next compressor attached to ``optimizer`` (a checkpointer's included). They are
    exact when ``step`` is a base or the log was written with ``ef_state="step"``;
    otherwise see ``RestoreResult.exact`` and docs/torch.md.

    A sharded checkpoint (one log per rank) restores in a job of any world size and layout
    (FSDP2, DDP, a plain model): each rank replays the shards holding the pieces it needs
    and assembles them, bitwise (:mod:`~lowdiff_store.torch.distributed.reshard`,
    ``docs/distributed.md``); a single log restores into a job of several ranks the same
    way. ``path`` is the checkpoint's directory: one of its rank directories
    (``PATH/rank-0000r``) restores replica r of a local-update checkpoint
    (:func:`restore_replica` at the newest step durable on every rank) and is
    ``ConfigError(invalid_argument)`` naming ``PATH`` for the layouts whose ranks split one
    state (DDP, ZeRO, FSDP2: :func:`~lowdiff_store.log.shards.replay_source`).
    """
    wait_for_orphaned_writer(os.fspath(path))  # (its trainer died: it finishes the log)
    p, replica = replay_source(path)
    if missing_ok and step is None and latest_step(p) is None:
        return None
    res = _restore_replicas(p, replica, model, optimizer, scheduler=scheduler, step=step,
                            compressor=compressor, verify=verify, progress=progress)
    if res is None:
        _refuse_local(p)
        optimizer = unwrap_optimizer(optimizer)
        if is_sharded(p) or rank_world()[1] > 1:  # a sharded checkpoint, or many ranks
            res = restore_sharded(p, model, optimizer, scheduler=scheduler, scaler=scaler,
                                  step=step, compressor=compressor, verify=verify,
                                  progress=progress)
        else:
            res = restore_log(p, model, optimizer, scheduler=scheduler, scaler=scaler,
                              step=step, compressor=compressor, verify=verify,
                              progress=progress)
    if extra_state is not None:
        res.notes += load_stateful(extra_state, res.extra)
    return res


def _restore_replicas(path: str, replica: int | None, model: torch.nn.Module,
                      optimizer: Any, **kw: Any) -> RestoreResult | None:
    """Restore a checkpoint with one log per replica (local-update training; FlexDeMo's
    replicas, also at another world size or into FSDP2), or its replica ``replica`` alone
    (given as its rank directory: at the newest step durable on every rank, as the
    checkpoint restores); None for any other."""
    if replica is not None:
        step = latest_step(path) if kw["step"] is None else kw["step"]
        return restore_replica(path, model, optimizer, rank=replica, **{**kw, "step": step})
    if _replicas(path) and _elsewhere(path, optimizer):
        return restore_replicas_resharded(path, model, optimizer, **kw)
    if is_local_update(optimizer) or _replicas(path):
        return restore_local(path, model, optimizer, **kw)
    return None


def _replicas(path: str) -> bool:
    """A checkpoint of replicas kept equal by a rank-local exchange (FlexDeMo): restored
    with the plain optimizer and its compressor."""
    if not is_sharded(path):
        return False
    body = read_shards_manifest(path)
    return bool(body.get("layout") == LOCAL_LAYOUT and body["meta"].get("kind") == "replica")


def _elsewhere(path: str, optimizer: Any) -> bool:
    """A replica checkpoint restored at another world size or into DTensor parameters."""
    return bool(read_shards_manifest(path)["world_size"] != rank_world()[1]
                or has_dtensor(L.params_of(optimizer)))


def _refuse_local(path: str) -> None:
    """A checkpoint of divergent replicas opened as one replicated state: refused."""
    if is_sharded(path) and read_shards_manifest(path).get("layout") == LOCAL_LAYOUT:
        raise ConfigError(
            f"{path} holds divergent replicas of local-update training (layout 'local'): "
            f"restore it with the PostLocalSGDOptimizer / DiLoCo it was written with, or "
            f"one replica with restore_replica(path, model, optimizer, rank=r) or "
            f"replay_state(path, rank=r)", reason=Reason.STATE_MISMATCH, path=path)


def replay_state(path: str | os.PathLike[str], step: int | None = None, *,
                 with_optimizer: bool = False,
                 optimizer_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
                 | None = None, progress: ProgressFn | None = None, verify: bool = True,
                 rank: int | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Reconstruct the state at ``step`` (default: newest durable) without the user's model.

    Returns ``(model_state, optimizer_state)``: ``model_state`` maps every
    ``model.state_dict()`` name (``module.`` removed, tied names included) to a CPU tensor;
    ``optimizer_state`` is an ``optimizer.state_dict()``-shaped dict when
    ``with_optimizer`` (else None).

    Grad-mode logs need an optimizer to replay: it is rebuilt from the recorded class name
    only if that is one of :data:`ALLOWED_OPTIMIZERS` (torch.optim classes), with the
    recorded hyperparameters; any other class needs ``optimizer_factory(param_groups)``,
    which receives the param groups (``params`` plus recorded hyperparameters) and returns
    the optimizer. ``progress(done, total)`` is called after each replayed diff.

    A checkpoint of local-update training (divergent replicas) needs ``rank``: replica
    ``rank``'s state, replayed from its own shard (the inner optimizer's state with
    ``with_optimizer``; ``step`` defaults to the newest durable on every rank); ``rank``
    with any other log is ``ConfigError(invalid_argument)``. Its rank directory
    (``PATH/rank-0000r``) is the same as ``rank=r``; a rank directory of a checkpoint whose
    ranks split one state (DDP, ZeRO, FSDP2) is ``ConfigError(invalid_argument)`` naming
    the checkpoint directory to replay instead.
    """
    p, rank = replay_source(path, rank)
    if rank is not None:  # checked: a rank of a local-update checkpoint
        return replica_state(p, step, rank=rank, with_optimizer=with_optimizer,
                             progress=progress, verify=verify)
    _refuse_local(p)
    if is_sharded(p):  # one log per rank: merged into one state
        return replay_state_sharded(p, step, with_optimizer=with_optimizer,
                                    optimizer_factory=optimizer_factory, progress=progress,
                                    verify=verify)
    return replay_log_state(p, step, with_optimizer=with_optimizer,
                            optimizer_factory=optimizer_factory, progress=progress,
                            verify=verify)


def describe_log(path: str | os.PathLike[str]) -> dict[str, Any]:
    """JSON-friendly torch metadata of the log at ``path``: mode, optimizer class, model
    tensors (name, dtype, shape), parameter groups, codecs, compressor, scheduler/scaler,
    intervals, and the step range (for a sharded checkpoint: rank 0's metadata plus
    ``sharded``, ``world_size``, ``layout`` and per shard its owned parameters and steps)."""
    p = os.fspath(path)
    return describe_sharded(p) if is_sharded(p) else describe_one_log(p)


def pin_numerics(path: str | os.PathLike[str]) -> str:
    """Pin this process's MKL branch to the one the log at ``path`` was trained under, for
    a program that runs MKL (a CPU matrix product, a float ``sqrt``) before it restores:
    :func:`restore` and :func:`replay_state` pin by themselves where it is still possible.
    Returns the branch's name, or why nothing was needed.

    It matters only for a log whose replay reaches MKL (AdamW's single-tensor or foreach
    step, a DeMo compressor: ``describe_log(path)["numerics"][i]["mkl_use"]``), trained on
    this CPU's vendor under another branch (``MKL_CBWR``). A branch's bits belong to its
    vendor: no setting on an Intel CPU gives an AMD log's bits, nor the reverse, and that is
    refused (``ConfigError(numerics_mismatch)``), as is a branch MKL can no longer take
    in this process (it already ran) or cannot run on this CPU."""
    from .core.numerics import cpu_vendor

    p = os.fspath(path)
    runs = [r.numerics for r in parse_runs(Ctx(p, None, "meta.torch"),
                                           describe_log(p).get("numerics"))
            if r.numerics.device == "cpu" and r.numerics.mkl_vml is not None
            and r.numerics.mkl_use is not None]
    if not runs:
        return "none needed (the log's replay reaches no MKL op)"
    vendor = cpu_vendor()
    theirs = {n.vendor for n in runs} - {None}
    if vendor is not None and theirs - {vendor}:
        raise ConfigError(f"the log was trained on {'/'.join(sorted(str(v) for v in theirs))} "
                          f"CPUs and its replay reaches MKL, whose bits no MKL setting on "
                          f"this {vendor} CPU reproduces: restore on such a CPU",
                          reason=Reason.NUMERICS_MISMATCH, path=p)
    branches = {n.mkl_vml for n in runs if n.mkl_vml is not None}
    if len(branches) > 1:
        raise ConfigError(f"the log's runs were trained under MKL branches "
                          f"{sorted(vml_name(b) for b in branches)}: one process runs one",
                          reason=Reason.NUMERICS_MISMATCH, path=p)
    (branch,) = branches
    if not pin_mkl(branch):
        here = mkl_vml_branch()
        runs_now = "no branch (torch has no MKL)" if here is None else vml_name(here)
        setting = CBWR_NAMES.get(branch)
        why = (f"MKL already ran here: start the process with MKL_CBWR={setting}"
               if setting and here is not None else "this CPU cannot run it")
        raise ConfigError(f"MKL cannot run its {vml_name(branch)} branch in this process "
                          f"(it runs {runs_now}): {why}", reason=Reason.NUMERICS_MISMATCH,
                          path=p)
    return vml_name(branch)


class TorchMaterializer:
    """Compaction's base materializer for logs written by this layer (see
    :func:`lowdiff_store.compaction.compact`): called as ``(reader, step, progress=...)``
    for one log (:func:`materialize_base`), and ``for_rank(r)`` gives the materializer of
    rank ``r``'s shard of a sharded checkpoint."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def __call__(self, reader: LogReader, step: int, *, progress: ProgressFn | None = None
                 ) -> tuple[BaseTensors, dict[str, Any]]:
        return materialize_base(reader, step, progress=progress)

    def for_rank(self, rank: int) -> Callable[[Any, int], Any]:
        """The materializer of rank ``rank``'s shard (of a local-update checkpoint: from
        that replica's shard alone)."""
        factory = replica_materializer if local_world(self.path) is not None \
            else shard_materializer
        mat: Callable[[Any, int], Any] = factory(self.path)(rank)
        return mat


__all__ = ["TorchMaterializer", "describe_log", "pin_numerics", "replay_state", "restore"]
