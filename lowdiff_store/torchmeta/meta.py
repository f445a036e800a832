"""The log's and a base's torch metadata as frozen dataclasses, parsed once where a log or a
base is opened ("parse, don't validate"): :func:`parse` turns the manifest's
``meta["torch"]`` into a :class:`LogMeta` (with its :class:`ShardMeta` for one rank of a
sharded checkpoint), :func:`parse_base` a base's ``meta["torch"]`` into a :class:`BaseMeta`.
A map that does not follow the schema gets one :class:`~lowdiff_store.errors.FormatError`
(``bad_metadata``) naming the file and what is wrong; a parsed value is consistent (names
that refer to each other do, shapes are within the format's limits), so consumers read its
attributes without checking again. Class names recorded by earlier versions are current
ones here (:func:`~.names.current_class_name`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..format.constants import MAX_NDIM
from . import checks as C
from .checks import Ctx, short
from .names import EF, current_class_name, opt_name
from .numerics import NumericsRun, mkl_use, parse_runs


class ModelTensor(NamedTuple):
    """A model tensor the log declares: its name, dtype tag and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CompressorMeta:
    """The gradient compressor a log was written with.

    Attributes:
        kind: the compressor's kind (``"topk"``, ``"demo"``, ...).
        error_feedback: it keeps error-feedback residuals.
        ef_state: when residuals are logged (``"base"``, ``"step"``) or None.
        config: the recorded map, as written (its options included).
    """

    kind: str
    error_feedback: bool
    ef_state: str | None
    config: Mapping[str, Any]


@dataclass(frozen=True)
class Mesh:
    """An FSDP2 rank's place in its device mesh."""

    shape: tuple[int, ...]
    coord: tuple[int, ...]
    dim_names: tuple[str, ...]


@dataclass(frozen=True)
class PieceMeta:
    """The box of a global tensor an FSDP2 rank holds: ``offset`` and ``shape`` per
    dimension (inside ``global_shape``), and its placement per mesh dimension (``("R",)``
    or ``("S", dim)``)."""

    global_shape: tuple[int, ...]
    placements: tuple[tuple[Any, ...], ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BaseSlices:
    """``base_slices`` of a log's torch metadata (streamed bases, spec section 7.2): the k
    the checkpointer was asked for (an int, or ``"auto"``: chosen before each base from
    the measured costs), the k it started with (1: it takes consistent bases) and why
    not, when not (None when in force)."""

    k: int | str
    in_force: int
    why: str | None

    def as_dict(self) -> dict[str, Any]:
        """The recorded map (``{"k", "in_force", "why"}``)."""
        return {"k": self.k, "in_force": self.in_force, "why": self.why}


@dataclass(frozen=True)
class ShardMeta:
    """The ``shard`` section of one rank's log in a sharded checkpoint.

    ``global_params``/``global_groups``: the job's optimizer order (zero and fsdp layouts;
    None where not recorded). FSDP2 only (None or empty otherwise): ``global_model``,
    ``mesh``, ``replicas``/``replica``, ``pieces`` (one per owned parameter),
    ``global_aliases`` and ``global_state_dict`` (None when not recorded).
    """

    world_size: int
    rank: int
    layout: str
    owned: tuple[str, ...]
    global_params: tuple[str, ...] | None = None
    global_groups: tuple[int, ...] | None = None
    global_model: tuple[ModelTensor, ...] | None = None
    mesh: Mesh | None = None
    replicas: int | None = None
    replica: int | None = None
    pieces: Mapping[str, PieceMeta] = field(default_factory=dict)
    global_aliases: Mapping[str, str] | None = None
    global_state_dict: tuple[str, ...] | None = None


@dataclass(frozen=True)
class LogMeta:
    """A log's torch metadata (``manifest.meta["torch"]``), parsed by :func:`parse`.

    Attributes:
        mode: ``"grad"`` or ``"delta"``.
        optimizer: the optimizer's qualified class name (current: a name an earlier
            version recorded is mapped to where the class lives now).
        params, groups: optimizer-order parameter names and param-group sizes.
        model: every model tensor (the log's model order).
        buffers, aliases, state_dict: persistent buffers, alias -> model tensor, and the
            ``state_dict`` order (None when not recorded).
        compressor: the gradient compressor, or None.
        numerics: what each run of the writer trained under (empty in logs of earlier
            versions; :mod:`.numerics`).
        shard: this rank's section of a sharded checkpoint, or None.
        base_slices: streamed bases asked for (``base_slices=k`` > 1), or None.
        raw: the map as the log recorded it (:meth:`as_written` for writing it again).
    """

    schema: int
    mode: str
    optimizer: str
    params: tuple[str, ...]
    groups: tuple[int, ...]
    model: tuple[ModelTensor, ...]
    buffers: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)
    state_dict: tuple[str, ...] | None = None
    capture: str | None = None
    compressor: CompressorMeta | None = None
    grad_codec: str | None = None
    grad_zstd: int | None = None
    delta_codec: str | None = None
    digest_every: int | None = None
    snapshot_every: int | None = None
    scheduler: str | None = None
    scaler: str | bool | None = None
    torch_version: str | None = None
    device: str | None = None
    numerics: tuple[NumericsRun, ...] = ()
    shard: ShardMeta | None = None
    base_slices: BaseSlices | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: ``params`` as a set (membership checks per record allocate nothing)
    param_set: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_set", frozenset(self.params))

    def as_written(self) -> dict[str, Any]:
        """The recorded map with the current optimizer class name: what a base made from
        this log records as ``"log"`` (as the checkpointer writes it)."""
        return {**self.raw, "optimizer": self.optimizer}


