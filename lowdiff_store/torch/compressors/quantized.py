"""Quantizing gradient compressors: TernGrad and QSGD (same contract as
:class:`~lowdiff_store.torch.TopKCompressor`). Their messages are logged as ``@grad/NAME``
in the ``tern`` and ``qsgd`` codecs (``format_spec/codecs.md``): 2 bits per entry plus one
fp32 scale per tensor, and ``1 + ceil(log2(s + 1))`` bits per entry plus one fp32 norm per
bucket. Training consumes the codec's decode of the message it logged, so replay rebuilds
the consumed gradient bit for bit.

Both round stochastically. Their random draws come from a generator re-seeded every step
from ``(seed, position)`` (:meth:`GradCompressor.generator`); the position is an entry of
``optimizer.param_groups[0]`` and so travels with the step's side channel and every base:
training continued after :func:`~lowdiff_store.torch.restore` draws exactly what the
uninterrupted run drew. Without error feedback both are unbiased (the expected consumed
gradient is the gradient) and keep no other state.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import codecs
from ...codecs.batch import Recipe, encode_qsgd_msg, encode_tern
from ...errors import ConfigError
from ..core.step_batch import Slot, StepBatch
from .topk import GradCompressor


class TernMessage:
    """A TernGrad message on its device: int8 codes in {-1, 0, 1} and the float32 scale
    (a 0-d tensor, read by the encoder thread only)."""

    tag = "F32"
    __slots__ = ("codes", "scale", "slots")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        self.codes, self.scale = codes, scale
        self.slots: tuple[Slot, Slot] | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes of the message."""
        return self.codes.numel() + 4

    def decoded(self) -> torch.Tensor:
        """What the ``tern`` codec decodes the message to (``code * scale`` in float32),
        computed on the device: the same bits as the host decode."""
        return self.codes.to(torch.float32) * self.scale

    def ship(self, batch: StepBatch) -> None:
        """Put the codes and the scale into ``batch``."""
        self.slots = (batch.add(self.codes), batch.add(self.scale.reshape(1)))

    def recipe(self) -> Recipe:
        """``tern`` (:mod:`lowdiff_store.codecs.batch`)."""
        assert self.slots is not None
        return "tern", self.slots, ()

    def encode(self, batch: StepBatch) -> codecs.Encoded:
        """The ``tern`` tensor (on the encoder thread)."""
        assert self.slots is not None
        return encode_tern(batch.host, *self.slots)


class QsgdMessage:
    """A QSGD message on its device: int8 ``sign * level`` per entry and the float32
    norm of each bucket (read by the encoder thread only)."""

    tag = "F32"
    __slots__ = ("bucket", "levels", "norms", "signed", "slots")

    def __init__(self, signed: torch.Tensor, norms: torch.Tensor, levels: int, bucket: int
                 ) -> None:
        self.signed, self.norms, self.levels, self.bucket = signed, norms, levels, bucket
        self.slots: tuple[Slot, Slot] | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes of the message."""
        return self.signed.numel() + 4 * self.norms.numel()

    def decoded(self) -> torch.Tensor:
        """What the ``qsgd`` codec decodes the message to, on the device and with the
        codec's arithmetic: ``fl32(float64(norm) * level / s)``, negated for a sign."""
        n = self.signed.numel()
        lv = self.signed.abs().to(torch.float64)
        t = torch.nn.functional.pad(lv, (0, (-n) % self.bucket)).view(-1, self.bucket)
        t = t * self.norms.to(torch.float64).unsqueeze(1) / self.levels
        t = t.reshape(-1).narrow(0, 0, n)
        return torch.where(self.signed < 0, -t, t).to(torch.float32)

    def ship(self, batch: StepBatch) -> None:
        """Put the entries and the norms into ``batch``."""
        self.slots = (batch.add(self.signed), batch.add(self.norms))

    def recipe(self) -> Recipe:
        """``qsgd`` (:mod:`lowdiff_store.codecs.batch`)."""
        assert self.slots is not None
        return "qsgd", self.slots, (self.levels, self.bucket)

    def encode(self, batch: StepBatch) -> codecs.Encoded:
        """The ``qsgd`` tensor (on the encoder thread)."""
        assert self.slots is not None
        return encode_qsgd_msg(batch.host, *self.slots, self.levels, self.bucket)


