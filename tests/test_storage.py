"""Layer 3 (storage): sources (mmap, pread, bytes), atomic publish, append files, the lock."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from lowdiff_store.errors import FormatError, LowdiffError, Reason, StorageError
from lowdiff_store.storage import (
    AppendFile,
    BytesSource,
    LocalStore,
    MmapSource,
    PreadSource,
    atomic_write,
    fsync_dir,
    local,
    open_source,
)

DATA = bytes(range(256)) * 40  # 10240 bytes


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    p = tmp_path / "data.bin"
    p.write_bytes(DATA)
    return p


# ------------------------------------------------------------------------------- sources


@pytest.mark.parametrize("kind", ["bytes", "mmap", "pread"])
def test_sources_read_exact_ranges(kind: str, data_file: Path) -> None:
    src = BytesSource(DATA, str(data_file)) if kind == "bytes" else \
        open_source(str(data_file), kind)  # type: ignore[arg-type]
    try:
        assert src.size == len(DATA)
        assert src.path == str(data_file)
        for off, n in [(0, 0), (0, 1), (5, 100), (4096, 4096), (len(DATA) - 1, 1),
                       (len(DATA), 0), (0, len(DATA))]:
            assert bytes(src.read(off, n)) == DATA[off:off + n], (off, n)
    finally:
        src.close()


@pytest.mark.parametrize("kind", ["bytes", "mmap", "pread"])
@pytest.mark.parametrize(("off", "n"), [(-1, 1), (0, -1), (len(DATA), 1), (len(DATA) - 3, 4),
                                        (0, len(DATA) + 1), (2**62, 1), (1, 2**63)])
def test_sources_refuse_reads_past_the_end(kind: str, off: int, n: int, data_file: Path
                                           ) -> None:
    src = BytesSource(DATA, "mem") if kind == "bytes" else \
        open_source(str(data_file), kind)  # type: ignore[arg-type]
    try:
        with pytest.raises(FormatError) as ei:
            src.read(off, n)
        assert ei.value.reason is Reason.TRUNCATED
        assert ei.value.path == src.path
        assert ei.value.offset == off
    finally:
        src.close()


def test_bytes_source_accepts_any_buffer() -> None:
    arr = np.arange(4, dtype="<u4")
    src = BytesSource(arr.data)
    assert src.size == 16
    assert src.path == "<memory>"
    assert bytes(src.read(4, 4)) == (1).to_bytes(4, "little")


def test_mmap_reads_are_zero_copy_views(data_file: Path) -> None:
    src = MmapSource(str(data_file))
    mv = src.read(4096, 64)
    assert mv.readonly
    assert isinstance(mv.obj, mmap.mmap)
    arr = np.frombuffer(mv, np.uint8)
    assert arr.tobytes() == DATA[4096:4160]
    assert not arr.flags.writeable
    assert arr.ctypes.data % 64 == 0  # the map is page aligned, so offsets keep alignment
    # the view is the file's page cache: a write through another descriptor shows in it
    fd = os.open(data_file, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xaa\xbb", 4096)
    finally:
        os.close(fd)
    assert arr[:2].tolist() == [0xAA, 0xBB]
    src.close()
    assert arr[2] == DATA[4098]  # views outlive close(): they hold the mapping


def test_pread_returns_private_copies(data_file: Path) -> None:
    src = PreadSource(str(data_file))
    mv = src.read(100, 10)
    fd = os.open(data_file, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x00" * 10, 100)
    finally:
        os.close(fd)
    assert bytes(mv) == DATA[100:110]
    assert bytes(src.read(100, 10)) == b"\x00" * 10
    src.close()
    src.close()  # idempotent
    with pytest.raises(StorageError):
        src.read(0, 1)


def test_pread_of_a_file_that_shrank(data_file: Path) -> None:
    src = PreadSource(str(data_file))
    os.truncate(data_file, 1000)
    with pytest.raises(FormatError) as ei:
        src.read(900, 200)
    assert ei.value.reason is Reason.TRUNCATED
    assert ei.value.offset == 1000
    src.close()


def test_empty_file_sources(tmp_path: Path) -> None:
    p = tmp_path / "empty"
    p.write_bytes(b"")
    for mode in ("mmap", "pread"):
        src = open_source(str(p), mode)  # type: ignore[arg-type]
        assert src.size == 0
        assert bytes(src.read(0, 0)) == b""
        with pytest.raises(FormatError):
            src.read(0, 1)
        src.close()


@pytest.mark.parametrize("mode", ["mmap", "pread"])
def test_missing_file_is_a_storage_error(mode: str, tmp_path: Path) -> None:
    with pytest.raises(StorageError) as ei:
        open_source(str(tmp_path / "nope"), mode)  # type: ignore[arg-type]
    assert ei.value.reason is Reason.IO_ERROR
    assert ei.value.errno == errno.ENOENT
    assert ei.value.path == str(tmp_path / "nope")
    assert isinstance(ei.value, OSError)


def test_unknown_read_mode(data_file: Path) -> None:
    with pytest.raises(LowdiffError) as ei:
        open_source(str(data_file), "mmap2")  # type: ignore[arg-type]
    assert ei.value.reason is Reason.INVALID_ARGUMENT


# ---------------------------------------------------------------------------- atomic write


def test_atomic_write_creates_and_replaces(tmp_path: Path) -> None:
    p = tmp_path / "F"
    atomic_write(str(p), [b"old", memoryview(b"-data")])
    assert p.read_bytes() == b"old-data"
    atomic_write(str(p), [np.arange(3, dtype="<u2").data, b""])
    assert p.read_bytes() == b"\x00\x00\x01\x00\x02\x00"
    assert sorted(os.listdir(tmp_path)) == ["F"]


def test_atomic_write_overwrites_a_stale_temp_file(tmp_path: Path) -> None:
    p = tmp_path / "F"
    (tmp_path / "F.tmp").write_bytes(b"x" * 1000)  # a crash left a longer temp file
    atomic_write(str(p), [b"new"])
    assert p.read_bytes() == b"new"
    assert not (tmp_path / "F.tmp").exists()


def test_atomic_write_keeps_the_old_file_when_the_write_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "F"
    p.write_bytes(b"old contents")

    def half_then_enospc(fd: int, chunks: Sequence[bytes]) -> int:
        os.write(fd, bytes(chunks[0])[:3])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local, "_write_all", half_then_enospc)
    with pytest.raises(StorageError) as ei:
        atomic_write(str(p), [b"new contents"])
    assert ei.value.errno == errno.ENOSPC
    assert ei.value.path == str(p) + ".tmp"
    assert p.read_bytes() == b"old contents"
    assert sorted(os.listdir(tmp_path)) == ["F"]


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_atomic_write_keeps_the_old_file_when_publishing_fails(
        step: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "F"
    p.write_bytes(b"old contents")

    def fail(*_a: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(local.os, step, fail)
    with pytest.raises(StorageError) as ei:
        atomic_write(str(p), [b"new contents"])
    monkeypatch.undo()
    assert ei.value.errno == errno.EIO
    assert p.read_bytes() == b"old contents"
    assert sorted(os.listdir(tmp_path)) == ["F"]


def test_fsync_dir(tmp_path: Path) -> None:
    fsync_dir(str(tmp_path))
    with pytest.raises(StorageError) as ei:
        fsync_dir(str(tmp_path / "missing"))
    assert ei.value.errno == errno.ENOENT


# ----------------------------------------------------------------------------- append file


def test_append_file_appends_syncs_truncates(tmp_path: Path) -> None:
    p = tmp_path / "A"
    f = AppendFile(str(p), create=True)
    assert (f.size, f.synced_size) == (0, 0)
    assert f.append([b"abc", memoryview(b"de")]) == 0
    assert f.append([np.array([1], "<u4").data]) == 5
    assert f.size == 9
    assert f.synced_size == 0
    f.sync()
    assert f.synced_size == 9
    f.truncate(4)
    assert (f.size, f.synced_size) == (4, 4)
    assert f.append([b"Z"]) == 4
    f.close()
    f.close()  # idempotent
    assert p.read_bytes() == b"abcdZ"
    for call in (lambda: f.append([b"x"]), f.sync, lambda: f.truncate(0)):
        with pytest.raises(StorageError):
            call()
    g = AppendFile(str(p))  # reopen: appends go to the end
    assert g.size == g.synced_size == 5
    assert g.append([b"!"]) == 5
    g.close()
    assert p.read_bytes() == b"abcdZ!"


def test_append_file_create_refuses_an_existing_file(tmp_path: Path) -> None:
    p = tmp_path / "A"
    p.write_bytes(b"keep")
    with pytest.raises(StorageError) as ei:
        AppendFile(str(p), create=True)
    assert ei.value.errno == errno.EEXIST
    assert p.read_bytes() == b"keep"


def test_append_file_resumes_after_short_os_writes(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.pwritev`` may write fewer bytes than asked; every byte must still land, in
    order, also with more chunks than one call takes (IOV_MAX)."""
    real = os.pwritev
    calls = []

    def short_pwritev(fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        calls.append(len(bufs))
        first = memoryview(bufs[0])
        return real(fd, [first[:7]] if first.nbytes > 7 else list(bufs[:2]), offset)

    monkeypatch.setattr(os, "pwritev", short_pwritev)
    chunks = [bytes([i % 251]) * (i % 13) for i in range(3000)]
    f = AppendFile(str(tmp_path / "A"), create=True)
    assert f.append(chunks) == 0
    f.close()
    monkeypatch.undo()
    assert (tmp_path / "A").read_bytes() == b"".join(chunks)
    assert f.size == sum(map(len, chunks))
    assert max(calls) <= 1024
    assert len(calls) > 100


def test_append_file_writev_without_progress_is_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, offset: 0)
    f = AppendFile(str(tmp_path / "A"), create=True)
    with pytest.raises(StorageError) as ei:  # not an endless retry loop
        f.append([b"abc"])
    assert ei.value.errno == errno.EIO
    assert f.size == 0
    f.close()


