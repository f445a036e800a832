"""Progress reporting: the callback type every long operation takes, and a bar for terminals.

:data:`ProgressFn` is the one definition of the callback type: ``progress(done, total)``,
called by ``verify_log``, ``compact``, ``replay_state``, ``materialize_base`` and the CLI.
``done`` grows monotonically up to ``total``; ``total`` may change between calls (a
replay learns its length after opening the log).

:class:`Progress` is a callable ``ProgressFn`` that draws a bar with rate and ETA (from
``tqdm``) on a terminal (stderr) and stays silent when stderr is piped or when disabled.
This module imports nothing from lowdiff-store and never torch, so every layer may import
:data:`ProgressFn` from it; ``tqdm`` is imported only when a bar is drawn.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from typing import Any, TextIO

#: the progress callback every long operation takes: ``progress(done, total)``
ProgressFn = Callable[[int, int], None]


class Progress:
    """``with Progress("verify", total) as p: p.update(n)`` or pass ``p`` as a
    :data:`ProgressFn` (``p(done, total)``).

    ``enabled``: None (default) draws only when ``stream`` is a terminal. ``unit="B"``
    shows sizes and rates in KiB/MiB/GiB. The bar redraws at most 10 times a second.
    """

    def __init__(self, label: str, total: int, *, enabled: bool | None = None,
                 stream: TextIO | None = None, unit: str = "it") -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self.label = label
        self.total = max(total, 0)
        self.done = 0
        self._bar: Any = None
        if self.enabled:
            from tqdm import tqdm

            # the terminal's size, else 80x24: a terminal that reports 0x0 (a fresh pty)
            # would otherwise get no bar at all from tqdm
            size = shutil.get_terminal_size()
            self._bar = tqdm(desc=label, total=self.total, file=self.stream, unit=unit,
                             unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                             mininterval=0.1, ncols=size.columns, nrows=size.lines,
                             leave=True)

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` units."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def __call__(self, done: int, total: int) -> None:
        """Callback form (:data:`ProgressFn`): ``done`` of ``total`` units are finished."""
        if total != self.total:
            self.total = max(total, 0)
            if self._bar is not None:
                self._bar.total = self.total
                self._bar.refresh()
        self.update(done - self.done)

    def close(self) -> None:
        """Finish the bar (a newline on the terminal). Idempotent."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or bare stream: no bar
        return False


__all__ = ["Progress", "ProgressFn"]


def human_bytes(n: float, fmt: str = ".2f") -> str:
    """``1536`` -> ``1.50 KiB`` (``fmt`` for the number of the larger units: ``".3g"``
    gives ``1.5 KiB``); whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:{fmt}} {unit}"
        n /= 1024
    return f"{n:{fmt}} TiB"
