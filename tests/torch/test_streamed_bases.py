"""Streamed bases (issue 50): a base spread over k steps, one slice of the state per step,
and a restore that replays each tensor from its own slice's step, bit for bit."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
from _cases import CASES, assert_same, build, ckpt_kwargs, reference, run, snapshot

from lowdiff_store.log import LogReader
from lowdiff_store.torch import DiffCheckpointer, restore

STEPS = 22


def _ckpt(path: Any, case: str, o: Any, **kw: Any) -> DiffCheckpointer:
    return DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                            compressor=o.compressor, extra_state=lambda: dict(o.extra),
                            **{**ckpt_kwargs(case), **kw})


def _restore(path: Any, o: Any, **kw: Any) -> Any:
    return restore(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler, **kw)


STREAMED = CASES


@pytest.mark.parametrize("case", STREAMED)
def test_restore_from_a_streamed_base_is_bitwise(case: str, tmp_path: Any) -> None:
    at = tuple(range(1, STEPS + 1))
    _, ref = reference(case, STEPS, at=at)
    path = tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, snapshot_every=6, base_slices=3) as ckpt:
        run(case, o, 0, STEPS, ckpt)
        stats = ckpt.stats()
    with LogReader(path) as r:
        assert r.bases == [0]
        assert r.streamed == [(6, (4, 5, 6)), (12, (10, 11, 12)), (18, (16, 17, 18))]
        names = sorted(os.listdir(path))
    assert [n for n in names if n.startswith("slice-")] == [
        f"slice-{s:016d}.safetensors" for s in (4, 5, 6, 10, 11, 12, 16, 17, 18)]
    # the slice after step 22 began the base of step 24: never complete, removed at close
    assert stats["base_slices"] == 10
    assert stats["bases"] == 4
    for t in (3, 5, 6, 7, 11, 12, 17, 19, STEPS):
        o2 = build(case)
        res = _restore(path, o2, step=t)
        assert res.step == t
        want = max(b for b in (0, 6, 12, 18) if b <= t)
        assert res.base_step == want
        assert res.base_slices == ([] if want == 0 else [want - 2, want - 1, want])
        assert res.exact
        assert_same(snapshot(o2), ref[t])


@pytest.mark.parametrize(("case", "ring"), [("adamw", "default"), ("topk_ef_step", "default"),
                                            ("adamw", "tiny"), ("layerwise_clip", "tiny")])
def test_streamed_bases_through_the_writer_process(case: str, ring: str, tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from lowdiff_store.torch.capture import process_sink

    if ring == "tiny":  # 8 slots of 4 KiB: a record fits, a base (33 KB) goes in pieces
        monkeypatch.setattr(process_sink, "ring_size", lambda _meta, _rb: (8, 4096))
    _, ref = reference(case, 14, at=(9, 13, 14))
    path = tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, snapshot_every=5, base_slices=3, writer_process=True) as ckpt:
        run(case, o, 0, 14, ckpt)
        stats = ckpt.stats()
    assert (stats["writer_ring_base_parts"] > 0) == (ring == "tiny")
    with LogReader(path) as r:
        assert r.streamed == [(5, (3, 4, 5)), (10, (8, 9, 10))]
    assert not [n for n in os.listdir(path) if n.startswith("slice-0000000000000013")]
    for t in (9, 13, 14):
        o2 = build(case)
        res = _restore(path, o2, step=t)
        assert (res.base_step, res.exact) == (5 if t < 10 else 10, True)
        assert_same(snapshot(o2), ref[t])


def _one_log(path: Any, case: str = "sgd_bn", steps: int = 12) -> dict[int, Any]:
    _, ref = reference(case, steps, at=tuple(range(1, steps + 1)))
    o = build(case)
    with _ckpt(path, case, o, snapshot_every=5, base_slices=3) as ckpt:
        run(case, o, 0, steps, ckpt)
    return ref


@pytest.mark.parametrize("damage", ["flip", "cut", "delete"])
def test_a_damaged_slice_is_named_never_used(damage: str, tmp_path: Any) -> None:
    from lowdiff_store.errors import LowdiffError

    path = tmp_path / "log"
    ref = _one_log(path)
    victim = path / f"slice-{9:016d}.safetensors"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x40  # inside the last tensor's bytes
        victim.write_bytes(bytes(data))
    elif damage == "cut":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        victim.unlink()
    o = build("sgd_bn")
    with pytest.raises(LowdiffError) as e:
        _restore(path, o, step=12)
    assert str(victim) in str(e.value)
    assert e.value.reason.value == {"flip": "checksum_mismatch", "cut": "truncated",
                                    "delete": "missing_file"}[damage]
    del e  # (its traceback holds the slice's mapping, and so a descriptor, until collected)
    gc.collect()
    # a step before that base's completion restores from the one before, exactly
    o = build("sgd_bn")
    res = _restore(path, o, step=9)
    assert (res.base_step, res.base_slices) == (5, [3, 4, 5])
    assert_same(snapshot(o), ref[9])


def test_streamed_bases_are_refused_where_replay_per_tensor_is_not_vouched(
        tmp_path: Any, caplog: Any) -> None:
    o = build("demo")
    with caplog.at_level("WARNING"), _ckpt(tmp_path / "log", "demo", o, snapshot_every=4,
                                            base_slices=2) as ckpt:
        run("demo", o, 0, 9, ckpt)
    assert "consistent bases are taken instead" in caplog.text
    with LogReader(tmp_path / "log") as r:
        assert (r.bases, r.streamed) == ([0, 4, 8], [])
        assert r.meta["torch"]["base_slices"] == {
            "k": 2, "in_force": 1, "why": r.meta["torch"]["base_slices"]["why"]}
        assert "DeMo" in r.meta["torch"]["base_slices"]["why"]


def test_streamed_bases_follow_the_layout() -> None:
    """A layout that cannot replay streamed bases says why, and consistent bases are taken.
    The schedule of a shard is cut from the job's parameters with their global shapes (the
    same on every rank), not from the shard's own."""
    from lowdiff_store.torch.capture.bases.slices import schedule_for, streaming

    meta = {"mode": "grad", "optimizer": "torch.optim.adamw.AdamW"}
    assert streaming(3, meta, layout_why=None, base_mode="foreground",
                     delta_codec="xor") == (3, None)
    assert streaming(3, meta, layout_why="because", base_mode="foreground",
                     delta_codec="xor") == (1, "because")
    shard = {"params": ["b"], "model": [["b", "F32", [1, 2]]],
             "shard": {"global_params": ["a", "b", "c"],
                       "global_model": [["a", "F32", [4, 2]], ["b", "F32", [4, 2]],
                                        ["c", "F32", [4, 2]]]}}
    sched = schedule_for(shard, 3)
    assert (sched.names, sched.sizes) == (["a", "b", "c"], [8, 8, 8])
    assert sched.groups_for(3) == (frozenset({"a"}), frozenset({"b"}), frozenset({"c"}))


