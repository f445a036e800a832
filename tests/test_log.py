"""Layer 4 (log): create/reopen, segments, bases, manifest, index, chains, durability,
history truncation, garbage collection, recovery (strict and tolerant readers)."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowdiff_store import (
    BaseFile,
    ConfigError,
    LogReader,
    LogWriter,
    LowdiffError,
    Reason,
    StepNotFoundError,
    StorageError,
    tensor_input,
)
from lowdiff_store.format.checksum import crc32c, mask
from lowdiff_store.format.constants import FILE_HEADER_SIZE, RECORD_TYPE_DIFF
from lowdiff_store.format.framing import unpack_manifest
from lowdiff_store.format.record import TensorInput, build_record
from lowdiff_store.log.manifest import load_manifest, publish_manifest
from lowdiff_store.log.writer import _runs
from lowdiff_store.storage import AppendFile
from lowdiff_store.verify import verify_log

SEG0 = "seg-0000000000000000.ldlog"
IDX0 = "seg-0000000000000000.ldidx"


def seg(i: int) -> str:
    return f"seg-{i:016d}.ldlog"


def idx(i: int) -> str:
    return f"seg-{i:016d}.ldidx"


def base_name(step: int) -> str:
    return f"base-{step:016d}.safetensors"


def values(step: int, n: int = 16) -> np.ndarray:
    """The gradient the tests store at ``step`` (distinct for every step and size)."""
    return (np.arange(n, dtype="<f4") + np.float32(step) * 1000).astype("<f4")


def grad(step: int, n: int = 16) -> list[TensorInput]:
    return [tensor_input("g", values(step, n), "F32")]


def append(w: LogWriter, steps: Sequence[int], n: int = 16, sync: bool = True) -> None:
    for s in steps:
        w.append(s, grad(s, n), kind="grad", side={"step": s})
    if sync:
        w.sync()


def check_steps(path: Path, steps: Sequence[int], n: int = 16, **kw: Any) -> None:
    with LogReader(path, **kw) as r:
        assert [int(s) for s in r.steps] == list(steps)
        for s in steps:
            rec = r.record(s)
            assert rec.side == {"step": s}
            assert rec.tensor("g").tobytes() == values(s, n).tobytes(), s


def flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([b ^ (1 << bit)]))


def locations(path: Path) -> dict[int, tuple[str, int, int]]:
    with LogReader(path) as r:
        return {int(s): r.record_location(int(s)) for s in r.steps}


# --------------------------------------------------------------------------- create/open


def test_create_makes_an_empty_log(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p, meta={"mode": "grad"}) as w:
        assert w.last_step == -1
        assert w.durable_step is None
        assert sorted(os.listdir(p)) == ["LOCK", "MANIFEST", "MANIFEST.lock", IDX0, SEG0]
    assert os.path.getsize(p / SEG0) == 64
    assert os.path.getsize(p / IDX0) == 64
    body = unpack_manifest((p / "MANIFEST").read_bytes())
    assert body["segments"] == [[0, 0]]
    assert body["bases"] == []
    assert body["next_segment_id"] == 1
    assert body["generation"] >= 1
    assert body["meta"] == {"mode": "grad"}
    assert len(body["log_id"]) == 16
    with LogReader(p) as r:
        assert len(r) == 0
        assert r.steps.tolist() == []
        assert r.bases == []
        assert (r.first_step, r.last_step, r.durable_step) == (None, None, None)
        assert r.meta == {"mode": "grad"}
        assert r.log_id == body["log_id"]
        assert r.report.clean
        assert r.report.torn_tail_bytes == 0


def test_two_logs_have_different_ids(tmp_path: Path) -> None:
    LogWriter(tmp_path / "a").close()
    LogWriter(tmp_path / "b").close()
    assert load_manifest(str(tmp_path / "a")).log_id != load_manifest(str(tmp_path / "b")).log_id


def test_reopen_and_append(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p) as w:
        w.write_base(0, {"w": ("F32", values(0))})
        append(w, [1, 2, 3])
    with LogWriter(p) as w:
        assert w.last_step == 3
        assert w.durable_step == 3
        append(w, [4, 5])
    check_steps(p, [1, 2, 3, 4, 5])
    check_steps(p, [1, 2, 3, 4, 5], mode="pread")
    assert verify_log(str(p)).ok


def test_steps_must_increase(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p) as w:
        append(w, [5])
        for bad in (5, 4, 0):
            with pytest.raises(ConfigError) as ei:
                w.append(bad, grad(bad), kind="grad")
            assert ei.value.reason is Reason.STEP_OUT_OF_ORDER
        # a batch is refused as a whole when any step in it is out of order
        recs = [build_record(s, grad(s), kind="grad") for s in (6, 8, 7)]
        with pytest.raises(ConfigError):
            w.write_records(recs)
        assert w.last_step == 5
    with LogWriter(p) as w:  # also after a reopen
        with pytest.raises(ConfigError):
            w.append(5, grad(5), kind="grad")
    check_steps(p, [5])


def test_closed_writer_refuses_calls(tmp_path: Path) -> None:
    w = LogWriter(tmp_path / "log")
    w.close()
    w.close()  # idempotent
    for call in (lambda: w.append(1, grad(1), kind="grad"), w.sync,
                 lambda: w.write_base(0, {"w": ("F32", values(0))})):
        with pytest.raises(LowdiffError) as ei:
            call()
        assert ei.value.reason is Reason.WRITER_CLOSED


def test_segment_bytes_lower_bound(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        LogWriter(tmp_path / "log", segment_bytes=4095)
    assert not (tmp_path / "log").exists() or not os.listdir(tmp_path / "log")


def test_second_writer_is_locked_out_but_readers_are_not(tmp_path: Path) -> None:
    p = tmp_path / "log"
    w = LogWriter(p)
    append(w, [1])
    with pytest.raises(LowdiffError) as ei:
        LogWriter(p)
    assert ei.value.reason is Reason.LOCKED
    assert ei.value.path == str(p / "LOCK")
    check_steps(p, [1])  # a reader needs no lock
    w.close()
    LogWriter(p).close()  # released on close


def test_create_refuses_a_directory_with_log_files_but_no_manifest(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p) as w:
        append(w, [1])
    os.unlink(p / "MANIFEST")
    with pytest.raises(LowdiffError) as ei:
        LogWriter(p)
    assert ei.value.reason is Reason.NOT_A_LOG
    assert (p / SEG0).exists()  # nothing was overwritten


def test_reader_on_something_that_is_not_a_log(tmp_path: Path) -> None:
    with pytest.raises(LowdiffError) as ei:
        LogReader(tmp_path)
    assert ei.value.reason is Reason.NOT_A_LOG
    assert ei.value.path == str(tmp_path)
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(LowdiffError) as ei:
        LogReader(f)
    assert ei.value.reason is Reason.IO_ERROR


def test_manifest_with_no_segment_is_refused_by_the_writer(small_log: Any) -> None:
    m = load_manifest(str(small_log.path))
    m.segments = []
    publish_manifest(str(small_log.path), m)
    with pytest.raises(LowdiffError) as ei:
        LogWriter(small_log.path)
    assert ei.value.reason is Reason.BAD_METADATA
    assert (small_log.path / SEG0).exists()  # not collected as garbage on that manifest


def test_update_meta_and_unknown_manifest_keys_survive_rewrites(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p, meta={"a": 1}, segment_bytes=4096) as w:
        w.update_meta({"b": [1, 2]})
    m = load_manifest(str(p))
    m.extra["from_a_newer_minor"] = {"x": b"\x01"}
    publish_manifest(str(p), m)
    with LogWriter(p, segment_bytes=4096) as w:
        append(w, range(1, 20), n=256)  # rolls segments: the manifest is rewritten
        w.write_base(20, {"w": ("F32", values(20))})
        w.update_meta({"a": 2})
    body = unpack_manifest((p / "MANIFEST").read_bytes())
    assert body["from_a_newer_minor"] == {"x": b"\x01"}
    assert body["meta"] == {"a": 2, "b": [1, 2]}
    assert len(body["segments"]) > 1


# ------------------------------------------------------------------------------ segments


def test_segment_roll_at_segment_bytes(tmp_path: Path) -> None:
    p = tmp_path / "log"
    n = 300  # each record is 32 + meta + 1200 bytes of payload, aligned: 1344 bytes
    with LogWriter(p, segment_bytes=4096) as w:
        w.write_base(0, {"w": ("F32", values(0))})
        append(w, range(1, 11), n=n, sync=False)
        w.append(11, grad(11, 2000), kind="grad", side={"step": 11})  # > segment_bytes
        append(w, [12], n=n)
        assert w.stats["rolls"] >= 4
    man = load_manifest(str(p))
    sizes = [os.path.getsize(p / seg(s)) for s, _f in man.segments]
    with LogReader(p) as r:
        by_seg: dict[int, list[int]] = {}
        for s in r.steps:
            path, _off, _ln = r.record_location(int(s))
            by_seg.setdefault(int(os.path.basename(path)[4:20]), []).append(int(s))
    for k, ((sid, first), size) in enumerate(zip(man.segments, sizes)):
        steps = by_seg[sid]
        # a rolled segment starts at its first record's step; the first one at 0
        assert first == (steps[0] if k else 0)
        assert size <= 4096 or len(steps) == 1, (sid, size, steps)  # only a lone big record
    assert [s for sid, _f in man.segments for s in by_seg[sid]] == list(range(1, 13))
    assert man.next_segment_id == man.segments[-1][0] + 1
    with LogReader(p) as r:
        for s in range(1, 13):
            assert r.record(s).tensor("g").tobytes() == values(s, 2000 if s == 11
                                                                else n).tobytes()
    assert verify_log(str(p)).ok


# --------------------------------------------------------------------------------- bases


def test_bases_publish_in_order(tmp_path: Path) -> None:
    p = tmp_path / "log"
    w0 = np.arange(6, dtype="<f4").reshape(2, 3)
    with LogWriter(p) as w:
        size = w.write_base(0, {"w": ("F32", w0), "b": ("BF16", np.array([1, 2], "<u2"))},
                            meta={"opt": "SGD"})
        assert size == os.path.getsize(p / base_name(0))
        append(w, [1, 2])
        w.write_base(2, {"w": ("F32", w0 + 2)})
        assert w.durable_step == 2
        assert w.write_base(2, {"w": ("F32", w0 + 99)}) == 0  # already live: not rewritten
        append(w, [3])
    with LogReader(p) as r:
        assert r.bases == [0, 2]
        assert r.first_step == 0
        assert r.last_step == 3
        assert load_manifest(str(p)).bases == [0, 2]
        with r.base(0) as b:
            assert b.names == ["w", "b"]
            assert b.step == 0
            assert b.meta() == {"opt": "SGD"}
            assert b.info("w") == ("F32", (2, 3))
            assert b.info("b") == ("BF16", (2,))
            assert b.tensor("w").tobytes() == w0.tobytes()
            assert b.tensor("b").tolist() == [1, 2]
        with r.base(2) as b:
            assert b.tensor("w").tobytes() == (w0 + 2).tobytes()
            assert b.meta() == {}
        with pytest.raises(StepNotFoundError) as ei:
            r.base(1)
        assert ei.value.reason is Reason.NO_BASE


def test_base_tensors_are_aligned_zero_copy_views(tmp_path: Path) -> None:
    p = tmp_path / "log"
    arrays = {f"t{i}": np.arange(i + 1, dtype="<u2") for i in range(7)}
    with LogWriter(p) as w:
        w.write_base(0, {k: ("U16", a) for k, a in arrays.items()})
    with LogReader(p) as r, r.base(0) as b:
        for k, a in arrays.items():
            t = b.tensor(k)
            assert t.tobytes() == a.tobytes()
            assert not t.flags.writeable
            assert t.ctypes.data % 64 == 0  # mmap is page aligned; tensors 64-aligned in it


@pytest.mark.parametrize(("tensors", "reason"), [
    ({"__lowdiff__.meta": ("U8", np.zeros(1, "u1"))}, "unsafe_name"),
    ({"w": ("F32", np.zeros(1, "<f8"))}, "bad_dtype"),
    ({"w": ("X", np.zeros(1, "<f4"))}, "bad_dtype"),
])
def test_base_refuses_bad_tensors(tensors: Any, reason: str, tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p) as w:
        with pytest.raises(LowdiffError) as ei:
            w.write_base(0, tensors)
        assert ei.value.reason.value == reason
    assert load_manifest(str(p)).bases == []
    assert not any(n.startswith("base-") for n in os.listdir(p))


def test_missing_base_file(small_log: Any) -> None:
    os.unlink(small_log.base_file)
    with LogReader(small_log.path) as r:
        with pytest.raises(LowdiffError) as ei:
            r.base(0)
    assert ei.value.reason is Reason.MISSING_FILE
    assert ei.value.path == str(small_log.base_file)
    rep = verify_log(str(small_log.path))
    assert [p.reason for p in rep.problems] == [Reason.MISSING_FILE]


# -------------------------------------------------------------------- chains, durability


def test_chain_and_lookups(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p) as w:
        w.write_base(0, {"w": ("F32", values(0))})
        append(w, [1, 2, 3])
        w.write_base(3, {"w": ("F32", values(3))})
        append(w, [4, 5])
    with LogReader(p) as r:
        assert r.chain(0) == (0, [])
        assert r.chain(2) == (0, [1, 2])
        assert r.chain(3) == (3, [])
        assert r.chain(5) == (3, [4, 5])
        assert r.base_for(2) == 0
        assert r.base_for(4) == 3
        assert r.has_step(4)
        assert not r.has_step(0)
        assert not r.has_step(6)
        assert [rec.step for rec in r.iter_records(2, 4)] == [2, 3, 4]
        assert [rec.step for rec in r.iter_records()] == [1, 2, 3, 4, 5]
        with pytest.raises(StepNotFoundError) as ei:
            r.record(6)
        assert ei.value.reason is Reason.NO_SUCH_STEP
        with pytest.raises(StepNotFoundError) as ei:
            r.chain(-1)
        assert ei.value.reason is Reason.NO_BASE


def test_chain_with_a_missing_diff(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p) as w:
        w.write_base(0, {"w": ("F32", values(0))})
        append(w, [1, 2, 4, 5])  # step 3 never logged
    with LogReader(p) as r:
        assert r.chain(2) == (0, [1, 2])
        with pytest.raises(StepNotFoundError) as ei:
            r.chain(5)
        assert ei.value.reason is Reason.NO_SUCH_STEP
        assert "step 3 is missing" in str(ei.value)
        assert r.durable_step == 2  # the last step reachable from a base
        assert r.last_step == 5


def test_chain_without_any_base(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p) as w:
        append(w, [1, 2])
    with LogReader(p) as r:
        with pytest.raises(StepNotFoundError) as ei:
            r.chain(2)
        assert ei.value.reason is Reason.NO_BASE
        assert r.durable_step is None
        assert r.first_step == 1


def test_durable_step_follows_sync(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p) as w:
        w.write_base(0, {"w": ("F32", values(0))})
        assert w.durable_step is None  # the writer counts diffs; a base does not move it
        assert w.last_step == -1
        append(w, [1, 2], sync=False)
        assert w.durable_step is None
        assert w.last_step == 2
        assert w.sync() == 2
        assert w.durable_step == 2
        append(w, [3], sync=False)
        w.write_base(3, {"w": ("F32", values(3))})  # record 3 not yet synced
        assert w.durable_step == 2
        w.sync()
        assert w.durable_step == 3
    with LogWriter(p) as w:
        assert w.durable_step == 3


# -------------------------------------------------------------------------------- index


def test_open_many_records_without_scanning(tmp_path: Path) -> None:
    p = tmp_path / "log"
    built = {}
    with LogWriter(p, segment_bytes=1 << 16) as w:
        for lo in range(1, 3001, 250):
            recs = [build_record(s, grad(s, 8 + s % 5), kind="grad", side={"step": s})
                    for s in range(lo, lo + 250)]
            w.write_records(recs)
            w.sync()
            for r in recs:
                built[r.step] = b"".join(bytes(c) for c in r.chunks)
    with LogReader(p) as r:
        assert len(r) == 3000
        assert len(r.manifest.segments) > 3
        assert r.report.unindexed_records == 0
        assert r.report.index_rebuilt == []
        assert r.report.clean
        assert r.report.torn_tail_bytes == 0
        for step in (1, 1234, 2999, 3000):
            path, off, ln = r.record_location(step)
            with open(path, "rb") as fh:
                fh.seek(off)
                assert fh.read(ln) == built[step]
            assert r.record(step).tensor("g").tobytes() == values(step, 8 + step % 5).tobytes()


def test_deleted_index_is_rebuilt(small_log: Any, read_all: Callable[..., Any]) -> None:
    os.unlink(small_log.index)
    with LogReader(small_log.path) as r:
        assert r.report.index_rebuilt == [0]
        assert r.report.unindexed_records == 4
    assert read_all(small_log.path, small_log) == [1, 2, 3, 4]
    LogWriter(small_log.path).close()  # a writer replaces the index
    assert os.path.getsize(small_log.index) == 64 + 4 * 32
    with LogReader(small_log.path) as r:
        assert r.report.index_rebuilt == []
        assert r.report.unindexed_records == 0


@pytest.mark.parametrize(("offset", "indexed"), [
    (0, None), (40, None), (63, None),  # header: magic, first_step, crc -> rebuilt
    (64, 0), (64 + 8, 0), (64 + 24, 0),  # entry 0: step, offset, check word
    (64 + 32 + 16, 1), (64 + 3 * 32 + 31, 3),
])
def test_corrupt_index_is_rebuilt(offset: int, indexed: int | None, small_log: Any,
                                  read_all: Callable[..., Any]) -> None:
    flip(small_log.index, offset, 3)
    with LogReader(small_log.path) as r:
        if indexed is None:
            assert r.report.index_rebuilt == [0]
            assert r.report.unindexed_records == 4
        else:  # the valid prefix is used, the rest scanned
            assert r.report.index_rebuilt == []
            assert r.report.unindexed_records == 4 - indexed
        assert r.report.clean
    assert read_all(small_log.path, small_log) == [1, 2, 3, 4]
    rep = verify_log(str(small_log.path))
    # the active segment's index is a cache a power cut may damage: a note, not corruption
    assert rep.ok
    assert any(small_log.index.name in n and "rebuilt by the next writer open" in n
               for n in rep.notes), rep.notes
    LogWriter(small_log.path).close()
    with LogReader(small_log.path) as r:
        assert r.report.unindexed_records == 0
        assert r.report.index_rebuilt == []
    assert verify_log(str(small_log.path)).ok


def test_index_of_another_log_is_not_trusted(small_log: Any, tmp_path: Path,
                                             read_all: Callable[..., Any]) -> None:
    other = tmp_path / "other"
    with LogWriter(other) as w:
        append(w, [1, 2, 3, 4])
    shutil.copy(other / IDX0, small_log.index)
    with LogReader(small_log.path) as r:
        assert r.report.index_rebuilt == [0]
        assert r.report.unindexed_records == 4
    assert read_all(small_log.path, small_log) == [1, 2, 3, 4]


def test_stale_index_entries_past_a_cut_are_not_reused(small_log: Any) -> None:
    """The index names records 1-4; the segment lost records 3-4. The writer appends a
    large step 3 where record 3 was: the stale entries for 3 and 4 fit inside the segment
    again and must not be trusted over the new record (they were before the fix in
    ``LogWriter._open_existing``: step 3 became unreadable and a phantom step 4 listed)."""
    os.truncate(small_log.segment, small_log.starts[3] + 10)
    big = np.arange(400, dtype="<f4")
    with LogWriter(small_log.path) as w:
        assert w.last_step == 2
        w.append(3, [tensor_input("x", big, "F32")], kind="grad")
    with LogReader(small_log.path) as r:
        assert r.steps.tolist() == [1, 2, 3]
        assert r.record(3).tensor("x").tobytes() == big.tobytes()
        assert r.report.unindexed_records == 0
        assert r.report.torn_tail_bytes == 0
    assert verify_log(str(small_log.path)).ok


# ------------------------------------------------------------------- recovery and report


def test_torn_tail_is_not_an_error(small_log: Any, read_all: Callable[..., Any]) -> None:
    os.unlink(small_log.index)  # the record was never acknowledged: nothing indexes it
    os.truncate(small_log.segment, small_log.ends[4] - 100)
    with LogReader(small_log.path, strict=True) as r:
        assert r.report.clean
        assert r.report.torn_tail_bytes == small_log.ends[4] - 100 - \
            small_log.starts[4]
        assert r.report.corrupt_bytes == 0
    assert read_all(small_log.path, small_log) == [1, 2, 3]
    assert verify_log(str(small_log.path)).ok


def test_flipped_bit_in_an_unindexed_last_record_is_a_torn_tail(small_log: Any) -> None:
    """Spec 8, aside: never acknowledged as durable, so dropping it loses nothing."""
    with open(small_log.index, "r+b") as fh:
        fh.truncate(64 + 3 * 32)  # record 4 not indexed
    flip(small_log.segment, small_log.starts[4] + 200)
    with LogReader(small_log.path) as r:
        assert r.steps.tolist() == [1, 2, 3]
        assert r.report.clean
        assert r.report.torn_tail_bytes == small_log.ends[4] - small_log.starts[4]
    with LogWriter(small_log.path) as w:  # the writer cuts it before appending
        assert w.last_step == 3
    assert os.path.getsize(small_log.segment) == small_log.ends[3]


def test_flipped_bit_in_an_indexed_last_record_is_corruption(small_log: Any) -> None:
    flip(small_log.segment, small_log.starts[4] + 200)
    off4 = small_log.starts[4]
    with LogReader(small_log.path, strict=True) as r:  # the index is trusted on open ...
        assert r.steps.tolist() == [1, 2, 3, 4]
        with pytest.raises(LowdiffError) as ei:  # ... and every record's CRC on read
            r.record(4)
        assert (ei.value.reason, ei.value.offset) == (Reason.CHECKSUM_MISMATCH, off4)
        assert ei.value.path == str(small_log.segment)
    os.unlink(small_log.index)  # without the index nothing says it was durable
    rep = verify_log(str(small_log.path))
    assert rep.ok
    assert rep.torn_tail_bytes == small_log.ends[4] - off4


def _corrupt_record_2(log: Any) -> tuple[int, int]:
    flip(log.segment, log.starts[2] + 100)
    return log.starts[2], log.ends[2] - log.starts[2]


def test_mid_log_corruption_strict_and_tolerant(small_log: Any) -> None:
    off, length = _corrupt_record_2(small_log)
    os.unlink(small_log.index)  # force a scan: the corruption is found on open
    with pytest.raises(LowdiffError) as ei:
        LogReader(small_log.path, strict=True)
    assert (ei.value.reason, ei.value.offset) == (Reason.CHECKSUM_MISMATCH, off)
    assert ei.value.path == str(small_log.segment)
    with LogReader(small_log.path, strict=False) as r:
        assert r.steps.tolist() == [1, 3, 4]  # resynchronized on record 3
        assert not r.report.clean
        assert r.report.corrupt_bytes == length
        assert [(p.reason, p.offset) for p in r.report.problems] == [
            (Reason.CHECKSUM_MISMATCH, off)]
        assert r.report.torn_tail_bytes == 0
        assert r.report.unindexed_records == 3
        assert r.record(3).tensor("g").tobytes() == small_log.tensors[3]["g"].tobytes()
    rep = verify_log(str(small_log.path))
    assert [(p.reason, p.offset) for p in rep.problems] == [(Reason.CHECKSUM_MISMATCH, off)]


def test_writer_refuses_a_log_with_corruption_before_its_tail(small_log: Any) -> None:
    off, _len = _corrupt_record_2(small_log)
    os.unlink(small_log.index)
    with pytest.raises(LowdiffError) as ei:
        LogWriter(small_log.path)
    assert (ei.value.reason, ei.value.offset) == (Reason.CHECKSUM_MISMATCH, off)
    assert os.path.getsize(small_log.segment) == small_log.ends[4]  # nothing cut


def test_writer_trusts_indexed_records_and_verify_finds_them(small_log: Any) -> None:
    """With a valid index the writer does not re-read indexed records (opening costs no
    scan); their CRC is checked when read and by verify."""
    off, _len = _corrupt_record_2(small_log)
    with LogWriter(small_log.path) as w:
        append(w, [5])
    with LogReader(small_log.path) as r:
        with pytest.raises(LowdiffError) as ei:
            r.record(2)
        assert ei.value.reason is Reason.CHECKSUM_MISMATCH
        assert r.record(5).tensor("g").tobytes() == values(5).tobytes()
    rep = verify_log(str(small_log.path))
    assert [(p.reason, p.offset) for p in rep.problems] == [(Reason.CHECKSUM_MISMATCH, off)]


def test_truncated_sealed_segment_is_corruption(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p, segment_bytes=4096) as w:
        append(w, range(1, 9), n=300)
    man = load_manifest(str(p))
    assert len(man.segments) >= 2
    first = p / seg(man.segments[0][0])
    os.unlink(p / idx(man.segments[0][0]))
    os.truncate(first, os.path.getsize(first) - 10)  # a torn tail is only for the last one
    with pytest.raises(LowdiffError) as ei:
        LogReader(p)
    assert ei.value.reason is Reason.TRUNCATED
    assert ei.value.path == str(first)
    with LogReader(p, strict=False) as r:
        assert r.report.corrupt_bytes > 0
        assert r.report.torn_tail_bytes == 0
        assert len(r.report.problems) == 1


def test_missing_segment(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p, segment_bytes=4096) as w:
        append(w, range(1, 9), n=300)
    man = load_manifest(str(p))
    gone = p / seg(man.segments[0][0])
    os.unlink(gone)
    with pytest.raises(LowdiffError) as ei:
        LogReader(p)
    assert ei.value.reason is Reason.MISSING_FILE
    assert ei.value.path == str(gone)
    with LogReader(p, strict=False) as r:
        assert [e.reason for e in r.report.problems] == [Reason.MISSING_FILE]
        assert len(r) > 0
        assert int(r.steps[-1]) == 8
    with pytest.raises(LowdiffError):
        LogWriter(p)


def test_segment_of_another_log_is_refused(small_log: Any, tmp_path: Path) -> None:
    other = tmp_path / "other"
    with LogWriter(other) as w:
        append(w, [1])
    shutil.copy(other / SEG0, small_log.segment)
    os.unlink(small_log.index)
    with pytest.raises(LowdiffError) as ei:
        LogReader(small_log.path)
    assert ei.value.reason is Reason.LOG_ID_MISMATCH
    assert ei.value.path == str(small_log.segment)


def _append_raw(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def test_valid_record_breaking_the_step_order_is_corruption_even_at_the_tail(
        small_log: Any) -> None:
    rec = build_record(2, grad(2), kind="grad")  # a complete, valid record for an old step
    _append_raw(small_log.segment, b"".join(bytes(c) for c in rec.chunks))
    with pytest.raises(LowdiffError) as ei:
        LogReader(small_log.path)
    assert (ei.value.reason, ei.value.offset) == (Reason.STEP_OUT_OF_ORDER,
                                                  small_log.ends[4])
    with LogReader(small_log.path, strict=False) as r:
        assert r.steps.tolist() == [1, 2, 3, 4]
        assert r.report.corrupt_bytes == rec.length
    with pytest.raises(LowdiffError):
        LogWriter(small_log.path)


def test_record_types(small_log: Any) -> None:
    opt = build_record(5, grad(5), kind="grad", type_=200)  # optional: skipped
    _append_raw(small_log.segment, b"".join(bytes(c) for c in opt.chunks))
    diff = build_record(6, grad(6), kind="grad", side={"step": 6})
    _append_raw(small_log.segment, b"".join(bytes(c) for c in diff.chunks))
    with LogReader(small_log.path) as r:
        assert r.steps.tolist() == [1, 2, 3, 4, 6]
        assert r.report.clean
        assert r.record(6).tensor("g").tobytes() == values(6).tobytes()
    unknown = build_record(7, grad(7), kind="grad", type_=7)  # required and unknown
    _append_raw(small_log.segment, b"".join(bytes(c) for c in unknown.chunks))
    with pytest.raises(LowdiffError) as ei:
        LogReader(small_log.path)
    assert ei.value.reason is Reason.UNKNOWN_RECORD_TYPE
    assert RECORD_TYPE_DIFF == 1


def test_record_crc_covers_padding(small_log: Any) -> None:
    """A flipped bit in the zero padding after the metadata fails the record's CRC."""
    data = small_log.segment.read_bytes()
    start = small_log.starts[1]
    meta_end = start + 32 + int.from_bytes(data[start + 12:start + 16], "little")
    assert meta_end % 64
    assert data[meta_end] == 0
    flip(small_log.segment, meta_end)
    with LogReader(small_log.path) as r:
        with pytest.raises(LowdiffError) as ei:
            r.record(1)
        assert ei.value.reason is Reason.CHECKSUM_MISMATCH
    stored = int.from_bytes(data[small_log.starts[1] + 4:small_log.starts[1] + 8], "little")
    assert stored == mask(crc32c(data[small_log.starts[1] + 8:small_log.ends[1]]))


