"""Where captured gradients live until the writer has them: host buffers, the layer-wise
copies made during backward, and the device-to-host copy events.

- :class:`HostPool` recycles host buffers (pinned when copying from CUDA); a buffer goes
  back once the writer is done with the record holding it.
- :class:`GradStaging` is layer-wise capture (``capture="layerwise"``, LowDiff+): a
  gradient is copied as soon as backward produces it (on a side stream under CUDA), and at
  the optimizer step a staged copy is used only if the gradient is the same tensor with the
  same version counter; :meth:`GradStaging.copy` makes the dense copy otherwise.
- :func:`copies_done` marks the end of the non-blocking copies just issued.

Nothing here decides what is logged: :class:`~lowdiff_store.torch.DiffCheckpointer` does.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from ._tensors import local_of


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


class GradStaging:
    """Gradient copies for one checkpointer: layer-wise copies made during backward, and
    dense copies at the optimizer step, in buffers of :attr:`pool`."""

    def __init__(self) -> None:
        self.pool = HostPool()
        #: a side stream per CUDA device for layer-wise copies
        self.streams: dict[torch.device, Any] = {}
        #: name -> (host copy, id(grad), grad._version) made during backward
        self._staged: dict[str, tuple[torch.Tensor, int, int]] = {}

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
        self._staged[name] = (buf, id(g), g._version)

    def valid(self, name: str, g: torch.Tensor) -> bool:
        """The staged copy of ``name`` holds ``g`` as it is now (same tensor, same version)."""
        s = self._staged.get(name)
        return s is not None and s[1] == id(g) and s[2] == g._version

    def rescaled(self, name: str, g: torch.Tensor) -> None:
        """``g`` was scaled in place by a recorded coefficient (clipping): its staged copy
        stays the pre-scale gradient, valid at the new version."""
        buf, gid, _ver = self._staged[name]
        self._staged[name] = (buf, gid, g._version)

    def claim(self, name: str, g: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The host copy of ``g`` to log: the staged one if still valid (True), else a
        fresh non-blocking copy (False)."""
        staged = self._staged.pop(name, None)
        if staged is not None and staged[1] == id(g) and staged[2] == g._version:
            return staged[0], True
        if staged is not None:
            self.pool.give([staged[0]])
        buf = self.pool.take(g)
        buf.copy_(local_of(g), non_blocking=True)
        return buf, False

    def drop_unclaimed(self) -> None:
        """Give back the staged copies no step consumed (parameters without a gradient)."""
        self.pool.give([b for b, _i, _v in self._staged.values()])
        self._staged = {}


__all__ = ["GradStaging", "HostPool", "copies_done"]
