"""Where captured gradients live until the writer has them: host buffers, the layer-wise
copies made during backward, and the device-to-host copy events.

- :class:`HostPool` recycles host buffers (pinned when copying from CUDA); a buffer goes
  back once the writer is done with the record holding it.
- :class:`GradStaging` is layer-wise capture (``capture="layerwise"``, LowDiff+): a
  gradient is copied as soon as backward produces it (on a side stream under CUDA), and at
  the optimizer step a staged copy is used only if the gradient is the same tensor with the
  same version counter and the same memory (``.data`` assignments swap the memory without
  bumping the counter); :meth:`GradStaging.claim` and :meth:`GradStaging.copy_claimed`
  make the dense copies otherwise.
- :func:`copies_done` marks the end of the non-blocking copies just issued.
- Dense copies of CPU gradients can run *beside* the optimizer step, on a helper thread
  (the copy releases the GIL), and the checkpointer's first post-step hook waits for
  them. Only for a step that never writes its gradients
  (:func:`~.optim_wrap.step_reads_grads_only`): a write during the copy would tear it.
  This is the CPU's counterpart of the non-blocking device-to-host copy under CUDA: it
  takes the copy off the training thread (``docs/design.md``, section 5).

Nothing here decides what is logged: :class:`~lowdiff_store.torch.DiffCheckpointer` does.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch

from ...threads import HelperPool
from ..core.tensors import local_of

#: What identifies a gradient's contents short of reading them: the tensor, its version
#: counter (bumped by in-place torch ops), its memory and layout (a ``.data`` assignment
#: keeps the tensor and the counter but swaps the memory).
GradIdent = tuple[int, int, int, tuple[int, ...], tuple[int, ...]]


def grad_ident(g: torch.Tensor) -> GradIdent:
    """The :data:`GradIdent` of gradient ``g`` as it is now."""
    return (id(g), g._version, g.data_ptr(), tuple(g.shape), tuple(g.stride()))


class HostPool:
    """Reusable host buffers for captured tensors (pinned when copying from CUDA)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, tuple[int, ...], bool], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer of ``like``'s dtype and shape (its local shard for a DTensor)."""
        like = local_of(like)
        pin = like.device.type == "cuda"
        key = (like.dtype, tuple(like.shape), pin)
        with self._lock:
            lst = self._free.get(key)
            if lst:
                return lst.pop()
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)

    def give(self, bufs: list[torch.Tensor]) -> None:
        """Return buffers (the writer no longer reads them)."""
        with self._lock:
            for b in bufs:
                key = (b.dtype, tuple(b.shape), b.is_pinned())
                self._free.setdefault(key, []).append(b)


def copies_done(sources: list[torch.Tensor], side: Mapping[torch.device, Any]) -> list[Any]:
    """Events marking the end of the non-blocking device-to-host copies just issued (on
    each device's current stream, and its side stream for layer-wise copies); empty on
    CPU, where copies are synchronous. Waited for when the record goes to the writer."""
    events = []
    for dev in {t.device for t in sources if t.device.type == "cuda"}:
        stream = torch.cuda.current_stream(dev)
        if dev in side:
            stream.wait_stream(side[dev])
        ev = torch.cuda.Event()
        ev.record(stream)
        events.append(ev)
    return events


#: the helper thread for copies beside the step
_COPIER = HelperPool("lowdiff-grad-copy", lambda cores: 1)


