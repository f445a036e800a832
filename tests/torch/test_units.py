"""Small units: typed metadata values, bit copies, the compressor, layer-wise capture, the
import boundary."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from _cases import build, ckpt_kwargs, run

from lowdiff_store import ConfigError, FormatError, LogReader
from lowdiff_store.torch import DiffCheckpointer, TopKCompressor
from lowdiff_store.torch.core.tensors import from_bits, to_bits, write_bits
from lowdiff_store.torch.core.typed_msgpack import pack, unpack


def _roundtrip(v: Any) -> Any:
    return unpack(msgpack.unpackb(msgpack.packb(pack(v), use_bin_type=True), raw=False,
                                  strict_map_key=False))


def test_pack_roundtrips_exactly() -> None:
    value = {"betas": (0.9, 0.999), "lr": torch.tensor(0.01), "ids": {3: "a", (1, 2): None},
             "nan": math.nan, "neg0": -0.0, "b": b"\x00\xff", "n": np.int64(7),
             "nested": [{"\x00tuple": 1}], "big": 2**63 - 1}
    out = _roundtrip(value)
    assert out["betas"] == (0.9, 0.999)
    assert type(out["betas"]) is tuple
    assert isinstance(out["lr"], torch.Tensor)
    assert torch.equal(out["lr"], value["lr"])
    assert out["ids"] == {3: "a", (1, 2): None}
    assert math.isnan(out["nan"])
    assert math.copysign(1, out["neg0"]) == -1
    assert out["b"] == b"\x00\xff"
    assert out["n"] == 7
    assert type(out["n"]) is int
    assert out["nested"] == [{"\x00tuple": 1}]  # a user map that looks like a tag survives
    for bad in ({1, 2}, object(), 2**64, torch.zeros(1 << 17)):
        with pytest.raises(ConfigError):
            pack({"x": bad})
    with pytest.raises(FormatError):
        unpack({"\x00tensor": ["F32", [2], b"\x00"]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.float8_e4m3fn, torch.uint8])
def test_bits_roundtrip(dtype: torch.dtype) -> None:
    t = torch.randn(3, 5).to(dtype)
    if dtype.is_floating_point and dtype.itemsize > 1:
        t.view(-1)[0] = -0.0
        t.view(-1)[1] = float("nan")
    tag, arr = to_bits(t)
    assert arr.flags.owndata or arr.base is not None
    back = from_bits(tag, arr)
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    dst = torch.empty_like(t)
    write_bits(dst, tag, arr)
    assert torch.equal(dst.view(torch.uint8), t.view(torch.uint8))
    scalar = t.reshape(-1)[2].clone()
    tag0, arr0 = to_bits(scalar)
    assert arr0.shape == ()
    assert from_bits(tag0, arr0).shape == ()


def test_topk_compressor_keeps_k_and_feeds_back() -> None:
    p = torch.nn.Parameter(torch.zeros(100))
    opt = torch.optim.SGD([p], lr=1.0)
    comp = TopKCompressor(0.05, error_feedback=True).attach(opt)
    g = torch.linspace(-1, 1, 100)
    p.grad = g.clone()
    opt.step()
    idx, vals = comp.last[p]
    assert len(idx) == 5
    assert torch.equal(vals, g[idx])
    dense = torch.zeros(100)
    dense[idx] = vals
    assert torch.equal(p.detach(), -dense)  # SGD consumed exactly the sparse gradient
    assert torch.equal(comp.residuals[p] + dense, g)  # nothing lost
    comp.detach()
    p.grad = g.clone()
    opt.step()
    assert torch.equal(p.grad, g)  # detached: no compression


def test_layerwise_capture_reuses_staged_copies(tmp_path: Any) -> None:
    """With ckpt.clip_grad_norm_ the copies made during backward stay valid: the record
    stores them with the clip scale instead of copying again."""
    case = "layerwise_clip"
    o = build(case)
    with DiffCheckpointer(tmp_path / "log", o.model, o.optimizer, scheduler=o.scheduler,
                          **ckpt_kwargs(case)) as ckpt:
        run(case, o, 0, 6, ckpt)
    names = {n for n, _p in o.model.named_parameters()}
    with LogReader(tmp_path / "log") as r:
        for t in range(1, 7):
            clip = r.record(t).side["clip"]
            assert set(clip["params"]) == names
            assert unpack(clip["scale"]).dtype == torch.float32


def test_import_lowdiff_store_does_not_import_torch() -> None:
    code = ("import sys, lowdiff_store, lowdiff_store.log, lowdiff_store.codecs; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attached_compressor_without_a_reference_keeps_compressing() -> None:
    import gc

    import torch

    from lowdiff_store.torch import TopKCompressor

    p = torch.nn.Parameter(torch.zeros(1000))
    opt = torch.optim.SGD([p], lr=1.0)
    TopKCompressor(ratio=0.01, error_feedback=False).attach(opt)  # no reference kept
    gc.collect()
    p.grad = torch.arange(1000, dtype=torch.float32)
    opt.step()
    assert int((p.detach() != 0).sum()) == 10  # only the top 1% was applied
    assert torch.equal(p.detach()[-10:], -torch.arange(990, 1000, dtype=torch.float32))


def test_the_metadata_schema_knows_every_codec_the_checkpointer_writes() -> None:
    from lowdiff_store import torchmeta
    from lowdiff_store.torch.capture.delta_capture import DELTA_CODECS

    assert set(torchmeta.DELTA_CODECS) == set(DELTA_CODECS)
    from lowdiff_store.torch import QSGDCompressor, TernGradCompressor, TopKCompressor

    for c in (TopKCompressor, TernGradCompressor, QSGDCompressor):
        assert c.grad_codec in torchmeta.GRAD_CODECS


@pytest.mark.parametrize("case", ["adamw", "layerwise_clip"])
def test_replay_lends_mapped_gradients_and_leaves_the_log_unchanged(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Replay hands the optimizer the record's own (copy-on-write mapped) gradients, with
    no copy; a clip scales them into buffers of replay's own. The restored state is the
    uninterrupted run's, bit for bit, and no byte of the log changes."""
    import hashlib

    from _cases import assert_same, reference, snapshot

    import lowdiff_store.torch.replay.engine as replay_mod
    from lowdiff_store.torch import restore

    steps = 6
    _ref, snaps = reference(case, steps)
    o = build(case)
    with DiffCheckpointer(tmp_path / "log", o.model, o.optimizer, scheduler=o.scheduler,
                          **{**ckpt_kwargs(case), "snapshot_every": 1000}) as ckpt:
        run(case, o, 0, steps, ckpt)

    def digest() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted((tmp_path / "log").iterdir()) if p.is_file()}

    before = digest()
    lent: list[int] = []
    real = replay_mod.lend_bits

    def spy(tag: str, arr: np.ndarray, like: torch.Tensor) -> torch.Tensor | None:
        t = real(tag, arr, like)
        lent.append(t is not None)
        if t is not None:
            assert t.data_ptr() == arr.__array_interface__["data"][0]  # a view, no copy
        return t

    monkeypatch.setattr(replay_mod, "lend_bits", spy)
    fresh = build(case)
    res = restore(tmp_path / "log", fresh.model, fresh.optimizer, scheduler=fresh.scheduler)
    assert res.step == steps
    assert res.replayed == steps
    assert res.exact
    n_params = len(list(fresh.model.parameters()))
    assert len(lent) == steps * n_params
    assert all(lent)
    assert all(p.grad is None for p in fresh.model.parameters())
    assert_same(snapshot(fresh)["model"], snaps[steps]["model"])
    assert_same(snapshot(fresh)["optimizer"], snaps[steps]["optimizer"])
    assert digest() == before


