"""The public :func:`restore`: replay (:mod:`._replay`) plus what a training script needs
around it: wrapped optimizers, ``missing_ok`` for a first run, stateful extras."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, overload

import torch

from ..log.latest import latest_step
from . import _replay
from ._replay import RestoreResult
from .compress import TopKCompressor
from .optim_wrap import unwrap_optimizer
from .stateful import load_stateful


@overload
def restore(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any, *,
            scheduler: Any = ..., scaler: Any = ..., step: int | None = ...,
            compressor: TopKCompressor | None = ..., verify: bool = ...,
            extra_state: Mapping[str, Any] | None = ..., missing_ok: Literal[False] = ...
            ) -> RestoreResult: ...


@overload
def restore(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any, *,
            scheduler: Any = ..., scaler: Any = ..., step: int | None = ...,
            compressor: TopKCompressor | None = ..., verify: bool = ...,
            extra_state: Mapping[str, Any] | None = ..., missing_ok: bool
            ) -> RestoreResult | None: ...


def restore(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any, *,
            scheduler: Any = None, scaler: Any = None, step: int | None = None,
            compressor: TopKCompressor | None = None, verify: bool = True,
            extra_state: Mapping[str, Any] | None = None, missing_ok: bool = False
            ) -> RestoreResult | None:
    """Put the state of ``step`` (default: the newest durable step) into the objects.

    Loads the nearest base at or before ``step`` and replays the diffs after it through
    ``optimizer`` itself (grad mode) or applies them (delta mode). Parameters, buffers,
    optimizer state, scheduler, scaler and RNG states are set bit for bit; gradients are
    left as None. Every recorded digest on the way is checked (``verify``); a mismatch
    raises ``ReplayError(replay_diverged)`` naming the step. The log is only read; a
    :class:`DiffCheckpointer` created next on the same objects continues it from ``step``.

    ``optimizer`` may be a trainer's wrapper (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``): the optimizer inside is used. ``extra_state``: the
    dict of stateful objects given to the checkpointer; each gets ``load_state_dict`` of
    its recorded state. ``missing_ok=True``: a missing or empty directory, or a log with
    no base yet, returns None instead of raising, so a script needs no existence check.

    Error-feedback residuals of a compressor go to ``compressor`` if given, otherwise to
    the next :class:`TopKCompressor` attached to ``optimizer``; see docs/torch.md.
    """
    optimizer = unwrap_optimizer(optimizer)
    if missing_ok and step is None and latest_step(path) is None:
        return None
    res = _replay.restore(path, model, optimizer, scheduler=scheduler, scaler=scaler,
                          step=step, compressor=compressor, verify=verify)
    if extra_state is not None:
        res.notes += load_stateful(extra_state, res.extra)
    return res


__all__ = ["restore"]
