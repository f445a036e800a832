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
segment, and both sides change the manifest under ``MANIFEST.lock``). Readers holding
memory maps keep valid views: files are unlinked, never rewritten. One compaction runs at a
time (``COMPACT.lock``, removed when released; a dry run writes nothing and takes no lock, so
it works on a read-only log). A compaction that fails (a full disk, no write permission)
raises one ``StorageError`` and leaves the old state: its temporary base is removed, and a
base renamed into place whose manifest could not be published is removed again.

The core does not know how to replay a gradient log (that needs the optimizer): a
*materializer* ``(reader, step) -> (tensors, meta)`` produces the base's content. The torch
layer provides one (:class:`lowdiff_store.torch.api.TorchMaterializer`); without one,
compaction only applies retention to existing bases.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, LowdiffError, Reason, StorageError
from ..format.constants import BASE_NAME, INDEX_NAME, SEGMENT_NAME
from ..log.base import write_base
from ..log.manifest import (
    Manifest,
    load_manifest,
    manifest_lock,
    publish_manifest,
    try_lock,
    update_manifest,
)
from ..log.reader import LogReader
from ..progress import ProgressFn
from ..storage import fsync_dir

#: one compaction at a time per log (the file is removed when released)
COMPACT_LOCK = "COMPACT.lock"

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
    keep_bases: list[int]
    delete_bases: list[int]
    delete_segments: list[int]
    bytes_freed: int
    bytes_before: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {"new_base": self.new_base, "keep_bases": self.keep_bases,
                "delete_bases": self.delete_bases, "delete_segments": self.delete_segments,
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


def _size(p: str) -> int:
    try:
        return os.path.getsize(p)
    except OSError:
        return 0


def log_bytes(path: str) -> int:
    """Bytes of every file of the log directory."""
    return sum(_size(os.path.join(path, n)) for n in os.listdir(path))


def _retained(bases: list[int], keep_bases: int, keep_history_from: int | None) -> list[int]:
    keep = set(bases[-keep_bases:]) if keep_bases > 0 else set()
    if keep_history_from is not None:
        older = [b for b in bases if b <= keep_history_from]
        start = older[-1] if older else (bases[0] if bases else None)
        if start is not None:
            keep |= {b for b in bases if b >= start}
    return sorted(keep)


def plan(man: Manifest, path: str, *, new_base: int | None, keep_bases: int,
         keep_history_from: int | None) -> CompactionPlan:
    """Decide what to keep and delete for a manifest (pure except for file sizes)."""
    bases = sorted(set(man.bases) | ({new_base} if new_base is not None else set()))
    keep = _retained(bases, keep_bases, keep_history_from)
    delete_bases = [b for b in man.bases if b not in keep]
    oldest = keep[0] if keep else None
    delete_segments: list[int] = []
    segs = man.segments
    if oldest is not None:
        for i, (sid, _first) in enumerate(segs[:-1]):  # never the active segment
            next_first = segs[i + 1][1]
            if next_first <= oldest + 1:  # every record of this segment is <= oldest base
                delete_segments.append(sid)
    freed = sum(_size(os.path.join(path, BASE_NAME.format(b))) for b in delete_bases)
    freed += sum(_size(os.path.join(path, SEGMENT_NAME.format(s))) +
                 _size(os.path.join(path, INDEX_NAME.format(s))) for s in delete_segments)
    return CompactionPlan(new_base, keep, delete_bases, delete_segments, freed,
                          log_bytes(path))


def publish_base(path: str, step: int, tensors: Mapping[str, tuple[str, np.ndarray]],
                 meta: Mapping[str, Any], log_id: bytes,
                 change: Callable[[Manifest], None] | None = None) -> int:
    """Write the base of ``step`` and publish it with one manifest swap (applying
    ``change`` to the manifest in the same swap). Returns the bytes written, or 0 when a
    base at ``step`` was already live (another process made it first: the state at a step
    is unique, so the existing one is kept and only ``change`` is applied).

    Safe beside a live writer and its background base writer: the file is written under a
    private name (``base-....<pid>.<thread>.tmp``, removed by garbage collection if this
    process dies) and renamed into place under ``MANIFEST.lock`` just before the manifest
    that names it is published. A crash leaves the old manifest, or the new one with its
    base complete.
    """
    final = os.path.join(path, BASE_NAME.format(step))
    tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
    size = write_base(tmp, step, tensors, dict(meta), log_id)  # fsynced
    try:
        _pause("base-written")
        with manifest_lock(path):
            m = load_manifest(path)
            renamed = False
            try:
                if step in m.bases:
                    size = 0
                else:
                    os.replace(tmp, final)
                    renamed = True
                    fsync_dir(path)
                    _pause("base-renamed")
                    m.bases = sorted(set(m.bases) | {step})
                if change is not None:
                    change(m)
                if size or change is not None:
                    publish_manifest(path, m)
            except BaseException:
                if renamed:
                    _remove_unpublished(path, step, final)
                raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return size


def _remove_unpublished(path: str, step: int, final: str) -> None:
    """After a failed publish (a full disk...), remove the base just renamed into place if
    the manifest on disk does not name it, so a failed compaction leaves the old state.
    Called under ``MANIFEST.lock``, so no other process can publish it meanwhile."""
    try:
        named = step in load_manifest(path).bases
    except LowdiffError:
        return  # cannot tell: garbage collection removes it if it is unreferenced
    if not named:
        try:
            os.unlink(final)
            fsync_dir(path)
        except OSError:
            pass


def _take_lock(path: str) -> int:
    """Take ``COMPACT.lock`` (one compaction at a time). The file is removed when released,
    so a log holds no lock file between compactions; a lock taken on a file that its holder
    removed meanwhile is retried on the new file."""
    name = os.path.join(path, COMPACT_LOCK)
    while True:
        try:
            fd = try_lock(path, COMPACT_LOCK)
        except OSError as e:
            raise StorageError(f"cannot create the compaction lock: {e.strerror} (a "
                               f"compaction writes to the log; --dry-run does not)",
                               path=name) from e
        if fd is None:
            raise LowdiffError("another compaction is running on this log",
                               reason=Reason.LOCKED, path=name)
        try:
            if os.fstat(fd).st_ino == os.stat(name).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _release_lock(path: str, fd: int | None) -> None:
    if fd is None:
        return
    try:
        os.unlink(os.path.join(path, COMPACT_LOCK))
    except OSError:
        pass
    finally:
        os.close(fd)


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
    path = os.fspath(path)
    if keep_bases < 1:
        raise ConfigError("keep_bases must be >= 1 (a log without a base cannot be restored)")
    t_start = time.perf_counter()
    if not os.path.isdir(path):
        load_manifest(path)  # raises not_a_log (or io_error) with the path
    lock = None if dry_run else _take_lock(path)  # a dry run writes nothing
    try:
        _pause("locked")
        replayed = 0
        tensors: Mapping[str, tuple[str, np.ndarray]] | None = None
        meta: Mapping[str, Any] = {}
        with LogReader(path, strict=True) as reader:
            target = step if step is not None else reader.durable_step
            if target is None:
                raise LowdiffError("the log has no base: nothing to compact",
                                   reason=Reason.NO_BASE, path=path)
            new_base = None if target in reader.bases else target
            if new_base is not None:
                replayed = len(reader.chain(new_base)[1])  # every diff needed is there
                if materializer is None:
                    new_base = None
            p = plan(reader.manifest, path, new_base=new_base, keep_bases=keep_bases,
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
            fresh = plan(m, path, new_base=None, keep_bases=keep_bases,
                         keep_history_from=keep_history_from)
            p.delete_bases, p.delete_segments = fresh.delete_bases, fresh.delete_segments
            p.bytes_freed = fresh.bytes_freed
            m.bases = [b for b in m.bases if b not in fresh.delete_bases]
            m.segments = [s for s in m.segments if s[0] not in fresh.delete_segments]

        if new_base is not None and tensors is not None:
            result.new_base_bytes = publish_base(path, new_base, tensors, meta, log_id, apply)
            del tensors
            if not result.new_base_bytes:
                p.notes.append(f"a base at step {new_base} was published meanwhile (by the "
                               "writer): kept it")
        else:
            update_manifest(path, apply)
        _pause("published")
        doomed = [BASE_NAME.format(b) for b in p.delete_bases]
        for s in p.delete_segments:
            doomed += [SEGMENT_NAME.format(s), INDEX_NAME.format(s)]
        for i, name in enumerate(doomed):
            try:
                os.unlink(os.path.join(path, name))
            except FileNotFoundError:
                pass
            if i == 0:
                _pause("deleting")
            if progress:
                progress(replayed + i + 1, replayed + len(doomed))
        _pause("deleted")
        _collect_unreferenced(path)
        result.total_s = time.perf_counter() - t_start
        result.bytes_after = log_bytes(path)
        return result
    except OSError as e:  # a StorageError is one already; anything else becomes one
        if isinstance(e, LowdiffError):
            raise
        raise StorageError(f"compaction failed: {e.strerror or e}",
                           path=e.filename or path) from e
    finally:
        _release_lock(path, lock)


def _collect_unreferenced(path: str) -> None:
    """Remove what an interrupted compaction left, when no writer holds the log (a live
    writer may be between creating a file and publishing it: it collects on its own open)."""
    fd = try_lock(path, "LOCK")
    if fd is None:
        return
    try:
        from ..log.writer import collect_garbage

        collect_garbage(path, load_manifest(path))
    finally:
        os.close(fd)


__all__ = ["CompactionPlan", "CompactionResult", "Materializer", "ShardMaterializer",
           "compact_log", "log_bytes", "plan", "publish_base"]
