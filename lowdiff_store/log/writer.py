"""The synchronous log writer: append records, make them durable, roll segments, publish
bases, cut history explicitly. The asynchronous writer (:mod:`lowdiff_store.writer`)
stages and batches on top of it.

Durability: :meth:`LogWriter.sync` fdatasyncs the active segment; when it returns, every
record appended before is durable and :attr:`durable_step` says up to which step. A store
that makes synced bytes durable later (an ``s3://`` log uploads at most every
``upload_interval_s``) reports how many are durable (the handle's ``durable_size``), and
:attr:`durable_step` follows that: it never names a step the store does not hold yet;
:attr:`flush_due` says when a :meth:`sync` will catch up and :meth:`flush` forces it. Index
entries are appended only for synced records (the index is a cache and is never fsynced
on the hot path). Segment creation, bases and the manifest are fsynced with their
directory.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from ..errors import ConfigError, FormatError, LowdiffError, ManifestError, Reason
from ..format.checksum import crc32c, crc32c_chunks
from ..format.constants import (
    ALIGN,
    BASE_NAME,
    BASE_RE,
    FILE_HEADER_SIZE,
    INDEX_ENTRY_SIZE,
    INDEX_NAME,
    INDEX_RE,
    LOCK_NAME,
    MANIFEST_NAME,
    SEGMENT_NAME,
    SEGMENT_RE,
    SLICE_NAME,
    SLICE_RE,
    TMP_SUFFIX,
)
from ..format.record import RecordBytes, TensorInput, build_record, finish_record, record_crc
from ..storage import AppendFile, Store, StoreLike, open_store
from .base import BaseTensors, store_base
from .index import IndexFile, index_file_size, make_entries
from .manifest import (
    MAX_MANIFEST_FILE_BYTES,
    Manifest,
    create_manifest,
    load_manifest,
    update_manifest,
)
from .reader import LogReader
from .segment import create_segment

_log = logging.getLogger(__name__)

#: a streamed base: its complete step and the steps of its slices (the last the complete one)
SliceOf = tuple[int, tuple[int, ...]]
_T = TypeVar("_T")

#: The lock a compaction holds while it runs (its files are in flight: no garbage
#: collection meanwhile).
COMPACT_LOCK_NAME = "COMPACT.lock"

#: Default size at which the active segment is sealed and a new one started.
DEFAULT_SEGMENT_BYTES = 256 << 20

#: A write of at least this many bytes to a local segment on Linux is *streamed*: it goes
#: to the page cache in runs (:func:`writeback_run_bytes`), each handed to the disk as
#: soon as it is written. A record this large appended alone (:meth:`LogWriter.append`)
#: is also written before its CRC: with its first 64 bytes zero, the CRC computed run by
#: run, and the first 64 bytes (header and CRC) written in place last, before anything can
#: be synced (spec section 8). Group commits (:meth:`LogWriter.write_records`, the
#: asynchronous writer's path) stream their records, CRCs already in place. Measured on 2
#: cores in bench/RESULTS.md ("Streamed appends").
WRITEBACK_CRC_BYTES = 512 << 10

#: The smallest run in which a streamed write goes out: the kernel is told to start
#: writing each run to the disk as soon as it is in the page cache (``sync_file_range``),
#: and a record's CRC takes the run while it is still in the CPU's cache. The disk takes
#: run k while the CPU copies run k+1, so most of the bytes are on the disk when the sync
#: starts, and the CRC costs no second read of the record from memory. Runs end at file
#: offsets that are multiples of the run (a multiple of the page size), and only whole
#: pages are handed to the disk, so no page goes to the disk twice.
WRITEBACK_RUN_BYTES = 256 << 10

#: A streamed write takes at most about this many runs: the run doubles from
#: :data:`WRITEBACK_RUN_BYTES` until it does (:func:`writeback_run_bytes`). Each handed-over
#: run costs the filesystem a block allocation and the kernel an I/O submission, work
#: that lands beside training: an 82 MB record in 256 KiB runs slowed the training step
#: beside the writer by 5% (bench/RESULTS.md), in 8 MiB runs not measurably.
WRITEBACK_RUNS = 16

#: Where the writeback hint is not available (another store, another OS), a record at
#: least this large has its CRC computed on a helper thread while it is being written
#: (gains 5-8% of append throughput on 32 MiB records, nothing or a few % lost to the
#: thread hand-off and memory-bandwidth contention on 8 MiB ones).
OVERLAP_CRC_BYTES = 16 << 20


class LogWriter:
    """Appends diff records and bases to the log at ``path`` (a directory, a URL or a
    :class:`~lowdiff_store.storage.Store`; created if needed).

    One writer per log (an exclusive lock on ``LOCK``). Opening an existing log cuts a
    torn tail left by a crash and re-indexes records that survived unindexed; a log with
    corruption before its tail is refused (run ``lowdiff-store verify``).

    Thread-safety: one thread appends and syncs; :meth:`write_base` may run on another.
    ``file_factory``: the :class:`~lowdiff_store.storage.AppendFile` class of a local
    log's segment and index files (fault injection in tests).
    """

    def __init__(self, path: StoreLike, *, meta: Mapping[str, Any] | None = None,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 file_factory: type[AppendFile] | None = None) -> None:
        if segment_bytes < 4096:
            raise ConfigError(f"segment_bytes={segment_bytes} is too small (>= 4096)")
        if isinstance(path, Store) and file_factory not in (None, AppendFile):
            raise ConfigError("file_factory applies to a path, not to a given store")
        #: Where the log lives; every file access goes through it.
        self.store: Store = open_store(path, append_file=file_factory)
        self.path = self.store.url
        self.segment_bytes = segment_bytes
        self._mlock = threading.Lock()  # guards the manifest
        self._closed = False
        self._failed: LowdiffError | None = None  # a write or sync failed: no more appends
        self._crc_pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, int, int]] = []
        # (end offset in the active segment, step) of records synced, not yet durable
        self._undurable: collections.deque[tuple[int, int]] = collections.deque()
        self.stats: dict[str, float] = {"bytes": 0, "records": 0, "writes": 0, "syncs": 0,
                                        "write_s": 0.0, "sync_s": 0.0, "rolls": 0,
                                        "streamed_incomplete": 0}
        #: the slices this writer wrote that no manifest names yet (a streamed base in
        #: progress, or abandoned: removed at close)
        self.slices_written: set[int] = set()
        try:
            self.store.ensure_root()  # the new directory is durable in its parent
        except LowdiffError as e:
            if e.reason in (Reason.STORE_UNAVAILABLE, Reason.UNSAFE_STORE):
                raise  # an object store's own line (unreachable; conditional writes ignored)
            raise LowdiffError(f"cannot create log directory: {e.detail}",
                               reason=Reason.IO_ERROR, path=self.path) from e
        lock = self.store.try_lock(LOCK_NAME)
        if lock is None:
            raise LowdiffError("another writer holds this log (LOCK is taken)",
                               reason=Reason.LOCKED, path=self.store.path_of(LOCK_NAME))
        self._lock = lock
        try:
            # read_versioned, not exists: a store without rename keeps MANIFEST.<seq>
            if self.store.read_versioned(MANIFEST_NAME, max_bytes=MAX_MANIFEST_FILE_BYTES) \
                    is not None:
                self._open_existing()
            else:
                self._create(meta or {})
        except BaseException:
            self._lock.release()
            raise

    # ------------------------------------------------------------------ open / create

    def _create(self, meta: Mapping[str, Any]) -> None:
        names = _without_creation_residue(self.store)
        leftovers = [n for n in names
                     if SEGMENT_RE.match(n) or BASE_RE.match(n) or SLICE_RE.match(n)]
        if leftovers:
            raise LowdiffError(
                f"log files ({leftovers[0]}, ...) but no MANIFEST: refusing to overwrite",
                reason=Reason.NOT_A_LOG, path=self.path)
        self.manifest = Manifest.new(dict(meta))
        self.manifest.next_segment_id = 1
        self.manifest.segments = [(0, 0)]
        self._seg_id = 0
        self._seg = create_segment(self.store, SEGMENT_NAME.format(0), self.manifest.log_id,
                                   0, 0)
        self._idx = IndexFile.create(self.store, INDEX_NAME.format(0), self.manifest.log_id,
                                     0, 0)
        self._seg_records = 0
        create_manifest(self.store, self.manifest)  # the lock excludes other writers
        self.last_step = -1
        self.durable_step: int | None = None

    def _open_existing(self) -> None:
        self.manifest = load_manifest(self.store)
        if not self.manifest.segments:  # checked before garbage collection trusts it
            raise ManifestError("manifest names no segment: nowhere to append",
                                reason=Reason.BAD_METADATA,
                                path=self.store.path_of(MANIFEST_NAME))
        _collect_garbage(self.store, self.manifest)
        with LogReader(self.store, strict=True) as reader:
            last = len(self.manifest.segments) - 1
            table = reader.record_table()
            rows_by_seg: dict[int, np.ndarray] = {
                sid: table[table[:, 1] == sid][:, [0, 2, 3]]
                for sid, _first in self.manifest.segments}
            rebuilt = set(reader.report.index_rebuilt)
            unindexed = reader.report.unindexed_records
            steps = reader.steps
            self.last_step = int(steps[-1]) if len(steps) else -1
            if self.manifest.base_steps():
                self.last_step = max(self.last_step, self.manifest.base_steps()[-1])
        sid, first = self.manifest.segments[last]
        rows = rows_by_seg[sid]
        valid_end = int(rows[-1, 1] + rows[-1, 2]) if len(rows) else 64
        self._seg_id = sid
        self._seg = self.store.open_append(SEGMENT_NAME.format(sid))
        if self._seg.size > valid_end:  # torn tail: never durable, cut before appending
            self._seg.truncate(valid_end)
        self._seg.sync()  # records that survived unsynced are durable from here on
        self._seg_records = len(rows)
        # The active index must hold exactly one entry per record before anything is
        # appended to it: entries past its valid prefix (naming bytes cut from the segment,
        # or torn) would sit before the new ones, and a reader that finds them valid again
        # once the segment has grown would trust them over the records now there.
        idx_size = index_file_size(self.store, INDEX_NAME.format(sid))
        exact = idx_size == FILE_HEADER_SIZE + INDEX_ENTRY_SIZE * len(rows)
        self._idx = _reindex(self.store, self.manifest, rows_by_seg,
                             rebuilt | ({sid} if unindexed or not exact else set()), sid)
        self.durable_step = self.last_step if self.last_step >= 0 else None
        del first

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
        late = WRITEBACK_CRC_BYTES if self._writeback() else OVERLAP_CRC_BYTES
        if rec.length < late:
            finish_record(rec)
            self._write([rec], None)
        else:
            self._write([rec], rec)
        return rec.length

    def _writeback(self) -> bool:
        """The active segment can start writeback (see :data:`WRITEBACK_CRC_BYTES`)."""
        return isinstance(self._seg, AppendFile) and self._seg.can_start_writeback()

    def write_records(self, records: Sequence[RecordBytes]) -> None:
        """Append records in one write (group commit). Steps must increase."""
        self._write(records, None)

    def _write(self, records: Sequence[RecordBytes], deferred: RecordBytes | None) -> None:
        """Write ``records``. ``deferred`` (the only record then, built without its CRC)
        has its CRC computed while the disk or the page cache takes the record (see
        :meth:`_write_deferred`)."""
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
        chunks = [c for r in records for c in r.chunks]
        try:
            # A roll that failed midway leaves no active segment to write to.
            if self._seg_records and self._seg.size + total > self.segment_bytes:
                self._roll_or_defer(records[0].step)
            t0 = time.perf_counter()
            if deferred is None:
                start = self._append(chunks, total)
            else:
                assert len(records) == 1
                assert records[0] is deferred
                start = self._write_deferred(deferred, chunks)
        except BaseException as e:
            # What the failed write left (never durable) stays a torn tail, cut when the log
            # is next opened; writing after it would bury it mid-log, so the writer is failed
            # (also when something else, a KeyboardInterrupt, stopped it between two runs).
            self._failed = e if isinstance(e, LowdiffError) else LowdiffError(
                f"a write was interrupted: {e!r}", reason=Reason.WRITER_FAILED,
                path=self.path)
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

    def _streams(self, total: int) -> bool:
        """A write of ``total`` bytes goes out in runs handed to the disk as they are
        written (see :data:`WRITEBACK_RUN_BYTES`)."""
        return total >= WRITEBACK_CRC_BYTES and self._writeback()

    def _append(self, chunks: Sequence[Any], total: int) -> int:
        """Append complete records (their CRCs are in place); returns their offset."""
        if not self._streams(total):
            return self._seg.append(chunks)
        return self._append_runs(chunks)[0]

    def _append_runs(self, chunks: Sequence[Any], crc: int | None = None
                     ) -> tuple[int, int | None]:
        """Append ``chunks`` in runs that end at file offsets that are multiples of
        :func:`writeback_run_bytes`, each handed to the disk once written. With ``crc``
        (a record written before its CRC), the first ``ALIGN`` bytes are rewritten later:
        they are never handed to the disk, and the CRC is continued over every byte after
        them, run by run, while each is still in the CPU's cache. Returns the offset the
        chunks start at and the CRC (or None)."""
        seg = self._seg
        assert isinstance(seg, AppendFile)
        start = seg.size
        keep = start + (ALIGN if crc is not None else 0)  # hinted and CRC'd from here on
        total = sum(memoryview(c).nbytes for c in chunks)
        for off, views in _runs(chunks, start, writeback_run_bytes(total)):
            seg.append(views)
            end = off + sum(v.nbytes for v in views)
            if crc is not None:
                crc = crc32c_chunks(_skip(views, keep - off) if off < keep else views, crc)
            if end > keep:
                seg.start_writeback(max(off, keep), end - max(off, keep))
        return start, crc

    def _write_deferred(self, rec: RecordBytes, chunks: list[Any]) -> int:
        """Append ``rec``, whose CRC is computed meanwhile, then stored: the record goes out
        with its first 64 bytes zero, and those bytes, CRC included, are written last. A
        power cut between the two leaves an aligned block of zeros where the record starts:
        a lost write (spec section 8), never a complete record with a wrong CRC followed by
        valid ones. Returns the offset the record starts at."""
        out: list[bytes | memoryview] = [bytes(ALIGN), *_skip(chunks, ALIGN)]
        if self._streams(rec.length):
            # each run is added to the CRC while the CPU still has it cached; the CRC starts
            # with the record's first 64 bytes after the CRC field (record_crc's rule)
            head = b"".join(bytes(c) for c in _take(chunks, ALIGN))
            start, crc = self._append_runs(out, crc32c(head[8:]))
            assert crc is not None
            finish_record(rec, crc)
        else:
            if self._crc_pool is None:
                self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="lowdiff-crc")
            fut = self._crc_pool.submit(record_crc, rec)
            try:
                start = self._seg.append(out)
            finally:  # also on failure: the thread reads the caller's buffers
                finish_record(rec, fut.result())
        # the page holding the record's first bytes was never handed to the disk (see
        # AppendFile.start_writeback): rewritten now, it goes out once, with the next sync
        self._seg.rewrite_unsynced(start, b"".join(bytes(c) for c in _take(chunks, ALIGN)))
        return start

    def sync(self) -> int | None:
        """Make every appended record durable (or taken, for a store that makes it durable
        later: see the module docstring); returns :attr:`durable_step`.

        A failed fdatasync fails the writer: the kernel may have dropped the dirty pages and
        a later fdatasync could succeed without them, so no later step is ever reported
        durable (reopen the log to go on from what is really on disk)."""
        self._check_open()
        self._sync(self._seg.sync)
        return self.durable_step

    def flush(self) -> int | None:
        """:meth:`sync`, and make every record durable now (an upload for a store that
        defers it); returns :attr:`durable_step`."""
        self._check_open()
        self._sync(self._seg.flush, flush=True)
        return self.durable_step

    @property
    def flush_due(self) -> float | None:
        """``time.monotonic()`` from which a :meth:`sync` makes the records synced but not
        yet durable durable; None when there are none."""
        return self._seg.flush_due if self._undurable else None

    def _sync(self, how: Callable[[], None], *, flush: bool = False) -> None:
        # the index entries are encoded while the CPU is warm, before the wait on the disk
        # (after it, on a VM, the first hundred microseconds of Python run cold)
        entries = self._idx.encode(self._pending) if self._pending else b""
        t0 = time.perf_counter()
        try:
            how()
        except LowdiffError as e:
            # An upload an unreachable store refused at an explicit flush lost nothing (the
            # bytes stay staged; a store's sync absorbs an outage until its budget runs
            # out): the writer goes on, and a later sync or flush uploads them.
            if not (flush and e.reason is Reason.STORE_UNAVAILABLE):
                self._failed = e
            raise
        self.stats["sync_s"] += time.perf_counter() - t0
        self.stats["syncs"] += 1
        self._undurable.extend((off + n, step) for step, off, n in self._pending)
        # The index entries of the records just synced go out now (one small write,
        # not synced): past the last indexed record of the active segment, recovery treats
        # the first bad record as the end of the log (spec section 8), so the index is what
        # tells a durable record that rotted from a write a power cut lost.
        durable = self._seg.durable_size
        while self._undurable and self._undurable[0][0] <= durable:
            self.durable_step = self._undurable.popleft()[1]
        try:
            self._flush_index(entries)
        except LowdiffError as e:
            # The records are durable (durable_step says so) but the index no longer has
            # one entry per record: the writer stops; the next open rebuilds the index.
            self._failed = e
            raise

    def _flush_index(self, data: bytes | None = None) -> None:
        """Append the index entries of records already durable (``data``: their bytes,
        encoded ahead)."""
        if self._pending:
            self._idx.append(self._pending, data)
            self._pending = []

    def _roll_or_defer(self, first_step: int) -> None:
        """Roll, unless the store is in an outage (an object store that does not answer):
        then the active segment grows past ``segment_bytes`` until it answers again, since
        sealing it needs the store (an upload and a manifest commit). An outage that starts
        inside the roll itself is waited out there (:meth:`_waiting_out`)."""
        if getattr(self._seg, "outage_since", None) is not None:
            return
        try:
            self.flush()
            load_manifest(self.store)  # the store answers: the roll's requests should too
        except LowdiffError as e:
            if e.reason is not Reason.STORE_UNAVAILABLE or self._failed is not None:
                raise
            return  # the outage starts now: nothing changed yet
        self._roll(first_step)

    def _roll(self, first_step: int) -> None:
        """Seal the active segment (durable, fully indexed) and start a new one. Each step
        that needs the store is waited out if the store stops answering meanwhile (each is
        safe to repeat: an upload retries its range and token, a create that failed created
        nothing, and the manifest change is idempotent)."""
        self.flush()
        assert not self._undurable
        wait = functools.partial(_waiting_out, self.store, self.path)
        try:
            self._flush_index()
            wait("seal", self._idx.seal)
            wait("seal", self._seg.seal)  # nothing new: sealing makes it final
        finally:
            self._idx.close()
            self._seg.close()
        with self._mlock:
            sid = wait("roll", lambda: load_manifest(self.store).next_segment_id)
            log_id = self.manifest.log_id
            self._seg = wait("roll", lambda: create_segment(
                self.store, SEGMENT_NAME.format(sid), log_id, sid, first_step))
            self._idx = wait("roll", lambda: IndexFile.create(
                self.store, INDEX_NAME.format(sid), log_id, sid, first_step))

            def add_segment(m: Manifest) -> None:
                m.next_segment_id = max(m.next_segment_id, sid + 1)
                if (sid, first_step) not in m.segments:  # (a commit whose answer was lost)
                    m.segments.append((sid, first_step))

            self.manifest = wait("roll", lambda: update_manifest(self.store, add_segment))
        self._seg_id = sid
        self._seg_records = 0
        self.stats["rolls"] += 1

    # ------------------------------------------------------------------ bases

    def write_base(self, step: int, tensors: BaseTensors,
                   meta: Mapping[str, Any] | None = None, crcs: Mapping[str, int] | None = None
                   ) -> int:
        """Write the full state at ``step`` as a base and publish it (``crcs``: CRC32Cs of
        tensors already computed by their copy). Returns its size (0 when a base at ``step``
        is already live, e.g. made by a compaction: the state at a step is unique).

        With the key ``"slice"`` in ``meta`` (``{"base": complete step, "steps": [slice
        steps]}``, spec section 7.2) the tensors are one slice of that streamed base, taken
        after ``step``: written durably as ``slice-<step>``, named by no manifest until the
        base's last slice is written; that one commits the base."""
        self._check_open()
        streamed = slice_of(meta or {})
        if streamed is not None:
            return _write_slice(self, step, tensors, meta, crcs, streamed)
        if step in load_manifest(self.store).bases:
            return 0
        size = store_base(self.store, step, tensors, dict(meta or {}), self.manifest.log_id,
                          crcs)
        with self._mlock:
            def add_base(m: Manifest) -> None:
                m.bases = sorted(set(m.bases) | {step})

            self.manifest = update_manifest(self.store, add_base)
        # A base does not move last_step: diffs and bases are separate sequences, and a
        # base written in the background may be published before the diff of its own step.
        return size

    def update_meta(self, meta: Mapping[str, Any]) -> None:
        """Merge keys into the log-level metadata and publish the manifest."""
        with self._mlock:
            self.manifest = update_manifest(self.store, lambda m: m.meta.update(meta))

    # ------------------------------------------------------------------ history

    def truncate_after(self, step: int) -> int:
        """Discard every diff and base after ``step`` (explicit, for restarting training
        from an earlier step). New files are written and the manifest swapped; dropped
        files are deleted only after the swap. Returns the number of records dropped."""
        return _truncate_after(self, step)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Sync, close files and release the lock. Idempotent."""
        if self._closed:
            return
        flushed = False
        try:
            if self._failed is None:
                self.flush()
                self._flush_index()
                self._idx.flush()
            flushed = True
        finally:
            self._closed = True
            # the slices of a streamed base that will not complete: no manifest names them
            live = self.manifest.slice_steps()
            _delete_quietly(self.store, [], [], [s for s in self.slices_written if s not in live])
            self._stop_crc_pool()
            # Every file is closed and the lock released even when a close fails (an
            # object store's close may upload): a lock left held would refuse every later
            # writer of this log in this process.
            err: LowdiffError | None = None
            for f in (self._idx, self._seg):
                try:
                    f.close()
                except LowdiffError as e:
                    err = err or e
            self._lock.release()
            if flushed and err is not None:
                raise err

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



def _waiting_out(store: Store, path: str, what: str, fn: Callable[[], _T]) -> _T:
    """``fn()``, repeated while the store does not answer (``store_unavailable``), with
    a backoff of 0.5 s doubling up to 15 s, for at most the store's
    ``outage_budget_s`` (0 for a local directory: no repeat). ``fn`` must be safe to
    repeat after it failed. The writer's caller waits meanwhile (the asynchronous
    writer's memory budget then holds training back)."""
    start = time.monotonic()
    delay = 0.5
    warned = False
    while True:
        try:
            return fn()
        except LowdiffError as e:
            if e.reason is not Reason.STORE_UNAVAILABLE or \
                    time.monotonic() - start + delay > store.outage_budget_s:
                raise
            if not warned:
                warned = True
                _log.warning("%s: %s waits for the store: %s", path, what, e)
            time.sleep(delay)
            delay = min(2 * delay, 15.0)


