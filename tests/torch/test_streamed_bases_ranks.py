"""Streamed bases (``base_slices=k``) on several ranks: 2 gloo ranks on CPU, each rank's
shard streaming its share of every base over k steps, a rank SIGKILLed inside a base's
window (after its first slice, before its last), restored and continued bit for bit.

Two module fixtures, each a ``train`` launch (an uninterrupted reference run, then a
checkpointed one killed inside a window) and a ``resume`` launch on 2 ranks (restore,
compare with the reference, continue to the end, compare):

- ``ddp_run`` (``dist_worker.py``): DDP with the all-reduce hook (layout ``replicated``),
  ``snapshot_every=5``, ``base_slices=2`` (windows ``(4, 5)``, ``(9, 10)``, ``(14, 15)``,
  ...); rank 1 flushes after step 14 and SIGKILLs itself: the job restores step 14,
  inside the window of 15, from the streamed base of 10, and goes on to 20;
- ``fsdp_run`` (``fsdp_worker.py``): FSDP2 (bf16 mixed precision, clipping, gradient
  accumulation), ``snapshot_every=4``, ``base_slices=3`` (windows ``(2, 3, 4)``,
  ``(6, 7, 8)``, ``(10, 11, 12)``); in the same processes first a DDP +
  ``ZeroRedundancyOptimizer`` run (layout ``zero``, into ``ck-zero``) left open; both
  flushed after 11, then rank 1 is killed: each log restores 11 (inside the window of 12)
  from the streamed base of 8: FSDP2 into FSDP2 (continued to 14) and into DDP, ZeRO into
  ZeRO and into FSDP2, on 2 ranks.

The rest runs in this process on those logs: each shard's metadata, manifest and slice
files; restores into one process (resharding) at steps inside windows; ``replay_state``,
the CLI's ``verify``, ``replay`` and ``compact``. ``@pytest.mark.slow``: the ZeRO job
killed, restored and continued through ``dist_worker.py``, and the FSDP2 log restored at
3 and 4 ranks.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_worker import Net as DdpNet
from fsdp_worker import Net as FsdpNet
from fsdp_worker import differences, gathered
from test_distributed import dist_worker_servers, scenario  # noqa: F401 (autouse fixture)
from test_fsdp import fsdp_worker_servers  # noqa: F401 (autouse fixture)
from test_fsdp import launch as fsdp_launch
from test_fsdp import results as fsdp_results

from lowdiff_store.log import LogReader
from lowdiff_store.log.shards import read_shards_manifest
from lowdiff_store.torch import replay_state, restore
from tests.helpers.cli import run_cli
from tests.helpers.dist import NEEDS_GLOO

pytestmark = NEEDS_GLOO

#: DDP and ZeRO (dist_worker): a base every 5 steps, each streamed over 2; rank 1
#: flushed and killed after 14
DDP_K, DDP_STEPS, DDP_KILLED = 2, 20, 14
DDP = ("--hook", "allreduce", "--every", "5", "--base-slices", str(DDP_K), "--steps",
       str(DDP_STEPS), "--stop", str(DDP_KILLED), "--end", "kill", "--kill-rank", "1",
       "--flush-at", str(DDP_KILLED), "--flush-rank0")
#: FSDP2 and ZeRO (fsdp_worker): a base every 4 steps, each streamed over 3; both ranks
#: flush after 11, rank 1 is killed there
FSDP_K, FSDP_STEPS, FSDP_KILLED = 3, 14, 11
FSDP = ("--mp", "--clip", "--accum", "2", "--every", "4", "--base-slices", str(FSDP_K),
        "--steps", str(FSDP_STEPS), "--stop", str(FSDP_KILLED), "--flush-at",
        str(FSDP_KILLED))


def window(complete: int, k: int) -> tuple[int, ...]:
    """The steps a streamed base complete at ``complete`` takes its k slices after."""
    return tuple(range(complete - k + 1, complete + 1))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def shard_dirs(ck: Path) -> list[Path]:
    dirs = sorted(p for p in ck.iterdir() if p.name.startswith("rank-"))
    assert len(dirs) == read_shards_manifest(ck)["world_size"] >= 2
    return dirs


def streamed_shards(ck: Path, k: int, before_kill: list[int], unnamed: tuple[int, ...] = ()
                    ) -> dict[int, tuple[int, ...]]:
    """Check every shard of the checkpoint ``ck``: its metadata says k slices are in force;
    the bases ``before_kill`` (complete steps) are streamed in every shard, none a
    consistent one; every streamed base's slices were taken at the k steps of its window,
    on every rank (a rank's slice may hold none of its parameters, docs/distributed.md);
    the slice files on disk are those the manifest names and, of a log killed inside a
    window and not opened since, some of ``unnamed`` (the slices of the base in progress,
    left for the next checkpointer to remove). Returns the streamed bases every shard
    holds: complete step -> the steps of their slices."""
    per: list[dict[int, tuple[int, ...]]] = []
    for sd in shard_dirs(ck):
        with LogReader(sd) as rd:
            bs = rd.meta["torch"].get("base_slices")
            streamed, bases = dict(rd.streamed), list(rd.bases)
        assert bs is not None, sd.name
        assert (bs["k"], bs["in_force"], bs["why"]) == (k, k, None), (sd.name, bs)
        for c, steps in streamed.items():
            assert tuple(steps) == window(c, k), (sd.name, c, steps)
            assert c not in bases, (sd.name, c)
        assert set(before_kill) <= set(streamed), (sd.name, sorted(streamed), bases)
        on_disk = sorted(int(n[len("slice-"):len("slice-") + 16]) for n in os.listdir(sd)
                         if n.startswith("slice-") and n.endswith(".safetensors"))
        named = {s for steps in streamed.values() for s in steps}
        assert named <= set(on_disk), (sd.name, on_disk)
        assert set(on_disk) - named <= set(unnamed), (sd.name, on_disk, sorted(streamed))
        per.append(streamed)
    common = set(per[0]).intersection(*per[1:])
    return {c: tuple(per[0][c]) for c in sorted(common)}


def plan_of(ck: Path, streamed: dict[int, tuple[int, ...]], step: int
            ) -> tuple[int, list[int]]:
    """(base_step, base_slices) a restore of ``step`` must report: the newest base every
    shard holds that is complete at or before ``step`` (a streamed one when both are)."""
    held = []
    for sd in shard_dirs(ck):
        with LogReader(sd) as rd:
            held.append(set(rd.bases))
    c = max(b for b in set.intersection(*held) | set(streamed) if b <= step)
    return c, list(streamed.get(c, ()))


def inside_windows(streamed: dict[int, tuple[int, ...]]) -> list[int]:
    """The first slice step of every streamed base of more than one slice: a step after
    which that base is begun and not complete."""
    return sorted(steps[0] for steps in streamed.values() if len(steps) > 1)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """``test_distributed.scenario``: trained, rank 1 killed inside the window of 15,
    resumed on 2 ranks, restored and continued bitwise, exact."""
    d = tmp_path_factory.mktemp("ddp")
    return d, scenario(d, *DDP, killed=1)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    d = tmp_path_factory.mktemp("fsdp")
    fsdp_launch("train", d, *FSDP, "--also-source", "zero", "--also-end", "kill", "--end",
                "kill", "--kill-rank", "1", killed=1)
    for r in fsdp_results(d, "train-*"):
        assert r["perturbed"] == [], "the checkpointer changed training"
    fsdp_launch("resume", d, *FSDP, "--restore", ":fsdp", "--restore", ":ddp",
                "--restore", "zero:zero", "--restore", "zero:fsdp", "--continue")
    res = fsdp_results(d, "result")
    assert len(res) == 2
    return d, res


# ---------------------------------------------------------------------- DDP


def test_ddp_rank_killed_inside_a_window_restores_from_the_streamed_base(
        ddp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    """Restored at 14 on 2 ranks (inside the window of 15) from the streamed base of 10
    (slices 9 and 10), bitwise the reference there and, continued, at 20 (checked by
    ``scenario``); every shard streamed its bases: 5 and 10 before the kill, 20 after the
    resume."""
    d, res = ddp_run
    assert read_shards_manifest(d / "ck")["layout"] == "replicated"
    for r in res:
        assert r["step"] == DDP_KILLED, r
        assert (r["base_step"], r["base_slices"]) == (10, list(window(10, DDP_K))), r
        assert r["exact"], r["notes"]
        assert r["stats"]["base_slices"] > 0, r["stats"]
    streamed = streamed_shards(d / "ck", DDP_K, [5, 10])
    assert DDP_STEPS in streamed, sorted(streamed)   # the last base, after the resume


def test_ddp_one_process_restores_steps_inside_windows_from_the_base_before(
        ddp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    """A job of one process restores the 2-rank log (resharding) at the first slice step
    of each streamed base (inside its window), and at 17: from the complete base before,
    its slices reported, bitwise the reference (parameters, buffers as rank 0 holds them,
    optimizer state)."""
    d, _res = ddp_run
    streamed = streamed_shards(d / "ck", DDP_K, [5, 10])
    ref = torch.load(d / "out" / "ref-0.pt")
    targets = sorted({*inside_windows(streamed), 17})
    assert {4, 9} <= set(targets)
    for t in targets:
        m = DdpNet()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
        res = restore(d / "ck", m, opt, step=t)
        assert res.step == t
        assert (res.base_step, res.base_slices) == plan_of(d / "ck", streamed, t), t
        # (not res.exact: the all-reduce hook's state is not carried across a resharding)
        for k, v in m.state_dict().items():
            assert same_bits(v, ref[t]["model/" + k]), (t, k)
        for n, p in m.named_parameters():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert same_bits(opt.state[p][key], ref[t][f"opt/{n}/{key}"]), (t, n, key)


def test_ddp_replay_state_and_cli_on_streamed_shards(
        ddp_run: tuple[Path, list[dict[str, Any]]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``replay_state`` merges the shards bitwise at steps inside windows, at a streamed
    base and at the end; ``verify``, ``inspect`` and ``replay --to-step`` exit 0, and
    ``replay``'s file is the reference's state."""
    d, _res = ddp_run
    ref = torch.load(d / "out" / "ref-0.pt")
    for step in (None, 4, 9, 10, 14, 19):
        state, opt = replay_state(d / "ck", step, with_optimizer=True)
        s = DDP_STEPS if step is None else step
        assert set(state) == {k[len("model/"):] for k in ref[s] if k.startswith("model/")}
        for k, v in state.items():
            assert same_bits(v, ref[s]["model/" + k]), (s, k)
        assert opt is not None
        assert len(opt["state"]) == 8
        for i, name in enumerate(opt["param_groups"][0]["param_names"]):
            for key in ("exp_avg", "exp_avg_sq"):
                assert same_bits(opt["state"][i][key], ref[s][f"opt/{name}/{key}"]), (s, name)
    rc, out, err = run_cli(["verify", str(d / "ck")], capsys)
    assert rc == 0, out + err
    rc, out, err = run_cli(["inspect", str(d / "ck"), "--json"], capsys)
    assert rc == 0, out + err
    for step in (9, 14):
        dst = tmp_path / f"s{step}.pt"
        rc, out, err = run_cli(["replay", str(d / "ck"), "--to-step", str(step), "--out",
                                str(dst), "--format", "pt"], capsys)
        assert rc == 0, out + err
        got = torch.load(dst, weights_only=True)
        assert set(got) == {k[len("model/"):] for k in ref[step] if k.startswith("model/")}
        for k, v in got.items():
            assert same_bits(v, ref[step]["model/" + k]), (step, k)


def test_ddp_compact_a_streamed_sharded_log(ddp_run: tuple[Path, list[dict[str, Any]]],
                                            tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Compaction at a step inside a window (19, in the window of 20): every shard gets a
    base there, the log verifies, and the steps from it replay bitwise."""
    d, _res = ddp_run
    ck = tmp_path / "ck"
    shutil.copytree(d / "ck", ck)
    rc, out, err = run_cli(["compact", str(ck), "--step", "19", "--keep-bases", "2"], capsys)
    assert rc == 0, out + err
    for sd in shard_dirs(ck):
        with LogReader(sd) as rd:
            assert 19 in set(rd.bases) | {c for c, _s in rd.streamed}, sd.name
    rc, out, err = run_cli(["verify", str(ck)], capsys)
    assert rc == 0, out + err
    ref = torch.load(d / "out" / "ref-0.pt")
    for s in (19, 20):
        state, _ = replay_state(ck, s)
        for k, v in state.items():
            assert same_bits(v, ref[s]["model/" + k]), (s, k)


# ---------------------------------------------------------------------- FSDP2 and ZeRO


def _restored_killed_inside_a_window(res: list[dict[str, Any]], specs: tuple[str, ...]
                                     ) -> None:
    """Every rank's restore ``spec`` of the fsdp_worker's result: step 11 (inside the
    window of 12) from the streamed base of 8, slices 6, 7, 8, bitwise, exact."""
    for r in res:
        for spec in specs:
            got = r[spec]
            assert got["restored_bad"] == [], (spec, got)
            assert got["exact"], (spec, got["notes"])
            assert got["step"] == FSDP_KILLED, (spec, got)
            assert (got["base_step"], got["base_slices"]) == (8, list(window(8, FSDP_K))), \
                (spec, got)


def test_fsdp2_rank_killed_inside_a_window_restores_from_the_streamed_base(
        fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    """Restored at 11 on 2 ranks (inside the window of 12) from the streamed base of 8
    (slices 6, 7, 8), into FSDP2 (then continued to 14, bitwise) and into DDP."""
    d, res = fsdp_run
    assert read_shards_manifest(d / "ck")["layout"] == "fsdp"
    streamed_shards(d / "ck", FSDP_K, [4, 8])
    _restored_killed_inside_a_window(res, (":fsdp", ":ddp"))
    for r in res:
        assert r["final_bad"] == [], "continued run differs from the uninterrupted one"


def test_zero_rank_killed_inside_a_window_restores_from_the_streamed_base(
        fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    """The ZeRO job (each rank its optimizer partition, streamed), killed at 11: restored
    on 2 ranks into ZeRO and into FSDP2 from the streamed base of 8, bitwise."""
    d, res = fsdp_run
    assert read_shards_manifest(d / "ck-zero")["layout"] == "zero"
    # (killed inside the window of 12 and never opened again: its first slices may stay)
    streamed_shards(d / "ck-zero", FSDP_K, [4, 8], unnamed=(10, 11))
    _restored_killed_inside_a_window(res, ("zero:zero", "zero:fsdp"))


def _plain_fsdp_net() -> tuple[FsdpNet, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    m = FsdpNet()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))


def _one_process_restores(ck: Path, ref: dict[int, Any], steps: list[int | None],
                          unnamed: tuple[int, ...]) -> None:
    """Restore ``ck`` (2 ranks, streamed over FSDP_K) into a plain model in this process
    at each of ``steps``: the base every shard holds before it, bitwise ``ref``."""
    streamed = streamed_shards(ck, FSDP_K, [4, 8], unnamed)
    for step in steps:
        m, opt, sched = _plain_fsdp_net()
        res = restore(ck, m, opt, scheduler=sched, step=step)
        assert step is None or res.step == step
        assert (res.base_step, res.base_slices) == plan_of(ck, streamed, res.step), step
        assert res.exact, res.notes
        assert differences(gathered(m, opt), ref[res.step]) == [], res.step


@pytest.mark.parametrize("source", ["", "zero"])
def test_one_process_restores_every_step_of_a_streamed_sharded_log(
        fsdp_run: tuple[Path, list[dict[str, Any]]], source: str) -> None:
    """World size 1 (resharding into a plain model) of the FSDP2 log and of the ZeRO log:
    at the end and at every step up to the kill (those inside a window from the base
    before it), bitwise."""
    d, _res = fsdp_run
    ck = d / ("ck-" + source if source else "ck")
    ref = torch.load(d / "out" / ("ref-" + source + ".pt" if source else "ref.pt"))
    # (the ZeRO log was killed inside the window of 12 and never opened again)
    _one_process_restores(ck, ref, [None, *range(1, FSDP_KILLED + 1)],
                          unnamed=(10, 11) if source else ())


@pytest.mark.parametrize("source", ["", "zero"])
def test_fsdp2_and_zero_replay_state_and_cli(fsdp_run: tuple[Path, list[dict[str, Any]]],
                                             source: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``replay_state`` of the FSDP2 log (pieces assembled) and of the ZeRO log
    (partitions merged), with the optimizer state, at steps inside windows and at
    streamed bases; ``verify`` and ``replay --to-step 7`` (inside the window of 8) exit 0
    and write the reference's state."""
    d, _res = fsdp_run
    ck = d / ("ck-" + source if source else "ck")
    ref = torch.load(d / "out" / ("ref-" + source + ".pt" if source else "ref.pt"))
    for step in (3, 7, 8, 11):
        state, opt = replay_state(ck, step, with_optimizer=True)
        assert opt is not None
        assert set(state) == {k[len("model/"):] for k in ref[step] if k.startswith("model/")}
        for k, v in state.items():
            assert same_bits(v, ref[step]["model/" + k]), (step, k)
        names = opt["param_groups"][0]["param_names"]
        assert names == [n for n, _p in FsdpNet().named_parameters()]
        for i, n in enumerate(names):
            assert set(opt["state"][i]) == {"step", "exp_avg", "exp_avg_sq"}, (step, n)
            for key, v in opt["state"][i].items():
                assert same_bits(v, ref[step][f"opt/{n}/{key}"]), (step, n, key)
    rc, out, err = run_cli(["verify", str(ck)], capsys)
    assert rc == 0, out + err
    dst = tmp_path / "s7.pt"
    rc, out, err = run_cli(["replay", str(ck), "--to-step", "7", "--out", str(dst),
                            "--format", "pt"], capsys)
    assert rc == 0, out + err
    got = torch.load(dst, weights_only=True)
    assert set(got) == {k[len("model/"):] for k in ref[7] if k.startswith("model/")}
    for k, v in got.items():
        assert same_bits(v, ref[7]["model/" + k]), k


# ---------------------------------------------------------------------- slow variants


@pytest.mark.slow
def test_zero_job_killed_inside_a_window_restored_and_continued(tmp_path: Path) -> None:
    """``dist_worker.py`` with a ZeroRedundancyOptimizer (layout ``zero``), killed as the
    DDP job is: restored at 14 on 2 ranks from the streamed base of 10, continued to 20,
    bitwise; its shards streamed their bases."""
    res = scenario(tmp_path, *DDP, "--zero", killed=1)
    assert read_shards_manifest(tmp_path / "ck")["layout"] == "zero"
    for r in res:
        assert r["step"] == DDP_KILLED, r
        assert (r["base_step"], r["base_slices"]) == (10, list(window(10, DDP_K))), r
    streamed = streamed_shards(tmp_path / "ck", DDP_K, [5, 10])
    assert DDP_STEPS in streamed, sorted(streamed)


@pytest.mark.slow
def test_fsdp2_streamed_log_restored_at_three_and_four_ranks(
        fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    d, _res = fsdp_run
    for world in (3, 4):
        fsdp_launch("resume", d, *FSDP, "--restore", ":fsdp", "--restore", "zero:fsdp",
                    "--tag", f"w{world}", world=world)
        got = fsdp_results(d, f"w{world}")
        assert len(got) == world
        for r in got:
            for spec in (":fsdp", "zero:fsdp"):
                assert r[spec]["restored_bad"] == [], (world, spec)
                assert r[spec]["exact"], r[spec]["notes"]


@pytest.mark.slow
def test_hsdp_four_ranks_killed_inside_a_window(tmp_path: Path) -> None:
    """A 2-D mesh (2 replicas x 2 shards, the replicas splitting the writing: a rank's
    slice may hold none of its parameters), SGD with momentum, a base every 3 steps
    streamed over 2; every rank flushed after 8, rank 2 killed there (inside the window
    of 9): restored at 4 ranks from the streamed base of 6 and continued to 10, bitwise;
    the log also restores into one process at every step."""
    args = ("--hsdp", "--keep-unsharded", "--optimizer", "sgd", "--steps", "10",
            "--stop", "8", "--flush-at", "8", "--every", "3", "--base-slices", "2")
    fsdp_launch("train", tmp_path, *args, "--end", "kill", "--kill-rank", "2", world=4,
                killed=2)
    fsdp_launch("resume", tmp_path, *args, "--restore", ":fsdp", "--continue", world=4)
    got = fsdp_results(tmp_path, "result")
    assert len(got) == 4
    for r in got:
        assert r[":fsdp"]["restored_bad"] == []
        assert r[":fsdp"]["exact"], r[":fsdp"]["notes"]
        assert (r[":fsdp"]["step"], r[":fsdp"]["base_step"], r[":fsdp"]["base_slices"]) == \
            (8, 6, [5, 6])
        assert r["final_bad"] == []
    ck = tmp_path / "ck"
    streamed = streamed_shards(ck, 2, [3, 6])
    ref = torch.load(tmp_path / "out" / "ref.pt")
    for step in (None, *range(1, 9)):
        torch.manual_seed(0)
        m = FsdpNet()
        opt = torch.optim.SGD(m.parameters(), lr=5e-2, momentum=0.9)
        res = restore(ck, m, opt, step=step)
        assert (res.base_step, res.base_slices) == plan_of(ck, streamed, res.step), step
        assert differences(gathered(m, opt), ref[res.step]) == [], res.step
