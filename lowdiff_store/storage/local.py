"""Local-file storage: sources, append files, atomic publish, directory locks."""

from __future__ import annotations

import errno
import io
import mmap
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import BinaryIO, Literal, Protocol, cast

import numpy as np

from ..errors import FormatError, LowdiffError, Reason, StorageError

Buffer = bytes | bytearray | memoryview
ReadMode = Literal["mmap", "pread"]

#: os.writev takes at most IOV_MAX buffers per call.
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)


def _storage_error(e: OSError, what: str, path: str, offset: int | None = None) -> StorageError:
    err = StorageError(f"{what} failed: {e.strerror or e} (errno {e.errno})",
                       path=path, offset=offset)
    err.errno = e.errno
    return err


class Source(Protocol):
    """Random-access bytes. ``read`` is bounds-checked against ``size``."""

    path: str
    size: int

    def read(self, offset: int, n: int) -> memoryview:
        """``n`` bytes at ``offset``; raises ``FormatError(truncated)`` past the end."""
        ...

    def close(self) -> None:
        """Release the file. Views returned by ``read`` must not be used afterwards."""
        ...


def _check_range(src: Source, offset: int, n: int) -> None:
    if offset < 0 or n < 0 or offset + n > src.size:
        raise FormatError(f"read of {n} bytes at {offset} past the end ({src.size} bytes)",
                          reason=Reason.TRUNCATED, path=src.path, offset=offset)


class BytesSource:
    """An in-memory source (tests, golden vectors)."""

    def __init__(self, data: Buffer, path: str = "<memory>") -> None:
        self._mv = memoryview(data).cast("B") if memoryview(data).format != "B" else \
            memoryview(data)
        self.path = path
        self.size = self._mv.nbytes

    def read(self, offset: int, n: int) -> memoryview:
        _check_range(self, offset, n)
        return self._mv[offset:offset + n]

    def close(self) -> None:
        pass


class MmapSource:
    """A read-only memory map. ``read`` returns zero-copy views into the map.

    Lifetime: views (and numpy arrays made from them) keep the map alive; the file is not
    rewritten by lowdiff-store while mapped (files are append-only and replaced by rename),
    so views never change under the reader. ``close`` drops this object's reference.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise _storage_error(e, "open", path) from e
        try:
            self.size = os.fstat(fd).st_size
            self._map: mmap.mmap | None = (
                mmap.mmap(fd, self.size, access=mmap.ACCESS_READ) if self.size else None)
        except OSError as e:
            raise _storage_error(e, "mmap", path) from e
        finally:
            os.close(fd)
        self._mv = memoryview(self._map) if self._map is not None else memoryview(b"")

    def read(self, offset: int, n: int) -> memoryview:
        _check_range(self, offset, n)
        return self._mv[offset:offset + n]

    def close(self) -> None:
        # Views handed out keep the mapping alive; release ours only.
        self._mv = memoryview(b"")


class PreadSource:
    """Reads with ``os.pread`` into fresh buffers (no mmap): for NFS, Lustre, cloud disks."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY)
            self.size = os.fstat(self._fd).st_size
        except OSError as e:
            raise _storage_error(e, "open", path) from e

    def read(self, offset: int, n: int) -> memoryview:
        _check_range(self, offset, n)
        if self._fd is None:
            raise StorageError("read after close", path=self.path, offset=offset)
        # np.empty, not bytearray: a bytearray is zero-filled first, which cost 3x the read
        # itself on large records (bench/RESULTS_log.md). Every byte is overwritten below.
        mv = np.empty(n, dtype=np.uint8).data
        got = 0
        try:
            while got < n:
                k = os.preadv(self._fd, [mv[got:]], offset + got)
                if k == 0:
                    raise FormatError("file shrank while reading", reason=Reason.TRUNCATED,
                                      path=self.path, offset=offset + got)
                got += k
        except OSError as e:
            raise _storage_error(e, "pread", self.path, offset) from e
        return mv

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_source(path: str, mode: ReadMode = "mmap") -> Source:
    """Open ``path`` for reading with the chosen backend."""
    if mode == "mmap":
        return MmapSource(path)
    if mode == "pread":
        return PreadSource(path)
    raise LowdiffError(f"unknown read mode {mode!r} (use 'mmap' or 'pread')")


