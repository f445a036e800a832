"""torchtitan (0.3.0): a checkpoint manager that logs every training step.

In a config function (``--module pkg.mod --config fn``)::

    from lowdiff_store.integrations.torchtitan import LowDiffCheckpointManager
    config.checkpoint = LowDiffCheckpointManager.Config(enable=True, interval=500)

:class:`LowDiffCheckpointManager` is torchtitan's own ``CheckpointManager`` (its DCP
checkpoint every ``interval`` steps, its final save are unchanged) with a
:class:`~lowdiff_store.torch.DiffCheckpointer` beside it: every optimizer step is a record
of the log at ``<dump_folder>/<log_folder>`` (grad mode: the gradient the optimizer
consumed, after clipping; the optimizer replays it). Each record also holds, after the
step, what torchtitan's checkpoint holds beside model and optimizer: the LR scheduler,
``train_state`` (``step``, ``ntokens_seen``), the data loader position, plus the Python,
NumPy and torch RNG states, which torchtitan's checkpoint lacks, and a digest of the job's
configuration.

**Bases by reference** (``bases="dcp"``, the default). The log takes no periodic base of its
own: each DCP checkpoint torchtitan writes (synchronously) is the log's base of that step
by reference (format section 7.1: the base file holds what the checkpoint lacks, RNG states
and the tensors torchtitan's ``state_dict`` hooks rewrite, such as the fused QKV weight;
every other tensor is named with its CRC32C in the DCP directory), so the state is on disk
once. The log's first base is a reference too when torchtitan loaded a DCP checkpoint (its
newest, or ``initial_load_path``); on a fresh start it is a copy, dropped at the first
DCP checkpoint. Retention: once a new base is durable on every rank the log drops its
older bases and the records before it (``lowdiff_store.compaction``), and
``keep_latest_k`` never deletes a DCP directory a base of the log still refers to (its
deletion waits until the log has dropped that base). ``bases="own"``: the log writes its
own bases every ``snapshot_every`` steps (a second copy of the state; keeps nothing of
torchtitan's).

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
``num_workers=0``, or whose state cannot be recorded. At ``load()``: a log written by
another number of data parallel ranks, or by a job whose configuration differs
(``ignore_config`` names parts allowed to change), a base whose DCP directory is gone or
changed, a data loader that refuses its logged state. See ``docs/integrations.md``.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import TRAIN_STATE, CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader

from ..compaction import compact
from ..errors import ConfigError, LowdiffError, Reason
from ..log.latest import latest_step
from ..torch import DiffCheckpointer, InitialBase, LateExtra, restore
from ..torch.capture.stateful import extra_at
from ..torch.core.typed_msgpack import pack
from ._common import RESUME_MODES, refuse_existing
from ._rng import np_state, py_state, set_np_state, set_py_state
from ._titan_log import base_everywhere, config_changes, config_digest, needed_dirs

_log = logging.getLogger(__name__)

#: Keys of every record's extra state (the resume path checks them).
EXTRA_KEYS = ("train_state", "dataloader", "dp_world_size", "py_rng", "np_rng", "config")
#: ``snapshot_every`` of a log whose bases are torchtitan's checkpoints: no periodic base
#: of its own ever falls due (the log's bases are the ones ``refer_base`` asks for)
NO_PERIODIC_BASES = 1 << 62
#: ``Config.bases`` values
BASES = ("dcp", "own")
#: the DiffCheckpointer arguments the manager sets (not ``log_options``)
MANAGER_SETS = ("scheduler", "scaler", "mode", "snapshot_every", "batch", "digest_every",
                "extra_state", "restored", "initial_base", "exact_bases", "compressor")


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
    """torchtitan's ``CheckpointManager`` plus a per-step lowdiff-store log whose bases are
    torchtitan's DCP checkpoints, by reference (see the module docstring).

    Attributes:
        log_path: the log directory.
        checkpointer: the live :class:`~lowdiff_store.torch.DiffCheckpointer` between
            ``load()`` and ``close()``.
        resumed_step: the training step the last ``load()`` restored from the log (None:
            the log held nothing, torchtitan loaded as usual).
        referred: the DCP directories made bases of the log by this process (in order).
        deferred: DCP directories ``keep_latest_k`` would have deleted, kept while the log
            refers to them.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        log_folder: str = "lowdiff"
        """Log directory, relative to the dump folder (or absolute)."""

        bases: str = "dcp"
        """``dcp``: the log's bases are torchtitan's DCP checkpoints, by reference (the
        state on disk once); ``own``: the log writes its own every ``snapshot_every``
        steps (a second copy)."""

        snapshot_every: int = 100
        """With ``bases="own"``: a base (full copy of the state) every this many steps."""

        log_batch: int = 1
        """Records per write + fsync (group commit)."""

        digest_every: int = 10
        """A digest of the state every this many steps, checked when the log is replayed."""

        log_resume: str = "auto"
        """``auto``: resume from the log when it holds a step; ``never``: refuse a log
        that already holds one."""

        log_options: dict[str, Any] = field(default_factory=dict)
        """Further :class:`~lowdiff_store.torch.DiffCheckpointer` options: writer options
        (``segment_bytes``, ``max_delay_s``...) and advanced ones (``writer_process``...);
        not those the manager sets itself."""

        ignore_config: list[str] = field(default_factory=list)
        """Parts of the job's configuration (``optimizer``, ``lr_scheduler``, ``training``,
        ``dataloader``...: ``docs/integrations.md``) allowed to differ from the log's job
        when resuming."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.snapshot_every < 1 or self.log_batch < 1 or self.digest_every < 0:
                raise ConfigError("snapshot_every and log_batch must be >= 1, digest_every "
                                  ">= 0")
            if self.log_resume not in RESUME_MODES:
                raise ConfigError(f"log_resume={self.log_resume!r} must be one of "
                                  f"{RESUME_MODES}")
            if self.bases not in BASES:
                raise ConfigError(f"bases={self.bases!r} must be one of {BASES}")
            taken = sorted(set(self.log_options) & set(MANAGER_SETS))
            if taken:
                raise ConfigError(f"log_options {taken} are set by the manager")
            if self.bases == "dcp" and self.log_options.get("base_slices") not in (None, 1):
                raise ConfigError("log_options base_slices (streamed bases) needs "
                                  "bases='own': with bases='dcp' every base is torchtitan's "
                                  "DCP checkpoint, by reference", reason=Reason.NOT_ALLOWED)

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[Any],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any, base_folder: str = "") -> None:
        self.checkpointer: DiffCheckpointer | None = None
        self.resumed_step: int | None = None
        self.referred: list[str] = []
        self.deferred: list[str] = []
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
        self._config_digest = config_digest(self._train_state)
        self._snap: dict[str, Any] = {}
        self._awaiting: int | None = None  # log step of a referred base not yet durable
        self._queued: set[str] = set()

    def _snapshot(self) -> None:
        """The state beside model and optimizer now; recorded with the step whose record
        is completed next (the dataset's buffers are copied: it extends them in place)."""
        self._snap = {
            "train_state": dict(self._train_state.state_dict()),
            "dataloader": copy.deepcopy(StatefulDataLoader.state_dict(self._dataloader)),
            "dp_world_size": self._dataloader.dp_world_size,
            "py_rng": py_state(), "np_rng": np_state(), "config": self._config_digest,
        }

    def _start(self, restored: Any = None, base0: str | None = None) -> None:
        """Open the log on the objects (``restored``: continuing it; ``base0``: a new log
        whose first base refers to this DCP checkpoint, which torchtitan just loaded)."""
        self._snapshot()
        _recordable(self._snap["dataloader"])
        c = self._config
        own = c.bases == "own"
        self.checkpointer = DiffCheckpointer(
            self.log_path, self._model, self._optimizer, scheduler=self._scheduler,
            snapshot_every=c.snapshot_every if own else NO_PERIODIC_BASES,
            exact_bases=not own, batch=c.log_batch, digest_every=c.digest_every,
            extra_state=LateExtra(lambda: self._snap), restored=restored,
            initial_base=None if base0 is None else InitialBase(base0, kind="dcp",
                                                                 load=False),
            **c.log_options | ({} if own else {"base_slices": 1}))

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
            source = self._titan_source()
            loaded = bool(super()._load(step))
            self._start(base0=source if loaded else None)
            return loaded
        with _base_errors(self.log_path):
            extra = extra_at(self.log_path, last)
            self._check_resume(extra, last)
            res = restore(self.log_path, self._model, self._optimizer,
                          scheduler=self._scheduler, step=last)
        self._train_state.load_state_dict(extra["train_state"])
        self._load_position(extra["dataloader"], last)
        set_py_state(extra["py_rng"])
        set_np_state(extra["np_rng"])
        self.resumed_step = int(extra["train_state"]["step"])
        self._start(res)
        return True

    def _load_position(self, state: Any, last: int) -> None:
        """The data loader's position logged at step ``last``, loaded and read back (the
        loader applies it when it next makes its iterator): a loader that raises, or whose
        position read back differs (a state it ignores), is refused."""
        loader = self._dataloader
        try:
            StatefulDataLoader.load_state_dict(loader, state)
            back = StatefulDataLoader.state_dict(loader)
        except Exception as e:  # a dataset's own code raises anything
            raise ConfigError(f"the data loader refused the position logged at step {last} "
                              f"({type(e).__name__}: {' '.join(str(e).split())}): not "
                              f"resumed", reason=Reason.STATE_MISMATCH,
                              path=self.log_path) from None
        _recordable(back)
        if back != state:
            raise ConfigError(f"the data loader did not take the position logged at step "
                              f"{last} (its position read back differs): not resumed",
                              reason=Reason.STATE_MISMATCH, path=self.log_path)

    def _check_resume(self, extra: Any, last: int) -> None:
        """The log's step ``last`` was written by this manager, for as many data parallel
        ranks and the same job configuration (but the parts ``ignore_config`` names)."""
        if not isinstance(extra, dict) or any(k not in extra for k in EXTRA_KEYS):
            raise ConfigError(f"{self.log_path} was not written by LowDiffCheckpointManager "
                              f"(no train state at step {last})", reason=Reason.STATE_MISMATCH,
                              path=self.log_path)
        if extra["dp_world_size"] != self._dataloader.dp_world_size:
            raise ConfigError(f"{self.log_path} was written by {extra['dp_world_size']} data "
                              f"parallel ranks, this job has {self._dataloader.dp_world_size}",
                              reason=Reason.STATE_MISMATCH, path=self.log_path)
        changed = config_changes(extra["config"], self._config_digest,
                                 self._config.ignore_config)
        if changed:
            raise ConfigError(f"the job's configuration differs from the one that wrote the "
                              f"log in {', '.join(changed)}: not resumed (list what may "
                              f"change in checkpoint.ignore_config, or use another "
                              f"log_folder)", reason=Reason.STATE_MISMATCH, path=self.log_path)

    def _titan_source(self) -> str | None:
        """The DCP directory torchtitan's own load is about to read (its newest step, or
        ``initial_load_path`` when it has none), if the log's first base may refer to it."""
        if self._config.bases != "dcp":
            return None
        newest = self._find_load_step() if os.path.isdir(self.folder) else -1
        if newest != -1:
            path = self._create_checkpoint_id(newest)
        elif self.initial_load_path and not self.initial_load_in_hf:
            path = self.initial_load_path
        else:
            return None
        return path if os.path.isfile(os.path.join(path, ".metadata")) else None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """After every training step: the step's state beside model and optimizer for its
        record; torchtitan's own DCP save when it is due, then made the base of that step
        by reference; at the last step, every record made durable; the log's retention and
        the deletions it put off, once a new base is durable."""
        ckpt = self.checkpointer
        if ckpt is not None:
            self._snapshot()
        saved = bool(super()._save(curr_step, last_step))
        full = not (last_step and self.last_save_model_only)
        if saved and full and ckpt is not None and self._config.bases == "dcp":
            self._refer(ckpt, self._create_checkpoint_id(curr_step))
        if last_step and ckpt is not None:
            ckpt.flush()
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                torch.distributed.barrier()  # every rank's last base is durable: rank 0's
        self._retain()                       # retention sees them all
        return saved

    def _refer(self, ckpt: DiffCheckpointer, path: str) -> None:
        """The DCP checkpoint torchtitan just saved at ``path`` becomes the log's base of
        the step. One that cannot be read back (a scan failure) is not referenced: training
        goes on, the log keeps its previous base (and that base's checkpoint)."""
        try:
            referred = ckpt.refer_base(path)
        except (LowdiffError, OSError) as e:
            _log.warning("lowdiff-store: torchtitan's checkpoint %s could not be made the "
                         "log's base (%s: %s); the log keeps its previous base", path,
                         type(e).__name__, e)
            return
        if referred:
            self.referred.append(path)
            self._awaiting = ckpt.step

    def _retain(self) -> None:
        """Rank 0, once the base last referred to is durable on every rank: the log keeps
        that base and what follows it; the DCP directories only the dropped bases referred
        to may then be deleted by ``keep_latest_k``."""
        if self._awaiting is None or _rank() != 0 or \
                not base_everywhere(self.log_path, self._awaiting):
            return
        self._awaiting = None
        try:
            compact(self.log_path, keep_bases=1)
        except (LowdiffError, OSError) as e:  # training goes on; the next base retries
            _log.warning("lowdiff-store: the log's retention failed (%s: %s); its older "
                         "bases, and the DCP checkpoints they refer to, are kept until the "
                         "next base", type(e).__name__, e)
        self._purge_stale_checkpoints()  # (what a live base refers to is kept either way)

    def _purge_stale_checkpoints(self) -> None:
        """torchtitan's ``keep_latest_k``, except for the DCP directories a base of the log
        refers to (:attr:`deferred` until the log drops that base)."""
        if self._config.bases != "dcp" or not self._should_purge():
            super()._purge_stale_checkpoints()
            return
        found = [(int(n[5:]), self._create_checkpoint_id(int(n[5:])))
                 for n in os.listdir(self.folder) if n.startswith("step-") and n[5:].isdigit()]
        needed = needed_dirs(self.log_path)
        self.deferred = []
        for _step, path in sorted(found)[:-self.keep_latest_k]:
            if os.path.normpath(os.path.abspath(path)) in needed:
                self.deferred.append(path)
            elif path not in self._queued:
                self._queued.add(path)
                self.purge_queue.put(path)

    def _close(self) -> None:
        if self.checkpointer is not None:
            ckpt, self.checkpointer = self.checkpointer, None
            ckpt.close()
            self._retain()
        super()._close()


def _recordable(position: Any) -> None:
    """A data loader position the log can record (else refused, naming what is not)."""
    try:
        pack(position, "its state")
    except ConfigError as e:
        raise _refuse(f"the data loader's position cannot be recorded every step: "
                      f"{e.detail}") from None


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


@contextmanager
def _base_errors(log: str) -> Iterator[None]:
    """A file outside the log (of the DCP checkpoint a base refers to) missing or changed:
    one line saying what happened and what to do."""
    try:
        yield
    except LowdiffError as e:
        where = os.path.abspath(e.path) if e.path else ""
        if e.reason not in (Reason.MISSING_FILE, Reason.REFERENCE_CHANGED) or not where or \
                where.startswith(os.path.abspath(log) + os.sep):
            raise
        raise ConfigError(
            f"the log cannot resume exactly: its base refers to torchtitan's DCP checkpoint "
            f"file {where}, which was deleted or changed ({e.reason.value}: {e.detail}); "
            f"move the log aside to resume from torchtitan's own newest checkpoint instead",
            reason=e.reason, path=log) from None


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


__all__ = ["BASES", "EXTRA_KEYS", "MANAGER_SETS", "NO_PERIODIC_BASES", "LowDiffCheckpointManager",
           "RawStateModel"]
