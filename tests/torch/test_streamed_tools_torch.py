"""The tools over a torch log with streamed bases (issue 50, items 1 and 5): ``verify`` and
``inspect`` read them as replay does, ``replay --to-step`` and the DCP export give the
reference state bit for bit, compaction makes a consistent base from a streamed one (the
base a consistent checkpointer writes at that step) and keeps what a streamed base in
progress needs while a writer is taking it, and a log left with streamed bases only still
replays."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cases import assert_same, build, ckpt_kwargs, reference, run, snapshot
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lowdiff_store.compaction import compact
from lowdiff_store.errors import FormatError, LowdiffError, Reason
from lowdiff_store.format.constants import BASE_NAME, SLICE_NAME
from lowdiff_store.log import LogReader
from lowdiff_store.log import writer as log_writer
from lowdiff_store.log.base import BaseFile, store_base
from lowdiff_store.log.manifest import load_manifest
from lowdiff_store.report.facts import collect
from lowdiff_store.report.html import render
from lowdiff_store.storage import open_store
from lowdiff_store.torch import DiffCheckpointer, materialize_base, replay_state, restore
from lowdiff_store.verify import inspect_log, verify_log
from tests.helpers.cli import run_cli as cli_run
from tests.helpers.timing import scaled
from tests.helpers.tiny import one_thread

STEPS = 22
CASE = "adamw"
#: snapshot_every=6, base_slices=3: base 0, streamed bases complete at 6, 12, 18
STREAMED = [(6, (4, 5, 6)), (12, (10, 11, 12)), (18, (16, 17, 18))]


#: what the autouse fixture of conftest.py does, for the module-scoped fixtures
_one_thread = contextlib.contextmanager(one_thread)


def _ckpt(path: Path, o: Any, **kw: Any) -> DiffCheckpointer:
    opts = {**ckpt_kwargs(CASE), "snapshot_every": 6, "base_slices": 3, **kw}
    return DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, **opts)


@pytest.fixture(scope="module")
def streamed_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("streamed") / "log"
    with _one_thread():
        o = build(CASE)
        with _ckpt(path, o) as ckpt:
            run(CASE, o, 0, STEPS, ckpt)
    with LogReader(path) as r:
        assert (r.bases, r.streamed) == ([0], STREAMED)
    return path


@pytest.fixture(scope="module")
def ref() -> dict[int, Any]:
    with _one_thread():
        return reference(CASE, STEPS, at=tuple(range(1, STEPS + 1)))[1]


@pytest.fixture
def log(streamed_log: Path, tmp_path: Path) -> Path:
    """A copy of the module's log, for a test that changes it."""
    p = tmp_path / "log"
    shutil.copytree(streamed_log, p)
    return p




def restored(path: Path, step: int) -> tuple[dict[str, Any], Any]:
    o = build(CASE)
    res = restore(path, o.model, o.optimizer, scheduler=o.scheduler, step=step)
    return snapshot(o), res


