"""The Quadratic Synchronization Rule (Gu et al., "A Quadratic Synchronization Rule for
Distributed Deep Learning", 2023): between two synchronizations each worker takes H local
steps, with H set at every synchronization from the current learning rate,

    H = max(h_base, floor((alpha / lr) ** 2))

so H grows as 1 / lr^2 while the learning rate decays. :class:`QSRSchedule` computes H;
:class:`QSRModelAverager` is a :class:`~torch.distributed.algorithms.model_averaging.
averagers.PeriodicModelAverager` (usable wherever one is, e.g. inside
``PostLocalSGDOptimizer``) whose period follows the schedule; the project's
:class:`~lowdiff_store.torch.distributed.diloco.DiLoCo` takes a schedule as its period.

The checkpointer logs every period H chosen (``docs/local_update.md``) and restore puts the
averager's step, next synchronization and current H back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.algorithms.model_averaging import utils as avg_utils
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from ...errors import ConfigError


def qsr_period(lr: float, h_base: int, alpha: float) -> int:
    """H = max(h_base, floor((alpha / lr) ** 2)) for a positive ``lr``."""
    if not lr > 0.0:
        raise ConfigError(f"QSR needs a positive learning rate, got {lr!r}")
    return max(int(h_base), math.floor((alpha / lr) ** 2))


class QSRSchedule:
    """The averaging period of the next local phase from the current learning rate.

    Args:
        lr: the learning-rate source: a ``torch.optim.Optimizer`` (its first param
            group's ``lr``) or a callable returning it.
        h_base: the smallest period (the paper's H_base, >= 1).
        alpha: the rule's growth coefficient (> 0).
    """

    def __init__(self, lr: torch.optim.Optimizer | Callable[[], float], *, h_base: int,
                 alpha: float) -> None:
        if type(h_base) is not int or h_base < 1:
            raise ConfigError(f"h_base must be an int >= 1, got {h_base!r}")
        if not alpha > 0.0:
            raise ConfigError(f"alpha must be > 0, got {alpha!r}")
        self.h_base = h_base
        self.alpha = float(alpha)
        self._lr = lr

    def current_lr(self) -> float:
        """The learning rate the rule reads now."""
        src = self._lr
        if isinstance(src, torch.optim.Optimizer):
            return float(src.param_groups[0]["lr"])
        return float(src())

    def period(self) -> int:
        """H for a local phase starting now."""
        return qsr_period(self.current_lr(), self.h_base, self.alpha)

    def config(self) -> dict[str, Any]:
        """The rule's parameters, as the log records them."""
        return {"h_base": self.h_base, "alpha": self.alpha}


class QSRModelAverager(PeriodicModelAverager):
    """Periodic model averaging with the period set by a :class:`QSRSchedule`.

    Averaging happens at averager step ``warmup_steps`` and then every H steps, H read from
    the schedule at each averaging (``self.period`` holds the current H, ``self.next_sync``
    the averager step of the next averaging). ``average_parameters`` is called once per
    optimizer step, as ``PostLocalSGDOptimizer`` does.
    """

    def __init__(self, schedule: QSRSchedule, warmup_steps: int = 0,
                 process_group: Any = None) -> None:
        super().__init__(period=max(2, schedule.h_base), warmup_steps=warmup_steps,
                         process_group=process_group)
        self.schedule = schedule
        self.period = schedule.h_base
        self.next_sync = warmup_steps

    def will_average(self) -> bool:
        """Whether the next ``average_parameters`` call averages."""
        return self.step >= self.warmup_steps and self.step == self.next_sync

    def average_parameters(self, params: Iterable[Any]) -> None:
        """Average ``params`` over the process group when a synchronization is due (then
        choose the next period), and count the step."""
        if self.will_average():
            avg_utils.average_parameters_or_parameter_groups(params, self.process_group)
            self.period = self.schedule.period()
            self.next_sync = self.step + self.period
        self.step += 1


__all__ = ["QSRModelAverager", "QSRSchedule", "qsr_period"]
