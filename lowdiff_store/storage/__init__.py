"""Storage layer: where bytes live. Local files today; an object-store backend slots in here.

- :class:`Source` reads bytes by offset: :class:`MmapSource` (zero-copy views) or
  :class:`PreadSource` (``os.pread``; for network filesystems where mmap is slow), and
  :class:`BytesSource` (in memory).
- :class:`AppendFile` appends with ``writev`` and makes bytes durable with ``fdatasync``.
- :func:`atomic_write` publishes a whole file: temp file, fsync, rename, fsync of the directory;
  :func:`atomic_publish` does the same for content a library writes to a file object.
"""

from .local import (
    AppendFile,
    BytesSource,
    DirLock,
    MmapSource,
    PreadSource,
    ReadMode,
    Source,
    atomic_publish,
    atomic_write,
    fsync_dir,
    open_source,
)

__all__ = [
    "AppendFile",
    "BytesSource",
    "DirLock",
    "MmapSource",
    "PreadSource",
    "ReadMode",
    "Source",
    "atomic_publish",
    "atomic_write",
    "fsync_dir",
    "open_source",
]
