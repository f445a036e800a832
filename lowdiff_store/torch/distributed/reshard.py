"""Resharding: the state of a checkpoint written by W ranks, for W' ranks of any layout.

Every log of a checkpoint is seen as a set of *pieces*: shard *s* holds, for each
parameter it owns, a box of the global tensor (an offset and a length per dimension): the
whole tensor for the replicated and ZeRO layouts and for a single log, the rank's DTensor
shard for FSDP2 (recorded placements, see :mod:`lowdiff_store.torch.distributed.fsdp`). Each
shard is
replayed **on its own**, through an optimizer over exactly the pieces it logged, so every
element goes through the very kernel call it went through in training; the pieces a new
rank needs are then cut and assembled into its own boxes. The optimizers allowed here act
on each element alone (:data:`~lowdiff_store.torch.distributed.fsdp.ELEMENTWISE`), so the result is
bitwise the original run's state at that step, gathered, for any partition. Anything else
is refused (``ConfigError(not_allowed)`` with the reason).

A rank replays only the shards whose pieces overlap its boxes, and reads only their logs:
with FSDP2 at W' = W each rank replays one shard; at W' = 1 every shard. Within a shard it
replays only the parameters whose pieces overlap its boxes and reads, through the store's
ranged reads, only their base tensors (each whole, so each is CRC-checked); records are read
whole (one CRC per record) and only the kept gradients decoded. Compressor residuals are
assembled like optimizer state; rank-local state (DDP hook state, DeMo momenta of a
multi-rank job) is not carried, and the result says so (see ``docs/distributed.md``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import ConfigError, Reason
from ...log import LogReader
from ...log.reader import BasePlan
from ...log.shardset import check_chain, plan_job
from ...progress import ProgressFn
from ...torchmeta import LogMeta
from ..core import schema as L
from ..core.hook_records import HOOK, HOOK_EF, HOOK_Q, PSGD
from ..core.tensors import DTYPE_OF, local_of, tag_of
from ..core.typed_msgpack import pack, unpack
from ..replay.engine import Objects, Replayer, base_torch_meta, streamed_base
from ..replay.restore import RestoreResult, build_optimizer
from .fsdp import ELEMENTWISE, NOT_ELEMENTWISE, has_dtensor, is_dtensor, piece_of

Box = tuple[tuple[int, ...], tuple[int, ...]]   # (offset, shape) per dimension


@dataclass
class Piece:
    """Shard ``shard`` holds the box ``(offset, shape)`` of a tensor."""

    shard: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardFacts:
    """What a restore must know of a shard it does not replay: its durable step and
    restore points (its live bases and streamed bases' complete steps, for the job's plan:
    each shard replays from its own), its diff mode, and the boxes it holds, as
    ``(name, offset, shape)`` (for finding the shards a rank needs). Plain values, so the
    ranks of a job can each open a few logs and exchange these instead of every rank
    opening every log."""

    durable: int | None
    bases: tuple[int, ...]
    mode: str
    boxes: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]


def shard_facts(reader: LogReader, meta: LogMeta, layout: str) -> ShardFacts:
    """The :class:`ShardFacts` of one log (``layout``: the checkpoint's, or ``"single"``):
    FSDP2's recorded pieces, else the whole of each parameter the shard owns (every model
    tensor but the buffers, for a log without a shard section)."""
    sh = meta.shard
    if layout == "fsdp":
        boxes = tuple((n, tuple(p.offset), tuple(p.shape))
                      for n, p in (sh.pieces if sh is not None else {}).items())
    else:
        bufs = set(meta.buffers)
        owned = set(sh.owned) if sh is not None else None
        boxes = tuple((n, (0,) * len(shape), tuple(shape)) for n, _t, shape in meta.model
                      if n not in bufs and (owned is None or n in owned))
    return ShardFacts(reader.durable_step, tuple(reader.manifest.base_steps()), meta.mode,
                      boxes)


class Source:
    """A checkpoint seen as pieces: ``readers[s]`` and ``metas[s]`` of each log, the
    layout, and from them the global model (name -> (dtype tag, global shape)), the global
    optimizer order and group sizes, and the pieces of every non-buffer model tensor.

    ``facts``: every shard's :class:`ShardFacts` when known already (exchanged between
    ranks); then ``readers`` and ``metas`` are only indexed for shard 0's metadata and the
    shards replayed, and may open each log on first use."""

    def __init__(self, root: str, readers: Sequence[LogReader], metas: Sequence[LogMeta],
                 layout: str, facts: Sequence[ShardFacts] | None = None) -> None:
        self.root = root
        self.readers = readers
        self.metas = metas
        self.layout = layout
        self.world = len(readers)
        m0 = self.metas[0]
        sh = m0.shard
        model = m0.model
        params, groups = m0.params, m0.groups
        if sh is not None and layout in ("fsdp", "zero"):
            params, groups = sh.global_params or params, sh.global_groups or groups
        if sh is not None and layout == "fsdp" and sh.global_model is not None:
            model = sh.global_model
        self.model: dict[str, tuple[str, tuple[int, ...]]] = {n: (t, s) for n, t, s in model}
        self.buffers = list(m0.buffers)
        self.params: list[str] = list(params)
        self.groups: list[int] = list(groups)
        self.optimizer: str = m0.optimizer
        self.facts: list[ShardFacts] = list(facts) if facts is not None else [
            shard_facts(r, m, layout) for r, m in zip(readers, metas, strict=True)]
        if len(self.facts) != self.world:
            raise ConfigError(f"{len(self.facts)} shards described, {self.world} expected",
                              reason=Reason.BAD_METADATA, path=self.root)
        bufs = set(self.buffers)
        self.pieces: dict[str, list[Piece]] = {n: [] for n in self.model if n not in bufs}
        for s, f in enumerate(self.facts):
            if f.mode != "grad":
                raise ConfigError("only grad-mode checkpoints can be resharded",
                                  reason=Reason.NOT_ALLOWED, path=self.root)
            for n, off, shape in f.boxes:
                if layout == "fsdp" or n in self.pieces:
                    self._add(n, Piece(s, off, shape))
        for n, ps in self.pieces.items():
            if not ps:
                raise ConfigError(f"no shard holds {n}", reason=Reason.BAD_METADATA,
                                  path=self.root)
            self._check_tiling(n, ps)

    def _check_tiling(self, n: str, ps: list[Piece]) -> None:
        """The pieces of ``n`` tile its global shape: pairwise disjoint and, together,
        every element. Cutting counts the elements it copies, and overlapping pieces
        could add up to the whole while leaving part of a box unwritten."""
        glob = self.model[n][1]
        held = sum(math.prod(p.shape) for p in ps)
        if held != math.prod(glob):
            raise ConfigError(f"the shards' pieces of {n} hold {held} elements, its global "
                              f"shape {list(glob)} {math.prod(glob)}",
                              reason=Reason.BAD_METADATA, path=self.root)
        live = sorted((p for p in ps if math.prod(p.shape) > 0), key=lambda p: p.offset)
        for i, a in enumerate(live):
            for b in live[i + 1:]:   # sorted by offset: none further can overlap a on dim 0
                if a.offset and b.offset[0] >= a.offset[0] + a.shape[0]:
                    break
                if _overlap((a.offset, a.shape), (b.offset, b.shape)) is not None:
                    raise ConfigError(f"shards {a.shard} and {b.shard} hold overlapping "
                                      f"pieces of {n}", reason=Reason.BAD_METADATA,
                                      path=self.root)

    def _add(self, n: str, p: Piece) -> None:
        if n not in self.pieces:
            raise ConfigError(f"a shard holds {n}, which is not a parameter of the model",
                              reason=Reason.BAD_METADATA, path=self.root)
        glob = self.model[n][1]
        if len(p.offset) != len(glob) or len(p.shape) != len(glob) or any(
                o < 0 or ln < 0 or o + ln > g for o, ln, g in zip(p.offset, p.shape, glob,
                                                                 strict=True)):
            raise ConfigError(f"shard {p.shard}: the box of {n} lies outside its global "
                              f"shape {list(glob)}", reason=Reason.BAD_METADATA, path=self.root)
        self.pieces[n].append(p)

    def shard_meta(self, s: int) -> LogMeta:
        """Shard ``s``'s torch metadata restricted to what it logged, so it replays on its
        own: its owned parameters (optimizer order, group sizes) and model tensors."""
        m = self.metas[s]
        if self.layout == "fsdp" or m.shard is None:
            return m
        owned = set(m.shard.owned)
        bufs = set(m.buffers)
        model = tuple(e for e in m.model if e[0] in owned or e[0] in bufs)
        if self.layout == "zero":   # the partition is the shard's optimizer already
            return dataclasses.replace(m, model=model)
        names = m.params
        keep = [i for i, n in enumerate(names) if n in owned]
        counts, start = [], 0
        for g in m.groups:
            counts.append(sum(1 for i in keep if start <= i < start + g))
            start += g
        return dataclasses.replace(m, model=model, params=tuple(names[i] for i in keep),
                                   groups=tuple(counts))

    def plan(self, step: int | None) -> tuple[int, list[int], int]:
        """(target, base per shard, job durable step): each shard from its own newest base
        at or before the target."""
        p = plan_job([f.durable for f in self.facts], [list(f.bases) for f in self.facts],
                     step, "pieces", self.root)
        return p.target, p.bases, p.job_durable

    def check_elementwise(self) -> None:
        """Refuse an optimizer whose step is not known to act on each element alone."""
        name = self.optimizer
        short = name.rsplit(".", 1)[-1]
        if name in NOT_ELEMENTWISE or short not in ELEMENTWISE or \
                L.allowed_optimizer(name) is None:
            raise ConfigError(
                f"cannot reshard a log of {name}: resharding replays each shard's pieces "
                f"alone and cuts them, which is exact only for the elementwise torch.optim "
                f"optimizers ({', '.join(ELEMENTWISE)}); factored or coupled state "
                f"(Adafactor, Shampoo, LBFGS, ...) is refused", reason=Reason.NOT_ALLOWED,
                path=self.root)


def _overlap(a: Box, b: Box) -> tuple[list[int], list[int]] | None:
    """The intersection of two boxes as (low, high) corners; None when empty."""
    lo = [max(x, y) for x, y in zip(a[0], b[0], strict=True)]
    hi = [min(x + lx, y + ly) for x, lx, y, ly in zip(a[0], a[1], b[0], b[1], strict=True)]
    if any(h <= lw for lw, h in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def needed_shards(src: Source, boxes: Mapping[str, Box]) -> set[int]:
    """The shards holding a piece that overlaps a wanted box (and, for a wanted box with
    no element, the first shard holding the tensor: its scalar optimizer state)."""
    need: set[int] = set()
    for n, box in boxes.items():
        ps = src.pieces[n]
        if math.prod(box[1]) == 0:
            need.add(ps[0].shard)
            continue
        for p in ps:
            if _overlap((p.offset, p.shape), box) is not None:
                need.add(p.shard)
    return need


@dataclass
class Replayed:
    """Shards replayed on their own to the target step."""

    values: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # pieces replayed straight into their place in a destination tensor (nothing to cut)
    in_place: set[tuple[int, str]] = field(default_factory=set)
    states: dict[tuple[int, str], dict[str, Any]] = field(default_factory=dict)
    hyper: list[Any] = field(default_factory=list)
    home_model: dict[str, torch.Tensor] = field(default_factory=dict)
    result: RestoreResult | None = None
    # shards replayed for some of their parameters only (no step digest checked)
    partial: list[int] = field(default_factory=list)
    # the home shard's base holds communication-hook state
    hooked: bool = False
    # compressor error-feedback residuals (or DeMo momenta) of the pieces, like states
    residuals: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # why a shard other than the home one is not exact (approximate residuals)
    shard_notes: list[str] = field(default_factory=list)


def _view_in(dest: tuple[Box, torch.Tensor] | None, p: Piece, dtype: torch.dtype
             ) -> torch.Tensor | None:
    """The part of a destination tensor (holding box ``dest[0]``) where piece ``p`` goes,
    when that part is one contiguous block of it (``p`` spans every dim but the first),
    so the piece can be replayed in place; else None."""
    if dest is None:
        return None
    (off, shape), t = dest
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or \
            not p.shape or math.prod(p.shape) == 0 or tuple(t.shape) != tuple(shape):
        return None
    if tuple(p.offset[1:]) != tuple(off[1:]) or tuple(p.shape[1:]) != tuple(shape[1:]):
        return None
    lo = p.offset[0] - off[0]
    if lo < 0 or lo + p.shape[0] > shape[0]:
        return None
    return t.narrow(0, lo, p.shape[0])


def keep_of(src: Source, s: int, boxes: Mapping[str, Box] | None) -> set[str] | None:
    """The parameters of shard ``s`` whose pieces overlap a box of ``boxes`` (a zero-element
    box: the first shard holding the tensor, for its scalar optimizer state), and those
    whose piece on ``s`` is empty (nothing to read: kept so that a shard wanted for all its
    other parameters, e.g. at W' = W, is replayed whole and its step digests checked);
    None when every piece is wanted (``boxes`` is None)."""
    if boxes is None:
        return None
    keep: set[str] = set()
    for n, box in boxes.items():
        for i, p in enumerate(src.pieces.get(n, ())):
            if p.shard != s:
                continue
            if math.prod(p.shape) == 0 or (math.prod(box[1]) == 0 and i == 0) or \
                    _overlap((p.offset, p.shape), box) is not None:
                keep.add(n)
    return keep


def _restrict(meta: LogMeta, keep: set[str], home: bool) -> LogMeta:
    """Shard metadata restricted to the parameters ``keep`` (their optimizer order and
    group sizes) and, on the home shard only, the buffers."""
    bufs = set(meta.buffers) if home else set()
    names = meta.params
    counts, start = [], 0
    for g in meta.groups:
        counts.append(sum(1 for n in names[start:start + g] if n in keep))
        start += g
    return dataclasses.replace(
        meta, model=tuple(e for e in meta.model if e[0] in keep or e[0] in bufs),
        buffers=tuple(b for b in meta.buffers if b in bufs),
        params=tuple(n for n in names if n in keep), groups=tuple(counts))


def _param_of(name: str, params: Collection[str]) -> str | None:
    """The parameter a per-parameter tensor of a base or record belongs to (its gradient,
    optimizer state, residuals, hook factors), or None."""
    for pre in (L.GRAD, L.EF, HOOK_EF, HOOK_Q):
        if name.startswith(pre) and name[len(pre):] in params:
            return name[len(pre):]
    if name.startswith(PSGD) and name.endswith(("/P", "/Q")) and name[len(PSGD):-2] in params:
        return name[len(PSGD):-2]
    if name.startswith(L.OPT):
        head = name[len(L.OPT):].rsplit("/", 1)[0]
        if head in params:
            return head
    return name if name in params else None


class _BaseView:
    """One shard's base, open once for the whole replay of that shard, seen with only the
    tensors of the parameters kept (the others are never read: a base is read tensor by
    tensor, each whole, so each one read is CRC32C-checked). ``with`` does not close it."""

    def __init__(self, base: Any, dropped: Collection[str]) -> None:
        self._b = base
        self._dropped = set(dropped)
        self.path = base.path
        self.step = base.step
        self.all_names: list[str] = base.names
        self.names = [n for n in self.all_names if _param_of(n, self._dropped) is None]

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype tag, shape) of a tensor."""
        out: tuple[str, tuple[int, ...]] = self._b.info(name)
        return out

    def step_of(self, name: str) -> int:
        """The step after which a streamed base's slice holding ``name`` was taken (a
        consistent base's: its step)."""
        step_of = getattr(self._b, "step_of", None)
        return int(step_of(name)) if step_of is not None else int(self.step)

    def tensor(self, name: str, **kw: Any) -> Any:
        """A tensor's bits (its CRC checked on first read)."""
        return self._b.tensor(name, **kw)

    def meta(self) -> dict[str, Any]:
        """The base metadata, the optimizer layout restricted to the kept parameters."""
        m: dict[str, Any] = self._b.meta()
        opt = (m.get("torch") or {}).get("opt")
        if isinstance(opt, dict) and self._dropped:
            for k in ("tensors", "values"):
                if isinstance(opt.get(k), dict):
                    opt[k] = {n: v for n, v in opt[k].items() if n not in self._dropped}
        return m

    def __enter__(self) -> _BaseView:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _RecordView:
    """One step's record of a shard seen with only the kept parameters' tensors. The
    record is read whole and its CRC checked (one CRC per record, see the spec); only the
    kept gradients are decoded. Its state digest covers every parameter of the shard, so
    it is not offered (cannot be checked on a part)."""

    def __init__(self, rec: Any, dropped: Collection[str]) -> None:
        self._rec = rec
        self.step, self.path, self.offset = rec.step, rec.path, rec.offset
        self.names = [n for n in rec.names if _param_of(n, dropped) is None]
        side = dict(rec.side)
        clip = side.get("clip")
        if isinstance(clip, dict) and isinstance(clip.get("params"), list):
            side["clip"] = {**clip, "params": [n for n in clip["params"] if n not in dropped]}
        self.side = side
        self.meta = {k: v for k, v in rec.meta.items() if k != "digest"}
        self.meta["side"] = side

    def entry(self, name: str) -> Any:
        """The entry of one tensor."""
        return self._rec.entry(name)

    def tensor(self, name: str, **kw: Any) -> Any:
        """Decode one tensor."""
        return self._rec.tensor(name, **kw)

    def parts(self, name: str) -> Any:
        """The stored parts of one tensor."""
        return self._rec.parts(name)


class _ShardReader:
    """A shard's reader for one replay: its base (or streamed base, ``plan``) opened once,
    its records seen through :class:`_RecordView` when some of its parameters are not
    replayed."""

    def __init__(self, reader: LogReader, plan: BasePlan, base: _BaseView,
                 dropped: Collection[str]) -> None:
        self._r = reader
        self._plan = plan
        self._base = base
        self._dropped = dropped
        self.path = reader.path

    def chain_from(self, step: int) -> tuple[BasePlan, list[int]]:
        """(where replay starts, diffs to replay)."""
        return self._plan, list(range(self._plan.first + 1, step + 1))

    def chain(self, step: int) -> tuple[int, list[int]]:
        """(the step replay starts after, diffs to replay)."""
        return self._plan.first, self.chain_from(step)[1]

    def base_for(self, step: int) -> int:
        """The step replay starts after."""
        return self._plan.first

    def base(self, step: int) -> _BaseView:
        """The base (open already)."""
        return self._base

    def open_start(self, plan: BasePlan) -> _BaseView:
        """The streamed base (open already)."""
        return self._base

    def record(self, step: int) -> Any:
        """The record of ``step``."""
        rec = self._r.record(step)
        return _RecordView(rec, self._dropped) if self._dropped else rec


@dataclass
class _ShardOutcome:
    """What replaying one shard produced (see :func:`replay_shards`)."""

    shard: int
    model: dict[str, torch.Tensor]
    names: list[str]
    params: list[torch.Tensor]
    opt: torch.optim.Optimizer
    outcome: Any
    dropped: list[str]
    in_place: set[tuple[int, str]]
    hooked: bool


def replay_shards(src: Source, shards: Sequence[int], home: int, target: int,
                  bases: Sequence[int], *, verify: bool, scheduler: Any = None,
                  scaler: Any = None, apply_rng: bool = True,
                  factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
                  | None = None, progress: ProgressFn | None = None,
                  dest: Mapping[str, tuple[Box, torch.Tensor]] | None = None,
                  boxes: Mapping[str, Box] | None = None) -> Replayed:
    """Replay each of ``shards`` alone from its base to ``target`` (``home`` last: its
    RNG states, buffers, scheduler, scaler and side channel are the result's). ``dest``:
    per parameter, the box a destination tensor holds and the tensor; a piece that is a
    contiguous block of it is replayed there, in place (no copy afterwards). ``boxes``:
    the boxes wanted; then only the parameters of a shard whose pieces overlap one are
    replayed, and only their tensors of the base are read (records are read whole, for
    their CRC; a shard replayed in part has no step digest to check)."""
    by_shard = {(p.shard, n): p for n, ps in src.pieces.items() for p in ps}
    out = Replayed()
    order = [s for s in sorted(set(shards)) if s != home] + [home]

    def one(s: int) -> _ShardOutcome:
        is_home = s == home
        full = src.shard_meta(s)
        keep = keep_of(src, s, boxes)
        if keep is not None and not keep & set(full.params):
            keep = {full.params[0]} if full.params else keep   # home: its side state
        meta = full if keep is None else _restrict(full, keep, is_home)
        dropped = [] if keep is None else [n for n in full.params if n not in keep]
        reader = src.readers[s]
        model: dict[str, torch.Tensor] = {}
        in_place: set[tuple[int, str]] = set()
        for n, tag, shape in meta.model:   # every tensor is loaded from the base
            piece = by_shard.get((s, n))
            view = _view_in((dest or {}).get(n), piece, DTYPE_OF[tag]) \
                if piece is not None and tuple(piece.shape) == tuple(shape) else None
            if view is not None:
                in_place.add((s, n))
            model[n] = view if view is not None else torch.empty(shape, dtype=DTYPE_OF[tag])
        names = list(meta.params)
        params = [model[n] for n in names]
        check_chain(reader, bases[s], target)
        plan = reader.start_for(bases[s])
        with (streamed_base(reader, plan, full) if plan.streamed
              else reader.base(bases[s])) as bf:
            base = _BaseView(bf, dropped)
            hooked = is_home and any(n.startswith(HOOK) for n in base.all_names)
            hyper = base_torch_meta(base, meta).hyper
            opt = build_optimizer(meta, params, hyper, factory, reader.path)
            objs = Objects(names, params, model, opt, scheduler if is_home else None,
                            scaler if is_home else None)
            shard_reader: Any = _ShardReader(reader, plan, base, dropped)   # a Reader
            rep = Replayer(shard_reader, meta, objs,
                            verify=verify and not dropped, progress=None)
            rep.apply_rng = apply_rng and is_home
            outcome = rep.run(target)
        return _ShardOutcome(s, model, names, params, opt, outcome, dropped, in_place, hooked)

    # Shards are independent (their own tensors, optimizer and reader; only the home shard
    # touches the scheduler, scaler and RNG, and it runs last, alone): the others replay
    # on a thread per core (torch releases the GIL in its kernels), the same bits.
    others = order[:-1]
    workers = min(len(others), os.cpu_count() or 1)
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="lowdiff-reshard") as pool:
            results = list(pool.map(one, others))
    else:
        results = [one(s) for s in others]
    results.append(one(home))
    for done, so in enumerate(results, 1):
        s, is_home = so.shard, so.shard == home
        res = so.outcome.result
        out.in_place |= so.in_place
        if is_home:
            out.hooked = so.hooked
        for n, resid in (so.outcome.residuals or {}).items():
            out.residuals[(s, n)] = resid
        if not is_home and not res.exact:
            out.shard_notes += [f"shard {s}: {x}" for x in res.notes]
        if so.dropped:
            out.partial.append(s)
        for n, t in so.model.items():
            if n in src.pieces:
                out.values[(s, n)] = t
        for n, p in zip(so.names, so.params, strict=True):
            out.states[(s, n)] = dict(so.opt.state.get(p, {}))
        if is_home:
            out.hyper = L.hyper_of(so.opt)
            out.home_model = so.model
            out.result = res
        if progress is not None:
            progress(done, len(order))
    return out


