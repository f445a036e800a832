"""The S3-compatible object store (:class:`S3Store`): ``s3://bucket/prefix``.

Client: ``boto3`` (the ``lowdiff-store[s3]`` extra), imported when an ``s3://`` store is first
opened, never by ``import lowdiff_store``. Endpoint, region and credentials come from the
standard AWS sources as the AWS CLI reads them (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``,
``~/.aws/config`` and ``credentials``, instance roles); nothing is read from the log.

Objects (``docs/object_store.md`` is the full description):

- object ``a/b`` of the store ``s3://bucket/p`` is the key ``p/a/b``;
- :meth:`S3Store.create` is a create-only PUT (``If-None-Match: *``; a multipart upload with
  ``If-None-Match: *`` on its completion for large objects); :meth:`S3Store.publish` a
  plain PUT (atomic in S3: readers see the old object or the new one);
- the versioned commit is the :class:`Store` default: create-only ``NAME.<sequence>``
  objects, readers take the newest. No rename, copy or delete on the commit path;
- an append handle (the active segment, its index) is staged in a local file and uploaded
  as immutable *pieces* ``KEY@p<offset>``: the object is the concatenation of its pieces
  (sealed or not; a whole object ``KEY`` takes precedence, see
  ``format_spec/object_store.md``). A piece is uploaded at the first ``sync``, at the first
  ``sync`` once ``upload_interval_s`` has passed since the last upload, and at ``flush`` /
  seal, so a segment's bytes are uploaded once. Without a write-ahead directory the handle's
  ``durable_size`` is what is in the bucket (the log's ``durable_step`` follows it); with
  one (``wal_dir``), ``sync`` is an ``fdatasync`` there and durable means "in that
  directory"; a writer reopening the log uploads what the directory holds beyond the bucket;
- :meth:`S3Store.delete` with a grace period (``gc_grace_s``) hides the object at once and
  removes it only once the grace has passed (a tombstone ``KEY@gc`` holds the deadline), so
  a reader holding an older manifest can still read what that manifest names;
- :meth:`S3Store.try_lock`: a create-only lock object holding its owner (host, pid, a
  random id) and refreshed as a lease; a lock whose owner process is gone (same host) or
  whose lease ran out is broken.

Errors: throttling (``503 SlowDown``), ``5xx`` and connection failures are retried with
exponential backoff and jitter by the client (``max_attempts``); a create-only write retried
after its first attempt landed is recognised by a per-write token kept in the object's
metadata. A missing bucket, bad credentials or an unreachable endpoint is one line.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import numpy as np

from ..errors import FormatError, LowdiffError, Reason, StorageError
from .base import (
    AppendHandle,
    Buffer,
    ObjectExists,
    ReadMode,
    Source,
    Store,
    StoreLock,
    check_name,
)
from .local import AppendFile

#: Size of one part of a multipart upload and of one ranged GET of a large read.
DEFAULT_PART_BYTES = 8 << 20
#: Requests in flight for one large upload or read (and the client's connection pool).
DEFAULT_CONCURRENCY = 8
#: Objects at least this large are uploaded with a multipart upload.
MULTIPART_MIN_BYTES = 16 << 20
#: A piece of an appended object (the bytes of one upload interval) at least this large is
#: a multipart upload streamed from the staged file, in at most ``concurrency`` parts;
#: below it, one PUT (a multipart upload of n parts costs n + 2 requests, and a piece is
#: sent in the background, where the parallel parts gain nothing the training waits for).
PIECE_MULTIPART_MIN_BYTES = 64 << 20
#: Small reads go through a cache of blocks of this size (a scan reads records in order).
READ_BLOCK_BYTES = 4 << 20
#: Blocks kept per open source.
READ_CACHE_BLOCKS = 4
#: A source read in order (a restore reads a base tensor after tensor) fetches this much
#: ahead in ``concurrency`` parallel ranges (at least ``part_bytes`` each).
DEFAULT_READAHEAD_BYTES = 256 << 20
#: Gap between two reads that still counts as reading in order (alignment padding).
ALIGN_GAP = 4096
#: Attempts per request (the client retries throttling, 5xx and connection errors).
DEFAULT_MAX_ATTEMPTS = 8
#: Seconds a deleted object stays readable by readers of older manifests.
DEFAULT_GC_GRACE_S = 600.0
#: Lease of a lock object; its holder refreshes it every third of this.
DEFAULT_LOCK_TTL_S = 60.0
#: Seconds a listed whole object's size is reused by this process (see _LayoutCache).
WHOLE_CACHE_S = 5.0
#: Seconds between uploads of the active segment (and of its index) while it grows.
DEFAULT_UPLOAD_INTERVAL_S = 10.0

#: :meth:`S3Store.delete` sweeps expired tombstones at most this often (per store object).
_SWEEP_EVERY_S = 60.0

_POOL_PREFIX = "lowdiff-s3-io"
_PIECE = "@p"
_TOMB = "@gc"
_PIECE_RE = re.compile(r"@p(\d{20})$")
_TOKEN_META = "lowdiff-token"


def piece_name(name: str, offset: int) -> str:
    """The name of the piece of object ``name`` holding its bytes from ``offset``
    (``NAME@p<offset, 20 digits>``, ``format_spec/object_store.md``)."""
    return f"{name}{_PIECE}{offset:020d}"


def tombstone_bytes(deadline: float) -> bytes:
    """The body of a tombstone ``NAME@gc``: msgpack ``{"deadline": <unix seconds>}``."""
    out: bytes = msgpack.packb({"deadline": float(deadline)})
    return out


def lock_bytes(owner: dict[str, Any]) -> bytes:
    """The body of a lock object: msgpack of its holder (``host``, ``pid``, ``id``,
    ``time``, ``ttl``)."""
    out: bytes = msgpack.packb(owner)
    return out


def is_s3_url(location: str) -> bool:
    """True for ``s3://...`` locations."""
    return location[:5].lower() == "s3://"


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")`` (prefix without slashes at its ends)."""
    if not is_s3_url(url):
        raise LowdiffError(f"not an s3:// URL: {url!r}", reason=Reason.INVALID_ARGUMENT)
    bucket, _, prefix = url[5:].partition("/")
    if not bucket:
        raise LowdiffError("s3:// URL without a bucket", reason=Reason.INVALID_ARGUMENT,
                           path=url)
    prefix = prefix.strip("/")
    if prefix:
        check_name(prefix)
    return bucket, prefix