@dataclass(frozen=True)
class OptLayout:
    """Which optimizer state a base (or a delta-mode record) holds: per parameter, the
    keys of its state tensors (``@opt/NAME/KEY``) and its packed non-tensor values."""

    tensors: Mapping[str, Sequence[str]] = field(default_factory=dict)
    values: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, checked: Mapping[str, Any] | None) -> OptLayout:
        """The layout of a checked ``{"tensors": ..., "values": ...}`` map (None: empty)."""
        if not checked:
            return EMPTY_LAYOUT
        return cls(checked["tensors"], checked["values"])


EMPTY_LAYOUT = OptLayout()


@dataclass(frozen=True)
class BaseMeta:
    """A base's torch metadata (``meta["torch"]``), parsed by :func:`parse_base`: the step,
    one packed hyperparameter map per group, the packed scheduler/scaler/extra state
    (None when absent), the optimizer layout, and whether its error-feedback residuals
    are approximate."""

    step: int | None
    hyper: list[Any]
    sched: Any = None
    scaler: Any = None
    extra: Any = None
    opt: OptLayout = EMPTY_LAYOUT
    ef_approx: bool = False


# ---------------------------------------------------------------------- the log


def parse(raw: Any, path: str | None = None) -> LogMeta:
    """The log-level torch metadata ``raw`` (``manifest.meta["torch"]``) parsed, or one
    FormatError(bad_metadata) naming ``path`` and what is wrong.

    A newer ``schema`` is refused by the caller (``unsupported_format_version``) before
    this runs; everything replay, restore, describe or export read is checked: mode,
    capture, optimizer class name, parameters and groups (their sizes sum to the
    parameters), model tensors (unique names, known dtype tags, shapes within the format's
    limits), buffers and aliases naming model tensors, the ``state_dict`` order, codecs,
    the compressor, scheduler and scaler descriptors, intervals, the shard section.
    """
    c = Ctx(path, None, "meta.torch")
    if not isinstance(raw, dict):
        raise c.fail("is not a map")
    C.integer(c, raw.get("schema"), "schema", 1, C.SCHEMA)
    C.one_of(c, raw.get("mode"), "mode", C.MODES)
    C.one_of(c, raw.get("capture"), "capture", C.CAPTURES, none=True)
    C.string(c, raw.get("optimizer"), "optimizer")
    params = C.tensor_names(c, raw.get("params"), "params")
    groups = _groups(c, raw.get("groups"), "groups", len(params), "parameters")
    model = _model(c, raw.get("model"), "model")
    names = {t.name for t in model}
    for p in params:
        if p not in names:
            raise c.fail(f"parameter {p!r} is not a model tensor")
    buffers = C.tensor_names(c, raw.get("buffers", []), "buffers")
    for b in buffers:
        if b not in names or b in params:
            raise c.fail(f"buffer {b!r} is not a model tensor (or is a parameter)")
    aliases = _aliases(c, raw.get("aliases") or {}, names)
    order = raw.get("state_dict")
    if order is not None:
        order = C.tensor_names(c, order, "state_dict")
        for n in order:
            if n not in names and n not in aliases:
                raise c.fail(f"state_dict name {n!r} is neither a model tensor nor an alias")
    compressor = _compressor(c, raw.get("compressor"))
    _codecs_and_intervals(c, raw)
    scaler = raw.get("scaler")
    if scaler is not None and not isinstance(scaler, bool):
        C.string(c, scaler, "scaler")  # a class name (bool in logs of earlier versions)
    for k in ("torch_version", "device"):
        C.string(c, raw.get(k), k, none=True)
    shard = None
    if "shard" in raw:
        shard = _shard(Ctx(path, None, "meta.torch.shard"), raw["shard"], groups)
    return LogMeta(
        schema=raw["schema"], mode=raw["mode"],
        optimizer=current_class_name(raw["optimizer"]), params=tuple(params),
        groups=tuple(groups), model=model, buffers=tuple(buffers), aliases=aliases,
        state_dict=None if order is None else tuple(order), capture=raw.get("capture"),
        compressor=compressor, grad_codec=raw.get("grad_codec"),
        grad_zstd=raw.get("grad_zstd"), delta_codec=raw.get("delta_codec"),
        digest_every=raw.get("digest_every"), snapshot_every=raw.get("snapshot_every"),
        scheduler=raw.get("scheduler"), scaler=scaler,
        torch_version=raw.get("torch_version"), device=raw.get("device"),
        numerics=parse_runs(c, raw.get("numerics"), _unrecorded_use(raw, model, params,
                                                                       compressor)),
        shard=shard, base_slices=_base_slices(c, raw.get("base_slices")), raw=raw)


