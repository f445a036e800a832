"""A rank directory (``CKPT/rank-0000N``) of a sharded checkpoint given to ``lowdiff-store
replay``, :func:`~lowdiff_store.torch.restore` or :func:`~lowdiff_store.torch.replay_state`
on its own (issue 48, item 3).

Per layout (format_spec/log_format.md, section 6.2): the ranks of a ``replicated`` (DDP),
``zero`` or ``fsdp`` checkpoint split one state between them, so one rank's log is no whole
state: refused in one line naming the checkpoint directory to replay instead (CLI exit 2,
``ConfigError(invalid_argument)``), nothing written. Before, the CLI said ``internal error:
KeyError: 'fc1.weight'`` (DDP, ZeRO) or replayed FSDP2 pieces as if they were the model.
Each rank of a ``local`` checkpoint (local-update training) logs a whole replica of its
own: its directory replays that replica, as ``CKPT --rank N`` does. Before, it was replayed
as a plain log and reported ``replay_diverged`` at the first synchronization.

The refusals use copies of the golden logs (nothing is replayed); the replica is written
fresh here, in this process.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lowdiff_store import cli
from lowdiff_store.errors import ConfigError
from lowdiff_store.log.manifest import update_manifest
from lowdiff_store.log.shards import read_shards_manifest, write_shards_manifest
from lowdiff_store.torch import DiffCheckpointer, DiLoCo, replay_state, restore
from tests.golden import recipes as R
from tests.helpers.tiny import bits_differ

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "logs"
EXIT_USAGE = 2

#: golden case -> (layout, what its ranks hold) as the refusal says it
SPLIT = {
    "ddp_allreduce": ("replicated", "the ranks split the parameters between them"),
    "zero_topk_allgather": ("zero", "each rank logs its own partition of the optimizer"),
    "fsdp2": ("fsdp", "each rank logs its pieces of the sharded parameters"),
}


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _refusal(rank_dir: str, root: str, layout: str, held: str) -> str:
    """The one line of the refusal (``str`` of the error)."""
    return (f"{rank_dir}: invalid_argument: rank 1 of the 2-rank checkpoint {root} "
            f"(layout {layout!r}: {held}) is not a whole state alone: replay the "
            f"checkpoint directory {root} instead")


@pytest.mark.parametrize("case", sorted(SPLIT))
def test_a_rank_directory_of_a_split_layout_is_refused(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``replay CKPT/rank-00001`` of a DDP, ZeRO or FSDP2 checkpoint: exit 2, one line
    naming the checkpoint directory, nothing written; through a symlink to the rank
    directory, the same naming the checkpoint it lies in; ``replay_state`` and
    ``restore`` raise ``ConfigError(invalid_argument)`` with the same line."""
    layout, held = SPLIT[case]
    root = tmp_path / case
    shutil.copytree(GOLDEN / case, root)
    assert read_shards_manifest(str(root))["layout"] == layout
    before = _tree(root)
    rank_dir = str(root / "rank-00001")
    want = _refusal(rank_dir, str(root), layout, held)
    out = tmp_path / "x.safetensors"

    rc, stdout, err = _cli(["replay", rank_dir, "--out", str(out)], capsys)
    assert rc == EXIT_USAGE, err
    assert err == f"lowdiff-store replay: error: {want}\n"
    assert stdout == ""

    link = tmp_path / "elsewhere" / "r1"
    link.parent.mkdir()
    link.symlink_to(root / "rank-00001", target_is_directory=True)
    real = os.path.realpath(root)
    rc, stdout, err = _cli(["replay", str(link), "--out", str(out)], capsys)
    assert rc == EXIT_USAGE, err
    assert err == (f"lowdiff-store replay: error: "
                   f"{_refusal(str(link), real, layout, held)}\n")

    with pytest.raises(ConfigError) as ei:
        replay_state(rank_dir)
    assert ei.value.reason.value == "invalid_argument"
    assert str(ei.value) == want
    o = R.build(_recipe(case), layout="plain")
    with pytest.raises(ConfigError) as ei:
        restore(rank_dir, o.model, o.optimizer, scheduler=o.scheduler)
    assert ei.value.reason.value == "invalid_argument"
    assert str(ei.value) == want

    assert not out.exists()
    assert _tree(root) == before