@dataclass(frozen=True)
class S3Options:
    """Tunables of an :class:`S3Store` (defaults documented in ``docs/object_store.md``).

    ``wal_dir`` and ``upload_interval_s`` may also come from the environment variables
    ``LOWDIFF_S3_WAL_DIR`` and ``LOWDIFF_S3_UPLOAD_INTERVAL_S``; ``gc_grace_s`` from
    ``LOWDIFF_S3_GC_GRACE_S``; ``max_attempts`` from ``LOWDIFF_S3_MAX_ATTEMPTS``;
    ``readahead_bytes`` from ``LOWDIFF_S3_READAHEAD_BYTES`` (0: no read-ahead).
    """

    part_bytes: int = DEFAULT_PART_BYTES
    concurrency: int = DEFAULT_CONCURRENCY
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    gc_grace_s: float = DEFAULT_GC_GRACE_S
    lock_ttl_s: float = DEFAULT_LOCK_TTL_S
    wal_dir: str | None = None
    upload_interval_s: float = DEFAULT_UPLOAD_INTERVAL_S
    staging_dir: str | None = None
    readahead_bytes: int = DEFAULT_READAHEAD_BYTES

    @classmethod
    def from_env(cls, **overrides: Any) -> S3Options:
        """Defaults, then the ``LOWDIFF_S3_*`` variables, then ``overrides``."""
        kw: dict[str, Any] = {}
        env = os.environ
        if env.get("LOWDIFF_S3_WAL_DIR"):
            kw["wal_dir"] = env["LOWDIFF_S3_WAL_DIR"]
        for var, key, conv in (("LOWDIFF_S3_UPLOAD_INTERVAL_S", "upload_interval_s", float),
                               ("LOWDIFF_S3_GC_GRACE_S", "gc_grace_s", float),
                               ("LOWDIFF_S3_MAX_ATTEMPTS", "max_attempts", int),
                               ("LOWDIFF_S3_READAHEAD_BYTES", "readahead_bytes", int)):
            if env.get(var):
                try:
                    kw[key] = conv(env[var])
                except ValueError:
                    raise LowdiffError(f"{var}={env[var]!r} is not a number",
                                       reason=Reason.INVALID_ARGUMENT) from None
        kw.update(overrides)
        opts = cls(**kw)
        if opts.part_bytes < 5 << 20:
            raise LowdiffError(f"part_bytes={opts.part_bytes} is below S3's 5 MiB minimum",
                               reason=Reason.INVALID_ARGUMENT)
        if opts.concurrency < 1 or opts.max_attempts < 1:
            raise LowdiffError("concurrency and max_attempts must be >= 1",
                               reason=Reason.INVALID_ARGUMENT)
        return opts


# -------------------------------------------------------------------- client and errors


