"""The torch-layer pieces the trainers need: closures in grad mode, ``step(None)``, wrapped
optimizers (real accelerate; a prepared loop with streamed bases SIGKILLed and run again),
refusals before anything is written, ``Stateful`` extras, ``latest_step`` and
``restore(missing_ok=True)``."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lowdiff_store
from lowdiff_store import ConfigError, Reason, latest_step
from lowdiff_store.torch import DiffCheckpointer, restore


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.1),
                               torch.nn.Linear(16, 2))


def _loss(m: torch.nn.Module, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(t)
    x = torch.randn(8, 6, generator=g)
    return m(x).pow(2).mean()


def _train(path: Any, steps: int, how: str, m: torch.nn.Module | None = None,
           opt: Any = None, start: int = 0) -> tuple[torch.nn.Module, Any]:
    m = m or _model()
    opt = opt or torch.optim.Adam(m.parameters(), lr=1e-2)
    ckpt = DiffCheckpointer(path, m, opt, snapshot_every=3, digest_every=1) \
        if path is not None else None
    for t in range(start, steps):
        def closure(t: int = t) -> torch.Tensor:
            opt.zero_grad()
            loss = _loss(m, t)
            loss.backward()
            return loss
        if how == "closure":
            opt.step(closure)
        elif how == "kwarg":
            opt.step(closure=closure)
        else:
            closure()
            opt.step(None) if how == "none" else opt.step()
    if ckpt is not None:
        ckpt.close()
    return m, opt


def _same(a: torch.nn.Module, b: torch.nn.Module, oa: Any, ob: Any) -> None:
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    for sa, sb in zip(oa.state.values(), ob.state.values(), strict=True):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("how", ["closure", "kwarg", "none"])
def test_closure_and_step_none_in_grad_mode_replay_bitwise(tmp_path: Any, how: str) -> None:
    torch.manual_seed(1)
    ref_m, ref_o = _train(None, 8, "plain")
    torch.manual_seed(1)
    m, o = _train(tmp_path / how, 8, how)
    _same(ref_m, m, ref_o, o)  # the closure wrapper changes nothing in training
    m2 = _model()
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    res = restore(tmp_path / how, m2, o2, step=5)
    assert res.step == 5
    assert res.verified == [5]  # replayed from base 3; the last digest on the way checked
    _train(None, 8, how, m2, o2, start=5)  # RNG restored too: dropout continues the same
    _same(ref_m, m2, ref_o, o2)


class _TwiceSGD(torch.optim.SGD):
    """An optimizer that evaluates its closure twice per step (like a line search)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        with torch.enable_grad():
            closure()
            loss = closure()
        super().step()
        return loss


def test_multi_call_closures_refused_clearly(tmp_path: Any) -> None:
    m = _model()
    lbfgs = torch.optim.LBFGS(m.parameters())
    with pytest.raises(ConfigError) as err:
        DiffCheckpointer(tmp_path / "lbfgs", m, lbfgs)
    assert err.value.reason is Reason.NOT_ALLOWED
    assert "LBFGS" in str(err.value)
    assert not (tmp_path / "lbfgs").exists()  # refused before anything was written
    opt = _TwiceSGD(m.parameters(), lr=0.1)
    with DiffCheckpointer(tmp_path / "twice", m, opt) as _ck:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = _loss(m, 0)
            loss.backward()
            return loss
        with pytest.raises(ConfigError, match="second time") as err:
            opt.step(closure)
        assert err.value.reason is Reason.NOT_ALLOWED
    with DiffCheckpointer(tmp_path / "delta", m, lbfgs, mode="delta") as ck:
        lbfgs.step(closure)  # delta mode logs the resulting state: fine
        assert ck.step == 1


def test_unsupported_optimizer_refused_before_any_file(tmp_path: Any) -> None:
    class Opaque:
        def __init__(self) -> None:
            self.param_groups: list[Any] = []

    with pytest.raises(ConfigError) as err:
        DiffCheckpointer(tmp_path / "x", _model(), Opaque())  # type: ignore[arg-type]
    assert "Opaque" in str(err.value)
    assert err.value.reason is Reason.NOT_ALLOWED
    assert not (tmp_path / "x").exists()


