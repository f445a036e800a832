"""Continuing, truncating and refusing histories; digests; error-feedback residuals between
bases; configuration errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _cases import EF_BASE, assert_same, build, ckpt_kwargs, run, snapshot

from lowdiff_store import ConfigError, LogReader, Reason, ReplayError
from lowdiff_store.torch import DiffCheckpointer, TopKCompressor, restore

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)


def _ckpt(path: Any, case: str, o: Any, **kw: Any) -> DiffCheckpointer:
    return DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                            compressor=o.compressor, **{**ckpt_kwargs(case), **kw})


def _restore(path: Any, o: Any, **kw: Any) -> Any:
    return restore(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler, **kw)


def _log(path: Any, case: str = "sgd_bn", steps: int = 20, **kw: Any) -> None:
    o = build(case)
    with _ckpt(path, case, o, **kw) as ckpt:
        run(case, o, 0, steps, ckpt)


def test_existing_log_needs_restore_first(tmp_path: Any) -> None:
    _log(tmp_path / "log")
    o = build("sgd_bn")
    with pytest.raises(ConfigError) as err:
        _ckpt(tmp_path / "log", "sgd_bn", o)
    assert err.value.reason is Reason.HISTORY_CONFLICT
    assert "restore" in str(err.value)


def test_earlier_step_refused_then_truncated(tmp_path: Any) -> None:
    path = tmp_path / "log"
    _log(path, snapshot_every=5)
    o = build("sgd_bn")
    assert _restore(path, o, step=12).step == 12
    with pytest.raises(ConfigError) as err:
        _ckpt(path, "sgd_bn", o)
    assert err.value.reason is Reason.HISTORY_CONFLICT
    assert "resume='truncate'" in str(err.value)
    assert "13..20" in str(err.value)
    with LogReader(path) as r:
        assert r.last_step == 20  # refusing changed nothing
    # explicit truncation: steps 13..20 are discarded, a new history follows step 12
    with _ckpt(path, "sgd_bn", o, resume="truncate", snapshot_every=5) as ckpt:
        with LogReader(path) as r:
            assert r.last_step == 12
            assert r.bases == [0, 5, 10]
        o.optimizer.param_groups[0]["momentum"] = 0.5  # the new history differs
        run("sgd_bn", o, 12, 18, ckpt)
    want = snapshot(o)
    o2 = build("sgd_bn")
    assert _restore(path, o2).step == 18
    assert_same(snapshot(o2), want)


def test_objects_changed_after_restore(tmp_path: Any) -> None:
    path = tmp_path / "log"
    _log(path, steps=6)
    o = build("sgd_bn")
    _restore(path, o)
    run("sgd_bn", o, 6, 7)  # trained without the checkpointer
    with pytest.raises(ConfigError) as err:
        _ckpt(path, "sgd_bn", o)
    assert err.value.reason is Reason.STATE_MISMATCH


def test_restore_into_other_objects_is_refused(tmp_path: Any) -> None:
    path = tmp_path / "log"
    _log(path, steps=3)
    o = build("sgd_bn")
    adam = torch.optim.Adam(o.model.parameters())
    with pytest.raises(ConfigError) as err:
        restore(path, o.model, adam)
    assert err.value.reason is Reason.STATE_MISMATCH
    assert "SGD" in str(err.value)
    other = build("adamw")
    with pytest.raises(ConfigError) as err:
        restore(path, other.model, torch.optim.SGD(other.model.parameters(), lr=0.1))
    assert err.value.reason is Reason.STATE_MISMATCH


def test_digest_reports_first_divergent_step(tmp_path: Any, monkeypatch: Any) -> None:
    """A recorded hyperparameter that is not what training used (simulated writer bug):
    replay must not silently produce other weights."""
    from lowdiff_store.torch.core import schema as L
    from lowdiff_store.torch.core.typed_msgpack import pack

    orig = DiffCheckpointer._pre_hook

    def tampering(self: DiffCheckpointer, args: Any, kwargs: Any) -> None:
        orig(self, args, kwargs)
        if self.step == 12:  # the hook of step 13
            groups = [dict(g) for g in L.hyper_of(self.optimizer)]
            groups[0]["lr"] = groups[0]["lr"] * 0.5
            self._step_side["hyper"] = [pack(g) for g in groups]

    monkeypatch.setattr(DiffCheckpointer, "_pre_hook", tampering)
    for k, want in ((1, "at step 13 (last verified step 12)"),
                    (5, "at step 15 (last verified step 10)")):
        path = tmp_path / f"k{k}"
        _log(path, steps=20, digest_every=k, snapshot_every=10)
        o = build("sgd_bn")
        with pytest.raises(ReplayError) as err:
            _restore(path, o, step=18)
        assert err.value.reason is Reason.REPLAY_DIVERGED
        assert want in str(err.value)
        # the gradients replay set (views of the log's records) are not left behind
        assert all(p.grad is None for p in o.model.parameters())
        o = build("sgd_bn")
        assert _restore(path, o, step=18, verify=False).step == 18  # opt-out
        assert _restore(path, build("sgd_bn"), step=12).step == 12  # before the tampering


def _count_digests(monkeypatch: Any) -> list[int]:
    """Record the step of every digest replay computes (the state's step is not known to
    the digest: the count is what matters)."""
    from lowdiff_store.torch.replay import engine as R

    calls: list[int] = []
    orig = R.Replayer._digest

    def counting(self: Any, state: Any, layout: Any) -> int:
        calls.append(1)
        return int(orig(self, state, layout))

    monkeypatch.setattr(R.Replayer, "_digest", counting)
    return calls


def test_only_the_last_digest_on_the_way_is_checked(tmp_path: Any, monkeypatch: Any) -> None:
    """A digest every 2 steps: replay from base 10 to 19 checks the one at 18 only (one pass
    over the state instead of four), and the state is training's, bit for bit."""
    path = tmp_path / "log"
    o = build("adamw")
    with _ckpt(path, "adamw", o, digest_every=2, snapshot_every=10) as ckpt:
        run("adamw", o, 0, 19, ckpt)
    want = snapshot(o)
    calls = _count_digests(monkeypatch)
    o2 = build("adamw")
    res = _restore(path, o2, step=19)
    assert (res.base_step, res.replayed, res.verified) == (10, 9, [18])
    assert len(calls) == 1
    assert_same(want, snapshot(o2))
    calls.clear()
    res = _restore(path, build("adamw"), step=18)
    assert res.verified == [18]
    assert len(calls) == 1
    calls.clear()
    res = _restore(path, build("adamw"), step=17, verify=False)
    assert res.verified == []
    assert calls == []


