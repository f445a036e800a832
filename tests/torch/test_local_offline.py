"""Local-update checkpoints in one process (DiLoCo and post-local SGD at world size 1, and
checkpoints of several ranks built by copying one rank's shard): what is refused before
anything is written, the digest over DiLoCo's outer state, and the offline tools (compact
and replay, per replica with ``--rank``). The multi-rank runs are in
``test_local_update.py``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lowdiff_store import cli
from lowdiff_store.compaction import compact, publish_base
from lowdiff_store.errors import ConfigError, LowdiffError, ReplayError
from lowdiff_store.log import LogReader
from lowdiff_store.torch import (
    DiffCheckpointer,
    DiLoCo,
    TorchMaterializer,
    replay_state,
    restore,
    restore_replica,
)
from lowdiff_store.torch.distributed.local_offline import materialize_replica
from lowdiff_store.torch.distributed.local_update import DiLoCoUpdate
from tests.helpers.tiny import bits_differ

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)

STEPS = 11  # H = 3: outer steps after steps 3, 6, 9


def _diloco(period: int = 3) -> tuple[torch.nn.Module, DiLoCo, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.ExponentialLR(inner, gamma=0.9)
    return model, DiLoCo(inner, outer_lr=0.7, outer_momentum=0.9, period=period), sched


@pytest.mark.parametrize("exists", [False, True])
def test_scaler_refused_before_anything_is_written(tmp_path: Path, exists: bool) -> None:
    """A GradScaler with a local-update optimizer: ``not_allowed``, one line naming the
    directory, and the directory untouched (not created; or left empty when it existed):
    no ``SHARDS``, no shard log."""
    d = tmp_path / "ck"
    if exists:
        d.mkdir()
    model, opt, _sched = _diloco()
    with pytest.raises(ConfigError) as ei:
        DiffCheckpointer(str(d), model, opt, snapshot_every=5,
                         scaler=torch.amp.GradScaler("cpu"))
    assert ei.value.reason.value == "not_allowed"
    assert "scaler" in str(ei.value)
    assert "\n" not in str(ei.value)
    assert str(d) in str(ei.value)
    if exists:
        assert os.listdir(d) == []
    else:
        assert not d.exists()
    # the same directory then takes a checkpointer without the scaler
    DiffCheckpointer(str(d), model, opt, snapshot_every=5).close()
    assert sorted(os.listdir(d)) == ["SHARDS", "rank-00000"]


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _train(o: tuple[torch.nn.Module, DiLoCo, Any], start: int, stop: int) -> None:
    model, opt, sched = o
    for t in range(start, stop):
        x, y = _batch(t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _snapshot(o: tuple[torch.nn.Module, DiLoCo, Any]) -> dict[str, torch.Tensor]:
    """Everything a DiLoCo replica is: parameters, inner state, global parameters, outer
    momentum, counters, lr."""
    model, opt, _sched = o
    out = {f"p/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, p in enumerate(opt.params):
        for k, v in opt.optim.state.get(p, {}).items():
            out[f"o/{i}/{k}"] = torch.as_tensor(v).clone()
    for i, g in enumerate(opt.global_params):
        out[f"g/{i}"] = g.detach().clone()
        buf = opt.outer.state.get(g, {}).get("momentum_buffer")
        if buf is not None:
            out[f"m/{i}"] = buf.clone()
    out["counters"] = torch.tensor([opt.steps, opt.next_sync, opt.period, opt.syncs])
    out["lr"] = torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float64)
    return out



@pytest.fixture(scope="module")
def reference() -> list[dict[str, torch.Tensor]]:
    """The uninterrupted run's state after every step (no checkpointer)."""
    rng = torch.get_rng_state()
    o = _diloco()
    snaps = [_snapshot(o)]
    for t in range(STEPS):
        _train(o, t, t + 1)
        snaps.append(_snapshot(o))
    torch.set_rng_state(rng)
    return snaps