def test_slice_groups_are_a_pure_function_of_names_sizes_and_k() -> None:
    from lowdiff_store.torch.capture.bases.slices import slice_groups

    assert slice_groups(["a", "b", "c", "d"], [1, 1, 1, 1], 2) == [["a", "b"], ["c", "d"]]
    assert slice_groups(["a", "b", "c", "d"], [100, 1, 1, 1], 3) == [["a"], ["b", "c", "d"]]
    assert slice_groups(["a", "b", "c"], [5, 5, 5], 5) == [["a"], ["b"], ["c"]]
    assert slice_groups(["a"], [0], 3) == [["a"]]


def test_every_step_restores_when_every_step_takes_a_slice(tmp_path: Any) -> None:
    case, steps = "adam_amp_fp16", 14
    _, ref = reference(case, steps, at=tuple(range(1, steps + 1)))
    path = tmp_path / "log"
    o = build(case)
    ref[0] = snapshot(o)
    with _ckpt(path, case, o, snapshot_every=4, base_slices=4) as ckpt:
        run(case, o, 0, steps, ckpt)
    with LogReader(path) as r:
        # MLPBN's first weight is most of it: 4 slices asked, 3 groups are not empty
        assert r.streamed == [(4, (2, 3, 4)), (8, (6, 7, 8)), (12, (10, 11, 12))]
    for t in range(steps + 1):
        o2 = build(case)
        res = _restore(path, o2, step=t)
        assert res.base_step == t - t % 4
        assert res.replayed == (t if t < 4 else t % 4 + 2)
        assert_same(snapshot(o2), ref[t])


