"""S3Store against the store conformance class, on a real S3 server (moto_server)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowdiff_store.errors import Reason, StorageError
from lowdiff_store.storage import Store
from lowdiff_store.storage.s3 import S3Options, S3Store
from tests.storage_conformance import StoreConformance


class TestS3Store(StoreConformance):
    """The S3 store with its defaults (deletes hidden at once, removed after a grace)."""

    @pytest.fixture
    def store(self, s3_url: str) -> Store:
        return S3Store(s3_url)


def test_a_deleted_object_stays_readable_during_its_grace(s3_url: str) -> None:
    store = S3Store(s3_url, S3Options.from_env(gc_grace_s=600))
    store.create("base-1", [b"old base"])
    src = store.open("base-1", "pread")  # a reader holding an older manifest
    store.delete("base-1")
    assert not store.exists("base-1")
    assert store.list() == []
    assert bytes(src.read(0, 8)) == b"old base"
    assert bytes(store.open("base-1", "pread").read(4, 4)) == b"base"
    assert store.collect_garbage() == 0  # grace not over
    assert store.collect_garbage(now=time.time() + 601) == 1
    with pytest.raises(StorageError) as ei:
        store.open("base-1", "pread")
    assert ei.value.reason is Reason.MISSING_FILE
    keys = S3Store(s3_url).objects.list_keys(store.prefix + "/")
    assert keys == []  # object and tombstone gone


def test_immediate_delete(s3_url: str) -> None:
    store = S3Store(s3_url, S3Options.from_env(gc_grace_s=0))
    store.create("a", [b"1"])
    store.delete("a")
    with pytest.raises(StorageError):
        store.open("a", "pread")
    assert store.objects.list_keys(store.prefix + "/") == []


def test_the_core_never_imports_the_client() -> None:
    """boto3 (the s3 extra) is imported only when an s3:// store is opened."""
    code = ("import sys, lowdiff_store\n"
            "from lowdiff_store.storage import open_store\n"
            "from lowdiff_store import LogReader, LogWriter\n"
            "open_store('x')\n"
            "assert 'boto3' not in sys.modules and 'botocore' not in sys.modules\n"
            "assert 'lowdiff_store.storage.s3' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_large_pieces_and_seal_stream_from_the_staged_file(
        s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece of PIECE_MULTIPART_MIN_BYTES or more (here lowered) is a multipart upload
    read part by part from the staged file; readers see pieces, and the sealed object stays
    its pieces (its bytes are uploaded once)."""
    import os

    from lowdiff_store.storage.s3 import append as s3_append

    MULTIPART_MIN_BYTES = 16 << 20
    monkeypatch.setattr(s3_append, "PIECE_MULTIPART_MIN_BYTES", MULTIPART_MIN_BYTES)
    store = S3Store(s3_url)
    a, b = os.urandom(1000), os.urandom(MULTIPART_MIN_BYTES + 777)
    f = store.open_append("seg", create=True)
    f.append([a])
    f.sync()  # the first sync uploads
    f.append([b])
    f.flush()
    keys = [k for k, _ in store.objects.list_keys(store.prefix + "/")]
    assert [k.rsplit("/", 1)[-1] for k in keys] == [
        "seg@p00000000000000000000", "seg@p00000000000000001000"]
    src = store.open("seg", "pread")
    assert bytes(src.read(0, src.size)) == a + b
    assert bytes(src.read(990, 20)) == (a + b)[990:1010]  # across the two pieces
    f.append([a])
    f.seal()
    assert [k.rsplit("/", 1)[-1] for k, _ in store.objects.list_keys(store.prefix + "/")] == [
        "seg@p00000000000000000000", "seg@p00000000000000001000",
        f"seg@p{len(a + b):020d}"]
    off = 5 << 20
    assert bytes(src.read(off, 1000)) == (a + b)[off:off + 1000]
    sealed = a + b + a
    assert store.size("seg") == len(sealed)
    assert store.read("seg", max_bytes=len(sealed)) == sealed


def test_a_failed_open_for_append_leaves_no_staging_directory(
        s3_url: str, tmp_path: Path) -> None:
    """Opening an append handle that fails (the object exists) removes the scratch
    directory it made for the staged copy (review finding: it leaked)."""
    from lowdiff_store.storage import ObjectExists

    staging = tmp_path / "staging"
    staging.mkdir()
    store = S3Store(s3_url, S3Options.from_env(staging_dir=str(staging)))
    store.create("obj", [b"x" * 10])
    with pytest.raises(ObjectExists):
        store.open_append("obj", create=True)
    assert list(staging.iterdir()) == []
    h = store.open_append("fresh", create=True)  # a good open keeps one until closed
    assert len(list(staging.iterdir())) == 1
    h.append([b"abc"])
    h.sync()
    h.close()
    assert list(staging.iterdir()) == []
