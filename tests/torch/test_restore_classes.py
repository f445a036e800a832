"""``restore`` checks the scheduler's and the GradScaler's classes like the optimizer's
(issue #16): a log written with StepLR restored into a CosineAnnealingLR used to say
``exact=True`` and then diverge. Logs written before the classes were recorded (a scaler
recorded as a bool) keep restoring."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _cases import build, ckpt_kwargs, run

from lowdiff_store import ConfigError, Reason
from lowdiff_store.log.manifest import update_manifest
from lowdiff_store.torch import DiffCheckpointer, describe_log, restore


def _log(tmp_path: Any, case: str) -> str:
    path = str(tmp_path / case)
    o = build(case)
    with DiffCheckpointer(path, o.model, o.optimizer, scheduler=o.scheduler, scaler=o.scaler,
                          **ckpt_kwargs(case)) as ck:
        run(case, o, 0, 6, ck)
    return path


def test_other_scheduler_class_is_refused(tmp_path: Any) -> None:
    path = _log(tmp_path, "sgd_bn")  # StepLR
    o = build("sgd_bn")
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(o.optimizer, T_max=10)
    with pytest.raises(ConfigError) as ei:
        restore(path, o.model, o.optimizer, scheduler=cos)
    assert ei.value.reason is Reason.STATE_MISMATCH
    assert "StepLR" in str(ei.value)
    assert "CosineAnnealingLR" in str(ei.value)
    # the same class restores, a subclass of the recorded class too
    o = build("sgd_bn")
    assert restore(path, o.model, o.optimizer, scheduler=o.scheduler).exact

    class MyStepLR(torch.optim.lr_scheduler.StepLR):
        pass

    o = build("sgd_bn")
    assert restore(path, o.model, o.optimizer,
                   scheduler=MyStepLR(o.optimizer, step_size=5, gamma=0.5)).step == 6


class OtherScaler(torch.amp.GradScaler):
    """A scaler class that is not the one the log was written with (nor its base)."""


def test_scaler_class_is_recorded_and_checked(tmp_path: Any) -> None:
    path = _log(tmp_path, "adam_amp_fp16")
    assert describe_log(path)["scaler"] == "torch.amp.grad_scaler.GradScaler"
    o = build("adam_amp_fp16")
    assert restore(path, o.model, o.optimizer, scaler=o.scaler).step == 6
    update_manifest(path, lambda m: m.meta["torch"].__setitem__(
        "scaler", f"{OtherScaler.__module__}.{OtherScaler.__qualname__}"))
    o = build("adam_amp_fp16")
    with pytest.raises(ConfigError) as ei:
        restore(path, o.model, o.optimizer, scaler=o.scaler)
    assert ei.value.reason is Reason.STATE_MISMATCH
    assert "OtherScaler" in str(ei.value)
    assert "GradScaler" in str(ei.value)


def test_logs_without_the_scaler_class_still_restore(tmp_path: Any) -> None:
    path = _log(tmp_path, "adam_amp_fp16")
    update_manifest(path, lambda m: m.meta["torch"].__setitem__("scaler", True))  # as before
    o = build("adam_amp_fp16")
    res = restore(path, o.model, o.optimizer, scaler=o.scaler)
    assert res.step == 6
    assert res.exact
