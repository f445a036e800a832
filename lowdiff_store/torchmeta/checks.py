"""The schema's constants and the checks of its small values: types, allow-lists, tensor
names, shapes bounded by the format's limits, packed values (``typed_msgpack``) well formed
and small, hyperparameter maps, optimizer layouts. Each failure is one
:class:`~lowdiff_store.errors.FormatError` with reason ``bad_metadata`` naming the file and
where in the map (:class:`Ctx`). :mod:`.meta` and :mod:`.record` build on these.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ..codecs import CODECS
from ..errors import FormatError, Reason
from ..format.constants import MAX_ELEMENTS, MAX_NAME_BYTES, MAX_NDIM
from ..format.dtypes import STORAGE_DTYPE

#: torch metadata schema version this build reads and writes
SCHEMA = 1
#: diff kinds a torch log can hold
MODES: tuple[str, ...] = ("grad", "delta")
#: gradient capture modes
CAPTURES: tuple[str, ...] = ("dense", "layerwise")
#: gradient codecs named in the log metadata (a compressor's message codec: any codec)
GRAD_CODECS: tuple[str, ...] = tuple(sorted(CODECS))
#: weight-diff codecs (delta mode; torch/delta_capture.py, DELTA_CODECS)
DELTA_CODECS: tuple[str, ...] = ("xor", "q8", "topk", "lcc")
#: when error-feedback residuals are logged
EF_STATES: tuple[str, ...] = ("base", "step")
#: optimizer attributes a record's ``amp`` map may set during replay
AMP_KEYS: tuple[str, ...] = ("grad_scale", "found_inf")
#: the largest tensor stored inline in metadata (a tensor lr, a scaler's scale...)
MAX_INLINE_NUMEL = 1 << 16
#: the deepest nesting of a packed value (scheduler states nest two or three levels)
MAX_DEPTH = 32
#: longest class name or other short string accepted
MAX_STR = 1024

#: torch.optim hyperparameters whose kind of value is known: "number" (int, float, or a
#: one-element float tensor: a tensor lr), "pair" (two numbers), "flag" (bool or nil). A
#: recorded value of another kind is refused before any optimizer sees it.
HYPER_KINDS: dict[str, str] = {
    **dict.fromkeys(("lr", "momentum", "dampening", "weight_decay", "eps", "alpha",
                     "lr_decay", "initial_accumulator_value", "rho", "lambd", "t0",
                     "momentum_decay", "initial_lr"), "number"),
    **dict.fromkeys(("betas", "etas", "step_sizes"), "pair"),
    **dict.fromkeys(("nesterov", "amsgrad", "maximize", "foreach", "capturable",
                     "differentiable", "fused", "centered", "decoupled_weight_decay"),
                    "flag"),
}

#: typed_msgpack's tags (single-key maps whose key starts with NUL)
TUPLE_TAG = "\x00tuple"
MAP_TAG = "\x00map"
TENSOR_TAG = "\x00tensor"

#: the most ranks a sharded checkpoint may declare (as the ``SHARDS`` file)
MAX_RANKS = 1 << 20
#: shard layouts
LAYOUTS: tuple[str, ...] = ("replicated", "zero", "fsdp")
#: the largest integer a step, an interval or a count may be
MAX_INT = (1 << 63) - 1


class Ctx:
    """Where a check is: the file, the offset, and the path of keys inside the map."""

    def __init__(self, path: str | None, offset: int | None, where: str) -> None:
        self.path, self.offset, self.where = path, offset, where

    def fail(self, detail: str) -> FormatError:
        """The one error of a check that failed here: ``bad_metadata`` with ``detail``."""
        return FormatError(f"{self.where}: {detail}", reason=Reason.BAD_METADATA,
                           path=self.path, offset=self.offset)


# ---------------------------------------------------------------------- small checks


def string(c: Ctx, v: Any, what: str, *, none: bool = False, maxlen: int = MAX_STR) -> None:
    """``v`` is a non-empty string of at most ``maxlen`` characters (or None if ``none``)."""
    if v is None and none:
        return
    if not isinstance(v, str) or not v or len(v) > maxlen:
        raise c.fail(f"{what} must be a non-empty string, not {short(v)}")


def tensor_name(c: Ctx, v: Any, what: str) -> str:
    """``v`` is a tensor name (non-empty, at most the format's name length); returned."""
    if not isinstance(v, str) or not v or len(v.encode("utf-8", "surrogatepass"))\
            > MAX_NAME_BYTES:
        raise c.fail(f"{what} must be a tensor name (a non-empty string of at most "
                     f"{MAX_NAME_BYTES} bytes), not {short(v)}")
    return v


def integer(c: Ctx, v: Any, what: str, lo: int, hi: int, *, none: bool = False) -> None:
    """``v`` is an int (not a bool) in ``[lo, hi]`` (or None if ``none``)."""
    if v is None and none:
        return
    if type(v) is not int or not lo <= v <= hi:
        raise c.fail(f"{what} must be an integer in [{lo}, {hi}], not {short(v)}")


def real(c: Ctx, v: Any, what: str, *, none: bool = False) -> float | None:
    """``v`` is a plain number (an int or a float, not a bool; or None if ``none``);
    returned as a float (None as None)."""
    if v is None and none:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise c.fail(f"{what} must be a number{' or nil' if none else ''}, not {short(v)}")
    return float(v)


def one_of(c: Ctx, v: Any, what: str, allowed: Sequence[str], *, none: bool = False
            ) -> None:
    """``v`` is one of the strings ``allowed`` (or None if ``none``)."""
    if v is None and none:
        return
    if not isinstance(v, str) or v not in allowed:
        raise c.fail(f"{what} {short(v)} is not one of {', '.join(allowed)}")


def short(v: Any) -> str:
    """``repr(v)`` cut to 60 characters, for error messages."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def tensor_names(c: Ctx, v: Any, what: str, *, unique: bool = True) -> list[str]:
    """``v`` is a list of tensor names (each once if ``unique``); returned."""
    if not isinstance(v, list):
        raise c.fail(f"{what} must be a list of names, not {short(v)}")
    out = [tensor_name(c, x, f"{what}[{i}]") for i, x in enumerate(v)]
    if unique and len(set(out)) != len(out):
        raise c.fail(f"{what} names a tensor twice")
    return out


def numel(c: Ctx, shape: Any, what: str, limit: int = MAX_ELEMENTS) -> int:
    """Elements of a shape, checked: a list of at most MAX_NDIM non-negative ints whose
    product is at most ``limit`` (checked as it is computed: never a huge integer)."""
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or \
            not all(type(d) is int and d >= 0 for d in shape):
        raise c.fail(f"{what}: bad shape {short(shape)}")
    n = 1
    for d in shape:
        n *= d
        if n > limit:
            raise c.fail(f"{what}: shape {short(shape)} exceeds {limit} elements")
    return n


# ---------------------------------------------------------------------- packed values


def packed(v: Any, c: Ctx, what: str, _depth: int = 0) -> None:
    """A value written by ``typed_msgpack.pack``: plain msgpack values, tuples, maps with
    any hashable keys and small tensors of a known dtype, nested at most MAX_DEPTH."""
    if _depth > MAX_DEPTH:
        raise c.fail(f"{what}: nested deeper than {MAX_DEPTH} levels")
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return
    if isinstance(v, list):
        for i, x in enumerate(v):
            packed(x, c, f"{what}[{i}]", _depth + 1)
        return
    if not isinstance(v, dict):
        raise c.fail(f"{what}: a {type(v).__name__} is not a packed value")
    if len(v) == 1:
        (key, val), = v.items()
        if key == TUPLE_TAG:
            if not isinstance(val, list):
                raise c.fail(f"{what}: bad packed tuple")
            for i, x in enumerate(val):
                packed(x, c, f"{what}[{i}]", _depth + 1)
            return
        if key == MAP_TAG:
            if not isinstance(val, list):
                raise c.fail(f"{what}: bad packed map")
            for i, kv in enumerate(val):
                if not isinstance(kv, list) or len(kv) != 2:
                    raise c.fail(f"{what}: bad packed map entry {i}")
                if not _hashable(kv[0]):
                    raise c.fail(f"{what}: packed map key {i} is not hashable")
                packed(kv[0], c, f"{what} key {i}", _depth + 1)
                packed(kv[1], c, f"{what}[{i}]", _depth + 1)
            return
        if key == TENSOR_TAG:
            _packed_tensor(val, c, what)
            return
    for k, x in v.items():
        packed(x, c, f"{what}[{k!r}]", _depth + 1)


def _hashable(k: Any) -> bool:
    if k is None or isinstance(k, (bool, int, float, str, bytes)):
        return True
    if isinstance(k, dict) and len(k) == 1 and TUPLE_TAG in k and isinstance(k[TUPLE_TAG],
                                                                            list):
        return all(_hashable(x) for x in k[TUPLE_TAG])
    return False


def _packed_tensor(val: Any, c: Ctx, what: str) -> tuple[str, int]:
    """A packed tensor ``[tag, shape, bytes]``: known tag, bounded shape, exact size.
    Returns (tag, numel)."""
    if not isinstance(val, list) or len(val) != 3 or not isinstance(val[2], bytes):
        raise c.fail(f"{what}: bad packed tensor")
    tag, shape, data = val
    if not isinstance(tag, str) or tag not in STORAGE_DTYPE:
        raise c.fail(f"{what}: packed tensor of unknown dtype {short(tag)}")
    n = numel(c, shape, what, MAX_INLINE_NUMEL)
    if len(data) != n * STORAGE_DTYPE[tag].itemsize:
        raise c.fail(f"{what}: packed tensor of {len(data)} bytes does not hold shape "
                     f"{shape} of {tag}")
    return tag, n


def packed_scalar_tensor(v: Any, c: Ctx, what: str, tags: Collection[str]) -> None:
    """``v`` is a packed one-element tensor of one of the dtype ``tags``."""
    if not isinstance(v, dict) or len(v) != 1 or TENSOR_TAG not in v:
        raise c.fail(f"{what} must be a packed tensor")
    tag, n = _packed_tensor(v[TENSOR_TAG], c, what)
    if tag not in tags or n != 1:
        raise c.fail(f"{what} must be a one-element tensor of {'/'.join(sorted(tags))}")


def hyper(c: Ctx, v: Any, what: str, groups: int) -> None:
    """``v`` holds one packed map of hyperparameters per param group (no ``params``; the
    known ones of the kind :data:`HYPER_KINDS` says)."""
    if not isinstance(v, list) or len(v) != groups:
        raise c.fail(f"{what} must hold one map per param group ({groups}), not "
                     f"{short(v)}")
    for i, g in enumerate(v):
        if not isinstance(g, dict) or (len(g) == 1 and next(iter(g)) in (TUPLE_TAG, MAP_TAG,
                                                                        TENSOR_TAG)):
            raise c.fail(f"{what}[{i}] must be a map of hyperparameters")
        if "params" in g:
            raise c.fail(f"{what}[{i}] must not hold 'params'")
        packed(g, c, f"{what}[{i}]")
        for k, x in g.items():
            kind = HYPER_KINDS.get(k)
            if kind is not None and not _is_kind(x, kind):
                raise c.fail(f"{what}[{i}][{k!r}] must be a {kind}, not {short(x)}")


def _is_number(v: Any) -> bool:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return True
    t = v.get(TENSOR_TAG) if isinstance(v, dict) and len(v) == 1 else None
    return isinstance(t, list) and len(t) == 3 and t[0] in ("F64", "F32", "F16", "BF16") \
        and isinstance(t[1], list) and len(t[1]) <= 1 and all(d == 1 for d in t[1])


def _is_kind(v: Any, kind: str) -> bool:
    if kind == "number":
        return _is_number(v)
    if kind == "flag":
        return v is None or isinstance(v, bool)
    items = v.get(TUPLE_TAG) if isinstance(v, dict) and len(v) == 1 else v
    return isinstance(items, list) and len(items) == 2 and all(_is_number(x) for x in items)


def opt_layout(c: Ctx, v: Any, what: str, params: Collection[str]) -> None:
    """``v`` is an optimizer layout: ``tensors`` (state keys per parameter) and ``values``
    (packed values per parameter and key), of the parameters ``params`` only."""
    if not isinstance(v, dict) or not isinstance(v.get("tensors"), dict) or \
            not isinstance(v.get("values"), dict):
        raise c.fail(f"{what} must be a map with 'tensors' and 'values' maps")
    for n, keys in v["tensors"].items():
        if n not in params:
            raise c.fail(f"{what}: optimizer state of unknown parameter {short(n)}")
        ks = tensor_names(c, keys, f"{what}.tensors[{n!r}]")
        if any("/" in k for k in ks):
            raise c.fail(f"{what}.tensors[{n!r}]: a state key holds '/'")
    for n, vals in v["values"].items():
        if n not in params:
            raise c.fail(f"{what}: optimizer state of unknown parameter {short(n)}")
        if not isinstance(vals, dict):
            raise c.fail(f"{what}.values[{n!r}] must be a map")
        tensor_keys = set(v["tensors"].get(n, ()))
        for k, x in vals.items():
            if k in tensor_keys:
                raise c.fail(f"{what}: state key {k!r} of {n!r} is both a tensor and a value")
            packed(x, c, f"{what}.values[{n!r}][{k!r}]")


# ---------------------------------------------------------------------- the three maps


def model_list(c: Ctx, model: Any, what: str) -> dict[str, tuple[str, list[int]]]:
    """A ``[[name, dtype tag, shape], ...]`` list (``model``, a shard's ``global_model``):
    unique names, known tags, shapes within the format's limits. Returns name -> (tag,
    shape)."""
    if not isinstance(model, list):
        raise c.fail(f"{what} must be a list of [name, dtype, shape]")
    out: dict[str, tuple[str, list[int]]] = {}
    for i, ent in enumerate(model):
        if not isinstance(ent, list) or len(ent) != 3:
            raise c.fail(f"{what}[{i}] must be [name, dtype, shape]")
        n = tensor_name(c, ent[0], f"{what}[{i}] name")
        if n in out:
            raise c.fail(f"{what} names {n!r} twice")
        if not isinstance(ent[1], str) or ent[1] not in STORAGE_DTYPE:
            raise c.fail(f"{what} tensor {n!r}: unknown dtype {short(ent[1])}")
        numel(c, ent[2], f"{what} tensor {n!r}")
        out[n] = (ent[1], ent[2])
    return out




__all__ = ["AMP_KEYS", "CAPTURES", "Ctx", "DELTA_CODECS", "EF_STATES", "GRAD_CODECS",
           "HYPER_KINDS", "LAYOUTS", "MAP_TAG", "MAX_DEPTH", "MAX_INLINE_NUMEL", "MAX_INT",
           "MAX_RANKS", "MAX_STR", "MODES", "SCHEMA", "TENSOR_TAG", "TUPLE_TAG", "hyper",
           "integer", "model_list", "numel", "one_of", "opt_layout", "packed",
           "packed_scalar_tensor", "short", "string", "tensor_name", "tensor_names"]