def _unrecorded_use(raw: Mapping[str, Any], model: Sequence[ModelTensor],
                    params: Sequence[str], compressor: CompressorMeta | None) -> str | None:
    """What a run recorded without ``mkl_use`` may reach of MKL: its optimizer's step
    when that may call MKL's ``sqrt`` in some implementation (which one it ran is not
    recorded in the log's metadata), a compressor's matrix products."""
    trained = set(params)
    return mkl_use(current_class_name(raw["optimizer"]), None,
                   {t.dtype for t in model if t.name in trained},
                   compressor.kind if compressor is not None else None, raw["mode"])


def _groups(c: Ctx, groups: Any, what: str, total: int, of: str) -> list[int]:
    if not isinstance(groups, list) or not all(type(g) is int and g >= 0 for g in groups) \
            or sum(groups) != total:
        raise c.fail(f"{what} {short(groups)} must be sizes that sum to the {total} {of}")
    return groups


def _model(c: Ctx, model: Any, what: str) -> tuple[ModelTensor, ...]:
    return tuple(ModelTensor(n, tag, tuple(shape))
                 for n, (tag, shape) in C.model_list(c, model, what).items())


def _aliases(c: Ctx, aliases: Any, names: set[str]) -> dict[str, str]:
    if not isinstance(aliases, dict):
        raise c.fail("aliases must be a map")
    for a, target in aliases.items():
        C.tensor_name(c, a, "alias")
        if a in names or not isinstance(target, str) or target not in names:
            raise c.fail(f"alias {a!r} -> {short(target)} does not name a model tensor")
    return aliases


def _compressor(c: Ctx, comp: Any) -> CompressorMeta | None:
    if comp is None:
        return None
    if not isinstance(comp, dict):
        raise c.fail("compressor must be a map or nil")
    C.string(c, comp.get("kind"), "compressor.kind")
    if not isinstance(comp.get("error_feedback", False), bool):
        raise c.fail("compressor.error_feedback must be a bool")
    C.one_of(c, comp.get("ef_state"), "compressor.ef_state", C.EF_STATES, none=True)
    return CompressorMeta(comp["kind"], comp.get("error_feedback", False),
                          comp.get("ef_state"), comp)


