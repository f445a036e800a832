"""A record's ``tuning`` field parsed once into a :class:`RecordedDecision` (torch-free).

The checkpointer's tuner writes ``Decision.to_dict()`` (:mod:`lowdiff_store.tuning`) into
the record of the step at which it changed (snapshot_every, batch). Its CRC only proves the
bytes are the ones written: :func:`parse_decision` checks the map against what ``to_dict``
writes (every key, its type and range) and returns a frozen value that consumers (the
report, ``verify``, replay's record check) read by attribute; a map that does not follow
it is one :class:`~lowdiff_store.errors.FormatError` (``bad_metadata``) naming the file,
the record's offset and the key.

A log of any writer may carry the field (the core ``LogWriter`` takes it in ``extra``), so
``verify`` parses it in every log, not only in a torch one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import checks as C
from .checks import Ctx, short

#: the longest reason kept (the tuner's reasons are a sentence or two)
MAX_REASON = 4096


@dataclass(frozen=True)
class RecordedDecision:
    """A tuner decision as a record holds it (``Decision.to_dict()``).

    Attributes:
        step: the step at which the change was decided.
        snapshot_every, batch: the new values (at least 1).
        previous_snapshot_every, previous_batch: the values they replaced (at least 1).
        predicted_waste_before, predicted_waste_after: the model's waste fractions, or None
            (not finite, or no estimate yet).
        reason: why, as the tuner said it.
        measurements: what the model was given (name -> number or None), or None.
    """

    step: int
    snapshot_every: int
    batch: int
    previous_snapshot_every: int
    previous_batch: int
    predicted_waste_before: float | None
    predicted_waste_after: float | None
    reason: str
    measurements: Mapping[str, float | None] | None


_INTERVALS = ("snapshot_every", "batch", "previous_snapshot_every", "previous_batch")
_WASTES = ("predicted_waste_before", "predicted_waste_after")


def parse_decision(v: Any, *, path: str | None = None, offset: int | None = None,
                   step: int | None = None) -> RecordedDecision:
    """The record's ``tuning`` value ``v`` as a :class:`RecordedDecision`; raises
    FormatError(bad_metadata) naming ``path``/``offset`` (the record) and the key."""
    c = Ctx(path, offset, "record" if step is None else f"step {step}")
    if not isinstance(v, dict):
        raise c.fail(f"tuning must be a map, not {short(v)}")
    for k in ("step", *_INTERVALS, "reason"):
        if k not in v:
            raise c.fail(f"tuning has no {k!r}")
    C.integer(c, v["step"], "tuning.step", 0, C.MAX_INT)
    for k in _INTERVALS:
        C.integer(c, v[k], f"tuning.{k}", 1, C.MAX_INT)
    before, after = (C.real(c, v.get(k), f"tuning.{k}", none=True) for k in _WASTES)
    C.string(c, v["reason"], "tuning.reason", maxlen=MAX_REASON)
    raw = v.get("measurements")
    meas: dict[str, float | None] | None = None
    if raw is not None:
        if not isinstance(raw, dict):
            raise c.fail(f"tuning.measurements must be a map or nil, not {short(raw)}")
        meas = {}
        for k, x in raw.items():
            C.string(c, k, "a tuning.measurements key")
            meas[k] = C.real(c, x, f"tuning.measurements.{k}", none=True)
    return RecordedDecision(v["step"], v["snapshot_every"], v["batch"],
                            v["previous_snapshot_every"], v["previous_batch"], before, after,
                            v["reason"], meas)


def record_decision(meta: Mapping[str, Any], *, path: str | None = None,
                    offset: int | None = None, step: int | None = None
                    ) -> RecordedDecision | None:
    """The decision a record's metadata holds (its ``tuning`` field parsed), or None where
    it holds none; raises as :func:`parse_decision`."""
    v = meta.get("tuning")
    return None if v is None else parse_decision(v, path=path, offset=offset, step=step)


__all__ = ["MAX_REASON", "RecordedDecision", "parse_decision", "record_decision"]