def _cut(src: Source, rep: Replayed, n: str, box: Box, get: Callable[[int], torch.Tensor],
         dtype: torch.dtype, out: torch.Tensor | None = None,
         skip: Collection[tuple[int, str]] = ()) -> torch.Tensor:
    """Assemble ``box`` of ``n`` from the pieces ``get(shard)`` overlapping it, into
    ``out`` (a tensor of the box's shape and ``dtype``) or a new tensor; the pieces in
    ``skip`` are in ``out`` already."""
    if out is None:
        out = torch.empty(box[1], dtype=dtype)
    covered = 0
    for p in src.pieces[n]:
        ov = _overlap((p.offset, p.shape), box)
        if ov is None:
            continue
        lo, hi = ov
        if (p.shard, n) in skip:
            covered += math.prod(b - a for a, b in zip(lo, hi, strict=True))
            continue
        piece = get(p.shard)
        dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, box[0], strict=True))
        sl = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, p.offset, strict=True))
        out[dst] = piece[sl]
        covered += math.prod(b - a for a, b in zip(lo, hi, strict=True))
    if covered != math.prod(box[1]):
        raise ConfigError(f"the shards' pieces of {n} do not cover the box wanted "
                          f"({covered} of {math.prod(box[1])} elements)",
                          reason=Reason.BAD_METADATA, path=src.root)
    return out


