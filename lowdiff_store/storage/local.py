"""The local-directory store (:class:`LocalStore`) and the local-file pieces it is built from:
sources (mmap, pread), append files, atomic publish, directory fsync, the one lock helper."""

from __future__ import annotations

import builtins
import ctypes
import errno
import fcntl
import hashlib
import io
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import BinaryIO, TypeVar, cast

import numpy as np

from ..errors import FormatError, LowdiffError, Reason, StorageError
from ..format.constants import MAX_MANIFEST_BYTES
from .base import (
    Buffer,
    CommitConflict,
    ObjectExists,
    PublishHandle,
    ReadMode,
    Source,
    Store,
    StoreLock,
    Versioned,
    check_name,
)

#: os.writev takes at most IOV_MAX buffers per call.
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)


#: ``sync_file_range(2)`` flag: start writeback of the dirty pages of a range, do not wait.
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux only; ``os`` does not wrap it), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, int, int], int]", fn)


_sync_file_range = _load_sync_file_range()


def _storage_error(e: OSError, what: str, path: str, offset: int | None = None) -> StorageError:
    cls = ObjectExists if e.errno == errno.EEXIST else StorageError
    err = cls(f"{what} failed: {e.strerror or e} (errno {e.errno})", path=path, offset=offset)
    err.errno = e.errno
    return err


