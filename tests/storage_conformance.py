"""The contract of :class:`lowdiff_store.storage.Store`, as tests every backend runs.

A backend's test module subclasses :class:`StoreConformance` and provides the ``store``
fixture: an empty store, fresh for each test, whose ``url`` :func:`open_store` can open
again from another process (the lock test does). Example (``tests/test_storage_local.py``)::

    class TestLocalStore(StoreConformance):
        @pytest.fixture
        def store(self, tmp_path):
            return LocalStore(str(tmp_path / "store"))

The file name does not start with ``test_`` so pytest collects the class only through its
subclasses.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from lowdiff_store.errors import FormatError, LowdiffError, Reason, StorageError
from lowdiff_store.storage import CommitConflict, ObjectExists, Store


class StoreConformance:
    """Tests every :class:`Store` must pass. Subclasses provide the ``store`` fixture."""

    @pytest.fixture
    def store(self) -> Store:
        """An empty store (subclasses override)."""
        raise NotImplementedError

    # ------------------------------------------------------------ whole objects

    def test_create_then_read(self, store: Store) -> None:
        store.create("a", [b"hello ", memoryview(b"world"), np.arange(2, dtype="<u2").data])
        assert store.exists("a")
        assert store.size("a") == 15
        assert store.read("a", max_bytes=15) == b"hello world\x00\x00\x01\x00"

    def test_create_refuses_an_existing_name(self, store: Store) -> None:
        store.create("a", [b"first"])
        with pytest.raises(ObjectExists) as ei:
            store.create("a", [b"second, longer"])
        assert ei.value.reason is Reason.ALREADY_EXISTS
        assert ei.value.path == store.path_of("a")
        assert store.read("a", max_bytes=100) == b"first"
        assert store.list() == ["a"]

    def test_publish_creates_and_replaces(self, store: Store) -> None:
        store.publish("m", [b"one"])
        assert store.read("m", max_bytes=10) == b"one"
        store.publish("m", [b"two, longer"])
        assert store.read("m", max_bytes=100) == b"two, longer"
        store.publish("m", [])
        assert store.size("m") == 0
        assert store.list() == ["m"]

    def test_publish_never_shows_a_partial_object(self, store: Store) -> None:
        a, b = b"A" * (3 << 20), b"B" * (1 << 20)
        store.publish("m", [a])
        seen: set[bytes] = set()
        stop = threading.Event()
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                while not stop.is_set():
                    data = store.read("m", max_bytes=len(a))
                    seen.add(data[:1] + data[-1:] + str(len(data)).encode())
                    assert data in (a, b), (len(data), data[:1], data[-1:])
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=reader)
        t.start()
        try:
            for i in range(12):
                store.publish("m", [a if i % 2 else b])
        finally:
            stop.set()
            t.join()
        assert not errors, errors[0]
        assert seen <= {b"AA" + str(len(a)).encode(), b"BB" + str(len(b)).encode()}

    def test_a_failed_publish_keeps_the_old_object(self, store: Store) -> None:
        store.publish("m", [b"old"])

        def chunks() -> list[object]:
            return [b"new", 12345]  # not a buffer: fails while writing

        with pytest.raises(TypeError):
            store.publish("m", chunks())  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            store.create("n", chunks())  # type: ignore[arg-type]
        assert store.read("m", max_bytes=10) == b"old"
        assert store.list() == ["m"]

    def test_read_is_capped_before_reading(self, store: Store) -> None:
        store.create("big", [b"x" * 1000])
        assert store.read("big", max_bytes=1000) == b"x" * 1000
        with pytest.raises(FormatError) as ei:
            store.read("big", max_bytes=999)
        assert ei.value.reason is Reason.METADATA_TOO_LARGE
        assert ei.value.path == store.path_of("big")

    def test_missing_objects(self, store: Store) -> None:
        assert not store.exists("nope")
        for call in (lambda: store.size("nope"), lambda: store.read("nope", max_bytes=10),
                     lambda: store.open("nope", "pread"), lambda: store.open("nope", "mmap"),
                     lambda: store.open_append("nope")):
            with pytest.raises(StorageError) as ei:
                call()
            assert ei.value.reason is Reason.MISSING_FILE
            assert ei.value.path == store.path_of("nope")
        assert store.read_versioned("nope", max_bytes=10) is None

    # ------------------------------------------------------------ ranged reads

    @pytest.mark.parametrize("mode", ["mmap", "pread", "private"])
    def test_ranges_are_exact_and_bounds_checked(self, store: Store, mode: str) -> None:
        data = bytes(range(256)) * 40
        store.create("d", [data])
        src = store.open("d", mode)  # type: ignore[arg-type]
        try:
            assert src.size == len(data)
            assert src.path == store.path_of("d")
            for off, n in [(0, 0), (5, 100), (4096, 4096), (len(data) - 1, 1),
                           (len(data), 0)]:
                assert bytes(src.read(off, n)) == data[off:off + n]
            for off, n in [(-1, 1), (0, -1), (len(data), 1), (len(data) - 3, 4), (2**62, 1)]:
                with pytest.raises(FormatError) as ei:
                    src.read(off, n)
                assert ei.value.reason is Reason.TRUNCATED
        finally:
            src.close()

    @pytest.mark.parametrize("mode", ["mmap", "pread", "private"])
    def test_a_source_can_be_limited_to_a_prefix(self, store: Store, mode: str) -> None:
        store.create("d", [b"0123456789"])
        src = store.open("d", mode, length=4)  # type: ignore[arg-type]
        try:
            assert src.size == 4
            assert bytes(src.read(0, 4)) == b"0123"
            with pytest.raises(FormatError):
                src.read(3, 2)
        finally:
            src.close()
        with pytest.raises(FormatError):
            store.open("d", mode, length=11)  # type: ignore[arg-type]

    # ------------------------------------------------------------ append handles

    def test_append_sync_truncate(self, store: Store) -> None:
        f = store.open_append("seg", create=True)
        assert (f.size, f.synced_size) == (0, 0)
        assert f.append([b"abc", memoryview(b"de")]) == 0
        assert f.append([np.array([1], "<u4").data]) == 5
        assert (f.size, f.synced_size) == (9, 0)
        f.rewrite_unsynced(0, b"A")
        f.sync()
        assert f.synced_size == 9
        with pytest.raises(LowdiffError):
            f.rewrite_unsynced(0, b"B")  # durable bytes are never rewritten
        f.truncate(4)
        assert (f.size, f.synced_size) == (4, 4)
        assert f.append([b"Z"]) == 4
        f.seal()
        f.close()  # idempotent after seal
        assert store.read("seg", max_bytes=100) == b"AbcdZ"
        assert store.size("seg") == 5
        g = store.open_append("seg")  # reopen: appends go to the end
        assert g.size == g.synced_size == 5
        assert g.append([b"!"]) == 5
        g.sync()  # taken; durable now or at the store's next durability point
        assert g.durable_size <= g.synced_size == 6
        g.flush()  # durable now
        assert g.durable_size == 6
        assert g.flush_due is None
        g.close()
        assert store.read("seg", max_bytes=100) == b"AbcdZ!"

    def test_append_create_refuses_an_existing_name(self, store: Store) -> None:
        store.create("seg", [b"keep"])
        with pytest.raises(ObjectExists):
            store.open_append("seg", create=True)
        assert store.read("seg", max_bytes=10) == b"keep"

    # ------------------------------------------------------------ names, list, delete

    def test_names_with_subdirectories(self, store: Store) -> None:
        store.create("rank-00000/MANIFEST", [b"r0"])
        store.publish("rank-00001/MANIFEST", [b"r1"])
        f = store.open_append("rank-00001/seg-1", create=True)
        f.append([b"x"])
        f.seal()
        store.create("SHARDS", [b"s"])
        assert store.list() == ["SHARDS", "rank-00000/MANIFEST", "rank-00001/MANIFEST",
                                "rank-00001/seg-1"]
        assert store.list("rank-00001/") == ["rank-00001/MANIFEST", "rank-00001/seg-1"]
        assert store.list("rank-0000") == store.list()[1:]
        shard = store.child("rank-00001")
        assert shard.read("MANIFEST", max_bytes=10) == b"r1"
        assert shard.list() == ["MANIFEST", "seg-1"]
        assert shard.path_of("MANIFEST") == store.path_of("rank-00001/MANIFEST")

    @pytest.mark.parametrize("name", ["", "/abs", "a//b", "../up", "a/./b", "a/..", "nul\0"])
    def test_invalid_names_are_refused(self, store: Store, name: str) -> None:
        with pytest.raises(LowdiffError) as ei:
            store.create(name, [b"x"])
        assert ei.value.reason is Reason.UNSAFE_NAME

    def test_list_of_an_empty_store(self, store: Store) -> None:
        assert store.list() == []
        assert store.list("x") == []

    def test_delete(self, store: Store) -> None:
        store.create("a", [b"1"])
        store.create("b/c", [b"2"])
        store.delete("a")
        store.delete("a")  # missing: not an error
        store.delete("never-existed")
        store.delete("b/c")
        assert not store.exists("a")
        assert store.list() == []

    def test_delete_many(self, store: Store) -> None:
        for n in ("a", "b", "c", "d/e"):
            store.create(n, [n.encode()])
        store.delete_many(["a", "never-existed", "d/e", "b"])
        store.delete_many([])
        assert store.list() == ["c"]
        assert store.read("c", max_bytes=10) == b"c"

    def test_ensure_root_is_idempotent(self, store: Store) -> None:
        store.ensure_root()
        store.ensure_root()
        store.create("x", [b""])
        assert store.list() == ["x"]

    # ------------------------------------------------------------ locks

    def test_lock_is_exclusive(self, store: Store) -> None:
        first = store.try_lock("LOCK")
        assert first is not None
        assert store.try_lock("LOCK") is None
        other = store.try_lock("COMPACT.lock")  # another name is another lock
        assert other is not None
        other.release()
        first.release()
        first.release()  # idempotent
        with store.try_lock("LOCK") as again:  # type: ignore[union-attr]
            assert again is not None
            assert store.try_lock("LOCK") is None
        assert store.try_lock("LOCK") is not None

    def test_lock_excludes_another_process(self, store: Store) -> None:
        code = textwrap.dedent(f"""
            from lowdiff_store.storage import open_store
            lock = open_store({store.url!r}).try_lock("LOCK")
            print("locked" if lock is None else "acquired")
        """)

        def other() -> str:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 timeout=120)
            assert out.returncode == 0, out.stderr
            return out.stdout.strip()

        held = store.try_lock("LOCK")
        assert held is not None
        try:
            assert other() == "locked"
        finally:
            held.release()
        assert other() == "acquired"

    # ------------------------------------------------------------ versioned commit

    def test_commit_is_a_compare_and_swap(self, store: Store) -> None:
        assert store.read_versioned("M", max_bytes=100) is None
        t1 = store.commit("M", [b"v1"], expect=None)
        cur = store.read_versioned("M", max_bytes=100)
        assert cur is not None
        assert cur.data == b"v1"
        assert cur.token == t1
        with pytest.raises(CommitConflict) as ei:
            store.commit("M", [b"again"], expect=None)  # exists already
        assert ei.value.reason is Reason.COMMIT_CONFLICT
        t2 = store.commit("M", [b"v2"], expect=t1)
        assert t2 != t1
        with pytest.raises(CommitConflict):
            store.commit("M", [b"stale"], expect=t1)  # based on an old version
        cur = store.read_versioned("M", max_bytes=100)
        assert cur is not None
        assert (cur.data, cur.token) == (b"v2", t2)
        with pytest.raises(FormatError):
            store.read_versioned("M", max_bytes=1)

    def test_racing_commits_have_one_winner(self, store: Store) -> None:
        base = store.commit("M", [b"v0"], expect=None)
        outcome: list[str] = []
        barrier = threading.Barrier(4)

        def racer(i: int) -> None:
            barrier.wait()
            try:
                store.commit("M", [f"from {i}".encode()], expect=base)
                outcome.append(f"won {i}")
            except CommitConflict:
                outcome.append("lost")

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [o for o in outcome if o.startswith("won")]
        assert len(winners) == 1
        assert outcome.count("lost") == 3
        cur = store.read_versioned("M", max_bytes=100)
        assert cur is not None
        assert cur.data == f"from {winners[0][4:]}".encode()