@pytest.mark.parametrize("case", sorted(SPLIT))
def test_a_rank_log_moved_out_of_its_checkpoint_is_refused(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1's log of a DDP, ZeRO or FSDP2 checkpoint copied out alone (no ``SHARDS``
    above it): its shard section says what it is, so ``replay_state``, ``restore`` and
    ``replay`` refuse it once it is open, ``ConfigError(invalid_argument)``, one line (the
    CLI: exit 1, found in the log, not in the arguments), nothing written. Before: an
    internal ``KeyError`` (DDP, ZeRO), or FSDP2 pieces replayed as the model."""
    layout, held = SPLIT[case]
    alone = tmp_path / "alone"
    shutil.copytree(GOLDEN / case / "rank-00001", alone)
    want = (f"{alone}: invalid_argument: rank 1 of a 2-rank checkpoint (layout {layout!r}: "
            f"{held}) is not a whole state alone: replay the checkpoint directory it "
            f"belongs to (the one holding its SHARDS and every rank) instead")
    with pytest.raises(ConfigError) as ei:
        replay_state(str(alone))
    assert str(ei.value) == want
    o = R.build(_recipe(case), layout="plain")
    with pytest.raises(ConfigError) as ei:
        restore(str(alone), o.model, o.optimizer, scheduler=o.scheduler)
    assert str(ei.value) == want
    out = tmp_path / "x.safetensors"
    rc, stdout, err = _cli(["replay", str(alone), "--out", str(out)], capsys)
    assert rc == 1, err
    assert err == f"lowdiff-store: error: {want}\n"
    assert stdout == ""
    assert not out.exists()


def _recipe(case: str) -> dict[str, Any]:
    """The golden case's recipe (``R.build`` makes its objects)."""
    expected = json.loads((GOLDEN.parent / "expected.json").read_text())["cases"]
    recipe: dict[str, Any] = expected[case]["recipe"]
    return recipe


# ------------------------------------------------------------------ local-update replicas

STEPS = 5   # DiLoCo, H = 3: an outer step after step 3, then two inner steps apart


