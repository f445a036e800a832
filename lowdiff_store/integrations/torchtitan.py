"""torchtitan (0.3.0): a checkpoint manager that logs every training step.

In a config function (``--module pkg.mod --config fn``)::

    from lowdiff_store.integrations.torchtitan import LowDiffCheckpointManager
    config.checkpoint = LowDiffCheckpointManager.Config(enable=True, interval=500)

:class:`LowDiffCheckpointManager` is torchtitan's own ``CheckpointManager`` (its DCP
checkpoint every ``interval`` steps, its retention, its final save are unchanged) with a
:class:`~lowdiff_store.torch.DiffCheckpointer` beside it: every optimizer step is a record
of the log at ``<dump_folder>/<log_folder>`` (grad mode: the gradient the optimizer
consumed, after clipping; the optimizer replays it). Each record also holds, after the
step, what torchtitan's checkpoint holds beside model and optimizer: the LR scheduler,
``train_state`` (``step``, ``ntokens_seen``), the data loader position, plus the Python,
NumPy and torch RNG states, which torchtitan's checkpoint lacks.

``Trainer.train()`` calls ``load()`` first: when the log holds a durable step, that step is
restored (bit for bit) instead of torchtitan's newest DCP checkpoint, which is up to
``interval - 1`` steps older; otherwise torchtitan loads as it always does (its DCP
checkpoint, ``initial_load_path``, or a fresh start) and the log starts there.

Several ranks: FSDP2 data parallel sharding over every rank (``data_parallel_shard_degree``
equal to the number of ranks, torchtitan's ``fully_shard`` of the model: every parameter a
DTensor ``Shard(0)`` over a 1-D mesh of all ranks). Each rank logs its own pieces, RNG,
``train_state`` and data loader position under ``<log>/rank-NNNNN`` (the library's
``fsdp`` layout, ``docs/distributed.md``), and ``load()`` resumes every rank at the newest
step durable on all of them. Tested bitwise on two CPU ranks (gloo).

What is not supported is refused when the manager is built (``ConfigError``, one line):
on several ranks anything but that FSDP2 sharding (HSDP / replicate, tensor, context,
expert parallelism), several model parts (pipeline parallelism) or optimizers,
``async_mode`` other than ``"disabled"``, ``load_step``, ``exclude_from_loading``,
``load_only``, a data loader that is not torchtitan's ``ParallelAwareDataloader`` with
``num_workers=0``; at ``load()``, a log written by another number of data parallel ranks.
See ``docs/integrations.md``.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import TRAIN_STATE, CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader

from ..errors import ConfigError, Reason
from ..log.latest import latest_step
from ..torch import DiffCheckpointer, LateExtra, restore
from ..torch.capture.stateful import extra_at
from ._common import RESUME_MODES, refuse_existing
from ._rng import np_state, py_state, set_np_state, set_py_state

#: Keys of every record's extra state (the resume path checks them).
EXTRA_KEYS = ("train_state", "dataloader", "dp_world_size", "py_rng", "np_rng")


class RawStateModel(torch.nn.Module):
    """The model as the log sees it: its parameters and persistent buffers under their
    module-tree names, without the model's ``state_dict`` hooks.

    torchtitan's hooks rename and split tensors for its checkpoints (a fused QKV weight
    becomes three new ``wq`` / ``wk`` / ``wv`` tensors): those are copies, not the
    parameters the optimizer steps, so the log names ``wqkv`` itself. The wrapped model is
    held as a plain attribute, not a submodule (its own ``state_dict`` is never called).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner: torch.nn.Module
        object.__setattr__(self, "inner", model)

    def state_dict(self, *args: Any, keep_vars: bool = False,  # type: ignore[override]
                   **kwargs: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for prefix, mod in self.inner.named_modules():
            dot = f"{prefix}." if prefix else ""
            for n, p in mod._parameters.items():
                if p is not None:
                    out[dot + n] = p if keep_vars else p.detach()
            for n, b in mod._buffers.items():
                if b is not None and n not in mod._non_persistent_buffers_set:
                    out[dot + n] = b if keep_vars else b.detach()
        return out

    def parameters(self, recurse: bool = True) -> Any:
        return self.inner.parameters(recurse)


def _refuse(what: str) -> ConfigError:
    return ConfigError(f"LowDiffCheckpointManager: {what}", reason=Reason.NOT_ALLOWED)


class LowDiffCheckpointManager(CheckpointManager):  # type: ignore[misc]
    """torchtitan's ``CheckpointManager`` plus a per-step lowdiff-store log.

    Attributes:
        log_path: the log directory.
        checkpointer: the live :class:`~lowdiff_store.torch.DiffCheckpointer` between
            ``load()`` and ``close()``.
        resumed_step: the training step the last ``load()`` restored from the log (None:
            the log held nothing, torchtitan loaded as usual).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        log_folder: str = "lowdiff"
        """Log directory, relative to the dump folder (or absolute)."""

        snapshot_every: int = 100
        """A base (full copy of the state) every this many steps of the log."""

        log_batch: int = 1
        """Records per write + fsync (group commit)."""

        digest_every: int = 10
        """A digest of the state every this many steps, checked when the log is replayed."""

        log_resume: str = "auto"
        """``auto``: resume from the log when it holds a step; ``never``: refuse a log
        that already holds one."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.snapshot_every < 1 or self.log_batch < 1 or self.digest_every < 0:
                raise ConfigError("snapshot_every and log_batch must be >= 1, digest_every "
                                  ">= 0")
            if self.log_resume not in RESUME_MODES:
                raise ConfigError(f"log_resume={self.log_resume!r} must be one of "
                                  f"{RESUME_MODES}")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[Any],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any, base_folder: str = "") -> None:
        self.checkpointer: DiffCheckpointer | None = None
        self.resumed_step: int | None = None
        if config.enable:
            _check_supported(config, dataloader, model_parts, optimizers, states)
        super().__init__(config, dataloader=dataloader, model_parts=model_parts,
                         optimizers=optimizers, lr_schedulers=lr_schedulers, states=states,
                         sd_adapter=sd_adapter, base_folder=base_folder)
        if not self.enable:
            return
        self.log_path = os.path.join(base_folder, config.log_folder)
        self._config = config
        self._model = RawStateModel(model_parts[0])
        self._optimizer = optimizers.optimizers[0]
        self._scheduler = lr_schedulers.schedulers[0]
        self._dataloader: ParallelAwareDataloader = dataloader
        self._train_state = states[TRAIN_STATE]
        self._snap: dict[str, Any] = {}

    def _snapshot(self) -> None:
        """The state beside model and optimizer now; recorded with the step whose record
        is completed next (the dataset's buffers are copied: it extends them in place)."""
        self._snap = {
            "train_state": dict(self._train_state.state_dict()),
            "dataloader": copy.deepcopy(StatefulDataLoader.state_dict(self._dataloader)),
            "dp_world_size": self._dataloader.dp_world_size,
            "py_rng": py_state(), "np_rng": np_state(),
        }

    def _start(self, restored: Any = None) -> None:
        self._snapshot()
        c = self._config
        self.checkpointer = DiffCheckpointer(
            self.log_path, self._model, self._optimizer, scheduler=self._scheduler,
            snapshot_every=c.snapshot_every, batch=c.log_batch, digest_every=c.digest_every,
            extra_state=LateExtra(lambda: self._snap), restored=restored)

    def _load(self, step: int = -1) -> bool:
        """The newest durable step of the log, or else torchtitan's own load; then the log
        (re)starts from the loaded state."""
        if self.checkpointer is not None:
            raise ConfigError("LowDiffCheckpointManager.load() runs once, before training",
                              reason=Reason.INVALID_ARGUMENT)
        refuse_existing(self.log_path, self._config.log_resume)
        self.resumed_step = None
        last = latest_step(self.log_path)
        if last is None:
            loaded = bool(super()._load(step))
            self._start()
            return loaded
        extra = extra_at(self.log_path, last)
        if not isinstance(extra, dict) or any(k not in extra for k in EXTRA_KEYS):
            raise ConfigError(f"{self.log_path} was not written by LowDiffCheckpointManager "
                              f"(no train state at step {last})", reason=Reason.STATE_MISMATCH,
                              path=self.log_path)
        if extra["dp_world_size"] != self._dataloader.dp_world_size:
            raise ConfigError(f"{self.log_path} was written by {extra['dp_world_size']} data "
                              f"parallel ranks, this job has {self._dataloader.dp_world_size}",
                              reason=Reason.STATE_MISMATCH, path=self.log_path)
        res = restore(self.log_path, self._model, self._optimizer, scheduler=self._scheduler,
                      step=last)
        self._train_state.load_state_dict(extra["train_state"])
        StatefulDataLoader.load_state_dict(self._dataloader, extra["dataloader"])
        set_py_state(extra["py_rng"])
        set_np_state(extra["np_rng"])
        self.resumed_step = int(extra["train_state"]["step"])
        self._start(res)
        return True

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """After every training step: the step's state beside model and optimizer for its
        record; torchtitan's own DCP save when it is due; at the last step, every record
        made durable."""
        if self.checkpointer is not None:
            self._snapshot()
        saved = bool(super()._save(curr_step, last_step))
        if last_step and self.checkpointer is not None:
            self.checkpointer.flush()
        return saved

    def _close(self) -> None:
        if self.checkpointer is not None:
            ckpt, self.checkpointer = self.checkpointer, None
            ckpt.close()
        super()._close()


