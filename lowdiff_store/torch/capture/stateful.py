"""``extra_state=``: what the checkpointer records beside the model and optimizer.

Three forms are accepted:

- a callable returning msgpack-able data (recorded after each step, returned by
  :func:`~lowdiff_store.torch.restore` as ``RestoreResult.extra``);
- a dict of *stateful* objects, DCP's convention: anything with ``state_dict()`` and
  ``load_state_dict(sd)`` (a torchdata ``StatefulDataLoader``, a sampler, a counter).
  Each step records ``{key: obj.state_dict()}``; ``restore(..., extra_state=same dict)``
  calls ``obj.load_state_dict`` with the recorded value;
- a :class:`LateExtra`: a callable read when the step's record is completed (at the next
  ``optimizer.step()``, ``flush`` or ``close``) instead of inside the optimizer step. The
  trainer integrations use it for bookkeeping that the trainer updates after the optimizer
  step (a global step counter, logged metrics).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ...errors import ConfigError, Reason


@runtime_checkable
class Stateful(Protocol):
    """An object whose state round-trips through ``state_dict`` / ``load_state_dict``."""

    def state_dict(self) -> Any:
        """The object's state (msgpack-able after ``typed_msgpack.pack``)."""

    def load_state_dict(self, state_dict: Any) -> Any:
        """Put a ``state_dict()`` result back."""


class LateExtra:
    """An ``extra_state`` callable read when the step's record is completed (see module
    docstring), not inside ``optimizer.step()``."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def __call__(self) -> Any:
        """The value to record for the step being completed."""
        return self.fn()


class ExtraSource:
    """The checkpointer's view of ``extra_state=`` (any of the three forms, or None)."""

    def __init__(self, extra: Any) -> None:
        self.late = isinstance(extra, LateExtra)
        self.objects: dict[str, Stateful] | None = None
        self._fn: Callable[[], Any] | None = None
        if extra is None:
            return
        if isinstance(extra, Mapping):
            self.objects = check_stateful(extra)
            objs = self.objects
            self._fn = lambda: {k: o.state_dict() for k, o in objs.items()}
        elif callable(extra):
            self._fn = extra
        else:
            raise ConfigError(f"extra_state must be a callable or a dict of objects with "
                              f"state_dict()/load_state_dict(), not a {type(extra).__name__}",
                              reason=Reason.INVALID_ARGUMENT)

    @property
    def active(self) -> bool:
        """Something is recorded."""
        return self._fn is not None

    def __call__(self) -> Any:
        """The current value (None when nothing is recorded)."""
        return None if self._fn is None else self._fn()


def check_stateful(objs: Mapping[Any, Any]) -> dict[str, Stateful]:
    """A dict of stateful objects, checked (str keys, both methods present)."""
    out: dict[str, Stateful] = {}
    for k, o in objs.items():
        if type(k) is not str:
            raise ConfigError(f"extra_state keys must be str, got {k!r}",
                              reason=Reason.INVALID_ARGUMENT)
        if not isinstance(o, Stateful):
            raise ConfigError(f"extra_state[{k!r}] ({type(o).__name__}) has no state_dict() and "
                              f"load_state_dict()", reason=Reason.INVALID_ARGUMENT)
        out[k] = o
    return out


def load_stateful(objs: Mapping[Any, Any], extra: Any) -> list[str]:
    """``obj.load_state_dict(extra[key])`` for each object; returns notes on objects the
    log holds no state for."""
    checked = check_stateful(objs)
    notes: list[str] = []
    if not isinstance(extra, Mapping):
        return [f"the log holds no extra state for {sorted(checked)}"]
    for k, o in checked.items():
        if k in extra:
            o.load_state_dict(extra[k])
        else:
            notes.append(f"the log holds no extra state for {k!r}")
    return notes




def extra_at(path: str | os.PathLike[str], step: int) -> Any:
    """The extra state recorded for ``step`` (unpacked), read from the log's metadata only:
    no replay, no payload read (:func:`restore` checks everything when it replays). For a
    sharded checkpoint, this rank's shard."""
    from ...log import LogReader
    from ...log.shards import is_sharded, shard_path
    from ..core.typed_msgpack import unpack

    p = os.fspath(path)
    if is_sharded(p):
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and \
            torch.distributed.is_initialized() else 0
        p = shard_path(p, rank)
    with LogReader(p, verify=False) as reader:
        b, diffs = reader.chain(step)
        with reader.base(b) as base:
            extra = (base.meta().get("torch") or {}).get("extra")
        for t in diffs:
            side = reader.record(t).side
            if "extra" in side:
                extra = side["extra"]
    return None if extra is None else unpack(extra)


__all__ = ["ExtraSource", "LateExtra", "Stateful", "check_stateful", "extra_at", "load_stateful"]
