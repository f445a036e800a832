"""Typed msgpack values: the non-tensor state (hyperparameters, scheduler and scaler state,
``extra_state()``) as plain msgpack that round-trips exactly.

msgpack alone loses tuples (``betas``), non-str dict keys and tensors (a tensor ``lr``).
:func:`pack` maps them to single-key maps whose key starts with a NUL, which no ordinary
value uses (a user map that happens to look like one is escaped the same way), and
:func:`unpack` maps them back. Nothing here chooses code to run: the only objects built are
None, bool, int, float, str, bytes, list, tuple, dict and CPU tensors of a known dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import torch

from ...errors import ConfigError, FormatError, Reason

# the tags and limits are the schema's (lowdiff_store.torchmeta checks packed values read
# from files without torch)
from ...torchmeta import MAP_TAG, MAX_DEPTH, MAX_INLINE_NUMEL, TENSOR_TAG, TUPLE_TAG
from .tensors import from_bits, to_bits

_TUPLE = TUPLE_TAG
_MAP = MAP_TAG
_TENSOR = TENSOR_TAG
_TAGS = frozenset({_TUPLE, _MAP, _TENSOR})

_I64 = (-(1 << 63), (1 << 64) - 1)


def pack(obj: Any, where: str = "value", _depth: int = 0) -> Any:
    """A msgpack-able form of ``obj``; raises ConfigError naming the path of a bad value."""
    if _depth > MAX_DEPTH:
        raise ConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if obj is None or isinstance(obj, (bool, str, bytes, float)):
        return obj
    if isinstance(obj, int):
        if not _I64[0] <= obj <= _I64[1]:
            raise ConfigError(f"{where}: integer {obj} does not fit in 64 bits")
        return int(obj)
    if isinstance(obj, np.generic) and not isinstance(obj, np.void):
        return pack(obj.item(), where, _depth)
    if isinstance(obj, torch.Tensor):
        if obj.numel() > MAX_INLINE_NUMEL:
            raise ConfigError(f"{where}: a tensor of {obj.numel()} elements is too large for "
                              f"metadata (at most {MAX_INLINE_NUMEL})")
        tag, arr = to_bits(obj)
        return {_TENSOR: [tag, list(arr.shape), arr.tobytes()]}
    if isinstance(obj, (tuple, torch.Size)):
        return {_TUPLE: [pack(v, f"{where}[{i}]", _depth + 1) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [pack(v, f"{where}[{i}]", _depth + 1) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(type(k) is str for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: pack(v, f"{where}[{k!r}]", _depth + 1) for k, v in obj.items()}
        return {_MAP: [[pack(k, f"{where} key", _depth + 1), pack(v, f"{where}[{k!r}]",
                                                                     _depth + 1)]
                       for k, v in obj.items()]}
    raise ConfigError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be "
                      f"stored (use None, bool, int, float, str, bytes, lists, tuples, dicts "
                      f"or small tensors)", reason=Reason.INVALID_ARGUMENT)


def unpack(obj: Any, _depth: int = 0) -> Any:
    """Inverse of :func:`pack`. Raises FormatError on a malformed tagged value."""
    if _depth > MAX_DEPTH:
        raise FormatError(f"packed value nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, list):
        return [unpack(v, _depth + 1) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (key, val), = obj.items()
        if key == _TUPLE and isinstance(val, list):
            return tuple(unpack(v, _depth + 1) for v in val)
        if key == _MAP and isinstance(val, list):
            out: dict[Any, Any] = {}
            for kv in val:
                if not isinstance(kv, list) or len(kv) != 2:
                    raise FormatError("bad packed map entry")
                k = unpack(kv[0], _depth + 1)
                try:
                    out[k] = unpack(kv[1], _depth + 1)
                except TypeError:
                    raise FormatError("unhashable packed map key") from None
            return out
        if key == _TENSOR:
            return _tensor(val)
    return {k: unpack(v, _depth + 1) for k, v in obj.items()}


def _tensor(val: Any) -> torch.Tensor:
    if (not isinstance(val, list) or len(val) != 3 or not isinstance(val[0], str)
            or not isinstance(val[1], list) or not isinstance(val[2], bytes)
            or not all(type(d) is int and d >= 0 for d in val[1])):
        raise FormatError("bad packed tensor")
    tag, shape, data = val
    numel = 1
    for d in shape:
        numel *= d
    if numel > MAX_INLINE_NUMEL:
        raise FormatError("packed tensor too large", reason=Reason.LIMIT_EXCEEDED)
    from ...format.dtypes import storage_dtype

    dt = storage_dtype(tag)
    if len(data) != numel * dt.itemsize:
        raise FormatError("packed tensor size does not match its shape",
                          reason=Reason.BAD_RECORD_LENGTH)
    return from_bits(tag, np.frombuffer(data, dtype=dt).reshape(shape))


def packb(obj: Any, where: str = "value") -> bytes:
    """``msgpack`` bytes of ``pack(obj)``: a canonical form used to detect changes."""
    out: bytes = msgpack.packb(pack(obj, where), use_bin_type=True)
    return out


def equal_packed(a: Any, b: Any) -> bool:
    """Two packed values are the same bits (NaN equals itself, -0.0 differs from 0.0)."""
    return bool(msgpack.packb(a, use_bin_type=True) == msgpack.packb(b, use_bin_type=True))


__all__ = ["MAX_INLINE_NUMEL", "equal_packed", "pack", "packb", "unpack"]
