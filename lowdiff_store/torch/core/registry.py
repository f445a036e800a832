"""What :func:`restore` hands the checkpointer created next on the objects it filled: one
:class:`RestoreInfo` (the log and step they hold, so a :class:`DiffCheckpointer` continues
that log or refuses to mix histories; the error-feedback residuals a compressor attached
later should take; with several ranks, the communication-hook state and the job's step).

``restore`` returns it as ``RestoreResult.info``, and ``DiffCheckpointer(...,
restored=result)`` takes it explicitly. So that ``restore(path, model, opt)`` followed by
``DiffCheckpointer(path, model, opt)`` works without passing it, ``restore`` also records it
here, in the one registry of the torch layer, keyed (weakly) by the optimizer it filled;
the checkpointer takes it over (and drops it) when it is created.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RestoreInfo:
    """The state :func:`restore` put into an optimizer (and its model): the log at
    ``path`` (``log_id``) at ``step``, the digest of the parameters and optimizer state it
    left (checked when a checkpointer continues), whether every piece is exact, the
    residuals for the next compressor, remarks; with several ranks the hook state waiting
    for the wrapped communication hook (``hook``) and ``job_step``, the job's newest
    durable step when the restore went there (a shard's later steps are then dropped)."""

    path: str
    log_id: bytes
    step: int
    digest: int
    exact: bool
    residuals: dict[torch.Tensor, torch.Tensor] | None = None
    notes: list[str] = field(default_factory=list)
    hook: Any = None
    job_step: int | None = None

    def take_residuals(self) -> dict[torch.Tensor, torch.Tensor] | None:
        """The residuals not yet taken by a compressor (then forgotten here)."""
        res, self.residuals = self.residuals, None
        return res


_RESTORED: weakref.WeakKeyDictionary[torch.optim.Optimizer, RestoreInfo] = \
    weakref.WeakKeyDictionary()


def remember(optimizer: torch.optim.Optimizer, info: RestoreInfo) -> None:
    """Record that ``optimizer`` holds ``info.step`` of the log at ``info.path``."""
    _RESTORED[optimizer] = info


def restored(optimizer: torch.optim.Optimizer) -> RestoreInfo | None:
    """What :func:`restore` last put into ``optimizer``, if anything."""
    return _RESTORED.get(optimizer)


def forget(optimizer: torch.optim.Optimizer) -> None:
    """Drop the record (the checkpointer took it over)."""
    _RESTORED.pop(optimizer, None)


def pending_residuals(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor] | None:
    """Residuals restored for ``optimizer`` that no compressor has taken yet."""
    info = _RESTORED.get(optimizer)
    return None if info is None else info.take_residuals()


__all__ = ["RestoreInfo", "forget", "pending_residuals", "remember", "restored"]