def test_auto_slices_are_bitwise_and_within_the_interval(tmp_path: Any) -> None:
    case, steps = "adamw", 20
    _, ref = reference(case, steps, at=(steps,))
    path = tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, snapshot_every=6, base_slices="auto") as ckpt:
        run(case, o, 0, steps, ckpt)
    with LogReader(path) as r:
        assert [c for c, _s in r.streamed] == [6, 12, 18]
        assert all(2 <= len(s) <= 6 for _c, s in r.streamed)
        assert r.meta["torch"]["base_slices"] == {"k": "auto", "in_force": 4, "why": None}
    o2 = build(case)
    res = _restore(path, o2)
    assert (res.step, res.base_step) == (steps, 18)
    assert_same(snapshot(o2), ref[steps])


@pytest.mark.parametrize("case", ["adamw", "delta", "layerwise"])
def test_live_slices_hold_no_staging_for_the_slices_after_the_first(case: str,
                                                                   tmp_path: Any) -> None:
    _, ref = reference(case, 14, at=(11, 14))
    path = tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, snapshot_every=6, base_slices=3, base_staging="live") as ckpt:
        run(case, o, 0, 14, ckpt)
        st = ckpt.stats()
    with LogReader(path) as r:
        assert r.streamed == [(6, (4, 5, 6)), (12, (10, 11, 12))]
        params = set(r.meta["torch"]["params"])
        # the first slice of each base (the one copied) holds no parameter, nor its state:
        # the rank-local state only; the parameters are in the two slices after it
        for first, rest in ((4, (5, 6)), (10, (11, 12))):
            with r.slice_file(first) as f:
                assert not params & {n.split("/")[-2] if n.startswith("@opt/") else n
                                     for n in f.names}
            held = set()
            for s in rest:
                with r.slice_file(s) as f:
                    held |= params & set(f.names)
            assert held == params
        smallest = min(r.slice_file(s).nbytes for s in (5, 6, 11, 12))
    # the slices after the first of each base were written from the live tensors: the
    # staging memory held is the first slices' (one buffer, reused), never the others'
    assert st["base_staging_bytes"] < smallest
    assert st["slice_wait_s"] >= 0.0
    for t in (11, 14):
        o2 = build(case)
        res = _restore(path, o2, step=t)
        assert res.exact
        assert_same(snapshot(o2), ref[t])


def test_live_staging_is_for_streamed_bases_only(tmp_path: Any) -> None:
    from lowdiff_store.errors import ConfigError

    o = build("adamw")
    with pytest.raises(ConfigError, match="base_staging='live' applies to streamed bases"):
        _ckpt(tmp_path / "log", "adamw", o, base_staging="live", base_slices=1)


