"""The synchronous log writer: append records, make them durable, roll segments, publish
bases, cut history explicitly. The asynchronous writer (:mod:`lowdiff_store.writer`) stages
and batches on top of it.

Durability: :meth:`LogWriter.sync` fdatasyncs the active segment; when it returns, every
record appended before is durable and :attr:`durable_step` says up to which step. Index
entries are appended only for durable records (the index is a cache and is never fsynced
on the hot path). Segment creation, bases and the manifest are fsynced with their
directory.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import ConfigError, LowdiffError, ManifestError, Reason
from ..format.constants import (
    BASE_NAME,
    BASE_RE,
    FILE_HEADER_SIZE,
    INDEX_ENTRY_SIZE,
    INDEX_NAME,
    INDEX_RE,
    MANIFEST_NAME,
    SEGMENT_NAME,
    SEGMENT_RE,
)
from ..format.record import RecordBytes, TensorInput, build_record, finish_record, record_crc
from ..storage import AppendFile, DirLock, fsync_dir
from .base import write_base
from .index import IndexFile, make_entries
from .manifest import Manifest, load_manifest, publish_manifest, try_lock, update_manifest
from .reader import LogReader
from .segment import create_segment

#: Index entries of durable records are appended in groups of this many (and at roll,
#: truncation and close).
INDEX_GROUP = 64

#: Default size at which the active segment is sealed and a new one started.
DEFAULT_SEGMENT_BYTES = 256 << 20

#: :meth:`LogWriter.append` computes the CRC of a record at least this large on a helper
#: thread while the record is being written (the CRC field is filled in before the record
#: can be synced). Measured on 2 cores (bench/RESULTS_log.md): it gains 5-8% of append
#: throughput on 32 MiB records, and nothing, or a few % lost to the thread hand-off and
#: memory-bandwidth contention, on 8 MiB ones.
OVERLAP_CRC_BYTES = 16 << 20


class LogWriter:
    """Appends diff records and bases to the log in ``path`` (created if needed).

    One writer per log (an exclusive lock on ``LOCK``). Opening an existing log cuts a
    torn tail left by a crash and re-indexes records that survived unindexed; a log with
    corruption before its tail is refused (run ``lowdiff-store verify``).

    Thread-safety: one thread appends and syncs; :meth:`write_base` may run on another.
    """

    def __init__(self, path: str | os.PathLike[str], *, meta: Mapping[str, Any] | None = None,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 file_factory: type[AppendFile] = AppendFile) -> None:
        self.path = os.fspath(path)
        if segment_bytes < 4096:
            raise ConfigError(f"segment_bytes={segment_bytes} is too small (>= 4096)")
        self.segment_bytes = segment_bytes
        self._factory = file_factory
        self._mlock = threading.Lock()  # guards the manifest
        self._closed = False
        self._failed: LowdiffError | None = None  # a write or sync failed: no more appends
        self._crc_pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, int, int]] = []
        self.stats: dict[str, float] = {"bytes": 0, "records": 0, "writes": 0, "syncs": 0,
                                        "write_s": 0.0, "sync_s": 0.0, "rolls": 0}
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise LowdiffError(f"cannot create log directory: {e.strerror}",
                               reason=Reason.IO_ERROR, path=self.path) from e
        self._lock = DirLock(self.path)
        try:
            if os.path.exists(os.path.join(self.path, MANIFEST_NAME)):
                self._open_existing()
            else:
                self._create(meta or {})
        except BaseException:
            self._lock.release()
            raise

    # ------------------------------------------------------------------ open / create

    def _create(self, meta: Mapping[str, Any]) -> None:
        names = os.listdir(self.path)
        # A crash between creating segment 0 and publishing the first manifest leaves
        # seg-0 / its index holding no record (at most their header): nothing was ever
        # durable there, so they are removed and the log is created afresh.
        residue = [n for n in names if n in (SEGMENT_NAME.format(0), INDEX_NAME.format(0))
                   or n.endswith(".tmp")]
        if all(os.path.getsize(os.path.join(self.path, n)) <= FILE_HEADER_SIZE
               for n in residue if not n.endswith(".tmp")):
            for n in residue:
                os.unlink(os.path.join(self.path, n))
            names = [n for n in names if n not in residue]
        leftovers = [n for n in names if SEGMENT_RE.match(n) or BASE_RE.match(n)]
        if leftovers:
            raise LowdiffError(
                f"log files ({leftovers[0]}, ...) but no MANIFEST: refusing to overwrite",
                reason=Reason.NOT_A_LOG, path=self.path)
        self.manifest = Manifest.new(dict(meta))
        self.manifest.next_segment_id = 1
        self.manifest.segments = [(0, 0)]
        self._seg_id = 0
        self._seg = create_segment(self._seg_path(0), self.manifest.log_id, 0, 0,
                                   factory=self._factory)
        self._idx = IndexFile.create(self._idx_path(0), self.manifest.log_id, 0, 0,
                                     factory=self._factory)
        self._seg_records = 0
        publish_manifest(self.path, self.manifest)  # the lock file excludes other writers
        self.last_step = -1
        self.durable_step: int | None = None

    def _open_existing(self) -> None:
        self.manifest = load_manifest(self.path)
        if not self.manifest.segments:  # checked before garbage collection trusts it
            raise ManifestError("manifest names no segment: nowhere to append",
                                reason=Reason.BAD_METADATA,
                                path=os.path.join(self.path, MANIFEST_NAME))
        self._collect_garbage()
        with LogReader(self.path, strict=True) as reader:
            last = len(self.manifest.segments) - 1
            rows_by_seg: dict[int, np.ndarray] = {}
            for i, (sid, _first) in enumerate(self.manifest.segments):
                mask = reader._seg_of == i
                rows_by_seg[sid] = np.stack([reader.steps[mask], reader._offsets[mask],
                                             reader._lengths[mask]], axis=1)
            rebuilt = set(reader.report.index_rebuilt)
            unindexed = reader.report.unindexed_records
            steps = reader.steps
            self.last_step = int(steps[-1]) if len(steps) else -1
            if self.manifest.bases:
                self.last_step = max(self.last_step, self.manifest.bases[-1])
        sid, first = self.manifest.segments[last]
        rows = rows_by_seg[sid]
        valid_end = int(rows[-1, 1] + rows[-1, 2]) if len(rows) else 64
        self._seg_id = sid
        self._seg = self._factory(self._seg_path(sid))
        if self._seg.size > valid_end:  # torn tail: never durable, cut before appending
            self._seg.truncate(valid_end)
        self._seg.sync()  # records that survived unsynced are durable from here on
        self._seg_records = len(rows)
        # The active index must hold exactly one entry per record before anything is
        # appended to it: entries past its valid prefix (naming bytes cut from the segment,
        # or torn) would sit before the new ones, and a reader that finds them valid again
        # once the segment has grown would trust them over the records now there.
        try:
            idx_size = os.path.getsize(self._idx_path(sid))
        except OSError:
            idx_size = -1
        exact = idx_size == FILE_HEADER_SIZE + INDEX_ENTRY_SIZE * len(rows)
        for s, r in rows_by_seg.items():
            if s in rebuilt or (s == sid and (unindexed or not exact)):
                ents = make_entries([(int(x[0]), int(x[1]), int(x[2])) for x in r], s,
                                    self.manifest.log_id)
                f = IndexFile.reopen(self._idx_path(s), self.manifest.log_id, s,
                                     self._first_of(s), ents, factory=self._factory)
                if s == sid:
                    self._idx = f
                else:
                    f.close()
        if not hasattr(self, "_idx"):
            self._idx = IndexFile(self._factory(self._idx_path(sid)), sid,
                                  self.manifest.log_id)
        self.durable_step = self.last_step if self.last_step >= 0 else None
        del first

    def _first_of(self, sid: int) -> int:
        return dict(self.manifest.segments)[sid]

    def _collect_garbage(self) -> None:
        """Delete what no manifest references: temp files and unreferenced log files
        (left by a crash between writing a file and publishing the manifest). Skipped while
        a compaction (another process) holds ``COMPACT.lock``: its files are in flight."""
        fd = try_lock(self.path, "COMPACT.lock")
        if fd is None:
            return
        try:
            self._collect_garbage_locked()
        finally:
            os.close(fd)

    def _collect_garbage_locked(self) -> None:
        collect_garbage(self.path, self.manifest)

    def _seg_path(self, sid: int) -> str:
        return os.path.join(self.path, SEGMENT_NAME.format(sid))

    def _idx_path(self, sid: int) -> str:
        return os.path.join(self.path, INDEX_NAME.format(sid))

    # ------------------------------------------------------------------ appending

    def _check_open(self) -> None:
        if self._closed:
            raise LowdiffError("writer is closed", reason=Reason.WRITER_CLOSED, path=self.path)
        if self._failed is not None:
            raise LowdiffError(f"writer failed earlier ({self._failed}); reopen the log to "
                               "go on from its durable step", reason=Reason.WRITER_FAILED,
                               path=self.path)

    @staticmethod
    def build(step: int, tensors: Sequence[TensorInput], *, kind: str,
              side: Mapping[str, Any] | None = None,
              extra: Mapping[str, Any] | None = None) -> RecordBytes:
        """Lay out a record (pure; no I/O). See :func:`build_record`."""
        return build_record(step, tensors, kind=kind, side=side, extra=extra)

    def append(self, step: int, tensors: Sequence[TensorInput], *, kind: str,
               side: Mapping[str, Any] | None = None,
               extra: Mapping[str, Any] | None = None) -> int:
        """Append one record (not yet durable: call :meth:`sync`). Returns its size."""
        self._check_open()
        rec = build_record(step, tensors, kind=kind, side=side, extra=extra, checksum=False)
        if rec.length < OVERLAP_CRC_BYTES:
            finish_record(rec)
            self._write([rec], None)
        else:
            self._write([rec], rec)
        return rec.length

    def write_records(self, records: Sequence[RecordBytes]) -> None:
        """Append records in one write (group commit). Steps must increase."""
        self._write(records, None)

    def _write(self, records: Sequence[RecordBytes], deferred: RecordBytes | None) -> None:
        """Write ``records``. ``deferred`` (the only record then, built without its CRC)
        has its CRC computed on the helper thread during the write, then stored in place."""
        self._check_open()
        if not records:
            return
        prev = self.last_step
        for r in records:
            if r.step <= prev:
                raise ConfigError(f"step {r.step} does not follow step {prev}",
                                  reason=Reason.STEP_OUT_OF_ORDER, path=self.path)
            prev = r.step
        total = sum(r.length for r in records)
        if self._seg_records and self._seg.size + total > self.segment_bytes:
            self._roll(records[0].step)
        chunks = [c for r in records for c in r.chunks]
        t0 = time.perf_counter()
        crc = None
        if deferred is not None:
            assert len(records) == 1
            assert records[0] is deferred
            if self._crc_pool is None:
                self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="lowdiff-crc")
            crc = self._crc_pool.submit(record_crc, deferred)
        try:
            try:
                start = self._seg.append(chunks)
            finally:
                if crc is not None:  # also on failure: the thread reads the caller's buffers
                    assert deferred is not None
                    finish_record(deferred, crc.result())
            if deferred is not None:
                self._seg.rewrite_unsynced(start + 4, bytes(deferred.chunks[0][4:8]))
        except LowdiffError as e:
            # What the failed write left (never durable) stays a torn tail, cut when the log
            # is next opened; writing after it would bury it mid-log, so the writer is failed.
            self._failed = e
            raise
        self.stats["write_s"] += time.perf_counter() - t0
        off = start
        for r in records:
            self._pending.append((r.step, off, r.length))
            off += r.length
        self._seg_records += len(records)
        self.last_step = records[-1].step
        self.stats["bytes"] += total
        self.stats["records"] += len(records)
        self.stats["writes"] += 1

    def sync(self) -> int | None:
        """Make every appended record durable; returns :attr:`durable_step`.

        A failed fdatasync fails the writer: the kernel may have dropped the dirty pages and
        a later fdatasync could succeed without them, so no later step is ever reported
        durable (reopen the log to go on from what is really on disk)."""
        self._check_open()
        t0 = time.perf_counter()
        try:
            self._seg.sync()
        except LowdiffError as e:
            self._failed = e
            raise
        self.stats["sync_s"] += time.perf_counter() - t0
        self.stats["syncs"] += 1
        # Index entries go out in groups: the index is a cache, and a crash only means the
        # newest (at most INDEX_GROUP) durable records are found by the tail scan instead.
        if len(self._pending) >= INDEX_GROUP:
            self._flush_index()
        if self.last_step >= 0:
            self.durable_step = self.last_step
        return self.durable_step

    flush = sync

    def _flush_index(self) -> None:
        """Append the index entries of records already durable."""
        if self._pending:
            self._idx.append(self._pending)
            self._pending = []

    def _roll(self, first_step: int) -> None:
        """Seal the active segment (durable, fully indexed) and start a new one."""
        self.sync()
        try:
            self._flush_index()
            self._idx.file.sync()
        finally:
            self._idx.close()
            self._seg.close()
        with self._mlock:
            sid = load_manifest(self.path).next_segment_id
            self._seg = create_segment(self._seg_path(sid), self.manifest.log_id, sid,
                                       first_step, factory=self._factory)
            self._idx = IndexFile.create(self._idx_path(sid), self.manifest.log_id, sid,
                                         first_step, factory=self._factory)

            def add_segment(m: Manifest) -> None:
                m.next_segment_id = max(m.next_segment_id, sid + 1)
                m.segments.append((sid, first_step))

            self.manifest = update_manifest(self.path, add_segment)
        self._seg_id = sid
        self._seg_records = 0
        self.stats["rolls"] += 1

    # ------------------------------------------------------------------ bases

    def write_base(self, step: int, tensors: Mapping[str, tuple[str, np.ndarray]],
                   meta: Mapping[str, Any] | None = None) -> int:
        """Write the full state at ``step`` as a base and publish it. Returns its size
        (0 when a base at ``step`` is already live, e.g. made by a compaction: the state at
        a step is unique, so it is not written twice)."""
        self._check_open()
        if step in load_manifest(self.path).bases:
            return 0
        size = write_base(os.path.join(self.path, BASE_NAME.format(step)), step, tensors,
                          dict(meta or {}), self.manifest.log_id)
        with self._mlock:
            def add_base(m: Manifest) -> None:
                m.bases = sorted(set(m.bases) | {step})

            self.manifest = update_manifest(self.path, add_base)
        # A base does not move last_step: diffs and bases are separate sequences, and a
        # base written in the background may be published before the diff of its own step.
        return size

    def update_meta(self, meta: Mapping[str, Any]) -> None:
        """Merge keys into the log-level metadata and publish the manifest."""
        with self._mlock:
            self.manifest = update_manifest(self.path, lambda m: m.meta.update(meta))

    # ------------------------------------------------------------------ history

    def truncate_after(self, step: int) -> int:
        """Discard every diff and base after ``step`` (explicit, for restarting training
        from an earlier step). New files are written and the manifest swapped; dropped
        files are deleted only after the swap. Returns the number of records dropped."""
        self._check_open()
        self.sync()
        with LogReader(self.path, strict=True) as reader:
            keep = reader.steps <= step
            dropped = int((~keep).sum())
            rows = [(int(s), int(reader._seg_of[i])) for i, s in enumerate(reader.steps)]
            offsets, lengths = reader._offsets.copy(), reader._lengths.copy()
        if dropped == 0 and all(b <= step for b in self.manifest.bases):
            return 0
        old_segments = list(self.manifest.segments)
        # the segment holding the first dropped record, and those after it, go away
        first_drop = next(i for i, (s, _si) in enumerate(rows) if s > step) if dropped else None
        cut_seg = rows[first_drop][1] if first_drop is not None else len(old_segments) - 1
        kept_segments = old_segments[:cut_seg]
        prefix_rows = [(s, int(offsets[i]), int(lengths[i])) for i, (s, si) in enumerate(rows)
                       if si == cut_seg and s <= step]
        sid_old, first_old = old_segments[cut_seg]
        self._pending = []  # the indexes of the cut segments are rebuilt below or deleted
        self._idx.close()
        self._seg.close()
        with self._mlock:
            sid = self.manifest.next_segment_id
            new_seg = create_segment(self._seg_path(sid), self.manifest.log_id, sid,
                                     first_old, factory=self._factory)
            if prefix_rows:
                end = prefix_rows[-1][1] + prefix_rows[-1][2]
                with open(self._seg_path(sid_old), "rb") as fh:
                    fh.seek(64)
                    new_seg.append([fh.read(end - 64)])
                new_seg.sync()
            ents = make_entries(prefix_rows, sid, self.manifest.log_id)
            self._idx = IndexFile.reopen(self._idx_path(sid), self.manifest.log_id, sid,
                                         first_old, ents, factory=self._factory)
            dropped_bases = [b for b in self.manifest.bases if b > step]

            def cut(m: Manifest) -> None:
                m.next_segment_id = max(m.next_segment_id, sid + 1)
                # from the reloaded manifest: a compaction may have dropped some meanwhile
                kept_ids = {s for s, _f in kept_segments}
                m.segments = [*(s for s in m.segments if s[0] in kept_ids), (sid, first_old)]
                m.bases = [b for b in m.bases if b <= step]

            self.manifest = update_manifest(self.path, cut)
        self._seg = new_seg
        self._seg_id = sid
        self._seg_records = len(prefix_rows)
        for s, _f in old_segments[cut_seg:]:
            for p in (self._seg_path(s), self._idx_path(s)):
                try:
                    os.unlink(p)
                except OSError:
                    pass
        for b in dropped_bases:
            try:
                os.unlink(os.path.join(self.path, BASE_NAME.format(b)))
            except OSError:
                pass
        fsync_dir(self.path)
        self.last_step = max([s for s, _si in rows if s <= step] + [b for b in
                             self.manifest.bases] + [-1])
        self.durable_step = self.last_step if self.last_step >= 0 else None
        return dropped

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Sync, close files and release the lock. Idempotent."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self.sync()
                self._flush_index()
                self._idx.file.sync()
        finally:
            self._closed = True
            self._stop_crc_pool()
            self._idx.close()
            self._seg.close()
            self._lock.release()

    def _stop_crc_pool(self) -> None:
        if self._crc_pool is not None:
            self._crc_pool.shutdown(wait=True)
            self._crc_pool = None

    def abandon(self) -> None:
        """Close without syncing (after a fatal I/O error). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_crc_pool()
        for f in (self._idx, self._seg):
            try:
                f.close()
            except Exception:
                pass
        self._lock.release()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def collect_garbage(path: str, manifest: Manifest) -> None:
    """Delete files of ``path`` that ``manifest`` does not reference, and ``*.tmp`` files.
    The caller must exclude concurrent writers and compactions (their locks)."""
    live_segs = {s for s, _f in manifest.segments}
    live_bases = set(manifest.bases)
    for name in os.listdir(path):
        m_seg, m_idx, m_base = SEGMENT_RE.match(name), INDEX_RE.match(name), BASE_RE.match(name)
        dead = (name.endswith(".tmp")
                or (m_seg is not None and int(m_seg.group(1)) not in live_segs)
                or (m_idx is not None and int(m_idx.group(1)) not in live_segs)
                or (m_base is not None and int(m_base.group(1)) not in live_bases))
        if dead:
            try:
                os.unlink(os.path.join(path, name))
            except OSError:
                pass


__all__ = ["DEFAULT_SEGMENT_BYTES", "LogWriter", "collect_garbage"]