@pytest.fixture(scope="module")
def diloco_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DiLoCo checkpoint (world size 1, layout 'local'): a base at step 0 only, a
    digest every step."""
    rng = torch.get_rng_state()
    d = tmp_path_factory.mktemp("diloco") / "ck"
    o = _diloco()
    with DiffCheckpointer(str(d), o[0], o[1], scheduler=o[2], snapshot_every=100,
                          digest_every=1):
        _train(o, 0, STEPS)
    torch.set_rng_state(rng)
    return d


def _restored(path: Path, step: int) -> dict[str, torch.Tensor]:
    o = _diloco()
    restore_replica(str(path), o[0], o[1], rank=0, step=step, scheduler=o[2])
    return _snapshot(o)


def test_diloco_log_declares_its_digest_over_the_outer_state(diloco_log: Path) -> None:
    """A new DiLoCo log's local section says its digests cover the outer state; every
    step restores bitwise (digests checked at each)."""
    with LogReader(str(diloco_log / "rank-00000")) as r:
        local = r.meta["torch"]["local"]
    assert local["digest_outer"] is True
    assert local["kind"] == "diloco"


@pytest.mark.parametrize("tensor", ["@outeropt/0.weight/momentum_buffer", "@global/2.bias"])
def test_digest_catches_a_corrupt_outer_state(diloco_log: Path, reference: list[Any],
                                              tmp_path: Path, tensor: str) -> None:
    """A base at step 7 (after the outer step of step 6, before that of step 9) whose
    outer momentum or global parameter is altered, every CRC valid: replaying to step 8
    from it restores the replica's parameters and inner state exactly, so only the digest
    over the outer state can see it: ``replay_diverged`` naming step 8 (the replica's
    digest alone matched, and the altered DiLoCo state was restored silently). The same
    base unaltered restores bitwise."""
    for corrupt in (False, True):
        d = tmp_path / f"ck-{corrupt}"
        shutil.copytree(diloco_log, d)
        shard = str(d / "rank-00000")
        with LogReader(shard) as r:
            tensors, meta = materialize_replica(r, 7, rank=0, world=1)
            log_id = r.log_id
        assert tensor in tensors
        if corrupt:
            tag, arr = tensors[tensor]
            bad = np.array(arr, copy=True)
            bad.reshape(-1)[0] = bad.reshape(-1)[0] * 2 + 1
            tensors[tensor] = (tag, bad)
        assert publish_base(shard, 7, tensors, meta, log_id) > 0
        if not corrupt:
            assert bits_differ(_restored(d, 8), reference[8]) == []
            continue
        with pytest.raises(ReplayError) as ei:
            _restored(d, 8)
        assert ei.value.reason.value == "replay_diverged"
        assert "step 8" in str(ei.value)
        assert shard in str(ei.value)
        with pytest.raises(ReplayError):
            replay_state(str(d), 8, rank=0)


def test_log_without_outer_digest_still_verifies(tmp_path: Path, reference: list[Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A DiLoCo log written before the digest covered the outer state (no
    ``digest_outer`` in its local section) restores bitwise, and a checkpointer
    continuing it keeps its digest definition: restored again at the end, bitwise."""
    d = tmp_path / "old"
    with monkeypatch.context() as m:  # what the code before this change wrote
        m.setattr(DiLoCoUpdate, "has_outer", False)
        o = _diloco()
        with DiffCheckpointer(str(d), o[0], o[1], scheduler=o[2], snapshot_every=100,
                              digest_every=1):
            _train(o, 0, 5)
    with LogReader(str(d / "rank-00000")) as r:
        assert "digest_outer" not in r.meta["torch"]["local"]
    o = _diloco()
    res = restore(str(d), o[0], o[1], scheduler=o[2])
    assert res.step == 5
    assert 5 in res.verified
    assert bits_differ(_snapshot(o), reference[5]) == []
    with DiffCheckpointer(str(d), o[0], o[1], scheduler=o[2], snapshot_every=100,
                          digest_every=1):
        _train(o, 5, 9)
    with LogReader(str(d / "rank-00000")) as r:  # the old definition, said explicitly
        assert r.meta["torch"]["local"]["digest_outer"] is False
    assert bits_differ(_restored(d, 9), reference[9]) == []


