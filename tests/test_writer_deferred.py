"""Deferred encodings (made on the encoder thread) and a memory budget sized from the record."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogReader, codecs
from lowdiff_store.errors import CommitError
from lowdiff_store.writer import AsyncLogWriter, TensorSpec
from lowdiff_store.writer.deferred import DeferredEncoding
from lowdiff_store.writer.staging import budget_for
from tests.test_writer import gated_factory


def _record(path: Path, step: int) -> bytes:
    """The bytes of ``step``'s record as framed in its segment."""
    with LogReader(path) as r:
        seg, off, length = r.record_location(step)
    with open(seg if Path(seg).is_absolute() else path / seg, "rb") as f:
        f.seek(off)
        return f.read(length)


def test_a_deferred_encoding_writes_the_bytes_of_the_encoded_parts(tmp_path: Path) -> None:
    idx = np.array([3, 9, 40, 41], np.int64)
    vals = np.array([1.5, -2.0, 0.25, 8.0], np.float32)
    enc = codecs.encode_sparse(idx, vals, 100, "F32")
    threads: list[str] = []

    def later() -> codecs.Encoded:
        threads.append(threading.current_thread().name)
        return codecs.encode_sparse(idx, vals, 100, "F32")

    logs, parts = {}, {}
    for name, given in (("plain", enc), ("deferred", DeferredEncoding(later, 48))):
        with AsyncLogWriter(tmp_path / name) as w:
            w.append(1, [TensorSpec("g", "F32", encoded=given, shape=(10, 10))], kind="grad",
                     side={"lr": 0.1}, owned=True)
            w.flush()
        with LogReader(tmp_path / name) as r:
            logs[name] = r.record(1).tensor("g")
            parts[name] = [p.tobytes() for p in r.record(1).parts("g")]
    assert threads == ["lowdiff-encoder"]  # once, on the encoder thread
    assert np.array_equal(logs["plain"], logs["deferred"])
    want = np.zeros(100, np.float32)
    want[idx] = vals
    assert np.array_equal(logs["deferred"].reshape(-1), want)
    # the records' bytes are the same (framing, header, parts, CRC)
    assert parts["plain"] == parts["deferred"]
    assert _record(tmp_path / "plain", 1) == _record(tmp_path / "deferred", 1)


def test_deferred_host_bytes_count_in_the_budget(tmp_path: Path) -> None:
    gate = threading.Event()
    released: list[int] = []
    enc = codecs.Encoded("raw", {}, (codecs.Part("U8", np.zeros(8, np.uint8)),))
    with AsyncLogWriter(tmp_path / "log", file_factory=gated_factory(gate)) as w:
        w.append(1, [TensorSpec("t", "U8", encoded=DeferredEncoding(lambda: enc, 123_456),
                                shape=(8,))], kind="grad", owned=True,
                 on_release=lambda: released.append(1))
        assert w.stats()["staged_bytes"] == 123_456
        gate.set()
        w.flush()
        assert w.stats()["staged_bytes"] == 0
    assert released == [1]


def test_a_failing_deferred_encoding_fails_its_step(tmp_path: Path) -> None:
    def boom() -> codecs.Encoded:
        raise ValueError("device copy failed")

    w = AsyncLogWriter(tmp_path / "log")
    ok = codecs.Encoded("raw", {}, (codecs.Part("U8", np.ones(4, np.uint8)),))
    w.append(1, [TensorSpec("t", "U8", encoded=ok, shape=(4,))], kind="grad")
    fut = w.append(2, [TensorSpec("t", "U8", encoded=DeferredEncoding(boom, 4), shape=(4,))],
                   kind="grad")
    with pytest.raises(CommitError) as info:
        fut.result(timeout=30)
    assert "2" in str(info.value)
    with pytest.raises(CommitError):
        w.close()
    with LogReader(tmp_path / "log") as r:  # the step before stays
        assert list(r.steps) == [1]


@pytest.mark.parametrize("bad", [dict(encode=None, nbytes=1), dict(encode=lambda: None,
                                                                   nbytes=-1)])
def test_deferred_encoding_checks_its_fields(bad: dict[str, Any]) -> None:
    with pytest.raises((TypeError, ValueError)):
        DeferredEncoding(**bad)


def test_budget_in_force_holds_two_records() -> None:
    assert budget_for(1 << 30, 1 << 20) == 1 << 30
    assert budget_for(1 << 30, 3 << 29) == 3 << 30  # a 1.5 GiB record: room for two
    assert budget_for(10, 10) == 20


def test_records_larger_than_the_budget_overlap_two_at_a_time(tmp_path: Path) -> None:
    """Step 2 is handed over while step 1 is still being written (no back-pressure); a
    third large record waits (never more than two in flight)."""
    gate = threading.Event()
    n = 50_000
    with AsyncLogWriter(tmp_path / "log", memory_budget=10_000,
                        file_factory=gated_factory(gate)) as w:
        w.append(1, [TensorSpec("a", "U8", np.zeros(n, np.uint8))], kind="grad", owned=True)
        w.append(2, [TensorSpec("a", "U8", np.ones(n, np.uint8))], kind="grad", owned=True)
        st = w.stats()
        assert st["blocked_s"] == 0
        assert st["staged_bytes"] == 2 * n
        third = threading.Thread(target=lambda: w.append(
            3, [TensorSpec("a", "U8", np.full(n, 2, np.uint8))], kind="grad", owned=True))
        third.start()
        third.join(0.3)
        assert third.is_alive()  # admitted only once a record is written
        assert w.stats()["staged_bytes"] == 2 * n
        gate.set()
        third.join(30)
        assert not third.is_alive()
        assert w.flush() == 3
        assert w.stats()["staged_bytes_peak"] <= 2 * n
    with LogReader(tmp_path / "log") as r:
        assert [int(r.record(s).tensor("a")[0]) for s in (1, 2, 3)] == [0, 1, 2]
