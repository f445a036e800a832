"""Crash and bit-rot campaigns on the reference log (``tests/conftest.py``: one segment, a
base at step 0, four records of 192-704 bytes: raw F32, sparse, zstd I32, raw BF16 plus
sparse+zstd).

- Cut at every byte of the segment: readers see exactly a prefix of the steps (never an
  error once the 64-byte header is whole, never a wrong value), and a writer reopens,
  cuts the torn tail and appends.
- Flip bits at every byte of the segment, index, manifest and base: ``verify_log`` reports
  a problem naming the file, or the byte is one of the few provably harmless ones; a strict
  reader either raises ``LowdiffError`` or returns exactly the original values.

Behaviour when the segment is shorter than its 64-byte header: a clean ``truncated`` error
naming the segment (offset 0) from readers and from ``LogWriter``, which refuses to open.
That is deliberate: a segment's header is written and fsynced, and the directory fsynced,
before the manifest names the segment, so a crash cannot leave a manifest-named segment with
a torn header; it is damage, not a crash artefact.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import BaseFile, LogReader, LogWriter, LowdiffError, Reason, tensor_input
from lowdiff_store.errors import FormatError
from lowdiff_store.log.base import RESERVED_PREFIX
from lowdiff_store.verify import verify_log

EXTRA = np.arange(5, dtype="<f4") * np.float32(0.5)


def _prefix(log: Any, cut: int) -> list[int]:
    """The steps whose records lie wholly before ``cut``."""
    return [s for s in sorted(log.ends) if log.ends[s] <= cut]


def _torn(log: Any, cut: int) -> int:
    steps = _prefix(log, cut)
    return cut - (log.ends[steps[-1]] if steps else 64)


def _check_cut_reader(log: Any, cut: int, read_all: Callable[..., list[int]],
                      index_names_all: bool) -> None:
    if cut < 64:
        with pytest.raises(FormatError) as ei:
            LogReader(log.path)
        assert ei.value.reason is Reason.TRUNCATED, cut
        assert (ei.value.path, ei.value.offset) == (str(log.segment), 0), cut
        return
    steps = read_all(log.path, log)
    assert steps == _prefix(log, cut), cut
    with LogReader(log.path, strict=True) as r:
        assert r.report.clean, cut
        assert r.report.corrupt_bytes == 0, cut
        assert r.report.torn_tail_bytes == _torn(log, cut), cut
        assert r.durable_step == (steps[-1] if steps else 0)  # the base is at step 0
        if not index_names_all:
            assert r.report.unindexed_records == len(steps)


@pytest.mark.parametrize("index", ["kept", "deleted"])
def test_cut_segment_at_every_byte_reads_a_prefix(index: str, small_log: Any,
                                                  read_all: Callable[..., list[int]]) -> None:
    size = os.path.getsize(small_log.segment)
    assert size == small_log.ends[4]
    assert size > 1500
    if index == "deleted":
        os.unlink(small_log.index)
    # from the whole file down to nothing: each cut only shortens the file
    for cut in range(size, -1, -1):
        os.truncate(small_log.segment, cut)
        _check_cut_reader(small_log, cut, read_all, index == "kept")


def _near_boundaries(log: Any, size: int) -> list[int]:
    """The cuts CI tries: every byte within 8 of the header's end and of each record's
    start and end (where the reader's decisions change), and every 13th byte between."""
    marks = [0, 64, size, *log.starts.values(), *log.ends.values()]
    near = {c for m in marks for c in range(m - 8, m + 9)} | set(range(0, size + 1, 13))
    return sorted(c for c in near if 0 <= c <= size)


@pytest.mark.parametrize("every", [pytest.param(False, id="near-boundaries"),
                                   pytest.param(True, id="every-byte", marks=pytest.mark.slow)])
def test_cut_segment_at_every_byte_then_append(small_log: Any, every: bool,
                                               read_all: Callable[..., list[int]]) -> None:
    """Cut the segment (the slow campaign: at every byte; CI: near every boundary and at
    a stride between), reopen for append, append one step: the torn tail is gone, every
    record before the cut is kept bit for bit."""
    seg, idx = small_log.segment.read_bytes(), small_log.index.read_bytes()
    for cut in range(len(seg) + 1) if every else _near_boundaries(small_log, len(seg)):
        small_log.segment.write_bytes(seg[:cut])
        small_log.index.write_bytes(idx)
        if cut < 64:
            with pytest.raises(FormatError) as ei:
                LogWriter(small_log.path)
            assert ei.value.reason is Reason.TRUNCATED
            assert (ei.value.path, ei.value.offset) == (str(small_log.segment), 0)
            assert os.path.getsize(small_log.segment) == cut  # left as found
            continue
        kept = _prefix(small_log, cut)
        new = (kept[-1] if kept else 0) + 1
        with LogWriter(small_log.path) as w:
            assert w.last_step == (kept[-1] if kept else 0)
            assert w.durable_step == w.last_step
            w.append(new, [tensor_input("x", EXTRA, "F32")], kind="grad")
            assert w.sync() == new
        expected = dataclasses.replace(
            small_log, tensors={**{s: small_log.tensors[s] for s in kept}, new: {"x": EXTRA}})
        assert read_all(small_log.path, expected) == [*kept, new], cut
        with LogReader(small_log.path) as r:
            _p, off, ln = r.record_location(new)
            assert off == (small_log.ends[kept[-1]] if kept else 64)  # the torn tail is gone
            assert os.path.getsize(small_log.segment) == off + ln
            assert r.report.clean
            assert r.report.torn_tail_bytes == 0
            assert r.report.unindexed_records == 0  # the writer indexed what it kept


# ------------------------------------------------------------------------------- flips


def _harmless(log: Any) -> dict[str, set[int]]:
    """Bytes whose flips no check can see, and why they change nothing:

    - ``MANIFEST`` bytes 10-11, the *minor* version: outside the body CRC by design
      (readers accept every minor of major 1 and nothing depends on its value);
    - the data of the base's padding tensors ``__lowdiff__.pad.<i>``: bytes between tensors
      that exist only to align the next tensor to 64; no CRC covers them and no read
      returns them (``BaseFile.names`` hides them).

    Everything else (every byte of segments and indexes included) is covered by a CRC, a
    magic, a version check or the index check words.
    """
    with BaseFile(str(log.base_file)) as b:
        pads = {o for name, (_t, _s, beg, end) in b._entries.items()
                if name.startswith(RESERVED_PREFIX + "pad.")
                for o in range(b.data_start + beg, b.data_start + end)}
    assert pads, "the reference base should contain padding"
    return {"MANIFEST": {10, 11}, log.base_file.name: pads,
            log.segment.name: set(), log.index.name: set()}


def _flip_files(log: Any) -> list[Path]:
    return [log.segment, log.index, log.manifest, log.base_file]


def _flip_campaign(log: Any, read_all: Callable[..., list[int]], bits: Callable[[int], list[int]]
                   ) -> dict[str, set[int]]:
    """Flip ``bits(offset)`` of every byte of every file, one flip at a time; returns the
    offsets per file where ``verify_log`` saw nothing."""
    silent: dict[str, set[int]] = {}
    for path in _flip_files(log):
        data = path.read_bytes()
        fd = os.open(path, os.O_RDWR)
        try:
            for off in range(len(data)):
                for bit in bits(off):
                    os.pwrite(fd, bytes([data[off] ^ (1 << bit)]), off)
                    try:
                        _check_flip(log, path, off, bit, read_all, silent)
                    finally:
                        os.pwrite(fd, data[off:off + 1], off)
        finally:
            os.close(fd)
    return silent


def _check_flip(log: Any, path: Path, off: int, bit: int,
                read_all: Callable[..., list[int]], silent: dict[str, set[int]]) -> None:
    where = f"{path.name}:{off} bit {bit}"
    rep = verify_log(str(log.path))
    # the active segment's index is a cache a power cut may damage: verify reports damage
    # there as a note (rebuilt by the next writer open), not as a problem
    noted = path == log.index and any(path.name in n for n in rep.notes)
    if rep.ok and not noted:
        silent.setdefault(path.name, set()).add(off)
    for p in rep.problems:
        assert isinstance(p, LowdiffError), where
        assert p.path, where
        assert os.path.dirname(p.path) == str(log.path) or p.path == str(log.path), where
    if path == log.segment or path == log.base_file:
        # the damaged file is named, with an offset, in one of the problems
        assert rep.ok or any(p.path == str(path) and p.offset is not None
                             for p in rep.problems), (where, rep.problems)
    try:
        steps = read_all(log.path, log)
    except LowdiffError:
        return
    assert steps == [1, 2, 3, 4], where  # never a silently shorter log either


def test_flip_one_bit_of_every_byte(small_log: Any, read_all: Callable[..., list[int]]) -> None:
    rng = random.Random(20240601)
    silent = _flip_campaign(small_log, read_all, lambda _off: [rng.randrange(8)])
    assert silent == {k: v for k, v in _harmless(small_log).items() if v}


@pytest.mark.slow
def test_flip_every_bit_of_every_byte(small_log: Any, read_all: Callable[..., list[int]]
                                      ) -> None:
    silent = _flip_campaign(small_log, read_all, lambda _off: list(range(8)))
    assert silent == {k: v for k, v in _harmless(small_log).items() if v}


def test_harmless_bytes_really_change_nothing(small_log: Any,
                                              read_all: Callable[..., list[int]]) -> None:
    """Rewrite every harmless byte with 0xFF at once: all reads are unchanged."""
    for name, offsets in _harmless(small_log).items():
        path = small_log.path / name
        data = bytearray(path.read_bytes())
        for o in offsets:
            data[o] = 0xFF
        path.write_bytes(bytes(data))
    assert verify_log(str(small_log.path)).ok
    assert read_all(small_log.path, small_log) == [1, 2, 3, 4]
    with LogWriter(small_log.path) as w:
        w.append(5, [tensor_input("x", EXTRA, "F32")], kind="grad")
