"""The tools over a log with streamed bases (spec section 7.2), torch-free: the reader's
steps, ``verify`` (every slice read, each fault one problem and exit 3), ``inspect``, the
report (the recovery curve replays from a streamed base's first slice) and compaction's
retention (streamed bases counted among the bases, dropped entry first then slices, the
diffs after a kept base's first slice and after a base in progress kept)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowdiff_store import LogWriter
from lowdiff_store.compaction import compact
from lowdiff_store.format.constants import (
    BASE_NAME,
    INDEX_NAME,
    LOCK_NAME,
    SEGMENT_NAME,
    SLICE_NAME,
)
from lowdiff_store.log import LogReader
from lowdiff_store.log.base import store_base
from lowdiff_store.log.manifest import load_manifest, update_manifest
from lowdiff_store.log.streamed import StreamedBase
from lowdiff_store.report import facts
from lowdiff_store.report.html import Page
from lowdiff_store.report.series import recovery_curve
from lowdiff_store.storage import open_store
from lowdiff_store.verify import inspect_log, verify_log
from tests.helpers.cli import run_cli as cli_run
from tests.helpers.streamed_log import NAMES, make_streamed_log, value

STREAMED = [(6, (4, 5, 6)), (10, (8, 9, 10))]


@pytest.fixture
def log(tmp_path: Path) -> Path:
    """Base 0, diffs 1..12, streamed bases complete at 6 and 10."""
    p = tmp_path / "log"
    make_streamed_log(p, 12, STREAMED)
    return p




def reslice(log: Path, step: int, tensors: dict[str, np.ndarray], sl: dict[str, Any]
            ) -> None:
    """Replace the slice file of ``step`` (a slice of this log, well framed)."""
    store = open_store(str(log))
    store.delete(SLICE_NAME.format(step))
    store_base(store, step, {n: ("F32", a) for n, a in tensors.items()},
               {"kind": "test", "slice": sl}, load_manifest(log).log_id, name=SLICE_NAME)


def sizes(log: Path, prefix: str) -> int:
    return sum(os.path.getsize(log / n) for n in os.listdir(log) if n.startswith(prefix))


# ---------------------------------------------------------------------------- reader


def test_the_reader_counts_streamed_bases_among_the_bases(log: Path) -> None:
    update_manifest(log, lambda m: setattr(m, "bases", []))  # base 0 gone (retention)
    with LogReader(log) as r:
        assert (r.bases, r.first_step, r.last_step, r.durable_step) == ([], 6, 12, 12)
        plan, diffs = r.chain_from(12)
        assert (plan.complete, plan.slices, diffs) == (10, (8, 9, 10), [9, 10, 11, 12])
        with StreamedBase(r, plan) as sb:
            for n in NAMES:
                assert sb.step_of(n) == 8 + NAMES.index(n)
                assert sb.tensor(n).tolist() == value(n, sb.step_of(n)).tolist()


def test_durable_step_passes_over_a_streamed_base_whose_diffs_are_not_there(
        log: Path) -> None:
    # a manifest naming a streamed base past the diffs (steps 13, 14 were never logged)
    update_manifest(log, lambda m: setattr(m, "streamed", [*m.streamed, (14, (13, 14))]))
    with LogReader(log) as r:
        assert (r.durable_step, r.last_step) == (12, 14)


# ---------------------------------------------------------------------------- verify


def test_verify_reads_every_slice(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = verify_log(str(log))
    assert (rep.ok, rep.bases, rep.streamed, rep.records) == (True, 1, 2, 12)
    segments = sum(os.path.getsize(log / n) for n in os.listdir(log) if n.endswith(".ldlog"))
    assert rep.bytes_checked == segments + sizes(log, "base-") + sizes(log, "slice-")
    rc, out, err = cli_run(["verify", str(log)], capsys)
    assert (rc, out) == (0, "")
    assert err.startswith("ok: 12 records, 1 bases and 2 streamed, ")
    rc, out, _err = cli_run(["verify", str(log), "--json"], capsys)
    assert (rc, json.loads(out)["streamed"]) == (0, 2)


def _flip_last_tensor_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # the last tensor's data (the metadata tensor comes first)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fault", ["flipped", "other_base", "twice", "missing", "diff"])
def test_each_fault_of_a_streamed_base_is_one_problem_and_exit_3(
        log: Path, fault: str, capsys: pytest.CaptureFixture[str]) -> None:
    five = log / SLICE_NAME.format(5)
    want, where = {"flipped": "checksum_mismatch", "other_base": "bad_metadata",
                   "twice": "bad_metadata", "missing": "missing_file",
                   "diff": "no_such_step"}[fault], str(five)
    if fault == "flipped":
        _flip_last_tensor_byte(five)
    elif fault == "other_base":
        reslice(log, 5, {"b": value("b", 5)}, {"base": 7, "steps": [4, 5, 7]})
    elif fault == "twice":
        reslice(log, 5, {"b": value("b", 5), "a": value("a", 5)},
                {"base": 6, "steps": [4, 5, 6]})
    elif fault == "missing":
        five.unlink()
    else:  # a sound streamed base whose diffs (after step 13) the log does not hold
        log_id = load_manifest(log).log_id
        for s, n in ((13, "a"), (14, "b")):
            store_base(open_store(str(log)), s, {n: ("F32", value(n, s))},
                       {"kind": "test", "slice": {"base": 14, "steps": [13, 14]}}, log_id,
                       name=SLICE_NAME)
        update_manifest(log, lambda m: setattr(m, "streamed", [*m.streamed, (14, (13, 14))]))
        where = str(log)
    rep = verify_log(str(log))
    assert [(p.reason.value, p.path) for p in rep.problems] == [(want, where)]
    assert rep.streamed == 1 + (fault == "diff")  # the sound one(s) still counted
    rc, out, _err = cli_run(["verify", str(log)], capsys)
    assert rc == 3
    assert len(out.splitlines()) == 1
    assert out.startswith(f"{where}:")
    assert f": {want}: " in out


def test_a_slice_no_manifest_names_is_a_note_not_a_problem(
        log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # what a base in progress (or a crash before its commit) leaves
    store_base(open_store(str(log)), 11, {"a": ("F32", value("a", 11))},
               {"kind": "test", "slice": {"base": 13, "steps": [11, 12, 13]}},
               load_manifest(log).log_id, name=SLICE_NAME)
    rep = verify_log(str(log))
    assert rep.ok
    name = SLICE_NAME.format(11)
    assert rep.notes == [f"{name}: not referenced by the manifest (removed by the next "
                         "writer open)"]
    rc, out, err = cli_run(["verify", str(log)], capsys)
    assert (rc, out) == (0, "")
    assert f"note: {name}: not referenced" in err


# ---------------------------------------------------------------------------- inspect


def test_inspect_lists_streamed_bases(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    info = inspect_log(str(log))
    slice_bytes = {c: sum(os.path.getsize(log / SLICE_NAME.format(s)) for s in sl)
                   for c, sl in STREAMED}
    assert info["streamed"] == [{"complete": c, "slices": list(sl), "bytes": slice_bytes[c]}
                                for c, sl in STREAMED]
    assert info["slice_bytes"] == sizes(log, "slice-")
    assert info["bytes_on_disk"] == sum(sizes(log, p) for p in ("seg-", "base-", "slice-",
                                                                "MANIFEST"))
    assert (info["bases"], info["base_slices"], info["health"]) == ([0], None, "ok")
    rc, out, _err = cli_run(["inspect", str(log)], capsys)
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("streamed bases"))
    assert line.split(None, 2)[2].startswith("6 (slices 4, 5, 6: ")
    assert "; 10 (slices 8, 9, 10: " in line
    rc, out, _err = cli_run(["inspect", str(log), "--json"], capsys)
    assert json.loads(out)["streamed"] == info["streamed"]


def test_inspect_finds_a_missing_slice(log: Path) -> None:
    (log / SLICE_NAME.format(9)).unlink()
    info = inspect_log(str(log))
    assert info["health"] == "corrupt"
    assert [(p["reason"], p["path"]) for p in info["problems"]] == [
        ("missing_file", str(log / SLICE_NAME.format(9)))]


# ---------------------------------------------------------------------------- report


def test_recovery_curve_replays_from_the_first_slice() -> None:
    steps = np.arange(1, 13, dtype=np.int64)
    lengths = np.full(12, 10, dtype=np.int64)
    c = recovery_curve(steps, lengths, [(0, 1000), (6, 300)], replay_cost=1.0,
                       starts=[0, 4])
    assert c.steps.tolist() == list(range(0, 13))
    assert c.base.tolist() == [0] * 6 + [6] * 7
    assert c.start.tolist() == [0] * 6 + [4] * 7
    assert c.replayed.tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7, 8]
    assert c.bytes_read.tolist()[5:8] == [1050, 320, 330]
    assert c.seconds is not None
    assert c.seconds.tolist()[6] == 2.0
    # the diffs after the first slice missing: the streamed base restores nothing
    gap = steps != 5
    c = recovery_curve(steps[gap], lengths[gap], [(0, 1000), (6, 300)], starts=[0, 4])
    assert c.steps.tolist() == [0, 1, 2, 3, 4]


def test_the_report_shows_streamed_bases(log: Path) -> None:
    rep = facts.collect(str(log))
    f = rep.logs[0]
    assert [(b.step, b.slices) for b in f.bases] == [(0, ()), (6, (4, 5, 6)),
                                                     (10, (8, 9, 10))]
    assert (f.base_bytes, f.slice_bytes) == (sizes(log, "base-"), sizes(log, "slice-"))
    assert f.bases[1].tensors == {"b": 16, "a": 16, "c": 16}
    assert not f.bases[1].error
    log_sum = rep.summary()["logs"][0]
    assert (log_sum["bases"], log_sum["base_slices"]) == ([0], None)
    assert log_sum["streamed"] == [{"complete": c, "slices": list(sl),
                                    "bytes": b.bytes} for (c, sl), b in zip(STREAMED,
                                                                           f.bases[1:])]
    page = Page(rep, with_plots=False)
    curve = page.curves[0]
    assert curve.replayed.tolist()[-1] == 4  # step 12 from the slice of step 8
    html = page.render()
    assert "6 (streamed: slices 4, 5, 6)" in html
    assert "10 (streamed: replays from 8)" in html


def test_the_report_names_a_damaged_slice(log: Path) -> None:
    (log / SLICE_NAME.format(9)).unlink()
    rep = facts.collect(str(log))
    assert rep.health == "corrupt"
    b10 = rep.logs[0].bases[-1]
    assert (b10.step, b10.error is not None) == (10, True)
    assert ("missing_file", str(log / SLICE_NAME.format(9))) in [
        (p["reason"], p["path"]) for p in rep.all_problems()]
    # no restore goes through it: the curve falls back to the base of step 6 after 10
    assert Page(rep, with_plots=False).curves[0].base.tolist()[-1] == 6


# ---------------------------------------------------------------------------- compaction


def _records_by_segment(log: Path) -> dict[int, list[int]]:
    with LogReader(log) as r:
        t = r.record_table()
    out: dict[int, list[int]] = {}
    for step, sid, _off, _len in t.tolist():
        out.setdefault(int(sid), []).append(int(step))
    return out


@pytest.fixture
def long_log(tmp_path: Path) -> Path:
    """Base 0, diffs 1..20 about one per segment, streamed bases at 6, 10, 16."""
    p = tmp_path / "log"
    make_streamed_log(p, 20, [*STREAMED, (16, (14, 15, 16))], segment_bytes=4096,
                      size=256)
    return p


def test_retention_counts_streamed_bases_and_keeps_the_diffs_after_the_first_slice(
        long_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _records_by_segment(long_log)
    assert len(before) > 10
    rc, out, _err = cli_run(["compact", str(long_log), "--keep-bases", "2", "--dry-run",
                             "--json"], capsys)
    assert rc == 0
    dry = json.loads(out)
    assert (dry["keep_bases"], dry["delete_bases"]) == ([10, 16], [0])
    assert dry["delete_streamed"] == [{"complete": 6, "slices": [4, 5, 6]}]
    assert load_manifest(long_log).streamed == [*STREAMED, (16, (14, 15, 16))]  # dry
    rc, out, _err = cli_run(["compact", str(long_log), "--keep-bases", "2", "--dry-run"],
                            capsys)
    assert rc == 0
    assert (f"would delete 1 base(s) [0], streamed base 6 (slices 4, 5, 6) and "
            f"{len(dry['delete_segments'])} segment(s)") in out
    rc, out, _err = cli_run(["compact", str(long_log), "--keep-bases", "2", "--json"], capsys)
    assert rc == 0
    res = json.loads(out)
    m = load_manifest(long_log)
    assert (m.bases, m.streamed) == ([], [(10, (8, 9, 10)), (16, (14, 15, 16))])
    gone = [s for s in (4, 5, 6) if (long_log / SLICE_NAME.format(s)).exists()]
    assert gone == []
    assert all((long_log / SLICE_NAME.format(s)).exists() for s in (8, 9, 10, 14, 15, 16))
    # every diff after step 8 (the first slice of the oldest base kept) is there; the
    # segments deleted held only diffs up to 8
    after = _records_by_segment(long_log)
    deleted = set(before) - set(after)
    assert sorted(deleted) == sorted(res["delete_segments"])
    assert deleted
    assert max(s for sid in deleted for s in before[sid]) <= 8
    with LogReader(long_log) as r:
        assert r.chain_from(20)[1] == list(range(15, 21))
        assert r.chain_from(12)[1] == [9, 10, 11, 12]
        assert min(int(s) for s in r.steps) <= 9
    assert verify_log(str(long_log)).ok


def test_a_streamed_base_dropped_goes_with_its_slices(long_log: Path) -> None:
    res = compact(str(long_log), keep_bases=1)
    assert [c for c, _s in res.plan.delete_streamed] == [6, 10]
    assert load_manifest(long_log).streamed == [(16, (14, 15, 16))]
    left = sorted(n for n in os.listdir(long_log) if n.startswith("slice-"))
    assert left == [SLICE_NAME.format(s) for s in (14, 15, 16)]
    with LogReader(long_log) as r:
        assert int(r.steps[0]) <= 15
        assert r.durable_step == 20
    assert verify_log(str(long_log)).ok


def _materializer(reader: LogReader, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state after ``step`` as the helper's log defines it (a consistent base)."""
    return {n: ("F32", value(n, step, 256)) for n in NAMES}, {"kind": "test"}


