"""Dense records that cost no copy (issue 34, item 3): gradients training drops are lent to
their record; every way training could write a lent gradient first copies it; an
unguarded in-place write is refused, never logged wrong."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lowdiff_store import ConfigError, Reason
from lowdiff_store.log.writer import LogWriter
from lowdiff_store.torch import DiffCheckpointer, restore
from lowdiff_store.torch.capture.lending import LEARN

STEPS = 8


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out.update({f"o{i}.{k}": v.clone() for k, v in st.items()})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


#: step -> how the loop clears the gradients before that step's backward
Zero = Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]


def _drop(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=True)


def _then(after: int, other: Zero) -> Zero:
    def zero(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        (other if step > after else _drop)(step, model, opt)
    return zero


ZEROS: dict[str, Zero] = {
    "set_to_none": _drop,
    "in_place": lambda s, m, o: o.zero_grad(set_to_none=False),
    "then_accumulate": _then(4, lambda s, m, o: None),  # no zeroing: backward adds
    "then_opt_in_place": _then(4, lambda s, m, o: o.zero_grad(set_to_none=False)),
    "then_model_in_place": _then(4, lambda s, m, o: m.zero_grad(set_to_none=False)),
}


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, zero: Zero, first: int,
           last: int) -> None:
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step)
        zero(step, model, opt)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("how", list(ZEROS))
def test_lent_or_copied_the_log_restores_bitwise(how: str, tmp_path: Path) -> None:
    model, opt = _build()
    _train(model, opt, ZEROS[how], 1, STEPS)
    want = _state(model, opt)
    model, opt = _build()
    with DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=100) as ck:
        _train(model, opt, ZEROS[how], 1, STEPS)
        stats = ck.stats()
    assert _same(_state(model, opt), want)
    nparams = len(list(model.parameters()))
    if how == "in_place":  # never dropped: never lent
        assert stats["lent_grads"] == 0
    elif how == "set_to_none":  # lent from step LEARN + 1 on, never copied
        assert stats["lent_grads"] == (STEPS - LEARN) * nparams
        assert stats["lent_copied"] == 0
    else:  # lent from step LEARN + 1; the step after 4 keeps step 4's and then stops
        assert stats["lent_grads"] == (4 - LEARN) * nparams
        assert stats["lent_copied"] == nparams  # copied before training wrote them
    model2, opt2 = _build()
    assert restore(tmp_path / "log", model2, opt2).step == STEPS
    assert _same(_state(model2, opt2), want)


def test_a_dropped_gradient_is_the_records_own_memory(tmp_path: Path) -> None:
    """No copy: the record's host buffers do not grow with lending, and the tensor the
    writer reads is the gradient training dropped."""
    model, opt = _build()
    with DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=100) as ck:
        _train(model, opt, _drop, 1, LEARN)
        misses = ck._grads.pool.misses
        _train(model, opt, _drop, LEARN + 1, STEPS)
        assert ck._grads.pool.misses == misses  # nothing taken for the lent steps
        g = next(model.parameters()).grad
        pending = ck._grads.lender.pending
        assert any(lent.tensor is g for lent in pending[next(iter(pending))])


def test_an_unguarded_in_place_write_of_a_lent_gradient_is_refused(tmp_path: Path) -> None:
    """A lent gradient kept by training and changed in place by code the checkpointer
    cannot see (here: ``mul_`` between two steps) cannot be logged: refused with one
    error naming the parameter, never written wrong; the steps before stay."""
    model, opt = _build()
    ck = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=100)
    _train(model, opt, _drop, 1, STEPS)
    first = next(model.parameters())
    with torch.no_grad():
        first.grad.mul_(2.0)  # step 8's gradient, lent to its record, changed
    with pytest.raises(ConfigError) as ei:
        _train(model, opt, lambda s, m, o: None, STEPS + 1, STEPS + 1)
    assert ei.value.reason is Reason.STATE_MISMATCH
    assert "0.weight" in str(ei.value)
    ck._finalizer.detach()
    ck._out.sink.close_quietly()
    model2, opt2 = _build()
    assert restore(tmp_path / "log", model2, opt2).step == STEPS - 1


def test_lending_needs_a_step_that_only_reads_its_gradients(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                          foreach=True)  # its step adds the momentum into .grad
    with DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=100) as ck:
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            opt.zero_grad(set_to_none=True)
            model(torch.randn(2, 4, generator=g)).sum().backward()
            opt.step()
        assert ck.stats()["lent_grads"] == 0


class _HeldWrites:
    """Every group write waits until the training thread waits at a capture for the
    writer (or the run ended): the slowest writer the record gate allows, no clock."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ckpt: DiffCheckpointer | None = None
        self.done = threading.Event()
        orig = LogWriter.write_records

        def write_records(log: LogWriter, records: Sequence[Any]) -> None:
            end = time.monotonic() + 60.0  # (a broken gate: go on rather than hang)
            while not (self._waiting() or self.done.is_set()) and time.monotonic() < end:
                self.done.wait(0.001)
            orig(log, records)
        monkeypatch.setattr(LogWriter, "write_records", write_records)

    def _waiting(self) -> bool:
        gate = None if self.ckpt is None else self.ckpt._grads.gate
        return gate is not None and gate.waiting > 0


