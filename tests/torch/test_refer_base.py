"""``DiffCheckpointer.refer_base``: a checkpoint another writer saved after a step becomes
the log's base of that step by reference (format section 7.1), and ``InitialBase(...,
load=False)``: base 0 refers to a checkpoint the objects already hold. Only the tensors
whose bits the checkpoint holds are referenced; restore is bitwise; a checkpoint deleted
or saved from another state is never taken for the state."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)

from lowdiff_store import ConfigError, LowdiffError, Reason
from lowdiff_store.compaction import compact
from lowdiff_store.log import LogReader
from lowdiff_store.log.reference import ReferenceBase
from lowdiff_store.torch import DiffCheckpointer, InitialBase, replay_state, restore
from tests.helpers.tiny import bits_differ, build, train

#: no periodic base of the log's own
NEVER = 1 << 62


def _dcp_save(path: Path, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
                 checkpoint_id=str(path), no_dist=True)


def _state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m/{k}": v.clone() for k, v in m.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o/{i}/{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    return out


def test_a_checkpoint_saved_after_a_step_becomes_its_base_by_reference(tmp_path: Path
                                                                      ) -> None:
    m, opt = build()
    log, ck = tmp_path / "log", tmp_path / "ck3"
    ckpt = DiffCheckpointer(log, m, opt, snapshot_every=NEVER, base_slices=1)
    train(m, opt, 0, 3)
    _dcp_save(ck, m, opt)
    at3 = _state(m, opt)
    assert ckpt.refer_base(ck)
    train(m, opt, 3, 6)
    ckpt.close()
    end = _state(m, opt)
    with LogReader(log) as r:
        assert r.bases == [0, 3]
        base = r.base(3)
        try:
            assert isinstance(base, ReferenceBase)
            assert base.file.names == ["@rng/cpu"]  # every tensor of the state referenced
            assert base.reference.root == str(ck)
            assert len(base.reference.tensors) == 6 + 18  # 6 parameters, 3 Adam entries each
            base.verify_all()
        finally:
            base.close()
    assert os.path.getsize(log / "base-0000000000000003.safetensors") < 12_000
    state3, _opt = replay_state(log, 3)
    assert set(state3) == {k[2:] for k in at3 if k[0] == "m"}
    assert not bits_differ({f"m/{k}": v for k, v in state3.items()},
                           {k: v for k, v in at3.items() if k[0] == "m"})
    # the log's retention keeps the reference base alone; restore replays from it
    res = compact(log, keep_bases=1)
    assert res.plan.delete_bases == [0]
    m2, opt2 = build(seed=7)
    got = restore(log, m2, opt2)
    assert got is not None
    assert (got.step, got.base_step, got.exact) == (6, 3, True)
    assert not bits_differ(_state(m2, opt2), end)
    # the checkpoint deleted: one line naming it, never another state
    shutil.rmtree(ck)
    with pytest.raises(LowdiffError) as err:
        restore(log, *build(seed=7))
    assert err.value.reason is Reason.MISSING_FILE
    assert err.value.path == str(ck / ".metadata")


def test_only_tensors_with_the_checkpoints_bits_are_referenced(tmp_path: Path) -> None:
    """A checkpoint saved from another state (a step earlier) is named by no tensor but
    the ones that did not change: the base holds the rest, and refers to nothing when
    nothing matches."""
    m, opt = build()
    log = tmp_path / "log"
    ckpt = DiffCheckpointer(log, m, opt, snapshot_every=NEVER, base_slices=1)
    train(m, opt, 0, 2)
    _dcp_save(tmp_path / "old", m, opt)  # the state after step 2
    train(m, opt, 2, 3)
    assert ckpt.refer_base(tmp_path / "old")  # claimed for step 3: nothing matches
    train(m, opt, 3, 4)
    ckpt.close()
    with LogReader(log) as r:
        base = r.base(3)
        try:
            assert not isinstance(base, ReferenceBase)  # depends on no checkpoint
            assert len([n for n in base.names if not n.startswith("@rng")]) == 6 + 18
        finally:
            base.close()
    m2, opt2 = build(seed=7)
    restore(log, m2, opt2)
    assert not bits_differ(_state(m2, opt2), _state(m, opt))


def test_refer_base_needs_a_pending_step(tmp_path: Path) -> None:
    m, opt = build()
    _dcp_save(tmp_path / "ck", m, opt)
    with DiffCheckpointer(tmp_path / "log", m, opt, snapshot_every=NEVER, base_slices=1) as ckpt:
        with pytest.raises(ConfigError) as err:
            ckpt.refer_base(tmp_path / "ck")  # no step taken yet
        assert err.value.reason is Reason.INVALID_ARGUMENT
        train(m, opt, 0, 1)
        ckpt.flush()  # step 1 completed and handed over: nothing pending
        with pytest.raises(ConfigError):
            ckpt.refer_base(tmp_path / "ck")


def test_initial_base_not_loaded_refers_to_what_the_objects_hold(tmp_path: Path) -> None:
    """``InitialBase(path, load=False)``: nothing is loaded (the objects keep their values);
    base 0 refers to the checkpoint's tensors with the same bits."""
    m, opt = build()
    train(m, opt, 0, 2)
    _dcp_save(tmp_path / "ck", m, opt)
    with torch.no_grad():
        m[0].bias.add_(1.0)  # one tensor no longer the checkpoint's
    before = _state(m, opt)
    ckpt = DiffCheckpointer(tmp_path / "log", m, opt, snapshot_every=NEVER, base_slices=1,
                            initial_base=InitialBase(str(tmp_path / "ck"), load=False))
    assert not bits_differ(_state(m, opt), before)  # nothing loaded
    train(m, opt, 2, 4)
    ckpt.close()
    with LogReader(tmp_path / "log") as r:
        base = r.base(0)
        try:
            assert isinstance(base, ReferenceBase)
            assert sorted(base.file.names) == ["0.bias", "@rng/cpu"]
            assert len(base.reference.tensors) == 5 + 18
        finally:
            base.close()
    m2, opt2 = build(seed=7)
    restore(tmp_path / "log", m2, opt2)
    assert not bits_differ(_state(m2, opt2), _state(m, opt))