def test_a_new_base_at_a_streamed_base_replaces_it(long_log: Path) -> None:
    res = compact(str(long_log), step=16, keep_bases=1, materializer=_materializer)
    assert (res.plan.new_base, res.plan.keep_bases) == (16, [16])
    assert [c for c, _s in res.plan.delete_streamed] == [6, 10, 16]  # 16: replaced
    m = load_manifest(long_log)
    assert (m.bases, m.streamed) == ([16], [])
    assert not [n for n in os.listdir(long_log) if n.startswith("slice-")]
    with LogReader(long_log) as r:
        plan, diffs = r.chain_from(20)
        assert (plan.streamed, plan.complete, diffs) == (False, 16, [17, 18, 19, 20])


def test_retention_keeps_the_diffs_of_a_streamed_base_in_progress(long_log: Path) -> None:
    """A live writer (it holds the log's LOCK) is taking the base complete at 19: slices
    after 17 and 18 written, not named yet, while its diffs have reached step 20. A
    compaction makes a base at 20 and keeps one base: the diffs after 17 stay, so the
    base the writer commits next is restorable."""
    store = open_store(str(long_log))
    log_id = load_manifest(long_log).log_id

    def take(s: int) -> None:
        n = NAMES[s - 17]
        store_base(store, s, {n: ("F32", value(n, s, 256))},
                   {"kind": "test", "slice": {"base": 19, "steps": [17, 18, 19]}}, log_id,
                   name=SLICE_NAME)

    update_manifest(long_log, lambda m: setattr(m, "streamed", m.streamed[:2]))  # not 16
    for s in (14, 15, 16):
        store.delete(SLICE_NAME.format(s))
    take(17)
    take(18)
    before = _records_by_segment(long_log)
    lock = store.try_lock(LOCK_NAME)
    assert lock is not None
    with lock:
        res = compact(str(long_log), keep_bases=1, materializer=_materializer)
        assert (res.plan.new_base, res.plan.keep_bases) == (20, [20])
        assert (long_log / SLICE_NAME.format(17)).exists()  # not garbage: a writer holds it
        take(19)  # the writer goes on: its last slice, then the commit
        update_manifest(long_log, lambda m: setattr(m, "streamed",
                                                    [*m.streamed, (19, (17, 18, 19))]))
    deleted = set(before) - set(_records_by_segment(long_log))
    assert deleted  # retention did delete segments, only those up to step 17
    assert max(s for sid in deleted for s in before[sid]) <= 17
    with LogReader(long_log) as r:
        plan, diffs = r.chain_from(19)
        assert (plan.complete, plan.streamed, diffs) == (19, True, [18, 19])
    assert verify_log(str(long_log)).ok



