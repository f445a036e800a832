"""Compaction of gradient and delta logs: ``materialize_base`` builds the very base the
checkpointer writes; restoring from a compacted log gives the same bits as from the
original; retention through the CLI; a progress bar on a terminal; compaction beside a live
writer in another process and beside readers holding memory maps.

Run as a script, this module is the writer process of
``test_compaction_beside_a_live_writer``: ``python test_compaction_torch.py PATH STEPS``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _cases import (
    CASES,
    EF_BASE,
    assert_same,
    build,
    ckpt_kwargs,
    reference,
    run,
    snapshot,
    train_step,
)

from lowdiff_store import LogReader
from lowdiff_store.compaction import compact
from lowdiff_store.format.constants import BASE_NAME
from lowdiff_store.log.base import write_base
from lowdiff_store.log.manifest import load_manifest, update_manifest
from lowdiff_store.torch import DiffCheckpointer, materialize_base, replay_state, restore
from lowdiff_store.verify import verify_log
from tests.helpers.cli import run_cli as cli_run

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def make_log(path: Path, case: str, steps: int = 30, **kw: Any) -> None:
    o = build(case)
    opts = {**ckpt_kwargs(case), **kw}
    with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                          compressor=o.compressor, extra_state=lambda: dict(o.extra),
                          **opts) as ckpt:
        run(case, o, 0, steps, ckpt)


def restored(path: Path, case: str, step: int) -> tuple[dict[str, Any], Any, Any]:
    """Everything ``restore`` puts into fresh objects at ``step``: (state, result,
    residuals by parameter position)."""
    o = build(case)
    comp = o.compressor
    res = restore(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                  step=step, compressor=comp)
    resid = None
    if comp is not None:
        params = [p for g in o.optimizer.param_groups for p in g["params"]]
        resid = [comp.residuals.get(p) for p in params]
    return snapshot(o), res, resid


def base_body(path: Path) -> tuple[Any, Any, bytes]:
    """A base file without what names its log (log id, header CRC)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    h = json.loads(data[8:8 + n])
    md = h.pop("__metadata__")
    md.pop("log_id")
    md.pop("header_crc32c")
    return h, md, data[8 + n:]




# ------------------------------------------------------------------------------ identity


@pytest.mark.parametrize("case", CASES)
def test_materialized_base_is_the_checkpointers(case: str, tmp_path: Path) -> None:
    """Hide the checkpointer's base at step 20, rebuild it from base 10 + ten diffs: the
    file is byte for byte the one the checkpointer wrote."""
    p = tmp_path / "log"
    make_log(p, case, steps=25)
    q = tmp_path / "copy"
    shutil.copytree(p, q)
    update_manifest(str(q), lambda m: setattr(m, "bases", [0, 10]))
    with LogReader(q) as r:
        tensors, meta = materialize_base(r, 20)
        write_base(str(tmp_path / "made"), 20, tensors, meta, r.log_id)
    assert (tmp_path / "made").read_bytes() == (p / BASE_NAME.format(20)).read_bytes()
    assert "ef_approx" not in meta["torch"]


def test_materialize_leaves_the_callers_rng_alone(tmp_path: Path) -> None:
    p = tmp_path / "log"
    make_log(p, "adamw", steps=12)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    with LogReader(p) as r:
        materialize_base(r, 12)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("case", ["adamw", "adam_amp_fp16", "topk_ef_step", "delta",
                                  "layerwise_clip"])
