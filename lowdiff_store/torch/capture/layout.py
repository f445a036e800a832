"""Where one process's checkpointer writes and which of the job's tensors it logs.

:func:`layout_for` is the factory :class:`~lowdiff_store.torch.DiffCheckpointer` asks: a
single process gets a :class:`Layout` (one log holding everything); a process of a job of
several ranks gets the per-rank layout of
:mod:`lowdiff_store.torch.distributed.checkpointer` (its own log under ``path/rank-<r>``, a
:class:`Partition` of the tensors, a gradient source for DDP communication hooks). That room
sits above this one in the import order, so it hands its factory over with
:func:`set_per_rank_layout` when it is imported (importing any part of
``lowdiff_store.torch`` imports it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError, Reason
from ...log.shards import check_world_size, is_sharded
from ..core.hook_records import passthrough
from ..core.optimizers import unwrap_optimizer
from ..core.registry import RestoreInfo
from .bases.initial import InitialBase
from .grad_capture import GradSource, HostPool
from .options import CheckpointerOptions


def at_job_step(options: CheckpointerOptions, info: RestoreInfo | None
                ) -> CheckpointerOptions:
    """``options`` for a shard restored at the job's durable step (``info.job_step``):
    truncating, since steps the shard holds beyond it are not durable on every rank."""
    if info is not None and info.job_step is not None and info.job_step == info.step:
        return options.truncating()
    return options


def rank_world() -> tuple[int, int]:
    """(rank, world size) from ``torch.distributed``; (0, 1) when it is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass
class Partition:
    """The tensors one process logs: ``names``/``params`` (optimizer parameters, in the
    optimizer's order) and ``model`` (model tensors by name: those parameters and every
    buffer)."""

    names: list[str]
    params: list[torch.Tensor]
    model: dict[str, torch.Tensor]


class Layout:
    """One log at ``path`` holding every tensor of ``optimizer`` and its model (a single
    process). The per-rank layout overrides the methods; the checkpointer calls them at
    the points named in each docstring."""

    #: this process's rank, the number of ranks, and the layout's name in the log
    rank, world, kind = 0, 1, "single"
    #: the job around this log was never published (a layout of several ranks in which
    #: no step was durable on every rank when this open began, ``SHARDS`` missing
    #: included: :func:`~lowdiff_store.torch.capture.opening.unpublished_job`): no restore
    #: can continue it, so a log holding only its step-0 base is a leftover of a setup
    #: that was stopped, and is started over
    #: (:func:`~lowdiff_store.torch.capture.opening.setup_leftover`)
    unpublished = False

    def __init__(self, path: str, optimizer: torch.optim.Optimizer) -> None:
        #: this process's log, and the checkpoint directory it belongs to
        self.path = self.root = path
        #: the optimizer hooked and logged (a ZeroRedundancyOptimizer's local one)
        self.optimizer = optimizer
        #: the parameters whose gradients, optimizer state and base copies are logged
        self.owned: list[str] = []

    def options_for(self, options: CheckpointerOptions,
                    info: RestoreInfo | None) -> CheckpointerOptions:
        """The options in force after ``info`` (what restore put into the objects)."""
        return options

    def select(self, names: list[str], params: list[torch.Tensor],
               model: dict[str, torch.Tensor], buffers: list[str], groups: list[int],
               meta: dict[str, Any]) -> Partition:
        """The tensors logged, out of every optimizer parameter (``names``, ``params``, in
        ``groups``) and model tensor; may complete the log metadata ``meta``."""
        self.owned = list(names)
        return Partition(names, params, model)

    def grad_source(self, pool: HostPool, options: CheckpointerOptions,
                    info: RestoreInfo | None) -> GradSource | None:
        """Where gradients come from besides dense copies (None: nowhere)."""
        return None

    def agree(self, err: BaseException | None) -> None:
        """After opening the log: raise ``err`` (several ranks: on every rank, if any
        failed)."""
        if err is not None:
            raise err

    def before_finalize(self) -> None:
        """Before a step's record is completed with what ran after the step."""

    def attach(self) -> list[Any]:
        """When the checkpointer's hooks are put on: this layout's own (their handles,
        each with ``remove()``, taken off with the checkpointer's)."""
        return []

    def post_step(self, capture: Callable[[], None]) -> None:
        """At the optimizer's post-step hook: run ``capture`` (the capture of the state
        after the step), now or later (a local-update wrapper's step runs it once its
        synchronization is done, so the step's digest and base include it)."""
        capture()

    def wrap_comm_hook(self, hook: Callable[[Any, Any], Any], compressor: Any
                       ) -> Callable[[Any, Any], Any]:
        """See :meth:`DiffCheckpointer.wrap_comm_hook`: a single process runs ``hook``
        unchanged and the gradient is captured densely."""
        return passthrough(hook)

    def clip_params(self) -> list[torch.Tensor] | None:
        """The parameters ``clip_grad_norm_`` clips with torch's own function (None: the
        logged ones, the scale recorded for layer-wise capture)."""
        return None

    def add_stats(self, out: dict[str, float], partition: Partition) -> None:
        """Add this layout's counters to :meth:`DiffCheckpointer.stats`."""

    def streamed_why(self) -> str | None:
        """Why this layout's restores cannot replay streamed bases (``base_slices``), or
        None: a single log, and one log per rank (DDP, ZeRO, FSDP2), can."""
        return None


