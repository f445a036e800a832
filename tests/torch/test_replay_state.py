"""Time travel without the user's model: replay_state, export_state, describe_log, the
optimizer allow-list."""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np
import pytest
import torch
from _cases import assert_same, build, ckpt_kwargs, reference, run

from lowdiff_store import ConfigError, Reason
from lowdiff_store.torch import (
    DiffCheckpointer,
    describe_log,
    export_state,
    flatten_optimizer_state,
    replay_state,
)

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)


def _log(tmp_path: Any, case: str, steps: int = 20, **kw: Any) -> Any:
    path = tmp_path / case
    o = build(case)
    with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                          compressor=o.compressor, **{**ckpt_kwargs(case), **kw}) as ckpt:
        run(case, o, 0, steps, ckpt)
    return path


@pytest.mark.parametrize("case", ["adamw", "sgd_bn", "adam_amp_fp16", "topk", "delta"])
def test_replay_state_equals_reference(case: str, tmp_path: Any) -> None:
    _, ref = reference(case, 20, at=(13,))
    path = _log(tmp_path, case)
    calls: list[tuple[int, int]] = []
    state, opt_state = replay_state(path, 13, with_optimizer=True,
                                    progress=lambda d, t: calls.append((d, t)))
    assert calls[0] == (0, 3)
    assert calls[-1] == (3, 3)
    assert_same(state, ref[13]["model"])  # every state_dict name, tied "head.weight" too
    assert list(state) == list(ref[13]["model"])
    names = [g.pop("param_names") for g in opt_state["param_groups"]]
    assert names == [describe_log(path)["params"]]  # filled in, torch's convention
    assert_same(opt_state, ref[13]["optimizer"])
    latest, none = replay_state(path)
    assert none is None
    assert_same(latest, ref[20]["model"])


def test_export_formats_load_and_equal(tmp_path: Any) -> None:
    _, ref = reference("adamw", 12)
    path = _log(tmp_path, "adamw", 12)
    state, opt_state = replay_state(path, 12, with_optimizer=True)
    want = ref[12]["model"]
    export_state(state, tmp_path / "w.pt", format="pt")
    assert_same(torch.load(tmp_path / "w.pt", weights_only=True), want)

    from safetensors.torch import load_file

    export_state(state, tmp_path / "w.safetensors", format="safetensors")
    assert_same(load_file(tmp_path / "w.safetensors"), want)

    names = describe_log(path)["params"]
    flat = flatten_optimizer_state(opt_state)
    assert_same(flat, flatten_optimizer_state(opt_state, names))
    assert "@opt/layer.linear1.weight/exp_avg" in flat
    export_state(state, tmp_path / "w.h5", format="hdf5", optimizer_state=opt_state)
    with h5py.File(tmp_path / "w.h5", "r") as f:
        assert '"lr"' in f.attrs["optimizer_param_groups"]
        for name, t in want.items():
            ds = f[name]
            assert ds.attrs["dtype"] == "F32"
            assert ds.chunks is None
            assert np.array_equal(ds[()], t.numpy())
        avg = f["@opt/layer.linear1.weight/exp_avg"][()]
        assert np.array_equal(avg, flat["@opt/layer.linear1.weight/exp_avg"].numpy())
    with pytest.raises(ConfigError):
        export_state(state, tmp_path / "x", format="npz")


def test_own_safetensors_writer_without_the_package(tmp_path: Any, monkeypatch: Any) -> None:
    import builtins

    real_import = builtins.__import__

    def no_safetensors(name: str, *a: Any, **k: Any) -> Any:
        if name.startswith("safetensors"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    state = {"a": torch.arange(5, dtype=torch.float32), "b": torch.ones(2, 3,
                                                                        dtype=torch.bfloat16)}
    monkeypatch.setattr(builtins, "__import__", no_safetensors)
    export_state(state, tmp_path / "own.safetensors", format="safetensors")
    monkeypatch.setattr(builtins, "__import__", real_import)
    from safetensors.torch import load_file

    assert_same(load_file(tmp_path / "own.safetensors"), state)


class CustomSGD(torch.optim.SGD):
    """Not in the allow-list."""


def test_allow_list_refuses_other_optimizers(tmp_path: Any) -> None:
    _, ref = reference("sgd_bn", 8)
    o = build("sgd_bn")
    opt = CustomSGD(o.model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                    weight_decay=1e-4)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    with DiffCheckpointer(tmp_path / "log", o.model, opt, scheduler=sch) as ckpt:
        o.optimizer, o.scheduler = opt, sch
        run("sgd_bn", o, 0, 8, ckpt)
    with pytest.raises(ConfigError) as err:
        replay_state(tmp_path / "log", 8)
    assert err.value.reason is Reason.NOT_ALLOWED
    assert "optimizer_factory" in str(err.value)
    made: list[Any] = []

    def factory(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        made.append(groups)
        return CustomSGD(groups)

    state, _ = replay_state(tmp_path / "log", 8, optimizer_factory=factory)
    assert made
    assert made[0][0]["momentum"] == 0.9
    assert_same(state, ref[8]["model"])


def test_describe_log(tmp_path: Any) -> None:
    path = _log(tmp_path, "topk", 12, snapshot_every=5)
    d = describe_log(path)
    assert d["mode"] == "grad"
    assert d["optimizer"] == "torch.optim.sgd.SGD"
    assert d["codecs"]["grad"] == "sparse"
    assert d["compressor"]["kind"] == "topk"
    assert d["compressor"]["ratio"] == 0.05
    assert d["steps"]["bases"] == [0, 5, 10]
    assert d["steps"]["durable"] == 12
    assert {"name": "net.1.running_mean", "dtype": "F32", "shape": [32]} in d["model_tensors"]
    assert "net.1.running_mean" in d["buffers"]
    tied = describe_log(_log(tmp_path, "adamw", 2))
    assert tied["aliases"] == {"head.weight": "emb.weight"}
