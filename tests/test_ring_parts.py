"""Bases through the writer process in pieces (format_spec/ring.md, section 3.2): a base
larger than half the ring goes as PART messages the writer process assembles, so a ring
sized for the steps carries a base of any size; a base cut short is never published, and
pieces out of order or miscounted are a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from lowdiff_store import LogReader
from lowdiff_store.errors import FormatError, Reason
from lowdiff_store.writer import AsyncLogWriter
from lowdiff_store.writer.ring import (
    Kind,
    Op,
    Ring,
    layout_base,
    layout_part,
    read_message,
    write_message,
)
from lowdiff_store.writer.ring_client import RingClient
from tests.helpers.ring_writer import zombie_or_gone
from tests.helpers.timing import scaled


def _base(seed: int) -> dict[str, tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        "big": ("F32", rng.standard_normal(3000).astype(np.float32)),  # 12 KB: cut
        "bf": ("BF16", rng.integers(0, 1 << 16, (7, 9)).astype(np.uint16)),
        "scalar": ("F64", np.array(seed / 7, np.float64)),  # 0-d
        "empty": ("I32", np.zeros((0, 3), np.int32)),
        "mid": ("U8", rng.integers(0, 256, 5000).astype(np.uint8)),
        "i64": ("I64", np.arange(seed, seed + 333, dtype=np.int64).reshape(3, 111)),
    }


def _assert_base(reader: LogReader, step: int, want: dict[str, tuple[str, np.ndarray]],
                 meta: dict[str, int]) -> None:
    b = reader.base(step)
    assert sorted(b.names) == sorted(want)
    for n, (tag, a) in want.items():
        assert b.info(n) == (tag, a.shape)
        got = b.tensor(n)
        assert got.shape == a.shape
        assert got.tobytes() == a.tobytes()
    assert {k: b.meta()[k] for k in meta} == meta


def test_a_base_larger_than_half_the_ring_goes_in_parts_and_reads_back_bitwise(
        tmp_path: Path) -> None:
    small = {"w": ("F32", np.arange(6, dtype=np.float32))}
    with AsyncLogWriter(tmp_path / "direct") as w:
        for s in range(1, 9):
            w.append(s, [], kind="grad")
            if s == 2:
                w.write_base(2, _base(2), {"b": 2})
            if s == 5:
                w.write_base(5, small, {"b": 5})
            if s == 7:
                w.write_base(7, _base(7), {"b": 7})
    # 4 slots of 4 KiB: a message takes at most 2 (8 KiB); each large base is ~20 KB
    with RingClient(tmp_path / "ring", slots=4, slot_size=4096) as c:
        assert c.part_slots == 2
        for s in range(1, 9):
            c.put_step(s, "grad", [])
            if s == 2:
                c.put_base(2, _base(2), {"b": 2})
                parts_2 = c.stats()["base_parts"]
            if s == 5:
                c.put_base(5, small, {"b": 5})
                assert c.stats()["base_parts"] == parts_2  # whole: one BASE message
            if s == 7:
                c.put_base(7, _base(7), {"b": 7})
        assert c.flush() == 8
        stats = c.stats()
    size = sum(a.nbytes for _t, a in _base(2).values())  # (19.8 KB)
    assert parts_2 >= -(-size // 8192)  # in messages of at most 8 KiB
    assert stats["base_parts"] == 2 * parts_2
    assert stats["bases"] == 3
    with LogReader(tmp_path / "direct") as a, LogReader(tmp_path / "ring") as b:
        assert a.bases == b.bases == [2, 5, 7]
        for step in (2, 7):
            _assert_base(b, step, _base(step), {"b": step})
            for n in _base(step):  # the same bits as the base written in this process
                assert a.base(step).tensor(n).tobytes() == b.base(step).tensor(n).tobytes()
        _assert_base(b, 5, small, {"b": 5})
        assert b.base_for(8) == 7


def test_a_base_whose_tensor_is_larger_than_the_ring_passes_through_it(
        tmp_path: Path) -> None:
    huge = np.random.default_rng(3).standard_normal(100_000).astype(np.float32)  # 400 KB
    with RingClient(tmp_path / "log", slots=2, slot_size=4096) as c:  # 8 KiB in all
        c.put_step(1, "grad", [])
        c.put_base(1, {"huge": ("F32", huge)}, {"b": 1})
        assert c.flush() == 1
        assert c.stats()["base_parts"] >= 100
    with LogReader(tmp_path / "log") as r:
        assert r.base(1).tensor("huge").tobytes() == huge.tobytes()


_KILLED = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from lowdiff_store.writer import ring_client as RC
    c = RC.RingClient(sys.argv[1], slots=4, slot_size=4096)
    for s in range(1, 4):
        c.put_step(s, "grad", [("w", "I64", (2,), np.array([s, s]))])
    c.put_base(3, {"w": ("F32", np.ones(4, np.float32))}, {"b": 3})
    c.flush()
    print(c.pid, flush=True)
    sent = [0]
    real = RC.layout_part
    def part(step, pieces, *rest):  # the producer dies as it lays out its third PART
        sent[0] += 1
        if sent[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(step, pieces, *rest)
    RC.layout_part = part
    c.put_step(4, "grad", [("w", "I64", (2,), np.array([4, 4]))])
    c.put_base(4, {"big": ("F32", np.full(20000, 4.0, np.float32))}, {"b": 4})
""")


