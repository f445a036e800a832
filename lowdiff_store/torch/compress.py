"""Top-k gradient compression with error feedback, as LowDiff's training consumes it.

Each step, for every parameter with a gradient: ``acc = grad + residual`` (error feedback)
or ``acc = grad``; keep the ``k = max(1, int(numel * ratio))`` entries of largest
magnitude; the optimizer then consumes a gradient that is zero except at those entries,
and the residual becomes ``acc`` with those entries zeroed. The sparse message (indices
and values) is what a :class:`~lowdiff_store.torch.DiffCheckpointer` logs: replaying it
rebuilds the consumed gradient bit for bit (zeros, then the values at the indices).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import ConfigError, Reason


class TopKCompressor:
    """Per-tensor top-k sparsification of the gradients an optimizer consumes.

    Args:
        ratio: fraction of each tensor's entries kept (``0 < ratio <= 1``).
        error_feedback: accumulate what was dropped into a per-parameter residual that is
            added to the next step's gradient.

    Use ``comp.attach(optimizer)`` for training without a checkpointer; with
    ``DiffCheckpointer(..., compressor=comp)`` the checkpointer attaches it itself.
    """

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True) -> None:
        if not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
            raise ConfigError(f"ratio={ratio!r} must be in (0, 1]")
        self.ratio = float(ratio)
        self.error_feedback = bool(error_feedback)
        #: residual per parameter (error feedback); keys are the parameters themselves
        self.residuals: dict[torch.Tensor, torch.Tensor] = {}
        #: the last step's sparse message per parameter: (int64 flat indices, values)
        self.last: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._wrote: dict[torch.Tensor, tuple[int, int]] = {}  # (id, version) of the grad
        self._handle: RemovableHandle | None = None
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = None

    def config(self) -> dict[str, Any]:
        """The settings, as recorded in a log."""
        return {"kind": "topk", "ratio": self.ratio, "error_feedback": self.error_feedback}

    def k_for(self, numel: int) -> int:
        """Entries kept for a tensor of ``numel`` elements."""
        return min(numel, max(1, int(numel * self.ratio)))

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer this compressor is attached to, if any."""
        return self._optimizer() if self._optimizer is not None else None

    def attach(self, optimizer: torch.optim.Optimizer) -> TopKCompressor:
        """Compress every gradient ``optimizer`` consumes from now on (a step pre-hook).

        If ``optimizer`` was just restored from a log with this compressor's residuals,
        they are loaded here (see :func:`~lowdiff_store.torch.restore`).
        """
        if self._handle is not None:
            if self.optimizer is optimizer:
                return self
            raise ConfigError("this compressor is already attached to another optimizer",
                              reason=Reason.NOT_ALLOWED)
        # The hook owns the compressor: `TopKCompressor(...).attach(opt)` without keeping a
        # reference must go on compressing (a weak reference silently stopped it).
        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.compress(opt)

        self._handle = optimizer.register_step_pre_hook(hook)
        self._optimizer = weakref.ref(optimizer)
        from ._registry import pending_residuals

        res = pending_residuals(optimizer)
        if res is not None and not self.residuals:
            self.residuals = res
        return self

    def detach(self) -> None:
        """Stop compressing (the residuals are kept)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            self._optimizer = None

    @torch.no_grad()
    def compress(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace every gradient of ``optimizer`` by its top-k part, in place."""
        self.last = {}
        self._wrote = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise ConfigError("TopKCompressor does not take sparse gradients",
                                      reason=Reason.NOT_ALLOWED)
                r = self.residuals.get(p) if self.error_feedback else None
                acc = g + r if r is not None else (g.clone() if self.error_feedback else g)
                flat = acc.reshape(-1)
                k = self.k_for(flat.numel())
                idx = torch.topk(flat.abs(), k, sorted=False).indices
                vals = flat[idx]
                if self.error_feedback:
                    flat[idx] = 0
                    self.residuals[p] = acc
                if g.is_contiguous():
                    g.zero_()
                    g.view(-1)[idx] = vals
                else:  # e.g. channels_last: build in C order, as replay does
                    dense = torch.zeros(flat.numel(), dtype=g.dtype, device=g.device)
                    dense[idx] = vals
                    g.copy_(dense.view(g.shape))
                self.last[p] = (idx, vals)
                self._wrote[p] = (id(g), g._version)

    def message(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sparse message ``p.grad`` holds now: (indices, values) from the last
        :meth:`compress`, or None when the gradient is not that output any more (replaced
        or modified in place since, or not compressed)."""
        g = p.grad
        msg = self.last.get(p)
        if g is None or msg is None or self._wrote.get(p) != (id(g), g._version):
            return None
        return msg

    def residual_of(self, p: torch.Tensor) -> torch.Tensor:
        """The residual of ``p`` (zeros when none has built up yet)."""
        r = self.residuals.get(p)
        return r if r is not None else torch.zeros_like(p)


__all__ = ["TopKCompressor"]
