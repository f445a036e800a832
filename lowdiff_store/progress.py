"""A minimal progress bar: drawn on a terminal (stderr), silent when piped or disabled."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

#: the progress callback every long operation takes: ``progress(done, total)``
ProgressFn = Callable[[int, int], None]


class Progress:
    """``with Progress("verify", total) as p: p.update(n)``. Draws at most 10 times a second."""

    def __init__(self, label: str, total: int, *, enabled: bool | None = None,
                 stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = (self.stream.isatty() if enabled is None else enabled)
        self.label = label
        self.total = max(total, 0)
        self.done = 0
        self._last = 0.0

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` units."""
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            self._draw()

    def __call__(self, done: int, total: int) -> None:
        """Callback form: ``progress(done, total)``."""
        self.total = total
        self.update(done - self.done)

    def _draw(self) -> None:
        frac = self.done / self.total if self.total else 1.0
        width = 30
        bar = "#" * int(frac * width)
        self.stream.write(f"\r{self.label} [{bar:<{width}}] {self.done}/{self.total}")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


__all__ = ["Progress", "ProgressFn"]