# ------------------------------------------------------------------------ history, gc


def _history_log(p: Path) -> None:
    with LogWriter(p, segment_bytes=4096) as w:
        w.write_base(0, {"w": ("F32", values(0))})
        append(w, range(1, 6), n=300)
        w.write_base(5, {"w": ("F32", values(5))})
        append(w, range(6, 13), n=300)
        w.write_base(12, {"w": ("F32", values(12))})


@pytest.mark.parametrize("keep", [3, 5, 7, 12])
def test_truncate_after_then_append_a_new_history(keep: int, tmp_path: Path) -> None:
    p = tmp_path / "log"
    _history_log(p)
    before = set(os.listdir(p))
    old_segments = load_manifest(str(p)).segments
    with LogWriter(p, segment_bytes=4096) as w:
        dropped = w.truncate_after(keep)
        assert dropped == 12 - keep
        assert w.last_step == keep
        assert w.durable_step == keep
        new = [tensor_input("g", -values(s, 300), "F32") for s in range(keep + 1, keep + 4)]
        for s, t in zip(range(keep + 1, keep + 4), new):
            w.append(s, [t], kind="grad", side={"new": True})
        w.sync()
    man = load_manifest(str(p))
    assert man.bases == [b for b in (0, 5, 12) if b <= keep]
    after = set(os.listdir(p))
    for b in (5, 12):  # dropped bases are deleted
        assert (base_name(b) in after) == (b <= keep)
    live = {s for s, _f in man.segments}
    for s, _f in old_segments:  # dropped segment files are deleted
        assert (seg(s) in after) == (s in live)
        assert (idx(s) in after) == (s in live)
    assert not [n for n in after if n.endswith(".tmp")]
    assert {n for n in after - before if not n.endswith(".lock")} <= \
        {seg(s) for s in live} | {idx(s) for s in live}
    with LogReader(p) as r:
        assert r.steps.tolist() == list(range(1, keep + 4))
        for s in range(1, keep + 1):  # the old history up to keep
            assert r.record(s).tensor("g").tobytes() == values(s, 300).tobytes()
        for s in range(keep + 1, keep + 4):  # then only the new one: no mixed history
            rec = r.record(s)
            assert rec.side == {"new": True}
            assert rec.tensor("g").tobytes() == (-values(s, 300)).tobytes()
        assert r.chain(keep + 3)[1][-1] == keep + 3
        assert r.report.clean
        assert r.report.unindexed_records == 0
    assert verify_log(str(p)).ok