def test_a_mismatch_that_does_not_repeat_is_noted(tmp_path: Any, monkeypatch: Any) -> None:
    """The last digest does not match in the first pass (a nondeterministic replay,
    simulated): the second pass checks every digest; all match, so its state is returned,
    with a note saying so."""
    from lowdiff_store.torch.replay import engine as R

    path = tmp_path / "log"
    o = build("adamw")
    with _ckpt(path, "adamw", o, digest_every=2, snapshot_every=10) as ckpt:
        run("adamw", o, 0, 19, ckpt)
    want = snapshot(o)
    orig = R.Replayer._digest
    flips = [1]

    def once_wrong(self: Any, state: Any, layout: Any) -> int:
        got = int(orig(self, state, layout))
        if flips:
            flips.pop()
            return got ^ 1
        return got

    monkeypatch.setattr(R.Replayer, "_digest", once_wrong)
    marks: list[tuple[int, int]] = []
    o2 = build("adamw")
    res = _restore(path, o2, step=19, progress=lambda d, t: marks.append((d, t)))
    assert res.verified == [12, 14, 16, 18]  # the second pass checked each
    assert any("not deterministic" in n and "step 18" in n for n in res.notes), res.notes
    assert marks.count((0, 9)) == 2
    assert marks[-1] == (9, 9)
    assert_same(want, snapshot(o2))


def test_digests_off_the_declared_cadence_are_all_checked(tmp_path: Any,
                                                          monkeypatch: Any) -> None:
    """A log whose digests are not where its digest_every says (written every 5 steps,
    declared every 2): no digest at or after step 12 on the way to 13, so the pass is
    repeated checking every digest, and a digest is never silently skipped."""
    from lowdiff_store.torch.replay import restore as R

    path = tmp_path / "log"
    _log(path, "adamw", steps=13, digest_every=5, snapshot_every=100)
    orig = R.log_meta

    def declared_2(reader: Any) -> Any:
        return dataclasses.replace(orig(reader), digest_every=2)

    monkeypatch.setattr(R, "log_meta", declared_2)
    calls = _count_digests(monkeypatch)
    res = _restore(path, build("adamw"), step=13)
    assert res.verified == [5, 10]
    assert len(calls) == 2  # nothing in the first pass, both in the second
    assert not any("deterministic" in n for n in res.notes)


