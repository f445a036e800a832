"""``storage.atomic_publish``: content a library writes to a file object, published like
every file of the log (temp file beside the target, fsync, rename, fsync of the
directory); on failure the target is untouched and nothing is left behind."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from lowdiff_store import StorageError
from lowdiff_store.storage import atomic_publish


def test_publishes_what_fill_wrote_including_rewrites(tmp_path: Path) -> None:
    def fill(f: BinaryIO) -> None:
        f.write(b"x" * 10)
        f.seek(2)
        f.write(b"yy")  # libraries seek back and patch headers
        f.seek(0)
        assert f.read(4) == b"xxyy"
        f.seek(0, os.SEEK_END)
        f.write(b"end")

    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    assert atomic_publish(target, fill) == 13
    assert target.read_bytes() == b"xxyyxxxxxxend"
    assert os.listdir(tmp_path) == ["out.bin"]


@contextlib.contextmanager
def _file_size_limit(n: int) -> Iterator[None]:
    """A real write failure from the kernel: past RLIMIT_FSIZE a write fails with EFBIG
    (SIGXFSZ ignored, as a process that handles it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def test_an_os_error_wrapped_by_the_library_keeps_its_errno(tmp_path: Path) -> None:
    class LibraryError(RuntimeError):
        pass

    def fill(f: BinaryIO) -> None:
        try:
            for _ in range(16):
                f.write(b"z" * 4096)
            f.flush()
        except OSError as e:
            raise LibraryError("enforce fail") from e  # what torch.save does

    target = tmp_path / "out.pt"
    target.write_bytes(b"old")
    with _file_size_limit(16 * 1024), pytest.raises(StorageError) as ei:
        atomic_publish(target, fill)
    assert ei.value.errno == errno.EFBIG
    assert ei.value.path == str(target)
    assert "File too large" in str(ei.value)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.pt"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, ValueError])
def test_other_exceptions_propagate_and_leave_nothing(tmp_path: Path,
                                                      exc: type[BaseException]) -> None:
    def fill(f: BinaryIO) -> None:
        f.write(b"some")
        raise exc("stop")

    with pytest.raises(exc):
        atomic_publish(tmp_path / "x", fill)
    assert os.listdir(tmp_path) == []


def test_a_directory_or_a_missing_parent_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StorageError) as ei:
        atomic_publish(tmp_path, lambda f: f.write(b"x"))
    assert ei.value.errno == errno.EISDIR
    with pytest.raises(StorageError) as ei:
        atomic_publish(tmp_path / "no" / "x", lambda f: f.write(b"x"))
    assert ei.value.errno == errno.ENOENT
    assert ei.value.path == str(tmp_path / "no" / "x")
    assert os.listdir(tmp_path) == []
