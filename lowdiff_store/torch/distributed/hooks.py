"""DDP communication hooks whose post-communication result is logged (LowDiff's reuse).

``ckpt.wrap_comm_hook(hook)`` returns a hook for ``ddp.register_comm_hook(state, ...)``
that runs ``hook`` and *tees* what it produced into the checkpointer, so the gradient is
logged in the form the communication already compressed it to, without compressing
anything again:

========================  ==============================================================
hook                      logged per parameter (owned by this rank)
========================  ==============================================================
``fp16_compress_hook``    the slice as fp16 / bf16 (``@grad/NAME`` F16 or BF16): the
``bf16_compress_hook``    values came out of an fp16/bf16 all-reduce, so the narrow copy
                          is lossless (checked; fp32 otherwise). Half the bytes
``powerSGD_hook``         the P and Q factors (``@psgd/NAME/P``, ``@psgd/NAME/Q``) of the
                          compressed matrices
:func:`topk_allgather_hook`  the union of the gathered top-k entries (sparse codec)
``allreduce_hook``, any   nothing is teed: the post-communication result (the averaged
other hook; PowerSGD's    fp32 bucket) *is* the gradient, so the checkpointer's pooled
vectors and warm-up       copy at the pre-step hook logs exactly those bits, for less than
iterations                a copy in the callback plus a comparison later
========================  ==============================================================

Buckets are mapped to parameters through ``bucket.parameters()`` and the offsets of
``bucket.gradients()`` in ``bucket.buffer()``, never through ``bucket.index()`` (DDP
rebuilds its buckets after the first iteration). At the optimizer's pre-step hook each teed
tensor is decoded with the very function replay uses and compared bit for bit with the
gradient the optimizer is about to consume (for fp16/bf16 this is the round-trip check); on
any difference (fp32 values an fp16 copy cannot hold, a later in-place change such as
clipping, gradient accumulation, a reconstruction that does not round the same way) the
gradient is copied densely instead and ``stats()["tee_fallbacks"]`` counts it. So the log
always holds exactly what the optimizer consumed.

Hook state that replay cannot rebuild (PowerSGD's error-feedback memory and warm-start Q,
its iteration counter and RNG; the top-k hook's residuals) is per rank: it is written into
every base of the rank's shard (``@hook/...``), the small parts into every record, and the
error feedback into every record only with ``ef_state="step"``. On restore the state is put
back into the hook's state object at the first call of the wrapped hook, re-laid out by
parameter for whatever bucket layout DDP uses then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ... import codecs
from ...errors import ConfigError
from ..compressors.select import SELECTORS, select
from ..core.hook_records import as_hook

# ---------------------------------------------------------------------- decoders (shared)


# ---------------------------------------------------------------------- top-k all-gather


@dataclass
class TopKAllGatherState:
    """State of :func:`topk_allgather_hook`.

    Attributes:
        process_group: the group to all-gather over (None: the default group).
        ratio: fraction of each parameter's entries every rank sends (``0 < ratio <= 1``).
        error_feedback: keep what was not sent in a per-parameter residual added to the
            next iteration's gradient.
        residuals: the residual per parameter (keys are the parameters).
        selector: ``"exact"`` (``torch.topk``) or ``"sampled"`` (the same entries, faster
            on CPU: :mod:`lowdiff_store.torch.compressors.select`).
    """

    process_group: Any = None
    ratio: float = 0.01
    error_feedback: bool = True
    residuals: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    selector: str = "exact"

    def __post_init__(self) -> None:
        if not isinstance(self.ratio, (int, float)) or not 0.0 < float(self.ratio) <= 1.0:
            raise ConfigError(f"ratio={self.ratio!r} must be in (0, 1]")
        if self.selector not in SELECTORS:
            raise ConfigError(f"selector={self.selector!r} must be one of {list(SELECTORS)}")

    def k_for(self, numel: int) -> int:
        """Entries each rank sends for a parameter of ``numel`` elements."""
        return min(numel, max(1, int(numel * float(self.ratio))))


def topk_allgather_hook(state: TopKAllGatherState, bucket: Any
                        ) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: sparse all-gather of each rank's per-parameter top-k.

    For every parameter of the bucket, each rank adds its residual (error feedback), keeps
    the ``k = max(1, int(numel * ratio))`` entries of largest magnitude, and all-gathers
    their (flat index, value) pairs; the result is zero except at the union of the gathered
    indices, where it is the sum of the ranks' values (added in rank order) divided by the
    world size. Selection is per parameter, so the result does not depend on how DDP
    groups parameters into buckets. Use it as
    ``ddp.register_comm_hook(TopKAllGatherState(ratio=0.01), topk_allgather_hook)``
    (through ``ckpt.wrap_comm_hook`` to log it).
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buf: torch.Tensor = bucket.buffer()
    base, size = buf.data_ptr(), buf.element_size()
    idx_parts: list[torch.Tensor] = []
    val_parts: list[torch.Tensor] = []
    for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
        off = (g.data_ptr() - base) // size
        flat = buf[off:off + g.numel()]
        if state.error_feedback:
            r = state.residuals.get(p)
            if r is not None:
                flat.add_(r.reshape(-1))
        k = state.k_for(flat.numel())
        i = select(state.selector, flat.abs(), k)
        if state.selector == "exact":
            i = torch.sort(i).values
        if state.error_feedback:
            res = flat.clone()
            res[i] = 0
            state.residuals[p] = res.view(g.shape)
        idx_parts.append(i + off)
        val_parts.append(flat[i])
    idx = torch.cat(idx_parts) if idx_parts else torch.zeros(0, dtype=torch.int64)
    vals = torch.cat(val_parts) if val_parts else torch.zeros(0, dtype=buf.dtype)
    k_all = idx.numel()
    # one message: indices (< 2**53) and values are exact in float64
    payload = torch.cat([idx.to(torch.float64), vals.to(torch.float64)])
    outs = [torch.empty_like(payload) for _ in range(world)]
    fut = dist.all_gather(outs, payload, group=group, async_op=True).get_future()

    def combine(_f: Any) -> torch.Tensor:
        buf.zero_()
        for msg in outs:
            buf.index_add_(0, msg[:k_all].to(torch.int64), msg[k_all:].to(buf.dtype))
        buf.div_(world)
        return buf

    out: torch.futures.Future[torch.Tensor] = fut.then(combine)
    return out


as_hook(topk_allgather_hook)


# ---------------------------------------------------------------------- quantized all-gather


@dataclass
class TernGradState:
    """State of :func:`terngrad_hook`.

    Attributes:
        process_group: the group to all-gather over (None: the default group).
        clip: clip to ``clip`` standard deviations before scaling (None: no clipping).
        min_numel: smaller parameters are all-gathered in fp32.
        seed: seed of the stochastic rounding (each rank draws from its own stream).
        steps: how many times each parameter was quantized (the generator position; keys
            are the parameters). Checkpointed per rank by a wrapping checkpointer.
    """

    process_group: Any = None
    clip: float | None = 2.5
    min_numel: int = 1024
    seed: int = 0
    steps: dict[torch.Tensor, int] = field(default_factory=dict)

    def message(self, flat: torch.Tensor, gen: torch.Generator) -> codecs.Encoded:
        """This hook's message of one flat gradient (a ``tern`` tensor)."""
        from ..compressors.quantized import terngrad_message

        return terngrad_message(flat, gen, self.clip)