class _Client:
    """One boto3 client (thread-safe) shared by the stores of one bucket, and the
    translation of its errors into :class:`StorageError` lines."""

    _lock = threading.Lock()
    _cache: ClassVar[dict[tuple[Any, ...], _Client]] = {}

    def __init__(self, opts: S3Options) -> None:
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError:
            raise LowdiffError("s3:// locations need boto3: pip install 'lowdiff-store[s3]'",
                               reason=Reason.INVALID_ARGUMENT) from None
        self.exc = botocore.exceptions
        cfg = botocore.config.Config(
            retries={"mode": "standard", "max_attempts": opts.max_attempts},
            max_pool_connections=max(10, 2 * opts.concurrency),
            connect_timeout=10, read_timeout=60,
            # Records and bases carry CRC32C; a second checksum of every body costs CPU.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required")
        session = boto3.session.Session()
        self.s3 = session.client("s3", config=cfg)
        self.endpoint = self.s3.meta.endpoint_url
        self._concurrency = opts.concurrency
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """Threads for parts and ranges in flight (created on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self._concurrency, thread_name_prefix=_POOL_PREFIX)
            return self._pool

    @classmethod
    def get(cls, opts: S3Options) -> _Client:
        env = tuple(os.environ.get(k) for k in (
            "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
            "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"))
        key = (env, opts.max_attempts, opts.concurrency)
        with cls._lock:
            c = cls._cache.get(key)
            if c is None:
                c = cls._cache[key] = _Client(opts)
            return c

    def error(self, e: BaseException, what: str, path: str) -> StorageError | ObjectExists:
        """The one-line error for a failed request."""
        exc = self.exc
        if isinstance(e, exc.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (
                    412, 409):
                return ObjectExists(f"{what}: another writer created it first ({code})",
                                    path=path)
            if code in ("NoSuchKey", "404", "NotFound"):
                return StorageError("object does not exist", reason=Reason.MISSING_FILE,
                                    path=path)
            if code == "NoSuchBucket":
                return StorageError(f"bucket does not exist (endpoint {self.endpoint})",
                                    path=path)
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                        "ExpiredToken", "403", "Forbidden", "InvalidToken"):
                return StorageError(f"{what}: access denied ({code}): check the AWS "
                                    "credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID)", path=path)
            return StorageError(f"{what} failed: {code or status} "
                                f"{err.get('Message', '')}".rstrip(), path=path)
        if isinstance(e, exc.NoCredentialsError):
            return StorageError("no AWS credentials found (set AWS_PROFILE or "
                                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)", path=path)
        if isinstance(e, (exc.EndpointConnectionError, exc.ConnectionClosedError,
                          exc.ReadTimeoutError, exc.ConnectTimeoutError)):
            return StorageError(f"{what}: cannot reach {self.endpoint} after retries "
                                f"({type(e).__name__})", path=path)
        if isinstance(e, exc.BotoCoreError):
            return StorageError(f"{what} failed: {e}", path=path)
        return StorageError(f"{what} failed: {type(e).__name__}: {e}", path=path)

    @contextlib.contextmanager
    def call(self, what: str, path: str) -> Iterator[None]:
        """Translate the errors of the requests made inside the block."""
        try:
            yield
        except (self.exc.ClientError, self.exc.BotoCoreError) as e:
            raise self.error(e, what, path) from e


def _views(chunks: Sequence[Buffer]) -> list[memoryview]:
    # Converts first: a chunk that is not a buffer fails here, before any request is sent.
    out = []
    for c in chunks:
        v = memoryview(c)
        if v.ndim != 1 or v.format != "B":
            v = v.cast("B")
        if v.nbytes:
            out.append(v)
    return out


def _split(views: Sequence[memoryview], part: int) -> Iterator[bytes]:
    """Consecutive ``part``-byte pieces of the concatenated views (the last may be short)."""
    buf = bytearray()
    for v in views:
        while v.nbytes:
            take = min(part - len(buf), v.nbytes)
            buf += v[:take]
            v = v[take:]
            if len(buf) == part:
                yield bytes(buf)
                buf = bytearray()
    if buf:
        yield bytes(buf)


# -------------------------------------------------------------------- the store


@dataclass(frozen=True)
class _Layout:
    """What backs a logical object: a whole object, pieces, or nothing."""

    whole: int | None                   # size of KEY, if it exists
    pieces: tuple[tuple[int, int], ...]  # (offset, size) of KEY@p<offset>, contiguous
    tomb: bool                          # deleted, within its grace period

    @property
    def exists(self) -> bool:
        return (self.whole is not None or bool(self.pieces)) and not self.tomb

    @property
    def size(self) -> int:
        if self.whole is not None:
            return self.whole
        return self.pieces[-1][0] + self.pieces[-1][1] if self.pieces else 0


class S3Store(Store):
    """A store in an S3-compatible bucket (see the module docstring).

    Args:
        url: ``s3://bucket/prefix``.
        options: tunables (:class:`S3Options`); default ``S3Options.from_env()``.
    """

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else \
            f"s3://{self.bucket}"
        self.options = options or S3Options.from_env()
        self._client = _Client.get(self.options)
        self._s3 = self._client.s3
        self._checked_bucket = False
        self._last_sweep = -_SWEEP_EVERY_S

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # ---------------------------------------------------------------- names

    def key(self, name: str) -> str:
        """The key of object ``name``."""
        check_name(name)
        if _PIECE in name or name.endswith(_TOMB):
            raise LowdiffError(f"invalid object name {name!r} ('@p', '@gc' are reserved)",
                               reason=Reason.UNSAFE_NAME)
        return f"{self.prefix}/{name}" if self.prefix else name

    def path_of(self, name: str) -> str:
        """``s3://bucket/prefix/name``."""
        return f"s3://{self.bucket}/{self.key(name)}"

    def child(self, prefix: str) -> S3Store:
        """The store at ``s3://bucket/prefix/<prefix>``."""
        return S3Store(f"s3://{self.bucket}/{self.key(prefix)}", self.options)

    def _name(self, key: str) -> str:
        return key[len(self.prefix) + 1:] if self.prefix else key

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The I/O pool, one per client (shared by every store of the process that uses the
        same settings: stores are opened often, pools must not pile up)."""
        return self._client.pool()

    # ---------------------------------------------------------------- listing

    def _list_keys(self, key_prefix: str) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": key_prefix}
        with self._client.call("list", f"s3://{self.bucket}/{key_prefix}"):
            while True:
                r = self._s3.list_objects_v2(**kw)
                out.extend((o["Key"], int(o["Size"])) for o in r.get("Contents", ()))
                if not r.get("IsTruncated"):
                    break
                kw["ContinuationToken"] = r["NextContinuationToken"]
        return out

    def _layout(self, name: str) -> _Layout:
        key = self.key(name)
        hit = _WHOLE_CACHE.get(self.bucket, key)
        if hit is not None:
            return hit
        lay = _layouts(self._list_keys(key), key).get(key, _Layout(None, (), False))
        if self.options.wal_dir is not None and lay.whole is None and not lay.tomb:
            lay = self._wal_recover(name, key, lay)
        if lay.whole is not None and not lay.tomb and not lay.pieces:
            _WHOLE_CACHE.put(self.bucket, key, lay)
        return lay

    def _wal_recover(self, name: str, key: str, lay: _Layout) -> _Layout:
        """A write-ahead copy left by a writer that stopped before uploading it (a crash):
        upload the bytes it holds beyond the bucket's copy, so that what the writer
        acknowledged is read (a torn tail in it is cut by the log's recovery as usual)."""
        local = _wal_path(self.options.wal_dir, self.bucket, key)  # type: ignore[arg-type]
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
            self._upload(piece_name(key, lay.size), [memoryview(data)], create=True,
                         path=self.path_of(name))
            return _Layout(None, (*lay.pieces, (lay.size, len(data))), False)

    # ---------------------------------------------------------------- reading

    def exists(self, name: str) -> bool:
        """True when the object (whole or as pieces) exists and is not deleted."""
        return self._layout(name).exists

    def size(self, name: str) -> int:
        """Size of the object; ``StorageError(missing_file)`` if absent."""
        lay = self._layout(name)
        if not lay.exists:
            raise self._missing(name)
        return lay.size

    def list(self, prefix: str = "") -> list[str]:
        """Sorted names of the objects whose name starts with ``prefix``."""
        if prefix:
            check_name(prefix.rstrip("/") or "x")
        kp = (f"{self.prefix}/{prefix}" if self.prefix else prefix)
        if self.prefix and not prefix:
            kp = self.prefix + "/"
        lays = _layouts(self._list_keys(kp), None)
        return sorted(self._name(k) for k, lay in lays.items() if lay.exists)

    def open(self, name: str, mode: ReadMode = "mmap", *, length: int | None = None
             ) -> Source:
        """An :class:`S3Source` (ranged GETs; ``mode`` is irrelevant for S3). A deleted
        object within its grace period is still served: a reader holding an older
        manifest names it explicitly."""
        lay = self._layout(name)
        if lay.whole is None and not lay.pieces:
            raise self._missing(name)
        return S3Source(self, name, lay, length)

    def read(self, name: str, *, max_bytes: int) -> bytes:
        """The whole object, if at most ``max_bytes`` (checked before reading)."""
        lay = self._layout(name)
        if not lay.exists:
            raise self._missing(name)
        if lay.size > max_bytes:
            raise FormatError(f"{lay.size} bytes exceed the cap of {max_bytes} for this "
                              "object", reason=Reason.METADATA_TOO_LARGE,
                              path=self.path_of(name))
        if lay.whole is not None and lay.whole <= self.options.part_bytes:
            try:
                return self._get(self.key(name), None, None, self.path_of(name))
            except StorageError as e:  # replaced by pieces meanwhile: read the layout again
                if e.reason is not Reason.MISSING_FILE:
                    raise
                return self.read(name, max_bytes=max_bytes)
        src = S3Source(self, name, lay, None)
        try:
            return bytes(src.read(0, src.size))
        finally:
            src.close()

    def _get(self, key: str, start: int | None, n: int | None, path: str) -> bytes:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if start is not None and n is not None:
            if n == 0:
                return b""
            kw["Range"] = f"bytes={start}-{start + n - 1}"
        with self._client.call("read", path):
            body: bytes = self._s3.get_object(**kw)["Body"].read()
        if n is not None and len(body) != n:
            raise FormatError(f"short read: {len(body)} of {n} bytes",
                              reason=Reason.TRUNCATED, path=path, offset=start)
        return body

    def _missing(self, name: str) -> StorageError:
        return StorageError("object does not exist", reason=Reason.MISSING_FILE,
                            path=self.path_of(name))

    # ---------------------------------------------------------------- writing

    def ensure_root(self) -> None:
        """Check that the bucket exists and the credentials work (one clear line if not);
        S3 has no directories to create."""
        if self._checked_bucket:
            return
        with self._client.call("open bucket", f"s3://{self.bucket}"):
            try:
                self._s3.head_bucket(Bucket=self.bucket)
            except self._client.exc.ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 404:
                    raise StorageError(f"bucket {self.bucket!r} does not exist (endpoint "
                                       f"{self._client.endpoint})",
                                       path=f"s3://{self.bucket}") from None
                if status == 403:
                    raise StorageError(f"access to bucket {self.bucket!r} denied: check "
                                       "the AWS credentials (AWS_PROFILE, "
                                       "AWS_ACCESS_KEY_ID)", path=f"s3://{self.bucket}"
                                       ) from None
                raise
        self._checked_bucket = True

    def create(self, name: str, chunks: Sequence[Buffer]) -> None:
        """Create-only upload (``If-None-Match: *``); :class:`ObjectExists` if it exists."""
        views = _views(chunks)
        key = self.key(name)
        try:
            self._upload(key, views, create=True, path=self.path_of(name))
        except ObjectExists:
            lay = self._layout(name)
            if not lay.tomb:
                raise
            self._remove(name, lay)  # a deleted name, reused: its grace ends now
            self._upload(key, views, create=True, path=self.path_of(name))

    def publish(self, name: str, chunks: Sequence[Buffer]) -> None:
        """Replace (or create) the object: one PUT, atomic in S3 (multipart when large)."""
        views = _views(chunks)
        key = self.key(name)
        self._upload(key, views, create=False, path=self.path_of(name))
        lay = self._layout(name)
        if lay.pieces:
            self._drop_pieces(name, lay)
        if lay.tomb:
            with self._client.call("publish", self.path_of(name)):
                self._s3.delete_object(Bucket=self.bucket, Key=key + _TOMB)

    def _upload(self, key: str, views: Sequence[memoryview], *, create: bool,
                path: str, one_put: bool = False) -> None:
        """Upload an object: one PUT, or (from ``MULTIPART_MIN_BYTES``, unless ``one_put``)
        a multipart upload."""
        _WHOLE_CACHE.drop(self.bucket, key)
        total = sum(v.nbytes for v in views)
        if total >= MULTIPART_MIN_BYTES and not one_put:
            self._multipart(key, _split(views, self.options.part_bytes), create=create,
                            path=path)
            return
        body = b"".join(views)
        token = uuid.uuid4().hex
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "Body": body,
                              "Metadata": {_TOKEN_META: token}}
        if create:
            kw["IfNoneMatch"] = "*"
        try:
            with self._client.call("create" if create else "publish", path):
                self._s3.put_object(**kw)
        except ObjectExists:
            if not (create and self._written_by(key, token)):
                raise
        finally:
            _WHOLE_CACHE.drop(self.bucket, key)  # also after: a LIST may have raced the PUT

    def _written_by(self, key: str, token: str) -> bool:
        """After a 412 on a create-only write: was the object created by this very write
        (a retry after a response lost on the network)?"""
        try:
            with self._client.call("check", f"s3://{self.bucket}/{key}"):
                h = self._s3.head_object(Bucket=self.bucket, Key=key)
        except StorageError:
            return False
        return bool(h.get("Metadata", {}).get(_TOKEN_META) == token)

    def _multipart(self, key: str, parts: Iterator[bytes], *, create: bool,
                   path: str) -> None:
        """A multipart upload with at most ``concurrency`` parts in flight (bounded memory:
        the iterator is pulled only as parts complete)."""
        token = uuid.uuid4().hex
        _WHOLE_CACHE.drop(self.bucket, key)
        with self._client.call("start upload", path):
            up = self._s3.create_multipart_upload(Bucket=self.bucket, Key=key,
                                                  Metadata={_TOKEN_META: token})
        uid = up["UploadId"]
        done: dict[int, str] = {}
        ex = self._executor()

        def send(num: int, data: bytes) -> tuple[int, str]:
            with self._client.call(f"upload part {num}", path):
                r = self._s3.upload_part(Bucket=self.bucket, Key=key, UploadId=uid,
                                         PartNumber=num, Body=data)
            return num, str(r["ETag"])

        try:
            inflight: set[concurrent.futures.Future[tuple[int, str]]] = set()
            for num, data in enumerate(parts, 1):
                if len(inflight) >= self.options.concurrency:
                    finished, inflight = concurrent.futures.wait(
                        inflight, return_when=concurrent.futures.FIRST_COMPLETED)
                    for f in finished:
                        n, etag = f.result()
                        done[n] = etag
                inflight.add(ex.submit(send, num, data))
            for f in concurrent.futures.as_completed(inflight):
                n, etag = f.result()
                done[n] = etag
            if not done:  # an empty object: one empty part
                done[1] = send(1, b"")[1]
            kw: dict[str, Any] = {
                "Bucket": self.bucket, "Key": key, "UploadId": uid,
                "MultipartUpload": {"Parts": [{"PartNumber": n, "ETag": done[n]}
                                              for n in sorted(done)]}}
            if create:
                kw["IfNoneMatch"] = "*"
            try:
                with self._client.call("complete upload", path):
                    self._s3.complete_multipart_upload(**kw)
            except ObjectExists:
                if not (create and self._written_by(key, token)):
                    raise
            except StorageError as e:
                # NoSuchUpload after a retry: the first completion landed.
                if not self._written_by(key, token):
                    raise e from None
        except BaseException:
            with contextlib.suppress(Exception):
                self._s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid)
            raise

    def open_append(self, name: str, *, create: bool = False) -> AppendHandle:
        """An :class:`S3AppendHandle`: staged in a local file, uploaded by ``sync``."""
        return S3AppendHandle(self, name, create=create)

    # ---------------------------------------------------------------- deleting

    def delete(self, name: str) -> None:
        """Remove the object (and its pieces). With ``gc_grace_s > 0`` it is hidden at
        once (a tombstone) and removed by a later :meth:`delete` or
        :meth:`collect_garbage` once the grace period has passed."""
        lay = self._layout(name)
        if lay.whole is None and not lay.pieces:
            return
        if self.options.gc_grace_s > 0:
            _WHOLE_CACHE.drop(self.bucket, self.key(name))
            if not lay.tomb:
                body = tombstone_bytes(time.time() + self.options.gc_grace_s)
                with self._client.call("delete", self.path_of(name)):
                    self._s3.put_object(Bucket=self.bucket, Key=self.key(name) + _TOMB,
                                        Body=body)
            now = time.monotonic()
            if now - self._last_sweep >= _SWEEP_EVERY_S:  # at most one sweep a minute
                self._last_sweep = now
                self.collect_garbage()
            return
        self._remove(name, lay)

    def _remove(self, name: str, lay: _Layout) -> None:
        key = self.key(name)
        _WHOLE_CACHE.drop(self.bucket, key)
        keys = [piece_name(key, off) for off, _ in lay.pieces]
        if lay.whole is not None:
            keys.append(key)
        with self._client.call("delete", self.path_of(name)):
            self._delete_keys(keys)
            # last: while the tombstone exists the object stays hidden
            self._s3.delete_object(Bucket=self.bucket, Key=key + _TOMB)

    def _delete_keys(self, keys: Sequence[str]) -> None:
        """DeleteObjects, 1000 keys a request (raises on any key not deleted)."""
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            if len(batch) == 1:
                self._s3.delete_object(Bucket=self.bucket, Key=batch[0])
                continue
            r = self._s3.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in batch], "Quiet": True})
            errs = r.get("Errors") or []
            if errs:
                e = errs[0]
                raise StorageError(f"delete of {e.get('Key')} failed: {e.get('Code')} "
                                   f"{e.get('Message', '')}".rstrip(),
                                   path=f"s3://{self.bucket}/{e.get('Key')}")

    def collect_garbage(self, *, now: float | None = None) -> int:
        """Remove every deleted object whose grace period has passed; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        lays = _layouts(self._list_keys(self.prefix + "/" if self.prefix else ""), None,
                        tombs_only=True)
        for key, lay in lays.items():
            name = self._name(key)
            try:
                body = msgpack.unpackb(self._get(key + _TOMB, None, None, self.path_of(name)))
                deadline = float(body["deadline"])
            except (StorageError, ValueError, KeyError, TypeError,
                    msgpack.UnpackException):
                continue
            if deadline <= now:
                self._remove(name, lay)
                removed += 1
        return removed

    def _clear_tomb(self, name: str) -> None:
        """Before reusing a deleted name: remove what its tombstone still hides."""
        lay = self._layout(name)
        if lay.tomb:
            self._remove(name, lay)

    def _drop_pieces(self, name: str, lay: _Layout) -> None:
        key = self.key(name)
        with self._client.call("delete", self.path_of(name)):
            self._delete_keys([piece_name(key, off) for off, _ in lay.pieces])

    # ---------------------------------------------------------------- locks

    def try_lock(self, name: str) -> StoreLock | None:
        """A lease lock object (create-only); None while another live holder has it."""
        return _S3Lock.acquire(self, name)


class _LayoutCache:
    """Recently listed whole objects, process-wide, for ``WHOLE_CACHE_S`` seconds.

    Whole objects of a log are immutable (sealed segments, bases, manifest versions), so a
    cached size is at worst an object deleted meanwhile, which stays readable for the grace
    period. Only positive results of whole objects are cached (never a missing object, never
    an object that is still growing as pieces); this process's own writes and deletes drop
    their entry. It saves the LIST that ``size`` and ``open`` would each send when the log
    asks both about the same object.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._d: OrderedDict[tuple[str, str], tuple[float, _Layout]] = OrderedDict()

    def get(self, bucket: str, key: str) -> _Layout | None:
        with self._lock:
            e = self._d.get((bucket, key))
            if e is None:
                return None
            if time.monotonic() - e[0] > WHOLE_CACHE_S:
                del self._d[(bucket, key)]
                return None
            return e[1]

    def put(self, bucket: str, key: str, lay: _Layout) -> None:
        with self._lock:
            self._d[(bucket, key)] = (time.monotonic(), lay)
            while len(self._d) > 4096:
                self._d.popitem(last=False)

    def drop(self, bucket: str, key: str) -> None:
        with self._lock:
            self._d.pop((bucket, key), None)


