"""Reading a sharded checkpoint: every rank's log under one directory, seen as one.

A sharded checkpoint (``PATH/SHARDS`` plus ``PATH/rank-NNNNN/``, see the spec, "Sharded
checkpoints") is read through a :class:`ShardSet`: one :class:`LogReader` per shard and the
job-level facts derived from them (the job's durable step is the minimum over the shards).

:class:`MergedReader` is the same reading interface as :class:`LogReader` (``chain``,
``base_for``, ``base``, ``record``) over the shards of one job step, from one rank's point of
view: a tensor name is taken from that rank's shard when it has it (RNG states, buffers),
else from the shard that logged it. Replay code takes either reader and never asks how many
shards there are; a single log is the one-shard case.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, Reason, StepNotFoundError
from ..format.checksum import crc32c
from ..format.record import TensorEntry
from ..storage import ReadMode
from .manifest import manifest_moved
from .reader import BasePlan, LogReader, Record
from .reference import AnyBase
from .shards import check_shards_exist, copied_logs, read_shards_manifest, shard_path
from .streamed import StreamedBase

#: shard layouts: DDP with a replicated optimizer, ZeroRedundancyOptimizer partitions, or
#: FSDP2 (each rank logs the pieces of the DTensor parameters it holds)
LAYOUTS = ("replicated", "zero", "fsdp")


def combine_digests(digests: Iterable[int]) -> int:
    """The digest of a job step: CRC32C over the shards' digests in rank order."""
    return crc32c(b"".join(struct.pack("<I", d & 0xFFFFFFFF) for d in digests))


def check_chain(reader: LogReader, base: int, target: int) -> None:
    """Every diff replay of ``target`` from the restore point ``base`` needs is present in
    ``reader``'s log: those in ``(base, target]``, or from a streamed base complete at
    ``base``, those after its first slice's step."""
    if any(c == base for c, _s in reader.streamed) and base not in reader.bases:
        base = reader.start_for(base).first
    steps = reader.steps
    lo = int(np.searchsorted(steps, base, side="right"))
    hi = int(np.searchsorted(steps, target, side="right"))
    if hi - lo != target - base:  # steps are unique and sorted: a count settles it
        have = set(int(s) for s in steps[lo:hi])
        missing = next(t for t in range(base + 1, target + 1) if t not in have)
        raise StepNotFoundError(f"cannot reach step {target} from base {base}: diff for step "
                                f"{missing} is missing", path=reader.path)


@dataclass(frozen=True)
class JobPlan:
    """Where a restore of a sharded checkpoint starts and ends."""

    #: the step to reconstruct
    target: int
    #: per shard, the base replay starts from (the same on every shard when replicated)
    bases: list[int]
    #: the newest step durable on every shard
    job_durable: int


def restore_points(bases: Sequence[int], streamed: Sequence[Sequence[Any]] = ()
                   ) -> dict[int, tuple[int, ...]]:
    """A log's restore points from its manifest's ``bases`` and ``streamed`` lists: each
    step a restore may start from, with the steps of the slices it is read from (a
    consistent base's: its own step alone; preferred where a streamed base completes at
    the same step, as :meth:`LogReader.start_for` does)."""
    out = {int(c): tuple(int(s) for s in steps) for c, steps in streamed}
    out.update((int(b), (int(b),)) for b in bases)
    return out


def plan_job(durable: Sequence[int | None], bases: Sequence[Sequence[int]], step: int | None,
             layout: str, root: str, streamed: Sequence[Sequence[Sequence[Any]]] | None = None
             ) -> JobPlan:
    """The plan for reconstructing ``step`` (default: the job's durable step) from each
    shard's durable step, live bases and complete streamed bases (``streamed[r]``: shard
    r's manifest ``streamed`` list). ``JobPlan.bases`` are restore points: a consistent
    base's step or a streamed base's complete step. Replicated shards are merged into one
    replay, which starts from one point: a step every shard can start from *with the same
    slices* (a streamed base on every shard taken at the same steps, or a consistent base
    on every shard)."""
    for r, d in enumerate(durable):
        if d is None:
            raise StepNotFoundError(f"rank {r}'s shard has no base yet: nothing to restore",
                                    reason=Reason.NO_BASE, path=shard_path(root, r))
    job = min(int(d) for d in durable if d is not None)
    if step is None:
        target = job
    else:
        if type(step) is not int or step < 0:
            raise ConfigError(f"step={step!r} must be a non-negative int")
        if step > job:
            raise StepNotFoundError(f"step {step} is not durable on every rank (the newest "
                                    f"step durable on all {len(durable)} ranks is {job})",
                                    path=root)
        target = step
    points = [restore_points(b, streamed[r] if streamed is not None else ())
              for r, b in enumerate(bases)]
    if layout == "replicated":
        common = [c for c, sl in points[0].items()
                  if all(p.get(c) == sl for p in points[1:])]
        cands = [b for b in common if b <= target]
        if not cands:
            raise StepNotFoundError(f"no base at or before step {target} is on every rank",
                                    reason=Reason.NO_BASE, path=root)
        return JobPlan(target, [max(cands)] * len(durable), job)
    per_shard = []
    for r, bs in enumerate(points):
        cands = [b for b in bs if b <= target]
        if not cands:
            raise StepNotFoundError(f"rank {r}'s shard has no base at or before step "
                                    f"{target}", reason=Reason.NO_BASE,
                                    path=shard_path(root, r))
        per_shard.append(max(cands))
    return JobPlan(target, per_shard, job)


