"""The client of an ``s3://`` store: its tunables (:class:`S3Options` and the constants
below, the one place they are defined) and :class:`Client`, one boto3 client per set of
settings, with the translation of its errors into one-line :class:`StorageError` s.

``boto3`` (the ``lowdiff-store[s3]`` extra) is imported when the first client is made, never
when this package is imported.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from ...errors import LowdiffError, Reason, StorageError
from ..base import ObjectExists

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
#: Seconds a listed whole object's size is reused by this process (see ``keys.LayoutCache``).
WHOLE_CACHE_S = 5.0
#: Seconds between uploads of the active segment (and of its index) while it grows.
DEFAULT_UPLOAD_INTERVAL_S = 10.0
#: An outage (the store unreachable, ``5xx``): training goes on, the active segment staged
#: locally, for at most this many seconds without a successful upload...
DEFAULT_OUTAGE_BUDGET_S = 600.0
#: ... and while at most this many bytes per appended object wait in the staged file.
DEFAULT_OUTAGE_BUDGET_BYTES = 4 << 30
#: During an outage an upload is retried after this many seconds, doubled after each failed
#: retry up to ``OUTAGE_RETRY_MAX_S`` (at most two attempts each: the client's own retries
#: are for blips, this backoff is for outages).
OUTAGE_RETRY_MIN_S = 1.0
OUTAGE_RETRY_MAX_S = 15.0
#: A warning repeats at most this often while an outage lasts.
OUTAGE_WARN_EVERY_S = 30.0
#: :meth:`S3Store.delete` sweeps expired tombstones at most this often (per store object).
SWEEP_EVERY_S = 60.0
#: Name prefix of the I/O pool's threads (a read on one of them never waits on the pool).
POOL_PREFIX = "lowdiff-s3-io"


@dataclass(frozen=True)
class S3Options:
    """Tunables of an :class:`S3Store` (defaults documented in ``docs/object_store.md``).

    ``wal_dir`` and ``upload_interval_s`` may also come from the environment variables
    ``LOWDIFF_S3_WAL_DIR`` and ``LOWDIFF_S3_UPLOAD_INTERVAL_S``; ``gc_grace_s`` from
    ``LOWDIFF_S3_GC_GRACE_S``; ``max_attempts`` from ``LOWDIFF_S3_MAX_ATTEMPTS``;
    ``readahead_bytes`` from ``LOWDIFF_S3_READAHEAD_BYTES`` (0: no read-ahead);
    ``outage_budget_s`` and ``outage_budget_bytes`` (how long, and with how many bytes
    staged, an appended object waits for an unreachable store before the writer fails) from
    ``LOWDIFF_S3_OUTAGE_BUDGET_S`` and ``LOWDIFF_S3_OUTAGE_BUDGET_BYTES``;
    ``lock_ttl_s`` from ``LOWDIFF_S3_LOCK_TTL_S``; ``single_writer`` (accept a store that
    ignores conditional writes: see :meth:`S3Store.ensure_root`) from
    ``LOWDIFF_S3_SINGLE_WRITER=1``.
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
    outage_budget_s: float = DEFAULT_OUTAGE_BUDGET_S
    outage_budget_bytes: int = DEFAULT_OUTAGE_BUDGET_BYTES
    single_writer: bool = False

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
                               ("LOWDIFF_S3_READAHEAD_BYTES", "readahead_bytes", int),
                               ("LOWDIFF_S3_OUTAGE_BUDGET_S", "outage_budget_s", float),
                               ("LOWDIFF_S3_OUTAGE_BUDGET_BYTES", "outage_budget_bytes", int),
                               ("LOWDIFF_S3_LOCK_TTL_S", "lock_ttl_s", float)):
            if env.get(var):
                try:
                    kw[key] = conv(env[var])
                except ValueError:
                    raise LowdiffError(f"{var}={env[var]!r} is not a number",
                                       reason=Reason.INVALID_ARGUMENT) from None
        if env.get("LOWDIFF_S3_SINGLE_WRITER", "") not in ("", "0"):
            kw["single_writer"] = True
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


#: HTTP statuses with which S3-compatible servers refuse writes when their disks or volumes
#: are full: SeaweedFS and MinIO answer ``500 InternalError``, WebDAV-style ``507``.
FULL_STATUSES = frozenset({500, 507})


def answer_status(e: BaseException) -> int | None:
    """The HTTP status of the server's answer behind ``e`` (an error raised ``from`` a
    botocore ``ClientError``, at any depth), or None when no answer came (connection
    refused or reset, timeout)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        resp = getattr(cur, "response", None)
        if isinstance(resp, dict):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
        cur = cur.__cause__ or cur.__context__
    return None


def refusal_hint(status: int | None) -> str:
    """What an upload refused with ``status`` for a whole outage may mean, and what to
    check ("" for no answer, or a status that says nothing about space)."""
    if status not in FULL_STATUSES:
        return ""
    return (f"the server answers HTTP {status} to uploads: it may be out of space "
            "(SeaweedFS and MinIO answer 500 InternalError when full): check its free "
            "disk space, its volume size and count limits, and its log")



class Client:
    """One boto3 client (thread-safe) shared by the stores of one bucket, and the
    translation of its errors into :class:`StorageError` lines."""

    _lock = threading.Lock()
    _cache: ClassVar[dict[tuple[Any, ...], Client]] = {}

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
                    self._concurrency, thread_name_prefix=POOL_PREFIX)
            return self._pool

    @classmethod
    def get(cls, opts: S3Options) -> Client:
        env = tuple(os.environ.get(k) for k in (
            "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
            "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"))
        key = (env, opts.max_attempts, opts.concurrency)
        with cls._lock:
            c = cls._cache.get(key)
            if c is None:
                c = cls._cache[key] = Client(opts)
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
            unavailable = isinstance(status, int) and status >= 500
            return StorageError(f"{what} failed: {code or status} "
                                f"{err.get('Message', '')}".rstrip(), path=path,
                                reason=Reason.STORE_UNAVAILABLE if unavailable else None)
        if isinstance(e, exc.NoCredentialsError):
            return StorageError("no AWS credentials found (set AWS_PROFILE or "
                                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)", path=path)
        if isinstance(e, (exc.EndpointConnectionError, exc.ConnectionClosedError,
                          exc.ReadTimeoutError, exc.ConnectTimeoutError)):
            return StorageError(f"{what}: cannot reach {self.endpoint} after retries "
                                f"({type(e).__name__})", path=path,
                                reason=Reason.STORE_UNAVAILABLE)
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