def _first_digest_mismatches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the first state digest replay computes come out wrong (replay then goes over
    the chain a second time); returns the list that records it."""
    import lowdiff_store.torch.replay.engine as replay_mod

    real = replay_mod.Replayer._digest
    lied: list[int] = []

    def lie_once(self: Any, state: Any, layout: Any) -> int:
        got: int = real(self, state, layout)
        if not lied:
            lied.append(got)
            return got ^ 1
        return got

    monkeypatch.setattr(replay_mod.Replayer, "_digest", lie_once)
    return lied


@pytest.mark.parametrize("case", ["adamw", "sgd_inplace", "adam_amp_fused"])
def test_a_second_replay_pass_reads_the_records_unchanged(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """A digest mismatch makes replay go over the same records again through the same
    reader. Lent gradients must still hold the log's bytes then: an optimizer whose step
    writes its gradients (foreach SGD with Nesterov momentum; a fused Adam given the grad
    scaler's scale, which stores the unscaled gradients back) is never lent the mapped
    records (its writes would land in the reader's private map, and the second pass read
    a checksum mismatch); one that only reads them (AdamW) is. All restore bit for bit."""
    from _cases import assert_same, reference, snapshot

    import lowdiff_store.torch.replay.engine as replay_mod
    from lowdiff_store.torch import restore

    steps = 6
    _ref, snaps = reference(case, steps)
    o = build(case)
    with DiffCheckpointer(tmp_path / "log", o.model, o.optimizer, scheduler=o.scheduler,
                          scaler=o.scaler,
                          **{**ckpt_kwargs(case), "snapshot_every": 1000}) as ckpt:
        run(case, o, 0, steps, ckpt)
    lent: list[bool] = []
    real_lend = replay_mod.lend_bits

    def spy(tag: str, arr: np.ndarray, like: torch.Tensor) -> torch.Tensor | None:
        t = real_lend(tag, arr, like)
        lent.append(t is not None)
        return t

    monkeypatch.setattr(replay_mod, "lend_bits", spy)
    lied = _first_digest_mismatches(monkeypatch)
    fresh = build(case)
    res = restore(tmp_path / "log", fresh.model, fresh.optimizer, scheduler=fresh.scheduler,
                  scaler=fresh.scaler)
    assert lied  # the first pass saw a mismatch at its one checked digest
    assert any("not deterministic" in n for n in res.notes)
    assert res.step == steps
    assert res.verified == list(range(1, steps + 1))  # the second pass checks them all
    assert (bool(lent) and all(lent)) if case == "adamw" else lent == []
    assert_same(snapshot(fresh)["model"], snaps[steps]["model"])
    assert_same(snapshot(fresh)["optimizer"], snaps[steps]["optimizer"])


def test_replay_decides_lending_with_the_steps_own_hyperparameters(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller builds the optimizer with other hyperparameters (plain momentum) and
    relies on restore to load the log's (Nesterov, whose foreach step adds the momentum
    into .grad). Lending, hinted from the groups as built, is decided again at each step
    with the log's values in place: the step gets copies, so a second pass (one digest
    made to mismatch) still reads the records unchanged, and the state is bit for bit."""
    from _cases import assert_same, reference, snapshot

    from lowdiff_store.torch import restore

    case, steps = "sgd_inplace", 6
    _ref, snaps = reference(case, steps)
    o = build(case)
    with DiffCheckpointer(tmp_path / "log", o.model, o.optimizer,
                          **{**ckpt_kwargs(case), "snapshot_every": 1000}) as ckpt:
        run(case, o, 0, steps, ckpt)
    lied = _first_digest_mismatches(monkeypatch)
    fresh = build(case)
    fresh.optimizer = torch.optim.SGD(fresh.model.parameters(), lr=0.05, momentum=0.5,
                                      foreach=True)
    res = restore(tmp_path / "log", fresh.model, fresh.optimizer)
    assert lied
    assert res.step == steps
    assert fresh.optimizer.param_groups[0]["nesterov"] is True  # the log's
    assert_same(snapshot(fresh)["model"], snaps[steps]["model"])
    assert_same(snapshot(fresh)["optimizer"], snaps[steps]["optimizer"])


def test_replay_reads_the_first_diff_while_the_base_loads(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetch thread starts before the base is loaded: the base load waits (up to 10
    s) for the first diff's record to be read, which it would wait for forever if the read
    came only after it. The restore is still the uninterrupted run's, bit for bit."""
    import threading

    from _cases import assert_same, reference, snapshot

    import lowdiff_store.torch.replay.engine as replay_mod
    from lowdiff_store.torch import restore

    case = "adamw"
    _ref, snaps = reference(case, 5)
    o = build(case)
    with DiffCheckpointer(tmp_path / "log", o.model, o.optimizer,
                          **{**ckpt_kwargs(case), "snapshot_every": 1000}) as ckpt:
        run(case, o, 0, 5, ckpt)
    read: list[tuple[int, str]] = []
    first = threading.Event()
    record, load_base = replay_mod.Replayer._record, replay_mod.Replayer._load_base

    def reading(self: Any, t: int) -> Any:
        read.append((t, threading.current_thread().name))
        first.set()
        return record(self, t)

    def loading(self: Any, base: Any, bmeta: Any) -> None:
        assert first.wait(10), "no diff was read while the base loaded"
        load_base(self, base, bmeta)

    monkeypatch.setattr(replay_mod.Replayer, "_record", reading)
    monkeypatch.setattr(replay_mod.Replayer, "_load_base", loading)
    fresh = build(case)
    res = restore(tmp_path / "log", fresh.model, fresh.optimizer)
    assert (res.step, res.replayed) == (5, 5)
    assert read == [(t, "lowdiff-replay-prefetch") for t in range(1, 6)]
    assert_same(snapshot(fresh)["model"], snaps[5]["model"])
    assert_same(snapshot(fresh)["optimizer"], snaps[5]["optimizer"])


def test_lend_bits_refuses_what_it_cannot_view_safely() -> None:
    from lowdiff_store.torch.core.tensors import lend_bits

    like = torch.zeros(2, 3)
    ok = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = lend_bits("F32", ok, like)
    assert t is not None
    assert t.data_ptr() == ok.__array_interface__["data"][0]
    ro = ok.copy()
    ro.flags.writeable = False
    assert lend_bits("F32", ro, like) is None                       # an in-place write would fault
    assert lend_bits("F32", ok.T.copy().T, like.T.contiguous()) is None  # not C-contiguous
    assert lend_bits("F32", ok.reshape(3, 2), like) is None         # other shape
    assert lend_bits("F16", ok.view(np.uint16)[:, :3], like) is None  # other dtype
    bf = torch.zeros(4, dtype=torch.bfloat16)
    bits = np.array([0x3F80, 0x4000, 0, 0x8000], dtype=np.uint16)
    got = lend_bits("BF16", bits, bf)
    assert got is not None
    assert got.dtype == torch.bfloat16
    assert got.tolist() == [1.0, 2.0, 0.0, -0.0]


def test_state_digest_in_windows_on_several_cores_is_the_sequential_crc(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest (docs/torch.md: CRC32C of each parameter's bytes, then its optimizer
    state entries in key order, a key's bytes before its value's) is computed in windows
    on several cores; it must be the same bits as the plain sequential CRC."""
    from lowdiff_store.format import checksum
    from lowdiff_store.format.checksum import crc32c
    from lowdiff_store.torch.core import schema

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    params = list(model.parameters())
    # AdamW's `step` is a 0-d tensor: its bytes are hashed as they are
    want_bytes = 0
    for p in params:
        want_bytes = crc32c(p.detach().numpy().tobytes(), want_bytes)
        for k, v in sorted(opt.state[p].items()):
            want_bytes = crc32c(k.encode(), want_bytes)
            want_bytes = crc32c(v.numpy().tobytes(), want_bytes)
    plain = schema.digest_objects(params, opt)
    assert plain == want_bytes
    for window, threshold in [(1, 1), (100, 1), (1 << 30, 1)]:
        monkeypatch.setattr(schema, "_DIGEST_WINDOW", window)
        monkeypatch.setattr(checksum, "PARALLEL_MIN_BYTES", threshold)
        assert schema.digest_objects(params, opt) == plain, (window, threshold)


def test_step_reads_grads_only_admits_only_steps_that_leave_gradients_alone() -> None:
    """The allow-list behind lending mapped gradients and copying beside the step, checked
    against what each configuration's step really does to ``.grad`` on this torch."""
    from lowdiff_store.torch.core.optimizers import step_reads_grads_only

    def params() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(64))]

    class MyAdamW(torch.optim.AdamW):
        pass

    cases: list[tuple[str, Any, bool, bool]] = [
        # (name, factory, grad_scale given, expected)
        ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), False, True),
        ("adam maximize amsgrad foreach", lambda ps: torch.optim.Adam(
            ps, lr=1e-2, weight_decay=0.1, maximize=True, amsgrad=True, foreach=True),
         False, True),
        ("adamw fused", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), False, True),
        ("adamw fused, scaled", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
         True, False),
        ("sgd nesterov foreach", lambda ps: torch.optim.SGD(
            ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True), False, False),
        ("sgd nesterov + weight decay", lambda ps: torch.optim.SGD(
            ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1, foreach=True),
         False, True),
        ("sgd nesterov fused", lambda ps: torch.optim.SGD(
            ps, lr=0.1, momentum=0.9, nesterov=True, fused=True), False, True),
        ("sgd tensor weight decay", lambda ps: torch.optim.SGD(
            ps, lr=0.1, weight_decay=torch.tensor(0.1, requires_grad=True)), False, False),
        ("adamw differentiable", lambda ps: torch.optim.AdamW(ps, lr=1e-2,
                                                              differentiable=True),
         False, False),
        ("a subclass", lambda ps: MyAdamW(ps, lr=1e-2), False, False),
        ("rmsprop", lambda ps: torch.optim.RMSprop(ps, lr=1e-2), False, False),
    ]
    for name, make, scaled, want in cases:
        ps = params()
        opt = make(ps)
        assert step_reads_grads_only(opt, grad_scale=scaled) is want, name
        if not want or name == "a subclass":
            continue
        # what the verdict promises: the step leaves every .grad bit for bit
        ps[0].grad = torch.randn(64)
        before = ps[0].grad.clone()
        if scaled:
            opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(0.0)
        for _ in range(3):
            opt.step()
        assert torch.equal(ps[0].grad, before), name
