"""LocalStore against the store conformance class, plus what only a local directory has:
special files (FIFO, device) refused at open, durable directory creation."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from lowdiff_store.errors import FormatError, LowdiffError, Reason, StorageError
from lowdiff_store.storage import LocalStore, Store, local, open_store
from tests.storage_conformance import StoreConformance


class TestLocalStore(StoreConformance):
    """The local directory store."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return LocalStore(str(tmp_path / "store"))


class _SequencedLocalStore(LocalStore):
    """A local store that commits the object-store way (the :class:`Store` default:
    create-only ``NAME.<sequence>`` objects, no rename): the mechanism an S3 backend
    inherits, checked here on a real directory."""

    read_versioned = Store.read_versioned
    commit = Store.commit


class TestSequencedCommit(StoreConformance):
    """The default (object-store) commit, over local files."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return _SequencedLocalStore(str(tmp_path / "store"))

    def test_versions_are_create_only_objects(self, store: Store) -> None:
        t = store.commit("MANIFEST", [b"a"], expect=None)
        store.commit("MANIFEST", [b"b"], expect=t)
        assert store.list() == ["MANIFEST.00000000000000000000",
                                "MANIFEST.00000000000000000001"]


def test_open_store_routes_paths_and_urls(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    assert isinstance(s, LocalStore)
    assert s.root == str(tmp_path)
    assert open_store(s) is s
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    with pytest.raises(LowdiffError) as ei:
        open_store("gopher://host/x")
    assert ei.value.reason is Reason.INVALID_ARGUMENT


# ------------------------------------------------------------------ special files


def _finishes(fn: Callable[[], object], timeout: float = 20.0) -> BaseException | None:
    """Run ``fn`` on a daemon thread; the exception it raised, or None. Fails the test if it
    is still blocked after ``timeout`` seconds (a FIFO open waits forever)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert out, "blocked: the special file was opened instead of refused"
    return out[0]


@pytest.mark.parametrize("kind", ["fifo", "devzero", "dir"])
def test_special_files_are_refused_at_open(tmp_path: Path, kind: str) -> None:
    store = LocalStore(str(tmp_path))
    p = tmp_path / "X"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "devzero":
        p.symlink_to("/dev/zero")
    else:
        p.mkdir()
    calls: list[Callable[[], object]] = [
        lambda: store.open("X", "mmap"), lambda: store.open("X", "pread"),
        lambda: store.read("X", max_bytes=1 << 20), lambda: store.open_append("X"),
        lambda: store.read_versioned("X", max_bytes=1 << 20)]
    for call in calls:
        err = _finishes(call)
        assert isinstance(err, StorageError), err
        if kind != "dir" or err.reason is not Reason.IO_ERROR:  # O_WRONLY on a dir: EISDIR
            assert err.reason is Reason.NOT_A_REGULAR_FILE, err
        assert err.path == str(p)


def test_a_huge_regular_file_is_not_read_past_its_cap(tmp_path: Path) -> None:
    p = tmp_path / "MANIFEST"
    with open(p, "wb") as fh:
        fh.truncate(1 << 40)  # sparse: 1 TiB, nothing allocated
    with pytest.raises(FormatError) as ei:
        LocalStore(str(tmp_path)).read("MANIFEST", max_bytes=64 << 20)
    assert ei.value.reason is Reason.METADATA_TOO_LARGE


# ------------------------------------------------------------------ durable directories


def test_ensure_root_fsyncs_every_new_directory_in_its_parent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = local.fsync_dir
    monkeypatch.setattr(local, "fsync_dir", lambda d: (synced.append(d), real(d)))
    LocalStore(str(tmp_path / "a" / "b" / "log")).ensure_root()
    for d in ("a", "a/b", "a/b/log"):
        assert (tmp_path / d).is_dir()
        assert str(tmp_path / d) in synced  # its own entries
    for parent in ("", "a", "a/b"):  # the entry of each new directory in its parent
        assert str(tmp_path / parent).rstrip("/") in synced


def test_delete_fsyncs_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(str(tmp_path))
    store.create("sub/f", [b"x"])
    order: list[str] = []
    real_unlink, real_fsync = os.unlink, local.fsync_dir
    monkeypatch.setattr(local.os, "unlink", lambda p: (order.append(f"unlink {p}"),
                                                       real_unlink(p))[1])
    monkeypatch.setattr(local, "fsync_dir", lambda d: (order.append(f"fsync {d}"),
                                                       real_fsync(d))[1])
    store.delete("sub/f")
    assert order == [f"unlink {tmp_path / 'sub' / 'f'}", f"fsync {tmp_path / 'sub'}"]


# ------------------------------------------------------------------ only the store


_FILE_CALLS = {"os.replace", "os.rename", "os.listdir", "os.scandir", "os.walk", "os.unlink",
               "os.remove", "os.open", "os.makedirs", "os.mkdir", "os.rmdir", "os.stat",
               "os.fsync", "os.ftruncate", "os.path.exists", "os.path.getsize",
               "os.path.isdir", "os.path.isfile", "open"}


def test_the_log_compaction_verify_and_tuner_touch_files_only_through_the_store() -> None:
    """No file access outside ``storage/`` in the modules that must use only the store."""
    import ast

    pkg = Path(__file__).resolve().parents[1] / "lowdiff_store"
    files = sorted((pkg / "log").glob("*.py")) + sorted((pkg / "compaction").glob("*.py")) + [
        pkg / n for n in ("verify.py", "tuning_from_log.py")]
    found = []
    for f in files:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in _FILE_CALLS:
                    found.append(f"{f.name}:{node.lineno}: {name}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if {"fcntl", "shutil", "mmap"} & set(mods):
                    found.append(f"{f.name}:{node.lineno}: import {mods}")
    assert not found, found


def test_private_mode_views_are_writable_and_never_reach_the_file(tmp_path: Path) -> None:
    """``"private"`` maps copy-on-write: the views are writable, a write is this process's
    own, the file and a shared ("mmap") view of it keep their bytes."""
    import numpy as np

    store = LocalStore(str(tmp_path))
    data = bytes(range(256)) * 64
    store.publish("f", [data])
    priv = store.open("f", "private")
    shared = store.open("f", "mmap")
    a = np.frombuffer(priv.read(64, 128), np.uint8)
    b = np.frombuffer(shared.read(64, 128), np.uint8)
    assert a.flags.writeable
    assert not b.flags.writeable
    a[:] = 7
    assert bytes(priv.read(64, 128)) == b"\x07" * 128
    assert bytes(shared.read(64, 128)) == data[64:192]
    assert (tmp_path / "f").read_bytes() == data
    with pytest.raises(LowdiffError, match="unknown read mode"):
        local.open_source(str(tmp_path / "f"), "cow")  # type: ignore[arg-type]
    priv.close()
    shared.close()
