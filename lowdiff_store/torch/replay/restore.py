"""Restore and replay of one (unsharded) log: open it, check the live objects against it (or
build blank ones from its metadata), and hand both to the engine
(:class:`~lowdiff_store.torch.replay.engine.Replayer`).

:func:`restore_log` puts the state at a step into the caller's model, optimizer, scheduler
and scaler; :func:`replay_log_state` rebuilds it without them (a zeroed model and, in grad
mode, an optimizer rebuilt from an allow-list or a factory). Sharded checkpoints are in
:mod:`lowdiff_store.torch.distributed.restore`, which uses the helpers here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...errors import ConfigError, Reason
from ...log import LogReader
from ...log.reader import with_reader
from ...log.shards import SPLIT_LAYOUTS, split_share
from ...progress import ProgressFn
from ...torchmeta import LogMeta
from ..compressors.topk import GradCompressor
from ..core import schema as L
from ..core.registry import RestoreInfo, remember
from ..core.tensors import DTYPE_OF, model_entries, tag_of
from ..core.typed_msgpack import unpack
from .engine import (
    Objects,
    Outcome,
    Replayer,
    base_hyper,
    log_meta,
    recorded,
    target_step,
)
from .result import RestoreResult

#: builds the optimizer of a replay from its param groups (``optimizer_factory``)
OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


# ---------------------------------------------------------------------- live objects


def check_objects(meta: LogMeta, objs: Objects, path: str) -> None:
    """The live objects are those the log was written with: model tensors (names, dtypes,
    shapes), the optimizer's parameters, class and param groups, the scheduler's and the
    scaler's classes (ConfigError(state_mismatch) naming what differs)."""
    want = [[n, t, list(s)] for n, t, s in meta.model]
    have = [[n, tag_of(t, n), list(t.shape)] for n, t in objs.model.items()]
    if want != have:
        diff = next((f"{w} vs {h}" for w, h in zip(want, have, strict=False) if w != h),
                    f"{len(want)} tensors vs {len(have)}")
        raise ConfigError(f"the model does not match the log's ({diff})",
                          reason=Reason.STATE_MISMATCH, path=path)
    if objs.names != list(meta.params):
        raise ConfigError("the optimizer's parameters (order or names) differ from the log's",
                          reason=Reason.STATE_MISMATCH, path=path)
    opt = objs.optimizer
    if opt is not None:
        if L.class_name(opt) != meta.optimizer:
            raise ConfigError(f"the log was written with {meta.optimizer}, the optimizer "
                              f"is {L.class_name(opt)}", reason=Reason.STATE_MISMATCH,
                              path=path)
        if [len(g["params"]) for g in opt.param_groups] != list(meta.groups):
            raise ConfigError("the optimizer's param groups differ from the log's",
                              reason=Reason.STATE_MISMATCH, path=path)
    check_classes(meta, objs.scheduler, objs.scaler, path)


def check_classes(meta: LogMeta, scheduler: Any, scaler: Any, path: str) -> None:
    """The scheduler and the GradScaler are of the classes the log was written with (or
    subclasses of them): their state means something else in another class. A log that
    recorded no class name (a scaler recorded as a bool, by earlier versions) is not
    checked."""
    for what, obj, recorded_cls in (("scheduler", scheduler, meta.scheduler),
                                    ("GradScaler", scaler, meta.scaler)):
        if obj is None or not isinstance(recorded_cls, str):
            continue
        if recorded_cls not in {f"{c.__module__}.{c.__qualname__}"
                                for c in type(obj).__mro__}:
            raise ConfigError(f"the log was written with the {what} {recorded_cls}, the "
                              f"{what} is {L.class_name(obj)}", reason=Reason.STATE_MISMATCH,
                              path=path)


def objects_for(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                scaler: Any) -> Objects:
    """Names of live objects, as the checkpointer records them."""
    tensors, _aliases, buffers, _order = model_entries(model)
    names, params = optimizer_names(tensors, buffers, optimizer)
    return Objects(names, params, tensors, optimizer, scheduler, scaler)


def optimizer_names(tensors: Mapping[str, torch.Tensor], buffers: list[str],
                    optimizer: torch.optim.Optimizer) -> tuple[list[str], list[torch.Tensor]]:
    """The model name of every parameter of ``optimizer``, in its order."""
    by_id = {id(t): n for n, t in tensors.items() if n not in buffers}
    params = L.params_of(optimizer)
    try:
        names = [by_id[id(p)] for p in params]
    except KeyError:
        raise ConfigError("the optimizer holds a parameter that is not in the model",
                          reason=Reason.STATE_MISMATCH) from None
    return names, params


# ---------------------------------------------------------------------- blank objects


def build_optimizer(meta: LogMeta, params: list[torch.Tensor], hyper: Sequence[Any],
                    factory: OptimizerFactory | None, path: str) -> torch.optim.Optimizer:
    """An optimizer over ``params`` (optimizer order) with the log's param groups and the
    packed hyperparameters ``hyper``: ``factory(groups)``, or the allow-listed class the
    log names (ConfigError(not_allowed) for another)."""
    groups: list[dict[str, Any]] = []
    start = 0
    for n, h in zip(meta.groups, hyper, strict=True):
        g = unpack(h)
        g["params"] = params[start:start + n]
        start += n
        groups.append(g)
    if factory is not None:
        return factory(groups)
    cls = L.allowed_optimizer(meta.optimizer)
    if cls is None:
        raise ConfigError(
            f"optimizer {meta.optimizer} is not in the allow-list "
            f"({', '.join(L.ALLOWED_OPTIMIZERS)} from torch.optim): pass "
            f"optimizer_factory=... to replay it", reason=Reason.NOT_ALLOWED, path=path)
    with recorded(f"the allow-listed optimizer {meta.optimizer}", path):
        return cls(groups)


