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

import inspect
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from .. import codecs
from ..errors import ConfigError, Reason
from . import schema as L
from ._tensors import DTYPE_OF, bits_view, from_bits, tag_of
from .topk_select import SELECTORS, select
from .writer_bridge import Spec, raw_spec

#: record/base tensor name prefixes owned by this module
PSGD = "@psgd/"
HOOK = "@hook/"
HOOK_EF = "@hook/ef/"
HOOK_Q = "@hook/q/"
HOOK_META = "@hook/meta"

Hook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_INT_OF[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bit patterns (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    x, y = _ints(a.detach()), _ints(b.detach())
    if x.device.type == "cpu" and y.device.type == "cpu":
        return bool(np.array_equal(x.numpy(), y.numpy()))  # 2-3x faster than torch.equal
    return bool(torch.equal(x, y))


# ---------------------------------------------------------------------- decoders (shared)


def narrow_decode(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp16/bf16 logged values back to the parameter dtype (exact widening)."""
    return t.to(dtype)


def psgd_decode(p: torch.Tensor, q: torch.Tensor, shape: tuple[int, ...],
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``P @ Q^T`` with the op PowerSGD's decompression uses (``torch.bmm`` of batch 1
    into a preallocated output), into ``out`` when given."""
    n, r = p.shape
    m = q.shape[0]
    if out is None:
        out = torch.empty(shape, dtype=p.dtype)
    torch.bmm(p.reshape(1, n, r), q.reshape(1, m, r).transpose(1, 2), out=out.view(1, n, m))
    return out


def sparse_decode(idx: torch.Tensor, vals: torch.Tensor, shape: tuple[int, ...]
                  ) -> torch.Tensor:
    """Zeros, then ``vals`` at the flat indices ``idx``."""
    out = torch.zeros(shape, dtype=vals.dtype)
    out.view(-1)[idx] = vals
    return out


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
            on CPU: :mod:`lowdiff_store.torch.topk_select`).
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


def _as_hook(fn: Any) -> None:
    """Give ``fn`` the plain ``(state, bucket)`` signature DDP's ``register_comm_hook``
    checks (this module's annotations are strings, which it would refuse)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    fn.__signature__ = inspect.Signature([inspect.Parameter("state", kind),
                                          inspect.Parameter("bucket", kind)])


_as_hook(topk_allgather_hook)


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
        from .compressors import terngrad_message

        return terngrad_message(flat, gen, self.clip)


@dataclass
class QSGDState(TernGradState):
    """State of :func:`qsgd_hook`: as :class:`TernGradState`, with QSGD's ``levels`` and
    ``bucket`` instead of ``clip``."""

    levels: int = 7
    bucket: int = 512

    def message(self, flat: torch.Tensor, gen: torch.Generator) -> codecs.Encoded:
        """This hook's message of one flat gradient (a ``qsgd`` tensor)."""
        from .compressors import qsgd_message

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


_as_hook(terngrad_hook)
_as_hook(qsgd_hook)


# ---------------------------------------------------------------------- teed tensors


@dataclass
class Teed:
    """One parameter's gradient as a hook produced it (owned by this rank).

    ``kind``: ``"narrow"`` (``tensors``: the fp16/bf16 copy, a buffer of the checkpointer's
    host pool), ``"psgd"`` (P and Q) or ``"sparse"`` (int64 flat indices, values)."""

    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensors: tuple[torch.Tensor, ...]
    pooled: tuple[torch.Tensor, ...] = ()

    def matches(self, grad: torch.Tensor, scratch: Callable[[torch.Tensor], torch.Tensor]
                ) -> bool:
        """The gradient this stands for, decoded as replay decodes it, equals ``grad`` bit
        for bit. ``scratch(like)`` lends a reusable buffer shaped like ``like``."""
        if grad.dtype != self.dtype or tuple(grad.shape) != self.shape or \
                grad.device.type != "cpu" or grad.layout != torch.strided:
            return False
        g = grad.detach()
        if self.kind == "narrow":
            buf = scratch(g)
            buf.copy_(self.tensors[0])       # the exact widening narrow_decode does
            return same_bits(buf, g)
        if self.kind == "psgd":
            return same_bits(psgd_decode(self.tensors[0], self.tensors[1], self.shape,
                                         out=scratch(g)), g)
        # sparse: the values at the indices, and nothing else non-zero (as bits: -0.0 and
        # NaN count), without densifying
        gi = _ints(g)
        vi = _ints(self.tensors[1])
        return bool(torch.equal(gi[self.tensors[0]], vi)) and \
            int(torch.count_nonzero(gi)) == int(torch.count_nonzero(vi))

    def specs(self, name: str, zstd: int | None) -> list[Spec]:
        """The record tensors of this gradient."""
        if self.kind == "narrow":
            tag, arr = bits_view(self.tensors[0], name)
            return [raw_spec(L.GRAD + name, tag, arr, zstd)]
        if self.kind == "psgd":
            out = []
            for t, suffix in zip(self.tensors, ("/P", "/Q"), strict=True):
                tag, arr = bits_view(t, name)
                out.append(raw_spec(PSGD + name + suffix, tag, arr))
            return out
        idx = self.tensors[0].numpy()
        tag, vals = bits_view(self.tensors[1], name)
        enc = codecs.encode_sparse(idx, vals, int(np.prod(self.shape, dtype=np.int64)), tag,
                                   delta=True)
        return [Spec(L.GRAD + name, tag, self.shape, enc, zstd)]

    def fallback_specs(self, name: str) -> list[Spec]:
        """What is kept when the gradient is logged densely instead: PowerSGD's Q (the
        warm-start memory a restore needs)."""
        if self.kind == "psgd":
            tag, arr = bits_view(self.tensors[1], name)
            return [raw_spec(PSGD + name + "/Q", tag, arr)]
        return []


@dataclass
class _Slot:
    name: str | None     # canonical parameter name (None: not a known parameter)
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass
class _PsgdItem:
    slot: int            # index into the bucket's slots
    n: int
    m: int
    r: int
    p_off: int
    q_off: int


class _Tap(dict):  # type: ignore[type-arg]
    """A dict that remembers the last value stored under each key (PowerSGD rebinds and,
    without warm start, clears its P/Q memories; the tee reads them after the hook)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.last: dict[Any, Any] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        self.last[key] = value
        super().__setitem__(key, value)


def hook_kind(hook: Any) -> str:
    """What the tee does for ``hook`` (see the module docstring)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    if hook is D.allreduce_hook:
        return "allreduce"
    if hook is D.fp16_compress_hook:
        return "fp16"
    if hook is D.bf16_compress_hook:
        return "bf16"
    if hook is P.powerSGD_hook:
        return "powersgd"
    if hook is topk_allgather_hook:
        return "topk"
    if hook is terngrad_hook:
        return "terngrad"
    if hook is qsgd_hook:
        return "qsgd"
    return "dense"


@dataclass
class HookRestore:
    """Hook state a restore found for this rank, waiting for the wrapped hook's first call.

    ``ef`` (per parameter; None: not restorable, the hook starts from zero), ``q``
    (PowerSGD warm-start Q per compressed parameter), ``meta`` (``kind``, ``iter``,
    ``rng``)."""

    kind: str
    meta: dict[str, Any]
    ef: dict[str, torch.Tensor] | None
    q: dict[str, torch.Tensor]


def pack_rng(rng: np.random.RandomState) -> dict[str, Any]:
    """numpy RandomState state as msgpack-able values."""
    name, keys, pos, has_gauss, cached = rng.get_state()
    return {"alg": str(name), "keys": np.asarray(keys, dtype="<u4").tobytes(),
            "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}


def unpack_rng(rng: np.random.RandomState, s: Mapping[str, Any]) -> None:
    """Set ``rng`` from :func:`pack_rng` output."""
    keys = np.frombuffer(s["keys"], dtype="<u4").astype(np.uint32)
    rng.set_state((s["alg"], keys, s["pos"], s["has_gauss"], s["cached"]))


class Tee:
    """The per-checkpointer side of wrapped hooks: collects teed gradients between backward
    and the optimizer step, and keeps the hook state checkpointable."""

    def __init__(self, names_by_id: Mapping[int, str], params_by_name: Mapping[str, Any],
                 owned: set[str], *, ef_step: bool,
                 take: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.names_by_id = dict(names_by_id)
        #: ``take(like)``: a host buffer shaped like ``like`` (the checkpointer's pool)
        self.take_buffer = take or (lambda like: torch.empty(like.shape, dtype=like.dtype))
        self.params_by_name = dict(params_by_name)
        self.owned = owned
        self.ef_step = ef_step
        self.kind: str | None = None
        self.state: Any = None
        self.restored: HookRestore | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, Teed] = {}
        self._installed = False
        self._layouts: dict[int, tuple[tuple[Any, ...], list[_Slot], list[_PsgdItem], int]] = {}
        self._store: dict[str, dict[str, torch.Tensor]] = {}   # per-param state to install
        self._last_rng: bytes | None = None
        self.stats: dict[str, float] = {"tee_buckets": 0}

    # -- wrapping

    def wrap(self, hook: Hook, compressor: Any = None) -> Hook:
        """The wrapped hook (see :meth:`DiffCheckpointer.wrap_comm_hook`)."""
        kind = hook_kind(hook)
        if compressor is not None:
            raise ConfigError("a TopKCompressor and a wrapped communication hook cannot be "
                              "combined: the compressor changes the gradients after the "
                              "hook; use topk_allgather_hook instead",
                              reason=Reason.NOT_ALLOWED)
        if self.kind is not None and self.kind != kind:
            raise ConfigError(f"a {self.kind} hook is already wrapped by this checkpointer",
                              reason=Reason.NOT_ALLOWED)
        r = self.restored
        if r is not None and r.kind != kind and r.kind in ("powersgd", "topk", "terngrad",
                                                           "qsgd"):
            raise ConfigError(f"the log was written with a {r.kind} hook (its state was "
                              f"restored); wrap the same hook, not {kind}",
                              reason=Reason.STATE_MISMATCH)
        self.kind = kind
        ref = weakref.ref(self)

        def wrapped(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
            me = ref()
            if me is None:
                return hook(state, bucket)
            return me._call(hook, kind, state, bucket)

        wrapped.__name__ = getattr(hook, '__name__', 'hook')  # DDP's checks see the hook
        wrapped.__doc__ = hook.__doc__
        _as_hook(wrapped)
        return wrapped

    def _slots(self, bucket: Any) -> list[_Slot]:
        buf = bucket.buffer()
        base, size = buf.data_ptr(), buf.element_size()
        return [_Slot(self.names_by_id.get(id(p)), (g.data_ptr() - base) // size, g.numel(),
                      tuple(g.shape))
                for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)]

    def _call(self, hook: Hook, kind: str, state: Any, bucket: Any
              ) -> torch.futures.Future[torch.Tensor]:
        self.state = state
        if not self._installed:
            self._install_global(kind, state)
        slots = self._slots(bucket)
        plan: list[_PsgdItem] = []
        compressed = False
        idx = -1
        if kind == "powersgd":
            idx = bucket.index()
            plan = self._psgd_before(state, idx, slots, bucket.buffer())
            compressed = state.iter >= state.start_powerSGD_iter
        fut = hook(state, bucket)

        def after(f: Any) -> torch.Tensor:
            out: torch.Tensor = f.value()
            self._after(kind, state, out, slots, plan if compressed else None, idx)
            return out

        return fut.then(after)

    def _after(self, kind: str, state: Any, out: torch.Tensor, slots: list[_Slot],
               plan: list[_PsgdItem] | None, idx: int) -> None:
        # Dense results (all-reduce, an unknown hook, PowerSGD's uncompressed tensors and
        # its first iterations) are not teed: the post-communication tensor *is* the
        # gradient, and the checkpointer's pooled copy at the pre-step hook logs the same
        # bits for less than a copy here plus a comparison there.
        narrow = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(kind)
        if narrow is None and kind != "topk" and not plan:
            return
        got: dict[str, Teed] = {}
        in_plan = {it.slot: it for it in plan} if plan else {}
        p_mem = q_mem = None
        if plan:
            p_mem = _tapped(state.p_memory_dict, idx)
            q_mem = _tapped(state.q_memory_dict, idx)
        for i, s in enumerate(slots):
            if s.name is None or s.name not in self.owned:
                continue
            view = out[s.offset:s.offset + s.numel].view(s.shape)
            it = in_plan.get(i)
            if it is not None and p_mem is not None and q_mem is not None:
                p = p_mem[it.p_off:it.p_off + it.n * it.r].view(it.n, it.r).clone()
                q = q_mem[it.q_off:it.q_off + it.m * it.r].view(it.m, it.r).clone()
                got[s.name] = Teed("psgd", s.shape, out.dtype, (p, q))
            elif narrow is not None:
                buf = self.take_buffer(torch.empty(s.shape, dtype=narrow, device="meta"))
                buf.copy_(view)
                got[s.name] = Teed("narrow", s.shape, out.dtype, (buf,), (buf,))
            elif kind == "topk":
                flat = view.reshape(-1)
                nz = torch.nonzero(flat).reshape(-1)
                got[s.name] = Teed("sparse", s.shape, out.dtype, (nz, flat[nz]))
        with self._lock:
            self._pending.update(got)
            self.stats["tee_buckets"] += 1

    def take(self) -> dict[str, Teed]:
        """The teed gradients of the backward pass just finished (then forgotten)."""
        with self._lock:
            out, self._pending = self._pending, {}
        return out

    # -- hook state: restore

    def _install_global(self, kind: str, state: Any) -> None:
        self._installed = True
        r = self.restored
        if kind == "powersgd":
            if not isinstance(state.p_memory_dict, _Tap):
                state.p_memory_dict = _Tap(state.p_memory_dict)
            if not isinstance(state.q_memory_dict, _Tap):
                state.q_memory_dict = _Tap(state.q_memory_dict)
            if r is not None and r.kind == "powersgd":
                if "iter" in r.meta:
                    state.iter = int(r.meta["iter"])
                if r.meta.get("rng") is not None:
                    unpack_rng(state.rng, r.meta["rng"])
                for n, t in (r.ef or {}).items():
                    self._store.setdefault(n, {})["err"] = t
                for n, t in r.q.items():
                    self._store.setdefault(n, {})["q"] = t
        elif kind == "topk" and r is not None and r.kind == "topk" and r.ef:
            for n, t in r.ef.items():
                p = self.params_by_name.get(n)
                if p is not None:
                    state.residuals[p] = t.to(p.device)
        elif kind in ("terngrad", "qsgd") and r is not None and r.kind == kind:
            for n, c in (r.meta.get("steps") or {}).items():
                p = self.params_by_name.get(n)
                if p is not None:
                    state.steps[p] = int(c)
        self.restored = None

    def _psgd_plan(self, state: Any, slots: list[_Slot]) -> tuple[list[_PsgdItem], int]:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        items: list[tuple[int, int, int, int]] = []
        for i, s in enumerate(slots):
            n = s.shape[0] if s.shape else 1
            m = s.numel // n if n else 0
            r = min(n, m, state.matrix_approximation_rank)
            if _should_compress(n, m, r, state.min_compression_rate)[0]:
                items.append((i, n, m, r))
        groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
        for it in items:  # PowerSGD lays its memories out grouped by matrix shape
            groups.setdefault((it[1], it[2]), []).append(it)
        plan = []
        p_off = q_off = 0
        for grp in groups.values():
            for i, n, m, r in grp:
                plan.append(_PsgdItem(i, n, m, r, p_off, q_off))
                p_off += n * r
                q_off += m * r
        return plan, p_off

    def _psgd_before(self, state: Any, idx: int, slots: list[_Slot], buf: torch.Tensor
                     ) -> list[_PsgdItem]:
        sig = tuple((s.name, s.offset, s.numel) for s in slots)
        names = {s.name for s in slots}
        old = self._layouts.get(idx)
        if old is None or old[0] != sig:
            # DDP rebuilt its buckets: move the state of every old bucket that held one of
            # these parameters (or had this index) to per-parameter form
            for j, (_sig, oslots, oplan, _tp) in list(self._layouts.items()):
                if j == idx or names & {s.name for s in oslots}:
                    self._psgd_detach(state, j, oslots, oplan)
                    del self._layouts[j]
            plan, total_p = self._psgd_plan(state, slots)
            self._layouts[idx] = (sig, slots, plan, total_p)
            self._psgd_install(state, idx, slots, plan, total_p, buf)
        return self._layouts[idx][2]

    def _psgd_detach(self, state: Any, j: int, slots: list[_Slot], plan: list[_PsgdItem]
                     ) -> None:
        err = state.error_dict.pop(j, None)
        q = state.q_memory_dict.get(j)
        state.q_memory_dict.pop(j, None)
        state.p_memory_dict.pop(j, None)
        for s in slots:
            if s.name is not None and err is not None:
                self._store.setdefault(s.name, {})["err"] = \
                    err[s.offset:s.offset + s.numel].clone()
        if q is not None:
            for it in plan:
                name = slots[it.slot].name
                if name is not None:
                    self._store.setdefault(name, {})["q"] = \
                        q[it.q_off:it.q_off + it.m * it.r].clone()

    def _psgd_install(self, state: Any, idx: int, slots: list[_Slot], plan: list[_PsgdItem],
                      total_p: int, buf: torch.Tensor) -> None:
        st = self._store
        if state.use_error_feedback and any("err" in st.get(s.name or "", {}) for s in slots):
            err = torch.zeros(buf.numel(), dtype=buf.dtype, device=buf.device)
            for s in slots:
                e = st.get(s.name or "", {}).pop("err", None)
                if e is not None:
                    err[s.offset:s.offset + s.numel] = e.reshape(-1).to(buf.device)
            state.error_dict[idx] = err
        names = [slots[it.slot].name for it in plan]
        if state.warm_start and plan and all("q" in st.get(n or "", {}) for n in names):
            qs = [st[n or ""].pop("q").reshape(-1).to(buf.device) for n in names]
            state.q_memory_dict[idx] = torch.cat(qs)
            state.p_memory_dict[idx] = torch.empty(total_p, dtype=buf.dtype, device=buf.device)

    # -- hook state: checkpoint

    def step_side(self) -> dict[str, Any] | None:
        """Small per-step hook state for the record's side channel (``side["hook"]``)."""
        if self.kind is None:
            return None
        out: dict[str, Any] = {"kind": self.kind}
        st = self.state
        if self.kind == "powersgd" and st is not None:
            out["iter"] = int(st.iter)
            rng = pack_rng(st.rng)
            blob = msgpack.packb(rng, use_bin_type=True)
            if blob != self._last_rng:
                out["rng"] = rng
                self._last_rng = blob
        elif self.kind in ("terngrad", "qsgd") and st is not None:
            out["steps"] = self._positions(st)
        return out

    def _positions(self, st: Any) -> dict[str, int]:
        """A quantizing hook's generator position per parameter, by name."""
        return {n: int(c) for p, c in st.steps.items()
                if (n := self.names_by_id.get(id(p))) is not None}

    def _meta(self) -> dict[str, Any] | None:
        r = self.restored
        if self.kind is None:
            return dict(r.meta) if r is not None else None
        out: dict[str, Any] = {"kind": self.kind}
        st = self.state
        if self.kind == "powersgd" and st is not None:
            out["iter"] = int(st.iter)
            out["rng"] = pack_rng(st.rng)
            out["error_feedback"] = bool(st.use_error_feedback)
            out["warm_start"] = bool(st.warm_start)
        elif self.kind == "topk" and st is not None:
            out["error_feedback"] = bool(st.error_feedback)
        elif self.kind in ("terngrad", "qsgd") and st is not None:
            out["steps"] = self._positions(st)
        return out

    def ef_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback state per parameter (every parameter, not only the
        owned ones: it differs between ranks)."""
        out: dict[str, torch.Tensor] = {}
        r = self.restored
        if r is not None:   # not installed yet
            return dict(r.ef or {})
        st = self.state
        if self.kind == "topk" and st is not None and st.error_feedback:
            for p, res in st.residuals.items():
                n = self.names_by_id.get(id(p))
                if n is not None:
                    out[n] = res
        elif self.kind == "powersgd" and st is not None and st.use_error_feedback:
            for n, d in self._store.items():
                if "err" in d:
                    out[n] = d["err"]
            for j, (_sig, slots, _plan, _tp) in self._layouts.items():
                err = st.error_dict.get(j)
                if err is None:
                    continue
                for s in slots:
                    if s.name is not None:
                        out[s.name] = err[s.offset:s.offset + s.numel].view(s.shape)
        return out

    def q_tensors(self) -> dict[str, torch.Tensor]:
        """PowerSGD warm-start Q of the owned compressed parameters."""
        out: dict[str, torch.Tensor] = {}
        r = self.restored
        if r is not None:
            return {n: q for n, q in r.q.items() if n in self.owned}
        st = self.state
        if self.kind != "powersgd" or st is None or not st.warm_start:
            return out
        for n, d in self._store.items():
            if "q" in d and n in self.owned:
                out[n] = d["q"]
        for j, (_sig, slots, plan, _tp) in self._layouts.items():
            q = st.q_memory_dict.get(j)
            if q is None:
                continue
            for it in plan:
                qn = slots[it.slot].name
                if qn is not None and qn in self.owned:
                    out[qn] = q[it.q_off:it.q_off + it.m * it.r].view(it.m, it.r)
        return out

    def step_specs(self, zstd: int | None) -> list[Spec]:
        """Per-step error-feedback state (``ef_state="step"``), this rank's."""
        if not self.ef_step:
            return []
        out = []
        for n, t in self.ef_tensors().items():
            tag, arr = bits_view(t.detach().cpu().clone(), n)
            out.append(raw_spec(HOOK_EF + n, tag, arr, zstd))
        return out

    def base_tensors(self) -> dict[str, tuple[str, np.ndarray]]:
        """The hook state for a base of this rank's shard."""
        meta = self._meta()
        if meta is None:
            return {}
        out: dict[str, tuple[str, np.ndarray]] = {
            HOOK_META: ("U8", np.frombuffer(msgpack.packb(meta, use_bin_type=True),
                                            dtype=np.uint8).copy())}
        for n, t in self.ef_tensors().items():
            out[HOOK_EF + n] = _bits_copy(t, n)
        for n, t in self.q_tensors().items():
            out[HOOK_Q + n] = _bits_copy(t, n)
        return out


def _bits_copy(t: torch.Tensor, what: str) -> tuple[str, np.ndarray]:
    tag, arr = bits_view(t.detach().cpu(), what)
    return tag, np.array(arr, copy=True)


def _tapped(d: Any, idx: int) -> torch.Tensor | None:
    if isinstance(d, _Tap) and idx in d.last:
        t: torch.Tensor = d.last[idx]
        return t
    got: torch.Tensor | None = d.get(idx)
    return got


class _SynthEntry:
    """The entry a hook-decoded gradient reads as: a raw tensor of the parameter's dtype."""

    codec = "raw"
    params: dict[str, Any] | None = None

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.name, self.dtype, self.shape = name, dtype, shape

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class HookGrads:
    """A record (one log's, or a merged one) whose gradients logged as a communication hook
    produced them read as plain gradients: fp16/bf16 buffers widened to the parameter's
    dtype, PowerSGD's P and Q factors multiplied with the hook's own operation, so
    ``@grad/NAME`` reads as a raw tensor of the parameter's dtype. Every other name reads
    through unchanged. Made by :func:`hook_grads`, which returns the record itself when it
    holds no hook message."""

    def __init__(self, rec: Any, params: Mapping[str, tuple[str, tuple[int, ...]]],
                 synth: dict[str, tuple[str, str]], names: list[str]) -> None:
        self._rec = rec
        self._params = params
        self._synth = synth
        self.names = names
        self.step, self.path, self.offset = rec.step, rec.path, rec.offset
        self.side, self.meta = rec.side, rec.meta

    def entry(self, name: str) -> Any:
        s = self._synth.get(name)
        if s is None:
            return self._rec.entry(name)
        tag, shape = self._params[s[1]]
        return _SynthEntry(name, tag, shape)

    def parts(self, name: str) -> list[np.ndarray]:
        parts: list[np.ndarray] = self._rec.parts(name)
        return parts

    def tensor(self, name: str, *, ref: np.ndarray | None = None) -> np.ndarray:
        s = self._synth.get(name)
        if s is None:
            arr: np.ndarray = self._rec.tensor(name, ref=ref)
            return arr
        kind, pname = s
        tag, shape = self._params[pname]
        rec = self._rec
        if kind == "psgd":
            pk, qk = PSGD + pname + "/P", PSGD + pname + "/Q"
            p = from_bits(rec.entry(pk).dtype, rec.tensor(pk))
            q = from_bits(rec.entry(qk).dtype, rec.tensor(qk))
            t = psgd_decode(p, q, shape)
        else:
            t = narrow_decode(from_bits(rec.entry(name).dtype, rec.tensor(name)),
                              DTYPE_OF[tag])
        if tag_of(t) != tag:
            raise ConfigError(f"step {self.step}: gradient {pname} decodes to {tag_of(t)}, "
                              f"the parameter is {tag}", reason=Reason.STATE_MISMATCH,
                              path=self.path)
        return bits_view(t)[1]


def hook_grads(rec: Any, params: Mapping[str, tuple[str, tuple[int, ...]]]) -> Any:
    """``rec`` seen through :class:`HookGrads` when it holds hook messages (PowerSGD
    factors, or an fp16/bf16 gradient of a wider parameter), else ``rec`` itself.
    ``params`` maps a parameter name to its (dtype tag, shape)."""
    all_names = rec.names
    synth: dict[str, tuple[str, str]] = {}
    have = set(all_names)
    names = [n for n in all_names if not n.startswith((PSGD, HOOK))]
    for n in all_names:
        if n.startswith(PSGD) and n.endswith("/P"):
            pname = n[len(PSGD):-2]
            if L.GRAD + pname not in have and PSGD + pname + "/Q" in have \
                    and pname in params:
                synth[L.GRAD + pname] = ("psgd", pname)
                names.append(L.GRAD + pname)
    for n in names:
        if n.startswith(L.GRAD) and n not in synth:
            pname = n[len(L.GRAD):]
            want = params.get(pname)
            if want is None:
                continue
            e = rec.entry(n)
            if e.codec == "raw" and e.dtype != want[0] and e.dtype in ("F16", "BF16"):
                synth[n] = ("narrow", pname)
    if not synth and len(names) == len(all_names):
        return rec
    return HookGrads(rec, params, synth, names)


def passthrough(hook: Hook) -> Hook:
    """A single-process checkpointer's wrapper: runs ``hook`` unchanged (the gradient is
    captured densely at the optimizer step; the hook's own state is not checkpointed)."""
    def wrapped(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket)
    wrapped.__name__ = getattr(hook, '__name__', 'hook')
    wrapped.__doc__ = hook.__doc__
    _as_hook(wrapped)
    return wrapped


__all__ = [
    "HOOK",
    "HOOK_EF",
    "HOOK_META",
    "HOOK_Q",
    "PSGD",
    "HookGrads",
    "HookRestore",
    "QSGDState",
    "TernGradState",
    "Tee",
    "Teed",
    "TopKAllGatherState",
    "hook_grads",
    "hook_kind",
    "narrow_decode",
    "pack_rng",
    "passthrough",
    "psgd_decode",
    "qsgd_hook",
    "same_bits",
    "sparse_decode",
    "terngrad_hook",
    "topk_allgather_hook",
    "unpack_rng",
]