def test_compact_keeps_every_step_restorable(diloco_log: Path, reference: list[Any],
                                             tmp_path: Path) -> None:
    """``compact`` of a DiLoCo checkpoint: a base at the newest durable step made from the
    shard alone (global parameters, outer momentum, counters), the older base and diffs
    deleted; the checkpoint then restores bitwise at that step and continues bitwise
    through the next outer step; ``SHARDS`` is unchanged."""
    d = tmp_path / "ck"
    shutil.copytree(diloco_log, d)
    shards_before = (d / "SHARDS").read_bytes()
    dry = compact(str(d), keep_bases=1, materializer=TorchMaterializer(str(d)),
                  dry_run=True)   # plans what the compaction below does, changes nothing
    assert (dry.plan.new_base, dry.plan.keep_bases, dry.plan.delete_bases) == \
        (STEPS, [STEPS], [0])
    with LogReader(str(d / "rank-00000")) as r:
        assert list(r.bases) == [0]
    res = compact(str(d), keep_bases=1, materializer=TorchMaterializer(str(d)))
    assert (res.plan.new_base, res.plan.keep_bases, res.plan.delete_bases) == \
        (STEPS, [STEPS], [0])
    assert (d / "SHARDS").read_bytes() == shards_before
    with LogReader(str(d / "rank-00000")) as r:
        assert list(r.bases) == [STEPS]
        with r.base(STEPS) as b:
            names = set(b.names)
    assert {"@local/counters", "@global/0.weight", "@outeropt/0.weight/momentum_buffer"} \
        <= names
    o = _diloco()
    res2 = restore(str(d), o[0], o[1], scheduler=o[2])
    assert res2.step == STEPS
    assert bits_differ(_snapshot(o), reference[STEPS]) == []
    # and the run goes on from the compacted checkpoint through an outer step (step 12)
    ref = _diloco()
    _train(ref, 0, STEPS + 3)
    with DiffCheckpointer(str(d), o[0], o[1], scheduler=o[2], snapshot_every=100):
        _train(o, STEPS, STEPS + 3)
    assert bits_differ(_snapshot(o), _snapshot(ref)) == []
    assert bits_differ(_restored(d, STEPS + 3), _snapshot(ref)) == []


