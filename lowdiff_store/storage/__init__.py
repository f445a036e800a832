"""Storage layer: where bytes live, behind one interface (:class:`Store`).

- :class:`Store` (``storage/base.py``): the abstract store the log uses and nothing else:
  list, ranged reads (:class:`Source`), write-once objects, append handles, atomic publish,
  a versioned commit (compare-and-swap), locks, durable deletes. See ``docs/storage.md``.
- :class:`LocalStore` (``storage/local.py``): a local directory; built from
  :class:`MmapSource` / :class:`PreadSource` (``os.pread``; for network filesystems where
  mmap is slow), :class:`AppendFile` (``writev`` + ``fdatasync``) and :func:`atomic_write`
  (temp file, fsync, rename, fsync of the directory); :func:`atomic_publish` does
  the same for content a library writes to a file object.
- :func:`open_store` is the one place a path or URL becomes a store.
"""

from __future__ import annotations

import os

from ..errors import LowdiffError, Reason
from .base import (
    AppendHandle,
    CommitConflict,
    ObjectExists,
    ReadMode,
    Source,
    Store,
    StoreLock,
    Versioned,
    check_name,
)
from .local import (
    PUBLISH_TEMP_MARK,
    AppendFile,
    BytesSource,
    LocalStore,
    MmapSource,
    PreadSource,
    atomic_publish,
    atomic_publish_dir,
    atomic_write,
    fsync_dir,
    is_directory,
    open_source,
    os_error_in,
    publish_temp_name,
    read_capped,
    read_into,
    regular_file_size,
    remove_stale_publish_temps,
)

#: What a function taking a log accepts: a directory path, a URL, or a store.
StoreLike = str | os.PathLike[str] | Store


def open_store(location: StoreLike, *, append_file: type[AppendFile] | None = None) -> Store:
    """The store for a path or URL (a :class:`Store` is returned as it is).

    A plain path (or ``file://`` URL) is a :class:`LocalStore`. ``append_file`` replaces
    the append-file class of a local store (fault injection in tests)."""
    if isinstance(location, Store):
        return location
    loc = os.fspath(location)
    if "://" in loc:
        scheme = loc.split("://", 1)[0].lower()
        if scheme == "file":
            return LocalStore(loc[len("file://"):], append_file=append_file)
        if scheme == "s3":
            from .s3 import S3Store  # lazy: boto3 is imported only for s3:// locations

            return S3Store(loc)
        raise LowdiffError(f"no storage backend for {scheme}:// locations",
                           reason=Reason.INVALID_ARGUMENT, path=loc)
    return LocalStore(loc, append_file=append_file)


__all__ = [
    "AppendFile",
    "AppendHandle",
    "BytesSource",
    "CommitConflict",
    "LocalStore",
    "MmapSource",
    "ObjectExists",
    "PUBLISH_TEMP_MARK",
    "PreadSource",
    "ReadMode",
    "Source",
    "Store",
    "StoreLike",
    "StoreLock",
    "Versioned",
    "atomic_publish",
    "atomic_publish_dir",
    "atomic_write",
    "check_name",
    "fsync_dir",
    "is_directory",
    "open_source",
    "open_store",
    "os_error_in",
    "publish_temp_name",
    "remove_stale_publish_temps",
    "read_capped",
    "read_into",
    "regular_file_size",
]