def test_restore_from_compacted_log_is_bitwise(case: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "log"
    make_log(p, case, steps=30)
    q = tmp_path / "compacted"
    shutil.copytree(p, q)
    rc, out, err = cli_run(["compact", str(q), "--step", "25", "--keep-bases", "2",
                            "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["new_base"] == 25
    assert d["keep_bases"] == [25, 30]
    assert d["delete_bases"] == [0, 10, 20]
    assert load_manifest(str(q)).bases == [25, 30]
    assert verify_log(str(q)).ok
    for step in (25, 27, 29, 30):
        want, wres, _ = restored(p, case, step)
        got, gres, _ = restored(q, case, step)
        assert_same(got, want, f"step {step}")
        assert gres.base_step == (30 if step == 30 else 25)
        assert gres.extra == wres.extra == {"batches": step}
        assert gres.exact
        assert wres.exact
    # continuing from the compacted log is the original run, bit for bit
    o = build(case)
    restore(q, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
            compressor=o.compressor)
    with DiffCheckpointer(q, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                          compressor=o.compressor, **ckpt_kwargs(case)) as ckpt:
        run(case, o, 30, 34, ckpt)
    _ref, snaps = reference(case, 34)
    assert_same(snapshot(o), snaps[34])


def test_error_feedback_base_mode_is_approximate_as_documented(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    """``ef_state="base"``: the residual at step 25 is not in the log. The compacted base
    holds what restore gives there (documented approximation) and says so; restoring from
    it gives the same bits as restoring from the original log, at 25 and after."""
    case = EF_BASE
    p = tmp_path / "log"
    make_log(p, case, steps=30)
    q = tmp_path / "compacted"
    shutil.copytree(p, q)
    rc, _out, err = cli_run(["compact", str(q), "--step", "25", "--keep-bases", "2"], capsys)
    assert rc == 0, err
    with LogReader(q) as r, r.base(25) as bf:
        assert bf.meta()["torch"]["ef_approx"] is True
    for step in (25, 28, 29):
        want, wres, wr = restored(p, case, step)
        got, gres, gr = restored(q, case, step)
        assert_same(got, want)
        assert not wres.exact
        assert not gres.exact
        assert all(torch.equal(a, b) for a, b in zip(gr, wr, strict=True))


# ------------------------------------------------------------------------------ retention


def test_cli_retention_on_a_gradient_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    p = tmp_path / "log"
    make_log(p, "adamw", steps=47, snapshot_every=10, segment_bytes=40000)
    with LogReader(p) as r:
        nseg = len(r.manifest.segments)
    snaps = {t: restored(p, "adamw", t)[0] for t in (35, 42, 47)}

    rc, out, _err = cli_run(["compact", str(p), "--dry-run"], capsys)
    assert rc == 0
    assert "would write base at step 47" in out
    assert "keep bases: 40, 47" in out
    assert "would delete 4 base(s) [0, 10, 20, 30]" in out
    with LogReader(p) as r:
        assert r.bases == [0, 10, 20, 30, 40]
        assert len(r.manifest.segments) == nseg

    rc, out, _err = cli_run(["compact", str(p), "--keep-bases", "3", "--keep-history-from",
                             "35", "--json"], capsys)
    d = json.loads(out)
    assert rc == 0
    assert d["new_base"] == 47
    assert d["keep_bases"] == [30, 40, 47]
    assert d["delete_bases"] == [0, 10, 20]
    assert d["new_base_bytes"] > 0
    assert d["materialize_s"] > 0
    with LogReader(p) as r:
        assert r.bases == [30, 40, 47]
        assert int(r.steps[0]) <= 31
        assert r.durable_step == 47
        assert len(r.manifest.segments) < nseg
    for t, want in snaps.items():
        assert_same(restored(p, "adamw", t)[0], want, f"step {t}")

    rc, out, _err = cli_run(["compact", str(p), "--keep-bases", "1"], capsys)
    assert rc == 0
    assert "keep bases: 47" in out
    assert "wrote base" not in out
    with LogReader(p) as r:
        assert r.bases == [47]
    assert_same(restored(p, "adamw", 47)[0], snaps[47])
    assert verify_log(str(p)).ok


def test_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    import pty

    p = tmp_path / "log"
    make_log(p, "sgd_bn", steps=40, snapshot_every=100)
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "lowdiff_store", "compact", str(p),
                             "--keep-bases", "1"], stdout=subprocess.PIPE, stderr=slave,
                            env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            b = os.read(master, 4096)
        except OSError:  # EIO: the terminal's other side is closed
            break
        if not b:
            break
        chunks.append(b)
    os.close(master)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    tty = b"".join(chunks).decode()
    assert "\rcompact: " in tty, tty  # the tqdm bar: label, counts, rate, ETA
    assert "40/" in tty, tty
    assert "it/s]" in tty, tty
    assert "<" in tty, tty  # elapsed<remaining
    assert b"wrote base at step 40" in out


# ------------------------------------------------------------------------------ concurrency


def test_readers_holding_maps_keep_valid_views(tmp_path: Path) -> None:
    p = tmp_path / "log"
    make_log(p, "adamw", steps=30, segment_bytes=40000)
    with LogReader(p) as r:
        name = "@grad/emb.weight"
        views = {t: r.record(t).tensor(name) for t in (3, 12, 29)}
        copies = {t: np.array(v) for t, v in views.items()}
        bf = r.base(10)
        bview = bf.tensor("emb.weight")
        bcopy = np.array(bview)
        res = compact(str(p), keep_bases=1, materializer=materialize_base)
        assert res.plan.delete_segments
        assert 10 in res.plan.delete_bases
        assert not (p / BASE_NAME.format(10)).exists()
        for t, v in views.items():  # unlinked files: the mappings stay, values unchanged
            assert v.tobytes() == copies[t].tobytes()
        assert bview.tobytes() == bcopy.tobytes()
        assert r.record(5).tensor(name).shape == copies[3].shape  # still readable
        bf.close()
    with LogReader(p) as r:
        assert r.bases == [30]


def _writer_main(path: str, steps: int) -> None:
    """The live writer: trains ``adamw`` and checkpoints every step, slowly; every 5 steps
    it flushes, prints the step and waits for a line on stdin (the test's compaction
    round beside the next 5 steps has begun), so the rounds keep pace with the steps on a
    loaded machine too."""
    torch.set_num_threads(1)
    case = "adamw"
    o = build(case)
    with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                          snapshot_every=10, segment_bytes=40000, digest_every=1) as ckpt:
        for t in range(1, steps + 1):
            train_step(case, o, t)
            if t % 5 == 0:
                ckpt.flush()
                print(t, flush=True)
                if not sys.stdin.readline():
                    raise SystemExit("the test went away")
            time.sleep(0.004)
    print("done", flush=True)


def test_compaction_beside_a_live_writer(tmp_path: Path) -> None:
    """A writer process appends continuously; compactions run again and again beside it
    (sealed segments only), with a reader holding maps across each; the writer never
    notices, and the final log restores to the uninterrupted run's state, bit for bit.

    One round per 5 steps, counted, not timed: the writer waits at each flush until the
    round beside its next 5 steps has begun (it used to run freely beside rounds paced by
    a sleep, and on a loaded machine could finish after too few rounds, or add more bases
    after the last round than the final count allows)."""
    p = tmp_path / "log"
    steps = 240
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with subprocess.Popen([sys.executable, str(HERE / "test_compaction_torch.py"), str(p),
                           str(steps)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env=env) as proc:
        assert proc.stdout is not None
        assert proc.stdin is not None
        _ref, snaps = reference("adamw", steps, at=tuple(range(1, steps)))
        made: list[int] = []
        dropped = checked = rounds = 0
        for line in proc.stdout:
            if line.strip() == "done":
                break
            assert int(line) == 5 * (rounds + 1), line  # every flush, in order
            rounds += 1
            proc.stdin.write("go\n")  # the writer goes on beside this round
            proc.stdin.flush()
            with LogReader(p) as r:
                t0 = int(r.steps[0]) if len(r.steps) else 0
                held = r.record(t0).tensor("@grad/emb.weight")
                copy = np.array(held)
                res = compact(str(p), keep_bases=2, materializer=materialize_base)
                assert held.tobytes() == copy.tobytes()
            dropped += len(res.plan.delete_segments)
            if res.plan.new_base is not None:
                made.append(res.plan.new_base)
                # The base this compaction made is the exact state. Only a base made in this
                # round is checked: an earlier one may be gone already (keep_bases=2 against
                # the writer's own bases every 10 steps).
                if checked < 3:
                    st, _ = replay_state(p, made[-1])
                    assert_same(st, snaps[made[-1]]["model"], f"base {made[-1]}")
                    checked += 1
        proc.stdin.close()
        proc.wait(timeout=300)
    assert proc.returncode == 0
    assert rounds == steps // 5
    assert len(made) >= 3, (made, dropped)
    assert dropped > 0, (made, dropped)
    assert verify_log(str(p)).ok
    o = build("adamw")
    res = restore(p, o.model, o.optimizer, scheduler=o.scheduler)
    assert res.step == steps
    assert_same(snapshot(o), snaps[steps])
    with LogReader(p) as r:
        assert len(r.bases) <= 4  # two kept by the last compaction, plus the writer's since


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    _writer_main(sys.argv[1], int(sys.argv[2]))