class _FullDisk(AppendFile):
    """Writes the first half of what it is given, then fails like a full disk."""

    def _writev(self, fd: int, chunks: Sequence[bytes | bytearray | memoryview]) -> int:
        data = b"".join(bytes(c) for c in chunks)
        os.lseek(fd, self.size, os.SEEK_SET)
        os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


class _GivesUp(AppendFile):
    """A ``_writev`` that returns a short count instead of raising."""

    def _writev(self, fd: int, chunks: Sequence[bytes | bytearray | memoryview]) -> int:
        data = b"".join(bytes(c) for c in chunks)
        os.lseek(fd, self.size, os.SEEK_SET)
        return os.write(fd, data[:3])


@pytest.mark.parametrize("cls", [_FullDisk, _GivesUp])
def test_append_file_partial_write_is_reported_with_the_real_size(cls: type[AppendFile],
                                                                  tmp_path: Path) -> None:
    p = tmp_path / "A"
    p.write_bytes(b"0123")
    f = cls(str(p))
    with pytest.raises(StorageError) as ei:
        f.append([b"abcdefgh", b"ijkl"])
    assert ei.value.reason is Reason.IO_ERROR
    assert ei.value.offset == 4
    assert ei.value.errno == (errno.ENOSPC if cls is _FullDisk else errno.EIO)
    assert ei.value.path == str(p)
    assert isinstance(ei.value.__cause__, OSError)
    # the size is what really reached the file, so a reopen can cut it as a torn tail
    assert f.size == os.path.getsize(p) == 4 + (6 if cls is _FullDisk else 3)
    f.close()