def assemble_value(src: Source, rep: Replayed, n: str, box: Box,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Model tensor ``n`` cut to ``box`` from the replayed pieces (into ``out`` if given:
    then the pieces replayed in place in it are not copied again)."""
    return _cut(src, rep, n, box, lambda s: rep.values[(s, n)], DTYPE_OF[src.model[n][0]],
                out, rep.in_place if out is not None else ())


def assemble_state(src: Source, rep: Replayed, n: str, box: Box) -> dict[str, Any]:
    """The optimizer state of parameter ``n`` for ``box``: state tensors of the piece's
    shape are cut and assembled; 0-d tensors and other values are per-parameter scalars,
    which must be bitwise equal in every piece; any other shape is not elementwise state
    and is refused."""
    held = [p for p in src.pieces[n] if (p.shard, n) in rep.states]
    if not held:
        raise ConfigError(f"no replayed shard holds {n}", reason=Reason.BAD_METADATA,
                          path=src.root)
    first = rep.states[(held[0].shard, n)]
    out: dict[str, Any] = {}
    for k, v in first.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            for p in held:
                w = rep.states[(p.shard, n)].get(k)
                if not isinstance(w, torch.Tensor) or tuple(w.shape) != p.shape:
                    raise ConfigError(f"optimizer state {k!r} of {n} does not have the "
                                      f"shape of the parameter: not elementwise, cannot be "
                                      f"resharded", reason=Reason.NOT_ALLOWED, path=src.root)
            def piece(s: int, k: str = k) -> torch.Tensor:
                t: torch.Tensor = rep.states[(s, n)][k]
                return t

            out[k] = _cut(src, rep, n, box, piece, v.dtype)
        else:
            for p in held[1:]:
                w = rep.states[(p.shard, n)].get(k)
                if not _same_value(v, w):
                    raise ConfigError(f"optimizer state {k!r} of {n} differs between the "
                                      f"pieces (shards {held[0].shard} and {p.shard}): not "
                                      f"elementwise, cannot be resharded",
                                      reason=Reason.NOT_ALLOWED, path=src.root)
            out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    for p in held[1:]:
        if set(rep.states[(p.shard, n)]) != set(first):
            raise ConfigError(f"the pieces of {n} hold different optimizer state keys",
                              reason=Reason.NOT_ALLOWED, path=src.root)
    return out


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(
                a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    return L.same(pack(a), pack(b)) if _packable(a) and _packable(b) else a == b


def _packable(v: Any) -> bool:
    try:
        pack(v)
    except Exception:
        return False
    return True


# ---------------------------------------------------------------------- live targets


def box_of(t: torch.Tensor) -> Box:
    """The box of the global tensor this process holds of ``t``: its DTensor shard, or
    the whole tensor."""
    if is_dtensor(t):
        p = piece_of(t, "tensor")
        return tuple(p["offset"]), tuple(p["shape"])
    return (0,) * t.dim(), tuple(int(s) for s in t.shape)


def global_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The global shape of ``t`` (a DTensor's, or its own)."""
    return tuple(int(s) for s in t.shape)


def put_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, st: Mapping[str, Any]
              ) -> None:
    """Set the optimizer state of ``p``: tensors of the piece's shape become DTensors
    with ``p``'s placements when ``p`` is a DTensor (on ``p``'s device); scalars as is."""
    local = local_of(p)
    out: dict[str, Any] = {}
    for k, v in st.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            v = v.to(local.device)
            if is_dtensor(p):
                from torch.distributed.tensor import DTensor

                v = DTensor.from_local(v, p.device_mesh, p.placements,  # type: ignore
                                       run_check=False, shape=p.shape, stride=p.stride())
        out[k] = v
    optimizer.state[p] = out


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bits of ``src`` into this process's part of ``dst``."""
    with torch.no_grad():
        local_of(dst).copy_(src)