def fsync_dir(path: str) -> None:
    """fsync a directory so that creations and renames in it are durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise _storage_error(e, "open directory", path) from e
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # some filesystems refuse: harmless
            raise _storage_error(e, "fsync directory", path) from e
    finally:
        os.close(fd)


def _write_all(fd: int, chunks: Sequence[Buffer], offset: int | None = None) -> int:
    """writev every chunk (``pwritev`` at ``offset`` when given: one syscall, no seek),
    resuming after short writes. Returns bytes written."""
    views = [memoryview(c).cast("B") if memoryview(c).format != "B" or memoryview(c).ndim != 1
             else memoryview(c) for c in chunks]
    views = [v for v in views if v.nbytes]
    total = 0
    i = 0
    while i < len(views):
        batch = views[i:i + _IOV_MAX]
        n = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, offset + total)
        if n <= 0:  # no progress: retrying would loop forever
            raise OSError(errno.EIO, "writev made no progress")
        total += n
        # advance past fully written views, trim a partially written one
        while n > 0 and i < len(views):
            if n >= views[i].nbytes:
                n -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return total


def atomic_write(path: str, chunks: Iterable[Buffer], *, fsync: bool = True) -> None:
    """Publish ``path`` atomically: write ``path.tmp``, fsync, rename over ``path``,
    fsync the directory. Readers see the old file or the new one, never a mix; a file that
    readers have mapped is never rewritten (it is replaced)."""
    tmp = path + ".tmp"
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        raise _storage_error(e, "create", tmp) from e
    try:
        _write_all(fd, list(chunks))
        if fsync:
            os.fsync(fd)
    except OSError as e:
        os.close(fd)
        _unlink_quiet(tmp)
        raise _storage_error(e, "write", tmp) from e
    os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError as e:
        _unlink_quiet(tmp)
        raise _storage_error(e, "rename", path) from e
    if fsync:
        fsync_dir(d)


class _WriteTracker(io.RawIOBase):
    """The file object :func:`atomic_publish` hands to ``fill``: a seekable read/write file
    that remembers the first ``OSError`` of a write, so that the reason (ENOSPC, EIO...)
    survives libraries that wrap it (torch.save raises ``RuntimeError``, h5py its own)."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self._f = f
        self.error: OSError | None = None

    def _track(self, e: OSError) -> None:
        if self.error is None:
            self.error = e

    def write(self, b: Buffer) -> int:  # type: ignore[override]
        try:
            return self._f.write(b)
        except OSError as e:
            self._track(e)
            raise

    def readinto(self, b: Buffer) -> int:  # type: ignore[override]
        return self._f.readinto(b)  # type: ignore[attr-defined,no-any-return]

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def truncate(self, size: int | None = None) -> int:
        try:
            return self._f.truncate(size)
        except OSError as e:
            self._track(e)
            raise

    def flush(self) -> None:
        if self._f.closed:
            return
        try:
            self._f.flush()
        except OSError as e:
            self._track(e)
            raise

    def close(self) -> None:
        """Flush and close the temp file (the descriptor too). Idempotent."""
        try:
            if not self._f.closed:
                self.flush()
        finally:
            self._f.close()
            super().close()

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def atomic_publish(path: str | os.PathLike[str], fill: Callable[[BinaryIO], object]) -> int:
    """Publish ``path`` atomically from a writer callback, for content a library writes to a
    file object (``torch.save``, h5py): ``fill(f)`` writes to a new temp file in the same
    directory (``.NAME.RANDOM.tmp``, created exclusively); then fsync of the data, rename
    over ``path``, fsync of the directory. Readers see the old file or the new one; after a
    power cut, the name holds the old file or the complete new one.

    On any failure (ENOSPC, EIO, an exception in ``fill``, Ctrl-C) the temp file is removed
    and ``path`` is untouched. An ``OSError`` met on the way, even one ``fill``'s library
    wrapped in its own exception, is raised as :class:`StorageError` with its errno; other
    exceptions propagate. Returns the size of the file published."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise _storage_error(OSError(errno.EISDIR, os.strerror(errno.EISDIR)), "publish", path)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise _storage_error(e, "create temp file", path) from e
    try:
        out = _WriteTracker(os.fdopen(fd, "w+b"))
    except BaseException:
        os.close(fd)
        _unlink_quiet(tmp)
        raise
    what = "write"
    try:
        try:
            fill(cast("BinaryIO", out))
            out.flush()
            what = "fsync"
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            out.close()
        what = "rename"
        os.replace(tmp, path)
    except BaseException as e:
        _unlink_quiet(tmp)
        cause = out.error or (e if isinstance(e, OSError) else None)
        if cause is not None and isinstance(e, Exception):
            raise _storage_error(cause, what, path) from e
        raise
    fsync_dir(d)
    return size


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class AppendFile:
    """An append-only file: ``append`` writes at the end, ``sync`` makes it durable.

    Subclass and override :meth:`_writev` / :meth:`_sync` to inject faults in tests.
    """

    def __init__(self, path: str, *, create: bool = False) -> None:
        self.path = path
        flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            self._fd: int | None = os.open(path, flags, 0o644)
            self.size = os.fstat(self._fd).st_size
        except OSError as e:
            raise _storage_error(e, "open for append", path) from e
        self.synced_size = self.size

    def _writev(self, fd: int, chunks: Sequence[Buffer]) -> int:
        return _write_all(fd, chunks, self.size)

    def _sync(self, fd: int) -> None:
        os.fdatasync(fd)

    def append(self, chunks: Sequence[Buffer]) -> int:
        """Write the chunks at the end of the file; returns the offset they start at."""
        if self._fd is None:
            raise StorageError("append after close", path=self.path)
        start = self.size
        expected = sum(memoryview(c).nbytes for c in chunks)
        try:
            n = self._writev(self._fd, chunks)
            if n != expected:  # a _writev that gave up early: never record a partial write
                raise OSError(errno.EIO, f"short write: {n} of {expected} bytes")
        except OSError as e:
            # A short write may have left part of the chunks in the file: note the real
            # size so the next open cuts it as a torn tail.
            self._refresh_size()
            raise _storage_error(e, "write", self.path, start) from e
        self.size = start + n
        return start

    def rewrite_unsynced(self, offset: int, data: Buffer) -> None:
        """Overwrite bytes appended since the last :meth:`sync` (a record's CRC field, filled
        in once computed). Durable bytes are never rewritten: that is refused."""
        if self._fd is None:
            raise StorageError("write after close", path=self.path)
        n = memoryview(data).nbytes
        if offset < self.synced_size or offset + n > self.size:
            raise StorageError(f"refusing to rewrite [{offset}, {offset + n}): only bytes "
                               f"[{self.synced_size}, {self.size}) are not yet durable",
                               reason=Reason.INVALID_ARGUMENT, path=self.path, offset=offset)
        try:
            done = 0
            while done < n:
                k = os.pwrite(self._fd, memoryview(data)[done:], offset + done)
                if k <= 0:
                    raise OSError(errno.EIO, "pwrite made no progress")
                done += k
        except OSError as e:
            raise _storage_error(e, "write", self.path, offset) from e

    def sync(self) -> None:
        """fdatasync: every byte appended so far is durable when this returns."""
        if self._fd is None:
            raise StorageError("sync after close", path=self.path)
        try:
            self._sync(self._fd)
        except OSError as e:
            raise _storage_error(e, "fsync", self.path) from e
        self.synced_size = self.size

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes (only ever used on a torn, never-durable tail)."""
        if self._fd is None:
            raise StorageError("truncate after close", path=self.path)
        try:
            os.ftruncate(self._fd, size)
            os.fdatasync(self._fd)
        except OSError as e:
            raise _storage_error(e, "truncate", self.path, size) from e
        self.size = size
        self.synced_size = min(self.synced_size, size)

    def _refresh_size(self) -> None:
        try:
            if self._fd is not None:
                self.size = os.fstat(self._fd).st_size
        except OSError:
            pass

    def close(self) -> None:
        """Close the descriptor (no implicit sync). Idempotent."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            finally:
                self._fd = None


class DirLock:
    """An exclusive advisory lock on ``DIR/LOCK``: one writer per log at a time."""

    def __init__(self, directory: str, name: str = "LOCK") -> None:
        import fcntl

        self.path = os.path.join(directory, name)
        try:
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _storage_error(e, "open lock", self.path) from e
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            self._fd = None
            raise LowdiffError("another writer holds this log (LOCK is taken)",
                               reason=Reason.LOCKED, path=self.path) from None

    def release(self) -> None:
        """Release the lock. Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
