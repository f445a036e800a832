"""The schema of the torch layer's metadata, checked without torch.

The torch layer (:mod:`lowdiff_store.torch`) stores three kinds of msgpack metadata
(docs/torch.md, "What is stored"): the log-level map ``meta["torch"]`` of the manifest, the
map ``"torch"`` of every base, and each record's side channel (``side``) and optional fields
(``digest``, ``tuning``). Their CRCs only prove that the bytes are the ones written; a file
crafted with valid checksums can still hold a map that does not follow the schema. This
module checks the schema the way the core format checks its own headers: types, allow-lists
(modes, codecs, dtype tags), names that refer to each other, shapes bounded by the format's
limits, packed values (``typed_msgpack``) well formed and small. Every violation is one
:class:`~lowdiff_store.errors.FormatError` with reason ``bad_metadata``, the file and, where
known, the offset.

It imports neither torch nor numpy, so :func:`lowdiff_store.verify.verify_log` applies the
same checks as replay (a log that ``verify`` passes is one that replay reads), and the torch
layer calls it once where it opens a log, a base or a record.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .codecs import CODECS
from .errors import FormatError, Reason
from .format.constants import MAX_ELEMENTS, MAX_NAME_BYTES, MAX_NDIM
from .format.dtypes import STORAGE_DTYPE

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

# typed_msgpack's tags (single-key maps whose key starts with NUL)
TUPLE_TAG = "\x00tuple"
MAP_TAG = "\x00map"
TENSOR_TAG = "\x00tensor"


class _Ctx:
    """Where a check is: the file, the offset, and the path of keys inside the map."""

    def __init__(self, path: str | None, offset: int | None, where: str) -> None:
        self.path, self.offset, self.where = path, offset, where

    def fail(self, detail: str) -> FormatError:
        return FormatError(f"{self.where}: {detail}", reason=Reason.BAD_METADATA,
                           path=self.path, offset=self.offset)


# ---------------------------------------------------------------------- small checks


def _str(c: _Ctx, v: Any, what: str, *, none: bool = False, maxlen: int = MAX_STR) -> None:
    if v is None and none:
        return
    if not isinstance(v, str) or not v or len(v) > maxlen:
        raise c.fail(f"{what} must be a non-empty string, not {_short(v)}")


def _name(c: _Ctx, v: Any, what: str) -> str:
    if not isinstance(v, str) or not v or len(v.encode("utf-8", "surrogatepass"))\
            > MAX_NAME_BYTES:
        raise c.fail(f"{what} must be a tensor name (a non-empty string of at most "
                     f"{MAX_NAME_BYTES} bytes), not {_short(v)}")
    return v


def _int(c: _Ctx, v: Any, what: str, lo: int, hi: int, *, none: bool = False) -> None:
    if v is None and none:
        return
    if type(v) is not int or not lo <= v <= hi:
        raise c.fail(f"{what} must be an integer in [{lo}, {hi}], not {_short(v)}")


def _one_of(c: _Ctx, v: Any, what: str, allowed: Sequence[str], *, none: bool = False
            ) -> None:
    if v is None and none:
        return
    if not isinstance(v, str) or v not in allowed:
        raise c.fail(f"{what} {_short(v)} is not one of {', '.join(allowed)}")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _names(c: _Ctx, v: Any, what: str, *, unique: bool = True) -> list[str]:
    if not isinstance(v, list):
        raise c.fail(f"{what} must be a list of names, not {_short(v)}")
    out = [_name(c, x, f"{what}[{i}]") for i, x in enumerate(v)]
    if unique and len(set(out)) != len(out):
        raise c.fail(f"{what} names a tensor twice")
    return out


def _numel(c: _Ctx, shape: Any, what: str, limit: int = MAX_ELEMENTS) -> int:
    """Elements of a shape, checked: a list of at most MAX_NDIM non-negative ints whose
    product is at most ``limit`` (checked as it is computed: never a huge integer)."""
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or \
            not all(type(d) is int and d >= 0 for d in shape):
        raise c.fail(f"{what}: bad shape {_short(shape)}")
    n = 1
    for d in shape:
        n *= d
        if n > limit:
            raise c.fail(f"{what}: shape {_short(shape)} exceeds {limit} elements")
    return n


# ---------------------------------------------------------------------- packed values


def _packed(v: Any, c: _Ctx, what: str, _depth: int = 0) -> None:
    """A value written by ``typed_msgpack.pack``: plain msgpack values, tuples, maps with
    any hashable keys and small tensors of a known dtype, nested at most MAX_DEPTH."""
    if _depth > MAX_DEPTH:
        raise c.fail(f"{what}: nested deeper than {MAX_DEPTH} levels")
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return
    if isinstance(v, list):
        for i, x in enumerate(v):
            _packed(x, c, f"{what}[{i}]", _depth + 1)
        return
    if not isinstance(v, dict):
        raise c.fail(f"{what}: a {type(v).__name__} is not a packed value")
    if len(v) == 1:
        (key, val), = v.items()
        if key == TUPLE_TAG:
            if not isinstance(val, list):
                raise c.fail(f"{what}: bad packed tuple")
            for i, x in enumerate(val):
                _packed(x, c, f"{what}[{i}]", _depth + 1)
            return
        if key == MAP_TAG:
            if not isinstance(val, list):
                raise c.fail(f"{what}: bad packed map")
            for i, kv in enumerate(val):
                if not isinstance(kv, list) or len(kv) != 2:
                    raise c.fail(f"{what}: bad packed map entry {i}")
                if not _hashable(kv[0]):
                    raise c.fail(f"{what}: packed map key {i} is not hashable")
                _packed(kv[0], c, f"{what} key {i}", _depth + 1)
                _packed(kv[1], c, f"{what}[{i}]", _depth + 1)
            return
        if key == TENSOR_TAG:
            _packed_tensor(val, c, what)
            return
    for k, x in v.items():
        _packed(x, c, f"{what}[{k!r}]", _depth + 1)


def _hashable(k: Any) -> bool:
    if k is None or isinstance(k, (bool, int, float, str, bytes)):
        return True
    if isinstance(k, dict) and len(k) == 1 and TUPLE_TAG in k and isinstance(k[TUPLE_TAG],
                                                                            list):
        return all(_hashable(x) for x in k[TUPLE_TAG])
    return False


def _packed_tensor(val: Any, c: _Ctx, what: str) -> tuple[str, int]:
    """A packed tensor ``[tag, shape, bytes]``: known tag, bounded shape, exact size.
    Returns (tag, numel)."""
    if not isinstance(val, list) or len(val) != 3 or not isinstance(val[2], bytes):
        raise c.fail(f"{what}: bad packed tensor")
    tag, shape, data = val
    if not isinstance(tag, str) or tag not in STORAGE_DTYPE:
        raise c.fail(f"{what}: packed tensor of unknown dtype {_short(tag)}")
    n = _numel(c, shape, what, MAX_INLINE_NUMEL)
    if len(data) != n * STORAGE_DTYPE[tag].itemsize:
        raise c.fail(f"{what}: packed tensor of {len(data)} bytes does not hold shape "
                     f"{shape} of {tag}")
    return tag, n


def _packed_scalar_tensor(v: Any, c: _Ctx, what: str, tags: Collection[str]) -> None:
    if not isinstance(v, dict) or len(v) != 1 or TENSOR_TAG not in v:
        raise c.fail(f"{what} must be a packed tensor")
    tag, n = _packed_tensor(v[TENSOR_TAG], c, what)
    if tag not in tags or n != 1:
        raise c.fail(f"{what} must be a one-element tensor of {'/'.join(sorted(tags))}")


def _hyper(c: _Ctx, v: Any, what: str, groups: int) -> None:
    if not isinstance(v, list) or len(v) != groups:
        raise c.fail(f"{what} must hold one map per param group ({groups}), not "
                     f"{_short(v)}")
    for i, g in enumerate(v):
        if not isinstance(g, dict) or (len(g) == 1 and next(iter(g)) in (TUPLE_TAG, MAP_TAG,
                                                                        TENSOR_TAG)):
            raise c.fail(f"{what}[{i}] must be a map of hyperparameters")
        if "params" in g:
            raise c.fail(f"{what}[{i}] must not hold 'params'")
        _packed(g, c, f"{what}[{i}]")
        for k, x in g.items():
            kind = HYPER_KINDS.get(k)
            if kind is not None and not _is_kind(x, kind):
                raise c.fail(f"{what}[{i}][{k!r}] must be a {kind}, not {_short(x)}")


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


def _opt_layout(c: _Ctx, v: Any, what: str, params: Collection[str]) -> None:
    if not isinstance(v, dict) or not isinstance(v.get("tensors"), dict) or \
            not isinstance(v.get("values"), dict):
        raise c.fail(f"{what} must be a map with 'tensors' and 'values' maps")
    for n, keys in v["tensors"].items():
        if n not in params:
            raise c.fail(f"{what}: optimizer state of unknown parameter {_short(n)}")
        ks = _names(c, keys, f"{what}.tensors[{n!r}]")
        if any("/" in k for k in ks):
            raise c.fail(f"{what}.tensors[{n!r}]: a state key holds '/'")
    for n, vals in v["values"].items():
        if n not in params:
            raise c.fail(f"{what}: optimizer state of unknown parameter {_short(n)}")
        if not isinstance(vals, dict):
            raise c.fail(f"{what}.values[{n!r}] must be a map")
        tensor_keys = set(v["tensors"].get(n, ()))
        for k, x in vals.items():
            if k in tensor_keys:
                raise c.fail(f"{what}: state key {k!r} of {n!r} is both a tensor and a value")
            _packed(x, c, f"{what}.values[{n!r}][{k!r}]")


# ---------------------------------------------------------------------- the three maps


def _model(c: _Ctx, model: Any, what: str) -> dict[str, tuple[str, list[int]]]:
    """A ``[[name, dtype tag, shape], ...]`` list (``model``, a shard's ``global_model``):
    unique names, known tags, shapes within the format's limits. Returns name -> (tag,
    shape)."""
    if not isinstance(model, list):
        raise c.fail(f"{what} must be a list of [name, dtype, shape]")
    out: dict[str, tuple[str, list[int]]] = {}
    for i, ent in enumerate(model):
        if not isinstance(ent, list) or len(ent) != 3:
            raise c.fail(f"{what}[{i}] must be [name, dtype, shape]")
        n = _name(c, ent[0], f"{what}[{i}] name")
        if n in out:
            raise c.fail(f"{what} names {n!r} twice")
        if not isinstance(ent[1], str) or ent[1] not in STORAGE_DTYPE:
            raise c.fail(f"{what} tensor {n!r}: unknown dtype {_short(ent[1])}")
        _numel(c, ent[2], f"{what} tensor {n!r}")
        out[n] = (ent[1], ent[2])
    return out


def check_log_meta(meta: Any, path: str | None = None) -> dict[str, Any]:
    """Check the log-level torch metadata (``manifest.meta["torch"]``) and return it.

    A newer ``schema`` is refused by the caller (``unsupported_format_version``) before
    this runs; everything else that replay, restore, describe or export read is checked
    here: mode, capture, optimizer class name, parameters and groups (their sizes sum to
    the parameters), model tensors (unique names, known dtype tags, shapes within the
    format's limits), buffers and aliases naming model tensors, the ``state_dict`` order,
    codecs, the compressor, scheduler and scaler descriptors, intervals.
    """
    c = _Ctx(path, None, "meta.torch")
    if not isinstance(meta, dict):
        raise c.fail("is not a map")
    _int(c, meta.get("schema"), "schema", 1, SCHEMA)
    _one_of(c, meta.get("mode"), "mode", MODES)
    _one_of(c, meta.get("capture"), "capture", CAPTURES, none=True)
    _str(c, meta.get("optimizer"), "optimizer")
    params = _names(c, meta.get("params"), "params")
    groups = meta.get("groups")
    if not isinstance(groups, list) or not all(type(g) is int and g >= 0 for g in groups) \
            or sum(groups) != len(params):
        raise c.fail(f"groups {_short(groups)} must be sizes that sum to the "
                     f"{len(params)} parameters")
    names = {n: tag for n, (tag, _shape) in _model(c, meta.get("model"), "model").items()}
    for p in params:
        if p not in names:
            raise c.fail(f"parameter {p!r} is not a model tensor")
    buffers = _names(c, meta.get("buffers", []), "buffers")
    for b in buffers:
        if b not in names or b in params:
            raise c.fail(f"buffer {b!r} is not a model tensor (or is a parameter)")
    aliases = meta.get("aliases") or {}
    if not isinstance(aliases, dict):
        raise c.fail("aliases must be a map")
    for a, target in aliases.items():
        _name(c, a, "alias")
        if a in names or target not in names:
            raise c.fail(f"alias {a!r} -> {_short(target)} does not name a model tensor")
    order = meta.get("state_dict")
    if order is not None:
        for n in _names(c, order, "state_dict"):
            if n not in names and n not in aliases:
                raise c.fail(f"state_dict name {n!r} is neither a model tensor nor an alias")
    comp = meta.get("compressor")
    if comp is not None:
        if not isinstance(comp, dict):
            raise c.fail("compressor must be a map or nil")
        _str(c, comp.get("kind"), "compressor.kind")
        if not isinstance(comp.get("error_feedback", False), bool):
            raise c.fail("compressor.error_feedback must be a bool")
        _one_of(c, comp.get("ef_state"), "compressor.ef_state", EF_STATES, none=True)
    _one_of(c, meta.get("grad_codec"), "grad_codec", GRAD_CODECS, none=True)
    _int(c, meta.get("grad_zstd"), "grad_zstd", -(1 << 17), 22, none=True)
    _one_of(c, meta.get("delta_codec"), "delta_codec", DELTA_CODECS, none=True)
    _int(c, meta.get("digest_every"), "digest_every", 0, (1 << 63) - 1, none=True)
    _int(c, meta.get("snapshot_every"), "snapshot_every", 1, (1 << 63) - 1, none=True)
    _str(c, meta.get("scheduler"), "scheduler", none=True)
    scaler = meta.get("scaler")
    if scaler is not None and not isinstance(scaler, bool):
        _str(c, scaler, "scaler")  # a class name (bool in logs of earlier versions)
    for k in ("torch_version", "device"):
        _str(c, meta.get(k), k, none=True)
    if "shard" in meta:
        _shard(_Ctx(path, None, "meta.torch.shard"), meta["shard"], groups)
    return meta


#: the most ranks a sharded checkpoint may declare (as the ``SHARDS`` file)
MAX_RANKS = 1 << 20
#: shard layouts
LAYOUTS: tuple[str, ...] = ("replicated", "zero", "fsdp")


def _shard(c: _Ctx, sh: Any, groups: Sequence[int]) -> None:
    """The ``shard`` section of a sharded checkpoint's log: rank, world size, layout, the
    parameters this rank logs, the job's optimizer order and, for FSDP2, the global model,
    the device mesh and every owned parameter's placements and box (inside its global
    shape): everything resharding and ``inspect`` read, checked before they read it."""
    if not isinstance(sh, dict):
        raise c.fail("must be a map")
    _int(c, sh.get("world_size"), "world_size", 1, MAX_RANKS)
    _int(c, sh.get("rank"), "rank", 0, sh["world_size"] - 1)
    _one_of(c, sh.get("layout"), "layout", LAYOUTS)
    owned = _names(c, sh.get("owned"), "owned")
    gp = sh.get("global_params")
    gparams: list[str] = []
    if gp is not None or sh["layout"] in ("zero", "fsdp"):   # the job's optimizer order
        gparams = _names(c, gp, "global_params")
        gg = sh.get("global_groups")
        if not isinstance(gg, list) or not all(type(g) is int and g >= 0 for g in gg) \
                or sum(gg) != len(gparams):
            raise c.fail(f"global_groups {_short(gg)} must be sizes that sum to the "
                         f"{len(gparams)} global parameters")
        if sh["layout"] == "zero" and len(gg) != len(groups):
            raise c.fail(f"global_groups has {len(gg)} groups, the optimizer {len(groups)}")
    if sh["layout"] != "fsdp":
        return
    glob = {n: shape for n, (_tag, shape) in
            _model(c, sh.get("global_model"), "global_model").items()}
    mesh = sh.get("mesh")
    if not isinstance(mesh, dict):
        raise c.fail("mesh must be a map")
    mshape, coord = mesh.get("shape"), mesh.get("coord")
    if not isinstance(mshape, list) or not 1 <= len(mshape) <= MAX_NDIM or \
            not all(type(x) is int and 1 <= x <= MAX_RANKS for x in mshape):
        raise c.fail(f"mesh.shape {_short(mshape)} must be 1 to {MAX_NDIM} sizes")
    if not isinstance(coord, list) or len(coord) != len(mshape) or not all(
            type(x) is int and 0 <= x < m for x, m in zip(coord, mshape, strict=False)):
        raise c.fail(f"mesh.coord {_short(coord)} is not a coordinate of mesh "
                     f"{_short(mshape)}")
    dn = mesh.get("dim_names", [])
    if not isinstance(dn, list) or not all(isinstance(x, str) and len(x) <= MAX_STR
                                           for x in dn):
        raise c.fail("mesh.dim_names must be a list of strings")
    _int(c, sh.get("replicas"), "replicas", 1, MAX_RANKS)
    _int(c, sh.get("replica"), "replica", 0, sh["replicas"] - 1)
    in_job = set(gparams)
    for n in owned:
        if n not in in_job:
            raise c.fail(f"owned parameter {n!r} is not one of global_params")
    pieces = sh.get("pieces")
    if not isinstance(pieces, dict):
        raise c.fail("pieces must be a map")
    if set(pieces) != set(owned):
        odd = sorted(str(n) for n in set(pieces) ^ set(owned))[:3]
        raise c.fail(f"pieces must be those of the owned parameters (differ on "
                     f"{', '.join(map(repr, odd))})")
    aliases = sh.get("global_aliases", {})
    if not isinstance(aliases, dict) or not all(
            isinstance(a, str) and a not in glob and t in glob for a, t in aliases.items()):
        raise c.fail("global_aliases must map names to global_model tensors")
    order = sh.get("global_state_dict")
    if order is not None:
        for n in _names(c, order, "global_state_dict"):
            if n not in glob and n not in aliases:
                raise c.fail(f"global_state_dict name {n!r} is neither a global_model tensor "
                             "nor an alias")
    for n, p in pieces.items():
        w = f"piece of {_short(n)}"
        if not isinstance(n, str) or n not in glob:
            raise c.fail(f"{w}: not a tensor of global_model")
        if not isinstance(p, dict):
            raise c.fail(f"{w} must be a map")
        g = glob[n]
        if p.get("global_shape") != g:
            raise c.fail(f"{w}: global_shape {_short(p.get('global_shape'))} is not the "
                         f"global model's {g}")
        pls = p.get("placements")
        if not isinstance(pls, list) or len(pls) != len(mshape) or not all(
                pl == ["R"] or (isinstance(pl, list) and len(pl) == 2 and pl[0] == "S"
                                and type(pl[1]) is int and 0 <= pl[1] < max(len(g), 1))
                for pl in pls):
            raise c.fail(f"{w}: placements {_short(pls)} must be one [\"S\", dim] or "
                         f"[\"R\"] per mesh dimension")
        box: list[list[int]] = []
        for what in ("offset", "shape"):
            v = p.get(what)
            if not isinstance(v, list) or len(v) != len(g) or \
                    not all(type(x) is int and x >= 0 for x in v):
                raise c.fail(f"{w}: {what} {_short(v)} must be {len(g)} non-negative "
                             "integers")
            box.append(v)
        off, shp = box
        if any(o + k > d for o, k, d in zip(off, shp, g, strict=True)):
            raise c.fail(f"{w}: the box at {off} of shape {shp} lies outside its global "
                         f"shape {g}")


def check_base_meta(bmeta: Any, log: Mapping[str, Any], *, path: str | None = None,
                    tensors: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
                    step: int | None = None) -> dict[str, Any]:
    """Check a base's ``meta["torch"]`` against the (checked) log metadata ``log`` and
    return it: one hyperparameter map per group, packed scheduler/scaler/extra state, an
    optimizer layout naming known parameters with state keys whose tensors the base holds.

    ``tensors`` (name -> (dtype tag, shape), from the base's validated header) makes the
    check against the file: every model tensor and every ``@opt`` tensor of the layout
    must be there with the dtype and shape the log declares, so nothing is ever allocated
    from a declared size that the file does not hold.
    """
    c = _Ctx(path, None, "base meta.torch")
    if not isinstance(bmeta, dict):
        raise c.fail("is missing or not a map")
    _int(c, bmeta.get("step"), "step", 0, (1 << 63) - 1, none=True)
    if step is not None and bmeta.get("step") not in (None, step):
        raise c.fail(f"step {bmeta.get('step')} differs from the base's step {step}")
    _hyper(c, bmeta.get("hyper"), "hyper", len(log["groups"]))
    for k in ("sched", "scaler", "extra"):
        _packed(bmeta.get(k), c, k)
    params = set(log["params"])
    opt = bmeta.get("opt")
    if opt is not None:
        _opt_layout(c, opt, "opt", params)
    if not isinstance(bmeta.get("ef_approx", False), bool):
        raise c.fail("ef_approx must be a bool")
    if tensors is not None:
        for n, tag, shape in log["model"]:
            got = tensors.get(n)
            if got is None or got[0] != tag or list(got[1]) != list(shape):
                raise c.fail(f"model tensor {n!r} ({tag} {list(shape)}) is "
                             f"{'missing from' if got is None else 'different in'} the base")
        if opt is not None and log["mode"] == "grad":
            for n, keys in opt["tensors"].items():
                for k in keys:
                    if f"@opt/{n}/{k}" not in tensors:
                        raise c.fail(f"optimizer state @opt/{n}/{k} is missing from the base")
    return bmeta


def check_record_meta(meta: Mapping[str, Any], log: Mapping[str, Any], names: Sequence[str],
                      *, path: str | None = None, offset: int | None = None,
                      step: int | None = None) -> dict[str, Any]:
    """Check a record's torch fields against the (checked) log metadata and return its side
    channel: ``hyper``/``hyper_after`` (one map per group), ``clip`` (a one-element float
    scale and parameters whose gradients the record holds), ``amp`` (known optimizer
    attributes, one-element tensors), packed ``sched``/``scaler``/``extra``, ``skipped``,
    ``opt_layout`` (delta mode), ``hook``; and the optional ``digest`` (uint32) and
    ``tuning`` (a map). ``names``: the record's tensor names."""
    c = _Ctx(path, offset, "record" if step is None else f"step {step}")
    side = meta.get("side", {})
    if side is None:
        side = {}
    if not isinstance(side, dict):
        raise c.fail("side channel is not a map")
    groups = len(log["groups"])
    for k in ("hyper", "hyper_after"):
        if k in side:
            _hyper(c, side[k], f"side.{k}", groups)
    clip = side.get("clip")
    if clip is not None:
        if not isinstance(clip, dict):
            raise c.fail("side.clip must be a map")
        _packed_scalar_tensor(clip.get("scale"), c, "side.clip.scale",
                              ("F64", "F32", "F16", "BF16"))
        have = set(names)
        params = set(log["params"])
        for n in _names(c, clip.get("params"), "side.clip.params"):
            if n not in params or "@grad/" + n not in have:
                raise c.fail(f"side.clip.params names {n!r}, whose gradient the record "
                             "does not hold")
    amp = side.get("amp")
    if amp is not None:
        if not isinstance(amp, dict):
            raise c.fail("side.amp must be a map")
        for k, v in amp.items():
            if k not in AMP_KEYS:
                raise c.fail(f"side.amp key {_short(k)} is not one of {', '.join(AMP_KEYS)}")
            _packed_scalar_tensor(v, c, f"side.amp.{k}", ("F32", "F64", "F16", "BF16"))
    for k in ("sched", "scaler", "extra"):
        if k in side:
            _packed(side[k], c, f"side.{k}")
    if not isinstance(side.get("skipped", False), bool):
        raise c.fail("side.skipped must be a bool")
    if "opt_layout" in side:
        _opt_layout(c, side["opt_layout"], "side.opt_layout", set(log["params"]))
    hook = side.get("hook")
    if hook is not None and not isinstance(hook, dict):
        raise c.fail("side.hook must be a map")
    _int(c, meta.get("digest"), "digest", 0, 0xFFFFFFFF, none=True)
    tuning = meta.get("tuning")
    if tuning is not None and not isinstance(tuning, dict):
        raise c.fail("tuning must be a map")
    return side


__all__ = ["AMP_KEYS", "CAPTURES", "DELTA_CODECS", "EF_STATES", "GRAD_CODECS", "HYPER_KINDS",
           "MAX_DEPTH", "MAX_INLINE_NUMEL", "MODES", "SCHEMA", "check_base_meta",
           "check_log_meta", "check_record_meta", "LAYOUTS", "MAX_RANKS"]
