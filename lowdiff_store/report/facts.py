"""What the report shows, read from a log through the log layer (torch-free).

:func:`collect` turns a log directory (or a sharded checkpoint's root) into a
:class:`Report`: one :class:`LogFacts` per log (per rank of a sharded checkpoint), each
with its per-step record sizes (from the index: record headers' places and lengths, never
payloads), its bases (file sizes, tensor sizes from the base header), the metadata of a
bounded number of records (tuner decisions, synchronization events, digests, bytes by
tensor and by codec), the measured costs the checkpointer recorded, and its health.

Bounded cost, whatever the length of the log (a 1,000,000-record log reads in under a
second, ``bench/bench_report.py``): the per-step series come from the index arrays in
numpy; record metadata is read for every record up to :data:`META_READ_ALL` records and
for an evenly spaced sample of :data:`META_SAMPLE` records beyond; the full byte-by-byte
check (:func:`lowdiff_store.verify.verify_log`) runs up to :data:`FULL_CHECK_RECORDS`
records and :data:`FULL_CHECK_BYTES` bytes (``verify`` decides otherwise). The page says
which of these applied.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..errors import LowdiffError, Reason
from ..format.constants import BASE_NAME, INDEX_NAME, MANIFEST_NAME, SLICE_NAME
from ..format.dtypes import STORAGE_DTYPE
from ..log.base import BaseFile
from ..log.reader import LogReader
from ..log.shards import is_sharded, log_paths, read_shards_manifest
from ..progress import ProgressFn
from ..torchmeta import LogMeta, RecordedDecision, parse, record_decision
from ..verify import verify_log

#: Logs of at most this many records have every record's metadata read.
META_READ_ALL = 20_000
#: Records whose metadata is read in a longer log (evenly spaced, the newest included).
META_SAMPLE = 2_000
#: The full check (every byte, as ``verify``) runs up to this many records ...
FULL_CHECK_RECORDS = 20_000
#: ... and this many bytes on disk (all ranks together).
FULL_CHECK_BYTES = 512 << 20

#: Tensor-name prefix of a local-update synchronization event (torch layer's schema).
SYNC_PREFIX = "@sync/"

FullCheck = Literal["auto", "always", "never"]


@dataclass
class BaseFacts:
    """One base: its step, file size, and tensor bytes (name -> bytes) if it opened. A
    streamed base (spec section 7.2): ``step`` is the step it is complete at, ``slices``
    the steps its slices were taken after (empty for a consistent base), ``bytes`` and
    ``tensors`` those of every slice."""

    step: int
    bytes: int
    tensors: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    slices: tuple[int, ...] = ()

    @property
    def first(self) -> int:
        """The step a restore from this base replays from (a streamed base's first
        slice's)."""
        return self.slices[0] if self.slices else self.step


@dataclass
class LogFacts:
    """Everything the page shows about one log (a rank's log of a sharded checkpoint)."""

    path: str
    rank: int | None = None
    opened: bool = False
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: where each record is: its segment's id and its offset (problems name these)
    segment_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    segment_paths: dict[str, int] = field(default_factory=dict)
    #: the bases by step, streamed ones (``slices``) among them
    bases: list[BaseFacts] = field(default_factory=list)
    first_step: int | None = None
    last_step: int | None = None
    durable_step: int | None = None
    segments: int = 0
    segment_bytes: int = 0
    index_bytes: int = 0
    manifest_generation: int = 0
    torn_tail_bytes: int = 0
    problems: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    torch: LogMeta | None = None
    measurements: dict[str, float] = field(default_factory=dict)
    decisions: list[RecordedDecision] = field(default_factory=list)
    syncs: list[int] = field(default_factory=list)
    digests: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    by_tensor: dict[str, int] = field(default_factory=dict)
    by_codec: dict[str, int] = field(default_factory=dict)
    tensor_codec: dict[str, str] = field(default_factory=dict)
    meta_read: int = 0
    meta_asked: int = 0

    @property
    def records(self) -> int:
        """Number of valid diff records."""
        return len(self.steps)

    @property
    def damaged_steps(self) -> list[int]:
        """Steps whose record a problem names (file and offset): a restore through them
        fails, so the recovery curve leaves them out."""
        named = {(sid, p["offset"]) for p in self.problems
                 if (sid := self.segment_paths.get(str(p.get("path")))) is not None
                 and isinstance(p.get("offset"), int)}
        if not named:
            return []
        # records at an offset some problem names, then their (segment, offset) looked up:
        # linear in the records and the problems (not one scan of the records per problem)
        hit = np.flatnonzero(np.isin(self.offsets, [off for _s, off in named]))
        return sorted({int(self.steps[i]) for i in hit
                       if (int(self.segment_ids[i]), int(self.offsets[i])) in named})

    @property
    def record_bytes(self) -> int:
        """Bytes of the valid diff records."""
        return int(self.lengths.sum())

    @property
    def base_bytes(self) -> int:
        """Bytes of the live consistent bases."""
        return sum(b.bytes for b in self.bases if not b.slices)

    @property
    def slice_bytes(self) -> int:
        """Bytes of the slices of the live streamed bases."""
        return sum(b.bytes for b in self.bases if b.slices)

    @property
    def base_slices(self) -> dict[str, Any] | None:
        """What ``base_slices=k`` did (``{"k", "in_force", "why"}``), or None."""
        bs = self.torch.base_slices if self.torch is not None else None
        return bs.as_dict() if bs is not None else None

    @property
    def bytes_on_disk(self) -> int:
        """Segments, bases, slices and indexes (the manifest's few bytes aside)."""
        return self.segment_bytes + self.base_bytes + self.slice_bytes + self.index_bytes

    @property
    def meta_sampled(self) -> bool:
        """Record metadata was read from a sample, not from every record (a record that
        failed to read is a problem, not a sample)."""
        return self.meta_asked < self.records

    @property
    def health(self) -> str:
        """``"ok"``, ``"unreadable"`` (the log did not open) or ``"corrupt"``."""
        if not self.opened:
            return "unreadable"
        return "corrupt" if self.problems else "ok"


@dataclass
class Report:
    """A log or a sharded checkpoint, ready to render (:mod:`.html`)."""

    path: str
    sharded: bool = False
    world_size: int | None = None
    layout: str | None = None
    logs: list[LogFacts] = field(default_factory=list)
    problems: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    full_check: bool = False
    error: dict[str, Any] | None = None

    @property
    def health(self) -> str:
        """``"ok"``, ``"corrupt"`` or ``"unreadable"`` (the path is no log)."""
        if self.error is not None or any(f.health == "unreadable" for f in self.logs):
            return "unreadable"
        if self.problems or any(f.problems for f in self.logs):
            return "corrupt"
        return "ok"

    def all_problems(self) -> list[dict[str, Any]]:
        """Every problem found, the checkpoint's own first."""
        out: list[dict[str, Any]] = []
        _merge(out, self.problems)
        for f in self.logs:
            _merge(out, f.problems)
        return out

    @property
    def durable_step(self) -> int | None:
        """The newest step restorable (for a sharded checkpoint: on every rank)."""
        durable = [f.durable_step for f in self.logs]
        if not durable or None in durable:
            return None
        return min(d for d in durable if d is not None)

    def summary(self) -> dict[str, Any]:
        """The page's numbers as plain JSON types (``lowdiff-store report --json``)."""
        return {
            "path": self.path, "health": self.health, "sharded": self.sharded,
            "world_size": self.world_size, "layout": self.layout,
            "durable_step": self.durable_step, "full_check": self.full_check,
            "records": sum(f.records for f in self.logs),
            "bytes_on_disk": sum(f.bytes_on_disk for f in self.logs),
            "problems": self.all_problems(), "error": self.error,
            "logs": [{
                "path": f.path, "rank": f.rank, "health": f.health, "records": f.records,
                "bases": [b.step for b in f.bases if not b.slices],
                "streamed": [{"complete": b.step, "slices": list(b.slices), "bytes": b.bytes}
                             for b in f.bases if b.slices],
                "base_slices": f.base_slices, "first_step": f.first_step,
                "last_step": f.last_step, "durable_step": f.durable_step,
                "record_bytes": f.record_bytes, "base_bytes": f.base_bytes,
                "slice_bytes": f.slice_bytes,
                "bytes_on_disk": f.bytes_on_disk, "torn_tail_bytes": f.torn_tail_bytes,
                "bytes_per_step": f.record_bytes / f.records if f.records else 0.0,
                "decisions": len(f.decisions), "syncs": len(f.syncs),
                "by_codec": f.by_codec, "meta_read": f.meta_read,
            } for f in self.logs],
        }


def collect(path: str | os.PathLike[str], *, full_check: FullCheck = "auto",
            progress: ProgressFn | None = None) -> Report:
    """Read what the page shows from the log (or sharded checkpoint) at ``path``. Never
    raises for bad data: what could not be read becomes the report's ``error`` or a
    problem of the log it concerns (file, offset, reason)."""
    p = os.fspath(path)
    rep = Report(p)
    try:
        paths = _paths(rep)
    except LowdiffError as e:
        rep.error = e.to_dict()
        return rep
    for i, log_dir in enumerate(paths):
        rep.logs.append(_collect_one(log_dir, i if rep.sharded else None))
        if progress:  # logs read; the full check then counts bytes (always more)
            progress(i + 1, len(paths))
    if not rep.sharded and not rep.logs[0].opened:
        # one log that does not open (no manifest, a damaged or newer one) is no log to
        # show: the page says why, as ``verify`` does with exit 1
        rep.error, rep.logs = rep.logs[0].problems[0], []
        return rep
    rep.full_check = _full_check_wanted(rep, full_check)
    if rep.full_check:
        _full_check(rep, progress)
    return rep


def _paths(rep: Report) -> list[str]:
    """The logs of ``rep.path`` (itself, or each rank's); fills the sharded fields."""
    if is_sharded(rep.path):
        body = read_shards_manifest(rep.path)
        rep.sharded = True
        rep.world_size = int(body["world_size"])
        rep.layout = str(body.get("layout", "replicated"))
        return log_paths(rep.path)
    if not os.path.isdir(rep.path) and "://" not in rep.path:
        what = "does not exist" if not os.path.exists(rep.path) else "is not a directory"
        raise LowdiffError(f"{what}: not a lowdiff-store log", path=rep.path,
                           reason=Reason.NOT_A_LOG)
    return [rep.path]


def _full_check_wanted(rep: Report, mode: FullCheck) -> bool:
    if mode != "auto":
        return mode == "always"
    return (sum(f.records for f in rep.logs) <= FULL_CHECK_RECORDS
            and sum(f.bytes_on_disk for f in rep.logs) <= FULL_CHECK_BYTES)


def _full_check(rep: Report, progress: ProgressFn | None) -> None:
    """``verify``'s findings: each problem goes to the log whose files it names (to the
    checkpoint's own list when it names none of them)."""
    vrep = verify_log(rep.path, progress=_Cumulative(progress) if progress else None)
    by_dir = {os.path.abspath(f.path): f for f in rep.logs}
    found: dict[str | None, list[dict[str, Any]]] = {}  # owner's directory -> its problems
    for err in vrep.problems:
        d = err.to_dict()
        found.setdefault(_owner(d.get("path"), by_dir), []).append(d)
    for owner, new in found.items():
        _merge(rep.problems if owner is None else by_dir[owner].problems, new)
    rep.notes += [n for n in vrep.notes if n not in rep.notes]
    for f in rep.logs:
        f.problems.sort(key=lambda q: (str(q.get("path")), q.get("offset") or 0))


class _Cumulative:
    """A :data:`ProgressFn` over a sharded ``verify_log``, which counts each shard's bytes
    from 0: a count that goes back starts the next shard, added to the ones done."""

    def __init__(self, progress: ProgressFn) -> None:
        self.progress = progress
        self.before = 0
        self.last = (0, 0)

    def __call__(self, done: int, total: int) -> None:
        if done < self.last[0]:
            self.before += self.last[1]
        self.last = (done, total)
        self.progress(self.before + done, self.before + total)


def _owner(path: Any, by_dir: Mapping[str, LogFacts]) -> str | None:
    """The directory (a key of ``by_dir``) of the log that holds ``path``, looked up
    directory by directory up from it: as many lookups as the path has parts, whatever
    the number of ranks."""
    if not isinstance(path, str):
        return None
    p = os.path.abspath(path)
    while True:
        if p in by_dir:
            return p
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def _key(p: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """What makes two problems one: the same file, offset and reason (``verify`` and the
    report's own reads may word the detail differently)."""
    return (p.get("path"), p.get("offset"), p.get("reason"))


def _merge(target: list[dict[str, Any]], new: Iterable[dict[str, Any]]) -> None:
    """Append to ``target`` each of ``new`` it does not hold yet (:func:`_key`), in order.
    One set of keys per call: linear in both lists, where comparing each new problem
    with every one held made a log of thousands of problems quadratic (issue 42)."""
    seen = {_key(q) for q in target}
    for d in new:
        k = _key(d)
        if k not in seen:
            seen.add(k)
            target.append(d)


def _collect_one(path: str, rank: int | None) -> LogFacts:
    f = LogFacts(path, rank)
    try:
        reader = LogReader(path, strict=False, verify=True)
    except LowdiffError as e:
        f.problems.append(e.to_dict())
        return f
    with reader:
        f.opened = True
        _from_reader(f, reader)
        _read_bases(f, reader)
        _read_records(f, reader)
    return f


def _from_reader(f: LogFacts, r: LogReader) -> None:
    """The cheap part: index arrays, files, manifest metadata and the open's findings."""
    table = r.record_table()
    f.steps = table[:, 0].copy()
    f.lengths = table[:, 3].copy()
    f.segment_ids = table[:, 1].copy()
    f.offsets = table[:, 2].copy()
    f.segment_paths = {p: i for i, p, _s in r.segment_files()}
    f.first_step, f.last_step, f.durable_step = r.first_step, r.last_step, r.durable_step
    segs = r.segment_files()
    f.segments = len(segs)
    f.segment_bytes = sum(size for _i, _p, size in segs)
    f.index_bytes = sum(_size(r, INDEX_NAME.format(i)) for i, _p, _s in segs)
    f.manifest_generation = r.manifest.generation
    f.torn_tail_bytes = r.report.torn_tail_bytes
    f.problems += [p.to_dict() for p in r.report.problems]
    f.meta = dict(r.meta)
    meas = f.meta.get("measurements")
    if isinstance(meas, dict):
        f.measurements = {str(k): float(v) for k, v in meas.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "torch" in f.meta:  # the torch layer's metadata, parsed once (torch-free)
        try:
            f.torch = parse(f.meta["torch"], r.store.path_of(MANIFEST_NAME))
        except LowdiffError as e:
            f.problems.append(e.to_dict())
    if r.report.index_rebuilt:
        f.notes.append(f"index of segment(s) {r.report.index_rebuilt} unusable: scanned "
                       "instead (rebuilt by the next writer open)")


def _size(r: LogReader, name: str) -> int:
    try:
        return r.store.size(name)
    except LowdiffError:
        return 0


def _read_bases(f: LogFacts, r: LogReader) -> None:
    """Each live base's size and its tensors' sizes (the header only, no tensor data); a
    streamed base's from each of its slices."""
    found: list[dict[str, Any]] = []
    plans: list[tuple[int, tuple[int, ...], list[tuple[str, Callable[[int], BaseFile], int]]]]
    plans = [(b, (), [(BASE_NAME.format(b), r.base_file, b)]) for b in r.bases]
    plans += [(c, sl, [(SLICE_NAME.format(s), r.slice_file, s) for s in sl])
              for c, sl in r.streamed]
    # by step; on a tie the consistent base last: the one a restore uses (it replays less)
    for step, slices, files in sorted(plans, key=lambda p: (p[0], -len(p[1]))):
        bf = BaseFacts(step, sum(_size(r, name) for name, _o, _s in files), slices=slices)
        f.bases.append(bf)
        try:
            for _name, open_file, at in files:
                with open_file(at) as base:
                    for name in base.names:
                        tag, shape = base.info(name)
                        bf.tensors[name] = int(np.prod(shape, dtype=np.int64)) * \
                            STORAGE_DTYPE[tag].itemsize
        except LowdiffError as e:
            bf.error = str(e)
            found.append(e.to_dict())
    _merge(f.problems, found)


def _sample(steps: np.ndarray) -> np.ndarray:
    """The steps whose record metadata is read: all, or an even sample with the newest."""
    if len(steps) <= META_READ_ALL:
        return steps
    idx = np.unique(np.linspace(0, len(steps) - 1, META_SAMPLE).astype(np.int64))
    return steps[idx]


def _read_records(f: LogFacts, r: LogReader) -> None:
    """Record metadata of :func:`_sample`'s steps: kinds, digests, tuner decisions,
    synchronization events, bytes by tensor and by codec (each part's stored length)."""
    sample = _sample(f.steps)
    f.meta_asked = len(sample)
    found: list[dict[str, Any]] = []
    for s in sample:
        step = int(s)
        try:
            rec = r.record(step)
        except LowdiffError as e:
            found.append(e.to_dict())
            continue
        f.meta_read += 1
        f.kinds[rec.kind] = f.kinds.get(rec.kind, 0) + 1
        if "digest" in rec.meta:
            f.digests += 1
        try:  # parsed as verify parses it: the same problem, never an error of the page
            decision = record_decision(rec.meta, path=rec.path, offset=rec.offset, step=step)
        except LowdiffError as e:
            found.append(e.to_dict())
        else:
            if decision is not None:
                f.decisions.append(decision)
        synced = False
        for ent in rec.entries:
            stored = sum(p.length for p in ent.parts)
            codec = ent.codec + ("+zstd" if any(p.zstd is not None for p in ent.parts) else "")
            f.by_tensor[ent.name] = f.by_tensor.get(ent.name, 0) + stored
            f.by_codec[codec] = f.by_codec.get(codec, 0) + stored
            f.tensor_codec[ent.name] = codec
            synced |= ent.name.startswith(SYNC_PREFIX)
        if synced:
            f.syncs.append(step)
    _merge(f.problems, found)


__all__ = ["FULL_CHECK_BYTES", "FULL_CHECK_RECORDS", "META_READ_ALL", "META_SAMPLE",
           "BaseFacts", "FullCheck", "LogFacts", "Report", "collect"]
