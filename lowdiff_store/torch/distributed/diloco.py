"""DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023), implemented from the paper: every replica takes H inner steps with its own
optimizer (AdamW in the paper), then all replicas average their *pseudo-gradients*
``global - local`` (one all-reduce) and one outer optimizer (SGD with Nesterov momentum)
steps the shared global parameters with it; every replica restarts from the new global
parameters.

Why the project's own wrapper rather than ``torchft.local_sgd.DiLoCo``: torchft's runs
under a ``torchft.Manager``, whose quorum service decides per synchronization whether the
outer step commits, and keeps its global copy and outer state inside its fragments; a
checkpoint of it would record the manager's decisions as well as the arithmetic. This
wrapper is the paper's algorithm with every piece of state in plain attributes the
checkpointer logs (``docs/local_update.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError
from .qsr import QSRSchedule


class DiLoCo:
    """The DiLoCo optimizer: ``inner`` steps every call; every H-th call also synchronizes.

    Args:
        inner: the replica's optimizer (e.g. ``AdamW``) over the model's parameters.
        outer_lr, outer_momentum: the outer ``SGD(nesterov=True)``'s hyperparameters (the
            paper uses 0.7 and 0.9).
        period: H, an int >= 1, or a :class:`QSRSchedule` (H chosen at each sync).
        process_group: the group averaging the pseudo-gradients (default: the world).

    Use it as an optimizer: ``loss.backward(); diloco.step(); diloco.zero_grad()``.
    ``synced`` says whether the last ``step()`` synchronized.
    """

    def __init__(self, inner: torch.optim.Optimizer, *, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, period: int | QSRSchedule = 500,
                 process_group: Any = None) -> None:
        if isinstance(period, QSRSchedule):
            self.schedule: QSRSchedule | None = period
            first = period.h_base
        elif type(period) is int and period >= 1:
            self.schedule = None
            first = period
        else:
            raise ConfigError(f"period must be an int >= 1 or a QSRSchedule, got {period!r}")
        self.optim = inner
        self.process_group = process_group
        self.params = [p for g in inner.param_groups for p in g["params"]]
        with torch.no_grad():
            self.global_params = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.global_params, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=True)
        self.steps = 0          # inner steps taken
        self.period = first     # H of the current local phase
        self.next_sync = first  # the inner step count at which the next sync happens
        self.syncs = 0
        self.synced = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (a scheduler drives the inner lr)."""
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's state."""
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; at the end of a local phase, the outer synchronization."""
        out = self.optim.step(closure) if closure is not None else self.optim.step()
        self.steps += 1
        self.synced = self.steps >= self.next_sync
        if self.synced:
            self.sync()
        return out

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients ``global - local`` over the group, take one outer
        step on the global parameters, and restart every replica from them."""
        world = dist.get_world_size(self.process_group) \
            if dist.is_available() and dist.is_initialized() else 1
        for g, p in zip(self.global_params, self.params, strict=True):
            pseudo = g - p
            if world > 1:
                dist.all_reduce(pseudo, op=dist.ReduceOp.SUM, group=self.process_group)
                pseudo.div_(world)
            g.grad = pseudo
        self.outer.step()
        for g, p in zip(self.global_params, self.params, strict=True):
            p.copy_(g)
        self.syncs += 1
        self.period = self.schedule.period() if self.schedule is not None else self.period
        self.next_sync = self.steps + self.period

    def config(self) -> dict[str, Any]:
        """What a log of this run records about the method (compared at restore)."""
        grp = self.outer.param_groups[0]
        return {"outer": "torch.optim.SGD", "outer_lr": float(grp["lr"]),
                "outer_momentum": float(grp["momentum"]), "nesterov": bool(grp["nesterov"]),
                "period": None if self.schedule is not None else self.period,
                "qsr": self.schedule.config() if self.schedule is not None else None}


__all__ = ["DiLoCo"]