def test_a_base_cut_short_by_a_killed_producer_is_never_published(tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH",
                                                                            "")]))
    p = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path / "log")], cwd=root,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    writer = int(p.stdout.split()[0])
    t0 = time.monotonic()
    # the orphaned writer finishes, then exits (a zombie until whoever adopted it reaps it)
    while time.monotonic() - t0 < scaled(60):
        if zombie_or_gone(writer):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the writer process outlived its producer by a minute")
    with LogReader(tmp_path / "log") as r:
        assert r.bases == [3]  # base 4's two PARTs sent are dropped, never a partial base
        assert [int(s) for s in r.steps] == [1, 2, 3, 4]  # step 4 was handed over: durable
        assert list(r.record(4).tensor("w")) == [4, 4]
        assert r.base(3).tensor("w").tolist() == [1.0] * 4
    # nothing of base 4 is left: its temp file was removed when the writer process closed
    assert not [f for f in os.listdir(tmp_path / "log") if "base" in f and "3" not in f]


@pytest.fixture
def ring() -> Ring:
    r, fd = Ring.create(8, 4096)
    os.close(fd)
    return r


def test_a_part_round_trips_and_its_garbage_is_refused(ring: Ring) -> None:
    data = np.arange(10, dtype=np.float32)
    msg = layout_part(9, [("w", "F32", (2, 5), 8, memoryview(data[2:6]).cast("B")),
                          ("e", "I32", (0,), 0, b"")],
                      [("w", "F32", (2, 5)), ("e", "I32", (0,))], {"k": 1})
    write_message(ring, 0, msg)
    got = read_message(ring, 0)
    assert got.kind is Kind.PART
    assert got.step == 9
    assert got.layout == (("w", "F32", (2, 5)), ("e", "I32", (0,)))
    assert got.meta == {"k": 1}
    (a, b) = got.pieces
    assert (a.name, a.dtype, a.shape, a.at) == ("w", "F32", (2, 5), 8)
    assert ring.array(a.part).view(np.float32).tolist() == [2.0, 3.0, 4.0, 5.0]
    assert (b.name, b.at, b.part.length) == ("e", 0, 0)
    closing = layout_base(9, [], {"k": 1}, parts=3)
    write_message(ring, 2, closing)
    assert read_message(ring, 2).parts == 3
    # the producer refuses a piece the reader would: past the tensor, or not whole elements
    for at, n in ((36, 8), (2, 4)):
        with pytest.raises(Exception, match="piece"):
            layout_part(9, [("w", "F32", (2, 5), at, b"x" * n)])


@pytest.mark.parametrize("case", ["out_of_order", "miscounted", "other_step", "short",
                                  "no_layout", "other_meta"])