def test_staging_for_slices_is_two_slices_made_once_never_the_state(tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    with DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=4, base_slices=4,
                          exact_bases=True) as ckpt:
        area = ckpt._out.stager.area
        made = []
        for t in range(1, 21):
            opt.zero_grad()
            model(torch.randn(8, 64, generator=torch.Generator().manual_seed(t))).sum().backward()
            opt.step()
            made.append(area.allocated)
        st = ckpt.stats()
    with LogReader(tmp_path / "log") as r:
        assert [c for c, _s in r.streamed] == [4, 8, 12, 16, 20]
        largest = max(r.slice_file(s).nbytes for _c, steps in r.streamed for s in steps)
    # two buffers at most, made during the first base's window, none after it
    assert made[-1] == made[4] <= 2
    assert st["base_staging_bytes"] <= 2.1 * largest
    assert st["base_staging_bytes"] < 0.6 * state


def test_truncating_before_a_streamed_base_drops_it_with_its_slices(tmp_path: Any) -> None:
    case = "adamw"
    _, ref = reference(case, 16, at=(16,))
    path = tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, snapshot_every=5, base_slices=3) as ckpt:
        run(case, o, 0, 14, ckpt)
    o = build(case)
    res = _restore(path, o, step=9)
    assert (res.step, res.base_step) == (9, 5)
    with _ckpt(path, case, o, snapshot_every=5, base_slices=3, resume="truncate") as ckpt:
        with LogReader(path) as r:
            assert r.streamed == [(5, (3, 4, 5))]
            assert r.last_step == 9
        assert sorted(int(n[6:22]) for n in os.listdir(path) if n.startswith("slice-")) == \
            [3, 4, 5]
        run(case, o, 9, 16, ckpt)
    assert_same(snapshot(o), ref[16])
    with LogReader(path) as r:
        # the base of step 10 starts at once (its window began before the resumed step)
        assert [c for c, _s in r.streamed] == [5, 12, 15]
    o2 = build(case)
    res = _restore(path, o2)
    assert (res.step, res.base_step) == (16, 15)
    assert_same(snapshot(o2), ref[16])


