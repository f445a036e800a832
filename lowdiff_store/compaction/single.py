"""Compaction and retention of one log: bound disk use and recovery time.

``compact_log`` (1) materializes a new base at a chosen step (default: the newest durable step)
by replaying from the nearest base, (2) applies the retention policy: it keeps the newest
``keep_bases`` bases (plus, with ``keep_history_from``, the base at or before that step and
every base after it) and every diff after the oldest kept base, (3) publishes the new base
and the retention in one manifest swap (:func:`publish_base`), and only then deletes the
files no manifest references.

Crash safety: every step either completes or leaves files that no manifest references
(a ``*.tmp``, a base renamed but not yet published, segments unpublished but not yet
deleted). Those are removed by the next open of the log by a writer or by the next
compaction; the log is at all times either the old state or the new one, both restorable
and clean under ``verify``. ``LOWDIFF_COMPACT_PAUSE=SECONDS`` (tests only) sleeps at each
crash point and names it on stderr, so a test can kill the process there.

Concurrency: a live writer may keep appending (compaction never touches the active
segment, and both sides change the manifest by a compare-and-swap commit that reapplies
their change when the other committed first). Readers holding memory maps keep valid views:
files are unlinked, never rewritten. One compaction runs at a time (``COMPACT.lock``; a dry
run takes no lock). Every file access goes through the log's
:class:`~lowdiff_store.storage.Store`; deletions are durable. A compaction that fails (a
full disk, no write permission) raises one ``StorageError`` and leaves the old state: a base
it stored but could not commit is removed again.

The core does not know how to replay a gradient log (that needs the optimizer): a
*materializer* ``(reader, step) -> (tensors, meta)`` produces the base's content. The torch
layer provides one (:class:`lowdiff_store.torch.api.TorchMaterializer`); without one,
compaction only applies retention to existing bases.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, LowdiffError, Reason, StepNotFoundError, StorageError
from ..format.constants import (
    BASE_NAME,
    INDEX_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    SEGMENT_NAME,
    SLICE_NAME,
    SLICE_RE,
)
from ..log.base import store_base
from ..log.manifest import Manifest, load_manifest, update_manifest
from ..log.reader import LogReader
from ..log.writer import COMPACT_LOCK_NAME, collect_garbage
from ..progress import ProgressFn
from ..storage import Store, StoreLike, open_store

#: ``(reader, step) -> (tensors, meta)``: the content of a base at ``step`` of the log
Materializer = Callable[[LogReader, int], "tuple[Mapping[str, tuple[str, np.ndarray]], "
                        "Mapping[str, Any]]"]


@runtime_checkable
class ShardMaterializer(Protocol):
    """A materializer for a sharded checkpoint: ``for_rank(r)`` is rank ``r``'s."""

    def for_rank(self, rank: int) -> Materializer:
        """The materializer of rank ``rank``'s shard."""


@dataclass
class CompactionPlan:
    """What a compaction will do (``dry_run`` returns it without doing it)."""

    new_base: int | None
    #: the steps of the bases kept, streamed ones (their complete steps) among them
    keep_bases: list[int]
    delete_bases: list[int]
    delete_segments: list[int]
    bytes_freed: int
    bytes_before: int
    notes: list[str] = field(default_factory=list)
    #: streamed bases dropped (spec section 7.2): (complete step, slice steps)
    delete_streamed: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {"new_base": self.new_base, "keep_bases": self.keep_bases,
                "delete_bases": self.delete_bases, "delete_segments": self.delete_segments,
                "delete_streamed": [{"complete": c, "slices": list(sl)}
                                    for c, sl in self.delete_streamed],
                "bytes_freed": self.bytes_freed, "bytes_before": self.bytes_before,
                "notes": self.notes}


@dataclass
class CompactionResult:
    """What a compaction did."""

    plan: CompactionPlan
    dry_run: bool
    new_base_bytes: int = 0
    materialize_s: float = 0.0
    total_s: float = 0.0
    bytes_after: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        d = self.plan.to_dict()
        d.update({"dry_run": self.dry_run, "new_base_bytes": self.new_base_bytes,
                  "materialize_s": self.materialize_s, "total_s": self.total_s,
                  "bytes_after": self.bytes_after})
        return d