def test_error_feedback_residuals_between_bases(tmp_path: Any) -> None:
    """ef_state='base': weights and optimizer are exact anywhere; the residual is exact at a
    base; between bases it is the base's residual with every entry sent since zeroed."""
    case = EF_BASE
    ref_o = build(case)
    comp = ref_o.compressor
    comp.attach(ref_o.optimizer)
    names = dict(ref_o.model.named_parameters())
    snaps: dict[int, Any] = {}
    res10: dict[str, torch.Tensor] = {}
    sent: dict[str, torch.Tensor] = {n: torch.zeros(p.numel(), dtype=torch.bool)
                                     for n, p in names.items()}
    for t in range(1, 31):
        run(case, ref_o, t - 1, t)
        if t == 10:
            res10 = {n: comp.residuals[p].clone() for n, p in names.items()}
        if 10 < t <= 17:
            for n, p in names.items():
                sent[n][comp.last[p][0]] = True
        if t in (17, 20, 30):
            snaps[t] = snapshot(ref_o)
    path = tmp_path / "log"
    _log(path, case, steps=30, snapshot_every=10)

    o = build(case)
    res = _restore(path, o, step=17, compressor=o.compressor)
    assert not res.exact
    assert "approximate" in res.notes[0]
    assert_same(snapshot(o), snaps[17])  # weights, optimizer, RNG: exact
    for n, p in dict(o.model.named_parameters()).items():
        want = res10[n].clone().reshape(-1)
        want[sent[n]] = 0
        assert torch.equal(o.compressor.residuals[p].reshape(-1), want), n
    # continuing from an approximate residual is not the original run (documented)
    run(case, o, 17, 30)
    assert not torch.equal(o.model.state_dict()["net.0.weight"],
                           snaps[30]["model"]["net.0.weight"])

    o = build(case)
    res = _restore(path, o, step=20)  # a base: residuals exact
    assert res.exact
    with _ckpt(tmp_path / "log", case, o, resume="truncate") as ckpt:  # takes the residuals
        run(case, o, 20, 30, ckpt)
    assert_same(snapshot(o), snaps[30])


def test_reopen_at_inexact_step_writes_a_base(tmp_path: Any) -> None:
    path = tmp_path / "log"
    _log(path, EF_BASE, steps=14, snapshot_every=10)
    o = build(EF_BASE)
    assert not _restore(path, o).exact
    with _ckpt(path, EF_BASE, o, snapshot_every=10) as ckpt:
        run(EF_BASE, o, 14, 16, ckpt)
    with LogReader(path) as r:
        assert r.bases == [0, 10, 14]
    o2 = build(EF_BASE)
    res = _restore(path, o2, step=14, compressor=o2.compressor)
    assert res.exact
    assert res.base_step == 14


def test_durable_step_and_flush(tmp_path: Any) -> None:
    o = build("sgd_bn")
    with _ckpt(tmp_path / "log", "sgd_bn", o, batch=100) as ckpt:
        assert ckpt.durable_step in (-1, 0)
        run("sgd_bn", o, 0, 5, ckpt)
        assert ckpt.step == 5
        assert ckpt.durable_step < 5
        assert ckpt.flush() == 5 == ckpt.durable_step
    with pytest.raises(ConfigError):
        ckpt.flush()