def _open_regular(path: str, flags: int, what: str) -> tuple[int, int]:
    """Open ``path`` refusing anything but a regular file: (fd, size). ``O_NONBLOCK`` makes
    opening a FIFO return at once (instead of waiting forever for a writer) so that the
    check below can refuse it; on a regular file the flag has no effect."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise StorageError("not a regular file (a FIFO): refused",
                               reason=Reason.NOT_A_REGULAR_FILE, path=path) from None
        raise _storage_error(e, what, path) from e
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise _storage_error(e, "stat", path) from e
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise StorageError("not a regular file (a FIFO, device or directory): refused",
                           reason=Reason.NOT_A_REGULAR_FILE, path=path)
    return fd, st.st_size


def _check_range(src: Source, offset: int, n: int) -> None:
    if offset < 0 or n < 0 or offset + n > src.size:
        raise FormatError(f"read of {n} bytes at {offset} past the end ({src.size} bytes)",
                          reason=Reason.TRUNCATED, path=src.path, offset=offset)


def _writable_bytes(buf: Buffer) -> memoryview:
    mv = memoryview(buf)
    if mv.readonly or not mv.c_contiguous:
        raise LowdiffError("read_into needs a writable C-contiguous buffer",
                           reason=Reason.INVALID_ARGUMENT)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _pread_into(fd: int, path: str, offset: int, mv: memoryview, ahead: int, size: int,
                advised: int = 0) -> int:
    """Fill ``mv`` from ``fd`` at ``offset``; first ask the kernel to start reading the
    ``ahead`` bytes after it (``POSIX_FADV_WILLNEED``), only the part past ``advised``
    (where an earlier call's advice ended: pages asked for twice are walked twice), so
    that the disk works on them while the caller uses these. Returns where the advice
    now ends."""
    n = mv.nbytes
    end = offset + n
    try:
        start, stop = max(end, advised), min(size, end + ahead)
        if ahead > 0 and start < stop and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, start, stop - start, os.POSIX_FADV_WILLNEED)
            advised = stop
        got = 0
        while got < n:
            k = os.preadv(fd, [mv[got:]], offset + got)
            if k == 0:
                raise FormatError("file shrank while reading", reason=Reason.TRUNCATED,
                                  path=path, offset=offset + got)
            got += k
    except OSError as e:
        raise _storage_error(e, "pread", path, offset) from e
    return advised


def read_into(src: Source, offset: int, buf: Buffer, *, ahead: int = 0) -> None:
    """Fill the writable buffer ``buf`` with the bytes of ``src`` at ``offset`` (bounds
    checked as :meth:`Source.read`). A local file (:class:`MmapSource`,
    :class:`PreadSource`) is read with ``pread`` straight into ``buf``, the kernel asked
    to read the next ``ahead`` bytes meanwhile; any other source is copied from
    :meth:`Source.read`. FormatError(truncated) if the file is shorter than it was."""
    mv = _writable_bytes(buf)
    if isinstance(src, (MmapSource, PreadSource, BytesSource)):
        src.read_into(offset, mv, ahead=ahead)
        return
    _check_range(src, offset, mv.nbytes)
    mv[:] = src.read(offset, mv.nbytes)


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

    def read_into(self, offset: int, buf: Buffer, *, ahead: int = 0) -> None:
        """Copy the bytes at ``offset`` into ``buf`` (see :func:`read_into`)."""
        del ahead  # in memory already
        mv = _writable_bytes(buf)
        _check_range(self, offset, mv.nbytes)
        mv[:] = self._mv[offset:offset + mv.nbytes]

    def close(self) -> None:
        pass


class MmapSource:
    """A read-only memory map. ``read`` returns zero-copy views into the map.

    ``private``: map copy-on-write (``MAP_PRIVATE``): the views are writable and a write
    copies the page for this process only; the file never changes. Replay hands such views
    to the optimizer as gradients without copying them. Where the kernel refuses a private
    writable map (strict overcommit, ``ENOMEM``) the map is read-only, as without it.

    Lifetime: views (and numpy arrays made from them) keep the map alive; the file is not
    rewritten by lowdiff-store while mapped (files are append-only and replaced by rename),
    so views never change under the reader. ``close`` drops this object's reference.
    """

    def __init__(self, path: str, *, length: int | None = None, private: bool = False
                 ) -> None:
        self.path = path
        fd, size = _open_regular(path, os.O_RDONLY, "open")
        # read_into reads the mapped file with pread through an fd opened on first use,
        # checked to be this file (a file renamed over the path since is not read)
        self._fd: int | None = None
        self._pread_ok = True
        self._closed = False
        self._advised = 0  # where read_into's read-ahead advice ends
        try:
            st = os.fstat(fd)
            self._ident = (st.st_dev, st.st_ino)
            self.size = _limit(path, size, length)
            self._map: mmap.mmap | None = None
            if self.size and private:
                try:
                    self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_COPY)
                except OSError as e:
                    if e.errno != errno.ENOMEM:
                        raise
            if self.size and self._map is None:
                self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ)
        except OSError as e:
            raise _storage_error(e, "mmap", path) from e
        finally:
            os.close(fd)
        self._mv = memoryview(self._map) if self._map is not None else memoryview(b"")

    def read(self, offset: int, n: int) -> memoryview:
        _check_range(self, offset, n)
        return self._mv[offset:offset + n]

    def read_into(self, offset: int, buf: Buffer, *, ahead: int = 0) -> None:
        """Copy the bytes at ``offset`` into ``buf``: with ``pread`` from the mapped file
        (the kernel's sequential read-ahead, no page faults on the map; see
        :func:`read_into`), or from the map where the file cannot be opened again as the
        same file."""
        mv = _writable_bytes(buf)
        _check_range(self, offset, mv.nbytes)
        if self._closed:
            raise StorageError("read after close", path=self.path, offset=offset)
        fd = self._pread_fd()
        if fd is None:
            mv[:] = self._mv[offset:offset + mv.nbytes]
            return
        self._advised = _pread_into(fd, self.path, offset, mv, ahead, self.size,
                                    self._advised)

    def _pread_fd(self) -> int | None:
        if self._fd is None and self._pread_ok:
            self._pread_ok = False  # one try
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            try:
                st = os.fstat(fd)
            except OSError:
                os.close(fd)
                return None
            if (st.st_dev, st.st_ino) != self._ident or not stat.S_ISREG(st.st_mode):
                os.close(fd)
                return None
            self._fd = fd
        return self._fd

    def close(self) -> None:
        # Views handed out keep the mapping alive; release ours only.
        self._mv = memoryview(b"")
        self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class PreadSource:
    """Reads with ``os.pread`` into fresh buffers (no mmap): for NFS, Lustre, cloud disks."""

    def __init__(self, path: str, *, length: int | None = None) -> None:
        self.path = path
        fd, size = _open_regular(path, os.O_RDONLY, "open")
        self._fd: int | None = fd
        self._advised = 0  # where read_into's read-ahead advice ends
        try:
            self.size = _limit(path, size, length)
        except BaseException:
            self.close()
            raise

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

    def read_into(self, offset: int, buf: Buffer, *, ahead: int = 0) -> None:
        """Read the bytes at ``offset`` straight into ``buf`` (see :func:`read_into`)."""
        mv = _writable_bytes(buf)
        _check_range(self, offset, mv.nbytes)
        if self._fd is None:
            raise StorageError("read after close", path=self.path, offset=offset)
        self._advised = _pread_into(self._fd, self.path, offset, mv, ahead, self.size,
                                    self._advised)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _limit(path: str, size: int, length: int | None) -> int:
    if length is None:
        return size
    if not 0 <= length <= size:
        raise FormatError(f"cannot limit a source of {size} bytes to {length}",
                          reason=Reason.TRUNCATED, path=path)
    return length


def open_source(path: str, mode: ReadMode = "mmap", *, length: int | None = None) -> Source:
    """Open ``path`` for reading with the chosen backend (a regular file only; ``length``:
    only its first ``length`` bytes, see :meth:`Store.open`)."""
    if mode in ("mmap", "private"):
        return MmapSource(path, length=length, private=mode == "private")
    if mode == "pread":
        return PreadSource(path, length=length)
    raise LowdiffError(f"unknown read mode {mode!r} (use 'mmap', 'private' or 'pread')")


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
    _replace(path, path + ".tmp", chunks, fsync=fsync)


def _replace(path: str, tmp: str, chunks: Iterable[Buffer], *, fsync: bool = True,
             exclusive: bool = False) -> None:
    """Write ``tmp``, fsync it, move it to ``path`` (``exclusive``: hard link, failing
    with :class:`ObjectExists` if ``path`` exists; else rename over it), fsync the
    directory. ``tmp`` never survives an error."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise _storage_error(e, "create", tmp) from e
    try:
        _write_all(fd, list(chunks))
        if fsync:
            os.fsync(fd)
    except BaseException as e:
        os.close(fd)
        _unlink_quiet(tmp)
        if isinstance(e, OSError):
            raise _storage_error(e, "write", tmp) from e
        raise
    os.close(fd)
    try:
        if exclusive:
            os.link(tmp, path)
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except OSError as e:
        _unlink_quiet(tmp)
        raise _storage_error(e, "create" if exclusive else "rename", path) from e
    if fsync:
        fsync_dir(d)


class _WriteTracker(io.RawIOBase):
    """The file object :func:`atomic_publish` hands to ``fill``: a seekable read/write file
    that remembers the first ``OSError`` of a write and the file offset it failed at, so
    that the reason (ENOSPC, EIO...) and the place survive libraries that wrap it
    (torch.save raises ``RuntimeError``, h5py its own)."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self._f = f
        self.error: OSError | None = None
        self.error_offset: int | None = None

    def _track(self, e: OSError) -> None:
        if self.error is None:
            self.error = e
            # The descriptor's position: where the write the kernel refused began (the
            # buffer's writes go there; a partial write moved it to the byte that failed).
            try:
                self.error_offset = os.lseek(self._f.fileno(), 0, os.SEEK_CUR)
            except (OSError, ValueError):
                pass

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
    directory (:func:`publish_temp_name`, created exclusively); then fsync of the data,
    rename over ``path``, fsync of the directory. Readers see the old file or the new one;
    after a power cut, the name holds the old file or the complete new one.

    A process killed meanwhile (SIGKILL, OOM killer) cannot remove its temp file: the next
    publish into the same directory does (:func:`remove_stale_publish_temps`).

    On any failure (ENOSPC, EIO, an exception in ``fill``, Ctrl-C) the temp file is removed
    and ``path`` is untouched. An ``OSError`` met on the way, even one ``fill``'s library
    wrapped in its own exception, is raised as :class:`StorageError` with its errno (and,
    for a write, the offset in the file it failed at); other exceptions propagate. Returns
    the size of the file published."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise _storage_error(OSError(errno.EISDIR, os.strerror(errno.EISDIR)), "publish", path)
    remove_stale_publish_temps(d)  # before writing: they may hold the space it needs
    tmp, fd = _new_temp(path, lambda t: os.open(t, _TEMP_FILE_FLAGS, 0o644), "create temp file")
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
        cause = out.error or (None if isinstance(e, LowdiffError) else os_error_in(e))
        if cause is not None and isinstance(e, Exception):
            at = out.error_offset if cause is out.error else None
            raise _storage_error(cause, what, path, at) from e
        raise
    fsync_dir(d)
    return size


class PublishFile:
    """A file written at any offset, then published atomically (:meth:`commit`: fsync,
    rename over ``path``, directory fsync) or removed (:meth:`abort`). Its temp file is
    named as :func:`atomic_publish`'s, so a process killed meanwhile leaves a file the
    next publish in that directory removes (:func:`remove_stale_publish_temps`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        remove_stale_publish_temps(os.path.dirname(path))  # (they may hold the space)
        self.tmp, self._fd = _new_temp(path, lambda t: os.open(t, _TEMP_FILE_FLAGS, 0o644),
                                       "create temp file")
        self._open = True

    def write_at(self, offset: int, data: Buffer) -> None:
        """Write ``data`` at ``offset`` (``StorageError`` naming the file and offset)."""
        try:
            _write_all(self._fd, [data], offset)
        except OSError as e:
            raise _storage_error(e, "write", self.path, offset) from e

    def truncate(self, size: int) -> None:
        """Set the file's size."""
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            raise _storage_error(e, "write", self.path) from e

    def commit(self) -> None:
        """fsync, rename over the path, fsync the directory; the temp file is removed on
        failure."""
        what = "fsync"
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._open = False
            what = "rename"
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise _storage_error(e, what, self.path) from e
        self.tmp = ""
        fsync_dir(os.path.dirname(self.path))

    def abort(self) -> None:
        """Close and remove the temp file; idempotent."""
        if self._open:
            self._open = False
            os.close(self._fd)
        if self.tmp:
            _unlink_quiet(self.tmp)
            self.tmp = ""


#: How a temp file is created: a new name only (``O_EXCL``), never through a symlink
#: (``O_NOFOLLOW``; ``O_EXCL`` already refuses one, this says so to the reader and the kernel).
_TEMP_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: Names drawn before a publish gives up (a collision of 32 random bits is a planted name).
_TEMP_TRIES = 16

_T = TypeVar("_T")


def _new_temp(path: str, create: Callable[[str], _T], what: str) -> tuple[str, _T]:
    """Create the temp file or directory of a publish of ``path``, beside it: ``create(tmp)``
    at a fresh :func:`publish_temp_name` (it must fail with ``FileExistsError`` on a name
    that exists). A name that exists (a file of another program, a symlink planted there)
    is never opened nor followed: another name is drawn. Returns ``(tmp, create's
    value)``; :class:`StorageError` naming ``path`` otherwise."""
    d = os.path.dirname(os.path.abspath(path))
    err: OSError = FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))
    for _ in range(_TEMP_TRIES):
        tmp = os.path.join(d, publish_temp_name(os.path.basename(path)))
        try:
            return tmp, create(tmp)
        except FileExistsError as e:
            err = e
        except OSError as e:
            raise _storage_error(e, what, path) from e
    raise _storage_error(err, what, path)


