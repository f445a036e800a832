"""``storage.atomic_publish``: content a library writes to a file object, published like
every file of the log (temp file beside the target, fsync, rename, fsync of the
directory); on failure the target is untouched and nothing is left behind; temp files of
writers killed meanwhile are removed by the next publish into the directory, and nothing
else is."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from lowdiff_store import StorageError
from lowdiff_store.storage import (
    PUBLISH_TEMP_MARK,
    atomic_publish,
    atomic_publish_dir,
    publish_temp_name,
    remove_stale_publish_temps,
)


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


# ------------------------------------------------------------------ temp files of dead writers


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_temp_names_carry_the_marker_host_and_pid(tmp_path: Path) -> None:
    seen: list[str] = []
    atomic_publish(tmp_path / "out.bin", lambda f: seen.extend(os.listdir(tmp_path)))
    (name,) = seen
    assert name.startswith(f".out.bin.{PUBLISH_TEMP_MARK}-")
    assert name.endswith(".tmp")
    host, pid, rand = name[len(f".out.bin.{PUBLISH_TEMP_MARK}-"):-4].split("-")
    assert int(pid) == os.getpid()
    assert len(host) == len(rand) == 8
    assert publish_temp_name("out.bin").rsplit("-", 1)[0] == name.rsplit("-", 1)[0]


def test_the_next_publish_removes_only_temps_of_dead_writers_here(tmp_path: Path) -> None:
    dead, live = _dead_pid(), os.getpid()
    mine = publish_temp_name("a.pt")
    stale = mine.replace(f"-{live}-", f"-{dead}-")
    in_use = publish_temp_name("b.pt")
    host = mine.split(f"{PUBLISH_TEMP_MARK}-")[1][:8]
    other_host = stale.replace(f"-{host}-", "-00000000-" if host != "00000000" else "-11111111-")
    foreign = [".a.pt.1234abcd.tmp", f"a.pt.{PUBLISH_TEMP_MARK}-{host}-{dead}-0123abcd.tmp",
               other_host, "notes.tmp"]
    for n in [stale, in_use, *foreign]:
        (tmp_path / n).write_bytes(b"partial")
    assert atomic_publish(tmp_path / "c.pt", lambda f: f.write(b"new")) == 3
    assert sorted(os.listdir(tmp_path)) == sorted([in_use, *foreign, "c.pt"])
    assert remove_stale_publish_temps(tmp_path) == []
    assert remove_stale_publish_temps(tmp_path / "missing") == []


def test_directory_publishes_share_the_names_and_the_cleanup(tmp_path: Path) -> None:
    stale_dir = publish_temp_name("old_ckpt").replace(f"-{os.getpid()}-", f"-{_dead_pid()}-")
    (tmp_path / stale_dir).mkdir()
    (tmp_path / stale_dir / "shard.bin").write_bytes(b"partial")
    stale_file = publish_temp_name("a.pt").replace(f"-{os.getpid()}-", f"-{_dead_pid()}-")
    (tmp_path / stale_file).write_bytes(b"partial")
    seen: list[str] = []

    def fill(d: str) -> None:
        seen.append(os.path.basename(d))
        Path(d, "x.bin").write_bytes(b"data")

    assert atomic_publish_dir(tmp_path / "ckpt", fill) == 4
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert seen[0].startswith(f".ckpt.{PUBLISH_TEMP_MARK}-")
    assert f"-{os.getpid()}-" in seen[0]