def _cut_plan(table: np.ndarray, segments: Sequence[tuple[int, int]], step: int
              ) -> tuple[int, list[tuple[int, int]], int, list[tuple[int, int, int]]]:
    """What :meth:`LogWriter.truncate_after` cuts, from the record table: the number of
    records after ``step``, (step, segment position) per record, the position of the
    segment holding the first dropped record (it and those after it go away; the last
    segment when none is dropped), and (step, offset, length) of its records kept."""
    position = {sid: i for i, (sid, _f) in enumerate(segments)}
    dropped = int((table[:, 0] > step).sum())
    rows = [(int(r[0]), position[int(r[1])]) for r in table]
    offsets, lengths = table[:, 2], table[:, 3]
    first_drop = next(i for i, (s, _si) in enumerate(rows) if s > step) if dropped else None
    cut_seg = rows[first_drop][1] if first_drop is not None else len(segments) - 1
    prefix = [(s, int(offsets[i]), int(lengths[i])) for i, (s, si) in enumerate(rows)
              if si == cut_seg and s <= step]
    return dropped, rows, cut_seg, prefix


def _copy_prefix(store: Store, sid_old: int, prefix_rows: Sequence[tuple[int, int, int]],
                 new_seg: Any) -> None:
    """Copy the kept records of segment ``sid_old`` (``prefix_rows``: step, offset, length)
    into ``new_seg`` and make them durable."""
    if not prefix_rows:
        return
    end = prefix_rows[-1][1] + prefix_rows[-1][2]
    old = store.open(SEGMENT_NAME.format(sid_old), "pread")
    try:
        new_seg.append([old.read(FILE_HEADER_SIZE, end - FILE_HEADER_SIZE)])
    finally:
        old.close()
    new_seg.flush()