#: builds the layout of a process in a job of several ranks:
#: ``(path, model, optimizer, options, compressor, initial_base)``
LayoutFactory = Callable[[str, torch.nn.Module, torch.optim.Optimizer, CheckpointerOptions,
                          Any, InitialBase | None], Layout]
_PER_RANK: dict[str, LayoutFactory] = {}
#: builds the layout of an optimizer wrapper the capture room does not know (the same
#: arguments, ``optimizer`` as given, not unwrapped), or returns None when not its own
WrapperLayoutFactory = Callable[[str, torch.nn.Module, Any, CheckpointerOptions, Any,
                                 InitialBase | None], "Layout | None"]
_WRAPPERS: list[WrapperLayoutFactory] = []


def set_per_rank_layout(factory: LayoutFactory) -> None:
    """Install the layout factory of jobs with several ranks (called once, by
    :mod:`lowdiff_store.torch.distributed.checkpointer` when imported)."""
    _PER_RANK["factory"] = factory


def set_wrapper_layout(factory: WrapperLayoutFactory) -> None:
    """Install a layout factory that :func:`layout_for` asks first, with the optimizer
    as given (called once, by :mod:`lowdiff_store.torch.distributed.local_sgd` when
    imported: local-update wrappers log one replica per rank)."""
    if factory not in _WRAPPERS:
        _WRAPPERS.append(factory)


def layout_for(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any,
               options: CheckpointerOptions, compressor: Any,
               initial_base: InitialBase | None = None) -> Layout:
    """The layout of a checkpointer created with these arguments: the one a factory of
    :func:`set_wrapper_layout` makes for ``optimizer`` (as given, a wrapper included); per
    rank under ``torch.distributed`` with more than one rank (collective: every rank calls
    this); otherwise one log, which may not be a sharded checkpoint
    (``ConfigError(world_size_mismatch)``). Other wrappers are peeled off
    (:func:`~lowdiff_store.torch.core.optimizers.unwrap_optimizer`)."""
    p = os.fspath(path)
    for wrapper in _WRAPPERS:
        made = wrapper(p, model, optimizer, options, compressor, initial_base)
        if made is not None:
            return made
    optimizer = unwrap_optimizer(optimizer)
    if rank_world()[1] > 1:
        factory = _PER_RANK.get("factory")
        if factory is None:
            raise ConfigError("several ranks but no per-rank layout: import "
                              "lowdiff_store.torch", reason=Reason.NOT_ALLOWED, path=p)
        return factory(p, model, optimizer, options, compressor, initial_base)
    if is_sharded(p):
        check_world_size(p, 1)
        raise ConfigError(f"{p} holds a sharded checkpoint; a single process cannot write "
                          f"into it", reason=Reason.WORLD_SIZE_MISMATCH, path=p)
    return Layout(p, optimizer)


__all__ = ["Layout", "LayoutFactory", "Partition", "WrapperLayoutFactory", "at_job_step",
           "layout_for", "rank_world", "set_per_rank_layout", "set_wrapper_layout"]