def test_accelerate_prepared_loop_works_as_is(tmp_path: Any) -> None:
    """accelerate's AcceleratedOptimizer (which has no step hooks) is unwrapped; its
    ``step()`` calls the inner ``step(None)``."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    ref_m = _model()
    ref_o = torch.optim.Adam(ref_m.parameters(), lr=1e-2)
    torch.manual_seed(1)
    _train(None, 6, "plain", ref_m, ref_o)
    m = _model()
    m, opt = acc.prepare(m, torch.optim.Adam(m.parameters(), lr=1e-2))
    assert type(opt).__name__ == "AcceleratedOptimizer"
    torch.manual_seed(1)
    with DiffCheckpointer(tmp_path / "acc", m, opt, snapshot_every=3) as ck:
        for t in range(6):
            opt.zero_grad()
            acc.backward(_loss(m, t))
            opt.step()
        assert ck.step == 6
    _same(ref_m, m, ref_o, opt.optimizer)
    m2 = _model()
    m2, o2 = acc.prepare(m2, torch.optim.Adam(m2.parameters(), lr=1e-2))
    assert restore(tmp_path / "acc", m2, o2).step == 6
    _same(ref_m, m2, ref_o, o2.optimizer)


def test_accelerate_loop_with_streamed_bases_killed_and_rerun_is_bitwise(
        tmp_path: Path) -> None:
    """A prepared accelerate loop (AdamW, clipping, a prepared per-step scheduler, dropout)
    with streamed bases (issue 50; ``base_slices=3``, ``snapshot_every=4``: bases 4, 8, 12
    with slices after steps 2-4, 6-8, 10-12), SIGKILLed in step 5..13 once a streamed base
    is complete (a kill after steps 6, 7, 10 or 11 lands inside a base's window), run again
    (``restore(missing_ok=True)``, the loop from ``res.step``): restored from a streamed
    base, it ends bitwise the uninterrupted loop."""
    pytest.importorskip("accelerate")
    from lowdiff_store.log import LogReader

    from . import acc_worker

    def run(name: str, ckpt: str) -> dict[str, np.ndarray]:
        acc_worker.run(str(tmp_path / name), ckpt)
        with np.load(tmp_path / name, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    def losses(name: str) -> list[list[float]]:
        return [json.loads(x) for x in (tmp_path / f"{name}.losses").read_text().splitlines()]

    def same(got: dict[str, np.ndarray], why: str) -> None:
        keys = set(ref) - {"resumed", "base_slices"}
        assert keys == set(got) - {"resumed", "base_slices"}, why
        bad = sorted(k for k in keys if not np.array_equal(ref[k], got[k]))
        assert not bad, f"{why}: differ in {bad}"

    ref = run("ref.npz", "-")
    assert len(losses("ref.npz")) == acc_worker.STEPS
    same(run("cb.npz", str(tmp_path / "nocrash")), "streamed bases, no crash")
    assert losses("cb.npz") == losses("ref.npz")
    with LogReader(tmp_path / "nocrash") as r:
        assert r.streamed == [(4, (2, 3, 4)), (8, (6, 7, 8)), (12, (10, 11, 12))]

    seed = random.randrange(1 << 30)
    kill_at = random.Random(seed).randrange(5, acc_worker.STEPS - 1)
    why = f"streamed bases, killed in step {kill_at + 1} (seed {seed})"
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, acc_worker.__file__, str(tmp_path / "killed.npz"),
                           str(ckpt), str(kill_at)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    durable = latest_step(ckpt)
    assert durable is not None, why
    assert kill_at - 1 <= durable <= kill_at, why
    got = run("resumed.npz", str(ckpt))  # the same script again
    assert int(got["resumed"]) == durable, why
    assert len(got["base_slices"]) == 3, why  # restored from a streamed base
    same(got, why)
    killed = [x for x in losses("killed.npz") if x[0] <= durable]
    assert killed + losses("resumed.npz") == losses("ref.npz"), why


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


def test_stateful_extra_state_round_trips(tmp_path: Any) -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    c = _Counter()
    with DiffCheckpointer(tmp_path / "s", m, opt, extra_state={"counter": c}):
        for t in range(5):
            opt.zero_grad()
            _loss(m, t).backward()
            c.n += 10  # like a data loader: advanced before the step it feeds
            opt.step()
    m2, c2 = _model(), _Counter()
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    res = restore(tmp_path / "s", m2, o2, step=3, extra_state={"counter": c2})
    assert c2.n == 30
    assert res.extra == {"counter": {"n": 30}}
    with pytest.raises(ConfigError):
        DiffCheckpointer(tmp_path / "bad", m, opt, extra_state={"x": object()})
    assert not (tmp_path / "bad").exists()


def test_latest_step_and_missing_ok(tmp_path: Any) -> None:
    assert lowdiff_store.latest_step(tmp_path / "absent") is None
    os.makedirs(tmp_path / "empty")
    assert lowdiff_store.latest_step(tmp_path / "empty") is None
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    assert restore(tmp_path / "absent", m, opt, missing_ok=True) is None
    assert restore(tmp_path / "empty", m, opt, missing_ok=True) is None
    with pytest.raises(lowdiff_store.LowdiffError):
        restore(tmp_path / "absent", m, opt)
    _train(tmp_path / "log", 4, "plain", m, opt)
    assert lowdiff_store.latest_step(tmp_path / "log") == 4
    m3 = _model()
    res = restore(tmp_path / "log", m3, torch.optim.SGD(m3.parameters(), lr=0.1),
                  missing_ok=True)
    assert res is not None
    assert res.step == 4
    for x, y in zip(m.parameters(), m3.parameters(), strict=True):
        assert torch.equal(x, y)


def test_stateful_dataloader_position_restored(tmp_path: Any) -> None:
    """A torchdata StatefulDataLoader given as extra state resumes at the next batch."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def loader() -> Any:
        data = list(torch.arange(40.0).reshape(20, 2))
        return sdl.StatefulDataLoader(data, batch_size=2, shuffle=True)

    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    torch.manual_seed(3)
    dl = loader()
    seen = []
    with DiffCheckpointer(tmp_path / "dl", m, opt, extra_state={"loader": dl}):
        for x in dl:
            seen.append(x)
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()
    m2 = torch.nn.Linear(2, 1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.01)
    dl2 = loader()
    restore(tmp_path / "dl", m2, o2, step=4, extra_state={"loader": dl2})
    rest = list(dl2)
    assert len(rest) == len(seen) - 4
    for a, b in zip(rest, seen[4:], strict=True):
        assert torch.equal(a, b)