def _truncate_after(w: LogWriter, step: int) -> int:
    """The body of :meth:`LogWriter.truncate_after`."""
    w._check_open()
    w.flush()  # the reader below reads the store
    with LogReader(w.store, strict=True) as reader:
        table = reader.record_table()
    dropped, rows, cut_seg, prefix_rows = _cut_plan(table, w.manifest.segments, step)
    if dropped == 0 and all(b <= step for b in w.manifest.base_steps()):
        return 0
    old_segments = list(w.manifest.segments)
    kept_segments = old_segments[:cut_seg]
    sid_old, first_old = old_segments[cut_seg]
    w._pending = []  # the indexes of the cut segments are rebuilt below or deleted
    w._idx.close()
    w._seg.close()
    with w._mlock:
        sid = w.manifest.next_segment_id
        new_seg = create_segment(w.store, SEGMENT_NAME.format(sid),
                                 w.manifest.log_id, sid, first_old)
        _copy_prefix(w.store, sid_old, prefix_rows, new_seg)
        ents = make_entries(prefix_rows, sid, w.manifest.log_id)
        w._idx = IndexFile.reopen(w.store, INDEX_NAME.format(sid),
                                     w.manifest.log_id, sid, first_old, ents)
        dropped_bases = [b for b in w.manifest.bases if b > step]
        dropped_slices = [s for c, steps in w.manifest.streamed if c > step
                          for s in steps]

        def cut(m: Manifest) -> None:
            m.next_segment_id = max(m.next_segment_id, sid + 1)
            # from the reloaded manifest: a compaction may have dropped some meanwhile
            kept_ids = {s for s, _f in kept_segments}
            m.segments = [*(s for s in m.segments if s[0] in kept_ids), (sid, first_old)]
            m.bases = [b for b in m.bases if b <= step]
            m.streamed = [e for e in m.streamed if e[0] <= step]

        w.manifest = update_manifest(w.store, cut)
    w._seg = new_seg
    w._seg_id = sid
    w._seg_records = len(prefix_rows)
    # Deleted durably (a power cut must not bring back a segment of the dropped
    # history); a failure leaves files no manifest names, removed at the next open.
    _delete_quietly(w.store, dropped_bases, old_segments[cut_seg:], dropped_slices)
    w.last_step = max([s for s, _si in rows if s <= step] + [b for b in
                         w.manifest.base_steps()] + [-1])
    w.durable_step = w.last_step if w.last_step >= 0 else None
    return dropped


