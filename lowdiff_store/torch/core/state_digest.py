"""The digest of live parameters and optimizer state, without a host copy per tensor.

The digest (:func:`~lowdiff_store.torch.core.schema.digest_objects`) is a CRC32C over each
parameter's bytes, then each of its optimizer state entries in key order (the key, then the
tensor's bytes or the msgpack of a packed value). CPU tensors are read where they are.
Device tensors are not copied one by one into fresh pageable memory (on an H100, 882 such
``.cpu()`` copies were 2.40 s of a 5.33 s restore, each a host synchronization): they are
copied in windows of :data:`WINDOW` bytes into two pinned buffers, reused, on a side stream
that first waits for the work queued so far; one event per window, so the CRC of one window
(on several cores, the GIL released) runs while the next is copied. A tensor larger than a
window is cut into window-sized pieces. The value is the same, bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import torch

from ...format.checksum import crc32c_parallel
from .tensors import bits_tensor, bytes_of
from .typed_msgpack import pack

#: device bytes copied to the host per window (two windows are held, pinned, per thread)
WINDOW: Final = 64 << 20


@dataclass
class _Dev:
    """Bytes of a device tensor (a flat uint8 view of its bits), staged through a window."""

    src: torch.Tensor


def on_device(t: torch.Tensor) -> bool:
    """The tensors staged through windows by default: those not on the CPU."""
    return t.device.type != "cpu"


def _segments(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
              staged: Callable[[torch.Tensor], bool]) -> list[Any]:
    """The byte stream of the digest, in order: host buffers and :class:`_Dev` pieces."""
    out: list[Any] = []

    def tensor(t: torch.Tensor) -> None:
        if not staged(t):
            out.append(bytes_of(t).data)
            return
        _tag, bt = bits_tensor(t)
        flat = bt.contiguous().reshape(-1).view(torch.uint8)
        out.extend(_Dev(flat[lo:lo + WINDOW]) for lo in range(0, flat.numel(), WINDOW))

    for p in params:
        tensor(p)
        st = optimizer.state.get(p, {})
        for k, v in sorted(((str(k), v) for k, v in st.items()), key=lambda kv: kv[0]):
            out.append(k.encode())
            if isinstance(v, torch.Tensor):
                tensor(v)
            else:
                out.append(msgpack.packb(pack(v), use_bin_type=True))
    return out


class _Windows:
    """Two host buffers of :data:`WINDOW` bytes (pinned when a device is present), one set
    per thread (the capture's helper thread and a restoring thread never share one)."""

    _local = threading.local()

    @classmethod
    def get(cls, pinned: bool) -> list[torch.Tensor]:
        key = "pinned" if pinned else "pageable"
        bufs: list[torch.Tensor] | None = getattr(cls._local, key, None)
        if bufs is None:
            bufs = [torch.empty(WINDOW, dtype=torch.uint8, pin_memory=pinned)
                    for _ in range(2)]
            setattr(cls._local, key, bufs)
        return bufs


def digest_state(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, *,
                 staged: Callable[[torch.Tensor], bool] | None = None,
                 after: Any = None) -> int:
    """The digest of ``params`` and their state in ``optimizer`` (the value of
    :func:`~lowdiff_store.torch.core.schema.digest_objects`). Tensors for which ``staged``
    is true (default: those not on the CPU) are copied in windows through two reused
    host buffers, never one host copy per tensor. ``after``: a CUDA event the copies wait
    for (recorded by the thread that owns the state, when another thread digests it);
    default: the work queued so far on this thread's current stream."""
    segs = _segments(params, optimizer, staged if staged is not None else on_device)
    devs = [s.src for s in segs if isinstance(s, _Dev)]
    if not devs:
        return crc32c_parallel(segs)
    cuda = [t.device for t in devs if t.device.type == "cuda"]
    bufs = _Windows.get(pinned=bool(cuda))
    stream = None
    if cuda:
        stream = torch.cuda.Stream(device=cuda[0])
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(cuda[0]))  # the state as of now
    # windows: runs of segments holding at most WINDOW device bytes
    windows: list[list[Any]] = [[]]
    held = 0
    for s in segs:
        if isinstance(s, _Dev):
            n = s.src.numel()
            if held + n > WINDOW:
                windows.append([])
                held = 0
            held += n
        windows[-1].append(s)

    def launch(k: int) -> tuple[list[Any], Any]:
        buf, off, views = bufs[k % 2], 0, []
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            for s in windows[k]:
                if isinstance(s, _Dev):
                    n = s.src.numel()
                    dst = buf[off:off + n]
                    dst.copy_(s.src, non_blocking=stream is not None)
                    views.append(dst.numpy().data)
                    off += n
                else:
                    views.append(s)
        ev = None
        if stream is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
        return views, ev

    crc = 0
    nxt = launch(0)
    for k in range(len(windows)):
        views, ev = nxt
        if k + 1 < len(windows):  # its buffer's previous window was checksummed already
            nxt = launch(k + 1)
        if ev is not None:
            ev.synchronize()
        crc = crc32c_parallel(views, crc)
    return crc


__all__ = ["WINDOW", "digest_state", "on_device"]
