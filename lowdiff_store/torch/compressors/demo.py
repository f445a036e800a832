"""DeMo (Decoupled Momentum Optimization, Peng, Quesnelle & Kingma 2024; the FlexDeMo
seed), implemented from the paper: the reference implementation is not a package on PyPI.

DeMo keeps a local momentum ``m`` per parameter. Each step:

1. ``m = beta * m + lr * grad`` (``beta``: ``decay``);
2. ``m`` is cut into chunks (``chunk`` x ``chunk`` blocks of a matrix, ``chunk`` runs of a
   vector; the chunk of a dimension is its largest divisor <= ``chunk``), each chunk goes
   through an orthonormal DCT-II, and the ``topk`` coefficients of largest magnitude per
   chunk are kept: ``q`` = their inverse DCT, the fast-moving part of the momentum;
3. ``m -= q`` (the residual stays local; it is the state a restore needs);
4. ranks exchange their kept coefficients (all-gather; summed in rank order) and decode
   the sum: ``Q``; with one process ``Q = q``;
5. the parameter update is signum of ``Q`` with decoupled weight decay:
   ``p = p * (1 - lr * wd) - lr * sign(Q)``.

Here steps 1-4 are :class:`DeMoCompressor` (a step pre-hook, like
:class:`~lowdiff_store.torch.TopKCompressor`: it replaces ``p.grad`` by ``sign(Q)``; its
``residuals`` are the momenta) and step 5 is the optimizer :class:`DeMo`. A
:class:`~lowdiff_store.torch.DiffCheckpointer` with ``compressor=DeMoCompressor(...)``
logs what the optimizer applies: the sign tensor at 1 bit per entry (``sign`` codec;
``tern`` at 2 bits if a sign is 0), while ``lr`` and ``weight_decay`` are hyperparameters
in the step's side channel; the momenta go to every base (``@ef/NAME``) and, with
``ef_state="step"``, to every record.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ... import codecs
from ...codecs.batch import Recipe, encode_sign
from ...errors import ConfigError
from ..core.schema import register_optimizer
from ..core.step_batch import Slot, StepBatch
from .topk import GradCompressor


class DeMo(torch.optim.Optimizer):
    """Signum with decoupled weight decay: ``p = p * (1 - lr * wd) - lr * grad``, where
    ``grad`` is the sign tensor :class:`DeMoCompressor` leaves (any gradient works: this
    is the optimizer DeMo's update runs, and replay runs it on the logged signs).

    Args:
        params: parameters or param groups.
        lr: learning rate.
        weight_decay: decoupled weight decay.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.0
                 ) -> None:
        if not lr >= 0.0:
            raise ConfigError(f"lr={lr!r} must be >= 0")
        if not weight_decay >= 0.0:
            raise ConfigError(f"weight_decay={weight_decay!r} must be >= 0")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                p.add_(p.grad, alpha=-lr)
        return loss


def _chunk(dim: int, target: int) -> int:
    """The largest divisor of ``dim`` that is <= ``target``."""
    for c in range(min(dim, target), 0, -1):
        if dim % c == 0:
            return c
    return 1


_DCT: dict[tuple[int, torch.device], torch.Tensor] = {}


