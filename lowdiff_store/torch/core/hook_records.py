"""What DDP communication hooks leave in a log, read back as plain gradients: the tensor-name
prefixes of hook messages and hook state, the decoders that capture (the tee's round-trip
check) and replay share, and the wrapper a single-process checkpointer puts around a hook.

Replay needs these without the training hooks, so they live here and not beside
:mod:`~lowdiff_store.torch.distributed.hooks` or :mod:`~lowdiff_store.torch.distributed.tee`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError, Reason
from ...torchmeta.names import HOOK, HOOK_EF, HOOK_META, HOOK_Q, PSGD
from . import schema as L
from .tensors import DTYPE_OF, bits_view, from_bits, tag_of

#: a DDP communication hook: ``(state, bucket) -> Future[Tensor]``
Hook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


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


def as_hook(fn: Any) -> None:
    """Give ``fn`` the plain ``(state, bucket)`` signature DDP's ``register_comm_hook``
    checks (this module's annotations are strings, which it would refuse)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    fn.__signature__ = inspect.Signature([inspect.Parameter("state", kind),
                                          inspect.Parameter("bucket", kind)])


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
    as_hook(wrapped)
    return wrapped


__all__ = [
    "HOOK",
    "HOOK_EF",
    "HOOK_META",
    "HOOK_Q",
    "PSGD",
    "Hook",
    "HookGrads",
    "as_hook",
    "hook_grads",
    "narrow_decode",
    "passthrough",
    "psgd_decode",
    "sparse_decode",
]