def state_dict_of(src: Source, rep: Replayed, names: Sequence[str]
                  ) -> dict[str, Any]:
    """An ``optimizer.state_dict()``-shaped dict of the full optimizer state (global
    boxes), parameters by position in ``names`` (the global optimizer order)."""
    state: dict[int, dict[str, Any]] = {}
    for i, n in enumerate(names):
        full: Box = ((0,) * len(src.model[n][1]), src.model[n][1])
        st = assemble_state(src, rep, n, full)
        if st:
            state[i] = st
    groups = []
    start = 0
    for count, h in zip(src.groups, rep.hyper, strict=True):
        g = unpack(h)
        g["params"] = list(range(start, start + count))
        g["param_names"] = list(names[start:start + count])
        start += count
        groups.append(g)
    return {"state": state, "param_groups": groups}


def check_global_model(src: Source, tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """The live model has the log's tensors (names, dtypes, global shapes)."""
    want = [[n, t, list(s)] for n, (t, s) in src.model.items()]
    have = [[n, tag_of(t, n), list(global_shape(t))] for n, t in tensors.items()]
    if want != have:
        diff = next((f"{w} vs {h}" for w, h in zip(want, have, strict=False) if w != h),
                    f"{len(want)} tensors vs {len(have)}")
        raise ConfigError(f"the model does not match the log's ({diff})",
                          reason=Reason.STATE_MISMATCH, path=path)


# ---------------------------------------------------------------------- drivers


def restore_pieces(src: Source, rank: int, world: int, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer, *, scheduler: Any, scaler: Any,
                   step: int | None, verify: bool, progress: ProgressFn | None = None
                   ) -> tuple[RestoreResult, int, dict[torch.Tensor, torch.Tensor] | None]:
    """Put the state at ``step`` into this rank's objects (plain, DDP or FSDP2), replaying
    only the shards whose pieces this rank's boxes need. Returns the result, the job's
    durable step and the compressor's residuals by parameter (see :func:`residuals_of`).
    Not collective: the caller agrees on errors."""
    from ..replay.restore import objects_for

    src.check_elementwise()
    objs = objects_for(model, optimizer, scheduler, scaler)
    check_global_model(src, objs.model, src.root)
    if objs.names != src.params:
        raise ConfigError("the optimizer's parameters (order or names) differ from the log's",
                          reason=Reason.STATE_MISMATCH, path=src.root)
    if L.class_name(optimizer) != src.optimizer:
        raise ConfigError(f"the log was written with {src.optimizer}, the optimizer is "
                          f"{L.class_name(optimizer)}", reason=Reason.STATE_MISMATCH,
                          path=src.root)
    if [len(g["params"]) for g in optimizer.param_groups] != src.groups:
        raise ConfigError("the optimizer's param groups differ from the log's",
                          reason=Reason.STATE_MISMATCH, path=src.root)
    boxes = {n: box_of(t) for n, t in objs.model.items() if n in src.pieces}
    target, bases, job = src.plan(step)
    need = needed_shards(src, boxes)
    if world == src.world:
        home = rank
    else:
        home = rank % src.world if rank % src.world in need else min(need)
    need.add(home)
    dest = {n: (box, local_of(objs.model[n]).detach()) for n, box in boxes.items()}
    rep = replay_shards(src, sorted(need), home, target, bases, verify=verify,
                        scheduler=scheduler, scaler=scaler, dest=dest, boxes=boxes,
                        progress=progress)
    with torch.no_grad():
        for n, box in boxes.items():
            dst = local_of(objs.model[n])
            if dst.device.type == "cpu" and dst.dtype == DTYPE_OF[src.model[n][0]]:
                assemble_value(src, rep, n, box, out=dst)   # straight into the parameter
            else:
                copy_into(objs.model[n], assemble_value(src, rep, n, box))
    for n in src.buffers:
        if n in rep.home_model and n in objs.model:
            copy_into(objs.model[n], rep.home_model[n])
    optimizer.state.clear()
    for n, p in zip(objs.names, objs.params, strict=True):
        st = assemble_state(src, rep, n, boxes[n])
        if st:
            put_state(optimizer, p, st)
    L.set_hyper(optimizer, rep.hyper)
    for p in objs.params:
        p.grad = None
    res = rep.result
    assert res is not None
    if home != rank or world != src.world or \
            has_dtensor(objs.params) != (src.layout == "fsdp"):
        res.notes.append(f"resharded: the checkpoint was written by {src.world} rank(s) "
                         f"(layout {src.layout!r}), this job has {world}; this rank's "
                         f"parameters and optimizer state come from shard(s) "
                         f"{sorted(need)}, its RNG states, buffers, scheduler and extra "
                         f"state from shard {home}")
    res.notes += rep.shard_notes
    if rep.shard_notes:
        res.exact = False
    residuals = residuals_of(src, rep, objs.names, objs.params, boxes, res)
    if verify and rep.partial and res.replayed:
        res.notes.append(f"shard(s) {rep.partial} were replayed for the parameters this "
                         f"rank needs only: their records' CRCs were checked, their step "
                         f"digests (over every parameter of a shard) were not")
    if rep.hooked:
        res.exact = False
        res.notes.append(
            "the checkpoint holds DDP communication-hook state (PowerSGD's error-feedback "
            "memory and warm-start Q, the top-k hook's residuals): it is each rank's own, "
            "the error of compressing that rank's local gradient before the all-reduce, "
            "and has no counterpart on another partition of ranks, so it is not carried "
            "across a resharding: a hook registered now starts from zero. Weights and "
            "optimizer state are exact")
    return res, job, residuals


#: compressors whose residuals are each rank's own in a multi-rank job (DeMo's momenta
#: accumulate the rank's local gradient before the exchange)
RANK_LOCAL_COMPRESSORS: tuple[str, ...] = ("demo",)


def residuals_of(src: Source, rep: Replayed, names: Sequence[str],
                 params: Sequence[torch.Tensor], boxes: Mapping[str, Box],
                 res: RestoreResult) -> dict[torch.Tensor, torch.Tensor] | None:
    """The compressor's error-feedback residuals (DeMo's momenta) of this rank's
    parameters, assembled from the pieces like optimizer state. They are per parameter and
    shaped like it; a compressor runs at the optimizer's pre-step hook on the gradient
    every rank holds after the all-reduce, so they are the same on every rank and the
    owner's copy is everyone's: carried bitwise to any partition of whole parameters.
    Not carried (``res.exact`` False, with a note): into FSDP2 parameters (an FSDP2 job
    takes no compressor), and the momenta of a DeMo log written by several ranks (each
    rank's own)."""
    if not rep.residuals:
        return None
    comp = src.metas[0].compressor
    kind = comp.kind if comp is not None else None
    why = None
    if has_dtensor(params):
        why = "an FSDP2 job takes no compressor"
    elif kind in RANK_LOCAL_COMPRESSORS and src.world > 1:
        why = (f"the {kind} compressor's momenta are each rank's own (they accumulate the "
               f"rank's local gradient before the exchange) and the log holds one rank's "
               f"copy per parameter")
    if why is not None:
        res.exact = False
        res.notes.append(f"the checkpoint holds {kind} compressor residuals, not carried "
                         f"across this resharding: {why}. Weights and optimizer state are "
                         f"exact")
        return None
    out: dict[torch.Tensor, torch.Tensor] = {}
    for n, p in zip(names, params, strict=True):
        have = [q for q in src.pieces[n] if (q.shard, n) in rep.residuals]
        if not have:
            continue
        first = rep.residuals[(have[0].shard, n)]

        def piece(s: int, n: str = n) -> torch.Tensor:
            return rep.residuals[(s, n)]

        out[p] = _cut(src, rep, n, boxes[n], piece, first.dtype).to(local_of(p).device)
    return out


def replay_pieces(src: Source, step: int | None, *, factory: Any = None,
                  progress: ProgressFn | None = None, verify: bool = True
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every shard replayed on its own and its pieces assembled: (global model tensors by
    canonical name, buffers as shard 0 holds them; the full optimizer state dict)."""
    target, bases, _job = src.plan(step)
    rep = replay_shards(src, range(src.world), 0, target, bases, verify=verify,
                        apply_rng=False, factory=factory, progress=progress)
    model: dict[str, torch.Tensor] = {}
    for n, (tag, shape) in src.model.items():
        if n in src.pieces:
            model[n] = assemble_value(src, rep, n, ((0,) * len(shape), shape))
        else:
            model[n] = rep.home_model[n] if n in rep.home_model else \
                torch.zeros(shape, dtype=DTYPE_OF[tag])
    return model, state_dict_of(src, rep, src.params)


__all__ = ["Piece", "Replayed", "ShardFacts", "Source", "assemble_state", "assemble_value",
           "box_of",
           "check_global_model", "copy_into", "needed_shards", "put_state", "replay_pieces",
           "replay_shards", "residuals_of", "restore_pieces", "shard_facts", "state_dict_of",
           "RANK_LOCAL_COMPRESSORS"]