def _diloco() -> tuple[torch.nn.Module, DiLoCo, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.ExponentialLR(inner, gamma=0.9)
    return model, DiLoCo(inner, outer_lr=0.7, outer_momentum=0.9, period=3), sched


def _train(o: tuple[torch.nn.Module, DiLoCo, Any], replica: int) -> None:
    model, opt, sched = o
    for t in range(STEPS):
        g = torch.Generator().manual_seed(1000 * t + replica)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _state(o: tuple[torch.nn.Module, DiLoCo, Any]) -> dict[str, torch.Tensor]:
    """A replica: parameters, inner AdamW state, global parameters, outer momentum,
    counters."""
    model, opt, _sched = o
    out = {f"p/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, p in enumerate(opt.params):
        for k, v in opt.optim.state.get(p, {}).items():
            out[f"o/{i}/{k}"] = torch.as_tensor(v).clone()
    for i, g in enumerate(opt.global_params):
        out[f"g/{i}"] = g.detach().clone()
        out[f"m/{i}"] = opt.outer.state[g]["momentum_buffer"].clone()
    out["counters"] = torch.tensor([opt.steps, opt.next_sync, opt.period, opt.syncs])
    return out



def _two_replicas(tmp_path: Path) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """A 2-rank DiLoCo checkpoint (layout ``local``) written in this process: each replica
    trained on batches of its own by a 1-rank job, its log moved to its rank directory and
    its ``local`` section set to its place (what a 2-rank job's rank writes; DiLoCo's outer
    all-reduce over one rank is the identity). Returns it and each replica's live state."""
    root = tmp_path / "ck"
    root.mkdir()
    live = []
    meta: dict[str, Any] = {}
    for r in range(2):
        job = tmp_path / f"job{r}"
        o = _diloco()
        with DiffCheckpointer(str(job), o[0], o[1], scheduler=o[2], snapshot_every=4,
                              digest_every=1):
            _train(o, r)
        live.append(_state(o))
        meta = read_shards_manifest(str(job))["meta"]
        shutil.move(str(job / "rank-00000"), str(root / f"rank-{r:05d}"))
        update_manifest(str(root / f"rank-{r:05d}"),
                        lambda m, r=r: m.meta["torch"]["local"].update(rank=r, world_size=2))
    write_shards_manifest(str(root), 2, layout="local", meta=meta)
    return root, live


def test_a_rank_directory_of_local_update_replays_its_replica(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``replay CKPT/rank-00001`` of a local-update checkpoint writes replica 1's
    parameters at the newest step, bitwise (as ``replay CKPT --rank 1``; replica 0's
    differ); ``replay_state`` gives them and the inner optimizer's state; ``restore``
    puts replica 1 (parameters, inner state, DiLoCo's global parameters, momentum and
    counters) into the objects. ``--rank 0`` with rank 1's directory, and a directory
    ``rank-00002`` of the 2-rank checkpoint: exit 2, one line, nothing written."""
    root, live = _two_replicas(tmp_path)
    rank_dir = str(root / "rank-00001")
    params = {k[2:]: v for k, v in live[1].items() if k.startswith("p/")}
    assert any(not torch.equal(v, live[0][f"p/{k}"]) for k, v in params.items())

    out = tmp_path / "r1.safetensors"
    rc, stdout, err = _cli(["replay", rank_dir, "--out", str(out)], capsys)
    assert rc == 0, err
    assert stdout.startswith(f"wrote 4 model tensors of replica 1 at step {STEPS} to "), stdout
    assert bits_differ(load_file(str(out)), params) == []
    by_rank = tmp_path / "by-rank.safetensors"
    assert cli.main(["replay", str(root), "--rank", "1", "--out", str(by_rank)]) == 0
    assert by_rank.read_bytes() == out.read_bytes()

    state, opt = replay_state(rank_dir, with_optimizer=True)
    assert bits_differ(state, params) == []
    assert opt is not None
    assert opt["param_groups"][0]["param_names"] == list(params)
    got_opt = {f"o/{i}/{k}": torch.as_tensor(v) for i, s in opt["state"].items()
               for k, v in s.items()}
    assert bits_differ(got_opt, {k: v for k, v in live[1].items() if k.startswith("o/")}) == []

    o = _diloco()
    res = restore(rank_dir, o[0], o[1], scheduler=o[2])
    assert (res.step, res.exact) == (STEPS, True), res.notes
    assert bits_differ(_state(o), live[1]) == []

    shutil.copytree(root / "rank-00001", root / "rank-00002")
    before = _tree(root)
    for argv, line in (
            (["replay", rank_dir, "--rank", "0", "--out", str(tmp_path / "x.safetensors")],
             f"{rank_dir}: invalid_argument: rank 0 was asked of the directory of rank 1 "
             f"of the checkpoint {root}: give {root} with rank 0, or this directory "
             f"without a rank"),
            (["replay", str(root / "rank-00002"), "--out", str(tmp_path / "x.safetensors")],
             f"{root / 'rank-00002'}: invalid_argument: rank-00002 is not a rank of the "
             f"2-rank checkpoint {root} (ranks 0..1)")):
        rc, stdout, err = _cli(argv, capsys)
        assert rc == EXIT_USAGE, (argv, err)
        assert err == f"lowdiff-store replay: error: {line}\n", argv
    assert not (tmp_path / "x.safetensors").exists()
    assert _tree(root) == before


@pytest.mark.parametrize("case", sorted(SPLIT))
def test_compact_of_a_rank_directory_of_a_split_layout_is_refused(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``compact CKPT/rank-00001`` (also ``--dry-run``) of a DDP, ZeRO or FSDP2 checkpoint:
    exit 2, one line naming the checkpoint directory to compact, nothing changed. Before:
    an internal ``KeyError`` (DDP, ZeRO), after a dry run that claimed a base."""
    layout, held = SPLIT[case]
    root = tmp_path / case
    shutil.copytree(GOLDEN / case, root)
    before = _tree(root)
    rank_dir = str(root / "rank-00001")
    want = _refusal(rank_dir, str(root), layout, held).replace(
        "alone: replay the", "alone: compact the")
    for extra in ([], ["--dry-run"]):
        rc, stdout, err = _cli(["compact", rank_dir, *extra], capsys)
        assert rc == EXIT_USAGE, err
        assert err == f"lowdiff-store compact: error: {want}\n"
        assert stdout == ""
    assert _tree(root) == before


def test_compact_of_a_rank_directory_of_local_update(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``compact CKPT/rank-00001`` of a local-update checkpoint compacts replica 1, as
    ``compact CKPT --rank 1``: rank 0's files are untouched, and replica 1 still replays
    bitwise to its newest step."""
    root, live = _two_replicas(tmp_path)
    rank0 = _tree(root / "rank-00000")
    rc, stdout, err = _cli(["compact", str(root / "rank-00001")], capsys)
    assert rc == 0, err
    assert stdout.startswith(f"wrote base at step {STEPS}"), stdout
    assert _tree(root / "rank-00000") == rank0
    params = {k[2:]: v for k, v in live[1].items() if k.startswith("p/")}
    state, _opt = replay_state(str(root / "rank-00001"))
    assert bits_differ(state, params) == []