def blank_objects(meta: LogMeta, hyper: Sequence[Any], factory: OptimizerFactory | None,
                  path: str, *, model: dict[str, torch.Tensor] | None = None) -> Objects:
    """What a replay without the caller's objects writes into: the log's model tensors
    (zeroed on the CPU, or ``model`` when given), its parameters in optimizer order and,
    in grad mode, an optimizer over them (:func:`build_optimizer`, with the base's
    hyperparameters ``hyper``)."""
    if model is None:
        model = {n: torch.zeros(shape, dtype=DTYPE_OF[tag]) for n, tag, shape in meta.model}
    names = list(meta.params)
    params = [model[n] for n in names]
    opt = build_optimizer(meta, params, hyper, factory, path) if meta.mode == "grad" else None
    return Objects(names, params, model, opt)


def hand_residuals(out: Outcome, objs: Objects, compressor: GradCompressor | None
                   ) -> dict[torch.Tensor, torch.Tensor] | None:
    """Error-feedback residuals of a replay, keyed by parameter: put into ``compressor``
    when given (then None is returned), else returned for the next compressor attached."""
    if out.residuals is None:
        return None
    by_name = dict(zip(objs.names, objs.params, strict=True))
    residuals = {by_name[n]: r for n, r in out.residuals.items()}
    if compressor is not None:
        compressor.residuals = residuals
        return None
    return residuals


# ---------------------------------------------------------------------- public functions


def whole_log_meta(reader: LogReader) -> LogMeta:
    """:func:`~lowdiff_store.torch.replay.engine.log_meta` of a log replayed or restored on
    its own, once it is a whole state: a log whose shard section says it is one rank's
    share of a checkpoint whose ranks split one state (a rank log moved out of its
    checkpoint; one in place is refused before it is opened,
    :func:`~lowdiff_store.log.shards.replay_source`) is ``ConfigError(invalid_argument)``."""
    meta = log_meta(reader)
    sh = meta.shard
    if sh is not None and sh.layout in SPLIT_LAYOUTS:
        raise split_share(reader.path, sh.rank, sh.world_size, sh.layout, None)
    return meta


def restore_log(path: str | os.PathLike[str], model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, *, scheduler: Any = None, scaler: Any = None,
                step: int | None = None, compressor: GradCompressor | None = None,
                verify: bool = True, progress: ProgressFn | None = None) -> RestoreResult:
    """:func:`~lowdiff_store.torch.restore` of one (unsharded) log."""
    p = os.fspath(path)
    objs = objects_for(model, optimizer, scheduler, scaler)

    def replay(reader: LogReader) -> tuple[Outcome, bytes]:
        meta = whole_log_meta(reader)
        target = target_step(reader, step)
        check_objects(meta, objs, p)
        return Replayer(reader, meta, objs, verify=verify, progress=progress).run(target), \
            reader.log_id

    # again on a newer manifest if a compaction deleted the base meanwhile (with_reader)
    out, log_id = with_reader(p, replay, mode="private")  # gradients lent, not copied
    res = out.result
    residuals = hand_residuals(out, objs, compressor)
    digest = out.live_digest if out.live_digest is not None else \
        L.digest_objects(objs.params, optimizer)
    res.info = RestoreInfo(os.path.realpath(p), log_id, res.step, digest, res.exact,
                           residuals, list(res.notes))
    remember(optimizer, res.info)
    return res


def replay_log_state(path: str | os.PathLike[str], step: int | None = None, *,
                     with_optimizer: bool = False,
                     optimizer_factory: OptimizerFactory | None = None,
                     progress: ProgressFn | None = None, verify: bool = True
                     ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """:func:`~lowdiff_store.torch.replay_state` of one (unsharded) log."""
    p = os.fspath(path)

    def replay(reader: LogReader) -> tuple[Outcome, LogMeta, Objects]:
        meta = whole_log_meta(reader)
        target = target_step(reader, step)
        hyper = base_hyper(reader, target, meta)  # checks shapes against the base first
        objs = blank_objects(meta, hyper, optimizer_factory, p)
        rp = Replayer(reader, meta, objs, verify=verify, progress=progress)
        rp.apply_rng = False  # the state is returned; the caller's generators are its own
        return rp.run(target), meta, objs

    out, meta, objs = with_reader(p, replay, mode="private")
    order = meta.state_dict or [n for n, _t, _s in meta.model] + list(meta.aliases)
    state = {n: objs.model[meta.aliases.get(n, n)] for n in order}
    if not with_optimizer:
        return state, None
    opt = objs.optimizer
    opt_state = opt.state_dict() if opt is not None else out.opt_state
    assert opt_state is not None
    for g in opt_state["param_groups"]:  # torch's convention for naming group params
        g["param_names"] = [objs.names[i] for i in g["params"]]
    return state, opt_state


__all__ = ["OptimizerFactory", "RestoreResult", "blank_objects", "build_optimizer",
           "check_classes", "check_objects", "hand_residuals", "objects_for", "optimizer_names",
           "replay_log_state", "restore_log", "whole_log_meta"]