def _check_supported(config: Any, dataloader: Any, model_parts: list[Any], optimizers: Any,
                     states: dict[str, Any]) -> None:
    """Refuse, before anything is written, what this manager does not support (the same
    answer on every rank: it depends on the job's configuration only)."""
    if len(model_parts) != 1:
        raise _refuse(f"{len(model_parts)} model parts (pipeline parallelism) are not "
                      f"supported")
    opts = getattr(optimizers, "optimizers", None)
    if not isinstance(opts, list) or len(opts) != 1:
        n = len(opts) if isinstance(opts, list) else "no"
        raise _refuse(f"{n} optimizers in the container: exactly one is supported (one "
                      f"optimizer type for every parameter group)")
    for name, bad in (("async_mode", config.async_mode != "disabled"),
                      ("load_step", config.load_step != -1),
                      ("exclude_from_loading", bool(config.exclude_from_loading)),
                      ("load_only", config.load_only)):
        if bad:
            raise _refuse(f"checkpoint.{name}={getattr(config, name)!r} is not supported")
    if not isinstance(dataloader, ParallelAwareDataloader):
        raise _refuse(f"the data loader is a {type(dataloader).__name__}: a "
                      f"ParallelAwareDataloader is needed (its state is recorded every step)")
    if dataloader.num_workers != 0:
        raise _refuse(f"dataloader.num_workers={dataloader.num_workers}: only 0 is supported")
    if TRAIN_STATE not in states:
        raise _refuse(f"no {TRAIN_STATE!r} in the states to save")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1:
        _check_fsdp_only(world, dataloader, model_parts[0])


