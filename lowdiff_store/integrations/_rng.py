"""Python and NumPy global RNG states as msgpack-able values (trainers restore them with
their own checkpoints; the torch generators are recorded by the checkpointer itself)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np


def np_state() -> list[Any]:
    """``np.random.get_state()`` with the key array as bytes."""
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return [name, np.asarray(keys, dtype=np.uint32).tobytes(), int(pos), int(has_gauss),
            float(cached)]


def set_np_state(s: Any) -> None:
    """Inverse of :func:`np_state`."""
    np.random.set_state((s[0], np.frombuffer(s[1], dtype=np.uint32).copy(), s[2], s[3], s[4]))


def py_state() -> list[Any]:
    """``random.getstate()`` with its 625 words as one bytes value (cheap to record)."""
    version, words, gauss = random.getstate()
    return [version, np.asarray(words, dtype=np.uint32).tobytes(), gauss]


def set_py_state(s: Any) -> None:
    """Inverse of :func:`py_state`."""
    words = tuple(int(w) for w in np.frombuffer(s[1], dtype=np.uint32))
    random.setstate((s[0], words, s[2]))


__all__ = ["np_state", "py_state", "set_np_state", "set_py_state"]
