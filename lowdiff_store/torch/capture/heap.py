"""Training's heap while the engine holds its gradients (glibc's ``malloc``; ``heap_pad``).

A loop that drops its gradients every step (``zero_grad(set_to_none=True)``) frees them
before the next backward, and that backward and the optimizer's temporaries reuse the
freed memory: a steady heap, no page faults. When the checkpointer lends those gradients
to their record (:mod:`.lending`: no copy), they stay alive until the record is written,
so the optimizer's temporaries of the next step (AdamW's ``sqrt`` and division, each the
size of a parameter) no longer fit in holes and extend the top of the heap; freed, they
join a top larger than glibc's trim threshold (twice the largest block it has seen
mapped, some tens of MB), which glibc gives back to the kernel, and the next step faults
the same pages in again. Measured on the 20.5M-parameter benchmark LM
(``bench/RESULTS.md``, "ninth session"): 9168 minor faults (36 MB) and 27 ms of kernel
time per 0.55 s step on the training thread, against 0 without the checkpointer.

:func:`pad_heap` asks glibc to keep that much free memory at the top of the heap
(``mallopt(M_TOP_PAD)``) instead of trimming it: twice the bytes of the gradients one
record holds (:class:`.GradLender`; at most :data:`MAX_PAD`). One record's worth left
faults on a model whose two largest parameters are half its bytes (the lent gradients
of a step freed by the writer while the next step's temporaries are alive); twice, none.
It is memory training touches again every step, so the peak is unchanged; only what the
process holds after training pauses can be higher, by at most the pad.

Setting the pad turns off glibc's sliding mmap threshold, so the threshold is set too, to
:data:`MMAP_THRESHOLD`: the value that sliding threshold reaches in a process that has
freed a block that large (its ceiling on 64-bit glibc), where a fresh process would
otherwise keep mapping every block over 128 KiB by itself and fault it in at every step.

Process-wide and never undone (two checkpointers: the larger pad). Left alone where the
user tuned ``malloc`` (``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, a ``glibc.malloc`` tunable in ``GLIBC_TUNABLES``, or another
allocator in ``LD_PRELOAD``), off glibc (musl, macOS), and with ``heap_pad=False``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable

#: mallopt parameters (glibc's malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
#: the mmap threshold set with the pad: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
#: (4 MiB * sizeof(long)), the most its sliding threshold reaches
MMAP_THRESHOLD = 32 << 20
#: the largest pad asked for (bytes of free memory kept at the top of the heap)
MAX_PAD = 1 << 30
#: a user's own malloc tuning, which is left alone
USER_TUNING = ("MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_lock = threading.Lock()
_pad = 0  # the pad in force (0: never set)


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None off glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # (musl: a mallopt doing nothing)
            return None
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def user_tuned() -> bool:
    """The environment tunes glibc's malloc, or preloads another allocator (jemalloc,
    tcmalloc, mimalloc: its name holds "malloc"); then nothing here changes anything."""
    preload = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    return (any(k in os.environ for k in USER_TUNING)
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
            or any("malloc" in os.path.basename(p) for p in preload))


def pad_heap(nbytes: int) -> int:
    """Keep up to ``nbytes`` (at most :data:`MAX_PAD`, rounded up to MiB) of free memory at
    the top of the heap rather than give it back to the kernel (module docstring). Returns
    the pad in force (a larger one set before is kept), 0 where nothing was set: off glibc,
    a user's own tuning, or ``mallopt`` refused."""
    global _pad
    pad = min(MAX_PAD, -(-max(nbytes, 1) // (1 << 20)) << 20)
    with _lock:
        if pad <= _pad:
            return _pad
        fn = _mallopt()
        if fn is None or user_tuned():
            return 0
        if not (fn(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and fn(M_TOP_PAD, pad)):
            return _pad
        _pad = pad
        return pad


def heap_pad() -> int:
    """The pad in force in this process (0: none set here)."""
    return _pad


__all__ = ["MAX_PAD", "MMAP_THRESHOLD", "USER_TUNING", "heap_pad", "pad_heap", "user_tuned"]