#: what several ranks may be (the one tested setup), for the refusals' messages
_SEVERAL_RANKS = ("only FSDP2 data parallel sharding over every rank is supported on several "
                  "ranks (data_parallel_shard_degree = the number of ranks; no replicate/HSDP, "
                  "tensor, context, expert or pipeline parallelism)")


def _check_fsdp_only(world: int, dataloader: Any, model: torch.nn.Module) -> None:
    """Several ranks: every rank a data parallel rank, every parameter an FSDP2 DTensor
    sharded on dim 0 over a 1-D mesh of all ranks."""
    from torch.distributed.tensor import DTensor, Shard

    dp = dataloader.dp_world_size
    if dp != world:
        raise _refuse(f"{world} ranks with a data parallel degree of {dp}: {_SEVERAL_RANKS}")
    for name, p in model.named_parameters():
        ok = isinstance(p, DTensor) and p.device_mesh.ndim == 1 and \
            p.device_mesh.size() == world and tuple(p.placements) == (Shard(0),)
        if not ok:
            where = f"placements {tuple(p.placements)} on a mesh of shape " \
                f"{tuple(p.device_mesh.shape)}" if isinstance(p, DTensor) else "not a DTensor"
            raise _refuse(f"{world} ranks, parameter {name} is {where}: {_SEVERAL_RANKS}")


__all__ = ["EXTRA_KEYS", "LowDiffCheckpointManager", "RawStateModel"]