_WHOLE_CACHE = _LayoutCache()

#: Write-ahead files of the append handles open in this process (not to be recovered).
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()


def _wal_path(wal_dir: str, bucket: str, key: str) -> str:
    return os.path.join(wal_dir, bucket, *key.split("/"))


def _layouts(keys: list[tuple[str, int]], only: str | None, *, tombs_only: bool = False
             ) -> dict[str, _Layout]:
    """Group listed keys into logical objects (``only``: just that key; ``tombs_only``:
    just the deleted ones, including a tombstone left alone by a crash in a removal)."""
    whole: dict[str, int] = {}
    pieces: dict[str, list[tuple[int, int]]] = {}
    tombs: set[str] = set()
    for k, size in keys:
        m = _PIECE_RE.search(k)
        if m is not None:
            base = k[:m.start()]
            pieces.setdefault(base, []).append((int(m.group(1)), size))
        elif k.endswith(_TOMB):
            tombs.add(k[:-len(_TOMB)])
        else:
            whole[k] = size
    out: dict[str, _Layout] = {}
    for k in set(whole) | set(pieces):
        if only is not None and k != only:
            continue
        ps = sorted(pieces.get(k, []))
        # Keep the contiguous run from offset 0 (a crash in a truncate may leave a piece
        # beyond a gap: it holds no byte of the object).
        run: list[tuple[int, int]] = []
        for off, size in ps:
            if off != (run[-1][0] + run[-1][1] if run else 0):
                break
            run.append((off, size))
        out[k] = _Layout(whole.get(k), tuple(run), k in tombs)
    if only is not None and only in tombs and only not in out:
        out[only] = _Layout(None, (), True)
    if tombs_only:
        return {k: out.get(k, _Layout(None, (), True)) for k in tombs}
    return out


