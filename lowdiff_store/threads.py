"""Helper threads shared by a process: work beside the caller's thread (the CRC of a large
buffer in runs, the copy of a step's gradients beside the optimizer step).

A :class:`HelperPool` starts its threads on first use, only where a second core exists
(on one core a helper would only take turns with the caller), and is forgotten in a forked
child, where the parent's threads do not exist (an executor that believes they do would
queue work nobody runs) and its lock may be held.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_POOLS: weakref.WeakSet[HelperPool] = weakref.WeakSet()


class HelperPool:
    """A lazily started :class:`ThreadPoolExecutor` of ``threads(cores)`` threads named
    ``name``; :meth:`get` is None below two usable cores."""

    def __init__(self, name: str, threads: Callable[[int], int]) -> None:
        self.name = name
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0
        self._lock = threading.Lock()
        _POOLS.add(self)

    def get(self) -> tuple[ThreadPoolExecutor, int] | None:
        """The executor and its number of threads, started now if needed; None on one
        core."""
        cores = usable_cores()
        if cores < 2:
            return None
        with self._lock:
            if self._pool is None:
                self._size = max(1, self._threads(cores))
                self._pool = ThreadPoolExecutor(self._size, thread_name_prefix=self.name)
            return self._pool, self._size

    def _forget(self) -> None:
        self._pool, self._lock = None, threading.Lock()


def _forget_all() -> None:
    for p in list(_POOLS):
        p._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all)

__all__ = ["HelperPool", "usable_cores"]