POINTS = ("locked", "materialized", "base-written", "published", "deleting", "deleted")


def _referenced(path: Path) -> set[str]:
    """The log files the manifest names."""
    m = load_manifest(path)
    out = {BASE_NAME.format(b) for b in m.bases} | {SLICE_NAME.format(s)
                                                     for s in m.slice_steps()}
    for sid, _f in m.segments:
        out |= {SEGMENT_NAME.format(sid), INDEX_NAME.format(sid)}
    return out


def _log_files(path: Path) -> set[str]:
    return {n for n in os.listdir(path) if n.startswith(("slice-", "base-", "seg-"))}


@pytest.mark.parametrize("point", POINTS)
def test_a_compaction_stopped_at_each_point_leaves_the_old_or_the_new_log(
        long_log: Path, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped at ``point`` (as a kill there would: nothing after it runs), the log is the
    old one or the new one, clean under verify and restorable; what it left (the slices
    of the streamed bases it dropped among them) are notes, removed by the next writer
    open."""
    import lowdiff_store.compaction.single as single

    old = load_manifest(long_log)

    class Stop(Exception):
        pass

    def stop(at: str) -> None:
        if at == point:
            raise Stop(at)

    monkeypatch.setattr(single, "_pause", stop)
    with pytest.raises(Stop):
        compact(str(long_log), keep_bases=1, materializer=_materializer)
    m = load_manifest(long_log)
    published = POINTS.index(point) >= POINTS.index("published")
    if published:
        assert (m.bases, m.streamed) == ([20], [])
        assert m.segments == old.segments[-len(m.segments):]
        assert m.segments != old.segments
    else:
        assert (m.bases, m.streamed, m.segments) == (old.bases, old.streamed, old.segments)
    rep = verify_log(str(long_log))
    assert rep.ok, rep.problems
    leftovers = _log_files(long_log) - _referenced(long_log)
    assert {n for n in leftovers if n.startswith("slice-")} == (
        {SLICE_NAME.format(s) for s in (4, 5, 6, 8, 9, 10, 14, 15, 16)}
        if point in ("published", "deleting") else set())
    assert {n.split(":")[0] for n in rep.notes} == leftovers
    with LogReader(long_log) as r:
        assert r.chain_from(20)[0].complete == (20 if published else 16)
    with LogWriter(long_log):
        pass  # the next open collects the garbage
    assert _log_files(long_log) <= _referenced(long_log)
    assert verify_log(str(long_log)).notes == []
