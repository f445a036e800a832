"""The writer process's records go into the ring on the sink's step thread (issue 49): the
training thread hands a record over and goes on; it waits only when ``MAX_QUEUED`` copies
are queued (a full ring still makes training wait, counted); a base goes into the ring
after the records handed over before it; a copy that fails is raised by the next call and
no later record is written (the log never skips a step)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lowdiff_store import LogReader
from lowdiff_store.torch import DiffCheckpointer, TopKCompressor, restore
from lowdiff_store.torch.capture.process_sink import MAX_QUEUED
from lowdiff_store.writer.ring_client import RingClient
from tests.helpers.timing import scaled

STEPS = 8


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    opt.zero_grad()
    model(torch.randn(4, 6, generator=g)).square().mean().backward()
    opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        st = opt.state[p]
        out += [st[k].clone() for k in sorted(st) if isinstance(st[k], torch.Tensor)]
    return out


def _reference(steps: int, topk: float | None = None) -> list[torch.Tensor]:
    model, opt = _build()
    comp = TopKCompressor(topk) if topk is not None else None
    if comp is not None:
        comp.attach(opt)
    for t in range(1, steps + 1):
        _step(model, opt, t)
    if comp is not None:
        comp.detach()
    return _state(model, opt)


def _assert_restores(path: Path, step: int, topk: float | None = None) -> None:
    model, opt = _build()
    comp = TopKCompressor(topk) if topk is not None else None
    res = restore(path, model, opt, compressor=comp)
    assert res.step == step
    # (top-k: the residuals restored are zeros, base 0 holding none: the weights and the
    # optimizer state are exact, the continuation is not, and the result says so)
    assert res.exact is (topk is None), res
    for a, b in zip(_state(model, opt), _reference(step, topk), strict=True):
        assert torch.equal(a, b)


def test_records_are_copied_on_the_step_thread_and_a_full_queue_waits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the copies held back, the training thread goes on for ``MAX_QUEUED`` records,
    then waits (``ring_append_waits``) until one is copied; every copy ran on the step
    thread, and the log restores bitwise. (Top-k records: dense ones are bounded first by
    the records in flight, ``test_records_in_flight.py``.)"""
    real = RingClient.put_step
    held, threads = threading.Event(), []

    def put_step(self: Any, step: int, *a: Any, **kw: Any) -> None:
        threads.append(threading.current_thread().name)
        held.wait(scaled(60))
        real(self, step, *a, **kw)
    monkeypatch.setattr(RingClient, "put_step", put_step)
    model, opt = _build()
    path = tmp_path / "log"
    ck = DiffCheckpointer(path, model, opt, snapshot_every=100, writer_process=True,
                          compressor=TopKCompressor(0.25))
    sink = ck._out.sink

    def release_at_the_wait() -> None:  # (no clock: the first wait releases the copies)
        while not held.wait(0.005):
            if sink._waits["append_waits"] >= 1:
                held.set()
    helper = threading.Thread(target=release_at_the_wait, daemon=True)
    helper.start()
    try:
        for t in range(1, STEPS + 1):
            _step(model, opt, t)
        ck.flush()
        stats = ck.stats()
    finally:
        held.set()
        ck.close()
    helper.join(scaled(60))
    assert threads[:MAX_QUEUED + 1] == threads[:1] * (MAX_QUEUED + 1)  # (one thread)
    assert stats["writer_ring_append_waits"] >= 1
    assert stats["writer_ring_append_wait_s"] > 0
    assert all(n.startswith("lowdiff-ring-step") for n in threads), threads
    assert ck.durable_step == STEPS
    with LogReader(path) as r:
        assert list(r.steps) == list(range(1, STEPS + 1))
    _assert_restores(path, STEPS, topk=0.25)


def test_a_base_goes_into_the_ring_after_the_records_before_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Consistent bases every 3 steps, each record's copy held until the training thread
    has handed the next base over: the ring still gets every record before the base
    handed over after it (a base of step t after the record of step t)."""
    real_step, real_base = RingClient.put_step, RingClient.put_base
    order: list[tuple[str, int]] = []
    handed = threading.Event()

    def put_step(self: Any, step: int, *a: Any, **kw: Any) -> None:
        handed.wait(scaled(2))  # (a base handed over meanwhile would overtake it)
        order.append(("step", step))
        real_step(self, step, *a, **kw)

    def put_base(self: Any, step: int, *a: Any, **kw: Any) -> None:
        order.append(("base", step))
        real_base(self, step, *a, **kw)
    monkeypatch.setattr(RingClient, "put_step", put_step)
    monkeypatch.setattr(RingClient, "put_base", put_base)
    model, opt = _build()
    path = tmp_path / "log"
    with DiffCheckpointer(path, model, opt, snapshot_every=3, base_slices=1,
                          exact_bases=True, writer_process=True) as ck:
        sink = ck._out.sink
        real_write_base = sink.write_base

        def write_base(step: int, *a: Any, **kw: Any) -> None:
            real_write_base(step, *a, **kw)
            if step > 0:
                handed.set()
        sink.write_base = write_base
        for t in range(1, STEPS + 1):
            _step(model, opt, t)
    bases = [s for k, s in order if k == "base"]
    assert bases == [0, 3, 6]
    for b in bases[1:]:
        at = order.index(("base", b))
        # (records handed over after the base may go in before it: between its pieces)
        assert set(range(1, b + 1)) <= {s for k, s in order[:at] if k == "step"}, order
    _assert_restores(path, STEPS)


def test_a_failed_copy_is_raised_and_no_later_record_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy of step 3's record fails: a later call raises that error (no step is
    skipped silently), no record after step 2 reaches the log, every record's place in
    flight was given back, and the log restores step 2 bitwise."""
    real = RingClient.put_step

    def put_step(self: Any, step: int, *a: Any, **kw: Any) -> None:
        if step == 3:
            raise RuntimeError("the copy of step 3 failed")
        real(self, step, *a, **kw)
    monkeypatch.setattr(RingClient, "put_step", put_step)
    model, opt = _build()
    path = tmp_path / "log"
    ck = DiffCheckpointer(path, model, opt, snapshot_every=100, writer_process=True)
    with pytest.raises(RuntimeError, match="the copy of step 3 failed"):
        for t in range(1, STEPS + 1):
            _step(model, opt, t)
        ck.flush()
    with pytest.raises(RuntimeError, match="the copy of step 3 failed"):
        ck.flush()  # every later call
    gate = ck._grads.gate
    with pytest.raises(RuntimeError, match="the copy of step 3 failed"):
        ck.close()
    ck.close()  # (raised once by close: the second is quiet)
    assert gate is not None
    assert gate.out <= 1  # (the pending step's, never handed over)
    with LogReader(path) as r:
        assert list(r.steps) == [1, 2]
    _assert_restores(path, 2)