class ShardSet:
    """The shards of a sharded checkpoint, opened for reading (close it, or use ``with``);
    ``mode``: the readers' (see :class:`LogReader`)."""

    def __init__(self, root: str | os.PathLike[str], *, mode: ReadMode = "mmap") -> None:
        self.root = os.fspath(root)
        body = read_shards_manifest(self.root)
        self.world: int = body["world_size"]
        self.layout: str = body.get("layout", "replicated")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown shard layout {self.layout!r}",
                              reason=Reason.BAD_METADATA, path=self.root)
        check_shards_exist(self.root, self.world)
        self.readers: list[LogReader] = []
        try:
            for r in range(self.world):
                self.readers.append(LogReader(shard_path(self.root, r), mode=mode))
            copies = copied_logs([r.path for r in self.readers],
                                 [r.manifest.log_id for r in self.readers])
            if copies:
                raise copies[0]
        except BaseException:
            self.close()
            raise

    @property
    def durable_step(self) -> int | None:
        """The newest step durable on every shard (None while some shard has no base)."""
        ds = [r.durable_step for r in self.readers]
        return None if any(d is None for d in ds) else min(d for d in ds if d is not None)

    def plan(self, step: int | None) -> JobPlan:
        """See :func:`plan_job`."""
        return plan_job([r.durable_step for r in self.readers],
                        [list(r.bases) for r in self.readers], step, self.layout, self.root,
                        [r.streamed for r in self.readers])

    def moved(self) -> bool:
        """A compaction published a newer manifest of some shard since its reader opened
        (see :func:`~lowdiff_store.log.reader.on_newest_manifest`)."""
        return any(manifest_moved(r.store, r.manifest.generation) for r in self.readers)

    def merged(self, own: int, base: int, opener: StreamedOpener | None = None
               ) -> MergedReader:
        """The replicated shards as one log from rank ``own``'s point of view, replaying
        from the restore point ``base`` (common to every shard, see :func:`plan_job`);
        ``opener``: see :class:`MergedReader`."""
        return MergedReader(self, own, base, opener)

    def close(self) -> None:
        """Close every shard's reader."""
        for r in self.readers:
            r.close()

    def __enter__(self) -> ShardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _precedence(n: int, own: int) -> list[int]:
    return [own] + [i for i in range(n) if i != own]


class MergedBase:
    """The bases of one step of every shard, seen as one :class:`BaseFile`-like object.
    The metadata is ``own``'s, with the optimizer layout (``torch.opt``) merged over every
    shard (each holds the optimizer state of the parameters it owns)."""

    def __init__(self, files: Sequence[AnyBase | StreamedBase], own: int) -> None:
        self._files = list(files)
        self._own = own
        self.path = files[own].path
        #: the step replay starts after (``own``'s base step, or its first slice's)
        self.step = int(files[own].step)
        self._where: dict[str, AnyBase | StreamedBase] = {}
        for i in _precedence(len(files), own):
            for n in files[i].names:
                self._where.setdefault(n, files[i])

    @property
    def names(self) -> list[str]:
        """Every tensor name of the merged base."""
        return list(self._where)

    def step_of(self, name: str) -> int:
        """The step after which the shard holding ``name`` took it (a streamed base's slice
        step, else the base's step)."""
        f = self._where[name]
        return f.step_of(name) if isinstance(f, StreamedBase) else int(f.step)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype tag, shape) of a tensor."""
        return self._where[name].info(name)

    def tensor(self, name: str) -> np.ndarray:
        """A tensor, read from the shard that holds it."""
        return self._where[name].tensor(name)

    def read_into(self, name: str, out: np.ndarray) -> None:
        """A tensor's bytes copied into ``out`` from the shard that holds it (see
        :meth:`BaseFile.read_into`)."""
        self._where[name].read_into(name, out)

    def meta(self) -> dict[str, Any]:
        """``own``'s base metadata with the optimizer layouts of every shard merged."""
        m = self._files[self._own].meta()
        t = m.get("torch")
        if isinstance(t, dict):
            opt: dict[str, Any] = {"tensors": {}, "values": {}}
            for f in self._files:   # (a streamed base: each slice lays out its own)
                metas = f.metas() if isinstance(f, StreamedBase) else [f.meta()]
                for fm in metas:
                    o = (fm.get("torch") or {}).get("opt") or {}
                    opt["tensors"].update(o.get("tensors") or {})
                    opt["values"].update(o.get("values") or {})
            t["opt"] = opt
        return m

    def close(self) -> None:
        """Close every shard's base file."""
        for f in self._files:
            f.close()

    def __enter__(self) -> MergedBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MergedRecord:
    """The records of one step of every shard, seen as one :class:`Record`-like object:
    the side channel is ``own``'s; the digest is :func:`combine_digests` of the shards'
    digests (present only when every shard recorded one)."""

    def __init__(self, recs: list[Record], own: int) -> None:
        r0 = recs[own]
        self.step, self.path, self.offset = r0.step, r0.path, r0.offset
        self.side = r0.side
        digests = [r.meta.get("digest") for r in recs]
        self.meta: dict[str, Any] = (
            {"digest": combine_digests(d for d in digests if isinstance(d, int))}
            if all(isinstance(d, int) for d in digests) else {})
        self._where: dict[str, Record] = {}
        for i in _precedence(len(recs), own):
            for n in recs[i].names:
                self._where.setdefault(n, recs[i])

    @property
    def names(self) -> list[str]:
        """Every tensor name of the merged record."""
        return list(self._where)

    def _rec(self, name: str) -> Record:
        rec = self._where.get(name)
        # the owning record raises the usual "no tensor" error for unknown names
        return rec if rec is not None else next(iter(self._where.values()))

    def entry(self, name: str) -> TensorEntry:
        """The entry of one tensor, from the shard that logged it."""
        return self._rec(name).entry(name)

    def tensor(self, name: str, *, ref: np.ndarray | None = None) -> np.ndarray:
        """Decode one tensor (see :meth:`Record.tensor`)."""
        return self._rec(name).tensor(name, ref=ref)

    def parts(self, name: str) -> list[np.ndarray]:
        """The stored parts of one tensor (see :meth:`Record.parts`)."""
        return self._rec(name).parts(name)