#: The fixed part of the names of :func:`atomic_publish`'s temp files.
PUBLISH_TEMP_MARK = "lowdiff-tmp"

_PUBLISH_TEMP = re.compile(r"^\..+\." + PUBLISH_TEMP_MARK +
                           r"-(?P<host>[0-9a-f]{8})-(?P<pid>[1-9][0-9]*)-[0-9a-f]{8}\.tmp$")


def _host_tag() -> str:
    return hashlib.blake2s(socket.gethostname().encode(), digest_size=4).hexdigest()


def publish_temp_name(name: str) -> str:
    """The name of :func:`atomic_publish`'s temp file for the file ``name``:
    ``.NAME.lowdiff-tmp-HOST-PID-RANDOM.tmp`` (HOST: 8 hex digits of a hash of the host
    name; PID: the writer's process id). The marker, the host and the pid are what let
    :func:`remove_stale_publish_temps` tell a temp file of a dead writer from one in use or
    from a file of another program."""
    return f".{name}.{PUBLISH_TEMP_MARK}-{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: a process of another user has that pid
    return True


def remove_stale_publish_temps(directory: str | os.PathLike[str]) -> list[str]:
    """Remove from ``directory`` the temp files (and directories) :func:`atomic_publish` and
    :func:`atomic_publish_dir` left behind when their process died before it could clean
    up (SIGKILL, OOM killer, power cut); returns their names. Only names of the
    :func:`publish_temp_name` form, written on this host by a process that no longer
    exists, are removed: a temp file in use, one from another host (a shared filesystem),
    and every other file are left alone. A pid reused by a live process keeps its temp
    file until that process is gone. Best effort: a directory that cannot be listed, or a
    file that cannot be removed, is skipped."""
    host = _host_tag()
    removed: list[str] = []
    try:
        with os.scandir(directory) as it:
            names = [e.name for e in it if e.name.endswith(".tmp")]
    except OSError:
        return removed
    for name in names:
        m = _PUBLISH_TEMP.match(name)
        if m is None or m["host"] != host or _alive(int(m["pid"])):
            continue
        full = os.path.join(directory, name)
        try:
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)  # an atomic_publish_dir temp directory
            else:
                os.unlink(full)
        except OSError:
            continue
        removed.append(name)
    return removed


