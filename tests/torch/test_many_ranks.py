"""Sharded restores that scale with the ranks (issue 24, item 4): a rank opens only the
shards it describes and those it replays, and a sharded restore or replay beside a
compaction reads the newer manifests instead of failing with ``missing_file``.

One 4-rank FSDP2 checkpoint per module, written by ``bench/bench_many_ranks.py``'s
training job (gloo, 5 steps, bases at 0, 2 and 4; the gathered state after step 5 saved
as the reference). The tests run in this process (world size 1: the resharded path).
The race with a compaction is made deterministic as in ``test_compaction_race.py``: the
compaction runs inside the first ``LogReader.base`` call, after the restoring reader read
the older manifest and before it opens the base that manifest names.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from lowdiff_store.compaction import compact
from lowdiff_store.errors import LowdiffError, Reason
from lowdiff_store.format.constants import BASE_NAME
from lowdiff_store.log import LogReader
from lowdiff_store.log.manifest import load_manifest
from lowdiff_store.log.shards import shard_path
from lowdiff_store.torch import replay_state, restore
from lowdiff_store.torch.api import TorchMaterializer
from lowdiff_store.torch.distributed.ondemand import OnDemandShards, exchange_facts
from lowdiff_store.torch.distributed.reshard import Source, needed_shards, replay_shards
from tests.helpers.dist import NEEDS_GLOO

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_many_ranks as bench  # noqa: E402

pytestmark = [NEEDS_GLOO, pytest.mark.consistent_bases]  # (tests/conftest.py)
WORLD = 4


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, Any]]:
    """(checkpoint directory, the bench's options, the reference state after step 5)."""
    d = tmp_path_factory.mktemp("many")
    a = bench.small_args(str(d), [WORLD])
    (d / "out").mkdir()
    bench.job(a, "train", WORLD, str(d / "ck"), str(d / "out"), "train")
    return d / "ck", a, bench.read_reference(str(d / "out"))


@pytest.fixture
def copy(written: tuple[Path, Any, dict[str, Any]], tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(written[0], ck)
    return ck


@pytest.fixture
def compact_on_first_base(monkeypatch: pytest.MonkeyPatch, copy: Path) -> list[int]:
    """Patch ``LogReader.base``: its first call compacts the copied checkpoint (a base at
    the newest durable step on every shard, keeping only it) before opening the base the
    caller's manifest named. Holds the caller's manifest generation and the newest."""
    real = LogReader.base
    done: list[int] = []

    def base(self: LogReader, step: int) -> Any:
        if not done:
            done.append(self.manifest.generation)
            compact(copy, keep_bases=1, materializer=TorchMaterializer(copy))
            done.append(load_manifest(self.path).generation)
        return real(self, step)

    monkeypatch.setattr(LogReader, "base", base)
    return done


def _compacted(ck: Path, gens: list[int]) -> None:
    old, new = gens
    assert new > old
    for r in range(WORLD):
        assert load_manifest(shard_path(ck, r)).bases == [5]
        assert not (Path(shard_path(ck, r)) / BASE_NAME.format(4)).exists()


def _replayed(ck: Path) -> dict[str, Any]:
    """``replay_state`` of ``ck`` named as the reference names it."""
    state, opt = replay_state(ck, with_optimizer=True)
    assert opt is not None
    got = {f"model/{n}": t for n, t in state.items()}
    for g in opt["param_groups"]:
        for i, n in zip(g["params"], g["param_names"], strict=True):
            got.update({f"opt/{n}/{k}": v for k, v in opt["state"].get(i, {}).items()})
    return got


def test_four_ranks_restored_at_three_two_and_one(written: tuple[Path, Any, dict[str, Any]],
                                                 tmp_path: Path) -> None:
    """The CI-sized many-ranks case: the 4-rank checkpoint restored by jobs of 3 and 2
    FSDP2 ranks (each rank's rows of every parameter and optimizer state bitwise the
    reference's) and by ``replay_state`` here; at W' = 3 no rank opens all four shards
    to find the ones it needs."""
    ck, a, ref = written
    out = tmp_path / "out"
    shutil.copytree(ck.parent / "out", out)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:   # the two jobs side by side
        jobs = {w2: pool.submit(bench.job, a, "restore", w2, str(ck), str(out),
                                f"restore{w2}") for w2 in (3, 2)}
    for w2, fut in jobs.items():
        rows, _job_s = fut.result()
        assert [r["rank"] for r in rows] == list(range(w2))
        assert all(r["step"] == 5 for r in rows), rows
        assert all(r["bad"] == [] for r in rows), rows
    assert bench.differences(_replayed(ck), ref, {}) == []


def test_resharded_restore_beside_compaction_retries_on_newer_manifests(
        written: tuple[Path, Any, dict[str, Any]], copy: Path,
        compact_on_first_base: list[int]) -> None:
    """The 4-rank FSDP2 checkpoint restored into one plain model while a compaction
    deletes the base at step 4 that the restore had planned from: restored from the new
    base at step 5, bitwise the reference."""
    _ck, a, ref = written
    model, opt = bench.build_model(a, 0)
    res = restore(copy, model, opt)
    _compacted(copy, compact_on_first_base)
    assert res.step == 5
    assert res.exact
    assert bench.differences(bench.state_of(model, opt, full=False), ref, {}) == []


def test_sharded_replay_state_beside_compaction_retries_on_newer_manifests(
        written: tuple[Path, Any, dict[str, Any]], copy: Path,
        compact_on_first_base: list[int]) -> None:
    _ck, _a, ref = written
    got = _replayed(copy)
    _compacted(copy, compact_on_first_base)
    assert bench.differences(got, ref, {}) == []


def test_a_base_missing_from_the_newest_manifests_still_fails(copy: Path,
                                                              written: tuple[Path, Any,
                                                                             Any]) -> None:
    """No compaction moved a manifest: the missing base is reported, not retried."""
    (Path(shard_path(copy, 2)) / BASE_NAME.format(4)).unlink()
    model, opt = bench.build_model(written[1], 0)
    with pytest.raises(LowdiffError) as ei:
        restore(copy, model, opt)
    assert ei.value.reason is Reason.MISSING_FILE
    assert "base named by the manifest is missing" in str(ei.value)


def _chunk_box(shape: tuple[int, ...], rank: int, world: int
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of ``rank`` when dim 0 is cut as ``torch.chunk`` cuts it (FSDP2's rule)."""
    size = -(-shape[0] // world)
    lo = min(shape[0], rank * size)
    hi = min(shape[0], lo + size)
    return (lo, *(0 for _ in shape[1:])), (hi - lo, *shape[1:])


def test_a_rank_opens_the_shards_it_describes_and_those_it_replays(
        written: tuple[Path, Any, dict[str, Any]]) -> None:
    """Described from the exchanged facts, a Source opens only shard 0 (the global model
    and optimizer layout); replaying the boxes of rank 1 of 4 opens only shard 1, and its
    rows come out bitwise the reference's."""
    ck, _a, ref = written
    with OnDemandShards(str(ck)) as shards:
        facts = exchange_facts(shards, 0, 1, None)   # no group: this process describes all
        assert shards.opened == list(range(WORLD))
        shards.close()
        src = Source(shards.root, shards.readers, shards.metas, shards.layout, facts=facts)
        assert shards.opened == [0]
        shards.close()
        boxes = {n: _chunk_box(shape, 1, WORLD) for n, (_t, shape) in src.model.items()
                 if n in src.pieces}
        need = needed_shards(src, boxes)
        assert need == {1}
        target, bases, _job = src.plan(None)
        rep = replay_shards(src, sorted(need), 1, target, bases, verify=True,
                            apply_rng=False, boxes=boxes)
        assert shards.opened == [1]
    for n, box in boxes.items():
        sl = tuple(slice(o, o + k) for o, k in zip(*box, strict=True))
        want = ref[f"model/{n}"][sl]
        assert bench.differences({n: rep.values[(1, n)]}, {n: want}, {}) == []
