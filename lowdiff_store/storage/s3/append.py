"""Appending to an object of an ``s3://`` store: :class:`S3AppendHandle` (the active
segment, its index), staged in a local file and uploaded as pieces, and the write-ahead
directory's one home: where a handle keeps its copy (:func:`wal_path`), which copies belong
to handles open in this process (the registry), and the recovery of a copy a crashed writer
left behind (:func:`recover_wal`, which :class:`~.objects.Objects` calls when it reads a
layout).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

from ...errors import Reason, StorageError
from ..base import Buffer, ObjectExists
from ..local import AppendFile, make_scratch_dir
from .client import (
    MULTIPART_MIN_BYTES,
    OUTAGE_RETRY_MAX_S,
    OUTAGE_RETRY_MIN_S,
    OUTAGE_WARN_EVERY_S,
    PIECE_MULTIPART_MIN_BYTES,
    answer_status,
    refusal_hint,
)
from .keys import Layout, piece_name
from .objects import Objects
from .source import S3Source

_log = logging.getLogger(__name__)

#: Name prefix of the scratch directories of handles without a write-ahead directory:
#: ``lowdiff-s3-HOST-PID-RANDOM`` under ``staging_dir`` (:func:`make_scratch_dir`).
SCRATCH_PREFIX = "lowdiff-s3"

# -------------------------------------------------------------------- write-ahead copies

#: Write-ahead files of the append handles open in this process (not to be recovered).
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()


def wal_path(wal_dir: str, bucket: str, key: str) -> str:
    """The write-ahead copy of object ``key`` of ``bucket`` under ``wal_dir``."""
    return os.path.join(wal_dir, bucket, *key.split("/"))


def recover_wal(objects: Objects, name: str, key: str, lay: Layout) -> Layout:
    """A write-ahead copy left by a writer that stopped before uploading it (a crash):
    upload the bytes it holds beyond the bucket's copy, so that what the writer
    acknowledged is read (a torn tail in it is cut by the log's recovery as usual).
    ``lay`` is the object's layout as listed (not whole, not deleted); returns the layout
    with the uploaded piece. A copy held by a handle open in this process is left alone:
    that handle uploads it."""
    wal_dir = objects.options.wal_dir
    if wal_dir is None:
        return lay
    local = wal_path(wal_dir, objects.bucket, key)
    with _LIVE_LOCK:
        if local in _LIVE:
            return lay  # this process's own open handle: it uploads by itself
        try:
            have = os.path.getsize(local)
        except OSError:
            return lay
        if have <= lay.size:
            with contextlib.suppress(OSError):
                os.unlink(local)  # nothing the bucket lacks
            return lay
        with open(local, "rb") as fh:
            fh.seek(lay.size)
            data = fh.read(have - lay.size)
        objects.upload(piece_name(key, lay.size), [memoryview(data)], create=True,
                       path=objects.path_of(name))
        return Layout(None, (*lay.pieces, (lay.size, len(data))), False)


# -------------------------------------------------------------------- the handle


class S3AppendHandle:
    """An object written at its end: staged in a local file, uploaded as pieces.

    Every upload sends the synced bytes not yet in the bucket as one create-only piece
    ``KEY@p<offset>``; the object stays its pieces after :meth:`seal` (nothing is uploaded
    twice). When uploads happen:

    - at the first :meth:`sync` (the object then exists in the bucket), at the first
      :meth:`sync` once ``upload_interval_s`` has passed since the last upload, and at
      :meth:`flush` and :meth:`seal` (and at :meth:`close` with a write-ahead directory);
    - without a write-ahead directory the staged file is a scratch copy (never fsynced):
      ``durable_size`` is what is in the bucket, and ``flush_due`` tells the writer when a
      :meth:`sync` will upload;
    - with ``wal_dir``, :meth:`sync` fdatasyncs the staged file there: ``durable_size`` is
      ``synced_size`` (durable = in the write-ahead directory) and the uploads are the
      bucket catching up.
    """

    def __init__(self, objects: Objects, name: str, *, create: bool) -> None:
        self.objects = objects
        self.name = name
        self.path = objects.path_of(name)
        self._key = objects.key(name)
        opts = objects.options
        self._wal = opts.wal_dir
        self._interval = opts.upload_interval_s
        if self._wal is not None:
            self._local = wal_path(self._wal, objects.bucket, self._key)
            os.makedirs(os.path.dirname(self._local), exist_ok=True)
        else:
            # named with this process's host and pid: a SIGKILL leaves it behind, and the
            # next handle made in the same directory removes it
            d = make_scratch_dir(SCRATCH_PREFIX, opts.staging_dir)
            self._local = os.path.join(d, "staged")
        try:
            lay = objects.layout(name)  # (recovers a write-ahead copy left by a crash)
        except BaseException:
            self._drop_scratch()
            raise
        with _LIVE_LOCK:
            _LIVE.add(self._local)
        try:
            self._open(lay, create)
        except BaseException:
            with _LIVE_LOCK:
                _LIVE.discard(self._local)
            self._drop_scratch()
            raise
        self.size = self._f.size
        self.synced_size = self._f.synced_size
        self._last_upload = time.monotonic()
        self._closed = False
        self._outage: _Outage | None = None
        self._retry: tuple[int, int, str] | None = None  # (start, end, token) to retry

    @property
    def durable_size(self) -> int:
        """Bytes in the bucket (with a write-ahead directory: synced there)."""
        return self.synced_size if self._wal is not None else self._uploaded

    @property
    def flush_due(self) -> float | None:
        """When a :meth:`sync` uploads the synced bytes not yet in the bucket (None with a
        write-ahead directory, where they are durable already, or when none wait)."""
        return None if self._wal is not None else self._upload_due()

    def _upload_due(self) -> float | None:
        if self._outage is not None:
            return self._outage.retry_at
        if self.synced_size <= self._uploaded:
            return None
        return self._last_upload + self._interval

    def _open(self, lay: Layout, create: bool) -> None:
        objects, name = self.objects, self.name
        # Without a write-ahead directory the staged file holds nothing a crash could
        # keep: syncing it would be an fdatasync for nothing.
        cls = AppendFile if self._wal is not None else _ScratchFile
        if create:
            if lay.exists:
                raise ObjectExists("open for append failed: object exists", path=self.path)
            if lay.tomb:
                objects.clear_tomb(name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._local)  # residue of a crash before the first upload
            self._f = cls(self._local, create=True)
            self._uploaded = 0
            self._whole = False
        else:
            if not lay.exists:
                self._cleanup_local()
                raise objects.missing(name)
            self._whole = lay.whole is not None
            have = os.path.getsize(self._local) if os.path.exists(self._local) else -1
            if have < lay.size:  # no write-ahead copy (or an older one): fetch the object
                self._download(lay)
            self._f = cls(self._local)
            self._uploaded = lay.size

    def _download(self, lay: Layout) -> None:
        src = S3Source(self.objects, self.name, lay, None)
        try:
            with open(self._local, "wb") as fh:
                step = self.objects.options.part_bytes
                for off in range(0, src.size, step):
                    fh.write(src.read(off, min(step, src.size - off)))
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            src.close()

    def append(self, chunks: Sequence[Buffer]) -> int:
        """Append to the staged file; returns the offset the chunks start at."""
        off = self._f.append(chunks)
        self.size = self._f.size
        return off

    def rewrite_unsynced(self, offset: int, data: Buffer) -> None:
        """Overwrite staged bytes appended since the last sync (never uploaded ones)."""
        self._f.rewrite_unsynced(offset, data)

    def sync(self) -> None:
        """Take every appended byte (fdatasync with a write-ahead directory); upload them
        if this is the first sync or ``upload_interval_s`` has passed since the last
        upload (see the class docstring). An unreachable store does not fail it: see
        :meth:`_try_upload`."""
        self._f.sync()
        self.synced_size = self._f.synced_size
        due = self._upload_due()
        if self._uploaded == 0 or (due is not None and time.monotonic() >= due):
            self._try_upload()

    def flush(self) -> None:
        """Sync and upload now: every byte is in the bucket when this returns (raises
        ``StorageError(store_unavailable)`` during an outage, losing nothing: the bytes
        stay staged and a later sync or flush uploads them)."""
        self._f.sync()
        self.synced_size = self._f.synced_size
        self._try_upload(strict=True)

    @property
    def outage_since(self) -> float | None:
        """``time.monotonic()`` of the first failed upload of the outage under way (None
        while uploads succeed)."""
        return self._outage.since if self._outage is not None else None

    def _try_upload(self, *, strict: bool = False) -> None:
        """:meth:`upload`, except that an unreachable store (``store_unavailable``) starts
        or continues an *outage* instead of failing: the bytes stay staged, ``durable_size``
        stops (without a write-ahead directory), a warning is logged, and the upload is
        retried by later syncs with a backoff (at most two attempts per try, same range
        and token: :meth:`upload`). The outage fails the handle only when it outlasts
        ``outage_budget_s`` or leaves more than ``outage_budget_bytes`` staged and not
        uploaded. ``strict`` (a flush): the failure is also raised, once counted."""
        out = self._outage
        try:
            self.upload(self.objects if out is None else self.objects.single_try())
        except StorageError as e:
            if e.reason is not Reason.STORE_UNAVAILABLE:
                raise
            if out is None:
                out = self._outage = _Outage(time.monotonic())
            out.failed(e, self)
            if strict:
                raise
            return
        if out is not None:
            self._outage = None
            _log.warning("%s: the store answers again after %.0f s; staged bytes uploaded "
                         "up to offset %d", self.path, time.monotonic() - out.since,
                         self._uploaded)

    def upload(self, objects: Objects | None = None) -> None:
        """Upload the synced bytes not yet in the bucket (one piece). An upload that
        failed is retried with the same range and token (``objects``: the client to use),
        so that a first attempt that landed without its answer counts as done."""
        objects = objects or self.objects
        end = self._f.synced_size
        if self._retry is not None:  # the range of an attempt that may have landed
            start, end, token = self._retry
        else:
            start, token = self._uploaded, uuid.uuid4().hex
        if end <= start:
            self._last_upload = time.monotonic()
            return
        self._retry = (start, end, token)
        if self._whole:  # an object that was sealed, appended to again: replace it
            self._publish_whole(end, objects)
        elif end - start >= PIECE_MULTIPART_MIN_BYTES:  # streamed from the file
            opts = objects.options
            part = max(opts.part_bytes, -(-(end - start) // opts.concurrency))
            objects.multipart(piece_name(self._key, start), self._parts(start, end, part),
                              create=True, path=self.path, token=token)
        else:
            data = self._read_local(start, end - start)
            objects.upload(piece_name(self._key, start), [data], create=True,
                           path=self.path, one_put=True, token=token)
        self._retry = None
        self._uploaded = end
        self._last_upload = time.monotonic()
        if self._f.synced_size > end:  # the bytes synced after the retried range
            self.upload(objects)

    def _read_local(self, offset: int, n: int) -> memoryview:
        with open(self._local, "rb") as fh:
            fh.seek(offset)
            buf = bytearray(n)
            got = fh.readinto(buf)
            if got != n:
                raise StorageError("staged file shorter than expected", path=self._local)
            return memoryview(buf)

    def _parts(self, start: int, end: int, step: int | None = None) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of the staged file, one part at a time (bounded memory)."""
        step = step or self.objects.options.part_bytes
        with open(self._local, "rb") as fh:
            fh.seek(start)
            pos = start
            while pos < end:
                b = fh.read(min(step, end - pos))
                if not b:
                    raise StorageError("staged file shorter than expected", path=self._local)
                pos += len(b)
                yield b

    def _publish_whole(self, end: int, objects: Objects | None = None) -> None:
        objects = objects or self.objects
        if end >= MULTIPART_MIN_BYTES:
            objects.multipart(self._key, self._parts(0, end), create=False, path=self.path)
        else:
            objects.upload(self._key, [self._read_local(0, end)], create=False,
                           path=self.path)

    def truncate(self, size: int) -> None:
        """Cut to ``size`` bytes, in the staged file and in the bucket."""
        self._f.truncate(size)
        self._retry = None  # the bucket's layout is read below: what landed is seen there
        self.size = self._f.size
        self.synced_size = self._f.synced_size
        if size >= self._uploaded:
            return
        if self._whole:
            self._publish_whole(size)
        else:
            lay = self.objects.layout(self.name)
            with self.objects.client.call("truncate", self.path):
                # the last piece first: a crash in between leaves a gap, and the object
                # then ends at the gap (see ``keys.layouts``), never holds stale bytes
                for off, _n in reversed(lay.pieces):
                    if off >= size or off + _n > size:
                        self.objects.s3.delete_object(
                            Bucket=self.objects.bucket, Key=piece_name(self._key, off))
            keep = [(o, n) for o, n in lay.pieces if o + n <= size]
            start = keep[-1][0] + keep[-1][1] if keep else 0
            if start < size:
                self.objects.upload(piece_name(self._key, start),
                                   [self._read_local(start, size - start)], create=True,
                                   path=self.path)
        self._uploaded = size

    def seal(self) -> None:
        """Upload the last bytes (one more piece), close the handle. The object stays its
        pieces: they are immutable, so the sealed object is final without a second
        upload of its bytes."""
        if self._closed:
            return
        self.flush()
        self._close_local()

    def close(self) -> None:
        """Close (no sync). With a write-ahead directory, synced bytes not yet in the
        bucket are uploaded first; without one, bytes not uploaded are dropped (call
        :meth:`flush` first). Idempotent."""
        if self._closed:
            return
        try:
            if self._wal is not None:
                self.upload()
        finally:
            # Closed even when the upload fails: the write-ahead copy stays (it holds bytes
            # the bucket lacks) and, no longer this process's live handle, is uploaded by
            # the next open of the object (:func:`recover_wal`), in this process too.
            self._close_local()

    def _close_local(self) -> None:
        self._closed = True
        self._f.close()
        self._cleanup_local()
        with _LIVE_LOCK:
            _LIVE.discard(self._local)

    def _drop_scratch(self) -> None:
        """An open that failed: remove the scratch directory it made (a write-ahead
        directory's files are kept: they may hold what a crashed writer acknowledged)."""
        if self._wal is None:
            shutil.rmtree(os.path.dirname(self._local), ignore_errors=True)

    def _cleanup_local(self) -> None:
        if self._wal is None:
            self._drop_scratch()
        elif self._uploaded >= getattr(self, "synced_size", 0):
            with contextlib.suppress(OSError):
                os.unlink(self._local)


class _ScratchFile(AppendFile):
    """The staged copy of an object without a write-ahead directory: never fsynced (a
    crash loses it whatever is done; what counts is the bucket)."""

    def _sync(self, fd: int) -> None:
        pass


class _Outage:
    """An outage of the store as one append handle lives it (see
    :meth:`S3AppendHandle._try_upload`): since when, the next retry, the budget."""

    def __init__(self, since: float) -> None:
        self.since = since
        self.retry_at = since
        self.backoff = OUTAGE_RETRY_MIN_S
        self.warned = -OUTAGE_WARN_EVERY_S
        self.failures = 0

    def failed(self, e: StorageError, h: S3AppendHandle) -> None:
        """One more failed upload: schedule the retry, warn, or fail once over budget."""
        now = time.monotonic()
        opts = h.objects.options
        pending = h.synced_size - h._uploaded
        down = now - self.since
        self.failures += 1
        # a server that answers 500 to uploads is likely full, not down: say so
        hint = refusal_hint(answer_status(e))
        if (self.failures > 1 and down > opts.outage_budget_s) or \
                pending > opts.outage_budget_bytes:
            what = "refused uploads" if hint else "not answered"
            raise StorageError(
                f"the store has {what} for {down:.0f} s, {pending} bytes staged and "
                f"not uploaded: over the outage budget (outage_budget_s="
                f"{opts.outage_budget_s:g}, outage_budget_bytes={opts.outage_budget_bytes})"
                f"{'; ' + hint if hint else ''}; last error: {e.detail}",
                reason=Reason.STORE_UNAVAILABLE, path=h.path, offset=h._uploaded) from e
        self.retry_at = now + self.backoff
        self.backoff = min(2 * self.backoff, OUTAGE_RETRY_MAX_S)
        if now - self.warned >= OUTAGE_WARN_EVERY_S:
            self.warned = now
            _log.warning("%s: the store %s (%s); training goes on, %d bytes staged locally "
                         "wait for it (%.0f s of the %g s outage budget used)%s", h.path,
                         "refuses uploads" if hint else "does not answer", e.detail,
                         pending, down, opts.outage_budget_s, f"; {hint}" if hint else "")