# -------------------------------------------------------------------- reading


class S3Source:
    """Random access to one object by ranged GETs.

    Reads of ``READ_BLOCK_BYTES`` or more are split into ``part_bytes`` ranges fetched in
    parallel into one buffer; one that continues the previous large read (a restore reading
    a base in order) fetches ``readahead_bytes`` at once instead, in ``concurrency`` ranges,
    and the reads that follow are served from that window. Smaller reads go through a cache of
    ``READ_BLOCK_BYTES`` blocks (bounded: at most ``READ_CACHE_BLOCKS``), so a scan of
    records in order costs one GET per block. The returned views own their memory (a fresh
    buffer, a cached block or a window, never written again).
    """

    def __init__(self, store: S3Store, name: str, layout: _Layout,
                 length: int | None) -> None:
        self.store = store
        self.name = name
        self.path = store.path_of(name)
        self._layout = layout
        full = layout.size
        if length is not None and not 0 <= length <= full:
            raise FormatError(f"cannot limit a source of {full} bytes to {length}",
                              reason=Reason.TRUNCATED, path=self.path)
        self.size = full if length is None else length
        self._blocks: OrderedDict[int, memoryview] = OrderedDict()
        self._lock = threading.Lock()
        self._next = 0  # end of the last read
        self._prev_large = False  # the last read was large: a large one at _next continues it
        self._ahead: tuple[int, memoryview] | None = None  # (offset, bytes) read ahead

    def read(self, offset: int, n: int) -> memoryview:
        """``n`` bytes at ``offset``; ``FormatError(truncated)`` past the end."""
        if offset < 0 or n < 0 or offset + n > self.size:
            raise FormatError(f"read of {n} bytes at {offset} past the end ({self.size} "
                              "bytes)", reason=Reason.TRUNCATED, path=self.path,
                              offset=offset)
        if n == 0:
            return memoryview(b"")
        # Two large reads in a row, the second where the first ended: a scan (a restore
        # reading a base). One large read after small ones (a record's header, then its
        # payload) is not: it must not fetch a window for one record.
        sequential = self._prev_large and 0 <= offset - self._next < ALIGN_GAP
        self._next = offset + n
        self._prev_large = n >= READ_BLOCK_BYTES
        ahead = self._ahead
        if ahead is not None and ahead[0] <= offset and offset + n <= ahead[0] + \
                ahead[1].nbytes:
            s = offset - ahead[0]
            return ahead[1][s:s + n]
        if n >= READ_BLOCK_BYTES:  # a tensor of a base: ranged GETs in parallel, no cache
            return self._read_large(offset, n, sequential)
        first, last = offset // READ_BLOCK_BYTES, (offset + n - 1) // READ_BLOCK_BYTES
        if first == last:
            b = self._block(first)
            s = offset - first * READ_BLOCK_BYTES
            return b[s:s + n]
        out = np.empty(n, dtype=np.uint8)
        pos = 0
        for i in range(first, last + 1):
            b = self._block(i)
            s = max(offset, i * READ_BLOCK_BYTES) - i * READ_BLOCK_BYTES
            e = min(offset + n, (i + 1) * READ_BLOCK_BYTES) - i * READ_BLOCK_BYTES
            out[pos:pos + e - s] = np.frombuffer(b[s:e], dtype=np.uint8)
            pos += e - s
        return memoryview(out.data).toreadonly()

    def _block(self, i: int) -> memoryview:
        with self._lock:
            b = self._blocks.get(i)
            if b is not None:
                self._blocks.move_to_end(i)
                return b
        start = i * READ_BLOCK_BYTES
        n = min(READ_BLOCK_BYTES, self._layout.size - start)
        b = memoryview(self._fetch(start, n))
        with self._lock:
            self._blocks[i] = b
            while len(self._blocks) > READ_CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        return b

    def _read_large(self, offset: int, n: int, sequential: bool) -> memoryview:
        """A large read: ranged GETs in parallel. A read that continues the previous large
        read fetches ``readahead_bytes`` at once, in ``concurrency``
        ranges: fewer, larger requests than one per tensor (a server that assembles the
        whole object for every ranged GET, as moto does, pays per request), all in flight
        together. Memory: one window per source, dropped when the next one is read.
        Views are read-only: a window serves several reads, so no caller may write in it
        (replay, seeing read-only memory, copies the gradients it would otherwise lend)."""
        opts = self.store.options
        window = min(max(n, opts.readahead_bytes), self.size - offset)
        if not sequential or window <= n:
            return self._read_parallel(offset, n, opts.part_bytes)
        step = max(opts.part_bytes, -(-window // opts.concurrency))
        buf = self._read_parallel(offset, window, step)
        self._ahead = (offset, buf)
        return buf[:n]

    def _read_parallel(self, offset: int, n: int, step: int) -> memoryview:
        out = np.empty(n, dtype=np.uint8)

        def one(s: int) -> None:
            k = min(step, n - s)
            out[s:s + k] = np.frombuffer(self._fetch(offset + s, k), dtype=np.uint8)

        if threading.current_thread().name.startswith(_POOL_PREFIX):
            for s in range(0, n, step):  # inside the pool: never wait on it
                one(s)
            return memoryview(out.data).toreadonly()
        futs = [self.store._executor().submit(one, s) for s in range(0, n, step)]
        for f in futs:
            f.result()
        return memoryview(out.data).toreadonly()

    def _fetch(self, start: int, n: int) -> bytes:
        """Bytes ``[start, start + n)`` of the object, across pieces if it has them. If a
        piece is gone (replaced by a whole object meanwhile, as a rebuilt index is, or
        deleted by compaction past its grace period), the layout is read again once."""
        try:
            return self._fetch_from(self._layout, start, n)
        except StorageError as e:
            if e.reason is not Reason.MISSING_FILE:
                raise
            lay = self.store._layout(self.name)
            if lay.size < start + n:
                raise
            self._layout = lay
            return self._fetch_from(lay, start, n)

    def _fetch_from(self, lay: _Layout, start: int, n: int) -> bytes:
        key = self.store.key(self.name)
        if lay.whole is not None:
            return self.store._get(key, start, n, self.path)
        want = [(piece_name(key, off), max(start, off) - off,
                 min(start + n, off + size) - max(start, off))
                for off, size in lay.pieces if max(start, off) < min(start + n, off + size)]
        def get(w: tuple[str, int, int]) -> bytes:
            return self.store._get(w[0], w[1], w[2], self.path)

        if len(want) == 1 or threading.current_thread().name.startswith(_POOL_PREFIX):
            # (inside the pool already: waiting on it from one of its threads could
            # deadlock it)
            return b"".join(get(w) for w in want)
        # pieces in parallel (a segment uploaded one group commit at a time has many)
        return b"".join(self.store._executor().map(get, want))

    def close(self) -> None:
        """Drop the cached blocks and the read-ahead window (views handed out stay valid:
        they own their memory)."""
        with self._lock:
            self._blocks.clear()
            self._ahead = None


# -------------------------------------------------------------------- appending


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

    def __init__(self, store: S3Store, name: str, *, create: bool) -> None:
        self.store = store
        self.name = name
        self.path = store.path_of(name)
        self._key = store.key(name)
        opts = store.options
        self._wal = opts.wal_dir
        self._interval = opts.upload_interval_s
        if self._wal is not None:
            self._local = _wal_path(self._wal, store.bucket, self._key)
            os.makedirs(os.path.dirname(self._local), exist_ok=True)
        else:
            d = tempfile.mkdtemp(prefix="lowdiff-s3-", dir=opts.staging_dir)
            self._local = os.path.join(d, "staged")
        try:
            lay = store._layout(name)  # (recovers a write-ahead copy left by a crash)
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
        if self.synced_size <= self._uploaded:
            return None
        return self._last_upload + self._interval

    def _open(self, lay: _Layout, create: bool) -> None:
        store, name = self.store, self.name
        # Without a write-ahead directory the staged file holds nothing a crash could
        # keep: syncing it would be an fdatasync for nothing.
        cls = AppendFile if self._wal is not None else _ScratchFile
        if create:
            if lay.exists:
                raise ObjectExists("open for append failed: object exists", path=self.path)
            if lay.tomb:
                store._clear_tomb(name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._local)  # residue of a crash before the first upload
            self._f = cls(self._local, create=True)
            self._uploaded = 0
            self._whole = False
        else:
            if not lay.exists:
                self._cleanup_local()
                raise store._missing(name)
            self._whole = lay.whole is not None
            have = os.path.getsize(self._local) if os.path.exists(self._local) else -1
            if have < lay.size:  # no write-ahead copy (or an older one): fetch the object
                self._download(lay)
            self._f = cls(self._local)
            self._uploaded = lay.size

    def _download(self, lay: _Layout) -> None:
        src = S3Source(self.store, self.name, lay, None)
        try:
            with open(self._local, "wb") as fh:
                step = self.store.options.part_bytes
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
        upload (see the class docstring)."""
        self._f.sync()
        self.synced_size = self._f.synced_size
        due = self._upload_due()
        if self._uploaded == 0 or (due is not None and time.monotonic() >= due):
            self.upload()

    def flush(self) -> None:
        """Sync and upload now: every byte is in the bucket when this returns."""
        self._f.sync()
        self.synced_size = self._f.synced_size
        self.upload()

    def upload(self) -> None:
        """Upload the synced bytes not yet in the bucket (one piece)."""
        end = self._f.synced_size
        if end <= self._uploaded:
            self._last_upload = time.monotonic()
            return
        if self._whole:  # an object that was sealed, appended to again: replace it
            self._publish_whole(end)
        elif end - self._uploaded >= PIECE_MULTIPART_MIN_BYTES:  # streamed from the file
            opts = self.store.options
            part = max(opts.part_bytes, -(-(end - self._uploaded) // opts.concurrency))
            self.store._multipart(piece_name(self._key, self._uploaded),
                                  self._parts(self._uploaded, end, part), create=True,
                                  path=self.path)
        else:
            data = self._read_local(self._uploaded, end - self._uploaded)
            self.store._upload(piece_name(self._key, self._uploaded), [data],
                               create=True, path=self.path, one_put=True)
        self._uploaded = end
        self._last_upload = time.monotonic()

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
        step = step or self.store.options.part_bytes
        with open(self._local, "rb") as fh:
            fh.seek(start)
            pos = start
            while pos < end:
                b = fh.read(min(step, end - pos))
                if not b:
                    raise StorageError("staged file shorter than expected", path=self._local)
                pos += len(b)
                yield b

    def _publish_whole(self, end: int) -> None:
        if end >= MULTIPART_MIN_BYTES:
            self.store._multipart(self._key, self._parts(0, end), create=False,
                                  path=self.path)
        else:
            self.store._upload(self._key, [self._read_local(0, end)], create=False,
                               path=self.path)

    def truncate(self, size: int) -> None:
        """Cut to ``size`` bytes, in the staged file and in the bucket."""
        self._f.truncate(size)
        self.size = self._f.size
        self.synced_size = self._f.synced_size
        if size >= self._uploaded:
            return
        if self._whole:
            self._publish_whole(size)
        else:
            lay = self.store._layout(self.name)
            with self.store._client.call("truncate", self.path):
                # the last piece first: a crash in between leaves a gap, and the object
                # then ends at the gap (see _layouts), never holds stale bytes
                for off, _n in reversed(lay.pieces):
                    if off >= size or off + _n > size:
                        self.store._s3.delete_object(
                            Bucket=self.store.bucket, Key=piece_name(self._key, off))
            keep = [(o, n) for o, n in lay.pieces if o + n <= size]
            start = keep[-1][0] + keep[-1][1] if keep else 0
            if start < size:
                self.store._upload(piece_name(self._key, start),
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
            # the next open of the object (_wal_recover), in this process too.
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


# -------------------------------------------------------------------- locks


class _S3Lock(StoreLock):
    """A lease: a create-only object naming its holder, refreshed every ``ttl / 3``."""

    def __init__(self, store: S3Store, name: str, owner: dict[str, Any], etag: str) -> None:
        self.name = name
        self._store = store
        self._owner = owner
        self._etag = etag
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="lowdiff-s3-lease",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, store: S3Store, name: str) -> _S3Lock | None:
        key = store.key(name)
        path = store.path_of(name)
        s3 = store._s3
        for _attempt in range(3):
            owner = {"host": socket.gethostname(), "pid": os.getpid(),
                     "id": uuid.uuid4().hex, "time": time.time(),
                     "ttl": store.options.lock_ttl_s}
            try:
                with store._client.call("lock", path):
                    r = s3.put_object(Bucket=store.bucket, Key=key, IfNoneMatch="*",
                                      Body=lock_bytes(owner))
                return cls(store, name, owner, str(r["ETag"]))
            except ObjectExists:
                pass
            try:
                with store._client.call("lock", path):
                    h = s3.get_object(Bucket=store.bucket, Key=key)
                    held = msgpack.unpackb(h["Body"].read())
                etag = str(h["ETag"])
            except StorageError as e:
                if e.reason is Reason.MISSING_FILE:
                    continue  # released meanwhile
                raise
            except (ValueError, msgpack.UnpackException):
                held, etag = {}, ""
            if isinstance(held, dict) and held.get("id") == owner["id"]:
                return cls(store, name, owner, etag)  # our own create, answered late (retry)
            if not _stale(held):
                return None
            with contextlib.suppress(StorageError), store._client.call("break lock", path):
                s3.delete_object(Bucket=store.bucket, Key=key, IfMatch=etag)
        return None

    def _refresh(self) -> None:
        ttl = float(self._owner["ttl"])
        store = self._store
        while not self._stop.wait(ttl / 3):
            self._owner["time"] = time.time()
            try:
                with store._client.call("refresh lock", store.path_of(self.name)):
                    r = store._s3.put_object(Bucket=store.bucket, Key=store.key(self.name),
                                             IfMatch=self._etag,
                                             Body=lock_bytes(self._owner))
                self._etag = str(r["ETag"])
            except StorageError:
                etag = self._still_ours()
                if etag is None:
                    return  # lost (broken by another process): commits still conflict safely
                self._etag = etag  # our refresh landed, its answer was lost (a retry's 412)

    def _still_ours(self) -> str | None:
        """The lock object's ETag if it still names this holder, else None."""
        store = self._store
        try:
            with store._client.call("refresh lock", store.path_of(self.name)):
                h = store._s3.get_object(Bucket=store.bucket, Key=store.key(self.name))
                held = msgpack.unpackb(h["Body"].read())
        except (StorageError, ValueError, msgpack.UnpackException):
            return None
        ok = isinstance(held, dict) and held.get("id") == self._owner["id"]
        return str(h["ETag"]) if ok else None

    def release(self) -> None:
        """Stop the lease and remove the lock object (only if it is still ours)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        store = self._store
        with contextlib.suppress(StorageError), \
                store._client.call("unlock", store.path_of(self.name)):
            store._s3.delete_object(Bucket=store.bucket, Key=store.key(self.name),
                                    IfMatch=self._etag)


def _stale(held: dict[str, Any]) -> bool:
    """A lock is stale when its holder process is gone (same host) or its lease ran out."""
    try:
        if held.get("host") == socket.gethostname():
            pid = int(held["pid"])
            if pid == os.getpid():
                return False
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            return False
        return bool(time.time() - float(held["time"]) > float(held["ttl"]))
    except (KeyError, TypeError, ValueError):
        return True


__all__ = ["DEFAULT_CONCURRENCY", "DEFAULT_GC_GRACE_S", "DEFAULT_PART_BYTES", "S3AppendHandle",
           "S3Options", "S3Source", "S3Store", "is_s3_url", "lock_bytes", "parse_url",
           "piece_name", "tombstone_bytes"]