#: Files deleted per directory fsync by a compaction (the first one alone).
DELETE_BATCH = 256


def _size(store: Store, name: str) -> int:
    try:
        return store.size(name)
    except LowdiffError:
        return 0


def log_bytes(path: StoreLike) -> int:
    """Bytes of every file of the log."""
    store = open_store(path)
    return sum(_size(store, n) for n in store.list())


def _retained(bases: list[int], keep_bases: int, keep_history_from: int | None) -> list[int]:
    keep = set(bases[-keep_bases:]) if keep_bases > 0 else set()
    if keep_history_from is not None:
        older = [b for b in bases if b <= keep_history_from]
        start = older[-1] if older else (bases[0] if bases else None)
        if start is not None:
            keep |= {b for b in bases if b >= start}
    return sorted(keep)


def plan(man: Manifest, path: StoreLike, *, new_base: int | None, keep_bases: int,
         keep_history_from: int | None) -> CompactionPlan:
    """Decide what to keep and delete for a manifest (pure except for file sizes and the
    listing of slice files no manifest names yet).

    Streamed bases count among the bases by their complete steps (spec section 7.2); one
    at a step where a consistent base is kept too is dropped (a restore uses the
    consistent one). The diffs kept are those after the first slice of the oldest base
    kept, and after the first slice of a streamed base a live writer is still taking
    (its slice files, not named yet, are listed: it is committed with its last one)."""
    consistent = set(man.bases) | ({new_base} if new_base is not None else set())
    streamed = dict(man.streamed)
    keep = _retained(sorted(consistent | set(streamed)), keep_bases, keep_history_from)
    delete_bases = [b for b in man.bases if b not in keep]
    delete_streamed = [(c, sl) for c, sl in man.streamed if c not in keep or c in consistent]
    store = open_store(path)
    firsts = [b if b in consistent else streamed[b][0] for b in keep]
    oldest = min(firsts + _slices_in_progress(store, man)) if keep else None
    delete_segments: list[int] = []
    segs = man.segments
    if oldest is not None:
        for i, (sid, _first) in enumerate(segs[:-1]):  # never the active segment
            next_first = segs[i + 1][1]
            if next_first <= oldest + 1:  # every record of this segment is <= oldest start
                delete_segments.append(sid)
    freed = sum(_size(store, BASE_NAME.format(b)) for b in delete_bases)
    freed += sum(_size(store, SLICE_NAME.format(s)) for _c, sl in delete_streamed for s in sl)
    freed += sum(_size(store, SEGMENT_NAME.format(s)) + _size(store, INDEX_NAME.format(s))
                 for s in delete_segments)
    return CompactionPlan(new_base, keep, delete_bases, delete_segments, freed,
                          log_bytes(store), delete_streamed=delete_streamed)


def _slices_in_progress(store: Store, man: Manifest) -> list[int]:
    """The steps of slice files ``man`` does not name: a streamed base a live writer is
    taking (its diffs from its first slice on must stay), or garbage of a crash (kept
    until the next writer open removes it: a few more diffs kept, never fewer)."""
    named = man.slice_steps()
    out = []
    for name in store.list("slice-"):
        m = SLICE_RE.match(name)
        if m is not None and int(m.group(1)) not in named:
            out.append(int(m.group(1)))
    return out