def dct_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal DCT-II matrix ``C`` (``C @ x`` transforms, ``C.T @ y`` inverts), on
    ``device`` (made there once: no copy per step)."""
    dev = torch.device(device)
    m = _DCT.get((n, dev))
    if m is None:
        if dev.type == "cpu":
            k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
            i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
            c = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
            c[0] /= math.sqrt(2.0)
            m = c.to(torch.float32)
        else:  # the CPU's bits, copied once
            m = dct_matrix(n).to(dev)
        _DCT[(n, dev)] = m
    return m


register_optimizer(DeMo)

class _Chunks:
    """The chunk layout of one tensor: a (rows, cols) matrix cut into (h, w) blocks."""

    def __init__(self, shape: torch.Size, target: int) -> None:
        n = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 1
        cols = n // rows if rows else 0
        self.rows, self.cols = rows, cols
        self.h = _chunk(rows, target) if len(shape) >= 2 else 1
        self.w = _chunk(cols, target)

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(nb, h*w) blocks of the flat ``x``."""
        h, w = self.h, self.w
        b = x.reshape(self.rows // h, h, self.cols // w, w).permute(0, 2, 1, 3)
        return b.reshape(-1, h, w)

    def unblocks(self, b: torch.Tensor) -> torch.Tensor:
        """The flat tensor of :meth:`blocks` output."""
        h, w = self.h, self.w
        x = b.reshape(self.rows // h, self.cols // w, h, w).permute(0, 2, 1, 3)
        return x.reshape(-1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """DCT coefficients per block, (nb, h*w)."""
        ch, cw = dct_matrix(self.h, x.device), dct_matrix(self.w, x.device)
        return (ch @ self.blocks(x) @ cw.T).reshape(-1, self.h * self.w)

    def decode(self, coeff: torch.Tensor) -> torch.Tensor:
        """The flat tensor of (nb, h*w) coefficients."""
        ch, cw = dct_matrix(self.h, coeff.device), dct_matrix(self.w, coeff.device)
        return self.unblocks(ch.T @ coeff.reshape(-1, self.h, self.w) @ cw)


class DeMoCompressor(GradCompressor):
    """DeMo's momentum decoupling (steps 1-4 of the module docstring) as a compressor.

    Args:
        decay: momentum decay ``beta`` (the reference's ``compression_decay``).
        topk: DCT coefficients kept per chunk (``compression_topk``).
        chunk: target chunk size (``compression_chunk``).
        process_group: ranks to exchange coefficients with (None: no exchange, one
            process; ``"world"``: the default group).

    Attach it to a :class:`DeMo` optimizer (or pass it as a checkpointer's
    ``compressor=``). The momenta are ``residuals`` (always kept: ``error_feedback``).
    """

    kind = "demo"
    grad_codec = "sign"

    def __init__(self, decay: float = 0.999, topk: int = 32, chunk: int = 64,
                 process_group: Any = None) -> None:
        if not 0.0 <= float(decay) <= 1.0:
            raise ConfigError(f"decay={decay!r} must be in [0, 1]")
        if type(topk) is not int or topk < 1:
            raise ConfigError(f"topk={topk!r} must be an int >= 1")
        if type(chunk) is not int or chunk < 1:
            raise ConfigError(f"chunk={chunk!r} must be an int >= 1")
        super().__init__(error_feedback=True)
        self.decay = float(decay)
        self.topk = topk
        self.chunk = chunk
        self.process_group = process_group
        self._layouts: dict[tuple[int, ...], _Chunks] = {}

    def config(self) -> dict[str, Any]:
        """The settings, as recorded in a log."""
        return {"kind": self.kind, "decay": self.decay, "topk": self.topk,
                "chunk": self.chunk, "error_feedback": True}

    def _compress_param(self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any]
                        ) -> SignMessage | None:
        if g.dtype != torch.float32:
            return None
        lay = self._layouts.get(tuple(g.shape))
        if lay is None:
            lay = self._layouts[tuple(g.shape)] = _Chunks(g.shape, self.chunk)
        m = self.residuals.get(p)
        if m is None:
            m = self.residuals[p] = torch.zeros_like(g, memory_format=torch.contiguous_format)
        if self.decay != 1.0:
            m.mul_(self.decay)
        m.add_(g, alpha=float(group["lr"]))
        coeff = lay.encode(m.reshape(-1))
        k = min(self.topk, coeff.shape[1])
        idx = torch.topk(coeff.abs(), k, dim=1, sorted=False).indices
        vals = torch.gather(coeff, 1, idx)
        sparse = torch.zeros_like(coeff).scatter_(1, idx, vals)
        m.sub_(lay.decode(sparse).view(g.shape))
        if self.process_group is not None:
            sparse = self._gathered(idx, vals, coeff)
        sign = lay.decode(sparse).sign()
        # +0.0 for a zero (sign() keeps -0.0): the codecs decode a zero code to +0.0
        sign = torch.where(sign == 0, torch.zeros_like(sign), sign)
        g.copy_(sign.view(g.shape))
        return SignMessage(sign.to(torch.int8))

    def _gathered(self, idx: torch.Tensor, vals: torch.Tensor, like: torch.Tensor
                  ) -> torch.Tensor:
        group = None if self.process_group == "world" else self.process_group
        world = dist.get_world_size(group)
        idxs = [torch.empty_like(idx) for _ in range(world)]
        valss = [torch.empty_like(vals) for _ in range(world)]
        dist.all_gather(idxs, idx, group=group)
        dist.all_gather(valss, vals, group=group)
        out = torch.zeros_like(like)
        for i, v in zip(idxs, valss, strict=True):   # rank order: the same sum everywhere
            out += torch.zeros_like(like).scatter_(1, i, v)
        return out


class SignMessage:
    """DeMo's applied update on its device: int8 codes in {-1, 0, +1}. Logged as a
    ``sign`` tensor (1 bit per entry), or ``tern`` (2 bits) when a code is 0, which a sign
    bit cannot hold: the encoder thread decides, once it has the codes."""

    tag = "F32"
    __slots__ = ("codes", "slot")

    def __init__(self, codes: torch.Tensor) -> None:
        self.codes = codes
        self.slot: Slot | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes of the message."""
        return self.codes.numel()

    def ship(self, batch: StepBatch) -> None:
        """Put the codes into ``batch``."""
        self.slot = batch.add(self.codes)

    def recipe(self) -> Recipe:
        """``sign`` (:mod:`lowdiff_store.codecs.batch`)."""
        assert self.slot is not None
        return "sign", (self.slot,), ()

    def encode(self, batch: StepBatch) -> codecs.Encoded:
        """The ``sign`` (or ``tern``) tensor (on the encoder thread)."""
        assert self.slot is not None
        return encode_sign(batch.host, self.slot)


__all__ = ["DeMo", "DeMoCompressor", "SignMessage", "dct_matrix"]
