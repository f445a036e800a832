"""Reading a log: open through the manifest and indexes (no full scan), list steps and
bases, read the record of step N in O(log n), reconstruct chains.

Recovery policy (see the spec, "Recovery"): the active (last) segment may end in a torn
tail, which is ignored and counted. Corruption anywhere else is reported with file,
offset and reason: in ``strict`` mode the first one raises; in tolerant mode it is
skipped, counted in :attr:`LogReader.report`, and reading goes on.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ..errors import CorruptRecordError, LowdiffError, Reason, StepNotFoundError
from ..format.constants import BASE_NAME, INDEX_NAME, SEGMENT_NAME, SLICE_NAME
from ..format.record import TensorEntry, parse_tensors
from ..storage import ReadMode, Source, Store, StoreLike, open_store
from .base import BaseFile
from .index import load_index
from .manifest import Manifest, load_manifest, manifest_moved
from .reference import AnyBase, as_base
from .segment import RecordRef, read_record_meta, read_segment_header, scan_segment
from .tensors import decode_entry, part_arrays


@dataclass
class RecoveryReport:
    """What opening the log found besides valid records."""

    torn_tail_bytes: int = 0
    corrupt_bytes: int = 0
    problems: list[LowdiffError] = field(default_factory=list)
    unindexed_records: int = 0
    index_rebuilt: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """No corruption was found (a torn tail is not corruption)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {"torn_tail_bytes": self.torn_tail_bytes, "corrupt_bytes": self.corrupt_bytes,
                "problems": [p.to_dict() for p in self.problems],
                "unindexed_records": self.unindexed_records,
                "index_rebuilt": self.index_rebuilt}


