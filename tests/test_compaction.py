"""Compaction and retention on plain logs (no torch): the retention policy, the CLI end to
end (``--keep-bases``, ``--keep-history-from``, ``--dry-run``, ``--json``), the single
manifest swap of a new base, leftovers of an interrupted compaction, locks.

Gradient logs (new bases materialized by replay) are in ``tests/torch/test_compaction_torch.py``,
kills of a compacting process in ``tests/test_compaction_crash.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from lowdiff_store import ConfigError, LogReader, LogWriter, tensor_input
from lowdiff_store.compaction import compact, log_bytes, publish_base
from lowdiff_store.compaction.single import _retained
from lowdiff_store.format.constants import BASE_NAME, SEGMENT_NAME
from lowdiff_store.log.manifest import load_manifest
from lowdiff_store.storage import open_store
from lowdiff_store.verify import verify_log
from tests.helpers.cli import run_cli as cli_run


@pytest.fixture
def no_torch_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain logs never need the torch layer (and the CLI must not require it)."""
    monkeypatch.setitem(sys.modules, "lowdiff_store.torch", None)


def base_of(step: int) -> dict[str, tuple[str, np.ndarray]]:
    return {"w": ("F32", np.full(8, float(step), dtype="<f4"))}


def grad_of(step: int) -> np.ndarray:
    return np.random.default_rng(step).standard_normal(300).astype("<f4")


def build(path: Path, last: int = 40, every: int = 10) -> None:
    """Bases every ``every`` steps, one 1.2 kB record per step, segments of ~4 kB (three
    records each), so retention has whole segments to drop."""
    with LogWriter(path, meta={"mode": "test"}, segment_bytes=4096) as w:
        w.write_base(0, base_of(0), meta={"step": 0})
        for t in range(1, last + 1):
            w.append(t, [tensor_input("g", grad_of(t), "F32")], kind="grad")
            if t % every == 0:
                w.sync()
                w.write_base(t, base_of(t), meta={"step": t})
        w.sync()


def files(path: Path) -> set[str]:
    return {n for n in os.listdir(path) if not n.endswith(".lock") and n != "LOCK"}


def referenced(path: Path) -> set[str]:
    m = load_manifest(str(path))
    out = {"MANIFEST"} | {BASE_NAME.format(b) for b in m.bases}
    for s, _f in m.segments:
        out |= {SEGMENT_NAME.format(s), SEGMENT_NAME.format(s).replace(".ldlog", ".ldidx")}
    return out


def check_readable(path: Path, steps: range) -> None:
    """Every step in ``steps`` reads back bit for bit; verify is clean."""
    assert verify_log(str(path)).ok
    with LogReader(path) as r:
        for t in steps:
            assert r.record(t).tensor("g").tobytes() == grad_of(t).tobytes(), t
        for b in r.bases:
            with r.base(b) as bf:
                assert bf.tensor("w").tobytes() == base_of(b)["w"][1].tobytes()




# ------------------------------------------------------------------------------ policy


@pytest.mark.parametrize(("bases", "k", "hist", "want"), [
    ([0, 10, 20, 30], 2, None, [20, 30]),
    ([0, 10, 20, 30], 1, None, [30]),
    ([0, 10, 20, 30], 9, None, [0, 10, 20, 30]),
    ([0, 10, 20, 30], 1, 15, [10, 20, 30]),   # the base at or before 15, and every later
    ([0, 10, 20, 30], 1, 20, [20, 30]),
    ([0, 10, 20, 30], 2, 0, [0, 10, 20, 30]),
    ([10, 20], 1, 5, [10, 20]),               # before the oldest base: keep everything
])
def test_retention_policy(bases: list[int], k: int, hist: int | None, want: list[int]) -> None:
    assert _retained(bases, k, hist) == want


# ------------------------------------------------------------------------------ CLI