def terngrad_codes(flat: torch.Tensor, gen: torch.Generator, clip: float | None
                   ) -> TernMessage:
    """TernGrad (Wen et al. 2017) of the flat float tensor ``flat``, on its device: clip to
    ``clip * std`` (None: no clipping), scale ``s = max |x|``, then entry i is
    ``s * sign(x_i)`` with probability ``|x_i| / s``, else 0. Nothing is read back."""
    x = flat.detach().to(torch.float32)
    n = x.numel()
    if clip is not None and n > 1:
        # float64 product, rounded to float32 as a clamp with a Python bound would
        bound = (x.std().to(torch.float64) * float(clip)).to(torch.float32)
        x = torch.where(bound > 0, x.clamp(-bound, bound), x)
    mag = x.abs()
    s = mag.max() if n else torch.zeros((), device=x.device)
    u = torch.rand(n, generator=gen, device=x.device)
    keep = u * s < mag   # u < |x| / s without a division; nothing kept when s == 0
    codes = torch.sign(x).to(torch.int8) * keep.to(torch.int8)
    return TernMessage(codes, s)


def qsgd_levels(flat: torch.Tensor, gen: torch.Generator, levels: int, bucket: int
                ) -> QsgdMessage:
    """QSGD (Alistarh et al. 2017) of ``flat``, on its device: per bucket of ``bucket``
    entries its L2 norm, per entry a sign and a level ``l`` in 0..s drawn so that
    ``E[norm * l / s] = |x|``. Nothing is read back."""
    x = flat.detach().to(torch.float32)
    n = x.numel()
    pad = (-n) % bucket
    xb = torch.nn.functional.pad(x, (0, pad)).view(-1, bucket)
    norms = torch.linalg.vector_norm(xb, dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    r = (xb.abs() / safe.unsqueeze(1) * float(levels)).reshape(-1).narrow(0, 0, n)
    low = r.floor()
    u = torch.rand(n, generator=gen, device=x.device)
    level = (low + (u < (r - low)).to(torch.float32)).clamp_(0, levels).to(torch.int8)
    return QsgdMessage(torch.where(x < 0, -level, level), norms, levels, bucket)


def terngrad_message(flat: torch.Tensor, gen: torch.Generator, clip: float | None
                     ) -> codecs.Encoded:
    """:func:`terngrad_codes` encoded as a ``tern`` tensor, on the host (the DDP hooks)."""
    m = terngrad_codes(flat, gen, clip)
    return codecs.encode_ternary(m.codes.cpu().numpy(), m.scale.reshape(1).cpu().numpy(),
                                 "F32", block=max(m.codes.numel(), 1))


def qsgd_message(flat: torch.Tensor, gen: torch.Generator, levels: int, bucket: int
                 ) -> codecs.Encoded:
    """:func:`qsgd_levels` encoded as a ``qsgd`` tensor, on the host (the DDP hooks)."""
    m = qsgd_levels(flat, gen, levels, bucket)
    return codecs.encode_qsgd(m.signed.cpu().numpy(), m.norms.cpu().numpy(), "F32",
                              levels=levels, bucket=bucket)


class _Quantizer(GradCompressor):
    """Shared by TernGrad and QSGD: small tensors stay dense; the consumed gradient is the
    decoded message, computed on the device with the codec's arithmetic (the error, with
    error feedback, goes to the residual)."""

    def __init__(self, seed: int, min_numel: int, error_feedback: bool) -> None:
        if type(min_numel) is not int or min_numel < 0:
            raise ConfigError(f"min_numel={min_numel!r} must be an int >= 0")
        super().__init__(error_feedback)
        self.seed = int(seed)
        self.min_numel = min_numel
        self._opt: torch.optim.Optimizer | None = None
        self._gens: dict[torch.device, torch.Generator] = {}

    def _begin(self, optimizer: torch.optim.Optimizer) -> None:
        self._opt = optimizer
        self._gens = {}

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._opt is not None:
            self.advance(optimizer)
            self._opt = None
            self._gens = {}

    def _gen(self, device: torch.device) -> torch.Generator:
        gen = self._gens.get(device)
        if gen is None:
            assert self._opt is not None
            gen = self._gens[device] = self.generator(self._opt, self.seed, device)
        return gen

    def _message(self, flat: torch.Tensor, gen: torch.Generator
                 ) -> TernMessage | QsgdMessage:
        raise NotImplementedError

    def _compress_param(self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any]
                        ) -> TernMessage | QsgdMessage | None:
        if g.numel() < self.min_numel or g.dtype != torch.float32:
            return None  # logged densely, consumed unchanged
        r = self.residuals.get(p) if self.error_feedback else None
        acc = g + r if r is not None else g
        msg = self._message(acc.reshape(-1), self._gen(g.device))
        # what replay decodes, with the codec's arithmetic: consumed == logged, bit for bit
        dec = msg.decoded().view(g.shape)
        if self.error_feedback:
            self.residuals[p] = acc - dec
        g.copy_(dec)
        return msg


