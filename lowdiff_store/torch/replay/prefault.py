"""Fresh tensors made resident on a helper thread while the caller reads others from disk.

Loading a base builds the optimizer state in new memory: the kernel then zeroes every page
on first touch, about as long as reading those bytes from a fast disk, and on the caller's
thread it would add to the read instead of hiding under it. :class:`Prefault` touches the
new tensors in the order the caller will fill them, on a thread of its own (torch releases
the GIL while it writes), while the caller waits on the disk for the model's tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

#: below this many bytes in all, the tensors are left to the caller (a thread costs more)
MIN_BYTES = 64 << 20


class Prefault:
    """Touch ``tensors`` (new CPU tensors whose contents do not matter yet) on a helper
    thread, in order. The caller fills them in the same order, calling :meth:`ready(i)
    <ready>` before writing tensor ``i``: it returns once the thread is done with that
    tensor, or at once when the thread has not reached it (the thread then stops: the
    caller's own writes fault the rest in). A context manager: leaving it stops the
    thread and waits for it, so no tensor is written by it afterwards."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        self._cond = threading.Condition()
        self._taken = 0      # tensors the thread has started
        self._finished = 0   # tensors the thread is done with
        self._stop = False
        self._thread: threading.Thread | None = None
        if sum(t.numel() * t.element_size() for t in self._tensors) >= MIN_BYTES:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="lowdiff-replay-prefault")
            self._thread.start()

    def _run(self) -> None:
        for i, t in enumerate(self._tensors):
            with self._cond:
                if self._stop:
                    break
                self._taken = i + 1
            try:
                with torch.no_grad():
                    t.zero_()
            finally:
                with self._cond:
                    self._finished = i + 1
                    self._cond.notify_all()
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def ready(self, i: int) -> None:
        """Tensor ``i`` may be written by the caller from now on."""
        if self._thread is None:
            return
        with self._cond:
            if self._taken <= i:
                self._stop = True  # behind the caller: the caller's writes fault the rest
            while self._finished < min(self._taken, i + 1):
                self._cond.wait()

    def close(self) -> None:
        """Stop the thread and wait for it."""
        if self._thread is None:
            return
        with self._cond:
            self._stop = True
        self._thread.join()
        self._thread = None

    def __enter__(self) -> Prefault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MIN_BYTES", "Prefault"]
