"""Base 0 without blocking (issue 34, item 2): ``DiffCheckpointer(...)`` returns before base
0 is durable; the first optimizer step waits for the writer only if it is still reading the
live tensors; base 0 is bitwise the state at construction; a failure writing it surfaces on
the next call; a tensor changed in place before it was written never passes as that state;
a SIGKILL before it is durable leaves a log that is refused cleanly or starts again."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from lowdiff_store.errors import CorruptRecordError, LowdiffError
from lowdiff_store.format.constants import BASE_NAME
from lowdiff_store.log import LogReader
from lowdiff_store.log.base import BaseFile
from lowdiff_store.log.writer import LogWriter
from lowdiff_store.torch import DiffCheckpointer, restore

State = dict[str, bytes]


def objects(seed: int = 0, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width),
                                torch.nn.Linear(width, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def snapshot(model: torch.nn.Module) -> State:
    return {n: t.detach().numpy().tobytes() for n, t in model.state_dict().items()}


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, t: int) -> None:
    opt.zero_grad()
    g = torch.Generator().manual_seed(t)
    model(torch.randn(8, model[0].in_features, generator=g)).pow(2).mean().backward()
    opt.step()


def base0(path: Any) -> State:
    b = BaseFile(os.path.join(path, BASE_NAME.format(0)))
    try:
        return {n: np.array(b.tensor(n)).tobytes() for n in b.names if not n.startswith("@")}
    finally:
        b.close()


def bases(path: Any) -> list[int]:
    with LogReader(path) as r:
        return list(r.bases)


def gated(monkeypatch: Any, gate: threading.Event, fail: BaseException | None = None
          ) -> list[float]:
    """Base 0's write waits for ``gate`` (a slow disk), then fails with ``fail`` if given;
    returns the times its write started."""
    orig = LogWriter.write_base
    started: list[float] = []

    def slow(self: LogWriter, step: int, tensors: Any, meta: Any = None,
             crcs: Any = None) -> int:
        if step == 0:
            started.append(time.monotonic())
            assert gate.wait(60)
            if fail is not None:
                raise fail
        return orig(self, step, tensors, meta, crcs)

    monkeypatch.setattr(LogWriter, "write_base", slow)
    return started


def test_the_constructor_returns_before_base_0_is_durable_and_steps_right_away(
        tmp_path: Any, monkeypatch: Any) -> None:
    gate = threading.Event()
    gated(monkeypatch, gate)
    path = tmp_path / "log"
    model, opt = objects()
    want = snapshot(model)
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=100)
    assert ckpt.durable_step == -1  # returned before base 0 is durable
    assert bases(path) == []
    threading.Timer(0.2, gate.set).start()  # the disk catches up while step 1 runs
    for t in range(1, 4):
        step(model, opt, t)  # the first optimizer step waits for base 0's write
    assert ckpt.flush() == 3
    assert ckpt.stats()["first_base_wait_s"] > 0
    ckpt.close()
    assert bases(path) == [0]
    assert base0(path) == want  # bitwise the state at construction
    m2, o2 = objects(1)
    res = restore(path, m2, o2)
    assert res.step == 3
    assert res.exact
    assert snapshot(m2) == snapshot(model)


def test_base_0_is_read_before_a_compressors_pre_hook_makes_new_residuals(
        tmp_path: Any, monkeypatch: Any) -> None:
    """With error feedback, base 0 is written from the live residuals; the compressor's
    pre-step hook replaces them by new tensors at the first step. The checkpointer's
    first pre-step hook waits for base 0's write before that, so the old residuals are let
    go first (otherwise the first step holds a gradient's worth more memory). Forced by a
    held write: the compressor runs only once base 0 is settled."""
    from lowdiff_store.torch import TopKCompressor

    gate = threading.Event()
    started = gated(monkeypatch, gate)
    model, opt = objects()
    comp = TopKCompressor(0.25)
    seen: list[tuple[bool, float]] = []
    orig = comp.compress
    opened: list[DiffCheckpointer] = []

    def compress(optimizer: Any) -> None:
        if opened:
            seen.append((opened[0]._out.first is None, time.monotonic()))
        orig(optimizer)

    monkeypatch.setattr(comp, "compress", compress)
    step(model, opt, 0)  # (residuals exist before the log opens, as in training)
    comp.attach(opt)
    step(model, opt, 1)
    comp.detach()
    ckpt = DiffCheckpointer(tmp_path / "log", model, opt, compressor=comp)
    opened.append(ckpt)
    assert ckpt._out.first is not None
    assert ckpt._out.first.reads_live
    threading.Timer(0.2, gate.set).start()
    step(model, opt, 2)
    assert len(started) == 1
    assert seen, seen
    assert seen[0][0], seen  # base 0 settled first
    assert seen[0][1] >= started[0]
    ckpt.close()
    assert bases(tmp_path / "log") == [0]


def test_a_failure_writing_base_0_surfaces_on_the_next_call(tmp_path: Any,
                                                             monkeypatch: Any) -> None:
    gate = threading.Event()
    gate.set()
    gated(monkeypatch, gate, OSError(28, "No space left on device"))
    path = tmp_path / "log"
    model, opt = objects()
    ckpt = DiffCheckpointer(path, model, opt)
    with pytest.raises((LowdiffError, OSError)) as e:
        step(model, opt, 1)
    assert "\n" not in str(e.value)
    assert "No space left" in str(e.value) or "step 0" in str(e.value)
    with pytest.raises((LowdiffError, OSError)):
        ckpt.flush()
    assert bases(path) == []


@pytest.mark.consistent_bases  # (its bases' steps)
def test_a_tensor_changed_before_base_0_is_written_never_passes_as_its_state(
        tmp_path: Any, monkeypatch: Any, caplog: Any) -> None:
    gate = threading.Event()
    gated(monkeypatch, gate)
    path = tmp_path / "log"
    model, opt = objects()
    # exact_bases: the base owed after step 1 is taken at step 1 even where its staging
    # memory is still being made (on a loaded machine it could be put off past step 2)
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=100, exact_bases=True)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # before the writer read it
    gate.set()
    with caplog.at_level(logging.WARNING):
        step(model, opt, 1)
    assert any("changed in place before the base of step 0" in r.message
               for r in caplog.records)
    step(model, opt, 2)
    ckpt.close()
    assert bases(path) == [0, 1]  # the next step took a base
    m2, o2 = objects(1)
    with pytest.raises(CorruptRecordError) as e:  # base 0 refuses the changed bytes
        restore(path, m2, o2, step=0)
    assert "0.weight" in str(e.value)
    m3, o3 = objects(1)
    res = restore(path, m3, o3)
    assert res.step == 2
    assert res.exact
    assert snapshot(m3) == snapshot(model)


CHILD = r"""
import sys, time
import torch
from lowdiff_store.log.writer import LogWriter
from lowdiff_store.torch import DiffCheckpointer
orig = LogWriter.write_base
def slow(self, step, tensors, meta=None, crcs=None):
    if step == 0 and sys.argv[2] == "slow":
        time.sleep(60)  # killed meanwhile: base 0 never durable
    return orig(self, step, tensors, meta, crcs)
LogWriter.write_base = slow
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
opt = torch.optim.AdamW(model.parameters())
ckpt = DiffCheckpointer(sys.argv[1], model, opt)
print("constructed", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("disk", ["slow", "fast"])
def test_sigkill_before_base_0_is_durable_leaves_no_half_log(tmp_path: Any, disk: str) -> None:
    path = str(tmp_path / "log")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, path, disk], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "constructed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        if proc.stdout is not None:
            proc.stdout.close()
    torch.manual_seed(0)
    want = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters())
    present = os.path.exists(os.path.join(path, BASE_NAME.format(0))) and \
        bases(path) == [0]
    if disk == "slow":
        assert not present
    if present:  # complete: base 0 is the state at construction
        res = restore(path, model, opt)
        assert res.step == 0
        for a, b in zip(model.parameters(), want.parameters(), strict=True):
            assert torch.equal(a, b)
    else:  # refused in one line, and a new checkpointer starts the log again
        with pytest.raises(LowdiffError) as e:
            restore(path, model, opt)
        assert "\n" not in str(e.value)
        with DiffCheckpointer(path, model, opt) as ckpt:
            assert ckpt.flush() == 0
        assert bases(path) == [0]


