"""The S3-compatible object store (:class:`S3Store`): the :class:`~..base.Store` interface
over :class:`~.objects.Objects` (the requests), :class:`~.source.S3Source` (reading),
:class:`~.append.S3AppendHandle` (appending, write-ahead recovery) and
:class:`~.lock.S3Lock` (locks). The package docstring describes the objects it keeps.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Sequence

import msgpack

from ...errors import FormatError, Reason, StorageError
from ..base import (
    AppendHandle,
    Buffer,
    ObjectExists,
    ReadMode,
    Source,
    Store,
    StoreLock,
    check_name,
)
from .append import S3AppendHandle, recover_wal
from .client import SWEEP_EVERY_S, S3Options
from .keys import PROBE, TOMB, WHOLE_CACHE, Layout, layouts, parse_url, tombstone_bytes
from .lock import S3Lock
from .objects import Objects, views_of
from .source import S3Source

_log = logging.getLogger(__name__)


class S3Store(Store):
    """A store in an S3-compatible bucket (see the package docstring).

    Args:
        url: ``s3://bucket/prefix``.
        options: tunables (:class:`S3Options`); default ``S3Options.from_env()``.
    """

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else \
            f"s3://{self.bucket}"
        self.options = options or S3Options.from_env()
        self.outage_budget_s = self.options.outage_budget_s
        self.objects = Objects(self.bucket, self.prefix, self.options,
                               recover_wal if self.options.wal_dir is not None else None)
        self._checked_bucket = False
        self._last_sweep = -SWEEP_EVERY_S

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # ---------------------------------------------------------------- names

    def key(self, name: str) -> str:
        """The key of object ``name``."""
        return self.objects.key(name)

    def path_of(self, name: str) -> str:
        """``s3://bucket/prefix/name``."""
        return self.objects.path_of(name)

    def child(self, prefix: str) -> S3Store:
        """The store at ``s3://bucket/prefix/<prefix>``."""
        return S3Store(f"s3://{self.bucket}/{self.key(prefix)}", self.options)

    # ---------------------------------------------------------------- reading

    def exists(self, name: str) -> bool:
        """True when the object (whole or as pieces) exists and is not deleted."""
        return self.objects.layout(name).exists

    def size(self, name: str) -> int:
        """Size of the object; ``StorageError(missing_file)`` if absent."""
        lay = self.objects.layout(name)
        if not lay.exists:
            raise self.objects.missing(name)
        return lay.size

    def list(self, prefix: str = "") -> list[str]:
        """Sorted names of the objects whose name starts with ``prefix``."""
        if prefix:
            check_name(prefix.rstrip("/") or "x")
        kp = (f"{self.prefix}/{prefix}" if self.prefix else prefix)
        if self.prefix and not prefix:
            kp = self.prefix + "/"
        lays = layouts(self.objects.list_keys(kp), None)
        return sorted(self.objects.name_of(k) for k, lay in lays.items() if lay.exists)

    def open(self, name: str, mode: ReadMode = "mmap", *, length: int | None = None
             ) -> Source:
        """An :class:`S3Source` (ranged GETs; ``mode`` is irrelevant for S3). A deleted
        object within its grace period is still served: a reader holding an older
        manifest names it explicitly."""
        lay = self.objects.layout(name)
        if lay.whole is None and not lay.pieces:
            raise self.objects.missing(name)
        return S3Source(self.objects, name, lay, length)

    def read(self, name: str, *, max_bytes: int) -> bytes:
        """The whole object, if at most ``max_bytes`` (checked before reading)."""
        lay = self.objects.layout(name)
        if not lay.exists:
            raise self.objects.missing(name)
        if lay.size > max_bytes:
            raise FormatError(f"{lay.size} bytes exceed the cap of {max_bytes} for this "
                              "object", reason=Reason.METADATA_TOO_LARGE,
                              path=self.path_of(name))
        if lay.whole is not None and lay.whole <= self.options.part_bytes:
            try:
                return self.objects.get(self.key(name), None, None, self.path_of(name))
            except StorageError as e:  # replaced by pieces meanwhile: read the layout again
                if e.reason is not Reason.MISSING_FILE:
                    raise
                return self.read(name, max_bytes=max_bytes)
        src = S3Source(self.objects, name, lay, None)
        try:
            return bytes(src.read(0, src.size))
        finally:
            src.close()

    # ---------------------------------------------------------------- writing

    def ensure_root(self) -> None:
        """Check that the bucket exists and the credentials work (one clear line if not),
        and that the store honours conditional writes (:meth:`check_conditional_writes`);
        S3 has no directories to create. Called when a log is opened for writing."""
        if self._checked_bucket:
            return
        client = self.objects.client
        with client.call("open bucket", f"s3://{self.bucket}"):
            try:
                self.objects.s3.head_bucket(Bucket=self.bucket)
            except client.exc.ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 404:
                    raise StorageError(f"bucket {self.bucket!r} does not exist (endpoint "
                                       f"{client.endpoint})",
                                       path=f"s3://{self.bucket}") from None
                if status == 403:
                    raise StorageError(f"access to bucket {self.bucket!r} denied: check "
                                       "the AWS credentials (AWS_PROFILE, "
                                       "AWS_ACCESS_KEY_ID)", path=f"s3://{self.bucket}"
                                       ) from None
                raise
        self.check_conditional_writes()
        self._checked_bucket = True

    def check_conditional_writes(self) -> None:
        """The probe of ``object_store.md`` section 8: create ``KEY@probe<random>`` twice
        with ``If-None-Match: *`` under this store's prefix. A store that lets the second
        create through ignores the header, and the commit protocol (and the lock) would then
        let two writers overwrite each other: refused with one line (``unsafe_store``)
        unless ``single_writer`` accepts it (a warning then). The probe object is deleted."""
        key = f"{self.key('LOCK')}{PROBE}{uuid.uuid4().hex}"
        path = f"s3://{self.bucket}/{key}"
        client, s3 = self.objects.client, self.objects.s3
        ignored = False
        try:
            with client.call("probe", path):
                s3.put_object(Bucket=self.bucket, Key=key, Body=b"1", IfNoneMatch="*")
            try:
                with client.call("probe", path):
                    s3.put_object(Bucket=self.bucket, Key=key, Body=b"2", IfNoneMatch="*")
                ignored = True
            except ObjectExists:
                pass
        finally:
            with contextlib.suppress(StorageError), client.call("probe", path):
                s3.delete_object(Bucket=self.bucket, Key=key)
        if not ignored:
            return
        what = ("the store ignores conditional writes: a second create-only PUT "
                "(If-None-Match: *) of the same key succeeded")
        if self.options.single_writer:
            _log.warning("%s: %s; single-writer mode accepted (LOWDIFF_S3_SINGLE_WRITER): "
                         "nothing stops a second writer", self.url, what)
            return
        raise StorageError(f"{what}, so two writers could both commit; refusing to write "
                           "(set LOWDIFF_S3_SINGLE_WRITER=1 only if a single writer is "
                           "guaranteed otherwise)", reason=Reason.UNSAFE_STORE, path=path)

    def create(self, name: str, chunks: Sequence[Buffer]) -> None:
        """Create-only upload (``If-None-Match: *``); :class:`ObjectExists` if it exists."""
        views = views_of(chunks)
        key = self.key(name)
        try:
            self.objects.upload(key, views, create=True, path=self.path_of(name))
        except ObjectExists:
            lay = self.objects.layout(name)
            if not lay.tomb:
                raise
            self.objects.remove(name, lay)  # a deleted name, reused: its grace ends now
            self.objects.upload(key, views, create=True, path=self.path_of(name))

    def publish(self, name: str, chunks: Sequence[Buffer]) -> None:
        """Replace (or create) the object: one PUT, atomic in S3 (multipart when large)."""
        views = views_of(chunks)
        key = self.key(name)
        self.objects.upload(key, views, create=False, path=self.path_of(name))
        lay = self.objects.layout(name)
        if lay.pieces:
            self.objects.drop_pieces(name, lay)
        if lay.tomb:
            with self.objects.client.call("publish", self.path_of(name)):
                self.objects.s3.delete_object(Bucket=self.bucket, Key=key + TOMB)

    def open_append(self, name: str, *, create: bool = False) -> AppendHandle:
        """An :class:`S3AppendHandle`: staged in a local file, uploaded by ``sync``."""
        return S3AppendHandle(self.objects, name, create=create)

    # ---------------------------------------------------------------- deleting

    def delete(self, name: str) -> None:
        """Remove the object (and its pieces). With ``gc_grace_s > 0`` it is hidden at
        once (a tombstone) and removed by a later :meth:`delete` or
        :meth:`collect_garbage` once the grace period has passed."""
        lay = self.objects.layout(name)
        if lay.whole is None and not lay.pieces:
            return
        if self.options.gc_grace_s > 0:
            WHOLE_CACHE.drop(self.bucket, self.key(name))
            if not lay.tomb:
                body = tombstone_bytes(time.time() + self.options.gc_grace_s)
                with self.objects.client.call("delete", self.path_of(name)):
                    self.objects.s3.put_object(Bucket=self.bucket,
                                               Key=self.key(name) + TOMB, Body=body)
            now = time.monotonic()
            if now - self._last_sweep >= SWEEP_EVERY_S:  # at most one sweep a minute
                self._last_sweep = now
                self.collect_garbage()
            return
        self.objects.remove(name, lay)

    def collect_garbage(self, *, now: float | None = None) -> int:
        """Remove every deleted object whose grace period has passed; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        lays: dict[str, Layout] = layouts(
            self.objects.list_keys(self.prefix + "/" if self.prefix else ""), None,
            tombs_only=True)
        for key, lay in lays.items():
            name = self.objects.name_of(key)
            try:
                body = msgpack.unpackb(self.objects.get(key + TOMB, None, None,
                                                        self.path_of(name)))
                deadline = float(body["deadline"])
            except (StorageError, ValueError, KeyError, TypeError,
                    msgpack.UnpackException):
                continue
            if deadline <= now:
                self.objects.remove(name, lay)
                removed += 1
        return removed

    # ---------------------------------------------------------------- locks

    def try_lock(self, name: str) -> StoreLock | None:
        """A lease lock object (create-only); None while another live holder has it."""
        return S3Lock.acquire(self.objects, name)
