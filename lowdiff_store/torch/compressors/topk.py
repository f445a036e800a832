"""Gradient compressors whose output training consumes and the log stores (LowDiff's reuse).

A compressor is a step pre-hook on the optimizer: it replaces every gradient by what a
compressed communication would deliver, and keeps the message it built, so a
:class:`~lowdiff_store.torch.DiffCheckpointer` logs the message (not the dense gradient)
and replay rebuilds the consumed gradient bit for bit from it. Local state a message does
not carry (error feedback, DeMo's momentum) is the compressor's ``residuals``: written into
every base (``@ef/NAME``) and, with ``ef_state="step"``, into every record.

:class:`TopKCompressor` is here;
:class:`~lowdiff_store.torch.compressors.quantized.TernGradCompressor`,
:class:`~lowdiff_store.torch.compressors.quantized.QSGDCompressor` and
:class:`~lowdiff_store.torch.compressors.demo.DeMoCompressor` follow the same contract
(:class:`GradCompressor`).

Top-k: each step, for every parameter with a gradient: ``acc = grad + residual`` (error
feedback) or ``acc = grad``; keep the ``k = max(1, int(numel * ratio))`` entries of largest
magnitude; the optimizer then consumes a gradient that is zero except at those entries,
and the residual becomes ``acc`` with those entries zeroed. The sparse message (indices
and values) is what the checkpointer logs.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch.utils.hooks import RemovableHandle

from ... import codecs
from ...codecs.batch import Recipe, encode_topk
from ...errors import ConfigError, Reason
from ...torchmeta.names import GRAD
from ..core.specs import Spec
from ..core.step_batch import SparseSlot, StepBatch
from ..core.tensors import bits_tensor
from .select import SELECTORS, select

#: param_groups[0] key holding a stochastic compressor's generator position (see
#: :meth:`GradCompressor.generator`)
RNG_KEY = "lowdiff_rng"


class GradCompressor:
    """Base of the compressors a checkpointer can log (see the module docstring).

    Subclasses set :attr:`kind`, implement :meth:`config` and :meth:`_compress_param`
    (replace ``p.grad`` in place with device work only, and return the message: a
    :class:`~lowdiff_store.torch.core.step_batch.Message` whose device tensors go to the
    step's batch and whose ``encode`` runs on the writer's encoder thread; decoded, it
    is what ``p.grad`` now holds). No compressor reads a device value back on the
    training thread (``tests/torch/test_host_sync.py``).
    """

    #: the name recorded in a log's metadata (``compressor.kind``)
    kind: ClassVar[str] = ""
    #: codec name recorded as the log's ``grad_codec`` (the main one; small tensors raw)
    grad_codec: ClassVar[str] = "raw"

    def __init__(self, error_feedback: bool) -> None:
        self.error_feedback = bool(error_feedback)
        #: residual per parameter (error feedback); keys are the parameters themselves
        self.residuals: dict[torch.Tensor, torch.Tensor] = {}
        #: the last step's message per parameter
        self.last: dict[torch.Tensor, Any] = {}
        self._wrote: dict[torch.Tensor, tuple[int, int]] = {}  # (id, version) of the grad
        self._handle: RemovableHandle | None = None
        self._post: RemovableHandle | None = None
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = None

    def config(self) -> dict[str, Any]:
        """The settings, as recorded in a log."""
        raise NotImplementedError

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer this compressor is attached to, if any."""
        return self._optimizer() if self._optimizer is not None else None

    def attach(self, optimizer: torch.optim.Optimizer) -> GradCompressor:
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

        def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._after_step(opt)

        self._handle = optimizer.register_step_pre_hook(hook)
        self._post = optimizer.register_step_post_hook(post)
        self._optimizer = weakref.ref(optimizer)
        from ..core.registry import pending_residuals

        res = pending_residuals(optimizer)
        if res is not None and not self.residuals:
            self.residuals = res
        return self

    def detach(self) -> None:
        """Stop compressing (the residuals are kept)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            if self._post is not None:
                self._post.remove()
                self._post = None
            self._optimizer = None

    @torch.no_grad()
    def compress(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace every gradient of ``optimizer`` by its compressed form, in place."""
        self.last = {}
        self._wrote = {}
        self._begin(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise ConfigError(f"{type(self).__name__} does not take sparse gradients",
                                      reason=Reason.NOT_ALLOWED)
                msg = self._compress_param(p, g, group)
                if msg is not None:
                    self.last[p] = msg
                    self._wrote[p] = (id(g), g._version)

    def _begin(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once per step before the parameters are compressed."""

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called after each ``optimizer.step()`` (a step post-hook)."""

    def _compress_param(self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any]
                        ) -> Any:
        raise NotImplementedError

    def message(self, p: torch.Tensor) -> Any:
        """The message ``p.grad`` holds now (from the last :meth:`compress`), or None when
        the gradient is not that output any more (replaced or modified in place since, or
        not compressed: then it is logged densely)."""
        g = p.grad
        msg = self.last.get(p)
        if g is None or msg is None or self._wrote.get(p) != (id(g), g._version):
            return None
        return msg

    def specs(self, p: torch.Tensor, name: str, zstd: int | None, batch: StepBatch
              ) -> list[Spec] | None:
        """The record tensor logging ``p``'s current gradient (``@grad/NAME`` in the
        message's codec, its device tensors put into ``batch``), or None (then it is
        logged densely)."""
        msg = self.message(p)
        if msg is None:
            return None
        return [batch.spec(GRAD + name, msg.tag, tuple(p.shape), msg, zstd, msg.nbytes)]

    def residual_of(self, p: torch.Tensor) -> torch.Tensor:
        """The residual of ``p`` (zeros when none has built up yet)."""
        r = self.residuals.get(p)
        return r if r is not None else torch.zeros_like(p)

    # -- stochastic rounding

    @staticmethod
    def generator(optimizer: torch.optim.Optimizer, seed: int,
                  device: torch.device | str = "cpu") -> torch.Generator:
        """This step's generator: seeded from ``(seed, position)``, where the position (how
        many steps drew from it so far) lives in ``optimizer.param_groups[0]["lowdiff_rng"]``
        (advanced by :meth:`advance` after the step, so a checkpointer records it as part
        of the step: a hyperparameter, in the step's side channel and in every base, and
        restored with them; ``optimizer.state_dict()`` holds it too). One generator per
        ``device`` (the draws of a CUDA generator are not a CPU one's)."""
        pos = int(optimizer.param_groups[0].get(RNG_KEY, 0))
        return torch.Generator(device=device).manual_seed(
            (int(seed) * 1_000_003 + pos) % (2 ** 63))

    @staticmethod
    def advance(optimizer: torch.optim.Optimizer) -> None:
        """Move the generator position of :meth:`generator` on by one step."""
        g0 = optimizer.param_groups[0]
        g0[RNG_KEY] = int(g0.get(RNG_KEY, 0)) + 1


def decode_message(enc: codecs.Encoded, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor a logged message decodes to (with the codec replay uses)."""
    arr = codecs.decode(enc.codec, enc.params, [p.data for p in enc.parts], "F32", shape)
    return torch.from_numpy(arr)


class TopKCompressor(GradCompressor):
    """Per-tensor top-k sparsification of the gradients an optimizer consumes.

    Args:
        ratio: fraction of each tensor's entries kept (``0 < ratio <= 1``).
        error_feedback: accumulate what was dropped into a per-parameter residual that is
            added to the next step's gradient.
        selector: ``"exact"`` (``torch.topk``) or ``"sampled"`` (a sampled threshold then
            an exact trim: the same ``k`` entries, several times faster on CPU; see
            :mod:`lowdiff_store.torch.compressors.select`).

    Use ``comp.attach(optimizer)`` for training without a checkpointer; with
    ``DiffCheckpointer(..., compressor=comp)`` the checkpointer attaches it itself.
    """

    kind = "topk"
    grad_codec = "sparse"

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True,
                 selector: str = "exact") -> None:
        if not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
            raise ConfigError(f"ratio={ratio!r} must be in (0, 1]")
        if selector not in SELECTORS:
            raise ConfigError(f"selector={selector!r} must be one of {list(SELECTORS)}")
        super().__init__(error_feedback)
        self.ratio = float(ratio)
        self.selector = selector

    def config(self) -> dict[str, Any]:
        """The settings, as recorded in a log (the selector only when not exact, so logs
        written before it existed stay compatible)."""
        out: dict[str, Any] = {"kind": "topk", "ratio": self.ratio,
                               "error_feedback": self.error_feedback}
        if self.selector != "exact":
            out["selector"] = self.selector
        return out

    def k_for(self, numel: int) -> int:
        """Entries kept for a tensor of ``numel`` elements."""
        return min(numel, max(1, int(numel * self.ratio)))

    def _compress_param(self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any]
                        ) -> TopKMessage:
        r = self.residuals.get(p) if self.error_feedback else None
        acc = g
        if self.error_feedback:  # C order, so that the flat view below zeroes the entries
            # sent in the residual itself (a channels_last one would be flattened by a copy)
            acc = (g + r).contiguous() if r is not None else \
                g.clone(memory_format=torch.contiguous_format)
        flat = acc.reshape(-1)
        k = self.k_for(flat.numel())
        idx = select(self.selector, flat.abs(), k)
        vals = flat.index_select(0, idx)
        if self.error_feedback:
            # (not ``flat[idx] = 0``: on CUDA, a Python scalar assigned through a tensor
            # index is copied to the device and waited for, one host sync per tensor)
            flat.index_fill_(0, idx, 0)
            self.residuals[p] = acc
        if g.is_contiguous():
            g.zero_()
            g.view(-1).index_copy_(0, idx, vals)
        else:  # e.g. channels_last: build in C order, as replay does
            dense = torch.zeros(flat.numel(), dtype=g.dtype, device=g.device)
            dense.index_copy_(0, idx, vals)
            g.copy_(dense.view(g.shape))
        return TopKMessage(idx, vals, flat.numel())


class TopKMessage:
    """A top-k message: the indices (unique, any order) and values of one tensor of
    ``numel`` elements, on its device. Shipped as a sparse pair of the step batch (sorted
    there by one batched sort on a GPU, or by the encoder thread's batched sort on CPU); the
    codec stores the first index and the gaps, computed for the whole step at once
    (:meth:`~lowdiff_store.torch.core.step_batch.StepBatch.sparse_stored`)."""

    __slots__ = ("idx", "numel", "slot", "tag", "vals", "values")

    def __init__(self, idx: torch.Tensor, vals: torch.Tensor, numel: int) -> None:
        self.idx, self.numel, self.values = idx, numel, vals
        self.tag, self.vals = bits_tensor(vals, "top-k values")  # (bits: bf16 as int16)
        self.slot: SparseSlot | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes of the message (int64 indices and the values)."""
        return self.idx.numel() * (8 + self.vals.element_size())

    def __iter__(self) -> Iterator[torch.Tensor]:
        """``indices, values = message`` (on the device; the values as the gradient's
        dtype)."""
        return iter((self.idx, self.values))

    def __getitem__(self, i: int) -> torch.Tensor:
        """``message[0]``: the indices, ``message[1]``: the values."""
        return (self.idx, self.values)[i]

    def ship(self, batch: StepBatch) -> None:
        """Put the pair into ``batch``."""
        self.slot = batch.add_sparse(self.idx, self.vals, self.numel)

    def recipe(self) -> Recipe:
        """``topk`` (:mod:`lowdiff_store.codecs.batch`)."""
        assert self.slot is not None
        return "topk", (self.slot,), (self.numel, self.tag)

    def encode(self, batch: StepBatch) -> codecs.Encoded:
        """The ``sparse`` tensor (on the encoder thread; :func:`~lowdiff_store.codecs.
        batch.encode_topk`: the index part made for the step's whole batch)."""
        assert self.slot is not None
        return encode_topk(batch.host, self.slot, self.numel, self.tag)


__all__ = ["RNG_KEY", "GradCompressor", "TopKCompressor", "TopKMessage", "decode_message"]