def restores_exactly(path: Any, model: torch.nn.Module, step: int) -> None:
    """The log restores into fresh objects at ``step``, exactly, to ``model``'s state."""
    m, o = objects(1)
    res = restore(path, m, o)
    assert (res.step, res.exact) == (step, True)
    assert snapshot(m) == snapshot(model)


def private_base0(monkeypatch: Any) -> None:
    """Base 0 as on a GPU: every array a private host copy, no live tensor watched."""
    from lowdiff_store.torch.capture.bases.stager import BaseStager

    orig = BaseStager.stage_views

    def copies(self: BaseStager, step: int) -> Any:
        base = orig(self, step)
        base.arrays = {n: (tag, arr.copy()) for n, (tag, arr) in base.arrays.items()}
        base.watch = []
        return base

    monkeypatch.setattr(BaseStager, "stage_views", copies)


def test_a_base_0_of_private_copies_lets_the_first_steps_run_before_it_is_written(
        tmp_path: Any, monkeypatch: Any) -> None:
    """A model on a GPU: base 0's arrays are host copies (nothing live is read), so the
    first optimizer steps do not wait for its write (11.9 s at 940M on an H100 before);
    ``flush`` still waits for it, and it is bitwise the state at construction."""
    gate = threading.Event()
    started = gated(monkeypatch, gate)
    private_base0(monkeypatch)
    path = tmp_path / "log"
    model, opt = objects()
    want = snapshot(model)
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=100)
    for t in range(1, 6):
        step(model, opt, t)  # base 0's write is held by the gate all along
    assert not gate.is_set()
    assert len(started) == 1  # its write began and still waits
    assert ckpt.stats()["first_base_wait_s"] == 0.0
    assert ckpt.durable_step == -1
    gate.set()
    assert ckpt.flush() == 5
    ckpt.close()
    assert bases(path) == [0]
    assert base0(path) == want
    restores_exactly(path, model, 5)