class TernGradCompressor(_Quantizer):
    """TernGrad: every gradient tensor of at least ``min_numel`` entries becomes
    ``scale * {-1, 0, +1}`` (stochastic rounding), logged at 2 bits per entry plus one
    fp32 scale per tensor (layer).

    Args:
        clip: clip each tensor to ``clip`` standard deviations before scaling (the
            paper's ``c = 2.5``); None: no clipping.
        min_numel: smaller tensors (biases, norms) are consumed and logged unchanged.
        seed: seed of the stochastic rounding (see the module docstring).
        error_feedback: add what rounding lost to the next step's gradient (off in the
            paper: the rounding is unbiased).
    """

    kind = "terngrad"
    grad_codec = "tern"

    def __init__(self, clip: float | None = 2.5, min_numel: int = 1024, seed: int = 0,
                 error_feedback: bool = False) -> None:
        if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
            raise ConfigError(f"clip={clip!r} must be a positive number or None")
        super().__init__(seed, min_numel, error_feedback)
        self.clip = None if clip is None else float(clip)

    def config(self) -> dict[str, Any]:
        """The settings, as recorded in a log."""
        return {"kind": self.kind, "clip": self.clip, "min_numel": self.min_numel,
                "seed": self.seed, "error_feedback": self.error_feedback}

    def _message(self, flat: torch.Tensor, gen: torch.Generator) -> TernMessage:
        return terngrad_codes(flat, gen, self.clip)


class QSGDCompressor(_Quantizer):
    """QSGD: per bucket of ``bucket`` entries an fp32 L2 norm, per entry a sign and a
    level 0..``levels`` (stochastic rounding), logged at ``1 + ceil(log2(levels + 1))``
    bits per entry plus ``32 / bucket``.

    Args:
        levels: quantization levels ``s`` (>= 1).
        bucket: entries per norm ``d`` (>= 1).
        min_numel, seed, error_feedback: as for :class:`TernGradCompressor`.
    """

    kind = "qsgd"
    grad_codec = "qsgd"

    def __init__(self, levels: int = 7, bucket: int = 512, min_numel: int = 1024,
                 seed: int = 0, error_feedback: bool = False) -> None:
        if type(levels) is not int or not 1 <= levels <= 127:
            raise ConfigError(f"levels={levels!r} must be an int in 1..127")
        if type(bucket) is not int or bucket < 1:
            raise ConfigError(f"bucket={bucket!r} must be an int >= 1")
        super().__init__(seed, min_numel, error_feedback)
        self.levels = levels
        self.bucket = bucket

    @property
    def bits(self) -> int:
        """Bits per entry of the codes."""
        return 1 + self.levels.bit_length()

    def config(self) -> dict[str, Any]:
        """The settings, as recorded in a log."""
        return {"kind": self.kind, "levels": self.levels, "bucket": self.bucket,
                "min_numel": self.min_numel, "seed": self.seed,
                "error_feedback": self.error_feedback}

    def _message(self, flat: torch.Tensor, gen: torch.Generator) -> QsgdMessage:
        return qsgd_levels(flat, gen, self.levels, self.bucket)


__all__ = ["QSGDCompressor", "QsgdMessage", "TernGradCompressor", "TernMessage", "qsgd_levels",
           "qsgd_message", "terngrad_codes", "terngrad_message"]
