"""Staging a base from the live objects: a consistent copy of the full state after a step,
taken in the step's post-hook and handed to the writer (which owns the arrays from then on)
when the step's record goes. Laid out as
:func:`~lowdiff_store.torch.replay.materialize.materialize_base` lays out a base made from
the log."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..replay.materialize import live_base_arrays, residual_tensors
from .grad_capture import GradSource


@dataclass
class StagedBase:
    """The state after ``step``: ``arrays`` (name -> (dtype tag, array)), ``opt`` (the
    optimizer's layout and non-tensor state for the base metadata), ``nbytes``."""

    step: int
    arrays: dict[str, tuple[str, np.ndarray]]
    opt: dict[str, Any]
    nbytes: int


class BaseStager:
    """Stages bases of the tensors one checkpointer logs: ``model`` (its model tensors),
    ``names``/``params`` (its optimizer parameters), the compressor's residuals and the
    gradient source's state. :meth:`stage` copies; :meth:`release` is called once the
    writer took a staged base, and :attr:`in_flight` counts those not yet handed over."""

    def __init__(self, model: Mapping[str, torch.Tensor], names: list[str],
                 params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 compressor: Any, source: GradSource | None) -> None:
        self._model, self._names, self._params = model, names, params
        self._optimizer, self._compressor, self._source = optimizer, compressor, source
        self.in_flight = 0

    def stage(self, step: int) -> StagedBase:
        """A copy of the state after ``step`` (call it between the step and the next)."""
        comp = self._compressor
        res = residual_tensors(self._names, self._params, comp.residuals) \
            if comp is not None and comp.error_feedback else {}
        arrays, opt = live_base_arrays(self._model, self._names, self._params,
                                       self._optimizer, res)
        if self._source is not None:
            arrays.update(self._source.base_tensors())
        self.in_flight += 1
        return StagedBase(step, arrays, opt, sum(a.nbytes for _t, a in arrays.values()))

    def release(self, base: StagedBase) -> None:
        """``base`` was handed to the writer, which owns its arrays from now on."""
        self.in_flight -= 1


__all__ = ["BaseStager", "StagedBase"]