def _codecs_and_intervals(c: Ctx, raw: Mapping[str, Any]) -> None:
    C.one_of(c, raw.get("grad_codec"), "grad_codec", C.GRAD_CODECS, none=True)
    C.integer(c, raw.get("grad_zstd"), "grad_zstd", -(1 << 17), 22, none=True)
    C.one_of(c, raw.get("delta_codec"), "delta_codec", C.DELTA_CODECS, none=True)
    C.integer(c, raw.get("digest_every"), "digest_every", 0, C.MAX_INT, none=True)
    C.integer(c, raw.get("snapshot_every"), "snapshot_every", 1, C.MAX_INT, none=True)
    C.string(c, raw.get("scheduler"), "scheduler", none=True)


def _base_slices(c: Ctx, v: Any) -> BaseSlices | None:
    """``base_slices``: ``{"k": int >= 1 | "auto", "in_force": 1 .. k, "why": str | nil}``."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise c.fail("base_slices must be a map")
    auto = v.get("k") == "auto"
    if not auto:
        C.integer(c, v.get("k"), "base_slices.k", 1, C.MAX_INT)
    C.integer(c, v.get("in_force"), "base_slices.in_force", 1, C.MAX_INT if auto else v["k"])
    C.string(c, v.get("why"), "base_slices.why", none=True)
    return BaseSlices(v["k"], v["in_force"], v.get("why"))


# ---------------------------------------------------------------------- the shard section


def _shard(c: Ctx, sh: Any, groups: Sequence[int]) -> ShardMeta:
    """The ``shard`` section of a sharded checkpoint's log: rank, world size, layout, the
    parameters this rank logs, the job's optimizer order and, for FSDP2, the global model,
    the device mesh and every owned parameter's placements and box (inside its global
    shape): everything resharding and ``inspect`` read, checked before they read it."""
    if not isinstance(sh, dict):
        raise c.fail("must be a map")
    C.integer(c, sh.get("world_size"), "world_size", 1, C.MAX_RANKS)
    C.integer(c, sh.get("rank"), "rank", 0, sh["world_size"] - 1)
    C.one_of(c, sh.get("layout"), "layout", C.LAYOUTS)
    layout = sh["layout"]
    owned = tuple(C.tensor_names(c, sh.get("owned"), "owned"))
    gp = sh.get("global_params")
    gparams: tuple[str, ...] | None = None
    ggroups: tuple[int, ...] | None = None
    if gp is not None or layout in ("zero", "fsdp"):   # the job's optimizer order
        gparams = tuple(C.tensor_names(c, gp, "global_params"))
        ggroups = tuple(_groups(c, sh.get("global_groups"), "global_groups", len(gparams),
                                "global parameters"))
        if layout == "zero" and len(ggroups) != len(groups):
            raise c.fail(f"global_groups has {len(ggroups)} groups, the optimizer "
                         f"{len(groups)}")
    out = ShardMeta(sh["world_size"], sh["rank"], layout, owned, gparams, ggroups)
    if layout != "fsdp":
        return out
    return _fsdp(c, sh, out)


def _fsdp(c: Ctx, sh: Mapping[str, Any], out: ShardMeta) -> ShardMeta:
    """The FSDP2 part of a shard section (see :func:`_shard`)."""
    gmodel = _model(c, sh.get("global_model"), "global_model")
    glob = {t.name: t.shape for t in gmodel}
    mesh = _mesh(c, sh.get("mesh"))
    C.integer(c, sh.get("replicas"), "replicas", 1, C.MAX_RANKS)
    C.integer(c, sh.get("replica"), "replica", 0, sh["replicas"] - 1)
    in_job = set(out.global_params or ())
    for n in out.owned:
        if n not in in_job:
            raise c.fail(f"owned parameter {n!r} is not one of global_params")
    pieces = sh.get("pieces")
    if not isinstance(pieces, dict):
        raise c.fail("pieces must be a map")
    if set(pieces) != set(out.owned):
        odd = sorted(str(n) for n in set(pieces) ^ set(out.owned))[:3]
        raise c.fail(f"pieces must be those of the owned parameters (differ on "
                     f"{', '.join(map(repr, odd))})")
    aliases = sh.get("global_aliases", {})
    if not isinstance(aliases, dict) or not all(
            isinstance(a, str) and a not in glob and isinstance(t, str) and t in glob
            for a, t in aliases.items()):
        raise c.fail("global_aliases must map names to global_model tensors")
    order = sh.get("global_state_dict")
    if order is not None:
        order = C.tensor_names(c, order, "global_state_dict")
        for n in order:
            if n not in glob and n not in aliases:
                raise c.fail(f"global_state_dict name {n!r} is neither a global_model tensor "
                             "nor an alias")
    parsed = {n: _piece(c, n, p, glob, len(mesh.shape)) for n, p in pieces.items()}
    return ShardMeta(out.world_size, out.rank, out.layout, out.owned, out.global_params,
                     out.global_groups, gmodel, mesh, sh["replicas"], sh["replica"], parsed,
                     sh.get("global_aliases"), None if order is None else tuple(order))


def _mesh(c: Ctx, mesh: Any) -> Mesh:
    if not isinstance(mesh, dict):
        raise c.fail("mesh must be a map")
    mshape, coord = mesh.get("shape"), mesh.get("coord")
    if not isinstance(mshape, list) or not 1 <= len(mshape) <= MAX_NDIM or \
            not all(type(x) is int and 1 <= x <= C.MAX_RANKS for x in mshape):
        raise c.fail(f"mesh.shape {short(mshape)} must be 1 to {MAX_NDIM} sizes")
    if not isinstance(coord, list) or len(coord) != len(mshape) or not all(
            type(x) is int and 0 <= x < m for x, m in zip(coord, mshape, strict=False)):
        raise c.fail(f"mesh.coord {short(coord)} is not a coordinate of mesh "
                     f"{short(mshape)}")
    dn = mesh.get("dim_names", [])
    if not isinstance(dn, list) or not all(isinstance(x, str) and len(x) <= C.MAX_STR
                                           for x in dn):
        raise c.fail("mesh.dim_names must be a list of strings")
    return Mesh(tuple(mshape), tuple(coord), tuple(dn))


def _piece(c: Ctx, n: Any, p: Any, glob: Mapping[str, tuple[int, ...]], mesh_dims: int
           ) -> PieceMeta:
    w = f"piece of {short(n)}"
    if not isinstance(n, str) or n not in glob:
        raise c.fail(f"{w}: not a tensor of global_model")
    if not isinstance(p, dict):
        raise c.fail(f"{w} must be a map")
    g = list(glob[n])
    if p.get("global_shape") != g:
        raise c.fail(f"{w}: global_shape {short(p.get('global_shape'))} is not the "
                     f"global model's {g}")
    pls = p.get("placements")
    if not isinstance(pls, list) or len(pls) != mesh_dims or not all(
            pl == ["R"] or (isinstance(pl, list) and len(pl) == 2 and pl[0] == "S"
                            and type(pl[1]) is int and 0 <= pl[1] < max(len(g), 1))
            for pl in pls):
        raise c.fail(f"{w}: placements {short(pls)} must be one [\"S\", dim] or "
                     f"[\"R\"] per mesh dimension")
    box: list[list[int]] = []
    for what in ("offset", "shape"):
        v = p.get(what)
        if not isinstance(v, list) or len(v) != len(g) or \
                not all(type(x) is int and x >= 0 for x in v):
            raise c.fail(f"{w}: {what} {short(v)} must be {len(g)} non-negative "
                         "integers")
        box.append(v)
    off, shp = box
    if any(o + k > d for o, k, d in zip(off, shp, g, strict=True)):
        raise c.fail(f"{w}: the box at {off} of shape {shp} lies outside its global "
                     f"shape {g}")
    return PieceMeta(tuple(g), tuple(tuple(pl) for pl in pls), tuple(off), tuple(shp))


# ---------------------------------------------------------------------- a base


def parse_base(raw: Any, log: LogMeta, *, path: str | None = None,
               tensors: Mapping[str, tuple[str, Sequence[int]]] | None = None,
               step: int | None = None) -> BaseMeta:
    """A base's ``meta["torch"]`` parsed against the log's metadata ``log``: one
    hyperparameter map per group, packed scheduler/scaler/extra state, an optimizer layout
    naming known parameters with state keys whose tensors the base holds; or one
    FormatError(bad_metadata) naming ``path``.

    ``tensors`` (name -> (dtype tag, shape), from the base's validated header) makes the
    check against the file: every model tensor and every ``@opt`` tensor of the layout
    must be there with the dtype and shape the log declares, so nothing is ever allocated
    from a declared size that the file does not hold. ``step``: the base's own step, which
    a recorded ``step`` must equal.
    """
    c = Ctx(path, None, "base meta.torch")
    if not isinstance(raw, dict):
        raise c.fail("is missing or not a map")
    C.integer(c, raw.get("step"), "step", 0, C.MAX_INT, none=True)
    if step is not None and raw.get("step") not in (None, step):
        raise c.fail(f"step {raw.get('step')} differs from the base's step {step}")
    C.hyper(c, raw.get("hyper"), "hyper", len(log.groups))
    for k in ("sched", "scaler", "extra"):
        C.packed(raw.get(k), c, k)
    opt = raw.get("opt")
    if opt is not None:
        C.opt_layout(c, opt, "opt", log.param_set)
    if not isinstance(raw.get("ef_approx", False), bool):
        raise c.fail("ef_approx must be a bool")
    layout = OptLayout.of(opt)
    if tensors is not None:
        _base_tensors(c, log, layout, tensors)
    return BaseMeta(raw.get("step"), raw["hyper"], raw.get("sched"), raw.get("scaler"),
                    raw.get("extra"), layout, raw.get("ef_approx", False))


def parse_streamed(metas: Sequence[Mapping[str, Any]], log: LogMeta, *,
                   slices: Sequence[int], held: Mapping[str, int],
                   paths: Sequence[str]) -> dict[str, Any]:
    """The metadata of a streamed base's slices (spec section 7.2) read as one base's:
    each slice's ``meta["torch"]`` parsed against ``log`` at its own step, every parameter
    whose optimizer state a slice lays out held by that slice with its state tensors and
    residual (``held``: tensor name -> the step of the slice holding it; else replay would
    move them at different steps), and the first slice's metadata with the optimizer layout
    of every slice returned (what :func:`parse_base` then checks against the union of the
    slices' tensors). One FormatError(bad_metadata) naming the slice otherwise."""
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for i, (s, m, path) in enumerate(zip(slices, metas, paths, strict=True)):
        lay = parse_base(m.get("torch"), log, path=path, step=s).opt
        for n in {*lay.tensors, *lay.values}:
            owned = [n, *(opt_name(n, k) for k in lay.tensors.get(n, ()))]
            if EF + n in held:
                owned.append(EF + n)
            wrong = next((x for x in owned if held.get(x) != s), None)
            if wrong is not None:
                raise Ctx(path, None, "base meta.torch.opt").fail(
                    f"slice {i} of the streamed base {slices[-1]} lays out the optimizer "
                    f"state of {n!r}, but {wrong!r} is not in it")
        tensors.update(lay.tensors)
        values.update(lay.values)
    first = dict(metas[0])
    first["torch"] = {**first["torch"], "opt": {"tensors": tensors, "values": values}}
    return first


def _base_tensors(c: Ctx, log: LogMeta, layout: OptLayout,
                  tensors: Mapping[str, tuple[str, Sequence[int]]]) -> None:
    for n, tag, shape in log.model:
        got = tensors.get(n)
        if got is None or got[0] != tag or list(got[1]) != list(shape):
            raise c.fail(f"model tensor {n!r} ({tag} {list(shape)}) is "
                         f"{'missing from' if got is None else 'different in'} the base")
    if log.mode == "grad":
        for n, keys in layout.tensors.items():
            for k in keys:
                if opt_name(n, k) not in tensors:
                    raise c.fail(f"optimizer state {opt_name(n, k)} is missing from the base")


__all__ = ["BaseMeta", "BaseSlices", "CompressorMeta", "EMPTY_LAYOUT", "LogMeta", "Mesh",
           "ModelTensor", "OptLayout", "PieceMeta", "ShardMeta", "parse", "parse_base",
           "parse_streamed"]