def test_tune_counts_the_slices_in_the_recovery(tmp_path: Any, capsys: Any) -> None:
    import json

    from lowdiff_store import cli
    from lowdiff_store.tuning import Measurements, recommend
    from lowdiff_store.tuning_from_log import recorded_measurements

    path = tmp_path / "log"
    _one_log(path, steps=16)
    assert cli.main(["tune", str(path), "--mtbf", "3600", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    k = d["base_slices"]
    assert 2 <= k <= d["snapshot_every"]
    m = Measurements.from_dict({**recorded_measurements(path), "mtbf": 3600.0})
    plain = recommend(m)
    assert plain.snapshot_every == d["snapshot_every"]
    assert d["recovery"]["replay_diffs"] == pytest.approx(plain.recovery.replay_diffs + k - 1)
    assert cli.main(["tune", str(path), "--mtbf", "3600"]) == 0
    assert f"base_slices     {k} (streamed bases" in capsys.readouterr().out


def test_a_live_slice_is_read_beside_the_next_forward_and_backward(tmp_path: Any) -> None:
    """``base_staging="live"``: the post-step hook hands a slice over as views of the live
    tensors and returns without waiting for the writer; the next optimizer step waits
    (``slice_wait_s``) until the writer has read it. The writer is held inside the
    slice's release here, so the order is forced, not raced."""
    import threading

    _, ref = reference("adamw", 8, at=(8,))
    o = build("adamw")
    path = tmp_path / "log"
    with _ckpt(path, "adamw", o, snapshot_every=6, base_slices=3,
               base_staging="live") as ckpt:
        out = ckpt._out
        sink = out.sink
        orig = sink.write_base
        gate, reached = threading.Event(), threading.Event()

        def write_base(step: int, tensors: Any, meta: Any, *, release: Any = None,
                       **kw: Any) -> Any:
            if step == 5 and release is not None:
                inner = release

                def release() -> None:   # (on the writer's thread, once it read them)
                    reached.set()
                    gate.wait(30)
                    inner()
            return orig(step, tensors, meta, release=release, **kw)

        sink.write_base = write_base
        run("adamw", o, 0, 5, ckpt)      # step 5 takes the second slice, from views
        assert out.streamer is not None
        assert out.streamer.deferred
        live = out.streamer.live
        assert live is not None          # returned with the writer still holding it
        assert not live.done.is_set()
        assert reached.wait(30)          # the writer has read the slice ...
        threading.Timer(0.2, gate.set).start()
        run("adamw", o, 5, 8, ckpt)      # ... step 6 waits at its pre-step hook
        assert out.streamer.live is None
        assert ckpt.stats()["slice_wait_s"] > 0.0
    with LogReader(path) as r:
        assert r.streamed == [(6, (4, 5, 6))]
    o2 = build("adamw")
    assert _restore(path, o2).step == 8
    assert_same(snapshot(o2), ref[8])


def test_refer_base_is_refused_while_bases_are_streamed(tmp_path: Any) -> None:
    """A base by reference is a consistent base of another writer's checkpoint: refused
    (one line, nothing written) in a log that streams its bases, whose staging is sized for
    slices and whose slice may hold the step; the log goes on streaming."""
    from lowdiff_store.errors import ConfigError, Reason

    o = build("adamw")
    path = tmp_path / "log"
    with _ckpt(path, "adamw", o, snapshot_every=4, base_slices=2) as ckpt:
        run("adamw", o, 0, 3, ckpt)
        with pytest.raises(ConfigError, match="streams its bases") as e:
            ckpt.refer_base(tmp_path / "dcp")
        assert e.value.reason is Reason.NOT_ALLOWED
        run("adamw", o, 3, 5, ckpt)
    with LogReader(path) as r:
        assert (r.bases, r.streamed) == ([0], [(4, (3, 4))])


def test_the_default_streams_on_cpu_and_is_quiet_where_not_vouched(tmp_path: Any,
                                                                   caplog: Any) -> None:
    """``base_slices=None`` (the default): ``"auto"`` for a CPU model, recorded as such;
    where a per-tensor replay is not vouched for, consistent bases with the reason in the
    log's metadata and no warning (the default asked for nothing)."""
    case, steps = "adamw", 13
    _, ref = reference(case, steps, at=(steps,))
    o = build(case)
    with _ckpt(tmp_path / "a", case, o, snapshot_every=4) as ckpt:
        run(case, o, 0, steps, ckpt)
        assert ckpt.stats()["base_slices"] >= 4
    with LogReader(tmp_path / "a") as r:
        assert r.meta["torch"]["base_slices"] == {"k": "auto", "in_force": 4, "why": None}
        assert [c for c, _s in r.streamed] == [4, 8, 12]
    o2 = build(case)
    assert _restore(tmp_path / "a", o2).base_step == 12
    assert_same(snapshot(o2), ref[steps])
    o = build("demo")
    with caplog.at_level("WARNING"), _ckpt(tmp_path / "d", "demo", o, snapshot_every=4) as ckpt:
        run("demo", o, 0, 5, ckpt)
    assert "consistent bases are taken instead" not in caplog.text
    with LogReader(tmp_path / "d") as r:
        assert (r.bases, r.streamed) == ([0, 4], [])
        bs = r.meta["torch"]["base_slices"]
        assert (bs["k"], bs["in_force"]) == ("auto", 1)
        assert "DeMo" in bs["why"]


def test_the_default_keeps_consistent_bases_on_an_accelerator() -> None:
    """On a device other than the CPU the default takes consistent bases and records
    nothing (streamed bases are not measured on a GPU yet); asked for, they stream."""
    from lowdiff_store.torch.capture.bases.slices import plan_slices
    from lowdiff_store.torch.capture.options import CheckpointerOptions

    meta: dict[str, Any] = {"mode": "grad", "optimizer": "torch.optim.adamw.AdamW",
                            "device": "cuda"}
    assert plan_slices(meta, CheckpointerOptions(), None) == 1
    assert "base_slices" not in meta
    assert plan_slices(meta, CheckpointerOptions(base_slices=3), None) == 3
    assert meta["base_slices"] == {"k": 3, "in_force": 3, "why": None}
    cpu = {**meta, "device": "cpu"}
    del cpu["base_slices"]
    assert plan_slices(cpu, CheckpointerOptions(), None) == 4
    assert plan_slices(cpu, CheckpointerOptions(base_slices=1), None) == 1


@pytest.mark.parametrize(("first", "then"), [(1, 3), (3, 1)])
def test_a_log_continued_with_other_base_slices_restores_bitwise(first: int, then: int,
                                                                 tmp_path: Any) -> None:
    """A log written with consistent bases and continued with streamed ones (a log of an
    older version under the new default), or the other way round: each base says what it
    is, and every step restores bitwise from either kind."""
    case, steps = "adamw", 20
    _, ref = reference(case, steps, at=tuple(range(1, steps + 1)))
    path = tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, snapshot_every=4, base_slices=first) as ckpt:
        run(case, o, 0, 9, ckpt)
    o = build(case)
    res = _restore(path, o)
    assert res.step == 9
    with _ckpt(path, case, o, snapshot_every=4, base_slices=then, restored=res) as ckpt:
        run(case, o, 9, steps, ckpt)
    with LogReader(path) as r:
        consistent = [b for b in r.bases if b > 0]
        streamed = [c for c, _s in r.streamed]
    assert (consistent, streamed) == (([4, 8], [12, 16, 20]) if first == 1
                                      else ([12, 16, 20], [4, 8]))
    for t in (5, 9, 10, 13, 17, steps):
        o2 = build(case)
        res = _restore(path, o2, step=t)
        assert res.step == t
        assert_same(snapshot(o2), ref[t])


def test_a_slice_waits_for_held_staging_a_bounded_time_then_the_base_is_put_off(
        tmp_path: Any, monkeypatch: Any) -> None:
    """Staging memory the writer does not give back (a store in an outage holds the
    slices it cannot upload) must not hold training: a slice after the first waits for it
    ``SLICE_WAIT_S`` at most, then its base is abandoned (``base_deferred``), the next
    first slices are put off without waiting while the memory is held, and once it is
    given back a base completes again; every step restores bitwise. The writer is made
    to hold the slices of steps 5 and 6 until step 10, so the order is forced."""
    import threading

    from lowdiff_store.torch.capture.bases import stager

    monkeypatch.setattr(stager, "SLICE_WAIT_S", 0.2)
    from lowdiff_store.torch.capture.bases import streaming

    monkeypatch.setattr(streaming, "SLICE_WAIT_S", 0.2)
    case, steps = "adamw", 20
    _, ref = reference(case, steps, at=(12, steps))
    o = build(case)
    path = tmp_path / "log"
    gate = threading.Event()
    with _ckpt(path, case, o, snapshot_every=8, base_slices=4, exact_bases=False) as ckpt:
        sink = ckpt._out.sink
        orig = sink.write_base

        def write_base(step: int, tensors: Any, meta: Any, *, release: Any = None,
                       **kw: Any) -> Any:
            if step in (5, 6) and release is not None:
                inner = release

                def release() -> None:  # (the writer goes on; the memory stays held)
                    threading.Thread(target=lambda: (gate.wait(60), inner())).start()
            return orig(step, tensors, meta, release=release, **kw)

        sink.write_base = write_base
        run(case, o, 0, 10, ckpt)      # step 7's slice finds no memory: put off
        held = ckpt.stats()
        gate.set()
        run(case, o, 10, steps, ckpt)
        st = ckpt.stats()
    assert held["base_deferred"] >= 1, held
    with LogReader(path) as r:
        done = [c for c, _s in r.streamed]
    assert 8 not in done, done   # the held base never completed; a later one did
    assert done, done
    for t in (12, steps):
        o2 = build(case)
        res = _restore(path, o2, step=t)
        assert res.step == t
        assert_same(snapshot(o2), ref[t])
    assert st["base_deferred"] >= held["base_deferred"]


def test_the_environment_sets_the_default(monkeypatch: Any, tmp_path: Any) -> None:
    """``LOWDIFF_BASE_SLICES`` sets what ``base_slices=None`` means, as if given (on an
    accelerator too); an explicit ``base_slices`` wins; a bad value is one ConfigError
    naming the variable."""
    from lowdiff_store.errors import ConfigError
    from lowdiff_store.torch.capture.bases.slices import plan_slices
    from lowdiff_store.torch.capture.options import CheckpointerOptions

    def meta(device: str) -> dict[str, Any]:
        return {"mode": "grad", "optimizer": "torch.optim.adamw.AdamW", "device": device}

    monkeypatch.setenv("LOWDIFF_BASE_SLICES", "1")
    m = meta("cpu")
    assert plan_slices(m, CheckpointerOptions(), None) == 1
    assert "base_slices" not in m
    assert plan_slices(meta("cpu"), CheckpointerOptions(base_slices=3), None) == 3
    monkeypatch.setenv("LOWDIFF_BASE_SLICES", "auto")
    m = meta("cuda")
    assert plan_slices(m, CheckpointerOptions(), None) == 4
    assert m["base_slices"] == {"k": "auto", "in_force": 4, "why": None}
    monkeypatch.setenv("LOWDIFF_BASE_SLICES", "6")
    assert plan_slices(meta("cpu"), CheckpointerOptions(), None) == 6
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv("LOWDIFF_BASE_SLICES", bad)
        with pytest.raises(ConfigError, match="LOWDIFF_BASE_SLICES") as e:
            plan_slices(meta("cpu"), CheckpointerOptions(), None)
        assert "\n" not in str(e.value)
    monkeypatch.setenv("LOWDIFF_BASE_SLICES", "1")
    o = build("adamw")
    with _ckpt(tmp_path / "log", "adamw", o, snapshot_every=4) as ckpt:
        run("adamw", o, 0, 9, ckpt)
    with LogReader(tmp_path / "log") as r:
        assert (r.bases, r.streamed) == ([0, 4, 8], [])


def test_bases_go_into_the_writer_process_ring_off_the_training_thread(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    from lowdiff_store.torch.capture import process_sink
    from lowdiff_store.writer.ring_client import RingClient

    real_put, real_write = RingClient.put_base, process_sink.ProcessSink.write_base
    returned: set[int] = set()
    seen: list[tuple[int, str, bool]] = []

    def write_base(self: Any, step: int, *a: Any, **kw: Any) -> None:
        real_write(self, step, *a, **kw)
        returned.add(step)

    def put_base(self: Any, step: int, *a: Any, **kw: Any) -> None:
        t0 = time.monotonic()  # the hand-over returned before the copy: it is not waited on
        while step not in returned and time.monotonic() - t0 < 10:
            time.sleep(0.002)
        seen.append((step, threading.current_thread().name, step in returned))
        real_put(self, step, *a, **kw)
    monkeypatch.setattr(process_sink.ProcessSink, "write_base", write_base)
    monkeypatch.setattr(RingClient, "put_base", put_base)
    case = "adamw"
    _, ref = reference(case, 12, at=(12,))
    path = tmp_path / "log"
    o = build(case)
    with _ckpt(path, case, o, snapshot_every=5, base_slices=3, writer_process=True) as ckpt:
        run(case, o, 0, 12, ckpt)
    assert [s for s, _t, _r in seen] == [0, 3, 4, 5, 8, 9, 10]  # base 0, then the slices
    assert all(name.startswith("lowdiff-ring-base") for _s, name, _r in seen), seen
    assert all(r for _s, _t, r in seen), seen
    o2 = build(case)
    res = _restore(path, o2, step=12)
    assert (res.base_step, res.exact) == (10, True)
    assert_same(snapshot(o2), ref[12])
