"""A log with streamed bases (spec section 7.2) written through the storage core alone
(no torch): base 0 of tensors ``a``, ``b``, ``c``; one record per step holding the three
tensors' values after it; streamed bases whose slices hold the tensors' values after
each slice's step, so every file can be checked against :func:`value`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lowdiff_store import LogWriter, tensor_input

#: the tensors of the log, each a slice of its own in a streamed base of three slices
NAMES = ("a", "b", "c")


def value(name: str, step: int, size: int = 4) -> np.ndarray:
    """What tensor ``name`` (of ``size`` elements) holds after ``step``."""
    return np.arange(size, dtype="<f4") + np.float32(100 * NAMES.index(name) + step)


def make_streamed_log(path: Path, steps: int,
                      streamed: Sequence[tuple[int, tuple[int, ...]]],
                      *, segment_bytes: int | None = None, size: int = 4,
                      groups: Sequence[Sequence[str]] | None = None) -> None:
    """Steps 1..``steps``, base 0 and the streamed bases ``streamed`` ((complete step,
    slice steps), each slice written after its step's record; ``groups``: the tensors of
    each slice, default one of :data:`NAMES` per slice; ``size``: elements per tensor)."""
    kw = {} if segment_bytes is None else {"segment_bytes": segment_bytes}
    slice_at = {s: (c, sl, i) for c, sl in streamed for i, s in enumerate(sl)}
    with LogWriter(path, **kw) as w:
        w.write_base(0, {n: ("F32", value(n, 0, size)) for n in NAMES}, {"kind": "test"})
        for s in range(1, steps + 1):
            w.append(s, [tensor_input(n, value(n, s, size), "F32") for n in NAMES], kind="grad")
            w.sync()
            if s in slice_at:
                c, sl, i = slice_at[s]
                names = (groups or [[n] for n in NAMES])[i]
                w.write_base(s, {n: ("F32", value(n, s, size)) for n in names},
                             {"kind": "test", "slice": {"base": c, "steps": list(sl)}})


__all__ = ["NAMES", "make_streamed_log", "value"]