#: opens one shard's streamed base: (shard index, its reader, its plan) -> a base-like
#: object with ``step_of`` (:class:`~lowdiff_store.log.streamed.StreamedBase`, or a layer
#: above's checked version of it)
StreamedOpener = Callable[[int, LogReader, BasePlan], Any]


class MergedReader:
    """Every shard of a replicated checkpoint as one log, from ``own``'s point of view,
    replaying from the restore point ``base`` (the same on every shard: a consistent base,
    or a streamed base taken at the same steps everywhere, see :func:`plan_job`). Same
    reading interface as :class:`LogReader`: ``chain_from``, ``chain``, ``base_for``,
    ``base``, ``record``; :meth:`open_start` opens the merged base of a plan.
    ``opener``: how a shard's streamed base is opened (default: unchecked
    :class:`~lowdiff_store.log.streamed.StreamedBase`)."""

    def __init__(self, shards: ShardSet, own: int, base: int,
                 opener: StreamedOpener | None = None) -> None:
        self.shards = shards
        self.own = own
        self._base = base
        self._opener = opener
        self.path = shards.root

    def _plans(self) -> list[BasePlan]:
        plans = [r.start_for(self._base) for r in self.shards.readers]
        for r, p in enumerate(plans):
            if p.complete != self._base or p.slices != plans[0].slices:
                raise StepNotFoundError(
                    f"rank {r}'s shard cannot start from step {self._base} as the others "
                    f"do (its restore point there: {p.complete}, slices {list(p.slices)}; "
                    f"the others': {list(plans[0].slices)})", reason=Reason.NO_BASE,
                    path=shard_path(self.shards.root, r))
        return plans

    def chain_from(self, step: int) -> tuple[BasePlan, list[int]]:
        """(where replay starts, diffs to replay): every shard must hold every diff after
        the start's first slice."""
        plan = self._plans()[0]
        for r in self.shards.readers:
            check_chain(r, self._base, step)
        return plan, list(range(plan.first + 1, step + 1))

    def chain(self, step: int) -> tuple[int, list[int]]:
        """(base, diffs to replay) for a consistent start (see :meth:`chain_from`)."""
        plan, diffs = self.chain_from(step)
        return plan.first, diffs

    def base_for(self, step: int) -> int:
        """The restore point replay starts from."""
        return self._base

    def open_start(self, plan: BasePlan) -> MergedBase:
        """The merged base of ``plan`` (from :meth:`chain_from`): each shard's base, or its
        streamed base's slices."""
        if not plan.streamed:
            return self.base(plan.first)
        files: list[AnyBase | StreamedBase] = []
        try:
            for s, (r, p) in enumerate(zip(self.shards.readers, self._plans(), strict=True)):
                files.append(self._opener(s, r, p) if self._opener is not None
                             else StreamedBase(r, p))
        except BaseException:
            for f in files:
                f.close()
            raise
        return MergedBase(files, self.own)

    def base(self, step: int) -> MergedBase:
        """Every shard's base at ``step``, merged."""
        files: list[AnyBase] = []
        try:
            for r in self.shards.readers:
                files.append(r.base(step))  # noqa: PERF401 (closed on error)
        except BaseException:
            for f in files:
                f.close()
            raise
        return MergedBase(files, self.own)

    def record(self, step: int) -> MergedRecord:
        """Every shard's record of ``step``, merged."""
        return MergedRecord([r.record(step) for r in self.shards.readers], self.own)


__all__ = ["LAYOUTS", "JobPlan", "MergedBase", "MergedReader", "MergedRecord", "ShardSet",
           "StreamedOpener", "check_chain", "combine_digests", "plan_job", "restore_points"]