def _write_slice(w: LogWriter, step: int, tensors: BaseTensors,
                 meta: Mapping[str, Any] | None, crcs: Mapping[str, int] | None,
                 streamed: SliceOf) -> int:
    """One slice of a streamed base (see :meth:`write_base`). The base is committed
    with its last slice only if every earlier one was written by this writer (a slice
    a store skipped leaves the base incomplete: never named, the log goes on from its
    previous base, as with a skipped base)."""
    complete, steps = streamed
    if step not in steps or steps[-1] != complete:
        raise ConfigError(f"slice at step {step} is not one of the streamed base "
                          f"{complete}'s {list(steps)}", reason=Reason.INVALID_ARGUMENT)
    if complete in load_manifest(w.store).base_steps():
        return 0
    size = store_base(w.store, step, tensors, dict(meta or {}), w.manifest.log_id,
                      crcs, name=SLICE_NAME)
    w.slices_written.add(step)
    _slice_point("slice-written" if step != complete else "before-commit", step)
    if step != complete:
        return size
    missing = [s for s in steps if s not in w.slices_written]
    if missing:
        _log.warning("streamed base at step %d not published: its slice at step %d was "
                     "not written", complete, missing[0])
        w.stats["streamed_incomplete"] += 1
        return size
    with w._mlock:
        def add(m: Manifest) -> None:
            # (a compaction may have dropped the diffs after its first slice meanwhile:
            # then the base could never be replayed, and is not named)
            if not m.segments or m.segments[0][1] <= steps[0] + 1:
                m.streamed = sorted({*m.streamed, (complete, tuple(steps))})

        w.manifest = update_manifest(w.store, add)
    if complete not in w.manifest.base_steps():
        _log.warning("streamed base at step %d not published: the diffs after its first "
                     "slice (step %d) are no longer in the log", complete, steps[0])
        w.stats["streamed_incomplete"] += 1
        return size
    w.slices_written -= set(steps)
    return size


