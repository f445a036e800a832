"""Dense gradient records that cost no copy (issue 34, item 3): a CPU gradient that training
drops after the step (``zero_grad(set_to_none=True)``, the default) is handed to the writer
itself instead of being copied into a host buffer.

Correctness first. A gradient is *lent* to its step's record only once the capture has seen
training drop the gradients it captured for :data:`LEARN` steps in a row (at the next
capture nothing references them any more: not ``p.grad``, not a buffer the loop keeps),
for a step that only reads its gradients (``step_reads_grads_only``), for plain contiguous
CPU tensors of a single-process log whose memory no other tensor shares (not a view of a
flat gradient buffer the loop keeps and zeroes).
Until the record is finalized (at the next pre-step hook, which then hands it to the
writer at once: :meth:`.GradCapture.hand_over_now`), every way training
could write a lent tensor is met by a copy made first (copy-on-write, into a buffer of the
pool that the record then holds):

- backward accumulating into it (``p.grad`` not dropped): a hook on the parameter runs
  before the accumulation (:meth:`GradLender.before_accumulate`);
- ``optimizer.zero_grad(set_to_none=False)`` / ``model.zero_grad(set_to_none=False)``:
  wrapped on the instances (:meth:`GradLender.keep_all`);
- the step is finalized (:meth:`GradLender.settle`) while ``p.grad`` still holds it, or
  anything besides the record still references the tensor or its memory (a loop that
  keeps its gradient buffers, say two sets used in turn): copied then, since nothing stops
  training from writing it later (and lending pauses until training drops its gradients
  for :data:`LEARN` steps again).

A lent tensor whose version counter moved before any of these (an in-place write by other
code between two steps, e.g. ``p.grad.mul_(...)`` on a gradient kept across steps) cannot be
logged any more: :meth:`GradLender.settle` raises ``ConfigError(state_mismatch)`` naming
the parameter (never a wrong record); that step's record can never be written, so every
later step is refused too (:attr:`GradLender.refused`: the log would skip a step). Once
settled, nothing but the record references the tensor or its memory (counted: Python
references and the users of its storage), so the writer reads it at leisure; it is freed
when the record is written.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import codecs
from ...errors import ConfigError, Reason
from ..core.step_batch import HostPool, StepBatch
from ..core.tensors import bits_view, local_of
from .heap import pad_heap

#: consecutive steps whose captured gradients training dropped before lending starts (one:
#: the first capture copies, the second lends once training dropped the first's gradients;
#: a loop that keeps its gradients is never lent one, see the module docstring)
LEARN = 1


def _storage_users(t: torch.Tensor) -> int:
    """References to ``t``'s storage (each tensor viewing it holds one), counted by
    torch; 0 where this torch cannot tell (then nothing is lent)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return 0 if count is None else int(count(t.untyped_storage()._cdata))


class LentGrad:
    """A gradient a record holds without a copy (until :meth:`keep` copies it)."""

    __slots__ = ("bufs", "copy", "name", "tensor", "version")

    def __init__(self, name: str, g: torch.Tensor, bufs: list[torch.Tensor]) -> None:
        self.name, self.tensor, self.version = name, g, g._version
        self.copy: torch.Tensor | None = None
        self.bufs = bufs  # the record's host buffers (a copy joins them)

    def keep(self, pool: HostPool, path: str) -> None:
        """Copy the tensor now, before training writes it (on the training thread)."""
        if self.copy is not None:
            return
        if self.tensor._version != self.version:
            raise ConfigError(f"the gradient of {self.name} was written in place after the "
                              f"step that logged it, before it was copied (it had been lent "
                              f"to the record: training had dropped its gradients before); "
                              f"that step cannot be logged", reason=Reason.STATE_MISMATCH,
                              path=path)
        buf = pool.take(self.tensor)
        buf.copy_(self.tensor)
        self.copy = buf
        self.bufs.append(buf)

    def counts(self) -> tuple[int, int]:
        """(Python references to the tensor, users of its storage) as seen from here."""
        return sys.getrefcount(self.tensor), _storage_users(self.tensor)

    def shared(self) -> bool:
        """Something besides this record references the tensor or its memory (training
        could write it later)."""
        refs, users = self.counts()
        return refs > _SOLE[0] or not 0 < users <= _SOLE[1]

    def encode(self, batch: StepBatch) -> codecs.Encoded:
        """The ``raw`` tensor (on the encoder thread): the copy if one was made."""
        tag, arr = bits_view(self.copy if self.copy is not None else self.tensor)
        return codecs.Encoded("raw", {}, (codecs.Part(tag, arr.reshape(-1)),))

    def ship(self, batch: StepBatch) -> None:
        """Nothing to add to the batch: a CPU gradient is already host memory."""

    def host_tensor(self) -> torch.Tensor:
        """The host tensor whose bits are logged: the copy if one was made."""
        return self.copy if self.copy is not None else self.tensor


