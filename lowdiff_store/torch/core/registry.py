"""What :func:`restore` leaves behind for the objects it filled: the log and step they hold
(so a :class:`DiffCheckpointer` opened on them continues that log, or refuses to mix
histories) and the error-feedback residuals a compressor attached later should take."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass
class RestoreInfo:
    """The state :func:`restore` put into an optimizer (and its model)."""

    path: str
    log_id: bytes
    step: int
    digest: int
    exact: bool
    residuals: dict[torch.Tensor, torch.Tensor] | None = None
    notes: list[str] = field(default_factory=list)


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
    if info is None or info.residuals is None:
        return None
    res, info.residuals = info.residuals, None
    return res


__all__ = ["RestoreInfo", "forget", "pending_residuals", "remember", "restored"]