def _slice_point(point: str, step: int) -> None:
    """Fault-injection hook of the streamed-base kill tests: ``LOWDIFF_SLICE_PAUSE=SECONDS``
    (or ``SECONDS@STEP``: at that slice only) prints ``lowdiff-slice-point POINT STEP`` to
    stderr and sleeps, after a slice is durable (``slice-written``; ``before-commit`` for a
    base's last slice, before the manifest names it). Unset (the default), one dictionary
    lookup."""
    value = os.environ.get("LOWDIFF_SLICE_PAUSE")
    if value:
        delay, _at, at = value.partition("@")
        sys.stderr.write(f"lowdiff-slice-point {point} {step}\n")
        sys.stderr.flush()
        if not at or int(at) == step:
            time.sleep(float(delay))


def is_slice(meta: Mapping[str, Any] | None) -> bool:
    """Whether a base's metadata makes it one slice of a streamed base (spec section 7.2).
    A slice is no restore point: a writer may write it before its own step's diff, and it
    holds no later step back and moves no durable step (the base is complete with its
    last slice, behind its diffs)."""
    return isinstance(meta, Mapping) and meta.get("slice") is not None


def slice_of(meta: Mapping[str, Any]) -> SliceOf | None:
    """The streamed base a slice's base metadata names (its ``"slice"`` key: spec section
    7.2), or None for a base; a malformed one raises ``bad_metadata``."""
    sl = meta.get("slice")
    if sl is None:
        return None
    steps = sl.get("steps") if isinstance(sl, Mapping) else None
    c = sl.get("base") if isinstance(sl, Mapping) else None
    if (type(c) is not int or not isinstance(steps, (list, tuple)) or not steps
            or any(type(s) is not int or s < 0 for s in steps)
            or list(steps) != sorted(set(steps)) or steps[-1] != c):
        raise FormatError(f"bad slice metadata {sl!r}", reason=Reason.BAD_METADATA)
    return c, tuple(steps)


