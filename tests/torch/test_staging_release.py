"""Staging memory made once and let go in pieces (issue 34, item 1).

On an H100 at 0.94B parameters one step took 15-20 s, the step at which a 12 GB pinned
staging buffer, made at base 0 before the top-k residuals existed, was let go and a 16 GB
one made beside training. Letting go of it unregistered 12 GB from the driver back to back
(each call holds the driver's lock, which the training thread's launches wait for), inside
the staging area's lock (which the training thread takes at every base), and unmapped it
while holding the GIL (~90 ms per GB on this VM: ``bench/probe_free.py``). These tests hold
the three properties that remove that: the memory is made once for the state a base will
have; a buffer let go is unregistered in paced pieces and its pages given back before the
last reference is dropped; and that happens outside the area's lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from lowdiff_store import LowdiffError
from lowdiff_store.log.writer import LogWriter
from lowdiff_store.torch import DiffCheckpointer, TopKCompressor
from lowdiff_store.torch.capture.bases import copy as base_copy

pytestmark = pytest.mark.consistent_bases  # consistent bases' steps and files (tests/conftest.py)


def _objects(warm: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if warm:  # an optimizer with state, a compressor that has not compressed yet
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 64)).pow(2).mean().backward()
            opt.step()
    return model, opt


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm-optimizer"])
def test_a_top_k_run_makes_its_staging_memory_once(tmp_path: Any, monkeypatch: Any,
                                                   warm: bool) -> None:
    """Base 0 is taken before the first step: the optimizer's moments (fresh) or the top-k
    residuals (either way) do not exist yet. Memory made for that state is too small for
    the first periodic base, and was let go and made again; it is now made once, after
    the first step, and every base after it is taken in it."""
    let_go: list[int] = []
    monkeypatch.setattr(base_copy, "give_back", lambda slot: let_go.append(slot.capacity))
    model, opt = _objects(warm)
    comp = TopKCompressor(0.05, error_feedback=True)
    ckpt = DiffCheckpointer(tmp_path / "log", model, opt, compressor=comp, snapshot_every=3)
    area = ckpt._out.stager.area
    for t in range(1, 11):
        opt.zero_grad()
        model(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
        if t % 3 == 2:  # the next base finds its memory made and free (not put off)
            ckpt.flush()
            assert area.wait_made(60)
    ckpt.flush()
    stats = ckpt.stats()
    assert let_go == []  # (before close)
    ckpt.close()
    assert stats["bases"] == 4  # 0, 3, 6, 9
    assert stats["base_deferred"] == 0
    state = sum(p.nbytes for p in model.parameters()) * 4  # params, 2 moments, residuals
    # (a state this small may have a second buffer, for a base staged while one is
    # written; each holds a whole base)
    assert area.allocated <= 2
    assert all(s.capacity >= state for s in area._slots)


class FakeCudart:
    """``torch.cuda.cudart()`` on a machine with no GPU: records (call, address, start,
    end) of each registration call, each taking ``delay`` seconds."""

    def __init__(self, delay: float = 0.005) -> None:
        self.calls: list[tuple[str, int, float, float]] = []
        self.delay = delay

    def _call(self, what: str, ptr: int) -> int:
        t0 = time.perf_counter()
        time.sleep(self.delay)
        self.calls.append((what, ptr, t0, time.perf_counter()))
        return 0

    def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:
        return self._call("register", ptr)

    def cudaHostUnregister(self, ptr: int) -> int:
        return self._call("unregister", ptr)


def _pinned_slot(monkeypatch: Any, pieces: int) -> tuple[base_copy.Slot, FakeCudart]:
    piece = 1 << 20
    monkeypatch.setattr(base_copy, "PIN_PIECE", piece)
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    slot = base_copy.new_slot(pieces * piece, pinned=True)
    base_copy.StagingArea.touch(slot)
    base_copy.pin(slot)
    assert [c[0] for c in cudart.calls] == ["register"] * pieces
    return slot, cudart


def test_a_buffer_let_go_is_unpinned_in_paced_pieces_and_its_pages_given_back(
        monkeypatch: Any) -> None:
    slot, cudart = _pinned_slot(monkeypatch, 5)
    registered = list(slot.registered)
    discarded: list[int] = []
    real = base_copy.discard

    def counted(buf: Any) -> bool:
        discarded.append(buf.nbytes)
        return real(buf)
    monkeypatch.setattr(base_copy, "discard", counted)
    slot.buf[:] = 7
    base_copy.give_back(slot)
    unreg = [c for c in cudart.calls if c[0] == "unregister"]
    assert [c[1] for c in unreg] == registered  # each piece once, in order
    for (_w, _p, a0, b0), (_w2, _p2, a1, _b1) in itertools.pairwise(unreg):
        assert a1 - b0 >= base_copy.PACE * (b0 - a0) * 0.99  # the pause after each
    assert slot.registered == []
    assert slot.unpin_at_exit is None
    assert discarded == [1 << 20] * 5  # every page, one piece per call
    if base_copy.discard(slot.buf[:4096]):  # (Linux): the pages were given back
        assert int(slot.buf.max()) == 0
    n = len(cudart.calls)
    del slot
    import gc
    gc.collect()
    assert len(cudart.calls) == n  # never unregistered twice (a stale driver error)


def test_a_buffer_freed_without_give_back_is_still_unregistered(monkeypatch: Any) -> None:
    slot, cudart = _pinned_slot(monkeypatch, 3)
    registered = list(slot.registered)
    del slot
    import gc
    gc.collect()
    assert [c[1] for c in cudart.calls if c[0] == "unregister"] == registered


def test_a_buffer_is_let_go_outside_the_areas_lock(monkeypatch: Any) -> None:
    """While the helper thread lets go of a buffer too small for the next base, the
    training thread's calls into the area (a base put off, a buffer acquired) do not wait
    for it."""
    area = base_copy.StagingArea()
    assert area.want(1 << 16, pinned=False)
    area.provide()
    small = area._slots[0]
    giving = threading.Event()
    gate = threading.Event()
    real = base_copy.give_back

    def slow(slot: base_copy.Slot) -> None:
        giving.set()
        assert gate.wait(60)
        real(slot)
    monkeypatch.setattr(base_copy, "give_back", slow)
    assert area.want(1 << 20, pinned=False)
    helper = threading.Thread(target=area.provide)
    helper.start()
    try:
        assert giving.wait(60)
        assert small not in area._slots  # let go of, not yet given back
        assert area.waiting(1 << 20)  # answered at once: the base is put off
        assert area.acquire(1 << 20, pinned=False) is None
        assert area.capacity == 0
    finally:
        gate.set()
        helper.join(60)
    slot = area.acquire(1 << 20, pinned=False)
    assert slot is not None
    assert slot.capacity >= 1 << 20
    assert area.allocated == 2


def test_closing_the_checkpointer_gives_the_staging_memory_back(tmp_path: Any,
                                                                 monkeypatch: Any) -> None:
    given: list[int] = []
    real = base_copy.give_back

    def counted(slot: base_copy.Slot) -> None:
        given.append(slot.capacity)
        real(slot)
    monkeypatch.setattr(base_copy, "give_back", counted)
    model, opt = _objects(warm=False)
    ckpt = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=2)
    area = ckpt._out.stager.area
    for _t in range(1, 6):
        opt.zero_grad()
        model(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
        assert area.wait_made(60)
    ckpt.close()
    deadline = time.monotonic() + 60
    while area.capacity and time.monotonic() < deadline:  # (on the helper thread)
        time.sleep(0.01)
    assert area.capacity == 0
    assert given
    assert all(n > 0 for n in given)


def test_a_budget_between_the_staged_bytes_and_the_whole_state_takes_every_base(
        tmp_path: Any) -> None:
    """Non-contiguous CPU tensors (channels_last convolution weights) are copied at once,
    so a base stages fewer bytes than the whole state. An owed base was put off without
    listing when the *whole* state did not fit the budget: with a budget between the two,
    every base after base 0 was put off for good, with no warning."""
    def objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(),
                                    torch.nn.Conv2d(16, 16, 3), torch.nn.Flatten(),
                                    torch.nn.Linear(16 * 4 * 4, 4))
        model = model.to(memory_format=torch.channels_last)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
        model(x).pow(2).mean().backward()
        opt.step()
    model, opt = objects()
    step(model, opt)  # the optimizer state exists: what a base stages, and the whole state
    probe = DiffCheckpointer(tmp_path / "probe", model, opt, snapshot_every=1000)
    stager = probe._out.stager
    whole = stager._rough()
    stager.prepare()
    staged = stager._need
    probe.close()
    assert staged is not None
    assert staged + 1024 < whole  # (the case: a budget fits between)
    model, opt = objects()
    ckpt = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=4,
                            staging_budget=(staged + whole) // 2)
    for t in range(1, 13):
        step(model, opt)
        if t % 4 == 3:
            ckpt.flush()
            assert ckpt._out.stager.area.wait_made(60)
    ckpt.close()
    from lowdiff_store.log import LogReader
    with LogReader(tmp_path / "log") as r:
        assert r.manifest.bases == [0, 4, 8, 12]
    assert ckpt.stats()["base_deferred"] == 0


def test_a_failed_writer_still_gets_the_staging_memory_back_at_close(
        tmp_path: Any, monkeypatch: Any) -> None:
    """The writer fails (a write error on record 3) while the base of step 4 is staged:
    step 4's record cannot be appended, and its base is never written. Its staging buffer
    must still be let go at close (in pieces, unpinned first), not stay busy for good
    (main: held, and with CUDA registered as pinned, until the checkpointer is
    garbage-collected)."""
    real = LogWriter.write_records

    def write_records(log: LogWriter, records: Any) -> None:
        if any(r.step == 3 for r in records):
            raise OSError(5, "injected write error")
        real(log, records)
    monkeypatch.setattr(LogWriter, "write_records", write_records)
    model, opt = _objects(warm=False)
    # (exact_bases: base 4 waits for its staging memory rather than being put off)
    ckpt = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=4, exact_bases=True)
    area, stager = ckpt._out.stager.area, ckpt._out.stager
    errors = 0
    for t in range(1, 7):
        opt.zero_grad()
        model(torch.randn(4, 64)).pow(2).mean().backward()
        try:
            opt.step()
        except LowdiffError:  # the writer's failure, at the next hand-over
            errors += 1
        if t == 4:  # base 4 staged, record 3 handed over: wait until its write failed
            assert stager.in_flight == 1
            deadline = time.monotonic() + 60
            while ckpt._out.sink._w._ledger.error is None and time.monotonic() < deadline:
                time.sleep(0.01)
    assert errors >= 1
    with pytest.raises(LowdiffError):
        ckpt.close()
    assert stager.in_flight == 0  # main: 1
    deadline = time.monotonic() + 60
    while area.capacity and time.monotonic() < deadline:  # (on the helper thread)
        time.sleep(0.01)
    assert area.capacity == 0


def test_exact_bases_wait_for_the_buffer_the_previous_base_is_written_from(
        tmp_path: Any, monkeypatch: Any) -> None:
    """``exact_bases`` (and every multi-rank job): a base that finds the one buffer its
    budget allows still held by the previous base's write waits for the writer to let go
    of it, and falls on its step. Before, only memory being *made* was waited for: the
    base was put off, so on a slow disk the ranks of a job could base on different steps
    (and a test on a loaded machine missed its bases)."""
    from lowdiff_store.log.writer import LogWriter
    from lowdiff_store.torch.capture.bases.stager import BaseStager

    gate, waiting = threading.Event(), threading.Event()
    real_write, real_wait = LogWriter.write_base, base_copy.StagingArea.wait_change

    def held_write(self: Any, step: int, *a: Any, **k: Any) -> Any:
        if step == 2:  # the base of step 2 is written only once step 3's base waits
            assert gate.wait(60)
        return real_write(self, step, *a, **k)

    def noted_wait(self: Any, seen: int, timeout: float) -> bool:
        waiting.set()
        return real_wait(self, seen, timeout)

    def opener() -> None:
        assert waiting.wait(60)
        gate.set()
    monkeypatch.setattr(LogWriter, "write_base", held_write)
    monkeypatch.setattr(base_copy.StagingArea, "wait_change", noted_wait)
    model, opt = _objects(warm=True)
    probe = DiffCheckpointer(tmp_path / "probe", model, opt, snapshot_every=1000)
    probe._out.stager.prepare()
    need = probe._out.stager._need
    probe.close()
    assert need is not None
    ckpt = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=1,
                            exact_bases=True, staging_budget=need * 3 // 2)  # one buffer
    th = threading.Thread(target=opener)
    th.start()
    seen: dict[int, bytes] = {}
    try:
        for t in range(1, 5):
            opt.zero_grad()
            model(torch.randn(4, 64)).pow(2).mean().backward()
            opt.step()
            seen[t] = model[0].weight.detach().numpy().tobytes()
    finally:
        gate.set()
        th.join(60)
    ckpt.close()
    st = ckpt.stats()
    assert waiting.is_set()  # step 3's base waited for step 2's buffer
    assert st["base_deferred"] == 0
    assert st["base_wait_s"] > 0
    from lowdiff_store.log import LogReader
    with LogReader(tmp_path / "log") as r:
        assert r.manifest.bases == [0, 1, 2, 3, 4]
        for s in (1, 2, 3, 4):
            with r.base(s) as b:
                assert np.asarray(b.tensor("0.weight")).tobytes() == seen[s], s
    assert BaseStager is not None


def test_a_base_whose_copy_fails_at_the_hand_over_gives_its_memory_back(
        tmp_path: Any, monkeypatch: Any) -> None:
    """The wait for a base's copies at its hand-over to the writer raised (with CUDA: a
    device copy that failed): the error reaches the training loop, and the base's staging
    buffer is given back instead of staying busy for the rest of the run."""
    from lowdiff_store.torch.capture.bases.stager import BaseStager

    real = BaseStager.settle
    failed: list[int] = []

    def failing(self: BaseStager, base: Any, on_device: bool = True) -> bool:
        if not on_device and base.step == 2 and not failed:
            failed.append(base.step)
            raise RuntimeError("device copy failed")
        return real(self, base, on_device)
    monkeypatch.setattr(BaseStager, "settle", failing)
    model, opt = _objects(warm=True)
    ckpt = DiffCheckpointer(tmp_path / "log", model, opt, snapshot_every=2,
                            exact_bases=True)
    area = ckpt._out.stager.area
    with pytest.raises(RuntimeError, match="device copy failed"):
        for _t in range(1, 5):
            opt.zero_grad()
            model(torch.randn(4, 64)).pow(2).mean().backward()
            opt.step()
    assert failed == [2]
    assert area._slots
    assert not any(s.busy for s in area._slots)  # (main: busy for good)
    ckpt._detach()
    ckpt._out.sink.close_quietly()