def test_append_file_sync_failure(tmp_path: Path) -> None:
    class FailingSync(AppendFile):
        def _sync(self, fd: int) -> None:
            raise OSError(errno.EIO, "Input/output error")

    f = FailingSync(str(tmp_path / "A"), create=True)
    f.append([b"abc"])
    with pytest.raises(StorageError) as ei:
        f.sync()
    assert ei.value.errno == errno.EIO
    assert f.synced_size == 0
    f.close()


# ------------------------------------------------------------------------------------ lock


def test_the_writer_lock_refuses_a_second_writer(tmp_path: Path) -> None:
    """The one lock helper (``LocalStore.try_lock``) as the log uses it: ``LOCK``."""
    from lowdiff_store import LogWriter

    first = LogWriter(tmp_path / "log")
    with pytest.raises(LowdiffError) as ei:
        LogWriter(tmp_path / "log")
    assert ei.value.reason is Reason.LOCKED
    assert ei.value.path == str(tmp_path / "log" / "LOCK")
    assert "LOCK" in str(ei.value)
    first.close()
    LogWriter(tmp_path / "log").close()  # free again


def test_a_lock_handed_over_is_adopted_and_refuses_everyone_else(tmp_path: Path) -> None:
    """``lock_to_hand_over`` / ``held_locks`` (a trainer takes its log's ``LOCK`` and hands
    the descriptor to its writer process): the lock holds from the first call on, the
    store given the descriptor adopts it once (its next ``try_lock`` is refused like any
    other), and it is free once every copy of the descriptor is closed."""
    from lowdiff_store import LogWriter

    log = tmp_path / "log"
    fd = LocalStore(str(log)).lock_to_hand_over("LOCK")
    assert fd is not None
    assert LocalStore(str(log)).lock_to_hand_over("LOCK") is None  # taken from the start
    with pytest.raises(LowdiffError) as ei:
        LogWriter(log)
    assert ei.value.reason is Reason.LOCKED
    copy = os.dup(fd)  # (what the process started with it holds)
    os.close(fd)
    store = LocalStore(str(log), held_locks={"LOCK": copy})
    w = LogWriter(store)  # adopts the descriptor
    assert store.try_lock("LOCK") is None  # adopted once; a second take is another's
    assert LocalStore(str(log)).try_lock("LOCK") is None
    w.close()
    LogWriter(log).close()  # free again


def test_a_descriptor_that_holds_no_lock_is_not_adopted(tmp_path: Path) -> None:
    log = tmp_path / "log"
    held = LocalStore(str(log)).try_lock("LOCK")
    assert held is not None
    other = os.open(log / "LOCK", os.O_RDWR)  # the same file, not the holder's description
    assert LocalStore(str(log), held_locks={"LOCK": other}).try_lock("LOCK") is None
    with pytest.raises(OSError):
        os.fstat(other)  # closed by the refusal
    held.release()