def _delete_quietly(store: Store, bases: Sequence[int],
                    segments: Sequence[tuple[int, int]], slices: Sequence[int] = ()) -> None:
    """Delete these bases, segments (with their indexes) and slices; a failure leaves
    files no manifest names, removed at the next open."""
    names = [BASE_NAME.format(b) for b in bases] + [SLICE_NAME.format(s) for s in slices]
    for sid, _first in segments:
        names += [SEGMENT_NAME.format(sid), INDEX_NAME.format(sid)]
    for name in names:
        try:
            store.delete(name)
        except LowdiffError:
            pass


def _without_creation_residue(store: Store) -> list[str]:
    """The names in ``store``, once the residue of a creation that crashed is removed: a
    crash between creating segment 0 and publishing the first manifest leaves seg-0 / its
    index holding no record (at most their header), and temp files; nothing was ever
    durable there, so they are removed and the log is created afresh."""
    names = store.list()
    residue = [n for n in names if n in (SEGMENT_NAME.format(0), INDEX_NAME.format(0))
               or n.endswith(TMP_SUFFIX)]
    if all(store.size(n) <= FILE_HEADER_SIZE for n in residue if not n.endswith(TMP_SUFFIX)):
        for n in residue:
            store.delete(n)
        names = [n for n in names if n not in residue]
    return names