def publish_base(path: StoreLike, step: int, tensors: Mapping[str, tuple[str, np.ndarray]],
                 meta: Mapping[str, Any], log_id: bytes,
                 change: Callable[[Manifest], None] | None = None) -> int:
    """Write the base of ``step`` and publish it with one manifest commit (applying
    ``change`` to the manifest in the same commit). Returns the bytes written, or 0 when a
    base at ``step`` was already live (another process made it first: the state at a step
    is unique, so the existing one is kept and only ``change`` is applied).

    Safe beside a live writer and its background base writer: the base object is
    published whole (atomically) under its name, then the manifest naming it is committed.
    A crash in between leaves a base no manifest names (removed by garbage collection);
    a base published meanwhile by the writer holds the same state, so replacing it changes
    nothing a reader can see.
    """
    store = open_store(path)
    size = 0
    if step not in load_manifest(store).bases:
        size = store_base(store, step, tensors, dict(meta), log_id)  # durable
        _pause("base-written")

    def commit(m: Manifest) -> None:
        if size:
            m.bases = sorted(set(m.bases) | {step})
        if change is not None:
            change(m)

    if size or change is not None:
        try:
            update_manifest(store, commit)
        except BaseException:
            if size:  # stored but never committed: leave exactly the old state
                try:
                    if step not in load_manifest(store).bases:
                        store.delete(BASE_NAME.format(step))
                except LowdiffError:
                    pass  # the next writer open collects it
            raise
    return size


def _pause(point: str) -> None:
    """Fault-injection hook for the crash tests: ``LOWDIFF_COMPACT_PAUSE=SECONDS`` sleeps
    at every crash point of a compaction and prints its name to stderr first. Unset (the
    default), it costs one dictionary lookup."""
    delay = os.environ.get("LOWDIFF_COMPACT_PAUSE")
    if delay:
        sys.stderr.write(f"lowdiff-compact-point {point}\n")
        sys.stderr.flush()
        time.sleep(float(delay))


def _accepts_progress(fn: Callable[..., Any]) -> bool:
    try:
        return "progress" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _check_step(reader: LogReader, step: object) -> None:
    """Refuse a step past the newest durable one before anything is built for it: work and
    memory follow the log, never the requested number."""
    if type(step) is not int or step < 0:
        raise ConfigError(f"step={step!r} must be a non-negative int")
    durable = reader.durable_step
    if durable is None or step > durable:
        raise StepNotFoundError(f"step {step} is past the newest durable step ({durable})",
                                path=reader.path)


def _delete_dropped(store: Store, p: CompactionPlan, replayed: int,
                    progress: ProgressFn | None) -> None:
    """Delete the bases, the slices of streamed bases and the segments (with their
    indexes) the plan drops (their manifest entries are gone already), durably when
    done: a power cut cannot bring a file back (one that came back before would be
    unreferenced, collected as garbage). The first file goes alone (the crash tests'
    "deleting" point), the rest in batches of ``DELETE_BATCH``, one directory fsync each."""
    doomed = [BASE_NAME.format(b) for b in p.delete_bases]
    doomed += [SLICE_NAME.format(s) for _c, sl in p.delete_streamed for s in sl]
    for s in p.delete_segments:
        doomed += [SEGMENT_NAME.format(s), INDEX_NAME.format(s)]
    done = 0
    for batch in (doomed[:1], *(doomed[i:i + DELETE_BATCH]
                                 for i in range(1, len(doomed), DELETE_BATCH))):
        store.delete_many(batch)
        if done == 0 and batch:
            _pause("deleting")
        done += len(batch)
        if progress and batch:
            progress(replayed + done, replayed + len(doomed))