def test_a_gpu_models_host_step_counts_do_not_hold_the_first_step(
        tmp_path: Any, monkeypatch: Any) -> None:
    """A model on a GPU whose optimizer keeps host tensors (AdamW's step counts live on the
    CPU unless ``capturable``): base 0 copies them too, so nothing live is read and the
    first steps do not wait for its write (11.6 s at 940M on an H100: the step counts were
    read live, so the first step waited for the whole 11.4 GB). Emulated on CPU: the
    parameters and moments count as device tensors (their arrays copied, as from a GPU)."""
    from lowdiff_store.torch.capture.bases.stager import BaseStager

    monkeypatch.setattr(BaseStager, "on_device", staticmethod(lambda t: t.numel() > 1))
    orig = BaseStager.stage_views

    def device_copies(self: BaseStager, step: int) -> Any:
        base = orig(self, step)
        steps = [n for n, (_tag, a) in base.arrays.items() if a.size == 1]
        assert steps  # the step counts: copied by the engine itself, never watched
        assert base.watch == []
        base.arrays = {n: (tag, a.copy() if a.size > 1 else a)
                       for n, (tag, a) in base.arrays.items()}
        return base

    monkeypatch.setattr(BaseStager, "stage_views", device_copies)
    gate = threading.Event()
    started = gated(monkeypatch, gate)
    path = tmp_path / "log"
    model, opt = objects()
    step(model, opt, 0)  # the optimizer's state (and its host step counts) exists
    want = snapshot(model)
    counts = [s["step"].clone() for s in opt.state.values()]
    ckpt = DiffCheckpointer(path, model, opt, snapshot_every=100)
    done = threading.Event()

    def train() -> None:
        for t in range(1, 4):
            step(model, opt, t)  # base 0's write is held by the gate all along
        done.set()
    threading.Thread(target=train, daemon=True).start()
    assert done.wait(120), "the first steps waited for base 0's write"
    assert not gate.is_set()
    assert len(started) == 1
    assert ckpt.stats()["first_base_wait_s"] == 0.0
    gate.set()
    assert ckpt.flush() == 3
    ckpt.close()
    assert base0(path) == want
    m2, o2 = objects(1)
    res = restore(path, m2, o2, step=0)
    assert res.step == 0
    assert [s["step"] for s in o2.state.values()] == counts  # the counts at construction
    restores_exactly(path, model, 3)


def test_a_failure_writing_a_base_0_of_private_copies_surfaces_at_flush(
        tmp_path: Any, monkeypatch: Any) -> None:
    gate = threading.Event()
    gated(monkeypatch, gate, OSError(28, "No space left on device"))
    private_base0(monkeypatch)
    model, opt = objects()
    ckpt = DiffCheckpointer(tmp_path / "log", model, opt)
    step(model, opt, 1)
    gate.set()
    with pytest.raises((LowdiffError, OSError)) as e:
        ckpt.flush()
    assert "\n" not in str(e.value)
    assert "No space left" in str(e.value) or "step 0" in str(e.value)