def _collect_garbage(store: Store, manifest: Manifest) -> None:
    """Delete what no manifest references: temp files and unreferenced log files (left by a
    crash between writing a file and publishing the manifest). Skipped while a compaction
    (another process) holds ``COMPACT.lock``: its files are in flight."""
    lock = store.try_lock(COMPACT_LOCK_NAME)
    if lock is None:
        return
    with lock:
        collect_garbage(store, manifest)


def _reindex(store: Store, manifest: Manifest, rows_by_seg: Mapping[int, np.ndarray],
             stale: set[int], active: int) -> IndexFile:
    """Rewrite the index of every segment in ``stale`` from its records' rows (step,
    offset, length); returns the index of segment ``active``, open for appending."""
    first_of = dict(manifest.segments)
    out: IndexFile | None = None
    for s, r in rows_by_seg.items():
        if s in stale:
            ents = make_entries([(int(x[0]), int(x[1]), int(x[2])) for x in r], s,
                                manifest.log_id)
            f = IndexFile.reopen(store, INDEX_NAME.format(s), manifest.log_id, s,
                                 first_of[s], ents)
            if s == active:
                out = f
            else:
                f.close()
    if out is None:
        out = IndexFile(store.open_append(INDEX_NAME.format(active)), active, manifest.log_id)
    return out