def test_truncate_after_the_last_step_changes_nothing(tmp_path: Path) -> None:
    p = tmp_path / "log"
    _history_log(p)
    before = {n: (p / n).read_bytes() for n in os.listdir(p)}
    with LogWriter(p, segment_bytes=4096) as w:
        assert w.truncate_after(12) == 0
        assert w.truncate_after(100) == 0
    def files(d: dict[str, bytes]) -> dict[str, bytes]:  # lock files hold nothing
        return {n: b for n, b in d.items() if n != "LOCK" and not n.endswith(".lock")}

    assert files({n: (p / n).read_bytes() for n in os.listdir(p)}) == files(before)


def test_truncate_after_everything(tmp_path: Path) -> None:
    p = tmp_path / "log"
    _history_log(p)
    with LogWriter(p, segment_bytes=4096) as w:
        assert w.truncate_after(-1) == 12
        assert w.last_step == -1
        assert w.durable_step is None
        append(w, [1])
    with LogReader(p) as r:
        assert r.steps.tolist() == [1]
        assert r.bases == []


def test_writer_open_collects_garbage(small_log: Any, read_all: Callable[..., Any]) -> None:
    p = small_log.path
    junk = [seg(7), idx(7), base_name(77), "MANIFEST.tmp", base_name(5) + ".tmp",
            seg(1) + ".tmp", "anything.tmp"]
    for name in junk:
        (p / name).write_bytes(b"junk")
    (p / "notes.txt").write_bytes(b"mine")
    live = {n: (p / n).read_bytes() for n in os.listdir(p)}
    LogWriter(p).close()
    left = set(os.listdir(p))
    assert not left & set(junk)
    assert "notes.txt" in left  # not a name the log uses: not touched
    for name in (SEG0, IDX0, "MANIFEST", base_name(0)):
        assert name in left
    assert (p / SEG0).read_bytes() == live[SEG0]
    assert read_all(p, small_log) == [1, 2, 3, 4]