#: :meth:`LentGrad.counts` of a tensor referenced by its :class:`LentGrad` alone
_SOLE: tuple[int, int] = LentGrad("", torch.empty(1), []).counts()


class GradLender:
    """When the dense CPU gradients of a step are lent rather than copied, and the copies
    made before training could write a lent one (module docstring). ``names``/``params``:
    the parameters logged; ``pool``: buffers of the copies; ``path``: for errors."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor], pool: HostPool,
                 path: str) -> None:
        self.names, self.params, self.pool, self.path = list(names), list(params), pool, path
        #: a parameter on the CPU: only their gradients are ever lent
        self.cpu = any(p.device.type == "cpu" for p in self.params)
        #: the gradients captured last, and whether each was lent (held by its record)
        self._prev: dict[str, tuple[weakref.ref[torch.Tensor], bool]] = {}
        self._drops = 0
        self.enabled = True  # off for good after a refusal
        #: the refusal of a lent gradient written before it was copied: its step's record
        #: cannot be written, so neither can any later step's
        self.refused: ConfigError | None = None
        #: lent tensors not yet settled, by parameter name
        self.pending: dict[str, list[LentGrad]] = {}
        #: counters: ``lent_grads`` (no copy), ``lent_copied`` (copied before a write),
        #: ``heap_top_pad`` (bytes of free heap glibc keeps, set at the first lending)
        self.stats: dict[str, float] = {"lent_grads": 0, "lent_copied": 0,
                                        "heap_top_pad": 0}
        #: pad the heap at the first lending (:mod:`.heap`; the ``heap_pad`` option)
        self.pad = True

    def _dropped(self) -> bool:
        """Training dropped the gradients captured last time: one copied once nothing
        references it; one lent (its record holds it) once it is not ``p.grad``
        (:meth:`settle` copied it if training kept it)."""
        for n, p in zip(self.names, self.params, strict=True):
            ref, lent = self._prev.get(n, (None, False))
            g = ref() if ref is not None else None
            if g is not None and (not lent or g is p.grad):
                return False
        return True

    def observe(self) -> None:
        """At a capture, before it: count whether training dropped the gradients
        captured last time (:meth:`_dropped`)."""
        if not self._prev:
            return
        self._drops = self._drops + 1 if self._dropped() else 0
        self._prev = {}

    def lending(self) -> bool:
        """Before the capture's :meth:`observe` (which it does not change): the capture
        about to run may lend, training having dropped the gradients captured last time
        for the :data:`LEARN`-th time in a row."""
        return (self.enabled and self.cpu and bool(self._prev)
                and self._drops + 1 >= LEARN and self._dropped())

    def captured(self, name: str, g: torch.Tensor) -> None:
        """``g`` was captured for ``name`` (watched for a drop by the next capture)."""
        self._prev[name] = (weakref.ref(g), False)

    def may_lend(self, g: torch.Tensor, step_only_reads: bool) -> bool:
        """``g`` may be lent to this step's record."""
        return (self.enabled and step_only_reads and self._drops >= LEARN
                and g.device.type == "cpu" and local_of(g) is g and g.is_contiguous()
                and g.layout == torch.strided and g._base is None
                and 0 < _storage_users(g) <= _SOLE[1])  # (not a view of kept memory)

    def lend(self, name: str, g: torch.Tensor, bufs: list[torch.Tensor]) -> LentGrad:
        """Lend ``g`` to the record whose host buffers are ``bufs``."""
        lent = LentGrad(name, g, bufs)
        if self.pad:  # (once: training's heap from now on holds a record's gradients)
            self.pad = False
            self.stats["heap_top_pad"] = pad_heap(2 * sum(
                p.numel() * p.element_size() for p in self.params if p.device.type == "cpu"))
        self.pending.setdefault(name, []).append(lent)
        self._prev[name] = (weakref.ref(g), True)
        self.stats["lent_grads"] += 1
        return lent

    def _keep(self, lent: LentGrad) -> None:
        try:
            lent.keep(self.pool, self.path)
        except ConfigError as e:
            self.enabled = False
            self.refused = e
            raise
        self.stats["lent_copied"] += 1

    def before_accumulate(self, name: str, p: torch.Tensor) -> None:
        """Backward is about to accumulate into ``p.grad``: copy it first if it is lent."""
        for lent in self.pending.get(name, ()):
            if lent.copy is None and p.grad is lent.tensor:
                self._keep(lent)

    def keep_all(self) -> None:
        """Gradients are about to be zeroed in place: copy every lent one first."""
        for lents in self.pending.values():
            for lent in lents:
                if lent.copy is None:
                    self._keep(lent)

    def settle(self) -> None:
        """The step's record is finalized: a lent tensor training still holds (as
        ``p.grad`` or anywhere else) is copied now, one written meanwhile is refused; the
        others are the writer's alone from now on."""
        pending, self.pending = self.pending, {}
        grads = dict(zip(self.names, self.params, strict=True))
        for name, lents in pending.items():
            p = grads[name]
            for lent in lents:
                if lent.copy is not None:
                    continue
                if p.grad is lent.tensor or lent.tensor._version != lent.version:
                    self._keep(lent)
                elif lent.shared():  # kept by the loop: lend no more until it drops them
                    self._drops = 0  # (and this step's gradients count as kept: the
                    self._prev = {}  # next capture's observation is skipped)
                    self._keep(lent)

    def intact(self) -> bool:
        """No lent tensor not yet copied was written since it was lent (checked after the
        step, which is known to only read its gradients)."""
        return all(lent.copy is not None or lent.tensor._version == lent.version
                   for lents in self.pending.values() for lent in lents)

    def hooks(self) -> list[Any]:
        """Pre-accumulation hooks on the CPU parameters (handles, to remove)."""
        out = []
        for name, p in zip(self.names, self.params, strict=True):
            if p.device.type == "cpu" and p.requires_grad:
                out.append(p.register_hook(_pre_accumulate(weakref.ref(self), name, p)))
        return out


def _pre_accumulate(ref: weakref.ref[GradLender], name: str, p: torch.Tensor
                    ) -> Callable[[torch.Tensor], None]:
    pref = weakref.ref(p)

    def hook(grad: torch.Tensor) -> None:
        me, prm = ref(), pref()
        if me is not None and prm is not None and me.pending:
            me.before_accumulate(name, prm)
    return hook


def zero_grad_wrapper(orig: Callable[..., Any], lenders: Callable[[], GradLender | None]
                      ) -> Callable[..., Any]:
    """``zero_grad`` that copies the lent gradients first when it zeroes in place."""
    def zero_grad(set_to_none: bool = True) -> Any:
        me = lenders()
        if me is not None and not set_to_none and me.pending:
            me.keep_all()
        return orig(set_to_none)
    return zero_grad


__all__ = ["LEARN", "GradLender", "LentGrad", "zero_grad_wrapper"]