def make_scratch_dir(prefix: str, parent: str | None = None) -> str:
    """A new private directory ``PARENT/PREFIX-HOST-PID-RANDOM`` (mode 0700; PARENT: the
    system's temp directory by default; HOST and PID as in :func:`publish_temp_name`) for
    scratch files of this process; returns its path. The caller removes it when done. A
    process killed before it could (SIGKILL, OOM killer) leaves it behind: every call first
    removes the directories of the same ``prefix`` in ``parent`` whose process, on this
    host, no longer exists (:func:`remove_stale_scratch_dirs`), so they never pile up."""
    parent = tempfile.gettempdir() if parent is None else os.fspath(parent)
    remove_stale_scratch_dirs(parent, prefix)
    while True:
        path = os.path.join(parent, f"{prefix}-{_host_tag()}-{os.getpid()}-"
                                    f"{secrets.token_hex(4)}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        except OSError as e:
            raise _storage_error(e, "create scratch directory", path) from e
        return path


def remove_stale_scratch_dirs(parent: str | os.PathLike[str], prefix: str) -> list[str]:
    """Remove from ``parent`` the :func:`make_scratch_dir` directories of ``prefix`` left by
    processes of this host that no longer exist; returns their names. A directory of a live
    process (a pid reused by a live process included), of another host (a shared temp
    directory) or of another name form is left alone. Best effort: what cannot be listed or
    removed is skipped."""
    form = re.compile(re.escape(prefix) +
                      r"-(?P<host>[0-9a-f]{8})-(?P<pid>[1-9][0-9]*)-[0-9a-f]{8}$")
    host = _host_tag()
    removed: list[str] = []
    try:
        with os.scandir(parent) as it:
            names = [e.name for e in it if e.name.startswith(prefix + "-")
                     and e.is_dir(follow_symlinks=False)]
    except OSError:
        return removed
    for name in names:
        m = form.match(name)
        if m is None or m["host"] != host or _alive(int(m["pid"])):
            continue
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        if not os.path.lexists(os.path.join(parent, name)):
            removed.append(name)
    return removed


def atomic_publish_dir(path: str | os.PathLike[str], fill: Callable[[str], object]) -> int:
    """Publish the directory ``path`` atomically, for checkpoints that are directories (DCP,
    sharded safetensors): ``fill(tmp)`` writes the files into a new temp directory beside
    ``path`` (:func:`publish_temp_name`); then every file in it is fsynced, the temp directory
    too, it is renamed to ``path`` and the parent directory is fsynced. ``path`` must not
    exist (an empty directory is replaced): a checkpoint directory is published whole or
    not at all, never merged into another one.

    After a failure (ENOSPC, an exception in ``fill``, Ctrl-C) the temp directory is
    removed and ``path`` is untouched; after a kill, what is left is a hidden ``*.tmp``
    directory, never a directory named ``path``, and the next publish into the same
    directory removes it (:func:`remove_stale_publish_temps`). An ``OSError``, even one a
    library in ``fill`` wrapped in its own exception (:func:`os_error_in`), is raised as
    :class:`StorageError` with its errno. Returns the bytes of the files published."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(path) and not (os.path.isdir(path) and not os.listdir(path)):
        raise StorageError("refusing to publish over an existing file or non-empty "
                           "directory", reason=Reason.ALREADY_EXISTS, path=path)
    remove_stale_publish_temps(d)
    tmp, _ = _new_temp(path, lambda t: os.mkdir(t, 0o755), "create temp directory")
    what, size = "write", 0
    try:
        fill(tmp)
        what = "fsync"
        for name in sorted(os.listdir(tmp)):
            fd, n = _open_regular(os.path.join(tmp, name), os.O_RDONLY, "open")
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            size += n
        fsync_dir(tmp)
        what = "rename"
        if os.path.isdir(path):
            os.rmdir(path)  # empty (checked above); a racing writer makes this fail
        os.rename(tmp, path)
    except BaseException as e:
        _rmtree_quiet(tmp)
        cause = None if isinstance(e, LowdiffError) else os_error_in(e)
        if cause is not None and isinstance(e, Exception):
            raise _storage_error(cause, what, path) from e
        raise
    fsync_dir(d)
    return size


def os_error_in(e: BaseException) -> OSError | None:
    """The ``OSError`` behind ``e``: ``e`` itself or the first one down its chain of
    ``__cause__`` / ``__context__``, or None. Libraries that write files for us wrap the
    OSError of a full disk in their own exception and keep it only there: torch.save's
    ``RuntimeError("[enforce fail at inline_container.cc...]")`` has it as its
    ``__context__``; h5py and DCP (:func:`~lowdiff_store.torch.core.dcp_source.
    dcp_failure`) likewise. Its errno is the reason; the wrapper's text is not read."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def regular_file_size(path: str) -> int:
    """The size of the regular file ``path``, for files outside any store (an external
    checkpoint a log refers to): ``missing_file``, ``not_a_regular_file`` or ``io_error``
    naming it otherwise. A FIFO or device is refused, never opened."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise LowdiffError("file is missing", reason=Reason.MISSING_FILE, path=path) from None
    except OSError as e:
        raise _storage_error(e, "stat", path) from None
    if not stat.S_ISREG(st.st_mode):
        raise StorageError("not a regular file (a FIFO, device or directory): refused",
                           reason=Reason.NOT_A_REGULAR_FILE, path=path)
    return st.st_size


def is_directory(path: str) -> bool:
    """Whether ``path`` is a directory (following links)."""
    return os.path.isdir(path)


def read_capped(path: str, cap: int) -> bytes:
    """The whole regular file ``path`` if it holds at most ``cap`` bytes, checked before
    reading (``metadata_too_large`` otherwise)."""
    src = open_source(path, "pread")
    try:
        if src.size > cap:
            raise FormatError(f"file of {src.size} bytes exceeds the cap of {cap}",
                              reason=Reason.METADATA_TOO_LARGE, path=path)
        return bytes(src.read(0, src.size))
    finally:
        src.close()


def _rmtree_quiet(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


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
        fd, self.size = _open_regular(path, flags, "open for append")
        self._fd: int | None = fd
        self.synced_size = self.size

    @property
    def durable_size(self) -> int:
        """Synced bytes are durable (fdatasync)."""
        return self.synced_size

    @property
    def flush_due(self) -> float | None:
        """Always None: nothing synced waits to become durable."""
        return None

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

    @staticmethod
    def can_start_writeback() -> bool:
        """:meth:`start_writeback` can start writeback here (Linux ``sync_file_range``)."""
        return _sync_file_range is not None

    def start_writeback(self, offset: int, n: int) -> bool:
        """Ask the kernel to start writing the whole pages of ``[offset, offset + n)`` to
        the disk now, and return without waiting (``sync_file_range`` with
        ``SYNC_FILE_RANGE_WRITE``; ctypes releases the GIL). A page the range holds only
        part of is left alone: the one holding ``offset`` (the log writer rewrites a
        record's first bytes in it) and the one holding the range's end (the next append
        writes into it; handed to the disk now, it would go twice, and a write into a page
        under writeback may wait for it). A hint with no durability meaning: bytes are
        durable only once :meth:`sync` returns, and a writeback error is reported by that
        ``fdatasync``. Returns False where the hint is not available, was refused, or the
        range holds no whole page."""
        head = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        tail = (offset + n) // mmap.PAGESIZE * mmap.PAGESIZE
        if self._fd is None or _sync_file_range is None or tail <= head:
            return False
        return _sync_file_range(self._fd, head, tail - head, _SYNC_FILE_RANGE_WRITE) == 0

    def sync(self) -> None:
        """fdatasync: every byte appended so far is durable when this returns."""
        if self._fd is None:
            raise StorageError("sync after close", path=self.path)
        try:
            self._sync(self._fd)
        except OSError as e:
            raise _storage_error(e, "fsync", self.path) from e
        self.synced_size = self.size

    def flush(self) -> None:
        """The same as :meth:`sync` (a synced byte is durable)."""
        self.sync()

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

    def seal(self) -> None:
        """Sync and close: the file is final (a sealed segment, a complete index)."""
        try:
            self.sync()
        finally:
            self.close()

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


class _FileLock(StoreLock):
    """The one lock helper: ``flock`` on a lock file (advisory, exclusive, released by the
    kernel when the process dies, so a crash never leaves a stale lock). Two opens in one
    process exclude each other too (flock locks belong to the open file description)."""

    def __init__(self, path: str, name: str, fd: int) -> None:
        self.path = path
        self.name = name
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, path: str, name: str, *, wait: bool) -> _FileLock | None:
        """The lock, or None when it is held elsewhere and ``wait`` is false. A lock file
        its holder removed (:meth:`release_and_remove`) while this process waited on it is
        no lock: the lock is taken again on the file now at ``path``."""
        while True:
            fd, _size = _open_regular(path, os.O_RDWR | os.O_CREAT, "open lock")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return None
                raise _storage_error(e, "lock", path) from e
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    return cls(path, name, fd)
            except FileNotFoundError:
                pass
            os.close(fd)

    @classmethod
    def adopt(cls, path: str, name: str, fd: int) -> _FileLock | None:
        """The lock held through ``fd``, a descriptor of the lock file at ``path`` that this
        process was handed already locked (a writer process's ``LOCK``, taken by the
        training process that started it: ``flock`` belongs to the open file description,
        so locking it again through ``fd`` succeeds at once and changes nothing). None when
        ``fd`` is not that file or its description does not hold the lock while another
        does; ``fd`` is then closed."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return cls(path, name, fd)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, errno.ENOENT):
                os.close(fd)
                raise _storage_error(e, "lock", path) from e
        os.close(fd)
        return None

    def release_and_remove(self) -> None:
        """Remove the lock file while still holding it, then release: a waiter that gets
        the old file sees it gone and retries (see :meth:`acquire`)."""
        if self._fd is not None:
            try:
                os.unlink(self.path)
                fsync_dir(os.path.dirname(self.path))  # every deletion is durable
            except LowdiffError:
                pass  # the directory fsync failed: the removal may not survive, harmless
            except OSError:
                pass  # a read-only or full file system: the file stays, harmless
            self.release()

    def release(self) -> None:
        """Release the lock. Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def detach(self) -> int:
        """The locked descriptor, now the caller's (this object no longer releases it)."""
        fd, self._fd = self._fd, None
        if fd is None:
            raise ValueError("the lock was released")
        return fd


def _token(chunks: Iterable[Buffer]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for c in chunks:
        h.update(c)
    return h.hexdigest()


class LocalStore(Store):
    """A store in a local (or POSIX network) directory: object ``a/b`` is file ``ROOT/a/b``.

    - :meth:`create`: temp file, fsync, hard link to the name (fails if it exists), fsync of
      the directory; :meth:`publish`: the same with a rename over the name.
    - :meth:`open_append`: an :class:`AppendFile` (``append_file``: a subclass, to inject
      faults in tests) with ``writev`` + ``fdatasync``.
    - :meth:`delete`: unlink, then fsync of the directory (a power cut cannot bring the
      file back).
    - :meth:`try_lock`: ``flock`` on the file ``name``.
    - :meth:`commit`: the object keeps one file (``MANIFEST``, as the format specifies),
      replaced by :meth:`publish` under ``flock(NAME.lock)``; the token is a hash of the
      content (a manifest's generation grows at every commit, so equal hashes mean the
      same version).

    Temp files end in ``.tmp`` (unique names: concurrent publishers never share one); a
    crash can leave them, and the log's garbage collection removes them.
    """

    def __init__(self, root: str | os.PathLike[str], *,
                 append_file: type[AppendFile] | None = None,
                 held_locks: dict[str, int] | None = None) -> None:
        self.root = os.fspath(root)
        self.url = self.root
        self._append_file: type[AppendFile] = append_file or AppendFile
        self._dirs: set[str] = set()  # directories known to exist (durably)
        #: lock name -> a descriptor of its file, locked by the process that handed it over;
        #: the first :meth:`try_lock` of the name adopts it (:meth:`_FileLock.adopt`)
        self._held = dict(held_locks or {})

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    # ---------------------------------------------------------------- names

    def path_of(self, name: str) -> str:
        """``ROOT/name``."""
        return os.path.join(self.root, check_name(name))

    def child(self, prefix: str) -> LocalStore:
        """The store rooted at ``ROOT/prefix``."""
        return LocalStore(self.path_of(prefix), append_file=self._append_file)

    # ---------------------------------------------------------------- reading

    def exists(self, name: str) -> bool:
        """True when ``ROOT/name`` exists (any kind of file: a special file is refused
        when opened, not hidden)."""
        return os.path.lexists(self.path_of(name)) and not os.path.isdir(self.path_of(name))

    def size(self, name: str) -> int:
        """``st_size`` of the file."""
        path = self.path_of(name)
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            raise StorageError("object does not exist", reason=Reason.MISSING_FILE,
                               path=path) from None
        except OSError as e:
            raise _storage_error(e, "stat", path) from e

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Files under the root whose name starts with ``prefix`` (directories are
        walked, not listed)."""
        out: builtins.list[str] = []
        head = prefix.rpartition("/")[0]
        start = self.path_of(head) if head else self.root

        def walk(d: str, rel: str) -> None:
            try:
                it = os.scandir(d)
            except (FileNotFoundError, NotADirectoryError):
                return
            except OSError as e:
                raise _storage_error(e, "list", d) from e
            with it:
                for ent in it:
                    name = f"{rel}{ent.name}"
                    if ent.is_dir(follow_symlinks=False):
                        if name.startswith(prefix[:len(name)]):
                            walk(ent.path, name + "/")
                    elif name.startswith(prefix):
                        out.append(name)

        walk(start, f"{head}/" if head else "")
        return sorted(out)

    def open(self, name: str, mode: ReadMode = "mmap", *, length: int | None = None
             ) -> Source:
        """An :class:`MmapSource` (``"mmap"``, ``"private"``) or :class:`PreadSource`
        (regular files only)."""
        path = self.path_of(name)
        try:
            return open_source(path, mode, length=length)
        except StorageError as e:
            raise _missing(e) from None

    def read(self, name: str, *, max_bytes: int) -> bytes:
        """The whole file, if at most ``max_bytes`` (checked before reading)."""
        path = self.path_of(name)
        try:
            fd, size = _open_regular(path, os.O_RDONLY, "open")
        except StorageError as e:
            raise _missing(e) from None
        try:
            if size > max_bytes:
                raise FormatError(f"{size} bytes exceed the cap of {max_bytes} for this file",
                                  reason=Reason.METADATA_TOO_LARGE, path=path)
            parts = []
            got = 0
            while got < size:  # a file growing meanwhile is read up to its size at open
                b = os.pread(fd, size - got, got)
                if not b:
                    break
                parts.append(b)
                got += len(b)
            return b"".join(parts)
        except OSError as e:
            raise _storage_error(e, "read", path) from e
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- writing

    def ensure_root(self) -> None:
        """``mkdir -p`` of the root, each new directory made durable in its parent."""
        self._ensure_dir(os.path.abspath(self.root))

    def _ensure_dir(self, d: str) -> None:
        if d in self._dirs:
            return
        missing = []
        p = d
        while not os.path.isdir(p):
            if os.path.lexists(p):
                raise StorageError("exists and is not a directory", path=p)
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        for m in reversed(missing):
            try:
                os.mkdir(m, 0o755)
            except FileExistsError:
                pass
            except OSError as e:
                raise _storage_error(e, "create directory", m) from e
            fsync_dir(m)
            fsync_dir(os.path.dirname(m))  # the new entry in its parent
        self._dirs.add(d)

    def _parent(self, name: str) -> str:
        path = os.path.abspath(self.path_of(name))
        self._ensure_dir(os.path.dirname(path))
        return path

    def _tmp(self, path: str) -> str:
        return f"{path}.{uuid.uuid4().hex[:16]}.tmp"

    def create(self, name: str, chunks: Sequence[Buffer]) -> None:
        """Temp file, fsync, hard link (fails if the name exists), directory fsync."""
        path = self._parent(name)
        _replace(path, self._tmp(path), chunks, exclusive=True)

    def publish(self, name: str, chunks: Sequence[Buffer]) -> None:
        """Temp file, fsync, rename over the name, directory fsync."""
        path = self._parent(name)
        _replace(path, self._tmp(path), chunks)

    def open_publish(self, name: str) -> PublishHandle:
        """A :class:`PublishFile`: a temp file beside ``name`` (:func:`publish_temp_name`,
        removed by the next publish there if this process dies first)."""
        return PublishFile(self._parent(name))

    def open_append(self, name: str, *, create: bool = False) -> AppendFile:
        """An :class:`AppendFile` (of the class given as ``append_file``); a new file is
        made durable in its directory before this returns."""
        path = self._parent(name) if create else self.path_of(name)
        try:
            f = self._append_file(path, create=create)
        except StorageError as e:
            raise _missing(e) from None
        if create:
            try:
                fsync_dir(os.path.dirname(path))
            except BaseException:
                f.close()
                raise
        return f

    def delete(self, name: str) -> None:
        """Unlink and fsync the directory; a missing file is not an error."""
        self.delete_many([name])

    def delete_many(self, names: Sequence[str]) -> None:
        """Unlink every file, then fsync each directory they were in once."""
        dirs: set[str] = set()
        for name in names:
            path = self.path_of(name)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise _storage_error(e, "delete", path) from e
            dirs.add(os.path.dirname(path))
        for d in sorted(dirs):
            if os.path.isdir(d):
                fsync_dir(d)

    def lock_to_hand_over(self, name: str) -> int | None:
        """A descriptor of the file ``name`` (created if needed, the root too), locked with
        ``flock(LOCK_EX | LOCK_NB)``, for another process to adopt (``held_locks``): the
        lock lasts while any process holds a descriptor of it. None when it is held
        elsewhere. The caller closes its own copy."""
        lock = _FileLock.acquire(self._parent(name), name, wait=False)
        return None if lock is None else lock.detach()

    def try_lock(self, name: str) -> StoreLock | None:
        """``flock(LOCK_EX | LOCK_NB)`` on the file ``name`` (created if needed); a lock
        handed over at construction (``held_locks``) is adopted instead, once."""
        path = self._parent(name)
        if name in self._held:
            return _FileLock.adopt(path, name, self._held.pop(name))
        return _FileLock.acquire(path, name, wait=False)

    # ---------------------------------------------------------------- versioned commit

    def read_versioned(self, name: str, *, max_bytes: int) -> Versioned | None:
        """The file's bytes and a hash of them; None if there is no file."""
        try:
            data = self.read(name, max_bytes=max_bytes)
        except StorageError as e:
            if e.reason is Reason.MISSING_FILE:
                return None
            raise
        return Versioned(data, _token([data]))

    def commit(self, name: str, chunks: Sequence[Buffer], *, expect: str | None) -> str:
        """Under ``flock(NAME.lock)``: compare the current content's hash with ``expect``,
        then :meth:`publish`."""
        path = self._parent(name)
        lock = _FileLock.acquire(path + ".lock", name + ".lock", wait=True)
        assert lock is not None
        with lock:
            cur = self.read_versioned(name, max_bytes=MAX_MANIFEST_BYTES)
            if (cur.token if cur is not None else None) != expect:
                raise CommitConflict("changed since it was read (another process "
                                     "committed first)", path=path)
            chunks = list(chunks)
            self.publish(name, chunks)
            return _token(chunks)


def _missing(e: StorageError) -> StorageError:
    if getattr(e, "errno", None) == errno.ENOENT:
        err = StorageError("object does not exist", reason=Reason.MISSING_FILE, path=e.path)
        err.errno = errno.ENOENT
        return err
    return e


__all__ = [
    "AppendFile",
    "BytesSource",
    "LocalStore",
    "MmapSource",
    "PUBLISH_TEMP_MARK",
    "PreadSource",
    "atomic_publish",
    "atomic_write",
    "fsync_dir",
    "make_scratch_dir",
    "open_source",
    "os_error_in",
    "publish_temp_name",
    "read_into",
    "remove_stale_publish_temps",
    "remove_stale_scratch_dirs",
]

