"""A record's torch fields checked against its log's parsed metadata: the side channel
(``side``) and the optional ``digest`` and ``tuning``. Records are many and small: the check
reads the side channel where it is, keeps no copy, and allocates only for what a record
actually holds (a clip, an optimizer layout). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import checks as C
from .checks import Ctx, short
from .decision import record_decision
from .meta import LogMeta
from .names import GRAD

_FLOAT_TAGS = ("F64", "F32", "F16", "BF16")


def check_record_meta(meta: Mapping[str, Any], log: LogMeta, names: Sequence[str],
                      *, side: Any = None, path: str | None = None,
                      offset: int | None = None, step: int | None = None) -> dict[str, Any]:
    """Check a record's torch fields against the log's metadata and return its side
    channel: ``hyper``/``hyper_after`` (one map per group), ``clip`` (a one-element float
    scale and parameters whose gradients the record holds), ``amp`` (known optimizer
    attributes, one-element tensors), packed ``sched``/``scaler``/``extra``, ``skipped``,
    ``opt_layout`` (delta mode), ``hook``; and the optional ``digest`` (uint32) and
    ``tuning`` (:func:`~.decision.parse_decision`). ``names``: the record's tensor names;
    ``side``: its side channel when the caller holds it apart from ``meta`` (default:
    ``meta["side"]``)."""
    c = Ctx(path, offset, "record" if step is None else f"step {step}")
    if side is None:
        side = meta.get("side", {})
    if side is None:
        side = {}
    if not isinstance(side, dict):
        raise c.fail("side channel is not a map")
    groups = len(log.groups)
    for k in ("hyper", "hyper_after"):
        if k in side:
            C.hyper(c, side[k], f"side.{k}", groups)
    clip = side.get("clip")
    if clip is not None:
        _clip(c, clip, log, names)
    amp = side.get("amp")
    if amp is not None:
        if not isinstance(amp, dict):
            raise c.fail("side.amp must be a map")
        for k, v in amp.items():
            if k not in C.AMP_KEYS:
                raise c.fail(f"side.amp key {short(k)} is not one of "
                             f"{', '.join(C.AMP_KEYS)}")
            C.packed_scalar_tensor(v, c, f"side.amp.{k}", _FLOAT_TAGS)
    for k in ("sched", "scaler", "extra"):
        if k in side:
            C.packed(side[k], c, f"side.{k}")
    if not isinstance(side.get("skipped", False), bool):
        raise c.fail("side.skipped must be a bool")
    if "opt_layout" in side:
        C.opt_layout(c, side["opt_layout"], "side.opt_layout", log.param_set)
    hook = side.get("hook")
    if hook is not None and not isinstance(hook, dict):
        raise c.fail("side.hook must be a map")
    C.integer(c, meta.get("digest"), "digest", 0, 0xFFFFFFFF, none=True)
    record_decision(meta, path=path, offset=offset, step=step)
    return side


def _clip(c: Ctx, clip: Any, log: LogMeta, names: Sequence[str]) -> None:
    if not isinstance(clip, dict):
        raise c.fail("side.clip must be a map")
    C.packed_scalar_tensor(clip.get("scale"), c, "side.clip.scale", _FLOAT_TAGS)
    have = set(names)
    for n in C.tensor_names(c, clip.get("params"), "side.clip.params"):
        if n not in log.param_set or GRAD + n not in have:
            raise c.fail(f"side.clip.params names {n!r}, whose gradient the record "
                         "does not hold")


__all__ = ["check_record_meta"]