def opt_by_name(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A reference optimizer state as ``@opt/NAME/KEY`` tensors (the export's names)."""
    names = [n for n, _p in build(CASE).model.named_parameters()]
    return {f"@opt/{names[i]}/{k}": v for i, st in state["state"].items()
            for k, v in st.items() if isinstance(v, torch.Tensor)}


# --------------------------------------------------------------------- verify, inspect


def test_verify_and_inspect_read_the_streamed_bases(streamed_log: Path,
                                                    capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    rep = verify_log(str(streamed_log))
    assert (rep.ok, rep.bases, rep.streamed, rep.records) == (True, 1, 3, STEPS)
    rc, out, _err = cli_run(["inspect", str(streamed_log), "--json"], capsys)
    assert rc == 0
    info = json.loads(out)
    assert info["base_slices"] == info["torch"]["base_slices"] == {
        "k": 3, "in_force": 3, "why": None}
    assert info["torch"]["steps"]["streamed"] == [{"complete": c, "slices": list(sl)}
                                                  for c, sl in STREAMED]
    assert [e["complete"] for e in info["streamed"]] == [6, 12, 18]
    assert "base_slices" not in info.get("meta", {}).get("torch", {})  # shown once
    rc, out, _err = cli_run(["inspect", str(streamed_log)], capsys)
    assert rc == 0
    rows = dict(ln.split("  ", 1) for ln in out.splitlines() if "  " in ln)
    assert rows["base slices"].strip() == "3 per base (asked 3)"
    assert rows["streamed bases"].strip().startswith("6 (slices 4, 5, 6: ")


def test_inspect_says_why_bases_are_consistent(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    o = build("demo")  # DeMo's step is not vouched per tensor: consistent bases
    with DiffCheckpointer(tmp_path / "log", o.model, o.optimizer, scheduler=o.scheduler,
                          compressor=o.compressor, **{**ckpt_kwargs("demo"),
                                                      "base_slices": 3}) as ckpt:
        run("demo", o, 0, 4, ckpt)
    info = inspect_log(str(tmp_path / "log"))
    bs = info["base_slices"]
    assert (bs["k"], bs["in_force"], info["streamed"]) == (3, 1, [])
    assert "is not known to step each parameter on its own" in bs["why"]
    rc, out, _err = cli_run(["inspect", str(tmp_path / "log")], capsys)
    assert rc == 0
    assert f"base slices                  asked 3, consistent bases taken instead: {bs['why']}" \
        in out


def test_inspect_and_the_report_of_base_slices_auto(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    o = build(CASE)
    with _ckpt(tmp_path / "log", o, base_slices="auto") as ckpt:
        run(CASE, o, 0, 3, ckpt)
    bs = inspect_log(str(tmp_path / "log"))["base_slices"]
    assert (bs["k"], bs["why"]) == ("auto", None)
    rc, out, _err = cli_run(["inspect", str(tmp_path / "log")], capsys)
    assert rc == 0
    assert f"base slices                  auto: chosen before each base ({bs['in_force']} at " \
        "the start)" in out
    page = render(collect(str(tmp_path / "log")), with_plots=False)
    assert f"<td>base slices</td><td>auto, {bs['in_force']} at the start" in page


def test_the_report_shows_streamed_bases_and_their_recovery(streamed_log: Path) -> None:
    rep = collect(str(streamed_log))
    summary = rep.summary()["logs"][0]
    assert summary["base_slices"] == {"k": 3, "in_force": 3, "why": None}
    assert [e["complete"] for e in summary["streamed"]] == [6, 12, 18]
    page = render(rep, with_plots=False)
    assert "<td>base slices</td><td>3 (streamed bases, spec section 7.2)</td>" in page
    # the worst case of each interval: steps 11, 17, 22 replay from the first slice
    for step, base, first, replayed in ((11, 6, 4, 7), (17, 12, 10, 7), (22, 18, 16, 6)):
        assert (f'<td class="n">{step}</td><td class="n">{base} (streamed: replays from '
                f'{first})</td><td class="n">{replayed}</td>') in page


def test_an_optimizer_state_outside_its_slice_is_refused_by_verify_and_replay(
        log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Slice 4 lays out ``emb.weight``'s state, but its ``exp_avg`` moved to slice 5:
    replay would move it at the wrong steps. ``verify`` says so as restore does."""
    store = open_store(str(log))
    moved = "@opt/emb.weight/exp_avg"
    files = {}
    for s in (4, 5):
        with BaseFile(str(log / SLICE_NAME.format(s))) as f:
            files[s] = ({n: (f.info(n)[0], f.tensor(n).copy()) for n in f.names}, f.meta())
    files[5][0][moved] = files[4][0].pop(moved)
    for s, (tensors, meta) in files.items():
        store.delete(SLICE_NAME.format(s))
        store_base(store, s, tensors, meta, load_manifest(log).log_id, name=SLICE_NAME)
    rep = verify_log(str(log))
    assert [(p.reason, p.path) for p in rep.problems] == [
        (Reason.BAD_METADATA, str(log / SLICE_NAME.format(4)))]
    assert moved in rep.problems[0].detail
    rc, out, _err = cli_run(["verify", str(log)], capsys)
    assert rc == 3
    assert out.startswith(f"{log / SLICE_NAME.format(4)}:-: bad_metadata: ")
    with pytest.raises(FormatError) as ei:
        restored(log, 8)
    assert (ei.value.reason, ei.value.path) == (Reason.BAD_METADATA,
                                                str(log / SLICE_NAME.format(4)))


# --------------------------------------------------------------------- replay, export


@pytest.mark.parametrize("step", [5, 6, 11, 17, STEPS])
def test_cli_replay_from_a_streamed_base_is_bitwise(
        streamed_log: Path, ref: dict[int, Any], step: int, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "state.safetensors"
    rc, stdout, err = cli_run(["replay", str(streamed_log), "--to-step", str(step), "--out",
                               str(out), "--with-optimizer", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(stdout)["step"] == step
    got = load_file(out)
    opt = {k: v for k, v in got.items() if k.startswith("@opt/")}
    assert_same({k: v for k, v in got.items() if k not in opt}, ref[step]["model"])
    assert_same(opt, opt_by_name(ref[step]["optimizer"]))


def _dcp_load(path: Path) -> Any:
    o = build(CASE)
    sd = {"model": get_model_state_dict(o.model),
          "optim": get_optimizer_state_dict(o.model, o.optimizer)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: this process alone
        dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(o.model, sd["model"])
    set_optimizer_state_dict(o.model, o.optimizer, sd["optim"])
    return o


def test_export_dcp_from_a_streamed_base_loads_the_reference_state(
        streamed_log: Path, ref: dict[int, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dcp"
    rc, stdout, err = cli_run(["replay", str(streamed_log), "--to-step", "17", "--out",
                               str(out), "--format", "dcp", "--with-optimizer", "--json"],
                              capsys)
    assert rc == 0, err
    assert json.loads(stdout)["format"] == "dcp"
    o = _dcp_load(out)
    assert_same(dict(o.model.state_dict()), ref[17]["model"])
    assert_same(o.optimizer.state_dict()["state"], ref[17]["optimizer"]["state"])


# --------------------------------------------------------------------- compaction


def _torch_meta(path: Path) -> tuple[dict[str, bytes], dict[str, Any]]:
    """A base's tensors (bytes) and its torch metadata without ``log`` (which names the
    log's options)."""
    with BaseFile(str(path)) as b:
        tensors = {n: b.tensor(n).tobytes() for n in b.names}
        meta = dict(b.meta())
    inner = dict(meta.pop("torch"))
    inner.pop("log")
    return tensors, {**meta, "torch": inner}


def test_compaction_makes_the_consistent_base_from_a_streamed_one(
        log: Path, ref: dict[int, Any], tmp_path: Path) -> None:
    res = compact(str(log), step=12, keep_bases=2, materializer=materialize_base)
    assert (res.plan.new_base, res.plan.keep_bases, res.plan.delete_bases) == (12, [12, 18],
                                                                               [0])
    assert [c for c, _s in res.plan.delete_streamed] == [6, 12]
    m = load_manifest(log)
    assert (m.bases, m.streamed) == ([12], [STREAMED[2]])
    assert sorted(n for n in os.listdir(log) if n.startswith("slice-")) == [
        SLICE_NAME.format(s) for s in STREAMED[2][1]]
    # the base a consistent checkpointer writes at step 12, tensor for tensor
    plain = tmp_path / "plain"
    o = build(CASE)
    with _ckpt(plain, o, base_slices=1) as ckpt:
        run(CASE, o, 0, 12, ckpt)
    assert _torch_meta(log / BASE_NAME.format(12)) == _torch_meta(plain / BASE_NAME.format(12))
    for t, base in ((12, 12), (15, 12), (17, 12), (18, 18), (STEPS, 18)):
        state, r = restored(log, t)
        assert (r.base_step, r.base_slices, r.exact) == (
            base, [16, 17, 18] if base == 18 else [], True)
        assert_same(state, ref[t])
    assert verify_log(str(log)).ok


def test_a_log_left_with_streamed_bases_only_replays(log: Path, ref: dict[int, Any],
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    res = compact(str(log), keep_bases=2)  # retention only
    assert (res.plan.delete_bases, [c for c, _s in res.plan.delete_streamed]) == ([0], [6])
    m = load_manifest(log)
    assert (m.bases, m.streamed) == ([], STREAMED[1:])
    with LogReader(log) as r:
        assert (r.first_step, r.durable_step) == (12, STEPS)
    for t in (12, 14, STEPS):
        state, r = restored(log, t)
        assert (r.base_step, r.exact) == (12 if t < 18 else 18, True)
        assert_same(state, ref[t])
    got, _ = replay_state(log, 14)
    assert_same(got, ref[14]["model"])
    out = tmp_path / "s.safetensors"
    rc, _out, err = cli_run(["replay", str(log), "--to-step", "20", "--out", str(out)],
                            capsys)
    assert rc == 0, err
    assert_same(load_file(out), ref[20]["model"])
    with pytest.raises(LowdiffError) as ei:
        restored(log, 11)  # before the oldest base kept
    assert ei.value.reason is Reason.NO_BASE
    # a new base from there: the CLI's compaction replays from the streamed base
    rc, _out, err = cli_run(["compact", str(log), "--keep-bases", "1"], capsys)
    assert rc == 0, err
    assert load_manifest(log).bases == [STEPS]
    state, r = restored(log, STEPS)
    assert (r.base_step, r.replayed) == (STEPS, 0)
    assert_same(state, ref[STEPS])


def _logged(path: Path) -> int:
    """The newest step of the diffs on disk, contiguous from the log's newest base."""
    with LogReader(path) as r:
        return r.durable_step if r.durable_step is not None else -1


def test_compaction_beside_a_writer_taking_a_streamed_base(
        tmp_path: Path, ref: dict[int, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's base thread is held between the last slice of the base complete at 12
    and the commit naming it (at the writer's slice hook) while training and the diff log
    go on (step 14 durable); a compaction makes a base at the durable step and keeps one
    base. The diffs after step 10 (the first slice of the base in progress) stay, its
    slices stay (a writer holds the log), the commit names a restorable base, and the log
    ends bitwise."""
    held, release = threading.Event(), threading.Event()

    def hook(point: str, step: int) -> None:
        if (point, step) == ("before-commit", 12):
            held.set()
            release.wait(scaled(300))

    monkeypatch.setattr(log_writer, "_slice_point", hook)
    path = tmp_path / "log"
    o = build(CASE)
    with _ckpt(path, o, segment_bytes=4096) as ckpt:
        try:  # (released before the checkpointer closes, which waits for the commit)
            run(CASE, o, 0, 15, ckpt)  # step 14 complete (15 is, at the next step)
            assert held.wait(scaled(120))
            deadline = time.monotonic() + scaled(120)
            while _logged(path) < 14 and time.monotonic() < deadline:
                time.sleep(0.01)  # (the diffs go on; the checkpointer reports 12 durable
            assert _logged(path) == 14  # only once the base there is published)
            assert load_manifest(path).streamed == [STREAMED[0]]  # 12: not named yet
            res = compact(str(path), keep_bases=1, materializer=materialize_base)
            assert (res.plan.new_base, res.plan.keep_bases) == (14, [14])
            m = load_manifest(path)
            assert (m.bases, m.streamed) == ([14], [])  # the base at 12 still in progress
            assert all((path / SLICE_NAME.format(s)).exists() for s in (10, 11, 12))
            with LogReader(path) as r:
                assert int(r.steps[0]) <= 11  # the diffs after the first slice, 10
        finally:
            release.set()
        run(CASE, o, 15, STEPS, ckpt)
    with LogReader(path) as r:
        assert (r.bases, r.streamed) == ([14], [STREAMED[1], STREAMED[2]])
    assert verify_log(str(path)).ok
    for t in (12, 13, 17, STEPS):
        state, r = restored(path, t)
        assert (r.base_step, r.exact) == ({12: 12, 13: 12, 17: 14}.get(t, 18), True)
        assert_same(state, ref[t])
