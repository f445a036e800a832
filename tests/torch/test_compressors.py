"""TernGrad, QSGD, DeMo and the sampled top-k selector: bitwise restore-and-continue (cut
at 17, restore into fresh objects, continue to 30, compare with an uninterrupted run),
consumed == logged, message round trips and the restore's honesty about residuals."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from _cases import COMPRESSOR_CASES, assert_same, build, ckpt_kwargs, reference, run, snapshot

from lowdiff_store import LogReader
from lowdiff_store.torch import (
    DeMo,
    DeMoCompressor,
    DiffCheckpointer,
    QSGDCompressor,
    TernGradCompressor,
    TopKCompressor,
    restore,
)
from lowdiff_store.torch.compressors.select import exact_topk, sampled_topk
from lowdiff_store.torch.compressors.topk import decode_message


def _ckpt(path: Any, case: str, o: Any, **kw: Any) -> DiffCheckpointer:
    return DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler,
                            compressor=o.compressor, extra_state=lambda: dict(o.extra),
                            **{**ckpt_kwargs(case), **kw})


@pytest.mark.parametrize("case", COMPRESSOR_CASES)
def test_cut_at_17_restore_continue_to_30(case: str, tmp_path: Any) -> None:
    _, ref = reference(case, 30, at=(16,))
    path = tmp_path / "log"
    o = build(case)
    ckpt = _ckpt(path, case, o)
    run(case, o, 0, 17, ckpt)
    del ckpt, o  # crash: step 17 never completed
    gc.collect()

    o2 = build(case)
    res = restore(path, o2.model, o2.optimizer, scheduler=o2.scheduler)
    assert res.step == 16
    assert res.exact, res.notes
    assert res.verified == [16]  # a digest every step: the last one on the way is checked
    assert_same(snapshot(o2), ref[16])
    ckpt2 = _ckpt(path, case, o2)
    run(case, o2, 16, 30, ckpt2)
    ckpt2.close()
    assert_same(snapshot(o2), ref[30])
    o3 = build(case)
    assert restore(path, o3.model, o3.optimizer, scheduler=o3.scheduler).step == 30
    assert_same(snapshot(o3), ref[30])


@pytest.mark.parametrize("case", ["terngrad", "qsgd", "demo"])
def test_logged_message_is_what_training_consumed(case: str, tmp_path: Any) -> None:
    o = build(case)
    consumed: list[dict[str, torch.Tensor]] = []
    names = {p: n for n, p in o.model.named_parameters()}

    def grab(opt: Any, args: Any, kwargs: Any) -> None:
        consumed.append({names[p]: p.grad.clone() for g in opt.param_groups
                         for p in g["params"] if p.grad is not None})

    with _ckpt(tmp_path / "log", case, o) as ckpt:
        run(case, o, 0, 3, ckpt)
        # after the checkpointer's own pre-hook: exactly what the optimizer consumes
        o.optimizer.register_step_pre_hook(grab)
        run(case, o, 3, 6, ckpt)
    codec = o.compressor.grad_codec
    compressed = 0
    with LogReader(tmp_path / "log") as r:
        for t, grads in zip(range(4, 7), consumed, strict=True):
            rec = r.record(t)
            for name, g in grads.items():
                compressed += rec.entry("@grad/" + name).codec == codec
                got = torch.from_numpy(rec.tensor("@grad/" + name).copy())
                assert torch.equal(got.view(-1).view(torch.int32),
                                   g.reshape(-1).view(torch.int32)), (t, name)
    assert compressed >= 6


def test_messages() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=g)
    from lowdiff_store.torch.compressors.quantized import qsgd_message, terngrad_message

    t = terngrad_message(x, torch.Generator().manual_seed(1), 2.5)
    assert t.codec == "tern"
    assert t.nbytes == 2500 + 4
    dec = decode_message(t, (10_000,))
    s = float(dec.abs().max())
    assert set(torch.unique(dec).tolist()) <= {-s, 0.0, s}
    assert s <= 2.5 * float(x.std()) + 1e-6   # clipped at c * sigma
    assert abs(float((dec - x.clamp(-s, s)).mean())) < 0.05   # unbiased
    for levels, bits in ((1, 2), (3, 3), (7, 4), (15, 5)):
        q = qsgd_message(x, torch.Generator().manual_seed(1), levels, 512)
        assert q.codec == "qsgd"
        assert q.nbytes == -(-10_000 * bits // 8) + 4 * -(-10_000 // 512)
        d = decode_message(q, (10_000,))
        assert abs(float((d - x).mean())) < 0.05   # unbiased
        assert bool((torch.sign(d) * torch.sign(x) >= 0).all())


def test_sampled_selector_keeps_exactly_the_topk_set() -> None:
    g = torch.Generator().manual_seed(3)
    for n, k in ((200_000, 2000), (100_000, 1), (70_000, 7000), (1000, 10)):
        for dist in ("normal", "heavy"):
            x = torch.randn(n, generator=g)
            if dist == "heavy":
                x = x ** 5
            mag = x.abs()
            got = sampled_topk(mag, k)
            assert got.numel() == k
            assert bool((got[1:] > got[:-1]).all())  # ascending, unique
            want = torch.sort(exact_topk(mag, k)).values
            assert torch.equal(torch.sort(mag[got]).values, torch.sort(mag[want]).values)


def test_sampled_selector_consumed_equals_logged(tmp_path: Any) -> None:
    o = build("topk_sampled")
    with _ckpt(tmp_path / "log", "topk_sampled", o) as ckpt:
        run("topk_sampled", o, 0, 3, ckpt)
        w = o.model.net[0].weight
        consumed = w.grad.clone()
        k = o.compressor.k_for(w.numel())
        assert int((consumed != 0).sum()) <= k
    with LogReader(tmp_path / "log") as r:
        logged = torch.from_numpy(r.record(3).tensor("@grad/net.0.weight").copy())
    assert torch.equal(logged.view(torch.int32), consumed.view(torch.int32))


def test_demo_residuals_in_bases_only_is_not_exact(tmp_path: Any) -> None:
    o = build("demo")
    with _ckpt(tmp_path / "log", "demo", o, ef_state="base") as ckpt:
        run("demo", o, 0, 16, ckpt)
    with LogReader(tmp_path / "log") as r:
        # the base due at 10 (a base is put off, never waited for, while its staging
        # memory is still being made on the helper thread: it may land a step or two later)
        later = [b for b in r.bases if b > 0]
    assert later, later
    assert 10 <= later[0] <= 13, later
    b = later[0]
    o2 = build("demo")
    res = restore(tmp_path / "log", o2.model, o2.optimizer, scheduler=o2.scheduler, step=b + 2)
    assert not res.exact  # replayed past the base: DeMo's momenta are not in the records
    assert res.notes
    o3 = build("demo")
    res = restore(tmp_path / "log", o3.model, o3.optimizer, scheduler=o3.scheduler, step=b)
    assert res.exact  # a base: the momenta are there


def test_compressor_options_are_checked() -> None:
    from lowdiff_store.errors import ConfigError

    for bad in (lambda: TernGradCompressor(clip=0), lambda: QSGDCompressor(levels=0),
                lambda: QSGDCompressor(bucket=0), lambda: DeMoCompressor(topk=0),
                lambda: DeMo([torch.zeros(1, requires_grad=True)], lr=-1.0),
                lambda: TopKCompressor(selector="magic")):
        with pytest.raises(ConfigError):
            bad()


def test_replay_state_rebuilds_demo_without_the_model(tmp_path: Any) -> None:
    from lowdiff_store.torch import replay_state

    o = build("demo")
    with _ckpt(tmp_path / "log", "demo", o) as ckpt:
        run("demo", o, 0, 13, ckpt)
    state, _opt = replay_state(tmp_path / "log", 13)
    for n, t in o.model.state_dict().items():
        assert torch.equal(state[n], t), n


@pytest.mark.consistent_bases  # (its bases' steps)
def test_stochastic_restore_at_a_base_continues_bitwise(tmp_path: Any) -> None:
    """The generator position is in the base too (no record replayed)."""
    _, ref = reference("terngrad", 30)
    o = build("terngrad")
    with _ckpt(tmp_path / "log", "terngrad", o) as ckpt:
        run("terngrad", o, 0, 14, ckpt)
    o2 = build("terngrad")
    res = restore(tmp_path / "log", o2.model, o2.optimizer, step=10)
    assert res.exact
    assert res.replayed == 0
    assert o2.optimizer.param_groups[0]["lowdiff_rng"] == 10
    with _ckpt(tmp_path / "log", "terngrad", o2, resume="truncate") as ckpt:
        run("terngrad", o2, 10, 30, ckpt)
    assert_same(snapshot(o2), ref[30])


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last],
                         ids=["contiguous", "channels_last"])
def test_topk_error_feedback_keeps_what_was_not_sent(fmt: torch.memory_format) -> None:
    """Error feedback: the residual is the accumulated gradient minus what was sent, in
    every memory format. For a channels_last gradient the flat view of the accumulator
    is a copy, and the entries sent were zeroed in that copy only: the residual kept
    them, and the next step sent them again (twice the gradient on those entries)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(2, 3, 4, 4).contiguous(memory_format=fmt))
    opt = torch.optim.SGD([p], lr=0.1)
    comp = TopKCompressor(ratio=0.25, error_feedback=True)
    sent_total = torch.zeros(p.numel())
    grads_total = torch.zeros(p.numel())
    for _step in range(3):
        g = torch.randn(2, 3, 4, 4).contiguous(memory_format=fmt)
        grads_total += g.reshape(-1)
        p.grad = g.clone()
        comp.compress(opt)
        sent = p.grad.reshape(-1)
        assert int((sent != 0).sum()) == comp.k_for(p.numel())
        sent_total += sent
        residual = comp.residuals[p].reshape(-1)
        assert torch.equal(residual[sent != 0], torch.zeros(int((sent != 0).sum())))
        # what was sent plus what is kept is every gradient so far (up to rounding)
        assert torch.allclose(sent_total + residual, grads_total, atol=1e-5)