def _take(chunks: Sequence[Any], n: int) -> list[memoryview]:
    """The first ``n`` bytes of the concatenated ``chunks``, as views."""
    out: list[memoryview] = []
    for c in chunks:
        if n <= 0:
            break
        v = memoryview(c).cast("B")
        out.append(v[:n])
        n -= len(out[-1])
    return out


def _skip(chunks: Sequence[Any], n: int) -> list[memoryview]:
    """The concatenated ``chunks`` after their first ``n`` bytes, as views."""
    out: list[memoryview] = []
    for c in chunks:
        v = memoryview(c).cast("B")
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def writeback_run_bytes(total: int) -> int:
    """The run of a streamed write of ``total`` bytes: :data:`WRITEBACK_RUN_BYTES`, doubled
    until the write takes at most :data:`WRITEBACK_RUNS` runs."""
    run = WRITEBACK_RUN_BYTES
    while total > run * WRITEBACK_RUNS:
        run *= 2
    return run


def _runs(chunks: Sequence[Any], offset: int, run: int
          ) -> Iterator[tuple[int, list[memoryview]]]:
    """The concatenated ``chunks``, which go to the file from ``offset`` on, cut where the
    file offset is a multiple of ``run``: ``(file offset, views)`` per piece, in order,
    together exactly the bytes."""
    views: list[memoryview] = []
    pos = begin = offset
    cut = (offset // run + 1) * run
    for c in chunks:
        v = memoryview(c).cast("B")
        while v.nbytes:
            k = min(v.nbytes, cut - pos)
            views.append(v[:k])
            v = v[k:]
            pos += k
            if pos == cut:
                yield begin, views
                views, begin, cut = [], pos, cut + run
    if views:
        yield begin, views


def collect_garbage(path: StoreLike, manifest: Manifest) -> None:
    """Delete (durably) the objects of the log at ``path`` that ``manifest`` does not
    reference, and ``*.tmp`` files. The caller must exclude concurrent writers and
    compactions (their locks)."""
    store = open_store(path)
    live_segs = {s for s, _f in manifest.segments}
    live_bases = set(manifest.bases)
    live_slices = manifest.slice_steps()  # (a base in progress: no writer holds the log)
    for name in store.list():
        if "/" in name:
            continue  # not a file of this log
        m_seg, m_idx, m_base = SEGMENT_RE.match(name), INDEX_RE.match(name), BASE_RE.match(name)
        m_slice = SLICE_RE.match(name)
        dead = (name.endswith(TMP_SUFFIX)
                or (m_seg is not None and int(m_seg.group(1)) not in live_segs)
                or (m_idx is not None and int(m_idx.group(1)) not in live_segs)
                or (m_base is not None and int(m_base.group(1)) not in live_bases)
                or (m_slice is not None and int(m_slice.group(1)) not in live_slices))
        if dead:
            try:
                store.delete(name)
            except LowdiffError:
                pass


__all__ = ["COMPACT_LOCK_NAME", "DEFAULT_SEGMENT_BYTES", "OVERLAP_CRC_BYTES",
           "WRITEBACK_CRC_BYTES", "WRITEBACK_RUNS", "WRITEBACK_RUN_BYTES", "LogWriter",
           "SliceOf", "collect_garbage", "is_slice", "slice_of", "writeback_run_bytes"]
