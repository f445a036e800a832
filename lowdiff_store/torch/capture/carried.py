"""What the log says the objects hold after the last record: a step's record states a
side-channel value (hyperparameters, scheduler, scaler, ``extra_state()``, a module
buffer, an RNG state, a compressor residual) only when it differs from the value carried
so far. Replay carries the same values forward."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

_ABSENT = object()


class Carried:
    """The last value recorded under each key; ``same(a, b)`` says two values have the
    same bits (``schema.same`` for packed values, ``tensors.same_bytes`` for arrays). A
    key with no value (never recorded, or :meth:`forget`) is stated by the next record."""

    __slots__ = ("_last", "_same")

    def __init__(self, same: Callable[[Any, Any], bool]) -> None:
        self._same = same
        self._last: dict[Hashable, Any] = {}

    def changed(self, key: Hashable, value: Any) -> bool:
        """True when ``value`` must be recorded under ``key`` (then it is carried from
        now on); False when it has the same bits as the carried value."""
        last = self._last.get(key, _ABSENT)
        if last is not _ABSENT and self._same(last, value):
            return False
        self._last[key] = value
        return True

    def set(self, key: Hashable, value: Any) -> None:
        """Carry ``value`` under ``key`` without recording it (the state at creation)."""
        self._last[key] = value

    def get(self, key: Hashable) -> Any:
        """The carried value of ``key`` (None if there is none)."""
        return self._last.get(key)

    def forget(self) -> None:
        """Nothing is known any more: the next record states every value."""
        self._last.clear()


__all__ = ["Carried"]