def test_pieces_out_of_order_or_miscounted_are_a_clear_error(tmp_path: Path,
                                                             case: str) -> None:
    w = memoryview(np.arange(8, dtype=np.float32)).cast("B")
    lay = [("w", "F32", (8,))]
    msgs = {
        "out_of_order": [layout_part(2, [("w", "F32", (8,), 16, w[16:])], lay),
                         layout_base(2, [], None, parts=1)],
        "miscounted": [layout_part(2, [("w", "F32", (8,), 0, w)], lay),
                       layout_base(2, [], None, parts=2)],
        "other_step": [layout_part(2, [("w", "F32", (8,), 0, w[:16])], lay),
                       layout_part(3, [("w", "F32", (8,), 16, w[16:])])],
        "short": [layout_part(2, [("w", "F32", (8,), 0, w[:16])], lay),
                  layout_base(2, [], None, parts=1)],
        "no_layout": [layout_part(2, [("w", "F32", (8,), 0, w)]),
                      layout_base(2, [], None, parts=1)],
        "other_meta": [layout_part(2, [("w", "F32", (8,), 0, w)], lay, {"a": 1}),
                       layout_base(2, [], {"a": 2}, parts=1)],
    }[case]
    want = {"out_of_order": "does not follow", "miscounted": "closes 2 PART",
            "other_step": "is not closed", "short": "16 of its 32 bytes arrived",
            "no_layout": "carries no layout", "other_meta": "other metadata"}[case]
    c = RingClient(tmp_path / "log", slots=8, slot_size=4096)
    try:
        c.put_step(1, "grad", [])
        for m in msgs:
            c._write(m, "a test message")
        c._send(Op.PUBLISH, c._head)
        with pytest.raises(FormatError, match=want) as ei:
            c.flush()
        assert ei.value.reason is Reason.BAD_METADATA
    finally:
        c.close()  # (the failure was raised: it closes quietly)
    with LogReader(tmp_path / "log") as r:
        assert r.bases == []
        assert [int(s) for s in r.steps] == [1]
    assert not [f for f in os.listdir(tmp_path / "log") if f.endswith(".tmp")]


def test_a_writer_killed_between_two_parts_is_raised_and_its_temp_file_goes_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lowdiff_store.errors import CommitError
    from lowdiff_store.verify import verify_log
    from lowdiff_store.writer import ring_client as RC

    c = RingClient(tmp_path / "log", slots=4, slot_size=4096)
    c.put_step(1, "grad", [("w", "I64", (2,), np.array([1, 1]))])
    c.put_base(1, {"w": ("F32", np.ones(4, np.float32))}, {"b": 1})
    assert c.flush() == 1
    real, sent = RC.layout_part, [0]

    def part(*a: object) -> object:  # the writer process is killed before the third PART
        sent[0] += 1
        if sent[0] == 3:  # (once the writer began the base's temp file)
            t0 = time.monotonic()
            while not [n for n in os.listdir(tmp_path / "log") if n.endswith(".tmp")]:
                assert time.monotonic() - t0 < scaled(30), "no temp file"
                time.sleep(0.005)
            os.kill(c.pid, signal.SIGKILL)
            t0 = time.monotonic()
            while not zombie_or_gone(c.pid) and time.monotonic() - t0 < scaled(30):
                time.sleep(0.01)
        return real(*a)  # type: ignore[arg-type]
    monkeypatch.setattr(RC, "layout_part", part)
    with pytest.raises(CommitError, match="writer process died"):
        c.put_step(2, "grad", [("w", "I64", (2,), np.array([2, 2]))])
        c.put_base(2, {"big": ("F32", np.full(20000, 2.0, np.float32))}, {"b": 2})
        c.flush()
    c.close()
    names = os.listdir(tmp_path / "log")
    left = [n for n in names if n.endswith(".tmp")]
    assert len(left) == 1  # the killed writer's temp file of base 2 ...
    assert verify_log(str(tmp_path / "log")).ok  # ... is no part of the log
    with LogReader(tmp_path / "log") as r:
        assert r.bases == [1]
    monkeypatch.setattr(RC, "layout_part", real)
    with RingClient(tmp_path / "log", slots=4, slot_size=4096) as c2:  # the next base in
        c2.put_base(5, {"big": ("F32", np.full(20000, 5.0, np.float32))}, {"b": 5})
        c2.flush()                                                     # pieces removes it
    assert not [n for n in os.listdir(tmp_path / "log") if n.endswith(".tmp")]
    with LogReader(tmp_path / "log") as r:
        assert r.bases == [1, 5]
        assert r.base(5).tensor("big").tolist() == [5.0] * 20000
