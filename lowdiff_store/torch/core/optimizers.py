"""Optimizers as trainers hand them over, and ``step(closure)`` in grad mode.

Trainers wrap the optimizer: accelerate's ``AcceleratedOptimizer`` (a subclass of
``torch.optim.Optimizer`` that never runs its ``__init__``, so it has no step hooks) and
Lightning's ``LightningOptimizer`` hold the real one under ``optimizer`` / ``_optimizer``.
:func:`unwrap_optimizer` finds it; the checkpointer hooks, and replay steps, that one.

A closure re-evaluates the loss and the gradients inside ``optimizer.step``, after the
step pre-hooks ran, so grad mode cannot capture the gradient there. The pre-hook instead
hands the optimizer a wrapped closure (:func:`wrap_closure`) that captures the gradients
right after the user's closure returns: they are exactly what the step then consumes.
An optimizer that calls its closure more than once per step (LBFGS) would consume
several gradients; that is refused.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...errors import ConfigError, Reason

#: Attributes under which a wrapper exposes the optimizer it wraps (accelerate, Lightning).
WRAPPED_ATTRS = ("optimizer", "_optimizer")

def imported_classes(module: str, name: str) -> tuple[type, ...]:
    """``(module.name,)`` when ``module`` has been imported in this process, else ``()``:
    for ``isinstance`` checks against a class that an object can only be an instance of
    if its module was imported. Importing ``torch.distributed.optim`` compiles its
    functional optimizers with TorchScript, a cost every process of a job would pay on
    each restore for a check that is False unless the user imported it."""
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return (cls,) if isinstance(cls, type) else ()


#: Optimizers whose ``step`` calls the closure several times (refused in grad mode).
MULTI_CALL = (torch.optim.LBFGS,)


def step_reads_grads_only(optimizer: torch.optim.Optimizer, *, grad_scale: bool = False
                          ) -> bool:
    """True when ``optimizer.step()`` is known to only read the parameters' ``.grad``
    tensors, never write them: torch's own Adam, AdamW and SGD, except

    - SGD with Nesterov momentum and neither weight decay nor ``maximize``, unless fused:
      its foreach implementation adds the momentum into each ``.grad``;
    - a ``fused`` group given a ``grad_scale`` (a ``GradScaler`` stepping a fused
      optimizer): the fused kernel stores the unscaled gradients back, without moving
      their version counters;
    - a ``differentiable`` group, or one with a hyperparameter tensor that requires grad
      (SGD then adds the weight decay into ``.grad`` with ``addcmul_``).

    Exact classes only: a subclass may override ``step``; any other optimizer may write
    its gradients. ``grad_scale``: the step gets one (``optimizer.grad_scale`` is a
    tensor).

    What depends on it: replay lends an optimizer the log's mapped gradients only then
    (a write would change the private map that a second pass reads again), and the
    checkpointer copies CPU gradients beside the step only then (a write during the copy
    would tear it)."""
    cls = type(optimizer)
    if cls not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return False
    for g in optimizer.param_groups:
        if g.get("differentiable") or (g.get("fused") and grad_scale):
            return False
        if any(isinstance(v, torch.Tensor) and v.requires_grad
               for k, v in g.items() if k != "params"):
            return False
        if cls is torch.optim.SGD and not g.get("fused") and g.get("nesterov") \
                and g.get("momentum") and not g.get("weight_decay") \
                and not g.get("maximize"):
            return False
    return True


def _name(obj: object) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _hooked(obj: object) -> bool:
    """A real ``torch.optim.Optimizer``: its ``__init__`` ran, so step hooks work."""
    return isinstance(obj, torch.optim.Optimizer) and \
        "_optimizer_step_pre_hooks" in vars(obj)


def _inner(obj: object) -> torch.optim.Optimizer | None:
    for attr in WRAPPED_ATTRS:
        try:
            inner = getattr(obj, attr, None)
        except Exception:  # a property that fails is no exposed optimizer
            inner = None
        if isinstance(inner, torch.optim.Optimizer) and inner is not obj:
            return inner
    return None


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The real optimizer behind ``optimizer``.

    A wrapper (no step hooks of its own, or sharing its ``param_groups`` with the object
    it exposes under ``optimizer`` / ``_optimizer``) is peeled off, repeatedly. Anything
    that is not a working ``torch.optim.Optimizer`` and exposes none raises
    ``ConfigError(not_allowed)`` naming its class. Nothing is touched.
    """
    cur: Any = optimizer
    for _ in range(16):
        inner = _inner(cur)
        if inner is not None and (not _hooked(cur)
                                  or getattr(cur, "param_groups", None) is inner.param_groups):
            cur = inner
            continue
        if _hooked(cur):
            return cur  # type: ignore[no-any-return]
        break
    raise ConfigError(
        f"{_name(optimizer)} is not a torch.optim.Optimizer with step hooks and exposes "
        f"none (as .optimizer or ._optimizer): it cannot be checkpointed",
        reason=Reason.NOT_ALLOWED)


def check_optimizer(optimizer: torch.optim.Optimizer, mode: str) -> None:
    """Refusals known before anything is written: optimizers that evaluate their closure
    several times per step cannot be logged as one gradient (grad mode)."""
    if mode == "grad" and isinstance(optimizer, MULTI_CALL):
        raise ConfigError(
            f"{_name(optimizer)} evaluates its closure several times per step, so no single "
            f"gradient describes the step: use mode='delta'", reason=Reason.NOT_ALLOWED)


def closure_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Callable[[], Any] | None:
    """The closure ``optimizer.step`` was called with (``step(None)`` is a plain step).
    ``args`` as a step pre-hook receives them: the optimizer first."""
    if len(args) > 1:
        return args[1]  # type: ignore[no-any-return]
    return kwargs.get("closure")


def wrap_closure(args: tuple[Any, ...], kwargs: dict[str, Any], closure: Callable[[], Any],
                 capture: Callable[[], None], optimizer: object
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``optimizer.step`` with ``closure`` replaced by one that runs
    it, then ``capture()`` (the gradients it produced); a second call in the same step
    raises ``ConfigError(not_allowed)``."""
    calls = 0

    def wrapped() -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise ConfigError(
                f"{_name(optimizer)}.step called its closure a second time in one step: "
                f"a step that consumes several gradients cannot be logged in mode='grad'; "
                f"use mode='delta'", reason=Reason.NOT_ALLOWED)
        out = closure()
        capture()
        return out

    if len(args) > 1:
        return (args[0], wrapped, *args[2:]), kwargs
    return args, {**kwargs, "closure": wrapped}


__all__ = ["check_optimizer", "closure_of", "unwrap_optimizer", "wrap_closure"]