def test_configuration_errors(tmp_path: Any) -> None:
    o = build("sgd_bn")
    bad: list[dict[str, Any]] = [
        {"mode": "weights"}, {"snapshot_every": 0}, {"batch": 0}, {"nonsense": 1},
        {"capture": "layerwise", "compressor": TopKCompressor()},
        {"mode": "delta", "compressor": TopKCompressor()},
        {"delta_codec": "zip"}, {"ef_state": "never"}, {"resume": "maybe"},
        {"extra_state": lambda: {"loader": {1, 2}}},
    ]
    for i, kw in enumerate(bad):
        with pytest.raises(ConfigError):
            DiffCheckpointer(tmp_path / f"bad{i}", o.model, o.optimizer, **kw)
    attached = TopKCompressor().attach(o.optimizer)
    with pytest.raises(ConfigError):
        DiffCheckpointer(tmp_path / "att", o.model, o.optimizer, compressor=attached)
    attached.detach()
    with pytest.raises(ConfigError):
        TopKCompressor(ratio=0)
    stranger = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*o.model.parameters(), stranger], lr=0.1)
    with pytest.raises(ConfigError) as err:
        DiffCheckpointer(tmp_path / "stranger", o.model, opt)
    assert err.value.reason is Reason.STATE_MISMATCH


def test_closure_step_refused_in_grad_mode(tmp_path: Any) -> None:
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.LBFGS(m.parameters())
    x = torch.randn(4, 3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = m(x).pow(2).sum()
        loss.backward()
        return loss

    with pytest.raises(ConfigError) as err:  # LBFGS calls its closure several times
        DiffCheckpointer(tmp_path / "g", m, opt)
    assert err.value.reason is Reason.NOT_ALLOWED
    assert not (tmp_path / "g").exists()
    with DiffCheckpointer(tmp_path / "d", m, opt, mode="delta") as ckpt:
        opt.step(closure)
        assert ckpt.step == 1


def test_resume_records_state_touched_after_restore(tmp_path: Any) -> None:
    """Buffers, extra state and hyperparameters changed between restore() and the new
    checkpointer are recorded by the first step after the resume."""
    for case in ("sgd_bn", "delta"):
        path = tmp_path / case
        _log(path, case, steps=10, snapshot_every=4)
        o = build(case)
        _restore(path, o)
        o.model.net[1].running_mean.add_(1.0)  # a buffer, not covered by the digest
        o.optimizer.param_groups[0]["weight_decay"] = 0.0
        o.extra["note"] = "resumed"
        with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                              extra_state=lambda o=o: dict(o.extra),
                              **ckpt_kwargs(case)) as ckpt:
            run(case, o, 10, 13, ckpt)
        want = snapshot(o)
        o2 = build(case)
        res = _restore(path, o2)
        assert res.step == 13
        assert res.extra == {"batches": 13, "note": "resumed"}
        assert_same(snapshot(o2), want)


def test_pre_hook_registered_after_the_checkpointer(tmp_path: Any) -> None:
    """A later pre-step hook that changes gradients: the log holds what the step consumed."""
    o = build("sgd_bn")
    with _ckpt(tmp_path / "log", "sgd_bn", o) as ckpt:
        def halve(opt: Any, args: Any, kwargs: Any) -> None:
            for g in opt.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.mul_(0.5)

        o.optimizer.register_step_pre_hook(halve)
        run("sgd_bn", o, 0, 6, ckpt)
    want = snapshot(o)
    o2 = build("sgd_bn")
    _restore(tmp_path / "log", o2)
    assert_same(snapshot(o2), want)


def test_unsupported_training_patterns_are_refused(tmp_path: Any) -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with DiffCheckpointer(tmp_path / "sparse", emb, opt):
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(ConfigError) as err:
            opt.step()
        assert err.value.reason is Reason.NOT_ALLOWED
    o = build("sgd_bn")
    with _ckpt(tmp_path / "groups", "sgd_bn", o) as ckpt:
        run("sgd_bn", o, 0, 2, ckpt)
        o.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        with pytest.raises(ConfigError) as err:
            run("sgd_bn", o, 2, 3, ckpt)
        assert err.value.reason is Reason.STATE_MISMATCH
        o.optimizer.param_groups.pop()


def test_restore_reports_progress_per_replayed_step(tmp_path: Any) -> None:
    path = tmp_path / "log"
    _log(path, snapshot_every=5)
    calls: list[tuple[int, int]] = []
    o = build("sgd_bn")
    res = _restore(path, o, step=13, progress=lambda done, total: calls.append((done, total)))
    assert (res.base_step, res.replayed) == (10, 3)
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]
    calls.clear()
    _restore(path, build("sgd_bn"), step=10, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(0, 0)]  # a base: nothing to replay