class GradStaging:
    """Gradient copies for one checkpointer: layer-wise copies made during backward, and
    dense copies at the optimizer step, in buffers of :attr:`pool`."""

    def __init__(self) -> None:
        self.pool = HostPool()
        #: a side stream per CUDA device for layer-wise copies
        self.streams: dict[torch.device, Any] = {}
        #: name -> (host copy, identity of the gradient copied) made during backward
        self._staged: dict[str, tuple[torch.Tensor, GradIdent]] = {}
        #: dense copies claimed, made together by copy_claimed: (host buffer, gradient)
        self._todo: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: the CPU copy running beside the step, and its sources' versions when it began
        #: (see :meth:`copy_claimed`)
        self._beside: Future[None] | None = None
        self._beside_srcs: list[tuple[torch.Tensor, int]] = []

    def stage(self, name: str, g: torch.Tensor) -> None:
        """Layer-wise: copy gradient ``g`` of parameter ``name`` now (backward just made it)."""
        old = self._staged.get(name)
        buf = old[0] if old is not None and old[0].shape == g.shape and \
            old[0].dtype == g.dtype else self.pool.take(g)
        if g.device.type == "cuda":
            stream = self.streams.get(g.device)
            if stream is None:
                stream = self.streams[g.device] = torch.cuda.Stream(g.device)
            stream.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(stream):
                buf.copy_(g, non_blocking=True)
            g.record_stream(stream)
        else:
            buf.copy_(g)
        self._staged[name] = (buf, grad_ident(g))

    def valid(self, name: str, g: torch.Tensor) -> bool:
        """The staged copy of ``name`` holds ``g`` as it is now (same tensor, same version,
        same memory)."""
        s = self._staged.get(name)
        return s is not None and s[1] == grad_ident(g)

    def rescaled(self, name: str, g: torch.Tensor) -> None:
        """``g`` was scaled in place by a recorded coefficient (clipping): its staged copy
        stays the pre-scale gradient, valid at the new version."""
        buf, _old = self._staged[name]
        self._staged[name] = (buf, grad_ident(g))

    def claim(self, name: str, g: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The host copy of ``g`` to log: the staged one if still valid (True), else a
        host buffer that :meth:`copy_claimed` fills (False)."""
        staged = self._staged.pop(name, None)
        if staged is not None and staged[1] == grad_ident(g):
            return staged[0], True
        if staged is not None:
            self.pool.give([staged[0]])
        buf = self.pool.take(g)
        self._todo.append((buf, local_of(g)))
        return buf, False

    def copy_claimed(self, *, beside: bool = False) -> None:
        """Make the dense copies claimed since the last call: one ``torch._foreach_copy_``
        per source device (non-blocking from CUDA into pinned buffers), not a Python call
        per tensor. With ``beside``, the CPU copy runs on a helper thread while the caller
        goes on (into the optimizer step): :meth:`wait` before the buffers are read or the
        gradients may change."""
        self.wait()  # one in flight at a time (a step that raised never waited for its own)
        todo, self._todo = self._todo, []
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for buf, src in todo:
            dst, srcs = by_device.setdefault(src.device, ([], []))
            dst.append(buf)
            srcs.append(src)
        helper = _COPIER.get() if beside else None
        for dev, (dst, srcs) in by_device.items():
            if dev.type == "cpu" and helper is not None:
                try:
                    self._beside_srcs = [(t, t._version) for t in srcs]
                    self._beside = helper[0].submit(torch._foreach_copy_, dst, srcs)
                    continue
                except RuntimeError:  # "cannot schedule new futures after shutdown"
                    self._beside_srcs = []
            torch._foreach_copy_(dst, srcs, non_blocking=dev.type == "cuda")

    def wait(self) -> bool:
        """Wait for the copy running beside the step, if any (re-raising its error).
        Returns False when an in-place torch op changed one of its sources meanwhile
        (the copy may be torn), else True."""
        fut, self._beside = self._beside, None
        srcs, self._beside_srcs = self._beside_srcs, []
        if fut is None:
            return True
        fut.result()
        return all(t._version == v for t, v in srcs)

    def drop_unclaimed(self) -> None:
        """Give back the staged copies no step consumed (parameters without a gradient)."""
        self.pool.give([b for b, _i in self._staged.values()])
        self._staged = {}


__all__ = ["GradIdent", "GradStaging", "HostPool", "copies_done", "grad_ident"]
