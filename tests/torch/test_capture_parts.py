"""The parts DiffCheckpointer composes: the frozen options, the side-channel tracker, the
gradient capture and its reset, the base stager, the restore hand-off passed explicitly."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _cases import assert_same, build, reference, run, snapshot

from lowdiff_store import ConfigError, LogReader, Reason
from lowdiff_store.torch import DiffCheckpointer, TopKCompressor, restore
from lowdiff_store.torch.capture.bases.stager import BaseStager
from lowdiff_store.torch.capture.carried import Carried
from lowdiff_store.torch.capture.grad_capture import GradCapture, GradStaging
from lowdiff_store.torch.capture.options import DEFAULTS, CheckpointerOptions
from lowdiff_store.torch.capture.side_channel import SideChannel
from lowdiff_store.torch.capture.stateful import ExtraSource
from lowdiff_store.torch.core import schema as L
from lowdiff_store.torch.core.registry import forget, restored
from lowdiff_store.torch.core.step_batch import HostPool
from lowdiff_store.torch.core.tensors import same_bytes
from lowdiff_store.writer.deferred import DeferredEncoding

# ---------------------------------------------------------------------- options


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "weights"}, "mode='weights' must be 'grad' or 'delta'"),
    ({"snapshot_every": 0}, "snapshot_every=0 must be an int >= 1 or 'auto'"),
    ({"snapshot_every": 2.0}, "snapshot_every=2.0 must be an int"),
    ({"batch": "many"}, "batch='many' must be an int >= 1 or 'auto'"),
    ({"base_mode": "later"}, "base_mode='later' must be 'foreground' or 'background'"),
    ({"mtbf": 0}, "mtbf=0 must be a positive number of seconds"),
    ({"mtbf": float("inf")}, "mtbf=inf must be a positive number"),
    ({"tuner": [1]}, "tuner must be a dict"),
    ({"resume": "append"}, "resume='append' must be 'continue' or 'truncate'"),
    ({"digest_every": -1}, "digest_every must be an int >= 0"),
    ({"capture": "eager"}, "capture='eager' must be 'dense' or 'layerwise'"),
    ({"capture": "layerwise", "mode": "delta"}, "capture='layerwise' applies to dense"),
    ({"delta_codec": "gzip"}, "delta_codec='gzip' must be 'xor', 'q8', 'topk' or 'lcc'"),
    ({"delta_bits": 9}, "delta_bits must be an int in 1..8"),
    ({"ef_state": "never"}, "ef_state='never' must be 'base' or 'step'"),
    ({"delta_ratio": 0.0}, r"delta_ratio must be in \(0, 1\]"),
    ({"writer_process": "yes"}, "writer_process='yes' must be True, False or 'auto'"),
    ({"writer_process": 1}, "writer_process=1 must be True, False or 'auto'"),
    ({"writer_process": None}, "writer_process=None must be True, False or 'auto'"),
])
def test_options_refuse_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointerOptions(**kwargs)


def test_options_from_arguments_split_writer_options_and_refuse_unknown_ones() -> None:
    o = CheckpointerOptions.from_arguments("delta", 7, "auto",
                                           {"delta_codec": "q8", "max_delay_s": 0.5})
    assert (o.mode, o.snapshot_every, o.batch, o.delta_codec) == ("delta", 7, "auto", "q8")
    assert o.writer == {"max_delay_s": 0.5}
    assert o.advanced() == {**DEFAULTS, "delta_codec": "q8"}
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['digest_evry'\]"):
        CheckpointerOptions.from_arguments("grad", 1, 1, {"digest_evry": 3})


def test_options_are_frozen_and_defaults_are_the_documented_table() -> None:
    o = CheckpointerOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.mode = "delta"  # type: ignore[misc]
    assert o.truncating().resume == "truncate"
    assert o.resume == "continue"
    assert DEFAULTS == {
        "capture": "dense", "digest_every": 10, "grad_zstd": None, "delta_codec": "xor",
        "delta_ratio": 0.01, "delta_block": 256, "delta_bits": 3, "delta_min_numel": 4096,
        "delta_zstd": 3, "ef_state": "base", "ef_zstd": None, "resume": "continue",
        "base_mode": "foreground", "base_staging": "overlap", "staging_budget": None,
        "exact_bases": False, "base_slices": None, "mtbf": None, "tuner": None,
        "writer_process": "auto", "records_in_flight": 2, "ring_bytes": None,
        "heap_pad": True, "writer_nice": 5}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "torch.md").read_text()
    assert "lowdiff_store.torch.capture.options.DEFAULTS" in doc
    for k, v in DEFAULTS.items():
        shown = "None" if v is None else repr(v).replace("'", '"')
        assert f"| `{k}` | `{shown}`" in doc or f"| `{k}` | {shown}" in doc, k


def test_options_check_the_compressor() -> None:
    model = torch.nn.Linear(2, 2)
    comp = TopKCompressor(0.5)
    with pytest.raises(ConfigError, match="only applies to mode='grad'"):
        CheckpointerOptions(mode="delta").check_compressor(comp)
    with pytest.raises(ConfigError, match="must be a TopKCompressor"):
        CheckpointerOptions().check_compressor(object())
    with pytest.raises(ConfigError, match="applies to dense gradients"):
        CheckpointerOptions(capture="layerwise").check_compressor(comp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # held: the compressor's ref is weak
    comp.attach(opt)
    with pytest.raises(ConfigError, match="already attached") as err:
        CheckpointerOptions().check_compressor(comp)
    assert err.value.reason is Reason.NOT_ALLOWED
    CheckpointerOptions().check_compressor(None)


# ---------------------------------------------------------------------- the tracker


def test_carried_records_a_value_only_when_its_bits_change() -> None:
    c = Carried(L.same)
    assert c.changed("sched", {"lr": 0.1}) is True       # nothing carried yet
    assert c.changed("sched", {"lr": 0.1}) is False      # same bits
    assert c.changed("sched", {"lr": 0.2}) is True
    assert c.get("sched") == {"lr": 0.2}
    c.set("scaler", None)
    assert c.changed("scaler", None) is False            # carried from creation
    c.forget()
    assert c.get("sched") is None
    assert c.changed("scaler", None) is True             # unknown after a resume
    assert c.changed("sched", {"lr": 0.2}) is True


def test_carried_arrays_compare_bytes_dtype_and_shape() -> None:
    c = Carried(same_bytes)
    a = np.arange(4, dtype=np.float32)
    assert c.changed("@rng/cpu", a)
    assert not c.changed("@rng/cpu", a.copy())
    assert c.changed("@rng/cpu", a.view(np.int32))       # same bytes, other dtype
    assert c.changed("@rng/cpu", a.reshape(2, 2))
    assert c.changed("bn.running_mean", a)               # keys are independent


# ---------------------------------------------------------------------- gradient capture


def _grads(model: torch.nn.Module) -> tuple[GradCapture, list[str], torch.optim.Optimizer]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [n for n, _p in model.named_parameters()]
    cap = GradCapture(names, list(model.parameters()), opt, compressor=None, zstd=None,
                      path="mem")
    return cap, names, opt


def test_grad_capture_hands_the_step_over_and_resets() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    cap, names, _opt = _grads(model)
    model(torch.randn(4, 3)).sum().backward()
    side: dict[str, Any] = {}
    cap.capture(side)
    cap.copy_done(1)  # a copy beside the step ends (the first post-step hook waits)
    assert side == {}
    assert [s.name for s in cap.specs] == [L.GRAD + n for n in names]
    assert set(cap.seen) == set(names)
    assert len(cap.bufs) == 2
    for buf, p in zip(cap.bufs, model.parameters(), strict=True):
        assert torch.equal(buf, p.grad)
    specs, bufs = cap.specs, cap.bufs
    cap.reset()  # the step's record took them
    assert len(specs) == 2
    assert len(bufs) == 2
    assert (cap.specs, cap.bufs, cap.seen) == ([], [], {})


def test_grad_capture_release_gives_the_buffers_back_and_resets() -> None:
    model = torch.nn.Linear(3, 2)
    cap, _names, _opt = _grads(model)
    model(torch.randn(4, 3)).sum().backward()
    cap.capture({})
    bufs = list(cap.bufs)
    cap.release()  # a step the scaler skipped
    assert (cap.specs, cap.bufs, cap.seen) == ([], [], {})
    again = [cap.pool.take(p.grad) for p in reversed(list(model.parameters()))]
    assert {id(b) for b in again} == {id(b) for b in bufs}  # reused from the pool


def test_grad_capture_check_recaptures_a_gradient_changed_after_it() -> None:
    model = torch.nn.Linear(3, 2)
    cap, names, _opt = _grads(model)
    model(torch.randn(4, 3)).sum().backward()
    cap.last = False  # a pre-step hook ran after the capture
    cap.capture({})
    model.weight.grad.mul_(3.0)  # that hook changed a gradient
    cap.check({})
    by_name = {s.name: s for s in cap.specs}
    assert set(by_name) == {L.GRAD + n for n in names}
    got = np.frombuffer(by_name[L.GRAD + "weight"].enc.parts[0].data, dtype=np.float32)
    assert np.array_equal(got, model.weight.grad.numpy().reshape(-1))
    cap.last = True
    model.bias.grad.mul_(2.0)
    before = list(cap.specs)
    cap.check({})  # ours ran last: the step changed it after consuming the capture
    assert cap.specs == before


# ---------------------------------------------------------------------- base stager


def test_base_stager_copies_the_live_state_and_counts_bases_in_flight() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = ["weight", "bias"]
    tensors = dict(model.named_parameters())
    stager = BaseStager(tensors, names, list(model.parameters()), opt, None, None)
    want = model.weight.detach().clone()
    assert stager.stage(4) is None  # no staging memory made yet: put off, and asked for
    assert stager.area.wait_made(60)  # (made on the helper thread)
    base = stager.stage(4)
    assert base is not None
    assert base.step == 4
    assert stager.in_flight == 1
    assert base.nbytes == sum(a.nbytes for _t, a in base.arrays.values())
    assert base.arrays["weight"][1].nbytes + base.arrays["bias"][1].nbytes == 8 * 4
    assert L.RNG_CPU in base.arrays  # the generators' states go into a base too
    assert stager.settle(base)  # the copy is complete, nothing changed meanwhile
    with torch.no_grad():
        model.weight.add_(1.0)
    assert np.array_equal(base.arrays["weight"][1], want.numpy())  # a copy, not a view
    stager.release(base)
    stager.release(base)  # idempotent (the writer and an error path may both release)
    assert stager.in_flight == 0
    again = stager.stage(8)  # the staging memory is reused
    assert again is not None
    # reused: nothing new beyond the first buffer and the spare a small state is given
    assert stager.area.allocated <= 2
    with torch.no_grad():
        model.weight.add_(1.0)  # changed before the copy was settled: not intact
    assert not stager.settle(again)
    assert again.job is not None
    assert again.job.changed == ["weight"]
    stager.release(again)
    stager.close()


# ---------------------------------------------------------------------- restore hand-off


def test_restore_result_passed_explicitly_continues_the_log(tmp_path: Path) -> None:
    p = tmp_path / "log"
    o = build("sgd_bn")
    with DiffCheckpointer(p, o.model, o.optimizer, scheduler=o.scheduler,
                          snapshot_every=5) as ck:
        run("sgd_bn", o, 0, 7, ck)
    o2 = build("sgd_bn")
    res = restore(p, o2.model, o2.optimizer, scheduler=o2.scheduler)
    assert res.info is not None
    assert res.info.step == 7
    assert restored(o2.optimizer) is res.info
    forget(o2.optimizer)  # only the explicit hand-off is left
    with DiffCheckpointer(p, o2.model, o2.optimizer, scheduler=o2.scheduler,
                          snapshot_every=5, restored=res) as ck:
        assert ck.step == 7
        run("sgd_bn", o2, 7, 12, ck)
    with LogReader(p) as r:
        assert r.last_step == 12
    _ref, snaps = reference("sgd_bn", 12)
    o3 = build("sgd_bn")
    restore(p, o3.model, o3.optimizer, scheduler=o3.scheduler)
    assert_same(snapshot(o3), snaps[12])


def test_the_registry_is_dropped_once_a_checkpointer_took_it(tmp_path: Path) -> None:
    p = tmp_path / "log"
    o = build("sgd_bn")
    with DiffCheckpointer(p, o.model, o.optimizer, snapshot_every=5) as ck:
        run("sgd_bn", o, 0, 3, ck)
    o2 = build("sgd_bn")
    res = restore(p, o2.model, o2.optimizer)
    with DiffCheckpointer(p, o2.model, o2.optimizer, snapshot_every=5, restored=res.info):
        assert restored(o2.optimizer) is None
    with pytest.raises(ConfigError, match="restored= takes what restore"):
        DiffCheckpointer(tmp_path / "other", o2.model, o2.optimizer, restored=3)


class _Residuals:
    """A compressor as the side channel sees it: error feedback and its residuals."""

    error_feedback = True

    def __init__(self) -> None:
        self.residuals: dict[torch.Tensor, torch.Tensor] = {}


def _ef_record(side: Any, pool: Any) -> tuple[dict[str, np.ndarray], int]:
    """The residual tensors one ``after_step`` logs (encoded as the encoder thread would)
    and the host buffers it hands to the record."""
    specs: list[Any] = []
    release: list[torch.Tensor] = []
    side.after_step(specs, {}, release)
    out = {}
    for s in specs:
        if s.name.startswith(L.EF):
            assert isinstance(s.enc, DeferredEncoding)  # made on the encoder thread
            enc = s.enc.encode()
            assert enc.codec == "raw"
            out[s.name] = enc.parts[0].data.copy()
    pool.give(release)
    return out, len(release)


def test_residuals_go_to_the_host_as_one_batch_and_only_when_they_changed() -> None:
    """``ef_state="step"``: each step's residuals are one host copy per dtype (not one per
    tensor), a residual is logged when it was replaced or changed in place, and its bits
    are logged exactly (bf16 as its 16-bit patterns)."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 4)]
    comp = _Residuals()
    pool = HostPool()
    opt = torch.optim.SGD(params, lr=0.1)
    side = SideChannel(opt, None, None, ExtraSource(None), {}, compressor=comp,
                       names=["a", "b", "c"], params=params, ef_step=True, pool=pool)
    r = [torch.randn(3), torch.randn(5), torch.randn(4).to(torch.bfloat16)]
    for p, t in zip(params, r, strict=True):
        comp.residuals[p] = t
    got, nbufs = _ef_record(side, pool)
    assert nbufs == 2  # float32 and bf16 bits: one buffer each for three residuals
    assert sorted(got) == [L.EF + n for n in "abc"]
    assert np.array_equal(got[L.EF + "a"], r[0].numpy())
    assert np.array_equal(got[L.EF + "c"], r[2].view(torch.int16).numpy().view(np.uint16))
    assert _ef_record(side, pool)[0] == {}  # nothing changed: nothing logged
    r[1].add_(1.0)  # changed in place (DeMo's momentum)
    comp.residuals[params[0]] = r[0] * 2  # replaced (top-k's residual)
    got, _n = _ef_record(side, pool)
    assert sorted(got) == [L.EF + "a", L.EF + "b"]
    assert np.array_equal(got[L.EF + "b"], r[1].numpy())
    side.forget()  # after a resume every residual is stated again
    assert sorted(_ef_record(side, pool)[0]) == [L.EF + n for n in "abc"]
    misses = pool.misses
    _ef_record(side, pool)
    side.forget()
    _ef_record(side, pool)
    assert pool.misses == misses  # the host buffers are reused step after step


def test_dense_copies_from_a_device_wait_for_the_layerwise_copies_queued_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer-wise capture under CUDA copies each gradient during backward on a side stream;
    a copy found stale at the step (a grad scaler's unscale bumped the version) gives its
    host buffer back to the pool, and the dense copy takes it again at once (same shape:
    the same buffer) on the current stream. Unless the current stream first waits for
    the side stream, the stale side copy can land after the dense one: the record holds
    the gradient before the unscale. Checked on the order of the device work (no GPU
    here): main queued the dense copy with no wait (the wait came after, in
    ``copies_done``)."""
    order: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            order.append(f"{self.name} waits {other.name}")

    dev = torch.device("cuda", 0)
    side, current = Stream("side"), Stream("current")

    class Src:  # a device gradient, as far as copy_claimed looks
        device = dev

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch, "_foreach_copy_",
                        lambda dst, srcs, non_blocking=False: order.append(
                            f"copy {len(dst)} on current"))
    staging = GradStaging()
    staging.streams[dev] = side  # layer-wise copies were queued on it during backward
    buf = torch.empty(4)
    staging._todo = [(buf, Src())]  # type: ignore[list-item]
    staging.copy_claimed()
    assert order == ["current waits side", "copy 1 on current"]
