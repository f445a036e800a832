"""The tee: what a DDP communication hook produced, logged as the gradient (LowDiff's reuse).

See :mod:`~lowdiff_store.torch.distributed.hooks` for the table of hooks and what each one
logs. :class:`Tee` maps buckets to parameters, keeps each parameter's teed message
(:class:`Teed`) until the optimizer's pre-step hook checks it bit for bit against the
gradient the optimizer consumes, and saves and restores the per-rank hook state (PowerSGD's
error feedback, warm-start Q, iteration and RNG; the top-k hook's residuals).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from ... import codecs
from ...errors import ConfigError, Reason
from ..core import schema as L
from ..core.hook_records import HOOK_EF, HOOK_META, HOOK_Q, PSGD, Hook, as_hook, psgd_decode
from ..core.specs import Spec, raw_spec
from ..core.tensors import bits_view, int_view, same_bits
from .hooks import qsgd_hook, terngrad_hook, topk_allgather_hook


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
        gi = int_view(g)
        vi = int_view(self.tensors[1])
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
        as_hook(wrapped)
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


__all__ = ["HookRestore", "Tee", "Teed", "hook_kind", "pack_rng", "unpack_rng"]