def compact_log(path: str | os.PathLike[str], *, step: int | None = None,
                keep_bases: int = 2, keep_history_from: int | None = None,
                dry_run: bool = False, materializer: Materializer | None = None,
                progress: ProgressFn | None = None) -> CompactionResult:
    """Materialize a base at ``step`` (default: the newest durable step) of the log at
    ``path`` and apply retention. See the module docstring for the guarantees.

    ``progress(done, total)`` is called while the materializer replays (when it takes a
    ``progress`` keyword, as :func:`lowdiff_store.torch.materialize_base` does) and as
    files are deleted; the units are replayed diffs plus deleted files.
    """
    store = open_store(path)
    path = store.url
    if keep_bases < 1:
        raise ConfigError("keep_bases must be >= 1 (a log without a base cannot be restored)")
    t_start = time.perf_counter()
    if not store.exists(MANIFEST_NAME):
        load_manifest(store)  # raises not_a_log with the path
    lock = None if dry_run else store.try_lock(COMPACT_LOCK_NAME)  # a dry run writes nothing
    if lock is None and not dry_run:
        raise LowdiffError("another compaction is running on this log",
                           reason=Reason.LOCKED, path=store.path_of(COMPACT_LOCK_NAME))
    try:
        _pause("locked")
        replayed = 0
        tensors: Mapping[str, tuple[str, np.ndarray]] | None = None
        meta: Mapping[str, Any] = {}
        with LogReader(store, strict=True) as reader:
            target = step if step is not None else reader.durable_step
            if target is None:
                raise LowdiffError("the log has no base: nothing to compact",
                                   reason=Reason.NO_BASE, path=path)
            _check_step(reader, target)
            # (a streamed base's complete step too: a consistent base is made there)
            new_base = None if target in reader.bases else target
            if new_base is not None:
                replayed = len(reader.chain_from(new_base)[1])  # every diff needed is there
                if materializer is None:
                    new_base = None
            p = plan(reader.manifest, store, new_base=new_base, keep_bases=keep_bases,
                     keep_history_from=keep_history_from)
            if new_base is None and target not in reader.bases:
                p.notes.append(f"no materializer for this log: no base made at step {target} "
                               "(install torch for gradient logs)")
            result = CompactionResult(p, dry_run)
            log_id = reader.log_id
            if dry_run:
                result.total_s = time.perf_counter() - t_start
                result.bytes_after = p.bytes_before - p.bytes_freed
                return result
            if new_base is not None and materializer is not None:
                t0 = time.perf_counter()
                if progress is not None and _accepts_progress(materializer):
                    tensors, meta = materializer(reader, new_base,  # type: ignore[call-arg]
                                                 progress=progress)
                else:
                    tensors, meta = materializer(reader, new_base)
                result.materialize_s = time.perf_counter() - t0
                _pause("materialized")

        def apply(m: Manifest) -> None:
            # recompute against the current manifest: a live writer may have moved on
            fresh = plan(m, store, new_base=None, keep_bases=keep_bases,
                         keep_history_from=keep_history_from)
            p.delete_bases, p.delete_segments = fresh.delete_bases, fresh.delete_segments
            p.delete_streamed, p.keep_bases = fresh.delete_streamed, fresh.keep_bases
            p.bytes_freed = fresh.bytes_freed
            m.bases = [b for b in m.bases if b not in fresh.delete_bases]
            m.streamed = [e for e in m.streamed if e not in fresh.delete_streamed]
            m.segments = [s for s in m.segments if s[0] not in fresh.delete_segments]

        if new_base is not None and tensors is not None:
            result.new_base_bytes = publish_base(store, new_base, tensors, meta, log_id, apply)
            del tensors
            if not result.new_base_bytes:
                p.notes.append(f"a base at step {new_base} was published meanwhile (by the "
                               "writer): kept it")
        else:
            update_manifest(store, apply)
        _pause("published")
        _delete_dropped(store, p, replayed, progress)
        _pause("deleted")
        _collect_unreferenced(store)
        result.total_s = time.perf_counter() - t_start
        result.bytes_after = log_bytes(store)
        return result
    except OSError as e:  # a StorageError is one already; anything else becomes one
        if isinstance(e, LowdiffError):
            raise
        raise StorageError(f"compaction failed: {e.strerror or e}",
                           path=e.filename or path) from e
    finally:
        if lock is not None:
            lock.release_and_remove()  # a log keeps no COMPACT.lock between compactions


def _collect_unreferenced(store: Store) -> None:
    """Remove what an interrupted compaction left, when no writer holds the log (a live
    writer may be between creating a file and publishing it: it collects on its own open)."""
    lock = store.try_lock(LOCK_NAME)
    if lock is None:
        return
    with lock:
        collect_garbage(store, load_manifest(store))


__all__ = ["CompactionPlan", "CompactionResult", "Materializer", "ShardMaterializer",
           "compact_log", "log_bytes", "plan", "publish_base"]