@pytest.mark.usefixtures("no_torch_layer")
def test_cli_keep_bases_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "log"
    build(p)
    before = log_bytes(str(p))
    rc, out, err = cli_run(["compact", str(p), "--keep-bases", "2", "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert out.count("\n") == 1
    assert d["new_base"] is None  # a plain log: no materializer, retention only
    assert d["keep_bases"] == [30, 40]
    assert d["delete_bases"] == [0, 10, 20]
    assert d["delete_segments"]
    assert d["bytes_before"] == before
    assert d["bytes_after"] == log_bytes(str(p)) < before
    assert abs(d["bytes_freed"] - (before - d["bytes_after"])) < 512  # the manifest shrank
    assert not d["dry_run"]
    m = load_manifest(str(p))
    assert m.bases == [30, 40]
    assert m.segments[0][1] <= 31  # every diff after the oldest kept base is kept
    assert files(p) == referenced(p)  # nothing left behind
    check_readable(p, range(31, 41))
    with LogReader(p) as r:
        assert int(r.steps[0]) <= 31
        assert r.durable_step == 40


@pytest.mark.usefixtures("no_torch_layer")
def test_cli_keep_history_from(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "log"
    build(p)
    rc, out, err = cli_run(["compact", str(p), "--keep-bases", "1", "--keep-history-from",
                            "15", "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["keep_bases"] == [10, 20, 30, 40]
    assert d["delete_bases"] == [0]
    check_readable(p, range(11, 41))  # time travel from 10 on still works


@pytest.mark.usefixtures("no_torch_layer")
def test_cli_dry_run_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    p = tmp_path / "log"
    build(p)
    snap = {n: (p / n).read_bytes() for n in files(p)}
    rc, out, err = cli_run(["compact", str(p), "--keep-bases", "1", "--dry-run"], capsys)
    assert rc == 0, err
    assert "would delete 4 base(s) [0, 10, 20, 30]" in out
    assert "KiB" in out
    assert "disk:" in out
    assert "note: no materializer" not in out  # step 40 is a base already: nothing to make
    assert {n: (p / n).read_bytes() for n in files(p)} == snap
    rc, out, _err = cli_run(["compact", str(p), "--keep-bases", "1", "--dry-run", "--json"],
                            capsys)
    d = json.loads(out)
    assert d["dry_run"]
    assert d["delete_bases"] == [0, 10, 20, 30]
    assert d["bytes_after"] == d["bytes_before"] - d["bytes_freed"]
    assert d["bytes_freed"] > 0
    assert {n: (p / n).read_bytes() for n in files(p)} == snap


@pytest.mark.usefixtures("no_torch_layer")
def test_cli_human_output_and_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "log"
    build(p, last=43)  # newest durable step 43 is not a base, and this log has no replay
    rc, out, err = cli_run(["compact", str(p), "--keep-bases", "2"], capsys)
    assert rc == 0
    assert "keep bases: 30, 40" in out
    assert "deleted 3 base(s) [0, 10, 20]" in out
    assert "note: no materializer for this log: no base made at step 43" in err


@pytest.mark.usefixtures("no_torch_layer")
def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "log"
    build(p)
    rc, _out, err = cli_run(["compact", str(p), "--keep-bases", "0"], capsys)
    assert rc == 2  # a value out of range is a usage error (issue 10)
    assert "--keep-bases: 0 must be >= 1" in err
    with pytest.raises(ConfigError, match="keep_bases must be >= 1"):
        compact(str(p), keep_bases=0)
    rc, _out, err = cli_run(["compact", str(tmp_path / "nope")], capsys)
    assert rc == 1
    assert "not_a_log" in err
    lock = open_store(p).try_lock("COMPACT.lock")
    assert lock is not None
    try:
        rc, _out, err = cli_run(["compact", str(p)], capsys)
        assert rc == 1
        assert "another compaction is running" in err
    finally:
        lock.release()
    rc, _out, err = cli_run(["compact", str(p), "--step", "99"], capsys)
    assert rc == 1
    assert len(err.splitlines()) == 1


@pytest.mark.usefixtures("no_torch_layer")
def test_cli_subprocess(tmp_path: Path) -> None:
    """The installed entry point, as an operator runs it."""
    import subprocess

    p = tmp_path / "log"
    build(p)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-m", "lowdiff_store", "compact", str(p),
                          "--keep-bases", "1", "--json"], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    assert json.loads(out.stdout)["keep_bases"] == [40]
    assert out.stderr == ""  # no progress bar when stderr is not a terminal
    check_readable(p, range(41, 41))


# ------------------------------------------------------------------------------ API


def test_publish_base_is_one_swap_and_keeps_an_existing_base(tmp_path: Path) -> None:
    p = tmp_path / "log"
    build(p, last=25)
    with LogReader(p) as r:
        log_id, gen = r.log_id, r.manifest.generation
    n = publish_base(str(p), 25, base_of(25), {"step": 25}, log_id,
                     lambda m: setattr(m, "bases", [b for b in m.bases if b != 0]))
    m = load_manifest(str(p))
    assert n > 0
    assert m.bases == [10, 20, 25]
    assert m.generation == gen + 1
    assert not [f for f in os.listdir(p) if f.endswith(".tmp")]
    size = (p / BASE_NAME.format(25)).stat().st_size
    # a base already published at that step wins: the new one is dropped, the change applied
    n = publish_base(str(p), 25, base_of(99), {"step": 99}, log_id,
                     lambda m: setattr(m, "bases", [b for b in m.bases if b != 10]))
    assert n == 0
    assert load_manifest(str(p)).bases == [20, 25]
    assert (p / BASE_NAME.format(25)).stat().st_size == size
    with LogReader(p) as r, r.base(25) as bf:
        assert bf.tensor("w").tobytes() == base_of(25)["w"][1].tobytes()
    assert not [f for f in os.listdir(p) if f.endswith(".tmp")]


def test_leftovers_removed_by_next_compaction_and_by_writer_open(tmp_path: Path) -> None:
    p = tmp_path / "log"
    build(p)
    junk = [BASE_NAME.format(33), BASE_NAME.format(35) + ".123.456.tmp",
            SEGMENT_NAME.format(999), "MANIFEST.tmp"]

    def litter() -> None:
        for j in junk:
            (p / j).write_bytes(b"left by a killed compaction")

    litter()
    assert verify_log(str(p)).ok  # unreferenced files are notes, not problems
    # a live writer holds the log: compaction must not touch files it may be publishing
    with LogWriter(p) as _w:
        litter()
        compact(str(p), keep_bases=5)
        assert set(junk) - {"MANIFEST.tmp"} <= files(p)  # (the swap reuses MANIFEST.tmp)
    litter()
    compact(str(p), keep_bases=5)
    assert files(p) == referenced(p)
    litter()
    with LogWriter(p):
        pass
    assert files(p) == referenced(p)


def test_compaction_is_exclusive_and_never_drops_the_active_segment(tmp_path: Path) -> None:
    p = tmp_path / "log"
    build(p, last=40)
    with LogWriter(p) as w:  # the writer keeps appending while compaction runs
        res = compact(str(p), keep_bases=1)
        active = load_manifest(str(p)).segments[-1][0]
        assert active not in res.plan.delete_segments
        for t in range(41, 50):
            w.append(t, [tensor_input("g", grad_of(t), "F32")], kind="grad")
        w.sync()
    check_readable(p, range(41, 50))
    with LogReader(p) as r:
        assert r.durable_step == 49
        assert r.bases == [40]