def test_materialized_base_is_the_checkpointers(diloco_log: Path, tmp_path: Path) -> None:
    """The base compaction makes at step 8 from a shard whose only base is step 0 holds
    the tensors (names, order, dtypes, bits) and base metadata the checkpointer wrote at
    step 8 in a run that took bases every 4 steps."""
    d = tmp_path / "every4"
    o = _diloco()
    with DiffCheckpointer(str(d), o[0], o[1], scheduler=o[2], snapshot_every=4,
                          digest_every=1, exact_bases=True):  # a base at 8 on a busy machine
        _train(o, 0, 8)
    with LogReader(str(d / "rank-00000")) as r, r.base(8) as b:
        want = [(n, *b.info(n), np.array(b.tensor(n)).tobytes()) for n in b.names]
        want_meta = {k: v for k, v in b.meta()["torch"].items() if k != "log"}
    with LogReader(str(diloco_log / "rank-00000")) as r:
        tensors, meta = materialize_replica(r, 8, rank=0, world=1)
    got = [(n, tag, tuple(np.shape(a)), np.ascontiguousarray(a).tobytes())
           for n, (tag, a) in tensors.items()]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert [g[0] for g, w2 in zip(got, want, strict=True) if g[3] != w2[3]] == []
    assert {k: v for k, v in meta["torch"].items() if k != "log"} == want_meta


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_replay_and_compact_with_rank(diloco_log: Path, reference: list[Any],
                                          tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``replay --rank 0 --to-step N`` writes replica 0's parameters at N, bitwise; ``compact
    --rank 0`` compacts that replica; without ``--rank``, with a rank the checkpoint does
    not have, or with ``--rank`` on a plain log: one line, exit 2, nothing written."""
    d = tmp_path / "ck"
    shutil.copytree(diloco_log, d)
    out = tmp_path / "r0.safetensors"
    rc, stdout, err = _cli(["replay", str(d), "--rank", "0", "--to-step", "7",
                            "--out", str(out)], capsys)
    assert rc == 0, err
    assert "replica 0" in stdout
    got = load_file(str(out))
    want = {k[2:]: v for k, v in reference[7].items() if k.startswith("p/")}
    assert bits_differ(got, want) == []
    for argv, what in (
            (["replay", str(d), "--out", str(tmp_path / "x.safetensors")], "--rank R"),
            (["replay", str(d), "--rank", "1", "--out", str(tmp_path / "x.safetensors")],
             "ranks 0..0"),
            (["compact", str(d), "--rank", "1"], "ranks 0..0"),
            (["replay", str(d), "--rank", "-1", "--out", str(tmp_path / "x.safetensors")],
             "not a rank")):
        rc, stdout, err = _cli(argv, capsys)
        assert rc == 2, (argv, err)
        assert what in err, (argv, err)
        assert err.count("\n") == 1, err
    assert not (tmp_path / "x.safetensors").exists()
    with LogReader(str(d / "rank-00000")) as r:
        assert list(r.bases) == [0]
    rc, stdout, err = _cli(["compact", str(d), "--rank", "0", "--keep-bases", "1",
                            "--json"], capsys)
    assert rc == 0, err
    with LogReader(str(d / "rank-00000")) as r:
        assert list(r.bases) == [STEPS]
    rc, stdout, err = _cli(["replay", str(d), "--rank", "0", "--out", str(out)], capsys)
    assert rc == 0, err
    want = {k[2:]: v for k, v in reference[STEPS].items() if k.startswith("p/")}
    assert bits_differ(load_file(str(out)), want) == []


def test_rank_refused_for_a_plain_log(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``--rank`` (CLI) or ``rank=`` (API) with a log that is not of local-update
    training: usage error (exit 2) / ``invalid_argument``, one line."""
    d = tmp_path / "plain"
    model, opt, _sched = _diloco()
    with DiffCheckpointer(str(d), model, opt.optim, snapshot_every=5) as ck:
        ck.flush()
    rc, _out, err = _cli(["replay", str(d), "--rank", "0", "--out",
                          str(tmp_path / "x.pt")], capsys)
    assert rc == 2
    assert "local-update" in err
    rc, _out, err = _cli(["compact", str(d), "--rank", "0"], capsys)
    assert rc == 2
    assert "local-update" in err
    with pytest.raises(LowdiffError) as ei:
        replay_state(str(d), rank=0)
    assert ei.value.reason.value == "invalid_argument"
    with pytest.raises(LowdiffError) as ei:
        compact(str(d), rank=0)
    assert ei.value.reason.value == "invalid_argument"


def test_a_shard_in_the_wrong_place_is_refused(diloco_log: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A 2-rank checkpoint whose shards are copies of a 1-rank checkpoint's (each local
    section says rank 0 of 1), every CRC valid: ``replay --rank 1`` and ``compact`` fail
    with one line (exit 1) naming the shard's ``MANIFEST`` and ``bad_metadata``; nothing
    is deleted."""
    from lowdiff_store.log.shards import write_shards_manifest

    d = tmp_path / "ck"
    for r in range(2):
        shutil.copytree(diloco_log / "rank-00000", d / f"rank-{r:05d}")
    write_shards_manifest(str(d), 2, layout="local", meta={"writer": "torch",
                                                           "kind": "diloco"})
    for argv, shard in (
            (["replay", str(d), "--rank", "1", "--out", str(tmp_path / "x.pt")], 1),
            (["compact", str(d), "--keep-bases", "1"], 0)):
        rc, _out, err = _cli(argv, capsys)
        assert rc == 1, (argv, err)
        assert err.count("\n") == 1, err
        assert f"{d / f'rank-{shard:05d}' / 'MANIFEST'}: bad_metadata" in err, err
        assert "rank 0 of 1" in err, err
    for r in range(2):
        with LogReader(str(d / f"rank-{r:05d}")) as rd:
            assert list(rd.bases) == [0]
            assert rd.durable_step == STEPS
    assert not (tmp_path / "x.pt").exists()


def test_a_log_saying_another_rank_is_refused_before_it_is_continued(
        diloco_log: Path, tmp_path: Path) -> None:
    """A 1-rank DiLoCo checkpoint whose shard's local section says rank 1 of 2 (a rank
    directory copied from a 2-rank job, CRCs valid): ``restore``, ``restore_replica`` and a
    checkpointer continuing the log refuse it with ``bad_metadata`` naming the shard's
    ``MANIFEST`` and the rank it says (before, restore went through); nothing is
    written."""
    from lowdiff_store.log.manifest import update_manifest

    d = tmp_path / "ck"
    shutil.copytree(diloco_log, d)
    shard = d / "rank-00000"
    update_manifest(str(shard), lambda m: m.meta["torch"]["local"].update(
        rank=1, world_size=2))
    files = {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
    want = f"{shard / 'MANIFEST'}: bad_metadata: the log's local section says rank 1 of 2"
    attempts = {
        "restore": lambda o: restore(str(d), o[0], o[1], scheduler=o[2]),
        "restore_replica": lambda o: restore_replica(str(d), o[0], o[1], rank=0),
        "checkpointer": lambda o: DiffCheckpointer(str(d), o[0], o[1], scheduler=o[2],
                                                   snapshot_every=100)}
    for what, fn in attempts.items():
        with pytest.raises(LowdiffError) as ei:
            fn(_diloco())
        assert ei.value.reason.value == "bad_metadata", (what, str(ei.value))
        assert str(ei.value).startswith(want), (what, str(ei.value))
    assert {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} == files