def _train_own(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int,
               last: int, keep_from: int) -> None:
    """Train; from step ``keep_from`` on, each step's gradients are copied into one of two
    sets of buffers the loop keeps (double-buffered gradient memory) and handed to the
    step as ``p.grad``: the set is written again two steps later."""
    params = list(model.parameters())
    sets = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step)
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        if step >= keep_from:
            with torch.no_grad():
                for p, buf in zip(params, sets[step % 2], strict=True):
                    buf.copy_(p.grad)
                    p.grad = buf
        opt.step()


@pytest.mark.parametrize("first", [1, LEARN + 3])
def test_gradients_the_loop_keeps_are_never_written_under_the_writer(
        first: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that keeps its gradient memory (two sets of buffers, each written again two
    steps after its step: ``p.grad`` is another tensor at the next step, as when training
    drops it) must not have that memory lent to a record without a copy: the writer, held
    until training waits for it, would read the next-but-one step's gradients (main: the
    log's records fail their checksums, every step after the first lent one is lost).
    ``first=1``: the loop keeps its buffers from the start (nothing is lent); later: it
    starts keeping them after lending began (each lent one is copied before it is
    rewritten)."""
    model, opt = _build()
    _train_own(model, opt, 1, STEPS + 4, first)
    want = _state(model, opt)
    held = _HeldWrites(monkeypatch)
    model, opt = _build()
    ck = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=100)
    held.ckpt = ck
    try:
        _train_own(model, opt, 1, STEPS + 4, first)
        held.done.set()
        stats = ck.stats()
    finally:
        held.done.set()
        ck.close()
    assert _same(_state(model, opt), want)
    model2, opt2 = _build()
    assert restore(tmp_path / "log", model2, opt2).step == STEPS + 4
    assert _same(_state(model2, opt2), want)
    nparams = len(list(model.parameters()))
    if first == 1:
        assert stats["lent_grads"] == 0
    else:  # lent from step LEARN + 1; the first one the loop keeps is copied, then
        # lending pauses (the loop never drops its gradients again)
        assert stats["lent_grads"] == (first - LEARN) * nparams
        assert stats["lent_copied"] == nparams


def test_a_gradient_that_is_a_view_of_the_loops_memory_is_not_lent(tmp_path: Path) -> None:
    """Gradients handed to the step as views of one flat buffer the loop keeps (and
    zeroes before the next backward): each step's view is a new tensor, but its memory
    is the loop's; lending it would have the next step find it written (main: every
    step after LEARN refused with ``state_mismatch``). They are copied, and the log
    restores bitwise."""
    def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        params = list(model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(step)
            opt.zero_grad(set_to_none=True)
            flat.zero_()
            model(torch.randn(8, 16, generator=g)).square().mean().backward()
            off = 0
            with torch.no_grad():
                for p in params:
                    view = flat[off:off + p.numel()].view_as(p)
                    view.copy_(p.grad)
                    p.grad = view
                    off += p.numel()
            opt.step()
    model, opt = _build()
    train(model, opt)
    want = _state(model, opt)
    model, opt = _build()
    with DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=100) as ck:
        train(model, opt)
        stats = ck.stats()
    assert _same(_state(model, opt), want)
    assert stats["lent_grads"] == 0
    model2, opt2 = _build()
    assert restore(tmp_path / "log", model2, opt2).step == STEPS
    assert _same(_state(model2, opt2), want)


@pytest.mark.consistent_bases  # (its bases' steps)
def test_after_a_refused_lent_gradient_every_later_step_is_refused(tmp_path: Path) -> None:
    """A loop that catches the refusal of a lent gradient written in place and trains on:
    the refused step's record can never be written, so no later step may be logged
    either (the log would skip a step: main logged steps 9-11 after the gap and reported
    them durable while restore reached step 7), and the refused step's place in flight
    and its base's staging memory are given back."""
    model, opt = _build()
    ck = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=STEPS,
                          exact_bases=True)
    _train(model, opt, _drop, 1, STEPS)  # the base of step STEPS is staged
    assert ck._out.stager.in_flight == 1
    first = next(model.parameters())
    with torch.no_grad():
        first.grad.mul_(2.0)  # step STEPS's gradient, lent to its record, changed
    reasons = []
    for step in range(STEPS + 1, STEPS + 5):
        try:
            _train(model, opt, _drop if step > STEPS + 1 else lambda s, m, o: None, step, step)
        except ConfigError as e:
            reasons.append(e.reason)
    # main: 2 (the backward, then the settle), then the later steps were logged
    assert reasons == [Reason.STATE_MISMATCH] * 4
    ck.close()
    assert ck.durable_step == STEPS - 1  # main: STEPS + 3
    assert ck._grads.gate is not None
    assert ck._grads.gate.out == 0  # main: 1
    assert ck._out.stager.in_flight == 0  # main: 1 (its staging buffer busy for good)
    model2, opt2 = _build()
    assert restore(tmp_path / "log", model2, opt2).step == STEPS - 1
