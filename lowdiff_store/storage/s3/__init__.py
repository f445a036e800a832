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

Modules: :mod:`.client` (tunables, the boto3 client, error lines), :mod:`.keys` (names and
layouts, no requests), :mod:`.objects` (the requests on a prefix), :mod:`.source` (ranged
reads), :mod:`.append` (append handles and the write-ahead directory's recovery),
:mod:`.lock` (leases), :mod:`.store` (:class:`S3Store`, composing them).
"""

from __future__ import annotations

from .append import S3AppendHandle
from .client import (
    DEFAULT_CONCURRENCY,
    DEFAULT_GC_GRACE_S,
    DEFAULT_PART_BYTES,
    MULTIPART_MIN_BYTES,
    S3Options,
)
from .keys import is_s3_url, lock_bytes, parse_url, piece_name, tombstone_bytes
from .source import S3Source
from .store import S3Store

__all__ = ["DEFAULT_CONCURRENCY", "DEFAULT_GC_GRACE_S", "DEFAULT_PART_BYTES",
           "MULTIPART_MIN_BYTES", "S3AppendHandle", "S3Options", "S3Source", "S3Store",
           "is_s3_url", "lock_bytes", "parse_url", "piece_name", "tombstone_bytes"]