class Record:
    """One step's diff. Tensors decode lazily; raw parts are zero-copy views (mmap).

    Views stay valid while the reader that produced them is open.
    """

    def __init__(self, step: int, meta: dict[str, Any], payload: memoryview,
                 path: str, offset: int, length: int) -> None:
        self.step = step
        self.meta = meta
        self.path = path
        self.offset = offset
        self.length = length
        self._payload = payload
        try:
            entries = parse_tensors(meta, payload.nbytes)
        except LowdiffError as e:
            e.path, e.offset = path, offset
            Exception.__init__(e, str(e))
            raise
        self._entries: dict[str, TensorEntry] = {e.name: e for e in entries}

    @property
    def kind(self) -> str:
        """Diff kind: ``"grad"`` (LowDiff gradient) or ``"weight"`` (weight delta)."""
        k = self.meta.get("kind")
        return k if isinstance(k, str) else ""

    @property
    def side(self) -> dict[str, Any]:
        """The step's side channel (opaque map filled by the torch layer)."""
        s = self.meta.get("side")
        return s if isinstance(s, dict) else {}

    @property
    def names(self) -> list[str]:
        """Tensor names in record order."""
        return list(self._entries)

    @property
    def entries(self) -> list[TensorEntry]:
        """Validated tensor entries."""
        return list(self._entries.values())

    def entry(self, name: str) -> TensorEntry:
        """The entry of one tensor."""
        try:
            return self._entries[name]
        except KeyError:
            raise LowdiffError(f"step {self.step} has no tensor {name!r}",
                               reason=Reason.INVALID_ARGUMENT, path=self.path,
                               offset=self.offset) from None

    def _wrap(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except LowdiffError as e:
            if e.path is None:
                e.path, e.offset = self.path, self.offset
                Exception.__init__(e, f"step {self.step}: " + str(e))
            raise

    def parts(self, name: str) -> list[np.ndarray]:
        """The stored parts of a tensor (e.g. sparse indices and values), decompressed."""
        entry = self.entry(name)
        result: list[np.ndarray] = self._wrap(lambda: part_arrays(entry, self._payload))
        return result

    def tensor(self, name: str, *, ref: np.ndarray | None = None) -> np.ndarray:
        """Decode a tensor to its storage dtype and shape (``ref`` for xor deltas)."""
        entry = self.entry(name)
        result: np.ndarray = self._wrap(lambda: decode_entry(entry, self._payload, ref=ref))
        return result


#: Attempts of a read that found a file missing while a compaction published newer
#: manifests (each retry reads the newer manifest; see :func:`on_newest_manifest`).
READ_ATTEMPTS = 3

T = TypeVar("T")


def _nothing_missing(_result: object) -> bool:
    return False


def on_newest_manifest(attempt: Callable[[], T], moved: Callable[[], bool], *,
                       missing: Callable[[T], bool] = _nothing_missing) -> T:
    """Run ``attempt`` (a read that loads the manifest itself) and return what it returns;
    run it again, at most :data:`READ_ATTEMPTS` times in all, while it found a file missing
    (it raised ``missing_file``, or ``missing(result)``) and ``moved()`` says a newer
    manifest was published after the one that attempt read.

    This is the one rule every reader beside a compaction follows: compaction deletes a
    base or segment only after publishing a manifest that no longer names it, so a file
    missing under an older manifest means "read the newer one". A file the newest
    manifest still names is missing for real: that error (or result) is returned as is.
    """
    for _ in range(READ_ATTEMPTS - 1):
        try:
            result = attempt()
        except LowdiffError as e:
            if e.reason is not Reason.MISSING_FILE or not moved():
                raise
            continue
        if not missing(result) or not moved():
            return result
    return attempt()


def with_reader(location: StoreLike, use: Callable[[LogReader], T], *,
                mode: ReadMode = "mmap", strict: bool = True, verify: bool = True) -> T:
    """``use(reader)`` on a :class:`LogReader` of ``location``, closed afterwards; when
    ``use`` meets a file that a compaction deleted after this reader read its manifest
    (``missing_file`` while a newer manifest exists), again on a fresh reader of the newer
    manifest (:func:`on_newest_manifest`). ``use`` must therefore be safe to run again: it
    may have run partly before failing (a reader fails on opening a base or a segment,
    before any state is loaded from it)."""
    opened: list[LogReader] = []

    def attempt() -> T:
        with LogReader(location, mode=mode, strict=strict, verify=verify) as reader:
            opened[:] = [reader]
            return use(reader)

    def moved() -> bool:
        return bool(opened) and manifest_moved(opened[0].store, opened[0].manifest.generation)

    return on_newest_manifest(attempt, moved)


def _cat(xs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)


@dataclass
class _Segment:
    id: int
    first_step: int
    name: str
    path: str
    src: Source | None = None


@dataclass(frozen=True)
class BasePlan:
    """Where a restore starts: a consistent base (``slices == (complete,)``) or a streamed
    base complete at ``complete`` whose slices were taken after ``slices``."""

    complete: int
    slices: tuple[int, ...]
    streamed: bool

    @property
    def first(self) -> int:
        """The step replay starts after (the first slice's)."""
        return self.slices[0]


class LogReader:
    """Read-only view of a log (a directory, a URL or a :class:`~lowdiff_store.storage.Store`).

    ``mode``: ``"mmap"`` (zero-copy views, default), ``"private"`` (zero-copy views that
    are writable, copy-on-write: replay lends them to the optimizer as gradients) or
    ``"pread"`` (network filesystems).
    ``strict``: raise on the first corruption (default); otherwise skip and count it.
    ``verify``: check each record's CRC when it is read (default True).

    A segment is scanned with ``pread`` and then mapped only up to the end of its last
    valid record: a writer that opens the log meanwhile and cuts a torn tail
    (``ftruncate``) never removes bytes under this reader's map (which would be SIGBUS).
    """

    def __init__(self, path: StoreLike, *, mode: ReadMode = "mmap",
                 strict: bool = True, verify: bool = True) -> None:
        #: Where the log lives; every file access goes through it.
        self.store: Store = open_store(path)
        self.path = self.store.url
        self.mode: ReadMode = mode
        self.strict = strict
        self.verify = verify
        self.report = RecoveryReport()
        self._segments: list[_Segment] = []
        self.manifest: Manifest  # set by _open_once
        on_newest_manifest(self._open_once, self._manifest_moved, missing=self._found_missing)
        self.bases: list[int] = list(self.manifest.bases)
        #: streamed bases (spec section 7.2): (complete step, slice steps)
        self.streamed: list[tuple[int, tuple[int, ...]]] = list(self.manifest.streamed)

    def _open_once(self) -> None:
        """Read the manifest and open the segments it names (closing what an earlier
        attempt opened). A strict reader raises on a missing segment; a tolerant one
        counts it in :attr:`report`."""
        self.close()
        self.report = RecoveryReport()
        self.manifest = load_manifest(self.store)
        try:
            self._open_segments()
        except BaseException:
            self.close()
            raise

    def _found_missing(self, _result: None) -> bool:
        return any(p.reason is Reason.MISSING_FILE for p in self.report.problems)

    def _manifest_moved(self) -> bool:
        return manifest_moved(self.store, self.manifest.generation)

    def _open_segments(self) -> None:
        self._segments = []
        seg_ids: list[np.ndarray] = []
        steps: list[np.ndarray] = []
        offsets: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        last_step = -1
        for i, (sid, first) in enumerate(self.manifest.segments):
            name = SEGMENT_NAME.format(sid)
            seg = _Segment(sid, first, name, self.store.path_of(name))
            self._segments.append(seg)
            active = i == len(self.manifest.segments) - 1
            refs = self._load_segment(seg, active, last_step)
            if len(refs):
                seg_ids.append(np.full(len(refs), i, dtype=np.int64))
                steps.append(refs[:, 0])
                offsets.append(refs[:, 1])
                lengths.append(refs[:, 2])
                last_step = int(refs[-1, 0])
        self.steps: np.ndarray = _cat(steps)
        self._seg_of = _cat(seg_ids)
        self._offsets = _cat(offsets)
        self._lengths = _cat(lengths)

    # ------------------------------------------------------------------ opening

    def _problem(self, err: LowdiffError) -> None:
        if self.strict:
            raise err
        self.report.problems.append(err)

    def _source(self, seg: _Segment) -> Source:
        if seg.src is None:
            raise LowdiffError("segment is not open", reason=Reason.MISSING_FILE, path=seg.path)
        return seg.src

    def _load_segment(self, seg: _Segment, active: bool, last_step: int) -> np.ndarray:
        """(step, offset, length) rows of the valid records of one segment; leaves
        ``seg.src`` open over the validated prefix."""
        if not self.store.exists(seg.name):
            self._problem(LowdiffError("segment named by the manifest is missing",
                                       reason=Reason.MISSING_FILE, path=seg.path))
            return np.zeros((0, 3), np.int64)
        src: Source | None = self.store.open(seg.name, "pread")
        assert src is not None
        try:
            rows, valid_end = self._scan(seg, src, active, last_step)
            if self.mode in ("mmap", "private"):
                seg.src = self.store.open(seg.name, self.mode, length=valid_end)
            else:
                seg.src, src = src, None
        finally:
            if src is not None:
                src.close()
        return rows

    def _scan(self, seg: _Segment, src: Source, active: bool, last_step: int
              ) -> tuple[np.ndarray, int]:
        """The rows of ``seg`` and the end of its validated prefix."""
        try:
            hdr = read_segment_header(src)
            if hdr.log_id != self.manifest.log_id or hdr.file_id != seg.id:
                raise CorruptRecordError("segment belongs to another log or position",
                                         reason=Reason.LOG_ID_MISMATCH, path=seg.path, offset=16)
        except LowdiffError as e:
            self._problem(e)
            return np.zeros((0, 3), np.int64), 0
        entries = load_index(self.store, INDEX_NAME.format(seg.id), seg.id, hdr.log_id,
                             src.size)
        rows = np.zeros((0, 3), np.int64)
        start = hdr.header_len
        if entries is not None and len(entries):
            rows = np.stack([entries["step"], entries["offset"], entries["length"]],
                            axis=1).astype(np.int64)
            if rows[0, 0] <= last_step or rows[0, 1] != hdr.header_len:
                rows = np.zeros((0, 3), np.int64)  # inconsistent with the log: rebuild
                self.report.index_rebuilt.append(seg.id)
            else:
                start = int(rows[-1, 1] + rows[-1, 2])
                last_step = int(rows[-1, 0])
        elif entries is None:
            self.report.index_rebuilt.append(seg.id)
        known_end = start
        result = scan_segment(src, start, active=active, known_end=known_end,
                              reporter=self._problem, min_step=last_step)
        self.report.torn_tail_bytes += result.torn_tail_bytes
        self.report.corrupt_bytes += result.corrupt_bytes
        self.report.unindexed_records += len(result.records)
        if result.records:
            extra = np.array([(r.step, r.offset, r.length) for r in result.records],
                             dtype=np.int64)
            rows = np.concatenate([rows, extra]) if len(rows) else extra
        valid_end = max(result.valid_end, int(rows[-1, 1] + rows[-1, 2]) if len(rows) else 0)
        return rows, valid_end

    # ------------------------------------------------------------------ queries

    @property
    def log_id(self) -> bytes:
        """The log's 16-byte id."""
        return self.manifest.log_id

    @property
    def meta(self) -> dict[str, Any]:
        """Log-level metadata from the manifest."""
        return self.manifest.meta

    @property
    def first_step(self) -> int | None:
        """The oldest step reachable (oldest base, a streamed one's complete step
        included), or None for an empty log."""
        starts = self.manifest.base_steps()
        if starts:
            return starts[0]
        return int(self.steps[0]) if len(self.steps) else None

    @property
    def last_step(self) -> int | None:
        """The newest step present (newest diff or base)."""
        cands = []
        if len(self.steps):
            cands.append(int(self.steps[-1]))
        starts = self.manifest.base_steps()
        if starts:
            cands.append(starts[-1])
        return max(cands) if cands else None

    @property
    def durable_step(self) -> int | None:
        """The newest step that can be reconstructed: a base at or before it and every
        diff between them present (after a crash: the last step that survived). From a
        streamed base the diffs run from its first slice's step (spec section 7.2); one
        whose diffs do not reach its complete step is passed over for an older base."""
        for c in reversed(self.manifest.base_steps()):
            first = self.start_for(c).first
            # diffs contiguous after the start: steps increase strictly, so the run
            # first+1, first+2, ... ends at the first step that is not its position's
            after = self.steps[int(np.searchsorted(self.steps, first, side="right")):]
            gaps = np.flatnonzero(after != np.arange(first + 1, first + 1 + len(after)))
            end = first + (int(gaps[0]) if len(gaps) else len(after))
            if end >= c:
                return end
        return None

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def record_bytes(self) -> int:
        """Total size of the valid diff records (headers included)."""
        return int(self._lengths.sum())

    def record_table(self) -> np.ndarray:
        """Where every valid diff record is: an ``(n, 4)`` int64 array of
        (step, segment id, offset, length) rows in step order (a copy)."""
        ids = np.array([s.id for s in self._segments], dtype=np.int64)
        seg_ids = ids[self._seg_of] if len(self._seg_of) else np.zeros(0, np.int64)
        return np.stack([self.steps, seg_ids, self._offsets, self._lengths], axis=1)

    def has_step(self, step: int) -> bool:
        """A diff record for ``step`` exists."""
        i = int(np.searchsorted(self.steps, step))
        return i < len(self.steps) and int(self.steps[i]) == step

    def _locate(self, step: int) -> tuple[_Segment, RecordRef]:
        i = int(np.searchsorted(self.steps, step))
        if i >= len(self.steps) or int(self.steps[i]) != step:
            raise StepNotFoundError(f"no diff record for step {step}", path=self.path)
        seg = self._segments[int(self._seg_of[i])]
        return seg, RecordRef(step, int(self._offsets[i]), int(self._lengths[i]), 0)

    def record(self, step: int) -> Record:
        """The diff record of ``step`` (O(log n) lookup, one read)."""
        seg, ref = self._locate(step)
        hdr, meta, payload = read_record_meta(self._source(seg), ref, verify=self.verify)
        return Record(hdr.step, meta, payload, seg.path, ref.offset, hdr.length)

    def record_location(self, step: int) -> tuple[str, int, int]:
        """(segment path, offset, length) of the record of ``step``."""
        seg, ref = self._locate(step)
        return seg.path, ref.offset, ref.length

    def iter_records(self, start: int | None = None, stop: int | None = None
                     ) -> Iterator[Record]:
        """Records with ``start <= step <= stop`` in step order."""
        lo = 0 if start is None else int(np.searchsorted(self.steps, start))
        hi = len(self.steps) if stop is None else int(np.searchsorted(self.steps, stop,
                                                                         side="right"))
        for i in range(lo, hi):
            yield self.record(int(self.steps[i]))

    def base_path(self, step: int) -> str:
        """Path of the base at ``step``."""
        return self.store.path_of(BASE_NAME.format(step))

    def base(self, step: int) -> AnyBase:
        """Open the base at ``step`` (must be a live base): a :class:`ReferenceBase` when
        its tensors are partly in an external checkpoint (spec section 7.1), whose files
        are then checked present and of their recorded sizes."""
        return as_base(self.base_file(step))

    def base_file(self, step: int) -> BaseFile:
        """Open the base file at ``step`` alone (a reference base's table unchecked)."""
        i = bisect.bisect_left(self.bases, step)
        if i == len(self.bases) or self.bases[i] != step:
            raise StepNotFoundError(f"no base at step {step}", reason=Reason.NO_BASE,
                                    path=self.path)
        return self._framed(BASE_NAME.format(step), step, "base")

    def _framed(self, name: str, step: int, what: str) -> BaseFile:
        """Open the base-framed file ``name`` the manifest names, of this log and ``step``."""
        path = self.store.path_of(name)
        try:
            src = self.store.open(name, self.mode)
        except LowdiffError as e:
            if e.reason is Reason.MISSING_FILE:
                raise LowdiffError(f"{what} named by the manifest is missing",
                                   reason=Reason.MISSING_FILE, path=path) from None
            raise
        b = BaseFile(path, source=src)
        if b.log_id != self.log_id or b.step != step:
            b.close()
            raise CorruptRecordError(f"{what} belongs to another log or step",
                                     reason=Reason.LOG_ID_MISMATCH, path=path)
        return b

    def slice_path(self, step: int) -> str:
        """Path of the slice taken after ``step``."""
        return self.store.path_of(SLICE_NAME.format(step))

    def slice_file(self, step: int) -> BaseFile:
        """Open the slice taken after ``step`` (one of a live streamed base's)."""
        if not any(step in steps for _c, steps in self.streamed):
            raise StepNotFoundError(f"no slice at step {step}", reason=Reason.NO_BASE,
                                    path=self.path)
        return self._framed(SLICE_NAME.format(step), step, "slice")

    def start_for(self, step: int) -> BasePlan:
        """Where a restore of ``step`` starts: the newest consistent base or complete
        streamed base at or before ``step`` (a consistent one when both complete at the
        same step: it replays fewer steps)."""
        best: BasePlan | None = None
        i = bisect.bisect_right(self.bases, step)
        if i:
            best = BasePlan(self.bases[i - 1], (self.bases[i - 1],), streamed=False)
        for c, steps in self.streamed:
            if c <= step and (best is None or c > best.complete):
                best = BasePlan(c, steps, streamed=True)
        if best is None:
            raise StepNotFoundError(f"no base at or before step {step}", reason=Reason.NO_BASE,
                                    path=self.path)
        return best

    def chain_from(self, step: int) -> tuple[BasePlan, list[int]]:
        """(where it starts, diff steps to replay) to reconstruct ``step`` from any base,
        streamed ones included: the diffs after the plan's first slice (a consistent
        base's step); checks every one is present."""
        plan = self.start_for(step)
        return plan, self._diffs(plan.first, step)

    def base_for(self, step: int) -> int:
        """The newest base at or before ``step``."""
        i = bisect.bisect_right(self.bases, step)
        if i == 0:
            raise StepNotFoundError(f"no base at or before step {step}", reason=Reason.NO_BASE,
                                    path=self.path)
        return self.bases[i - 1]

    def chain(self, step: int) -> tuple[int, list[int]]:
        """(base step, diff steps to replay) to reconstruct ``step``; checks every diff
        between them is present."""
        b = self.base_for(step)
        return b, self._diffs(b, step)

    def _diffs(self, b: int, step: int) -> list[int]:
        lo = int(np.searchsorted(self.steps, b, side="right"))
        hi = int(np.searchsorted(self.steps, step, side="right"))
        diffs = [int(s) for s in self.steps[lo:hi]]
        expected = list(range(b + 1, step + 1))
        if diffs != expected:
            missing = sorted(set(expected) - set(diffs))
            raise StepNotFoundError(
                f"cannot reach step {step} from base {b}: diff for step {missing[0]} is missing",
                path=self.path)
        return diffs

    def segment_files(self) -> list[tuple[int, str, int]]:
        """(segment id, path, size) of the live segments."""
        out = []
        for seg in self._segments:
            try:
                size = self.store.size(seg.name)
            except LowdiffError:
                size = 0
            out.append((seg.id, seg.path, size))
        return out

    def close(self) -> None:
        """Release files. Arrays read through mmap stay valid (they hold the mapping)."""
        for seg in self._segments:
            if seg.src is not None:
                seg.src.close()
                seg.src = None

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["READ_ATTEMPTS", "BasePlan", "LogReader", "Record", "RecoveryReport",
           "on_newest_manifest", "with_reader"]