# --------------------------------------------------------------------- failures, faults


class _FailingSegments(AppendFile):
    """Segment appends fail like a full disk once ``armed`` (after writing half)."""

    armed = False

    def _writev(self, fd: int, chunks: Sequence[Any]) -> int:
        if type(self).armed and self.path.endswith(".ldlog"):
            data = b"".join(bytes(c) for c in chunks)
            os.lseek(fd, self.size, os.SEEK_SET)
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return super()._writev(fd, chunks)


@pytest.fixture(params=["writeback", "thread"])
def overlap_small(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> int:
    """Records of 64 KiB and more get their CRC late, as large ones do: after the write,
    while the disk takes the record (``writeback``: Linux ``sync_file_range``), or on the
    helper thread during the write (``thread``: where that hint is unavailable)."""
    from lowdiff_store.log import writer as writer_mod
    from lowdiff_store.storage import local as local_mod

    monkeypatch.setattr(writer_mod, "OVERLAP_CRC_BYTES", 1 << 16)
    monkeypatch.setattr(writer_mod, "WRITEBACK_CRC_BYTES", 1 << 16)
    monkeypatch.setattr(writer_mod, "WRITEBACK_RUN_BYTES", 4 * mmap.PAGESIZE)
    if request.param == "thread":
        monkeypatch.setattr(local_mod, "_sync_file_range", None)
    elif not AppendFile.can_start_writeback():
        pytest.skip("sync_file_range is Linux-only")
    return 1 << 16


@pytest.mark.parametrize("n", [1000, 30_000])  # the second one has its CRC overlapped
@pytest.mark.usefixtures("overlap_small")
def test_full_disk_fails_the_writer_and_durable_steps_stay_readable(n: int, tmp_path: Path
                                                                     ) -> None:
    p = tmp_path / "log"
    w = LogWriter(p, file_factory=_FailingSegments)
    try:
        w.write_base(0, {"w": ("F32", values(0))})
        append(w, [1, 2])
        end2 = os.path.getsize(p / SEG0)
        _FailingSegments.armed = True
        with pytest.raises(StorageError) as ei:
            w.append(3, grad(3, n), kind="grad")
        assert ei.value.errno == errno.ENOSPC
        assert ei.value.path == str(p / SEG0)
        assert w.durable_step == 2
        assert w.last_step == 2
        assert os.path.getsize(p / SEG0) > end2  # half a record: a torn tail
        _FailingSegments.armed = False
        # writing after the torn bytes would bury them mid-log (and lose what follows on
        # the next open): the writer refuses until the log is reopened
        for call in (lambda: w.append(3, grad(3, n), kind="grad"), w.sync,
                     lambda: w.write_records([build_record(3, grad(3), kind="grad")]),
                     lambda: w.write_base(3, {"w": ("F32", values(3))})):
            with pytest.raises(LowdiffError) as ei2:
                call()
            assert ei2.value.reason is Reason.WRITER_FAILED
            assert "No space left" in str(ei2.value)  # names the first failure
        assert w.durable_step == 2
    finally:
        _FailingSegments.armed = False
        w.close()  # quietly: no sync of a failed writer
    with LogReader(p) as r:
        assert r.steps.tolist() == [1, 2]
        assert r.report.clean
        assert r.report.torn_tail_bytes == os.path.getsize(p / SEG0) - end2
    with LogWriter(p) as w2:  # the torn tail is cut; appending goes on
        assert w2.last_step == 2
        append(w2, [3], n=n)
    with LogReader(p) as r:
        assert r.steps.tolist() == [1, 2, 3]
        assert r.record(3).tensor("g").tobytes() == values(3, n).tobytes()
        assert r.report.torn_tail_bytes == 0
        assert r.report.unindexed_records == 0
    assert verify_log(str(p)).ok


class _FailingSync(AppendFile):
    armed = False

    def _sync(self, fd: int) -> None:
        if type(self).armed and self.path.endswith(".ldlog"):
            raise OSError(errno.EIO, "Input/output error")
        super()._sync(fd)


def test_failed_fdatasync_fails_the_writer(tmp_path: Path) -> None:
    p = tmp_path / "log"
    w = LogWriter(p, file_factory=_FailingSync)
    try:
        append(w, [1, 2])
        append(w, [3], sync=False)
        _FailingSync.armed = True
        with pytest.raises(StorageError) as ei:
            w.sync()
        assert ei.value.errno == errno.EIO
        _FailingSync.armed = False
        assert w.durable_step == 2  # step 3 is never reported durable
        for call in (w.sync, lambda: w.append(4, grad(4), kind="grad"),
                     lambda: w.write_records([build_record(4, grad(4), kind="grad")])):
            with pytest.raises(LowdiffError) as ei2:
                call()
            assert ei2.value.reason is Reason.WRITER_FAILED
        assert w.durable_step == 2
    finally:
        _FailingSync.armed = False
        w.close()  # no sync attempted on a failed writer
    with LogWriter(p) as w2:  # reopening goes on from what is on disk
        assert w2.last_step in (2, 3)  # 3 if its bytes reached the disk after all
        append(w2, [w2.last_step + 1])


class _CountWriteback(AppendFile):
    ranges: ClassVar[list[tuple[int, int]]] = []

    def start_writeback(self, offset: int, n: int) -> bool:
        type(self).ranges.append((offset, n))
        return super().start_writeback(offset, n)


def test_large_records_have_their_crc_computed_late(tmp_path: Path, overlap_small: int
                                                    ) -> None:
    p = tmp_path / "log"
    n = overlap_small // 4 + 10
    _CountWriteback.ranges = []
    with LogWriter(p, file_factory=_CountWriteback) as w:
        w.write_base(0, {"w": ("F32", values(0))})
        append(w, [1], n=n)
        if AppendFile.can_start_writeback():  # streamed: the disk took each run in turn
            assert w._crc_pool is None
            ranges = _CountWriteback.ranges
            start = FILE_HEADER_SIZE
            run = 4 * mmap.PAGESIZE
            assert len(ranges) == -(-(start + w.stats["bytes"]) // run)  # one per run
            assert ranges[0][0] == start + 64  # the record's first 64 bytes stay dirty
            for (off, ln), (nxt, _n) in itertools.pairwise(ranges):
                assert off + ln == nxt          # contiguous, in order,
                assert nxt % run == 0           # cut at the run boundaries of the file
            assert sum(ranges[-1]) == start + w.stats["bytes"]  # up to the record's end
        else:
            assert w._crc_pool is not None  # the helper thread was used
            assert _CountWriteback.ranges == []
        append(w, [2], n=16)
        append(w, [3, 4], n=n)
    with LogReader(p) as r:
        for s, size in ((1, n), (2, 16), (3, n), (4, n)):
            assert r.record(s).tensor("g").tobytes() == values(s, size).tobytes()
    assert verify_log(str(p)).ok
    data = (p / SEG0).read_bytes()
    for _s, (_path, off, ln) in locations(p).items():
        stored = int.from_bytes(data[off + 4:off + 8], "little")
        assert stored == mask(crc32c(data[off + 8:off + ln]))


@given(st.lists(st.binary(max_size=40), max_size=8), st.integers(0, 100), st.integers(1, 24))
def test_runs_cut_a_write_at_the_file_offsets_of_each_run(chunks: list[bytes], offset: int,
                                                          run: int) -> None:
    """A streamed write's pieces: together exactly the bytes, in order, none empty, each
    at its file offset, every one but the last ending at a multiple of ``run``, none
    crossing one."""
    pieces = list(_runs(chunks, offset, run))
    data = b"".join(chunks)
    assert b"".join(bytes(v) for _o, views in pieces for v in views) == data
    pos = offset
    for i, (off, views) in enumerate(pieces):
        n = sum(v.nbytes for v in views)
        assert off == pos
        assert n > 0
        assert (off + n) // run - off // run <= 1
        if i < len(pieces) - 1:
            assert (off + n) % run == 0
        pos += n
    assert pos == offset + len(data)


def test_a_streamed_write_takes_at_most_writeback_runs_runs() -> None:
    """Small writes go out in runs of WRITEBACK_RUN_BYTES; a large one in runs doubled until
    it takes at most WRITEBACK_RUNS of them (each run costs the filesystem work beside
    training), always a whole number of pages."""
    from lowdiff_store.log.writer import WRITEBACK_RUN_BYTES, WRITEBACK_RUNS, writeback_run_bytes

    assert writeback_run_bytes(1 << 20) == WRITEBACK_RUN_BYTES
    assert writeback_run_bytes(WRITEBACK_RUN_BYTES * WRITEBACK_RUNS) == WRITEBACK_RUN_BYTES
    assert writeback_run_bytes(WRITEBACK_RUN_BYTES * WRITEBACK_RUNS + 1) == \
        2 * WRITEBACK_RUN_BYTES
    for total in (82_083_328, 64 << 20, 3 << 30):
        run = writeback_run_bytes(total)
        assert run % mmap.PAGESIZE == 0
        assert -(-total // run) <= WRITEBACK_RUNS
        assert -(-total // (run // 2)) > WRITEBACK_RUNS  # the smallest run that does it


def test_group_commits_are_streamed_too(tmp_path: Path, overlap_small: int) -> None:
    """write_records (the asynchronous writer's group commit) streams a large group: the
    records, CRCs already in place, go out in runs, each handed to the disk, cut at the
    file's run boundaries; the log reads back bit for bit."""
    if not AppendFile.can_start_writeback():
        pytest.skip("sync_file_range is Linux-only")
    p = tmp_path / "log"
    n = overlap_small // 8 + 10  # two records make one group of more than 64 KiB
    _CountWriteback.ranges = []
    with LogWriter(p, file_factory=_CountWriteback) as w:
        w.write_records([build_record(s, grad(s, n), kind="grad", side={"step": s})
                         for s in (1, 2)])
        w.sync()
        ranges = _CountWriteback.ranges
        run = 4 * mmap.PAGESIZE
        assert len(ranges) == -(-(FILE_HEADER_SIZE + w.stats["bytes"]) // run)
        assert ranges[0][0] == FILE_HEADER_SIZE
        for (off, ln), (nxt, _n) in itertools.pairwise(ranges):
            assert off + ln == nxt
            assert nxt % run == 0
        assert sum(ranges[-1]) == FILE_HEADER_SIZE + w.stats["bytes"]
        assert w.stats["writes"] == 1
    check_steps(p, [1, 2], n=n)
    assert verify_log(str(p)).ok


class _InterruptAtRun(AppendFile):
    """KeyboardInterrupt at the ``at``-th write of a segment file after ``armed``."""

    armed = False
    seen = 0
    at = 3

    def _writev(self, fd: int, chunks: Sequence[Any]) -> int:
        if type(self).armed and self.path.endswith(".ldlog"):
            type(self).seen += 1
            if type(self).seen == type(self).at:
                raise KeyboardInterrupt
        return super()._writev(fd, chunks)


def test_a_streamed_write_interrupted_between_runs_fails_the_writer(
        tmp_path: Path, overlap_small: int) -> None:
    """Something other than an I/O error (a KeyboardInterrupt) stopping a streamed record
    between two runs (or, without the writeback hint, a record's one write) leaves part
    of it in the file or none: the writer is failed as after an I/O error, so nothing is
    ever appended after torn bytes, and the next open cuts them; every acknowledged step
    stays."""
    p = tmp_path / "log"
    n = overlap_small // 4 + 10
    w = LogWriter(p, file_factory=_InterruptAtRun)
    try:
        append(w, [1], n=n)
        _InterruptAtRun.at = 3 if AppendFile.can_start_writeback() else 1
        _InterruptAtRun.armed, _InterruptAtRun.seen = True, 0
        with pytest.raises(KeyboardInterrupt):
            w.append(2, grad(2, n), kind="grad")
        _InterruptAtRun.armed = False
        with pytest.raises(LowdiffError) as ei:
            w.append(3, grad(3, n), kind="grad")
        assert ei.value.reason is Reason.WRITER_FAILED
        assert "interrupted" in str(ei.value)
        assert w.durable_step == 1
    finally:
        _InterruptAtRun.armed = False
        w.close()
    with LogWriter(p) as w2:  # the torn record is cut; appending goes on
        assert w2.last_step == 1
        append(w2, [2, 3], n=n)
    check_steps(p, [1, 2, 3], n=n)
    assert verify_log(str(p)).ok


class _NoCrcFill(AppendFile):
    def rewrite_unsynced(self, offset: int, data: Any) -> None:
        if not self.path.endswith(".ldlog"):  # the index writes its entries this way too
            return super().rewrite_unsynced(offset, data)
        raise StorageError("pwrite failed", path=self.path, offset=offset)


def test_record_whose_crc_could_not_be_stored_is_a_torn_tail(tmp_path: Path,
                                                             overlap_small: int) -> None:
    p = tmp_path / "log"
    n = overlap_small // 4
    w = LogWriter(p, file_factory=_NoCrcFill)
    try:
        append(w, [1])
        size = os.path.getsize(p / SEG0)
        with pytest.raises(StorageError):
            w.append(2, grad(2, n), kind="grad")
        data = (p / SEG0).read_bytes()
        assert len(data) > size
        # the record's first 64 bytes (header, CRC) are written last: never, here
        assert data[size:size + 64] == bytes(64)
        assert data[size + 64:] != bytes(len(data) - size - 64)
    finally:
        w.close()
    with LogReader(p) as r:
        assert r.steps.tolist() == [1]
        assert r.report.torn_tail_bytes == len(data) - size
    with LogWriter(p) as w2:
        append(w2, [2])
    check_steps(p, [1, 2])


def test_start_writeback_hands_over_whole_pages_only(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the whole pages of the range go to the disk: not the page holding its start
    (the log writer rewrites a record's first bytes there), nor the one holding its end
    (the next append writes into it)."""
    from lowdiff_store.storage import local as local_mod

    page = mmap.PAGESIZE
    f = AppendFile(str(tmp_path / "A"), create=True)
    try:
        f.append([bytes(3 * page)])
        if not AppendFile.can_start_writeback():
            assert not f.start_writeback(0, f.size)
            return
        calls: list[tuple[int, int]] = []
        real = local_mod._sync_file_range
        assert real is not None

        def spy(fd: int, off: int, n: int, flags: int) -> int:
            calls.append((off, n))
            return real(fd, off, n, flags)

        monkeypatch.setattr(local_mod, "_sync_file_range", spy)
        assert f.start_writeback(0, f.size)                  # all three pages
        assert f.start_writeback(100, 2 * page)              # the second page only
        assert f.start_writeback(page, 2 * page - 1)         # the second page only
        assert not f.start_writeback(100, 200)               # inside the first page
        assert not f.start_writeback(page + 1, page - 1)     # up to a boundary: no whole page
        assert not f.start_writeback(page - 10, page + 5)    # holds no whole page
        assert calls == [(0, 3 * page), (page, page), (page, page)]
    finally:
        f.close()
    assert not f.start_writeback(0, 3 * page)  # closed


def test_rewrite_unsynced_never_touches_durable_bytes(tmp_path: Path) -> None:
    f = AppendFile(str(tmp_path / "A"), create=True)
    f.append([b"durable!"])
    f.sync()
    f.append([b"pending!"])
    f.rewrite_unsynced(8, b"PEND")
    for off, data in ((4, b"xx"), (7, b"xx"), (14, b"xxx"), (16, b"x")):
        with pytest.raises(StorageError):
            f.rewrite_unsynced(off, data)
    f.close()
    assert (tmp_path / "A").read_bytes() == b"durable!PENDing!"


def test_read_views_are_zero_copy_and_aligned(small_log: Any) -> None:
    with LogReader(small_log.path, mode="mmap") as r:
        t = r.record(1).tensor("g")
        assert not t.flags.writeable
        assert t.ctypes.data % 64 == 0
        assert t.base is not None  # a view of the map, not a copy
    with LogReader(small_log.path, mode="pread") as r:
        assert r.record(1).tensor("g").tobytes() == small_log.tensors[1]["g"].tobytes()


def test_record_accessors(small_log: Any) -> None:
    with LogReader(small_log.path) as r:
        rec = r.record(4)
        assert rec.kind == "weight"
        assert rec.side == {"scale": 65536.0}
        assert rec.names == ["g", "h"]
        assert [e.name for e in rec.entries] == ["g", "h"]
        assert rec.entry("h").codec == "sparse"
        assert any(p.zstd is not None for p in rec.entry("h").parts)
        assert rec.length == small_log.ends[4] - small_log.starts[4]
        with pytest.raises(LowdiffError) as ei:
            rec.entry("nope")
        assert ei.value.reason is Reason.INVALID_ARGUMENT
        assert len(rec.parts("h")) == 2
    with BaseFile(str(small_log.base_file)) as b:
        b.verify_all()
        assert b.step == 0
        assert b.nbytes == os.path.getsize(small_log.base_file)


# ------------------------------------------------------------------ base file checks


def _base_file(tmp_path: Path, header: dict[str, Any] | None = None, data: bytes | None = None,
               fix_crc: bool = True) -> Path:
    """A base whose JSON header is ``header`` (default: a valid one), CRC recomputed."""
    import json
    import struct

    if header is None:
        header = _valid_base_header()
    raw = json.dumps(header, separators=(",", ":")).encode()
    prefix = struct.pack("<Q", len(raw))
    if fix_crc:
        crc = crc32c(prefix + raw)
        raw = raw.replace(b'"header_crc32c":"00000000"', b'"header_crc32c":"%08x"' % crc)
    p = tmp_path / "b.safetensors"
    p.write_bytes(prefix + raw + (_BASE_DATA if data is None else data))
    return p


_W = np.array([1, 2, 3, 4], "<f4").tobytes()
_META = b"\x80"  # msgpack {}
_BASE_DATA = _W + bytes(48) + _META


def _valid_base_header() -> dict[str, Any]:
    import json

    return {"__metadata__": {"format": "lowdiff-base", "format_version": "1.0", "step": "7",
                             "log_id": "00" * 16,
                             "crc32c": json.dumps({"w": f"{crc32c(_W):08x}",
                                                   "__lowdiff__.meta": f"{crc32c(_META):08x}"}),
                             "header_crc32c": "00000000"},
            "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "__lowdiff__.pad.0": {"dtype": "U8", "shape": [48], "data_offsets": [16, 64]},
            "__lowdiff__.meta": {"dtype": "U8", "shape": [1], "data_offsets": [64, 65]}}


def test_base_file_hand_made_is_valid(tmp_path: Path) -> None:
    with BaseFile(str(_base_file(tmp_path))) as b:
        b.verify_all()
        assert (b.step, b.log_id, b.names, b.meta()) == (7, bytes(16), ["w"], {})
        assert b.tensor("w").tolist() == [[1, 2], [3, 4]]


def _edit(**changes: Any) -> dict[str, Any]:
    h = _valid_base_header()
    alias = {"md": "__metadata__", "pad": "__lowdiff__.pad.0", "meta": "__lowdiff__.meta"}
    for path, value in changes.items():
        keys = [alias.get(k, k) for k in path.split("__")]
        d = h
        for k in keys[:-1]:
            d = d[k]
        if value is _DELETE:
            del d[keys[-1]]
        else:
            d[keys[-1]] = value
    return h


_DELETE = object()

_BAD_BASES: list[tuple[str, dict[str, Any], str]] = [
    ("future major", _edit(md__format_version="2.0"), "unsupported_format_version"),
    ("bad version", _edit(md__format_version="1"), "bad_metadata"),
    ("no step", _edit(md__step=_DELETE), "bad_metadata"),
    ("bad step", _edit(md__step="seven"), "bad_metadata"),
    ("bad log id", _edit(md__log_id="zz"), "bad_metadata"),
    ("crc map not json", _edit(md__crc32c="{"), "bad_metadata"),
    ("crc map not a map", _edit(md__crc32c="[1]"), "bad_metadata"),
    ("crc not hex", _edit(md__crc32c='{"w":"xyz","__lowdiff__.meta":"0"}'), "bad_metadata"),
    ("unknown dtype", _edit(w__dtype="F31"), "bad_dtype"),
    ("list dtype", _edit(w__dtype=["F32"]), "bad_dtype"),
    ("map dtype", _edit(w__dtype={"F32": 1}), "bad_dtype"),
    ("entry not a map", _edit(w=[1]), "bad_metadata"),
    ("shape not a list", _edit(w__shape=4), "bad_metadata"),
    ("negative dim", _edit(w__shape=[-2, -2]), "bad_metadata"),
    ("rank 33", _edit(w__shape=[1] * 33), "bad_metadata"),
    ("too many elements", _edit(w__shape=[2**30, 2**30]), "limit_exceeded"),
    ("offsets reversed", _edit(w__data_offsets=[16, 0]), "out_of_bounds"),
    ("offsets not ints", _edit(w__data_offsets=[0.0, 16]), "out_of_bounds"),
    ("three offsets", _edit(w__data_offsets=[0, 8, 16]), "out_of_bounds"),
    ("size vs shape", _edit(w__shape=[2, 3]), "bad_record_length"),
    ("past the end", _edit(meta__data_offsets=[64, 66], meta__shape=[2]), "truncated"),
    ("gap", _edit(pad__data_offsets=[17, 64], pad__shape=[47]), "out_of_bounds"),
    ("no crc for a tensor", _edit(md__crc32c="{}"), "bad_metadata"),
    ("no meta tensor", _edit(meta=_DELETE, pad__data_offsets=[16, 65], pad__shape=[49]),
     "bad_metadata"),
    ("no metadata", {k: v for k, v in _valid_base_header().items() if k != "__metadata__"},
     "bad_magic"),
]


@pytest.mark.parametrize(("header", "reason"), [(h, r) for _n, h, r in _BAD_BASES],
                         ids=[n for n, _h, _r in _BAD_BASES])
def test_base_file_reason_codes(header: dict[str, Any], reason: str, tmp_path: Path) -> None:
    p = _base_file(tmp_path, header)
    with pytest.raises(LowdiffError) as ei:
        BaseFile(str(p))
    assert ei.value.reason.value == reason
    assert ei.value.path == str(p)
    assert ei.value.offset is not None


def test_base_file_name_that_is_not_utf8(tmp_path: Path) -> None:
    h = _valid_base_header()
    h["\ud800"] = h.pop("w")  # JSON can spell a lone surrogate
    h["__metadata__"]["crc32c"] = h["__metadata__"]["crc32c"].replace('"w"', '"\\ud800"')
    with pytest.raises(LowdiffError) as ei:
        BaseFile(str(_base_file(tmp_path, h)))
    assert ei.value.reason is Reason.UNSAFE_NAME


def test_base_file_framing_errors(tmp_path: Path) -> None:
    good = _base_file(tmp_path).read_bytes()
    cases = [
        (good[:7], "truncated", 0),
        ((200 << 20).to_bytes(8, "little") + good[8:], "metadata_too_large", 0),
        ((len(good)).to_bytes(8, "little") + good[8:], "truncated", 0),
        (good[:8] + b'{"__metadata__":{"format":"safetensors"' + good[47:], "bad_magic", 8),
        (good[:60] + bytes([good[60] ^ 1]) + good[61:], "checksum_mismatch", 8),
    ]
    for data, reason, offset in cases:
        p = tmp_path / "c.safetensors"
        p.write_bytes(data)
        with pytest.raises(LowdiffError) as ei:
            BaseFile(str(p))
        assert (ei.value.reason.value, ei.value.offset) == (reason, offset), reason
    p = _base_file(tmp_path, fix_crc=False)  # the placeholder is not the CRC
    with pytest.raises(LowdiffError) as ei:
        BaseFile(str(p))
    assert ei.value.reason is Reason.CHECKSUM_MISMATCH


def test_base_file_tensor_checksum_is_checked_on_read(tmp_path: Path) -> None:
    data = bytearray(_BASE_DATA)
    data[5] ^= 0x10
    p = _base_file(tmp_path, data=bytes(data))
    with BaseFile(str(p)) as b:  # the header is fine
        with pytest.raises(LowdiffError) as ei:
            b.tensor("w")
        assert ei.value.reason is Reason.CHECKSUM_MISMATCH
        assert ei.value.offset == os.path.getsize(p) - len(_BASE_DATA)
        assert b.tensor("w", verify=False).reshape(-1)[1] != 2  # what verify=False gives
        with pytest.raises(LowdiffError):
            b.verify_all()
        assert b.meta() == {}


def test_crash_during_first_create_is_recovered(tmp_path: Any) -> None:
    """Segment 0 created, manifest never published: the next writer starts afresh."""
    import numpy as np

    from lowdiff_store import LogReader, LogWriter, tensor_input

    d = tmp_path / "log"
    with LogWriter(d) as w:
        pass
    (d / "MANIFEST").unlink()  # as if the crash came before the first publish
    assert (d / "seg-0000000000000000.ldlog").stat().st_size == 64
    with LogWriter(d) as w:
        w.write_base(0, {"w": ("F32", np.zeros(4, np.float32))})
        w.append(1, [tensor_input("w", np.ones(4, np.float32), "F32")], kind="weight")
    with LogReader(d) as r:
        assert list(r.steps) == [1]
        assert r.record(1).tensor("w").tolist() == [1.0, 1.0, 1.0, 1.0]


def test_index_entries_in_plain_integers_are_the_numpy_bytes() -> None:
    from lowdiff_store.log.index import entry_bytes, make_entries

    rng = np.random.default_rng(5)
    top = (1 << 64) - 1
    cases = [[], [(0, 0, 0)], [(top, top, top)], [(1, 64, 128), (2, 192, 4096)]]
    cases += [[tuple(int(v) for v in rng.integers(0, 1 << 63, 3, dtype=np.uint64))
               for _ in range(int(rng.integers(1, 5)))] for _ in range(200)]
    for i, refs in enumerate(cases):
        log_id = bytes(rng.integers(0, 256, 16, dtype=np.uint8))
        sid = int(rng.integers(0, 1 << 40)) if i else top >> 1
        assert entry_bytes(refs, sid, log_id) == make_entries(refs, sid, log_id).tobytes()


def test_a_roll_that_fails_fails_the_writer_and_keeps_what_was_durable(
        tmp_path: Path) -> None:
    """A storage error while sealing the active segment (a roll) fails the writer with one
    clear error on the next append; reopening the log finds every synced step."""
    from lowdiff_store.errors import StorageError

    p = tmp_path / "log"
    w = LogWriter(p, segment_bytes=4096)
    append(w, range(1, 4), n=256)
    calls = {"n": 0}

    def broken_seal() -> None:
        calls["n"] += 1
        raise StorageError("fsync failed (injected)", reason=Reason.IO_ERROR, path=str(p))

    w._idx.file.seal = broken_seal  # type: ignore[method-assign]
    big = [tensor_input("g", values(10, 2048), "F32")]  # does not fit: a roll
    with pytest.raises(StorageError, match="injected"):
        w.append(10, big, kind="grad")
    assert calls["n"] == 1
    with pytest.raises(LowdiffError, match="writer failed earlier"):
        w.append(11, grad(11), kind="grad")
    w.abandon()
    with LogReader(p) as r:
        assert [s for s in range(1, 12) if r.has_step(s)] == [1, 2, 3]
        assert r.record(3).tensor("g").tolist() == values(3, 256).tolist()


IDX0 = "seg-0000000000000000.ldidx"


def _index_steps(p: Path, sid: int) -> list[int]:
    from lowdiff_store.log.index import load_index
    from lowdiff_store.storage import LocalStore

    name = f"seg-{sid:016d}.ldidx"
    with LogReader(p) as r:
        log_id = r.log_id
    ents = load_index(LocalStore(str(p)), name, sid, log_id, 1 << 30)
    assert ents is not None
    return [int(e["step"]) for e in ents]


def test_index_reserve_left_by_a_crash_reads_and_verifies_clean(tmp_path: Path) -> None:
    """Index entries go into zeros reserved ahead of them; a writer that dies leaves the
    reserve behind: readers take the valid prefix, verify says nothing of it, and the next
    writer republishes the index with exactly one entry per record."""
    from lowdiff_store.log.index import RESERVE_BYTES

    p = tmp_path / "log"
    w = LogWriter(p)
    append(w, range(1, 6))
    w.abandon()  # as a SIGKILL: nothing closed cleanly
    assert (p / IDX0).stat().st_size == FILE_HEADER_SIZE + RESERVE_BYTES
    assert _index_steps(p, 0) == [1, 2, 3, 4, 5]
    with LogReader(p) as r:
        assert r.steps.tolist() == [1, 2, 3, 4, 5]
        assert r.report.unindexed_records == 0  # nothing scanned: the index covers all
    rep = verify_log(str(p))
    assert rep.ok
    assert not [n for n in rep.notes if "ldidx" in n], rep.notes
    with LogWriter(p) as w2:
        assert (p / IDX0).stat().st_size == FILE_HEADER_SIZE + 32 * 5  # republished
        append(w2, [6, 7])
    assert (p / IDX0).stat().st_size == FILE_HEADER_SIZE + 32 * 7
    assert _index_steps(p, 0) == list(range(1, 8))
    check_steps(p, list(range(1, 8)))


def test_index_grows_past_its_reserve_and_a_roll_seals_it_exact(tmp_path: Path) -> None:
    from lowdiff_store.log import index as index_mod

    p = tmp_path / "log"
    with LogWriter(p, segment_bytes=1 << 16) as w:
        index_mod.RESERVE_BYTES = 64  # two entries per growth
        try:
            append(w, range(1, 8))  # 7 entries: the reserve grows 4 times
            assert (p / IDX0).stat().st_size == FILE_HEADER_SIZE + 64 * 4
            assert _index_steps(p, 0) == list(range(1, 8))
            append(w, range(8, 400))  # rolls: segment 0's index is sealed
        finally:
            index_mod.RESERVE_BYTES = 64 << 10
        with LogReader(p) as r:
            segs = sorted({int(sid) for sid in r.record_table()[:, 1]})
        assert len(segs) > 1
    for sid in segs:
        name = f"seg-{sid:016d}.ldidx"
        steps = _index_steps(p, sid)
        assert (p / name).stat().st_size == FILE_HEADER_SIZE + 32 * len(steps)
    assert sum(len(_index_steps(p, s)) for s in segs) == 399
    assert verify_log(str(p)).ok


def test_verify_still_reports_garbage_after_an_index(tmp_path: Path) -> None:
    p = tmp_path / "log"
    with LogWriter(p, segment_bytes=1 << 16) as w:
        append(w, range(1, 700))
    with LogReader(p) as r:
        assert r.record_table()[-1, 1] > 0  # segment 0 is sealed
    with open(p / IDX0, "ab") as f:  # a sealed index with zeros after its entries
        f.write(bytes(64))
    rep = verify_log(str(p))
    assert not rep.ok
    assert any(e.reason is Reason.INDEX_STALE for e in rep.problems)
    last = max(int(n[4:20]) for n in os.listdir(p) if n.endswith(".ldidx"))
    active = p / f"seg-{last:016d}.ldidx"
    (p / IDX0).write_bytes((p / IDX0).read_bytes()[:-64])
    with open(active, "ab") as f:  # the active index: zeros are the reserve, garbage is not
        f.write(bytes(96))
    rep = verify_log(str(p))
    assert rep.ok
    assert not [n for n in rep.notes if "ldidx" in n], rep.notes
    with open(active, "ab") as f:
        f.write(b"\x01" + bytes(31))
    rep = verify_log(str(p))
    assert rep.ok
    assert [n for n in rep.notes if "inconsistent" in n], rep.notes


class _IndexFull(AppendFile):
    full = False

    def rewrite_unsynced(self, offset: int, data: Any) -> None:
        if self.path.endswith(".ldidx") and _IndexFull.full:
            raise StorageError("write failed: No space left on device (errno 28)",
                               path=self.path, offset=offset)
        super().rewrite_unsynced(offset, data)


def test_index_write_failing_after_a_sync_keeps_the_durable_step(tmp_path: Path) -> None:
    """The records were made durable, then the index entry could not be written (a full
    disk): durable_step still names them, the writer stops (its index would be one entry
    short), and the next open finds every durable step and rebuilds the index."""
    p = tmp_path / "log"
    _IndexFull.full = False
    w = LogWriter(p, file_factory=_IndexFull)
    try:
        append(w, [1, 2])
        _IndexFull.full = True
        append(w, [3], sync=False)
        with pytest.raises(StorageError):
            w.sync()
        assert w.durable_step == 3
        with pytest.raises(LowdiffError) as ei:
            w.append(4, grad(4), kind="grad")
        assert ei.value.reason is Reason.WRITER_FAILED
    finally:
        _IndexFull.full = False
        w.abandon()
    with LogWriter(p) as w2:
        assert (p / IDX0).stat().st_size == FILE_HEADER_SIZE + 32 * 3  # rebuilt, exact
        append(w2, [4])
    check_steps(p, [1, 2, 3, 4])
    assert _index_steps(p, 0) == [1, 2, 3, 4]