@dataclass
class QSGDState(TernGradState):
    """State of :func:`qsgd_hook`: as :class:`TernGradState`, with QSGD's ``levels`` and
    ``bucket`` instead of ``clip``."""

    levels: int = 7
    bucket: int = 512

    def message(self, flat: torch.Tensor, gen: torch.Generator) -> codecs.Encoded:
        """This hook's message of one flat gradient (a ``qsgd`` tensor)."""
        from ..compressors.quantized import qsgd_message

        return qsgd_message(flat, gen, self.levels, self.bucket)


def _quantized_allgather(state: TernGradState, bucket: Any
                         ) -> torch.futures.Future[torch.Tensor]:
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    buf: torch.Tensor = bucket.buffer()
    base, size = buf.data_ptr(), buf.element_size()
    # one uint8 payload per rank, laid out alike on every rank (same parameters, same
    # sizes): per parameter the bytes of its message's parts, or its fp32 bytes when small
    layout: list[tuple[int, int, codecs.Encoded | None, list[int]]] = []
    chunks: list[torch.Tensor] = []
    for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
        off = (g.data_ptr() - base) // size
        flat = buf[off:off + g.numel()]
        if g.numel() < state.min_numel or buf.dtype != torch.float32:
            layout.append((off, g.numel(), None, [flat.numel() * size]))
            chunks.append(flat.reshape(-1).view(torch.uint8))
            continue
        pos = state.steps.get(p, 0)
        state.steps[p] = pos + 1
        gen = torch.Generator().manual_seed(
            ((int(state.seed) * 1_000_003 + rank) * 1_000_003 + pos) % (2 ** 63))
        msg = state.message(flat, gen)
        layout.append((off, g.numel(), msg, [part.nbytes for part in msg.parts]))
        chunks.extend(torch.from_numpy(part.data.view(np.uint8)) for part in msg.parts)
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    outs = [torch.empty_like(payload) for _ in range(world)]
    fut = dist.all_gather(outs, payload, group=group, async_op=True).get_future()

    def combine(_f: Any) -> torch.Tensor:
        total = torch.zeros_like(buf)
        for got in outs:   # rank order: the same sum on every rank
            raw = got.numpy()
            at = 0
            for off, n, enc, sizes in layout:
                parts = []
                for nbytes in sizes:
                    parts.append(raw[at:at + nbytes])
                    at += nbytes
                if enc is None:
                    total[off:off + n] += torch.from_numpy(parts[0].copy().view(np.float32))
                else:  # the ranks' messages share codec and params, not parts
                    total[off:off + n] += torch.from_numpy(codecs.decode(
                        enc.codec, enc.params, parts, "F32", (n,)))
        buf.copy_(total.div_(world))
        return buf

    out: torch.futures.Future[torch.Tensor] = fut.then(combine)
    return out


def terngrad_hook(state: TernGradState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: TernGrad. Each rank quantizes every parameter of the bucket
    (of at least ``state.min_numel`` entries) to 2-bit ternary codes and one fp32 scale
    (stochastic rounding from its own seeded stream) and all-gathers them; the result is
    the sum of the ranks' decoded messages (in rank order) divided by the world size.
    ``ddp.register_comm_hook(TernGradState(), terngrad_hook)`` (through
    ``ckpt.wrap_comm_hook`` to log it: the averaged gradient is logged, and the stream
    positions are part of the rank's hook state)."""
    return _quantized_allgather(state, bucket)


def qsgd_hook(state: QSGDState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: QSGD (``state.levels`` levels, a norm per ``state.bucket``
    entries), otherwise as :func:`terngrad_hook`."""
    return _quantized_allgather(state, bucket)


as_hook(terngrad_hook)
as_hook(qsgd_hook)


# ---------------------------------------------------------------------- teed tensors


__all__ = [
    "QSGDState",
    "TernGradState",
    "TopKAllGatherState",
    "qsgd_hook",
    "terngrad_hook",
    "topk_allgather_hook",
]
