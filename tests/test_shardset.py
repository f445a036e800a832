"""Sharded checkpoints read as one: ShardSet, the job plan, MergedReader (the same reading
interface as LogReader), and the SHARDS manifest's checks against what exists."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from lowdiff_store import LogReader, LogWriter, tensor_input
from lowdiff_store.errors import ConfigError, LowdiffError, Reason, StepNotFoundError
from lowdiff_store.log.shards import read_shards_manifest, shard_path, write_shards_manifest
from lowdiff_store.log.shardset import (
    MergedRecord,
    ShardSet,
    check_chain,
    combine_digests,
    plan_job,
)
from lowdiff_store.verify import verify_log


def _f32(*v: float) -> np.ndarray:
    return np.array(v, dtype=np.float32)


def _two_shards(root: Path, steps: int = 4) -> None:
    """Rank 0 logs parameter "a", rank 1 parameter "b"; both log their own "@rng/cpu" and
    a digest per step; bases at 0 on both, at 2 on rank 0 only."""
    write_shards_manifest(root, 2, layout="replicated")
    for r, own in enumerate(("a", "b")):
        with LogWriter(shard_path(root, r), meta={"rank": r}) as w:
            w.write_base(0, {own: ("F32", _f32(r, r)), "@rng/cpu": ("U8", np.full(3, r, np.uint8))},
                         {"who": r})
            for t in range(1, steps + 1):
                w.append(t, [tensor_input("@grad/" + own, _f32(t, r), "F32"),
                             tensor_input("@rng/cpu", np.full(3, 10 * t + r, np.uint8), "U8")],
                         kind="grad", side={"rank": r}, extra={"digest": 100 * t + r})
                if r == 0 and t == 2:
                    w.sync()
                    w.write_base(2, {own: ("F32", _f32(9, 9)),
                                     "@rng/cpu": ("U8", np.zeros(3, np.uint8))}, {"who": 0})
            w.sync()


def test_merged_reader_reads_the_shards_as_one_log(tmp_path: Path) -> None:
    _two_shards(tmp_path)
    with ShardSet(tmp_path) as shards:
        assert (shards.world, shards.layout, shards.durable_step) == (2, "replicated", 4)
        plan = shards.plan(None)
        assert (plan.target, plan.bases, plan.job_durable) == (4, [0, 0], 4)  # 2: rank 0 only
        for own in (0, 1):
            merged = shards.merged(own, plan.bases[0])
            assert merged.chain(3) == (0, [1, 2, 3])
            rec = merged.record(3)
            assert isinstance(rec, MergedRecord)
            assert sorted(rec.names) == ["@grad/a", "@grad/b", "@rng/cpu"]
            assert rec.side == {"rank": own}                       # this rank's side channel
            assert rec.tensor("@rng/cpu").tolist() == [30 + own] * 3  # this rank's RNG
            assert rec.tensor("@grad/a").tolist() == [3.0, 0.0]       # from rank 0
            assert rec.tensor("@grad/b").tolist() == [3.0, 1.0]       # from rank 1
            assert rec.entry("@grad/b").dtype == "F32"
            assert rec.meta == {"digest": combine_digests([300, 301])}
            with pytest.raises(LowdiffError, match="no tensor"):
                rec.entry("@grad/zzz")
            with merged.base(0) as base:
                assert sorted(base.names) == ["@rng/cpu", "a", "b"]
                assert base.tensor("@rng/cpu").tolist() == [own] * 3
                assert base.tensor("b").tolist() == [1.0, 1.0]


def test_combine_digests_is_order_sensitive_and_stable() -> None:
    assert combine_digests([1, 2]) != combine_digests([2, 1])
    assert combine_digests([1, 2]) == combine_digests(iter([1, 2]))
    assert combine_digests([0xFFFFFFFF + 1]) == combine_digests([0])


def test_plan_job_picks_common_or_per_shard_bases(tmp_path: Path) -> None:
    root = str(tmp_path)
    p = plan_job([7, 5], [[0, 4], [0, 4, 5]], None, "replicated", root)
    assert (p.target, p.bases, p.job_durable) == (5, [4, 4], 5)
    p = plan_job([7, 5], [[0, 4], [0, 5]], 5, "zero", root)
    assert p.bases == [4, 5]
    with pytest.raises(StepNotFoundError, match="not durable on every rank"):
        plan_job([7, 5], [[0], [0]], 6, "replicated", root)
    with pytest.raises(StepNotFoundError, match="no base yet"):
        plan_job([7, None], [[0], []], None, "replicated", root)
    with pytest.raises(ConfigError):
        plan_job([7, 5], [[0], [0]], -1, "replicated", root)


def test_check_chain_is_bounded_by_the_log_not_the_step(tmp_path: Path) -> None:
    _two_shards(tmp_path)
    with ShardSet(tmp_path) as shards:
        r0 = shards.readers[0]
        check_chain(r0, 0, 4)
        t0 = time.perf_counter()
        with pytest.raises(StepNotFoundError, match="diff for step 5 is missing"):
            check_chain(r0, 0, 2**62)  # no list of 2^62 steps is built
        assert time.perf_counter() - t0 < 5


def test_shards_manifest_declaring_more_ranks_than_exist_is_refused_at_once(
        tmp_path: Path) -> None:
    _two_shards(tmp_path)
    from lowdiff_store.format.constants import SHARDS_MAGIC
    from lowdiff_store.format.framing import pack_manifest

    (tmp_path / "SHARDS").write_bytes(pack_manifest(
        {"world_size": 2**20, "layout": "replicated", "meta": {}}, SHARDS_MAGIC))
    t0 = time.perf_counter()
    assert read_shards_manifest(tmp_path)["world_size"] == 2**20  # well-formed
    with pytest.raises(LowdiffError) as ei:
        ShardSet(tmp_path)
    assert ei.value.reason.value == "bad_metadata"
    assert "rank-00002 holds no log" in str(ei.value)
    rep = verify_log(str(tmp_path))
    assert not rep.ok
    assert any(p.reason.value == "bad_metadata" for p in rep.problems)
    assert time.perf_counter() - t0 < 10


def test_shards_without_logs_are_refused_before_opening_them(tmp_path: Path) -> None:
    write_shards_manifest(tmp_path / "ck", 3)
    assert read_shards_manifest(tmp_path / "ck")["world_size"] == 3
    with pytest.raises(LowdiffError, match="rank-00000 holds no log") as ei:
        ShardSet(tmp_path / "ck")
    assert ei.value.reason.value == "bad_metadata"


def test_compact_refuses_a_per_log_materializer_on_a_sharded_checkpoint(
        tmp_path: Path) -> None:
    """Before, compact(sharded, materializer=f) dropped f silently."""
    from lowdiff_store.compaction import compact

    _two_shards(tmp_path)

    def per_log(reader: object, step: int) -> None:
        raise AssertionError("must not be called")

    with pytest.raises(ConfigError, match="for_rank") as ei:
        compact(str(tmp_path), step=4, materializer=per_log)
    assert ei.value.reason.value == "invalid_argument"
    calls: list[tuple[int, int]] = []

    class PerRank:
        def __call__(self, reader: object, step: int) -> None:
            raise AssertionError("the per-rank materializer must be used")

        def for_rank(self, rank: int):  # type: ignore[no-untyped-def]
            def mat(reader, step):  # type: ignore[no-untyped-def]
                calls.append((rank, step))
                own = "ab"[rank]
                return ({own: ("F32", _f32(step, rank)),
                         "@rng/cpu": ("U8", np.zeros(3, np.uint8))}, {"made": rank})
            return mat

    res = compact(str(tmp_path), step=4, keep_bases=1, materializer=PerRank())
    assert sorted(calls) == [(0, 4), (1, 4)]
    assert res.plan.new_base == 4
    with ShardSet(tmp_path) as shards:
        assert [list(r.bases) for r in shards.readers] == [[4], [4]]
        with shards.merged(1, 4).base(4) as b:
            assert b.tensor("b").tolist() == [4.0, 1.0]


def test_verify_reports_a_shards_manifest_of_an_unknown_layout(tmp_path: Path) -> None:
    """``SHARDS`` naming a layout the spec does not list is ``bad_metadata`` at ``SHARDS``
    (the shards' own bytes being fine); before, verify passed it (logs without a torch
    shard section had nothing to compare it with)."""
    _two_shards(tmp_path)
    write_shards_manifest(tmp_path, 2, layout="striped")   # republished over the first
    rep = verify_log(str(tmp_path))
    assert [(p.reason, p.path) for p in rep.problems] == [
        (Reason.BAD_METADATA, str(tmp_path / "SHARDS"))]
    assert "unknown shard layout 'striped'" in str(rep.problems[0])
    with pytest.raises(LowdiffError) as ei:
        ShardSet(tmp_path)
    assert ei.value.reason is Reason.BAD_METADATA


def test_verify_reports_one_log_copied_as_two_ranks(tmp_path: Path) -> None:
    """rank-00000's log copied as rank-00001 (same ``log_id``): ``log_id_mismatch`` naming
    both directories; each copy alone verifies clean, so before this verify passed it."""
    _two_shards(tmp_path)
    shutil.rmtree(tmp_path / "rank-00001")
    shutil.copytree(tmp_path / "rank-00000", tmp_path / "rank-00001")
    rep = verify_log(str(tmp_path))
    assert [(p.reason, p.path) for p in rep.problems] == [
        (Reason.LOG_ID_MISMATCH, shard_path(tmp_path, 1))]
    assert shard_path(tmp_path, 0) in str(rep.problems[0])
    with pytest.raises(LowdiffError) as ei:
        ShardSet(tmp_path)
    assert (ei.value.reason, ei.value.path) == (Reason.LOG_ID_MISMATCH, shard_path(tmp_path, 1))


def test_rank_logs_without_shards_say_what_is_missing(tmp_path: Path) -> None:
    """A directory holding ``rank-00001/`` but no ``SHARDS`` (rank 0 killed after the job's
    layout was set up and before it published ``SHARDS``, while rank 1 opened its log):
    ``verify`` and the readers say ``not_a_log`` naming the missing ``SHARDS`` and how to
    publish it, not only "no MANIFEST"."""
    _two_shards(tmp_path)
    (tmp_path / "SHARDS").unlink()
    shutil.rmtree(tmp_path / "rank-00000")
    rep = verify_log(str(tmp_path))
    assert [p.reason for p in rep.problems] == [Reason.NOT_A_LOG]
    msg = str(rep.problems[0])
    assert "rank-00001 but no SHARDS" in msg, msg
    assert "open the checkpointer again on every rank" in msg, msg
    with pytest.raises(LowdiffError, match="rank-00001 but no SHARDS") as ei:
        LogReader(str(tmp_path))
    assert ei.value.reason is Reason.NOT_A_LOG


def _streamed_shards(root: Path, rank1_slices: tuple[int, int] = (3, 4)) -> None:
    """Rank r logs parameters "<a|b>1" and "<a|b>2"; base 0 on both; a streamed base
    complete at 4 on each: its first slice (the parameter "...1" and the RNG state) taken
    after step 3 on rank 0 and after ``rank1_slices[0]`` on rank 1, the second ("...2")
    after step 4."""
    write_shards_manifest(root, 2, layout="replicated")
    for r, own in enumerate(("a", "b")):
        steps = (3, 4) if r == 0 else rank1_slices
        sl = {"base": steps[-1], "steps": list(steps)}
        with LogWriter(shard_path(root, r), meta={"rank": r}) as w:
            w.write_base(0, {own + "1": ("F32", _f32(r, r)), own + "2": ("F32", _f32(r, r)),
                             "@rng/cpu": ("U8", np.full(3, r, np.uint8))}, {"who": r})
            for t in range(1, 7):
                w.append(t, [tensor_input("@grad/" + own + "1", _f32(t, r), "F32"),
                             tensor_input("@grad/" + own + "2", _f32(t, r), "F32"),
                             tensor_input("@rng/cpu", np.full(3, 10 * t + r, np.uint8), "U8")],
                         kind="grad", side={"rank": r})
                if t == steps[0]:
                    w.sync()
                    w.write_base(t, {own + "1": ("F32", _f32(t, 1)),
                                     "@rng/cpu": ("U8", np.full(3, t, np.uint8))},
                                 {"who": r, "torch": {"opt": {"tensors": {own + "1": []}}},
                                  "slice": sl})
                if t == steps[1]:
                    w.sync()
                    w.write_base(t, {own + "2": ("F32", _f32(t, 2))},
                                 {"who": r, "torch": {"opt": {"tensors": {own + "2": []}}},
                                  "slice": sl})
            w.sync()


def test_plan_job_starts_from_streamed_bases(tmp_path: Path) -> None:
    root = str(tmp_path)
    same = [[[4, [3, 4]]], [[4, [3, 4]]]]
    p = plan_job([6, 6], [[0], [0]], None, "replicated", root, same)
    assert (p.target, p.bases) == (6, [4, 4])
    # replicated shards replay merged: a streamed base taken at other steps on one shard
    # is no common start, the older consistent base is
    other = [[[4, [3, 4]]], [[4, [2, 4]]]]
    assert plan_job([6, 6], [[0], [0]], None, "replicated", root, other).bases == [0, 0]
    # a consistent base and a streamed one at the same step: the consistent one (fewer
    # steps replayed), as LogReader.start_for picks
    assert plan_job([6, 6], [[0, 4], [0, 4]], None, "replicated", root, same).bases == [4, 4]
    assert plan_job([6, 6], [[0, 4], [0]], None, "replicated", root, same).bases == [0, 0]
    # shards replayed on their own: each from its own newest point
    assert plan_job([6, 6], [[0], [0]], None, "zero", root, other).bases == [4, 4]
    assert plan_job([6, 6], [[0], [0]], 3, "fsdp", root, same).bases == [0, 0]


def test_merged_reader_replays_a_streamed_base_of_every_shard(tmp_path: Path) -> None:
    _streamed_shards(tmp_path)
    with ShardSet(tmp_path) as shards:
        assert shards.plan(None).bases == [4, 4]
        check_chain(shards.readers[0], 4, 6)   # (the diffs after the first slice, 3)
        merged = shards.merged(1, 4)
        plan, diffs = merged.chain_from(6)
        assert (plan.complete, plan.slices, plan.streamed, diffs) == (4, (3, 4), True,
                                                                      [4, 5, 6])
        assert merged.chain(6) == (3, [4, 5, 6])
        with merged.open_start(plan) as base:
            assert sorted(base.names) == ["@rng/cpu", "a1", "a2", "b1", "b2"]
            assert base.step == 3
            assert {n: base.step_of(n) for n in base.names} == {
                "@rng/cpu": 3, "a1": 3, "a2": 4, "b1": 3, "b2": 4}
            assert base.tensor("@rng/cpu").tolist() == [3] * 3     # rank 1's first slice
            assert base.tensor("a2").tolist() == [4.0, 2.0]        # rank 0's second slice
            assert sorted(base.meta()["torch"]["opt"]["tensors"]) == ["a1", "a2", "b1", "b2"]


def test_merged_reader_refuses_shards_streamed_at_other_steps(tmp_path: Path) -> None:
    _streamed_shards(tmp_path, rank1_slices=(2, 4))
    with ShardSet(tmp_path) as shards:
        assert shards.plan(None).bases == [0, 0]
        with pytest.raises(StepNotFoundError, match=r"rank 1's shard cannot start from step 4"
                           r".*slices \[2, 4\]"):
            shards.merged(0, 4).chain_from(6)
