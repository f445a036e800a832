"""Python and NumPy global RNG states as msgpack-able values (trainers restore them with
their own checkpoints; the torch generators are recorded by the checkpointer itself)."""

from __future__ import annotations

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


def tuples(v: Any) -> Any:
    """``random.setstate`` wants tuples where a decoded value may hold lists."""
    return tuple(tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


__all__ = ["np_state", "set_np_state", "tuples"]
